//! Configuration: `keel.toml` — its typed sections with documented defaults
//! and hard caps, loading (`--config FILE`, else `<data-dir>/keel.toml`, else
//! defaults), validation that reports every problem with its file, line and
//! key path, provider profile resolution (with the built-in offline `default`)
//! and the conversions into store, engine and tool settings.
//!
//! Every key, its default and its meaning is listed by [`reference()`], which
//! docs/CONFIG.md renders verbatim (a test keeps them identical).

mod error;
mod mcp;
mod origin;
mod reference;
mod spans;
mod validate;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use keel_catalog::{CatalogInputs, SkillSet};
use keel_core::{AgentId, Prices, Provider, ToolRegistry, Usd};
use keel_engine::{
    ApprovalPolicy, BuiltinToolsConfig, CoordinatorConfig, GateLimits, InboxPolicy, LandlockPolicy,
    RetentionPolicy, SessionManagerConfig, ShellConfig, ShellConfinement, SummaryConfig,
    DEFAULT_SHELL_READ_PATHS,
};
use keel_providers::{ProviderKind, ProviderProfile};
use keel_store::{StoreOptions, Synchronous};
use serde::{Deserialize, Serialize};

pub use error::{ConfigError, ConfigProblem};
pub use mcp::{
    valid_mcp_server_name, McpServerConfig, DEFAULT_MCP_MAX_OUTPUT_BYTES, DEFAULT_MCP_TIMEOUT_SECS,
    MAX_MCP_MAX_OUTPUT_BYTES, MAX_MCP_TIMEOUT_SECS, MIN_MCP_MAX_OUTPUT_BYTES,
};
pub(crate) use origin::host_of;
pub use origin::AllowedOrigin;
pub use reference::{flatten_keys, reference, render_generated_docs, KeyDoc, EXAMPLE_TOML};

/// Name of the configuration file looked up in the data directory.
pub const CONFIG_FILE_NAME: &str = "keel.toml";
/// Data directory used when neither `--data-dir`, `data_dir` nor
/// `$KEEL_DATA_DIR` names one (relative to the current directory).
pub const DEFAULT_DATA_DIR: &str = ".keel";
/// Environment variable naming the data directory.
pub const DATA_DIR_ENV: &str = "KEEL_DATA_DIR";
/// Sub-directory of the data directory holding agent definitions by default.
pub const DEFAULT_AGENTS_SUBDIR: &str = "agents";
/// Sub-directory of the data directory holding skills by default.
pub const DEFAULT_SKILLS_SUBDIR: &str = "skills";
/// The profile name that `llm_profile: default` refers to.
pub const DEFAULT_PROFILE_NAME: &str = "default";
/// The one-line notice printed when no provider is configured.
pub const OFFLINE_NOTICE: &str = "keel: no provider configured — using the built-in offline model \
     (replies are canned). Add [providers.NAME] to keel.toml to use a real LLM (see docs/CONFIG.md).";

/// Largest `session.ttl_hours` (30 days).
pub const MAX_SESSION_TTL_HOURS: u64 = 720;
/// Largest `session.cleanup_interval_minutes` (1 day).
pub const MAX_CLEANUP_INTERVAL_MINUTES: u64 = 1440;
/// Largest `session.auto_title_after_n_messages`.
pub const MAX_AUTO_TITLE_AFTER_N_MESSAGES: u64 = 1000;
/// `session.turn_timeout_secs` when keel.toml does not set it (15 minutes).
pub const DEFAULT_TURN_TIMEOUT_SECS: u64 = 15 * 60;
/// Largest `session.turn_timeout_secs` (1 day).
pub const MAX_TURN_TIMEOUT_SECS: u64 = 86_400;
/// Largest `session.summary.debounce_turns`.
pub const MAX_SUMMARY_DEBOUNCE_TURNS: u32 = 1000;
/// Largest `session.retention.keep_checkpoints`.
pub const MAX_KEEP_CHECKPOINTS: usize = 1_000_000;
/// Largest `session.retention.purge_deleted_after_days` (100 years).
pub const MAX_PURGE_DELETED_AFTER_DAYS: u64 = 36_500;

/// Most entries in `storage.retry_delays_ms`.
pub const MAX_RETRY_ATTEMPTS: usize = 10;
/// Largest single entry of `storage.retry_delays_ms` (10 s).
pub const MAX_RETRY_DELAY_MS: u64 = 10_000;
/// Largest `storage.max_connections`.
pub const MAX_PG_CONNECTIONS: usize = 1000;
/// Smallest `storage.lease_secs`: renewals come every third of it.
pub const MIN_LEASE_SECS: u64 = 3;
/// Largest `storage.lease_linger_ms`.
pub const MAX_LEASE_LINGER_MS: u64 = 10_000;
/// Largest `storage.lease_secs` (10 min).
pub const MAX_LEASE_SECS: u64 = 600;
/// Largest `storage.busy_timeout_ms` (1 min).
pub const MAX_BUSY_TIMEOUT_MS: u64 = 60_000;

/// Default `tools.shell_timeout_secs`.
pub const DEFAULT_SHELL_TIMEOUT_SECS: u64 = 30;
/// Largest `tools.shell_timeout_secs` (1 h).
pub const MAX_SHELL_TIMEOUT_SECS: u64 = 3600;

/// Largest `orchestration.max_runs_per_tree`.
pub const MAX_RUNS_PER_TREE_CAP: usize = 1024;
/// Largest `orchestration.max_concurrent_runs` (and its per-session limit).
pub const MAX_CONCURRENT_RUNS_CAP: usize = 1024;
/// Largest provider or tool step limit (global or per session).
pub const MAX_CONCURRENT_STEPS_CAP: usize = 1024;
/// Largest `orchestration.max_pending_inbox_events_per_session`.
pub const MAX_PENDING_INBOX_EVENTS_CAP: usize = 10_000;
/// Default `orchestration.inbox_event_ttl_hours` (7 days).
pub const DEFAULT_INBOX_EVENT_TTL_HOURS: u64 = 168;
/// Largest `orchestration.inbox_event_ttl_hours` (30 days).
pub const MAX_INBOX_EVENT_TTL_HOURS: u64 = 720;
/// Default `orchestration.max_inbox_delivery_attempts`.
pub const DEFAULT_MAX_INBOX_DELIVERY_ATTEMPTS: u32 = 5;
/// Largest `orchestration.max_inbox_delivery_attempts`.
pub const MAX_INBOX_DELIVERY_ATTEMPTS_CAP: u32 = 100;
/// Default `orchestration.max_user_turn_burst_before_inbox`.
pub const DEFAULT_MAX_USER_TURN_BURST_BEFORE_INBOX: usize = 3;
/// Largest `orchestration.max_user_turn_burst_before_inbox`.
pub const MAX_USER_TURN_BURST_CAP: usize = 1000;
/// Default `orchestration.max_inbox_wait_secs`.
pub const DEFAULT_MAX_INBOX_WAIT_SECS: u64 = 30;
/// Largest `orchestration.max_inbox_wait_secs` (1 h).
pub const MAX_INBOX_WAIT_SECS_CAP: u64 = 3600;
/// Default `orchestration.default_run_timeout_secs` (the catalog's default run deadline).
pub const DEFAULT_RUN_TIMEOUT_SECS: u64 = keel_catalog::DEFAULT_TIMEOUT_SECS;
/// Largest `orchestration.default_run_timeout_secs` (the catalog's cap, 24 h).
pub const MAX_RUN_TIMEOUT_SECS: u64 = keel_catalog::TIMEOUT_SECS_BOUND.max;
/// Largest `orchestration.max_children_per_call`.
pub const MAX_CHILDREN_PER_CALL_CAP: usize = 64;

/// Default `server.bind`: loopback only.
pub const DEFAULT_BIND: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 7420));
/// Default `server.token_env`.
pub const DEFAULT_TOKEN_ENV: &str = "KEEL_TOKEN";
/// Default `server.shutdown_grace_secs`.
pub const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
/// Largest `server.shutdown_grace_secs` (1 h).
pub const MAX_SHUTDOWN_GRACE_SECS: u64 = 3600;
/// Default `server.header_timeout_secs`.
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 10;
/// Default `server.body_timeout_secs`.
pub const DEFAULT_BODY_TIMEOUT_SECS: u64 = 60;
/// Default `server.idle_timeout_secs`.
pub const DEFAULT_IDLE_TIMEOUT_SECS: u64 = 60;
/// Largest `server.header_timeout_secs`, `body_timeout_secs` and `idle_timeout_secs` (1 h).
pub const MAX_CLIENT_TIMEOUT_SECS: u64 = 3600;
/// Default `server.stream_replay_secs` (5 min).
pub const DEFAULT_STREAM_REPLAY_SECS: u64 = 300;
/// Largest `server.stream_replay_secs` (1 h).
pub const MAX_STREAM_REPLAY_SECS: u64 = 3600;
/// Default `server.stream_replay_bytes` (1 MiB).
pub const DEFAULT_STREAM_REPLAY_BYTES: u64 = 1024 * 1024;
/// Largest `server.stream_replay_bytes` (64 MiB).
pub const MAX_STREAM_REPLAY_BYTES: u64 = 64 * 1024 * 1024;
/// Default `server.image_max_bytes` (5 MiB).
pub const DEFAULT_IMAGE_MAX_BYTES: u64 = 5 * 1024 * 1024;
/// Largest `server.image_max_bytes` (20 MiB).
pub const MAX_IMAGE_BYTES: u64 = 20 * 1024 * 1024;
/// Default `server.images_per_message`.
pub const DEFAULT_IMAGES_PER_MESSAGE: u64 = 8;
/// Largest `server.images_per_message`.
pub const MAX_IMAGES_PER_MESSAGE: u64 = 32;
/// Largest `server.max_connections`.
pub const MAX_CONNECTIONS_CAP: usize = 1_000_000;
/// Default `server.webhook_secret_env`.
pub const DEFAULT_WEBHOOK_SECRET_ENV: &str = "KEEL_WEBHOOK_SECRET";
/// Default `server.webhook_max_attempts`.
pub const DEFAULT_WEBHOOK_MAX_ATTEMPTS: u32 = 8;
/// Largest `server.webhook_max_attempts`.
pub const MAX_WEBHOOK_MAX_ATTEMPTS: u32 = 100;
/// Default `server.webhook_retry_base_ms` (1 s, doubled per attempt).
pub const DEFAULT_WEBHOOK_RETRY_BASE_MS: u64 = 1000;
/// Largest `server.webhook_retry_base_ms` (10 min).
pub const MAX_WEBHOOK_RETRY_BASE_MS: u64 = 600_000;
/// Most `server.webhook_urls`.
pub const MAX_WEBHOOK_URLS: usize = 16;

/// The whole of `keel.toml`. Every key is optional; see [`reference()`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where the database and `keel.toml` live. Unset: `--data-dir`, else
    /// `$KEEL_DATA_DIR`, else `.keel`. [`Config::load`] always fills it in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_dir: Option<PathBuf>,
    /// The profile `llm_profile: default` means when several are configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_profile: Option<String>,
    /// Directory of agent definitions. Unset: `<data_dir>/agents` if it exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agents_dir: Option<PathBuf>,
    /// Directory of skills. Unset: `<data_dir>/skills` if it exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skills_dir: Option<PathBuf>,
    /// Agents the root agent may delegate to.
    pub root_delegates: Vec<String>,
    /// Output token cap of each model call of the root agent.
    pub root_max_output_tokens: u32,
    /// Root directory of the file tools. Unset: the current directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_root: Option<PathBuf>,
    /// Provider profiles by name (`[providers.NAME]`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub providers: BTreeMap<String, ProviderProfile>,
    /// `[session]`: lifetime, titles and checkpoints of dialogs.
    pub session: SessionConfig,
    /// `[storage]`: SQLite durability and retries.
    pub storage: StorageConfig,
    /// `[tools]`: which built-in tools exist.
    pub tools: ToolsConfig,
    /// `[orchestration]`: sub-agent quotas and inbox behaviour.
    pub orchestration: OrchestrationConfig,
    /// `[server]`: how `keel serve` listens, authenticates and shuts down.
    pub server: ServerConfig,
    /// MCP servers by name (`[mcp.NAME]`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub mcp: BTreeMap<String, McpServerConfig>,
    /// `[telemetry]`: OpenTelemetry export of traces (off by default).
    pub telemetry: TelemetryConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            data_dir: None,
            default_profile: None,
            agents_dir: None,
            skills_dir: None,
            root_delegates: Vec::new(),
            root_max_output_tokens: keel_catalog::DEFAULT_MAX_OUTPUT_TOKENS,
            workspace_root: None,
            providers: BTreeMap::new(),
            session: SessionConfig::default(),
            storage: StorageConfig::default(),
            tools: ToolsConfig::default(),
            orchestration: OrchestrationConfig::default(),
            server: ServerConfig::default(),
            mcp: BTreeMap::new(),
            telemetry: TelemetryConfig::default(),
        }
    }
}

/// `[session]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// Hours a session may stay idle in memory before it is dropped (storage keeps it).
    pub ttl_hours: u64,
    /// Minutes between two sweeps of idle sessions and two retention passes.
    pub cleanup_interval_minutes: u64,
    /// Generate a title after this many user messages (0 disables).
    pub auto_title_after_n_messages: u64,
    /// Checkpoint after every committed turn.
    pub auto_checkpoint: bool,
    /// Seconds a root turn may run before it is stopped, timed out.
    pub turn_timeout_secs: u64,
    /// USD everything one dialog runs may spend, across restarts; unset: no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cost_usd_per_dialog: Option<Usd>,
    /// `[session.summary]`: automatic context summaries.
    pub summary: SummarySettings,
    /// `[session.retention]`: how much history the database keeps.
    pub retention: RetentionSettings,
}

impl Default for SessionConfig {
    fn default() -> Self {
        let engine = SessionManagerConfig::default();
        Self {
            ttl_hours: engine.idle_ttl.as_secs() / 3600,
            cleanup_interval_minutes: 60,
            auto_title_after_n_messages: engine.auto_title_after,
            auto_checkpoint: engine.auto_checkpoint,
            turn_timeout_secs: DEFAULT_TURN_TIMEOUT_SECS,
            max_cost_usd_per_dialog: None,
            summary: SummarySettings::default(),
            retention: RetentionSettings::default(),
        }
    }
}

/// `[session.retention]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionSettings {
    /// Turn checkpoints kept per dialog, newest first (0 keeps all).
    pub keep_checkpoints: usize,
    /// Days a soft-deleted dialog is kept before it is purged for good (0 keeps it).
    pub purge_deleted_after_days: u64,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            keep_checkpoints: 100,
            purge_deleted_after_days: 30,
        }
    }
}

/// `[session.summary]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SummarySettings {
    /// Summarize long contexts after a turn, before a request would need it.
    pub enabled: bool,
    /// Summarize when the context exceeds this share of the profile's
    /// budget (`context_window_tokens` less the output cap).
    pub trigger_ratio: f32,
    /// Turns between two automatic summaries of a session.
    pub debounce_turns: u32,
}

impl Default for SummarySettings {
    fn default() -> Self {
        let engine = SummaryConfig::default();
        Self {
            enabled: true,
            trigger_ratio: engine.trigger_ratio,
            debounce_turns: engine.debounce_turns,
        }
    }
}

/// `storage.synchronous`: how durable a commit is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// A commit survives a process crash; power loss may drop the last few.
    #[default]
    Normal,
    /// Every commit is fsynced before it is acknowledged.
    Full,
}

/// `[storage]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageConfig {
    /// A PostgreSQL database (`postgres://…`) instead of the data
    /// directory's SQLite file; `KEEL_DATABASE_URL` wins over it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Most connections to PostgreSQL this process opens (unset: twice
    /// the CPUs and two, at most 16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Seconds a process on PostgreSQL stays registered without renewing:
    /// how long after it dies another process takes over its work.
    pub lease_secs: u64,
    /// Milliseconds a dialog's lease stays this process's after a step
    /// (PostgreSQL only; 0: given back at once).
    pub lease_linger_ms: u64,
    /// `normal` or `full` (SQLite `synchronous`).
    pub synchronous: SyncMode,
    /// Delays between retries of a transient write failure; its length is the retry count.
    pub retry_delays_ms: Vec<u64>,
    /// Milliseconds SQLite waits on a lock before reporting BUSY.
    pub busy_timeout_ms: u64,
}

impl Default for StorageConfig {
    fn default() -> Self {
        let store = StoreOptions::default();
        Self {
            url: None,
            max_connections: None,
            lease_secs: keel_store_postgres::PgOptions::default().lease.as_secs(),
            lease_linger_ms: duration_ms(&keel_engine::DEFAULT_LEASE_LINGER),
            synchronous: match store.synchronous {
                Synchronous::Full => SyncMode::Full,
                Synchronous::Normal => SyncMode::Normal,
            },
            retry_delays_ms: store.retry_delays.iter().map(duration_ms).collect(),
            busy_timeout_ms: duration_ms(&store.busy_timeout),
        }
    }
}

fn duration_ms(d: &Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `[tools]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {
    /// Register `write_file` (root agent only).
    pub enable_write: bool,
    /// Register `shell` (root agent only).
    pub enable_shell: bool,
    /// Default and maximum run time of one shell command.
    pub shell_timeout_secs: u64,
    /// Environment variables passed to shell commands besides PATH, HOME, LANG and TERM.
    pub shell_env: Vec<String>,
    /// Trees shell commands may read and execute from (besides the workspace).
    pub shell_read_paths: Vec<PathBuf>,
    /// Let shell commands open TCP connections and listen.
    pub shell_network: bool,
    /// Run shell commands unconfined where the kernel has no Landlock.
    pub shell_unsandboxed: bool,
    /// Whether `shell` and `write_file` (when enabled) need a person's
    /// approval when `[tools.approval]` does not name them.
    pub approval_default: ApprovalMode,
    /// Seconds a tool call waits for a decision before it expires as a denial.
    pub approval_timeout_secs: u64,
    /// The reason a pending approval is denied with (the model reads it)
    /// when the user sends new input.
    pub approval_supersede_reason: String,
    /// `[tools.approval]`: per tool, whether its calls need approval.
    pub approval: BTreeMap<String, ApprovalMode>,
}

/// Whether a tool's calls need a person's approval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalMode {
    /// Every call waits for a decision.
    #[default]
    Always,
    /// Calls run unasked.
    Never,
}

/// Tools whose calls act on the world: they need approval by default.
pub const GATED_BY_DEFAULT: [&str; 2] = ["shell", "write_file"];

/// Names `[tools.approval]` may use: the built-in and runtime tools.
pub const APPROVABLE_TOOLS: [&str; 14] = [
    "read_file",
    "list_dir",
    "search_text",
    "write_file",
    "shell",
    "current_time",
    "sleep",
    "remember",
    "recall",
    "forget",
    "get_skill",
    "delegate",
    "agent_task",
    "emit_signal",
];

/// `tools.approval_timeout_secs` when keel.toml does not set it (24 hours).
pub const DEFAULT_APPROVAL_TIMEOUT_SECS: u64 = 24 * 3600;
/// Largest `tools.approval_timeout_secs` (30 days).
pub const MAX_APPROVAL_TIMEOUT_SECS: u64 = 30 * 24 * 3600;
/// Longest `tools.approval_supersede_reason`, in bytes.
pub const MAX_SUPERSEDE_REASON_BYTES: usize = 500;

impl Default for ToolsConfig {
    fn default() -> Self {
        Self {
            enable_write: false,
            enable_shell: false,
            shell_timeout_secs: DEFAULT_SHELL_TIMEOUT_SECS,
            shell_env: Vec::new(),
            shell_read_paths: DEFAULT_SHELL_READ_PATHS.iter().map(PathBuf::from).collect(),
            shell_network: false,
            shell_unsandboxed: false,
            approval_default: ApprovalMode::Always,
            approval_timeout_secs: DEFAULT_APPROVAL_TIMEOUT_SECS,
            approval_supersede_reason: keel_engine::SUPERSEDED_REASON.to_owned(),
            approval: BTreeMap::new(),
        }
    }
}

/// `[orchestration]`: quotas of sub-agent runs and how the inbox delivers
/// their results.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrchestrationConfig {
    /// Longest delegation chain below the root agent.
    pub max_tree_depth: u32,
    /// Runs one root turn's tree may create in total.
    pub max_runs_per_tree: usize,
    /// Non-terminal runs across all sessions.
    pub max_concurrent_runs: usize,
    /// Non-terminal runs within one session.
    pub max_concurrent_runs_per_session: usize,
    /// Provider calls in flight across all sessions.
    pub max_concurrent_provider_steps: usize,
    /// Provider calls in flight within one session.
    pub max_concurrent_provider_steps_per_session: usize,
    /// Tool calls in flight across all sessions.
    pub max_concurrent_tool_steps: usize,
    /// Tool calls in flight within one session.
    pub max_concurrent_tool_steps_per_session: usize,
    /// Undelivered completions and signals one session may hold.
    pub max_pending_inbox_events_per_session: usize,
    /// Hours an undelivered inbox event is kept before it is dead-lettered.
    pub inbox_event_ttl_hours: u64,
    /// Failed deliveries of one inbox event before it is dead-lettered.
    pub max_inbox_delivery_attempts: u32,
    /// User turns in a row before a pending inbox event gets a continuation turn.
    pub max_user_turn_burst_before_inbox: usize,
    /// Seconds a pending inbox event waits before the next turn is a continuation.
    pub max_inbox_wait_secs: u64,
    /// Deadline of a run whose definition sets no `limits.timeout_secs`.
    pub default_run_timeout_secs: u64,
    /// Children one `delegate` call may start at once.
    pub max_children_per_call: usize,
    /// USD one root turn and its foreground tree may spend; unset: no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cost_usd_per_root_turn: Option<Usd>,
}

impl Default for OrchestrationConfig {
    /// Quotas as in the engine's [`GateLimits`] and [`CoordinatorConfig`]
    /// defaults; inbox timing from the constants above.
    fn default() -> Self {
        let gate = GateLimits::default();
        let coordinator = CoordinatorConfig::default();
        Self {
            max_tree_depth: coordinator.max_tree_depth,
            max_runs_per_tree: widen(coordinator.max_runs_per_tree),
            max_concurrent_runs: gate.max_concurrent_runs,
            max_concurrent_runs_per_session: gate.max_concurrent_runs_per_session,
            max_concurrent_provider_steps: gate.max_concurrent_provider_steps,
            max_concurrent_provider_steps_per_session: gate
                .max_concurrent_provider_steps_per_session,
            max_concurrent_tool_steps: gate.max_concurrent_tool_steps,
            max_concurrent_tool_steps_per_session: gate.max_concurrent_tool_steps_per_session,
            max_pending_inbox_events_per_session: widen(
                coordinator.max_pending_inbox_events_per_session,
            ),
            inbox_event_ttl_hours: DEFAULT_INBOX_EVENT_TTL_HOURS,
            max_inbox_delivery_attempts: DEFAULT_MAX_INBOX_DELIVERY_ATTEMPTS,
            max_user_turn_burst_before_inbox: DEFAULT_MAX_USER_TURN_BURST_BEFORE_INBOX,
            max_inbox_wait_secs: DEFAULT_MAX_INBOX_WAIT_SECS,
            default_run_timeout_secs: DEFAULT_RUN_TIMEOUT_SECS,
            max_children_per_call: widen(coordinator.max_children_per_call),
            max_cost_usd_per_root_turn: None,
        }
    }
}

fn widen(n: u32) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

fn narrow(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// `[server]`: how `keel serve` listens, authenticates and shuts down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address `keel serve` listens on.
    pub bind: SocketAddr,
    /// Environment variable holding the bearer token of the API.
    pub token_env: String,
    /// Seconds a shutdown lets running turns finish before cancelling them.
    pub shutdown_grace_secs: u64,
    /// Origins whose pages may use the server besides its own.
    pub allowed_origins: Vec<AllowedOrigin>,
    /// Connections open at once; unset: derived from the open-file limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Seconds a client has to send a request head.
    pub header_timeout_secs: u64,
    /// Seconds a client has to send a request body, from its head.
    pub body_timeout_secs: u64,
    /// Seconds a connection may stay open with no request in flight.
    pub idle_timeout_secs: u64,
    /// Seconds a dialog's turn frames are kept for clients that reconnect.
    pub stream_replay_secs: u64,
    /// Bytes of turn frames kept per dialog for clients that reconnect.
    pub stream_replay_bytes: u64,
    /// URLs every committed turn is POSTed to (signed webhooks).
    pub webhook_urls: Vec<String>,
    /// Environment variable holding the secret webhooks are signed with.
    pub webhook_secret_env: String,
    /// Attempts at a webhook delivery before it is dead-lettered.
    pub webhook_max_attempts: u32,
    /// Milliseconds before a failed delivery's first retry (doubled per attempt).
    pub webhook_retry_base_ms: u64,
    /// Largest image of a message, in bytes (decoded).
    pub image_max_bytes: u64,
    /// Most images of one message.
    pub images_per_message: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            bind: DEFAULT_BIND,
            token_env: DEFAULT_TOKEN_ENV.to_owned(),
            shutdown_grace_secs: DEFAULT_SHUTDOWN_GRACE_SECS,
            allowed_origins: Vec::new(),
            max_connections: None,
            header_timeout_secs: DEFAULT_HEADER_TIMEOUT_SECS,
            body_timeout_secs: DEFAULT_BODY_TIMEOUT_SECS,
            idle_timeout_secs: DEFAULT_IDLE_TIMEOUT_SECS,
            stream_replay_secs: DEFAULT_STREAM_REPLAY_SECS,
            stream_replay_bytes: DEFAULT_STREAM_REPLAY_BYTES,
            webhook_urls: Vec::new(),
            webhook_secret_env: DEFAULT_WEBHOOK_SECRET_ENV.to_owned(),
            webhook_max_attempts: DEFAULT_WEBHOOK_MAX_ATTEMPTS,
            webhook_retry_base_ms: DEFAULT_WEBHOOK_RETRY_BASE_MS,
            image_max_bytes: DEFAULT_IMAGE_MAX_BYTES,
            images_per_message: DEFAULT_IMAGES_PER_MESSAGE,
        }
    }
}

/// `[telemetry]`: where `keel serve` exports its traces (OTLP over
/// HTTP/protobuf) and what they hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Base URL of the OTLP/HTTP collector (`/v1/traces` is appended);
    /// unset: `OTEL_EXPORTER_OTLP_*`, else no export.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// Environment variable holding extra export headers (`k=v,k2=v2`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers_env: Option<String>,
    /// `service.name` of the exported spans; unset: `OTEL_SERVICE_NAME`, else `keel`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// Share of root traces recorded, 0.0..=1.0.
    pub sampling_ratio: f64,
    /// Whether spans carry message content (inputs, answers, tool arguments and results).
    pub record_content: bool,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            headers_env: None,
            service_name: None,
            sampling_ratio: 1.0,
            record_content: false,
        }
    }
}

/// A configuration together with the file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedConfig {
    /// The validated configuration, with `data_dir` filled in and relative
    /// paths resolved against the file's directory.
    pub config: Config,
    /// The file read, or `None` when built-in defaults are used.
    pub source: Option<PathBuf>,
}

impl LoadedConfig {
    /// What no tool may touch: the data directory and the configuration
    /// file (the one read, or the one a later start would read).
    pub fn protected_paths(&self) -> Vec<PathBuf> {
        let data_dir = self.config.data_dir();
        let file = self
            .source
            .clone()
            .unwrap_or_else(|| data_dir.join(CONFIG_FILE_NAME));
        vec![data_dir, file]
    }

    /// How errors name this configuration: the file's path, or
    /// `keel.toml (defaults)` when no file was read.
    pub fn source_label(&self) -> String {
        self.source
            .as_ref()
            .map_or_else(|| DEFAULT_LABEL.to_owned(), |p| p.display().to_string())
    }
}

/// The built-in offline profile that `default` names when no provider is configured.
static OFFLINE_PROFILE: LazyLock<ProviderProfile> =
    LazyLock::new(|| ProviderProfile::new(ProviderKind::Scripted, ""));

/// `path` when it names a regular file (through any symbolic links),
/// `None` when nothing is there, else [`ConfigError::NotAFile`].
fn config_file(path: &Path) -> Result<Option<PathBuf>, ConfigError> {
    let not_a_file = |what: String| ConfigError::NotAFile {
        path: path.to_path_buf(),
        what,
    };
    let link = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ConfigError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if link.file_type().is_symlink() && e.kind() == std::io::ErrorKind::NotFound => {
            let target = std::fs::read_link(path)
                .map_or_else(|_| "?".to_owned(), |t| t.display().to_string());
            return Err(not_a_file(format!(
                "a symbolic link to {target}, which does not exist"
            )));
        }
        Err(source) => {
            return Err(ConfigError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(Some(path.to_path_buf()));
    }
    #[cfg(unix)]
    use std::os::unix::fs::FileTypeExt;
    #[cfg(unix)]
    let fifo = kind.is_fifo();
    #[cfg(not(unix))]
    let fifo = false;
    Err(not_a_file(
        if kind.is_dir() {
            "a directory"
        } else if fifo {
            "a FIFO (named pipe)"
        } else {
            "a special file"
        }
        .to_owned(),
    ))
}

fn real_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

impl Config {
    /// Loads `explicit` (`--config FILE`, which must exist), else
    /// `<data-dir>/keel.toml` if it exists, else the defaults; then validates
    /// against the process environment. Something at either path that is
    /// not a readable file (a directory, a FIFO, a dangling symbolic link)
    /// is an error naming it, never taken for "no file".
    pub fn load(
        explicit: Option<&Path>,
        data_dir_override: Option<&Path>,
    ) -> Result<LoadedConfig, ConfigError> {
        Self::load_with_env(explicit, data_dir_override, &real_env)
    }

    /// [`load`](Self::load) with an injected environment lookup (for
    /// `$KEEL_DATA_DIR` and provider API keys).
    ///
    /// The data directory is `data_dir_override` (`--data-dir`), else the
    /// file's `data_dir`, else `$KEEL_DATA_DIR`, else `.keel`; without
    /// `--config` the file is looked up in the directory chosen without the
    /// file's own `data_dir`. Relative paths inside the file are resolved
    /// against the directory that holds it.
    pub fn load_with_env(
        explicit: Option<&Path>,
        data_dir_override: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<LoadedConfig, ConfigError> {
        let env_data_dir = env(DATA_DIR_ENV)
            .filter(|v| !v.trim().is_empty())
            .map(PathBuf::from);
        let lookup_dir = data_dir_override
            .map(Path::to_path_buf)
            .or_else(|| env_data_dir.clone())
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
        let source = match explicit {
            Some(path) => match config_file(path)? {
                Some(path) => Some(path),
                None => {
                    return Err(ConfigError::NotFound {
                        path: path.to_path_buf(),
                    })
                }
            },
            None => config_file(&lookup_dir.join(CONFIG_FILE_NAME))?,
        };
        let Some(path) = source else {
            let config = Config {
                data_dir: Some(lookup_dir),
                ..Config::default()
            };
            config.validate_with_env(DEFAULT_LABEL, env)?;
            return Ok(LoadedConfig {
                config,
                source: None,
            });
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: path.clone(),
            source,
        })?;
        let label = path.display().to_string();
        let (mut config, index) = Self::parse(&text, &label)?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        config.resolve_paths(&base);
        config.data_dir = data_dir_override
            .map(Path::to_path_buf)
            .or(config.data_dir.take())
            .or(env_data_dir)
            .or_else(|| Some(PathBuf::from(DEFAULT_DATA_DIR)));
        let mut problems = validate::problems(&config, env);
        problems.extend(validate::filesystem_problems(&config));
        error::into_result(&label, &index, problems)?;
        Ok(LoadedConfig {
            config,
            source: Some(path),
        })
    }

    /// Parses and validates `text`, naming `file_label` in every error and
    /// reading provider keys through `env`. Relative paths are kept as
    /// written.
    pub fn from_toml_str_with_env(
        text: &str,
        file_label: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let (config, index) = Self::parse(text, file_label)?;
        error::into_result(file_label, &index, validate::problems(&config, env))?;
        Ok(config)
    }

    /// Checks every rule (capacities, caps, per-session ≤ global, profiles,
    /// root delegates, provider keys via `env`) and reports all problems at once.
    pub fn validate_with_env(
        &self,
        file_label: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        error::into_result(
            file_label,
            &spans::KeyIndex::default(),
            validate::problems(self, env),
        )
    }

    /// Syntax, then types and unknown keys; the first such error stops parsing.
    fn parse(text: &str, label: &str) -> Result<(Config, spans::KeyIndex), ConfigError> {
        if let Err(e) = toml::from_str::<toml::Table>(text) {
            return Err(error::parse_error(label, text, None, &e));
        }
        let index = spans::KeyIndex::build(text);
        match toml::from_str::<Config>(text) {
            Ok(config) => Ok((config, index)),
            Err(e) => Err(error::parse_error(label, text, Some(&index), &e)),
        }
    }

    /// Makes relative paths relative to `base` (the directory of the file).
    fn resolve_paths(&mut self, base: &Path) {
        let join = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        for path in [
            &mut self.data_dir,
            &mut self.agents_dir,
            &mut self.skills_dir,
            &mut self.workspace_root,
        ]
        .into_iter()
        .flatten()
        .chain(&mut self.tools.shell_read_paths)
        {
            join(path);
        }
        for profile in self.providers.values_mut() {
            if let Some(script) = &mut profile.script {
                join(script);
            }
        }
        for server in self.mcp.values_mut() {
            if let Some(cwd) = &mut server.cwd {
                join(cwd);
            }
        }
    }

    /// The data directory (`.keel` when unset and not loaded through [`Config::load`]).
    pub fn data_dir(&self) -> PathBuf {
        self.data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR))
    }

    /// The agent definitions directory: `agents_dir`, else `<data_dir>/agents`
    /// if that directory exists, else none.
    pub fn agents_dir(&self) -> Option<PathBuf> {
        self.agents_dir
            .clone()
            .or_else(|| Some(self.data_dir().join(DEFAULT_AGENTS_SUBDIR)).filter(|p| p.is_dir()))
    }

    /// The skills directory: `skills_dir`, else `<data_dir>/skills` if that
    /// directory exists, else none.
    pub fn skills_dir(&self) -> Option<PathBuf> {
        self.skills_dir
            .clone()
            .or_else(|| Some(self.data_dir().join(DEFAULT_SKILLS_SUBDIR)).filter(|p| p.is_dir()))
    }

    /// The skills of [`Config::skills_dir`] (none when there is no such
    /// directory); every problem of every file is reported.
    pub fn load_skills(&self) -> Result<SkillSet, keel_catalog::Diagnostics> {
        match self.skills_dir() {
            Some(dir) => SkillSet::load(&dir),
            None => Ok(SkillSet::empty()),
        }
    }

    /// The root of the file tools: `workspace_root`, else the current directory.
    pub fn workspace_root(&self) -> PathBuf {
        self.workspace_root
            .clone()
            .unwrap_or_else(|| PathBuf::from("."))
    }

    /// `root_delegates` as agent ids (invalid entries, rejected by validation, are skipped).
    pub fn root_delegate_ids(&self) -> Vec<AgentId> {
        self.root_delegates
            .iter()
            .filter_map(|id| AgentId::parse(id).ok())
            .collect()
    }

    /// What the agent catalog validates definitions against: the profile
    /// names (with `default`), `tools`, `skills`, `root_delegates` and
    /// `max_tree_depth`.
    pub fn catalog_inputs(&self, tools: Arc<ToolRegistry>, skills: SkillSet) -> CatalogInputs {
        let mut inputs = CatalogInputs::new(self.profile_names(), tools);
        inputs.priced_profiles = self
            .profile_names()
            .into_iter()
            .filter(|name| self.profile_prices(name).is_some())
            .collect();
        inputs.skills = skills;
        inputs.root_delegates = self.root_delegate_ids();
        inputs.max_delegation_depth = self.orchestration.max_tree_depth;
        inputs.default_timeout_secs = self.orchestration.default_run_timeout_secs;
        inputs
    }

    /// The usable profiles: the configured ones, or only `default` (the
    /// built-in offline provider) when none is configured.
    pub fn profiles(&self) -> BTreeMap<String, ProviderProfile> {
        if self.providers.is_empty() {
            return BTreeMap::from([(DEFAULT_PROFILE_NAME.to_owned(), OFFLINE_PROFILE.clone())]);
        }
        self.providers.clone()
    }

    /// Every name an agent's `llm_profile` may use, sorted: the profiles plus `default`.
    pub fn profile_names(&self) -> Vec<String> {
        let mut names: BTreeSet<String> = self.providers.keys().cloned().collect();
        names.insert(DEFAULT_PROFILE_NAME.to_owned());
        names.into_iter().collect()
    }

    /// One line saying the built-in offline model is in use, when no provider is configured.
    pub fn offline_notice(&self) -> Option<&'static str> {
        self.providers.is_empty().then_some(OFFLINE_NOTICE)
    }

    /// The profile `name` refers to, with the name it resolved to: `default`
    /// is the offline provider when none is configured, else
    /// `[providers.default]`, else `default_profile`, else the only profile.
    pub fn resolve_profile(&self, name: &str) -> Option<(&str, &ProviderProfile)> {
        if let Some((key, profile)) = self.providers.get_key_value(name) {
            return Some((key.as_str(), profile));
        }
        if name != DEFAULT_PROFILE_NAME {
            return None;
        }
        if self.providers.is_empty() {
            return Some((DEFAULT_PROFILE_NAME, &OFFLINE_PROFILE));
        }
        if let Some(chosen) = &self.default_profile {
            return self
                .providers
                .get_key_value(chosen.as_str())
                .map(|(k, p)| (k.as_str(), p));
        }
        match self.providers.iter().next() {
            Some((key, profile)) if self.providers.len() == 1 => Some((key.as_str(), profile)),
            _ => None,
        }
    }

    /// Builds the provider of profile `name` (see [`resolve_profile`](Self::resolve_profile)),
    /// reading API keys through `env`.
    pub fn build_provider_with_env(
        &self,
        name: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Arc<dyn Provider>, ConfigError> {
        let Some((resolved, profile)) = self.resolve_profile(name) else {
            return Err(ConfigError::UnknownProfile {
                name: name.to_owned(),
                known: self.profile_names(),
            });
        };
        keel_providers::build_provider_with_env(resolved, profile, env).map_err(ConfigError::from)
    }

    /// What profile `name`'s tokens cost (see [`resolve_profile`](Self::resolve_profile)),
    /// when it has prices.
    pub fn profile_prices(&self, name: &str) -> Option<Prices> {
        self.resolve_profile(name)?.1.prices()
    }

    /// The context window of profile `name` in tokens (its
    /// `context_window_tokens`, else its model's known window).
    pub fn context_window(&self, name: &str) -> usize {
        let tokens = match self.resolve_profile(name) {
            Some((_, profile)) => profile.context_window(),
            None => keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS as u64,
        };
        usize::try_from(tokens).unwrap_or(usize::MAX)
    }

    /// [`build_provider_with_env`](Self::build_provider_with_env) with the process environment.
    pub fn build_provider(&self, name: &str) -> Result<Arc<dyn Provider>, ConfigError> {
        self.build_provider_with_env(name, &real_env)
    }

    /// The store settings from `[storage]` (readers, batch size and WAL
    /// checkpointing keep the store's defaults).
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            synchronous: match self.storage.synchronous {
                SyncMode::Normal => Synchronous::Normal,
                SyncMode::Full => Synchronous::Full,
            },
            busy_timeout: Duration::from_millis(self.storage.busy_timeout_ms),
            retry_delays: self
                .storage
                .retry_delays_ms
                .iter()
                .map(|ms| Duration::from_millis(*ms))
                .collect(),
            ..StoreOptions::default()
        }
    }

    /// The session manager settings from `[session]`.
    pub fn session_manager_config(&self) -> SessionManagerConfig {
        let s = &self.session;
        SessionManagerConfig {
            auto_checkpoint: s.auto_checkpoint,
            idle_ttl: Duration::from_secs(s.ttl_hours.saturating_mul(3600)),
            auto_title_after: s.auto_title_after_n_messages,
            summary: s.summary.enabled.then_some(SummaryConfig {
                trigger_ratio: s.summary.trigger_ratio,
                debounce_turns: s.summary.debounce_turns,
            }),
            inbox: self.inbox_policy(),
            turn_timeout: Some(Duration::from_secs(s.turn_timeout_secs)),
            approval_timeout: Duration::from_secs(self.tools.approval_timeout_secs),
            supersede_reason: self.tools.approval_supersede_reason.clone(),
            max_cost_usd_per_root_turn: self.orchestration.max_cost_usd_per_root_turn,
            max_cost_usd_per_dialog: s.max_cost_usd_per_dialog,
            lease_linger: Duration::from_millis(self.storage.lease_linger_ms),
            ..SessionManagerConfig::default()
        }
    }

    /// How the inbox is delivered, from `[orchestration]` (lease, backoff
    /// and batch sizes keep the engine's defaults).
    pub fn inbox_policy(&self) -> InboxPolicy {
        let o = &self.orchestration;
        InboxPolicy {
            max_user_turn_burst: o.max_user_turn_burst_before_inbox,
            max_wait: Duration::from_secs(o.max_inbox_wait_secs),
            max_delivery_attempts: o.max_inbox_delivery_attempts,
            event_ttl: Duration::from_secs(o.inbox_event_ttl_hours.saturating_mul(3600)),
            ..InboxPolicy::default()
        }
    }

    /// The built-in tool settings from `[tools]` and `workspace_root`, with
    /// `protected` out of every tool's reach. With the shell enabled this
    /// checks the kernel for Landlock; the notice (print it once at start-up)
    /// says when commands will not be confined.
    pub fn builtin_tools(&self, protected: Vec<PathBuf>) -> (BuiltinToolsConfig, Option<String>) {
        let t = &self.tools;
        let (confinement, notice) = if t.enable_shell {
            // The sandbox launcher is this binary, started again.
            let launcher = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("keel"));
            let policy = LandlockPolicy {
                launcher,
                read_paths: t.shell_read_paths.clone(),
                network: t.shell_network,
            };
            ShellConfinement::choose(policy, t.shell_unsandboxed)
        } else {
            (
                ShellConfinement::Refused("the shell is disabled".into()),
                None,
            )
        };
        let tools = BuiltinToolsConfig {
            workspace_root: self.workspace_root(),
            protected_paths: protected,
            enable_write: t.enable_write,
            enable_shell: t.enable_shell,
            shell: ShellConfig {
                timeout: Duration::from_secs(t.shell_timeout_secs),
                env: t.shell_env.clone(),
                confinement,
            },
        };
        (tools, notice)
    }

    /// The tools keel.toml gates behind a person's approval: `shell` and
    /// `write_file` when enabled (unless `[tools.approval]` or
    /// `approval_default` says `never`), and every tool `[tools.approval]`
    /// sets to `always`.
    pub fn approval_policy(&self) -> ApprovalPolicy {
        let t = &self.tools;
        let enabled = |name: &str| match name {
            "shell" => t.enable_shell,
            _ => t.enable_write,
        };
        let defaults = GATED_BY_DEFAULT.into_iter().filter(|name| {
            enabled(name)
                && t.approval.get(*name).copied().unwrap_or(t.approval_default)
                    == ApprovalMode::Always
        });
        let named = t
            .approval
            .iter()
            .filter(|(name, mode)| {
                **mode == ApprovalMode::Always && !GATED_BY_DEFAULT.contains(&name.as_str())
            })
            .map(|(name, _)| name.as_str());
        ApprovalPolicy::tools(defaults.chain(named).map(str::to_owned))
    }

    /// The execution gate's limits from `[orchestration]` (no per-agent limits).
    pub fn gate_limits(&self) -> GateLimits {
        let o = &self.orchestration;
        GateLimits {
            max_concurrent_runs: o.max_concurrent_runs,
            max_concurrent_runs_per_session: o.max_concurrent_runs_per_session,
            max_concurrent_provider_steps: o.max_concurrent_provider_steps,
            max_concurrent_provider_steps_per_session: o.max_concurrent_provider_steps_per_session,
            max_concurrent_tool_steps: o.max_concurrent_tool_steps,
            max_concurrent_tool_steps_per_session: o.max_concurrent_tool_steps_per_session,
            ..GateLimits::default()
        }
    }

    /// The coordinator's limits from `[orchestration]` (previews, reaper
    /// interval and runtime generation keep the engine's defaults).
    pub fn coordinator_config(&self) -> CoordinatorConfig {
        let o = &self.orchestration;
        CoordinatorConfig {
            max_tree_depth: o.max_tree_depth,
            max_runs_per_tree: narrow(o.max_runs_per_tree),
            max_children_per_call: narrow(o.max_children_per_call),
            max_pending_inbox_events_per_session: narrow(o.max_pending_inbox_events_per_session),
            approval: self.approval_policy(),
            approval_timeout: Duration::from_secs(self.tools.approval_timeout_secs),
            ..CoordinatorConfig::default()
        }
    }

    /// `[session.retention]` for the engine: `None` for what it keeps forever.
    pub fn retention_policy(&self) -> RetentionPolicy {
        let r = &self.session.retention;
        let days = r.purge_deleted_after_days;
        RetentionPolicy {
            keep_checkpoints: (r.keep_checkpoints > 0).then_some(r.keep_checkpoints),
            purge_deleted_after: (days > 0)
                .then(|| Duration::from_secs(days.saturating_mul(86_400))),
        }
    }

    /// Time between two sweeps of idle sessions (and two retention passes).
    pub fn cleanup_interval(&self) -> Duration {
        Duration::from_secs(self.session.cleanup_interval_minutes.saturating_mul(60))
    }
}

/// The label used when no file was read.
const DEFAULT_LABEL: &str = "keel.toml (defaults)";
