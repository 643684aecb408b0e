#!/usr/bin/env python3
"""Parses Prometheus text (stdin) with the official prometheus-client
package's parser and prints it as JSON: {family: {"type", "help",
"samples": [{"name", "labels", "value"}]}}. Used by keel-e2e's metrics test;
exits 2 with a message when prometheus_client is not installed."""

import json
import sys

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    sys.stderr.write("prometheus_client is not installed (pip install prometheus-client, see .ci/run)\n")
    sys.exit(2)

families = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    families[family.name] = {
        "type": family.type,
        "help": family.documentation,
        "samples": [
            {"name": s.name, "labels": dict(s.labels), "value": s.value} for s in family.samples
        ],
    }
json.dump(families, sys.stdout, sort_keys=True)
