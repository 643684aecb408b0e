//! The typed agent definition: frontmatter fields, their documented defaults
//! and hard caps, the signal contract, and the `definition_hash`.
//!
//! Every default is a `const` here and is repeated in the field's doc comment;
//! every numeric field has a minimum and a hard maximum (see [`Bound`]), and a
//! value outside them is a diagnostic naming the key — never a silent clamp.

use std::path::PathBuf;

use keel_core::{AgentId, Delivery, Usd};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Inclusive range accepted for one numeric frontmatter key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// Smallest accepted value.
    pub min: u64,
    /// Largest accepted value (the hard cap).
    pub max: u64,
}

/// Default `limits.max_iterations`: provider calls per run before it stops.
pub const DEFAULT_MAX_ITERATIONS: u32 = 16;
/// Accepted `limits.max_iterations`.
pub const MAX_ITERATIONS_BOUND: Bound = Bound { min: 1, max: 256 };
/// Default `limits.timeout_secs`: wall-clock deadline of one run (10 min).
pub const DEFAULT_TIMEOUT_SECS: u64 = 600;
/// Accepted `limits.timeout_secs` (at most 24 h).
pub const TIMEOUT_SECS_BOUND: Bound = Bound {
    min: 1,
    max: 86_400,
};
/// Default `limits.max_output_tokens`: output tokens per provider call.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 4096;
/// Accepted `limits.max_output_tokens`.
pub const MAX_OUTPUT_TOKENS_BOUND: Bound = Bound {
    min: 1,
    max: 131_072,
};
/// Default `limits.max_children`: delegations one run may start.
pub const DEFAULT_MAX_CHILDREN: u32 = 4;
/// Accepted `limits.max_children`.
pub const MAX_CHILDREN_BOUND: Bound = Bound { min: 1, max: 64 };

/// Accepted `limits.max_tokens_total` (unset by default: no token budget).
pub const MAX_TOKENS_TOTAL_BOUND: Bound = Bound {
    min: 1,
    max: 1_000_000_000_000,
};

/// Default `signal.delivery`: signals wait for a continuation turn.
pub const DEFAULT_SIGNAL_DELIVERY: Delivery = Delivery::Queue;
/// Default `signal.max_signals`: signals one run may emit in total.
pub const DEFAULT_MAX_SIGNALS: u32 = 16;
/// Accepted `signal.max_signals`.
pub const MAX_SIGNALS_BOUND: Bound = Bound { min: 1, max: 1000 };
/// Default `signal.max_summary_bytes`: UTF-8 bytes of one signal's summary.
pub const DEFAULT_MAX_SUMMARY_BYTES: u32 = 512;
/// Accepted `signal.max_summary_bytes`.
pub const MAX_SUMMARY_BYTES_BOUND: Bound = Bound { min: 1, max: 4096 };
/// Default `signal.max_details_bytes`: bytes of one signal's details JSON.
pub const DEFAULT_MAX_DETAILS_BYTES: u32 = 4096;
/// Accepted `signal.max_details_bytes` (0 forbids details).
pub const MAX_DETAILS_BYTES_BOUND: Bound = Bound {
    min: 0,
    max: 65_536,
};
/// Default `signal.min_interval_ms`: least time between two signals of a run.
pub const DEFAULT_MIN_INTERVAL_MS: u64 = 1000;
/// Accepted `signal.min_interval_ms` (at most 1 h).
pub const MIN_INTERVAL_MS_BOUND: Bound = Bound {
    min: 0,
    max: 3_600_000,
};
/// Default `signal.burst`: signals allowed back to back before
/// `min_interval_ms` applies.
pub const DEFAULT_BURST: u32 = 3;
/// Accepted `signal.burst`.
pub const BURST_BOUND: Bound = Bound { min: 1, max: 100 };
/// Default `signal.severities`: every severity is allowed.
pub const DEFAULT_SEVERITIES: [Severity; 3] = [Severity::Info, Severity::Warning, Severity::Error];
/// Default `signal.dedupe_window_secs`: a repeated dedupe key within this
/// window returns the earlier event.
pub const DEFAULT_DEDUPE_WINDOW_SECS: u64 = 60;
/// Accepted `signal.dedupe_window_secs` (0 disables dedupe; at most 24 h).
pub const DEDUPE_WINDOW_SECS_BOUND: Bound = Bound {
    min: 0,
    max: 86_400,
};
/// Default `signal.max_json_depth`: nesting depth of a signal's details.
pub const DEFAULT_MAX_JSON_DEPTH: u32 = 8;
/// Accepted `signal.max_json_depth`.
pub const MAX_JSON_DEPTH_BOUND: Bound = Bound { min: 1, max: 32 };

/// Most entries in one of `tools`, `delegates`, `skills`, `signal.severities`.
pub const MAX_LIST_ENTRIES: usize = 64;
/// Longest `description`, in bytes.
pub const MAX_DESCRIPTION_BYTES: usize = 1024;
/// Longest `llm_profile`, tool or skill name, in bytes.
pub const MAX_NAME_BYTES: usize = 128;

/// Hard limits on one agent's runs. Every key is optional in the frontmatter;
/// a missing key takes the default named on the field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentLimits {
    /// Provider calls per run; default [`DEFAULT_MAX_ITERATIONS`] (16),
    /// accepted 1..=256.
    pub max_iterations: u32,
    /// Run deadline in seconds, accepted 1..=86400. When the file sets none
    /// the catalog uses its `default_timeout_secs` input (config
    /// `default_run_timeout_secs`; [`DEFAULT_TIMEOUT_SECS`], 600, by default).
    pub timeout_secs: u64,
    /// Output tokens per provider call; default [`DEFAULT_MAX_OUTPUT_TOKENS`]
    /// (4096), accepted 1..=131072.
    pub max_output_tokens: u32,
    /// Delegations one run may start; default [`DEFAULT_MAX_CHILDREN`] (4),
    /// accepted 1..=64.
    pub max_children: u32,
    /// Tokens (prompt plus completion) one run and its foreground
    /// descendants may spend; unset by default (no budget), accepted
    /// 1..=10^12 ([`MAX_TOKENS_TOTAL_BOUND`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens_total: Option<u64>,
    /// USD one run and its foreground descendants may spend, more than 0;
    /// unset by default. Every profile they may run on needs prices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<Usd>,
}

impl AgentLimits {
    /// The documented defaults.
    pub const DEFAULT: AgentLimits = AgentLimits {
        max_iterations: DEFAULT_MAX_ITERATIONS,
        timeout_secs: DEFAULT_TIMEOUT_SECS,
        max_output_tokens: DEFAULT_MAX_OUTPUT_TOKENS,
        max_children: DEFAULT_MAX_CHILDREN,
        max_tokens_total: None,
        max_cost_usd: None,
    };
}

impl Default for AgentLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// How important a signal is. The contract's allowlist says which ones an
/// agent may emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Progress or a finding worth knowing.
    Info,
    /// Something the root agent should look at.
    Warning,
    /// A failure the root agent should act on.
    Error,
}

impl Severity {
    /// Every severity, in increasing order.
    pub const ALL: [Severity; 3] = [Severity::Info, Severity::Warning, Severity::Error];

    /// The stable text form.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }
}

/// What a background run of this agent may send to the root agent with
/// `emit_signal`. Without a contract the tool is not offered.
/// All limits are enforced by code; the model only supplies the payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SignalContract {
    /// How signals reach the root agent; default `queue`
    /// ([`DEFAULT_SIGNAL_DELIVERY`]).
    pub delivery: Delivery,
    /// Signals per run; default [`DEFAULT_MAX_SIGNALS`] (16), 1..=1000.
    pub max_signals: u32,
    /// Summary bytes; default [`DEFAULT_MAX_SUMMARY_BYTES`] (512), 1..=4096.
    pub max_summary_bytes: u32,
    /// Details JSON bytes; default [`DEFAULT_MAX_DETAILS_BYTES`] (4096),
    /// 0..=65536.
    pub max_details_bytes: u32,
    /// Least milliseconds between signals once the burst is spent; default
    /// [`DEFAULT_MIN_INTERVAL_MS`] (1000), 0..=3600000.
    pub min_interval_ms: u64,
    /// Signals allowed back to back; default [`DEFAULT_BURST`] (3), 1..=100.
    pub burst: u32,
    /// Severities the agent may use; default all ([`DEFAULT_SEVERITIES`]);
    /// must not be empty.
    pub severities: Vec<Severity>,
    /// Dedupe window in seconds; default [`DEFAULT_DEDUPE_WINDOW_SECS`] (60),
    /// 0..=86400.
    pub dedupe_window_secs: u64,
    /// Nesting depth of the details JSON; default [`DEFAULT_MAX_JSON_DEPTH`]
    /// (8), 1..=32.
    pub max_json_depth: u32,
}

impl Default for SignalContract {
    fn default() -> Self {
        Self {
            delivery: DEFAULT_SIGNAL_DELIVERY,
            max_signals: DEFAULT_MAX_SIGNALS,
            max_summary_bytes: DEFAULT_MAX_SUMMARY_BYTES,
            max_details_bytes: DEFAULT_MAX_DETAILS_BYTES,
            min_interval_ms: DEFAULT_MIN_INTERVAL_MS,
            burst: DEFAULT_BURST,
            severities: DEFAULT_SEVERITIES.to_vec(),
            dedupe_window_secs: DEFAULT_DEDUPE_WINDOW_SECS,
            max_json_depth: DEFAULT_MAX_JSON_DEPTH,
        }
    }
}

impl SignalContract {
    /// Whether the contract allows `severity`.
    pub fn allows(&self, severity: Severity) -> bool {
        self.severities.contains(&severity)
    }
}

/// The frontmatter as serde_yaml parses it. `deny_unknown_fields` everywhere:
/// a misspelt key is an error, never ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Frontmatter {
    pub id: AgentId,
    pub description: String,
    pub llm_profile: String,
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default)]
    pub delegates: Vec<AgentId>,
    #[serde(default)]
    pub skills: Vec<String>,
    #[serde(default)]
    pub limits: AgentLimits,
    #[serde(default)]
    pub signal: Option<SignalContract>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Approval>,
}

/// Which of an agent's tools need a person's approval before they run
/// (frontmatter `approval:`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Approval {
    /// `approval: all`: every tool call of the agent.
    All(AllTools),
    /// `approval: [shell, write_file]`: these tools.
    Tools(Vec<String>),
}

/// The keyword `all` of [`Approval::All`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllTools {
    /// `all`.
    All,
}

impl Approval {
    /// Whether a call of `tool` needs approval.
    pub fn covers(&self, tool: &str) -> bool {
        match self {
            Self::All(_) => true,
            Self::Tools(tools) => tools.iter().any(|t| t == tool),
        }
    }
}

/// One agent: its frontmatter with defaults applied, its role prompt and the
/// hash that identifies this exact definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AgentDefinition {
    /// The agent's name, unique in the catalog.
    pub id: AgentId,
    /// One line for the delegating model: what the agent is good at.
    pub description: String,
    /// The provider profile (config `[providers.NAME]`) the agent runs on.
    pub llm_profile: String,
    /// Registered tools the agent may use, in the order written.
    pub tools: Vec<String>,
    /// Agents this one may delegate to, in the order written.
    pub delegates: Vec<AgentId>,
    /// Skills the agent may read.
    pub skills: Vec<String>,
    /// Hard limits on its runs.
    pub limits: AgentLimits,
    /// What it may signal when run in the background; `None` = no signals.
    pub signal: Option<SignalContract>,
    /// Tools whose calls need a person's approval (`None` = none by definition).
    pub approval: Option<Approval>,
    /// The role prompt: the Markdown after the frontmatter, with CRLF turned
    /// into LF, leading blank lines and trailing whitespace removed.
    pub body: String,
    /// Lowercase hex SHA-256 of a domain tag, the frontmatter as compact JSON
    /// with defaults applied (so YAML key order, quoting, comments and
    /// whitespace do not change it; any value change does) and the body.
    pub definition_hash: String,
    /// The file it came from, relative to the definitions root.
    pub source_file: PathBuf,
}

impl AgentDefinition {
    /// The first 12 hex digits of the hash, for listings.
    pub fn hash_prefix(&self) -> &str {
        self.definition_hash
            .get(..12)
            .unwrap_or(&self.definition_hash)
    }

    pub(crate) fn from_frontmatter(fm: Frontmatter, body: String, source_file: PathBuf) -> Self {
        let definition_hash = definition_hash(&fm, &body);
        Self {
            id: fm.id,
            description: fm.description,
            llm_profile: fm.llm_profile,
            tools: fm.tools,
            delegates: fm.delegates,
            skills: fm.skills,
            limits: fm.limits,
            signal: fm.signal,
            approval: fm.approval,
            body,
            definition_hash,
            source_file,
        }
    }
}

/// Domain separator so a definition hash can never equal a hash of other data.
const HASH_DOMAIN: &[u8] = b"keel-agent-definition/v1\n";

/// SHA-256 over a domain tag, the frontmatter serialized as compact JSON with
/// defaults applied (struct field order, so YAML key order, quoting, comments
/// and whitespace do not matter, while any value change does), a newline (the
/// compact JSON never contains a raw one), and the normalized body.
pub(crate) fn definition_hash(fm: &Frontmatter, body: &str) -> String {
    let mut h = Sha256::new();
    h.update(HASH_DOMAIN);
    // Serializing plain structs of strings, integers and enums cannot fail;
    // if it ever did, hash the error text rather than panic.
    match serde_json::to_vec(fm) {
        Ok(json) => h.update(&json),
        Err(e) => h.update(e.to_string().as_bytes()),
    }
    h.update(b"\n");
    h.update(body.as_bytes());
    let digest = h.finalize();
    let mut hex = String::with_capacity(64);
    for b in digest {
        hex.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        hex.push(char::from(b"0123456789abcdef"[usize::from(b & 0xf)]));
    }
    hex
}
