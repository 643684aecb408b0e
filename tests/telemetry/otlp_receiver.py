"""A minimal OTLP/HTTP trace receiver for keel's telemetry tests.

Listens on 127.0.0.1 (an ephemeral port, printed as `listening PORT`),
decodes each `POST /v1/traces` body with the official protobuf classes of
the `opentelemetry-proto` package, and prints every span as one JSON line
on stdout *before* answering 200, so once the exporter has its answer the
span is on stdout. It stops when its stdin closes.

Exits 3 with a message on stderr when `opentelemetry-proto` is missing.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
except ImportError:
    sys.stderr.write(
        "the telemetry test needs the opentelemetry-proto Python package "
        "(python3 -m pip install opentelemetry-proto; .ci/run does it)\n"
    )
    sys.exit(3)

OUT = threading.Lock()


def value(v):
    """An AnyValue as a plain JSON value."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind is None:
        return None
    return getattr(v, kind)


def attributes(kvs):
    return {kv.key: value(kv.value) for kv in kvs}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (the http.server name)
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces":
            self.send_response(404)
            self.end_headers()
            return
        if self.headers.get("content-type") != "application/x-protobuf":
            self.send_response(415)
            self.end_headers()
            return
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        lines = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    lines.append(
                        json.dumps(
                            {
                                "service": resource.get("service.name"),
                                "header": self.headers.get("x-keel-test"),
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent_span_id": s.parent_span_id.hex(),
                                "name": s.name,
                                "kind": s.kind,
                                "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano,
                                "status": s.status.code,
                                "attributes": attributes(s.attributes),
                                "links": [
                                    {
                                        "trace_id": link.trace_id.hex(),
                                        "span_id": link.span_id.hex(),
                                    }
                                    for link in s.links
                                ],
                            }
                        )
                    )
        with OUT:
            for line in lines:
                sys.stdout.write(line + "\n")
            sys.stdout.flush()
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdout.write(f"listening {server.server_address[1]}\n")
    sys.stdout.flush()
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
