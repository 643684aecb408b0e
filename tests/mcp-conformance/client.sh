#!/usr/bin/env bash
# Drives keel's MCP client through the conformance suite's client
# scenarios: the suite starts a test server, appends its URL to this
# command and names the scenario in MCP_CONFORMANCE_SCENARIO. KEEL_BIN is
# the keel binary. Each scenario is one `keel mcp` command against a
# keel.toml naming the server.
set -euo pipefail
url="${*: -1}"
keel="${KEEL_BIN:?KEEL_BIN names the keel binary}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cat >"$dir/keel.toml" <<TOML
[mcp.conformance]
url = "$url"
timeout_secs = 10
TOML
case "${MCP_CONFORMANCE_SCENARIO:-}" in
  initialize) exec "$keel" mcp list --data-dir "$dir" ;;
  tools_call) exec "$keel" mcp call --data-dir "$dir" conformance add_numbers '{"a": 2, "b": 3}' ;;
  sse-retry) exec "$keel" mcp call --data-dir "$dir" conformance test_reconnection '{}' ;;
  *)
    echo "client.sh: keel's MCP client has no command for scenario ${MCP_CONFORMANCE_SCENARIO:-?}" >&2
    exit 1
    ;;
esac
