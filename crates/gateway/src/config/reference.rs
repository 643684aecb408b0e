//! The key reference: every `keel.toml` key with its default and meaning,
//! kept next to the structs and rendered verbatim into docs/CONFIG.md.
//!
//! Defaults shown for keys that `Config::default()` writes are read from that
//! value itself, and caps from the constants, so the table cannot drift from
//! the code; tests check that every key is documented and vice versa.

use std::collections::BTreeMap;

use keel_providers::{
    DEFAULT_CONNECT_TIMEOUT_SECS, DEFAULT_CONTEXT_WINDOW_TOKENS, DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MAX_RETRIES, DEFAULT_MAX_TOOL_ARGUMENT_BYTES, DEFAULT_READ_TIMEOUT_SECS,
    DEFAULT_TOTAL_TIMEOUT_SECS, MAX_CONNECT_TIMEOUT_SECS, MAX_CONTEXT_WINDOW_TOKENS,
    MAX_READ_TIMEOUT_SECS, MAX_RESPONSE_BYTES_CAP, MAX_RETRIES_CAP, MAX_TOOL_ARGUMENT_BYTES_CAP,
    MAX_TOTAL_TIMEOUT_SECS, MIN_CONTEXT_WINDOW_TOKENS,
};

use super::*;

mod sections;
use sections::{mcp_rows, telemetry_rows};

/// One documented key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDoc {
    /// Dotted key path; provider keys are spelled `providers.NAME.<key>`.
    pub key: String,
    /// The default, as Markdown (a TOML value in backticks, or prose when unset).
    pub default: String,
    /// What the key means, with its accepted range.
    pub doc: String,
}

/// A complete `keel.toml` that sets every key (values are the defaults where
/// there is one); rendered into docs/CONFIG.md and parsed by the tests.
pub const EXAMPLE_TOML: &str = r#"# Where the database lives (relative paths are relative to this file).
data_dir = ".keel"
# What `llm_profile: default` means: required when several profiles exist.
default_profile = "main"
agents_dir = "agents"
skills_dir = "skills"
root_delegates = ["researcher", "reviewer"]
root_max_output_tokens = 4096
workspace_root = "."

# An OpenAI-compatible endpoint; the key is read from $OPENAI_API_KEY.
[providers.main]
kind = "openai"
base_url = "https://api.openai.com/v1"
model = "gpt-4o-mini"
api_key_env = "OPENAI_API_KEY"
connect_timeout_secs = 10
read_timeout_secs = 120
max_retries = 3
max_tokens = 4096
max_response_bytes = 33554432
max_tool_argument_bytes = 4194304
total_timeout_secs = 600
context_window_tokens = 128000
# USD per million tokens, for cost budgets (unset: unpriced).
price_input_per_mtok = 0.15
price_output_per_mtok = 0.6
# false: the model takes text only; messages with images are refused.
images = true

# keel's deterministic scripted provider (no network).
[providers.offline]
kind = "scripted"
script = "scripts/demo.yaml"
price_input_per_mtok = 0.0
price_output_per_mtok = 0.0

[session]
ttl_hours = 24
cleanup_interval_minutes = 60
auto_title_after_n_messages = 10
auto_checkpoint = true
turn_timeout_secs = 900
# Unset by default: no limit.
max_cost_usd_per_dialog = 5.0

[session.summary]
enabled = true
trigger_ratio = 0.75
debounce_turns = 3

[session.retention]
keep_checkpoints = 100
purge_deleted_after_days = 30

[storage]
# A PostgreSQL database instead of the data directory's SQLite file.
url = "postgres://keel@db.internal/keel?sslmode=require"
max_connections = 16
lease_secs = 10
lease_linger_ms = 100
synchronous = "normal"
retry_delays_ms = [100, 200, 300]
busy_timeout_ms = 5000

[tools]
enable_write = false
enable_shell = false
shell_timeout_secs = 30
shell_env = []
shell_read_paths = ["/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/etc", "/opt", "/dev", "/proc"]
shell_network = false
shell_unsandboxed = false
approval_default = "always"
approval_timeout_secs = 86400
approval_supersede_reason = "superseded by new input"

# Per tool: "always" (every call waits for a person) or "never".
[tools.approval]
shell = "always"
write_file = "always"

[orchestration]
max_tree_depth = 3
max_runs_per_tree = 16
max_concurrent_runs = 32
max_concurrent_runs_per_session = 8
max_concurrent_provider_steps = 8
max_concurrent_provider_steps_per_session = 4
max_concurrent_tool_steps = 16
max_concurrent_tool_steps_per_session = 8
max_pending_inbox_events_per_session = 64
inbox_event_ttl_hours = 168
max_inbox_delivery_attempts = 5
max_user_turn_burst_before_inbox = 3
max_inbox_wait_secs = 30
default_run_timeout_secs = 600
max_children_per_call = 8
# Unset by default: no limit.
max_cost_usd_per_root_turn = 1.0

[server]
bind = "127.0.0.1:7420"
token_env = "KEEL_TOKEN"
shutdown_grace_secs = 30
allowed_origins = []
# Unset by default: derived from the open-file limit (768 at 1024).
max_connections = 768
header_timeout_secs = 10
body_timeout_secs = 60
idle_timeout_secs = 60
stream_replay_secs = 300
stream_replay_bytes = 1048576
webhook_urls = []
webhook_secret_env = "KEEL_WEBHOOK_SECRET"
webhook_max_attempts = 8
webhook_retry_base_ms = 1000
image_max_bytes = 5242880
images_per_message = 8

# An MCP server keel starts as a child process and talks to over stdio.
[mcp.files]
command = "npx"
args = ["-y", "@modelcontextprotocol/server-filesystem", "."]
env = ["NPM_CONFIG_CACHE"]
cwd = "."
network = false
unsandboxed = false
tools = ["read_text_file", "list_directory"]
delegatable = false
timeout_secs = 30
max_output_bytes = 65536

# An MCP server reached over Streamable HTTP; the token is read from $DOCS_TOKEN.
[mcp.docs]
url = "https://mcp.example.com/mcp"
headers_env = { Authorization = "DOCS_TOKEN" }

# Traces to an OpenTelemetry collector (docs/TELEMETRY.md); off unless an
# endpoint is set here or in OTEL_EXPORTER_OTLP_ENDPOINT.
[telemetry]
otlp_endpoint = "http://127.0.0.1:4318"
headers_env = "KEEL_OTLP_HEADERS"
service_name = "keel"
sampling_ratio = 1.0
record_content = false
"#;

/// Rows of [`reference`] before defaults are filled in: key, default text
/// (`None`: read from `Config::default()`), meaning.
struct Rows(Vec<(String, Option<String>, String)>);

/// Every key of `keel.toml`, in file order, with its default and meaning.
pub fn reference() -> Vec<KeyDoc> {
    let mut rows = Rows(Vec::new());
    let text = |rows: &mut Rows, key: &str, default: &str, doc: String| {
        rows.0.push((key.to_owned(), Some(default.to_owned()), doc));
    };
    let code = |rows: &mut Rows, key: &str, doc: String| {
        rows.0.push((key.to_owned(), None, doc));
    };
    text(
        &mut rows,
        "data_dir",
        "unset: `--data-dir`, else `$KEEL_DATA_DIR`, else `.keel`",
        "Directory of the database (`keel.db`) and, by default, of `agents/`. \
         `--data-dir` overrides it. Without `--config`, `keel.toml` itself is looked up \
         in `--data-dir`, else `$KEEL_DATA_DIR`, else `.keel`."
            .into(),
    );
    text(
        &mut rows,
        "default_profile",
        "unset",
        "The profile `llm_profile: default` means. Required when several \
         `[providers.NAME]` exist and none is named `default`; with one profile, \
         `default` is that one; with none, `default` is the built-in offline model."
            .into(),
    );
    text(
        &mut rows,
        "agents_dir",
        "unset: `<data_dir>/agents` if it exists",
        "Directory of agent definitions (Markdown with frontmatter); must exist when set. \
         `keel serve` reads it again on SIGHUP or `POST /api/admin/reload`."
            .into(),
    );
    text(
        &mut rows,
        "skills_dir",
        "unset: `<data_dir>/skills` if it exists",
        "Directory of skills (`*.md` with `name` and `description` frontmatter; the body is \
         the skill). The root agent may load every skill, another agent those its `skills:` \
         lists; must exist when set."
            .into(),
    );
    code(
        &mut rows,
        "root_delegates",
        "Agent ids the root agent may delegate to. Read at start: a catalog reload keeps \
         them, and is refused when one of them is no longer defined."
            .into(),
    );
    let output_bound = keel_catalog::MAX_OUTPUT_TOKENS_BOUND;
    code(
        &mut rows,
        "root_max_output_tokens",
        format!(
            "Output token cap of each model call of the root agent, {}..={}.",
            output_bound.min, output_bound.max
        ),
    );
    text(
        &mut rows,
        "workspace_root",
        "unset: the current directory",
        "Directory the file tools are confined to; must exist when set.".into(),
    );
    text(
        &mut rows,
        "providers.NAME.kind",
        "required",
        "Wire protocol: `openai` (any OpenAI-compatible API), `anthropic` or \
         `scripted` (offline, deterministic)."
            .into(),
    );
    text(
        &mut rows,
        "providers.NAME.base_url",
        "the kind's public API",
        "API root, e.g. `http://127.0.0.1:11434/v1` for Ollama. Not for `scripted`.".into(),
    );
    text(
        &mut rows,
        "providers.NAME.model",
        "required, except for `scripted`",
        "Model identifier sent to the API.".into(),
    );
    text(
        &mut rows,
        "providers.NAME.api_key_env",
        "`OPENAI_API_KEY` / `ANTHROPIC_API_KEY` with the default `base_url`; none otherwise",
        "Environment variable holding the API key; it must be set. Keys are never \
         written in the file."
            .into(),
    );
    let connect = format!("`{DEFAULT_CONNECT_TIMEOUT_SECS}`");
    text(
        &mut rows,
        "providers.NAME.connect_timeout_secs",
        &connect,
        format!("Seconds to establish a connection, 1..={MAX_CONNECT_TIMEOUT_SECS}."),
    );
    let read = format!("`{DEFAULT_READ_TIMEOUT_SECS}`");
    text(
        &mut rows,
        "providers.NAME.read_timeout_secs",
        &read,
        format!(
            "Longest silence, in seconds, before a response or its next chunk, \
             1..={MAX_READ_TIMEOUT_SECS}."
        ),
    );
    let retries = format!("`{DEFAULT_MAX_RETRIES}`");
    text(
        &mut rows,
        "providers.NAME.max_retries",
        &retries,
        format!("Retries on 429/5xx/connection errors before any output, 0..={MAX_RETRIES_CAP}."),
    );
    text(
        &mut rows,
        "providers.NAME.max_tokens",
        "unset",
        "Output token cap when a request sets none (Anthropic then uses 4096).".into(),
    );
    let response_bytes = format!("`{DEFAULT_MAX_RESPONSE_BYTES}` (32 MiB)");
    text(
        &mut rows,
        "providers.NAME.max_response_bytes",
        &response_bytes,
        format!(
            "Most bytes of one model response (event-stream framing included); a longer \
             response fails the call, 1024..={MAX_RESPONSE_BYTES_CAP}."
        ),
    );
    let argument_bytes = format!("`{DEFAULT_MAX_TOOL_ARGUMENT_BYTES}` (4 MiB)");
    text(
        &mut rows,
        "providers.NAME.max_tool_argument_bytes",
        &argument_bytes,
        format!(
            "Most bytes of tool-call arguments in one model response, over all its calls, \
             1..={MAX_TOOL_ARGUMENT_BYTES_CAP}."
        ),
    );
    let total = format!("`{DEFAULT_TOTAL_TIMEOUT_SECS}`");
    text(
        &mut rows,
        "providers.NAME.total_timeout_secs",
        &total,
        format!(
            "Longest time, in seconds, one model call may take from the first request to \
             the end of the answer, retries included, 1..={MAX_TOTAL_TIMEOUT_SECS}."
        ),
    );
    let window = format!(
        "known for well-known models (e.g. `gpt-4o` 128000, `claude-*` 200000), else \
         `{DEFAULT_CONTEXT_WINDOW_TOKENS}`"
    );
    text(
        &mut rows,
        "providers.NAME.context_window_tokens",
        &window,
        format!(
            "The model's context window in tokens. Requests are kept under it by \
             compacting older history into a summary (tokens are estimated, see \
             docs/ARCHITECTURE.md), \
             {MIN_CONTEXT_WINDOW_TOKENS}..={MAX_CONTEXT_WINDOW_TOKENS}."
        ),
    );
    text(
        &mut rows,
        "providers.NAME.script",
        "unset: the offline echo model",
        "For `scripted`: a YAML/JSON script file.".into(),
    );
    text(
        &mut rows,
        "providers.NAME.price_input_per_mtok",
        "unset: the profile is unpriced",
        "USD per million prompt tokens (a finite number, 0 or more); set it together \
         with `price_output_per_mtok`. Prices turn a call's reported usage into its cost \
         for cost budgets: `limits.max_cost_usd` of a definition needs them on every \
         profile its run tree may use, `session.max_cost_usd_per_dialog` and \
         `orchestration.max_cost_usd_per_root_turn` on every profile, or keel refuses \
         to start, naming the key."
            .into(),
    );
    text(
        &mut rows,
        "providers.NAME.price_output_per_mtok",
        "unset: the profile is unpriced",
        "USD per million completion tokens (a finite number, 0 or more).".into(),
    );
    code(
        &mut rows,
        "providers.NAME.images",
        "Whether the model takes images in user messages; `false` marks it text-only: a \
         message with images to a dialog whose agent uses it is refused (400 over the API, \
         before anything is stored)."
            .into(),
    );

    code(
        &mut rows,
        "session.ttl_hours",
        format!(
            "Hours an idle session stays in memory (the database keeps it), \
             1..={MAX_SESSION_TTL_HOURS}."
        ),
    );
    code(
        &mut rows,
        "session.cleanup_interval_minutes",
        format!(
            "Minutes between two sweeps of idle sessions, and between two retention \
             passes (`session.retention`), 1..={MAX_CLEANUP_INTERVAL_MINUTES}."
        ),
    );
    code(
        &mut rows,
        "session.auto_title_after_n_messages",
        format!(
            "Generate a title after this many user messages while the title is the \
             default; 0 disables, at most {MAX_AUTO_TITLE_AFTER_N_MESSAGES}."
        ),
    );
    code(
        &mut rows,
        "session.auto_checkpoint",
        "Checkpoint after every committed turn.".into(),
    );
    code(
        &mut rows,
        "session.turn_timeout_secs",
        format!(
            "Seconds a root turn (a user's or a continuation's) may run, counted from \
             when it starts, not while it waits in the queue; past it the turn is stopped \
             and fails `timed_out`, the user's message kept, marked unanswered. \
             1..={MAX_TURN_TIMEOUT_SECS}; there is no \"no deadline\"."
        ),
    );
    text(
        &mut rows,
        "session.max_cost_usd_per_dialog",
        "unset: no limit",
        "USD one dialog may spend on model calls, its turns and all its runs \
         (background ones included), above 0; every profile needs prices. The spend is \
         stored call by call and is not given back by a restart or a rollback. Before a \
         model call the request's estimated input tokens are reserved at its profile's \
         input price; a call that would pass the budget is not made and the turn fails \
         (the run ends `budget_exhausted`). Titles and summaries are not counted."
            .into(),
    );
    code(
        &mut rows,
        "session.summary.enabled",
        "Summarize long contexts after a turn, in the background, before a request \
         needs it (a request that would not fit the context window is compacted \
         before it is sent either way)."
            .into(),
    );
    code(
        &mut rows,
        "session.summary.trigger_ratio",
        "Summarize when the context exceeds this share of the budget (the profile's \
         `context_window_tokens` less the output cap), in (0, 1]."
            .into(),
    );
    code(
        &mut rows,
        "session.summary.debounce_turns",
        format!(
            "Turns between two automatic summaries of a session, 1..={MAX_SUMMARY_DEBOUNCE_TURNS}."
        ),
    );

    code(
        &mut rows,
        "session.retention.keep_checkpoints",
        format!(
            "Turn checkpoints kept per dialog, newest first; older ones are pruned in the \
             background off the turn path and by `keel prune`. Manual, rollback and fork \
             checkpoints, the checkpoints a rollback or fork started from, and the history \
             a head still shows are always kept. 0 keeps all, at most {MAX_KEEP_CHECKPOINTS}."
        ),
    );
    code(
        &mut rows,
        "session.retention.purge_deleted_after_days",
        format!(
            "Days a deleted dialog is kept; after that it and all its rows (messages, \
             checkpoints, state, runs and their inbox events) are removed for good, in the \
             background off the turn path and by `keel prune`. The history another dialog \
             was forked from stays until that dialog is purged too. 0 keeps deleted dialogs \
             forever, at most {MAX_PURGE_DELETED_AFTER_DAYS}."
        ),
    );

    text(
        &mut rows,
        "storage.url",
        "unset (SQLite)",
        "A PostgreSQL database, `postgres://USER[:PASSWORD]@HOST[:PORT]/DB[?sslmode=…]` \
         (or libpq's key=value form), instead of the data directory's SQLite file. \
         `KEEL_DATABASE_URL` wins over it (so a password need not be in a file). \
         `sslmode` is `disable`, `prefer` (default) or `require`; with TLS the server's \
         certificate is always verified against the system's roots. keel migrates the \
         database on start (`keel migrate` does it alone); see docs/DEPLOY.md."
            .into(),
    );
    text(
        &mut rows,
        "storage.max_connections",
        "unset: twice the CPUs and two, at most 16",
        format!(
            "Most connections to PostgreSQL this process opens, 1..={MAX_PG_CONNECTIONS} \
             (PostgreSQL only). More than the server's cores can run only make its \
             backends take turns; with several processes, keep their sum near what one \
             would use (docs/DEPLOY.md)."
        ),
    );
    code(
        &mut rows,
        "storage.lease_secs",
        format!(
            "Seconds a `keel serve` on PostgreSQL stays registered without renewing \
             ({MIN_LEASE_SECS}..={MAX_LEASE_SECS}; it renews every third of it). When a \
             process dies, another takes over its runs, dialogs and queued messages this long \
             after its last renewal; a process that could not renew for this long is taken \
             over and stops (PostgreSQL only)."
        ),
    );
    code(
        &mut rows,
        "storage.lease_linger_ms",
        format!(
            "Milliseconds a dialog's lease, and its worker, stay with the process that ran its \
             last turn, 0..={MAX_LEASE_LINGER_MS} (PostgreSQL only). Its next turn there (the \
             user's next message, a continuation) starts without asking the database; a request \
             for it that another process receives waits up to this much longer. 0 gives the \
             lease back as each turn ends."
        ),
    );
    code(
        &mut rows,
        "storage.synchronous",
        "`normal`: a commit survives a process crash, power loss may drop the last few; \
         `full`: every commit is fsynced (SQLite only: PostgreSQL's durability is the \
         server's `synchronous_commit`)."
            .into(),
    );
    code(
        &mut rows,
        "storage.retry_delays_ms",
        format!(
            "Delays between retries of a transient write failure (its length is the retry \
             count): 1..={MAX_RETRY_ATTEMPTS} entries, each 0..={MAX_RETRY_DELAY_MS} (SQLite \
             only: PostgreSQL retries a serialization failure or a connection lost before COMMIT \
             up to 20 times, backing off from 1 ms to 2 s)."
        ),
    );
    code(
        &mut rows,
        "storage.busy_timeout_ms",
        format!(
            "Milliseconds SQLite waits on a lock before reporting busy, 0..={MAX_BUSY_TIMEOUT_MS}."
        ),
    );

    code(
        &mut rows,
        "tools.enable_write",
        "Register `write_file` (root agent only).".into(),
    );
    code(
        &mut rows,
        "tools.enable_shell",
        "Register `shell` (root agent only). Its commands run under Landlock (see docs/SECURITY.md); \
         keel's data directory and configuration file must then lie outside `workspace_root` and \
         `tools.shell_read_paths`, or start-up fails."
            .into(),
    );
    code(
        &mut rows,
        "tools.shell_timeout_secs",
        format!("Default and maximum run time of a shell command, 1..={MAX_SHELL_TIMEOUT_SECS}."),
    );
    code(
        &mut rows,
        "tools.shell_env",
        "Environment variables passed from keel's environment to shell commands, besides `PATH`, \
         `HOME`, `LANG` and `TERM` (everything else is cleared; `TMPDIR` is a private directory). \
         Provider key variables and `server.token_env` are refused."
            .into(),
    );
    code(
        &mut rows,
        "tools.shell_read_paths",
        "Trees shell commands may read and execute from, besides the workspace (which they may also \
         write) and their temporary directory. Missing paths are skipped."
            .into(),
    );
    code(
        &mut rows,
        "tools.shell_network",
        "Allow shell commands to open TCP connections and listen (Landlock ABI 4+; UDP is never \
         restricted)."
            .into(),
    );
    code(
        &mut rows,
        "tools.shell_unsandboxed",
        "On a kernel without Landlock, run shell commands unconfined instead of refusing them."
            .into(),
    );

    code(
        &mut rows,
        "tools.approval_default",
        "`\"always\"` or `\"never\"`: whether calls of `shell` and `write_file`, when enabled, \
         wait for a person's approval unless `[tools.approval]` names them. Other tools run \
         unasked unless `[tools.approval]` or the agent's `approval:` gates them."
            .into(),
    );
    code(
        &mut rows,
        "tools.approval_timeout_secs",
        format!(
            "Seconds a tool call waits for a decision before it expires as a denial, \
             1..={MAX_APPROVAL_TIMEOUT_SECS}."
        ),
    );
    code(
        &mut rows,
        "tools.approval_supersede_reason",
        format!(
            "The reason a pending approval is denied with when the user sends new input; the \
             model reads it as the call's result. 1..={MAX_SUPERSEDE_REASON_BYTES} bytes, not \
             blank."
        ),
    );
    code(
        &mut rows,
        "tools.approval",
        format!(
            "A table `NAME = \"always\"` or `NAME = \"never\"`: whether calls of the tool NAME wait \
             for a person's approval (unset: `shell` and `write_file` follow \
             `tools.approval_default`, other tools run unasked). NAME is one of: {}. Applies to \
             root turns and background runs (which wait for the decision); a foreground \
             sub-agent run refuses a gated call (its caller waits on it).",
            APPROVABLE_TOOLS.join(", ")
        ),
    );

    let depth_cap = keel_catalog::MAX_DELEGATION_DEPTH_CAP;
    let orchestration: [(&str, String); 15] = [
        (
            "max_tree_depth",
            format!("Longest delegation chain below the root agent, 1..={depth_cap}."),
        ),
        (
            "max_runs_per_tree",
            format!("Runs one root turn's tree may create in total, 1..={MAX_RUNS_PER_TREE_CAP}."),
        ),
        (
            "max_concurrent_runs",
            format!("Non-terminal runs across all sessions, 1..={MAX_CONCURRENT_RUNS_CAP}."),
        ),
        (
            "max_concurrent_runs_per_session",
            "Non-terminal runs within one session; at most `max_concurrent_runs`.".into(),
        ),
        (
            "max_concurrent_provider_steps",
            format!(
                "Provider calls in flight across all sessions, 1..={MAX_CONCURRENT_STEPS_CAP}."
            ),
        ),
        (
            "max_concurrent_provider_steps_per_session",
            "Provider calls in flight within one session; at most \
             `max_concurrent_provider_steps`."
                .into(),
        ),
        (
            "max_concurrent_tool_steps",
            format!("Tool calls in flight across all sessions, 1..={MAX_CONCURRENT_STEPS_CAP}."),
        ),
        (
            "max_concurrent_tool_steps_per_session",
            "Tool calls in flight within one session; at most `max_concurrent_tool_steps`.".into(),
        ),
        (
            "max_pending_inbox_events_per_session",
            format!(
                "Undelivered completions and signals one session may hold; more background \
                 runs and signals are refused, 1..={MAX_PENDING_INBOX_EVENTS_CAP}."
            ),
        ),
        (
            "inbox_event_ttl_hours",
            format!(
                "Hours an undelivered inbox event is kept before it is dead-lettered, \
                 1..={MAX_INBOX_EVENT_TTL_HOURS}."
            ),
        ),
        (
            "max_inbox_delivery_attempts",
            format!(
                "Failed deliveries of one inbox event before it is dead-lettered, \
                 1..={MAX_INBOX_DELIVERY_ATTEMPTS_CAP}."
            ),
        ),
        (
            "max_user_turn_burst_before_inbox",
            format!(
                "User turns in a row before a pending inbox event gets its continuation \
                 turn, 1..={MAX_USER_TURN_BURST_CAP}."
            ),
        ),
        (
            "max_inbox_wait_secs",
            format!(
                "Seconds a pending inbox event may wait before the next turn is a \
                 continuation, 1..={MAX_INBOX_WAIT_SECS_CAP}."
            ),
        ),
        (
            "default_run_timeout_secs",
            format!(
                "Deadline of a run whose definition sets no `limits.timeout_secs`, \
                 1..={MAX_RUN_TIMEOUT_SECS}."
            ),
        ),
        (
            "max_children_per_call",
            format!(
                "Children one `delegate` call may start at once, 1..={MAX_CHILDREN_PER_CALL_CAP}."
            ),
        ),
    ];
    for (name, doc) in orchestration {
        code(&mut rows, &format!("orchestration.{name}"), doc);
    }
    text(
        &mut rows,
        "orchestration.max_cost_usd_per_root_turn",
        "unset: no limit",
        "USD one root turn may spend on model calls, with the foreground runs it \
         delegates (background runs count against the dialog only), above 0; every \
         profile needs prices. Each turn starts with the whole amount."
            .into(),
    );

    code(
        &mut rows,
        "server.bind",
        "Address `keel serve` listens on (`--bind` overrides it); loopback by default. \
         A non-loopback address is refused unless a token is set."
            .to_owned(),
    );
    code(
        &mut rows,
        "server.token_env",
        "Environment variable holding the bearer token every `/api` request must present \
         (`Authorization: Bearer …`); unset or empty: no token, loopback only."
            .to_owned(),
    );
    code(
        &mut rows,
        "server.shutdown_grace_secs",
        format!(
            "Seconds a shutdown (SIGTERM, Ctrl-C) lets running turns finish before cancelling \
             them (a cancelled turn saves nothing), 0..={MAX_SHUTDOWN_GRACE_SECS}."
        ),
    );
    code(
        &mut rows,
        "server.allowed_origins",
        "Origins (`https://keel.example.com`: scheme, host, optional port) under which \
         browsers reach the server besides its own address, e.g. through a reverse proxy: \
         their pages may use the API and their hosts are accepted in `Host`. Without it \
         only IP addresses and `localhost` are, and only pages the server itself served. \
         No CORS headers are sent."
            .to_owned(),
    );
    text(
        &mut rows,
        "server.max_connections",
        "unset: derived from the open-file limit",
        format!(
            "Connections open at once, 1..={MAX_CONNECTIONS_CAP}. `keel serve` raises its soft \
             open-file limit to the hard one at start-up; unset, the bound is that limit less an \
             eighth and 128 files for the database, providers and tools (768 at a limit of 1024), \
             at most 16384. When every connection is taken, the oldest with no request in flight \
             is closed for the new one; when all are busy, the new one is closed at once."
        ),
    );
    code(
        &mut rows,
        "server.header_timeout_secs",
        format!(
            "Seconds an HTTP/1 client has to send a request head before its connection is \
             closed, 1..={MAX_CLIENT_TIMEOUT_SECS}; it also bounds how long a keep-alive \
             connection waits for its next request. (An HTTP/2 connection that completes no \
             request is closed by `server.idle_timeout_secs`.)"
        ),
    );
    code(
        &mut rows,
        "server.body_timeout_secs",
        format!(
            "Seconds a client has to send a request body, from the end of its head \
             (answered 400 when late), 1..={MAX_CLIENT_TIMEOUT_SECS}."
        ),
    );
    code(
        &mut rows,
        "server.idle_timeout_secs",
        format!(
            "Seconds a connection (HTTP/1 or HTTP/2) may stay open with no request in flight, \
             1..={MAX_CLIENT_TIMEOUT_SECS}. A WebSocket or a streamed answer is in flight; a \
             WebSocket that sends nothing for this long, not even the pong to the ping the \
             server sends halfway, is closed with 1008."
        ),
    );
    code(
        &mut rows,
        "server.stream_replay_secs",
        format!(
            "Seconds each dialog's turn frames are kept, 0..={MAX_STREAM_REPLAY_SECS}, so a \
             client that reconnects (`Last-Event-ID`, `resume_from`) gets every frame it missed; \
             asking for older ones gets a `replay_gap`. 0 keeps nothing."
        ),
    );
    code(
        &mut rows,
        "server.stream_replay_bytes",
        format!(
            "Bytes (about) of turn frames kept per dialog, 4096..={MAX_STREAM_REPLAY_BYTES}; the \
             oldest go first."
        ),
    );
    code(
        &mut rows,
        "server.webhook_urls",
        format!(
            "http(s) URLs (at most {MAX_WEBHOOK_URLS}) every committed turn that answers a message, and every background run's end, is POSTed to, signed (see PROTOCOL.md, Webhooks), besides the `webhook` a send names. Delivered at least once from the store's outbox."
        ),
    );
    code(
        &mut rows,
        "server.image_max_bytes",
        format!(
            "Largest image of a message, in bytes once decoded, 1..={MAX_IMAGE_BYTES}; a larger \
             one is refused with 413."
        ),
    );
    code(
        &mut rows,
        "server.webhook_secret_env",
        "Environment variable holding the webhook signing secret (`whsec_` + base64, or any \
         text, used as bytes). `keel serve` refuses to start with `webhook_urls` set and it \
         unset; a send naming a `webhook` is refused (400) while it is unset."
            .to_owned(),
    );
    code(
        &mut rows,
        "server.webhook_max_attempts",
        format!(
            "Attempts at a webhook delivery, 1..={MAX_WEBHOOK_MAX_ATTEMPTS}, before it is dead-lettered (`status: dead` in `/api/webhooks/deliveries`)."
        ),
    );
    code(
        &mut rows,
        "server.webhook_retry_base_ms",
        format!(
            "Milliseconds before a failed delivery's first retry, 1..={MAX_WEBHOOK_RETRY_BASE_MS}; each further retry waits twice as long (at most 1 h)."
        ),
    );
    code(
        &mut rows,
        "server.images_per_message",
        format!(
            "Most images of one message, 0..={MAX_IMAGES_PER_MESSAGE} (0: images are refused \
             everywhere); more are refused with 400."
        ),
    );
    mcp_rows(&mut rows);
    telemetry_rows(&mut rows);
    let defaults = flatten_keys(&Config::default());
    rows.0
        .into_iter()
        .map(|(key, default, doc)| {
            let default = default.unwrap_or_else(|| {
                defaults
                    .get(&key)
                    .map_or_else(|| "(missing)".to_owned(), |v| format!("`{v}`"))
            });
            KeyDoc { key, default, doc }
        })
        .collect()
}

/// The generated part of docs/CONFIG.md: the key table and the full example.
pub fn render_generated_docs() -> String {
    let mut md = String::from("| Key | Default | Meaning |\n|---|---|---|\n");
    for KeyDoc { key, default, doc } in reference() {
        md.push_str(&format!(
            "| `{key}` | {} | {} |\n",
            default.replace('|', "\\|"),
            doc.replace('|', "\\|")
        ));
    }
    md.push_str("\nA file that sets every key:\n\n```toml\n");
    md.push_str(EXAMPLE_TOML);
    md.push_str("```\n");
    md
}

/// Every key `config` writes, as dotted paths (provider names spelled
/// `NAME`), with its value in TOML syntax.
pub fn flatten_keys(config: &Config) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Ok(toml::Value::Table(table)) = toml::Value::try_from(config) {
        walk("", &table, &mut out);
    }
    out
}

fn walk(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, String>) {
    for (key, value) in table {
        let key = if prefix == "providers" || prefix == "mcp" {
            "NAME"
        } else {
            key
        };
        let path = if prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            // A table of tool names: the table is the key.
            toml::Value::Table(_) if path == "tools.approval" => {
                out.insert(path, value.to_string());
            }
            // A map of the user's own names: one key.
            toml::Value::Table(inner) if key != "headers_env" => walk(&path, inner, out),
            leaf => {
                out.insert(path, leaf.to_string());
            }
        }
    }
}
