//! The rows of the `[telemetry]` and `[mcp.NAME]` sections.

use super::*;

/// The `[telemetry]` rows (docs/TELEMETRY.md tells the rest).
pub(super) fn telemetry_rows(rows: &mut Rows) {
    let text = |rows: &mut Rows, key: &str, default: &str, doc: String| {
        rows.0.push((key.to_owned(), Some(default.to_owned()), doc));
    };
    let code = |rows: &mut Rows, key: &str, doc: String| {
        rows.0.push((key.to_owned(), None, doc));
    };
    text(
        rows,
        "telemetry.otlp_endpoint",
        "unset: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, else off",
        "Base URL of an OTLP/HTTP (protobuf) collector, e.g. `http://127.0.0.1:4318`; \
         `keel serve` exports its traces to `<URL>/v1/traces` (docs/TELEMETRY.md). It wins \
         over the `OTEL_EXPORTER_OTLP_*` endpoint variables, which alone also turn export \
         on; `OTEL_SDK_DISABLED=true` turns it off. An unreachable collector never slows \
         a turn: spans wait in a bounded queue and those that do not fit are dropped and \
         counted."
            .into(),
    );
    text(
        rows,
        "telemetry.headers_env",
        "unset: no extra headers",
        "Environment variable holding headers sent with every export (`key=value,key2=value2`, \
         e.g. a collector's API key), besides `OTEL_EXPORTER_OTLP_HEADERS`; `keel serve` \
         refuses to start when the variable it names is not set."
            .into(),
    );
    text(
        rows,
        "telemetry.service_name",
        "unset: `OTEL_SERVICE_NAME`, else `keel`",
        "The `service.name` resource attribute of the exported spans \
         (`OTEL_RESOURCE_ATTRIBUTES` adds others)."
            .into(),
    );
    code(
        rows,
        "telemetry.sampling_ratio",
        "Share of traces recorded, 0.0..=1.0, decided per root turn or background run \
         (its model calls, tool calls and foreground runs follow it)."
            .into(),
    );
    code(
        rows,
        "telemetry.record_content",
        "Whether spans carry message content: a turn's input, model answers, tool arguments \
         and results. Off, spans hold names, ids, token counts, durations and outcomes only."
            .into(),
    );
}

/// The `[mcp.NAME]` rows (no server exists by default).
pub(super) fn mcp_rows(rows: &mut Rows) {
    let mut text = |key: &str, default: &str, doc: String| {
        rows.0
            .push((format!("mcp.NAME.{key}"), Some(default.to_owned()), doc));
    };
    text(
        "command",
        "one of `command` or `url` is required",
        "A stdio MCP server: the program keel starts (looked up in `PATH`) when it \
         activates (`keel serve`, `chat`), under the shell tool's Landlock confinement. `NAME` matches `[a-z][a-z0-9_-]`, at most 32 \
         characters. Its tools reach the model as `mcp__NAME__TOOL`; agent definitions list them \
         as `mcp:NAME/TOOL` or `mcp:NAME/*`."
            .into(),
    );
    text("args", "`[]`", "stdio: the program's arguments.".into());
    text(
        "env",
        "`[]`",
        "stdio: names of environment variables passed to the server besides `PATH`, `HOME`, \
         `LANG` and `TERM`; the rest of keel's environment is cleared. Variables holding keel's \
         own keys are refused."
            .into(),
    );
    text(
        "cwd",
        "unset: the workspace root",
        "stdio: the server's working directory (relative to this file). A confined server \
         reads and writes only in the workspace and its private `TMPDIR`, and reads and \
         executes in `tools.shell_read_paths`."
            .into(),
    );
    text(
        "network",
        "`false`",
        "stdio: let the confined server open TCP connections and listen (Landlock ABI 4).".into(),
    );
    text(
        "unsandboxed",
        "`false`",
        "stdio: on a kernel without Landlock, run the server unconfined (a start-up notice \
         says so) instead of refusing to start it."
            .into(),
    );
    text(
        "url",
        "one of `command` or `url` is required",
        "A Streamable HTTP MCP server: its endpoint (`http://` or `https://`).".into(),
    );
    text(
        "headers_env",
        "`{}`",
        "Streamable HTTP: header name → the environment variable holding its value (e.g. \
         `{ Authorization = \"DOCS_TOKEN\" }`); each must be set. Values are never written in \
         the file."
            .into(),
    );
    text(
        "tools",
        "unset: every tool of the server",
        "The server's tools agents may use (MCP tool names); the others are not registered.".into(),
    );
    text(
        "approval",
        "`\"always\"`",
        "Whether calls of the server's tools wait for a person's approval (`always`) or run \
         unasked (`never`); see docs/PROTOCOL.md, Approvals. A foreground sub-agent run cannot \
         wait for a decision, so a gated tool called inside one is refused."
            .into(),
    );
    text(
        "delegatable",
        "`false`",
        "Whether agents that are delegated to may list the server's tools; `false` keeps them \
         for the root agent and agents nobody delegates to."
            .into(),
    );
    text(
        "timeout_secs",
        &format!("`{DEFAULT_MCP_TIMEOUT_SECS}`"),
        format!(
            "Seconds one tool call, and connecting at start-up, may take, \
             1..={MAX_MCP_TIMEOUT_SECS}; a call past it is cancelled and the model told."
        ),
    );
    text(
        "max_output_bytes",
        &format!("`{DEFAULT_MCP_MAX_OUTPUT_BYTES}`"),
        format!(
            "Bytes of one tool result the model reads, \
             {MIN_MCP_MAX_OUTPUT_BYTES}..={MAX_MCP_MAX_OUTPUT_BYTES}; the rest is cut with a note."
        ),
    );
}
