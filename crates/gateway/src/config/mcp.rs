//! `[mcp.NAME]`: the MCP servers whose tools keel's agents may use.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::ApprovalMode;

/// Default `mcp.NAME.timeout_secs`.
pub const DEFAULT_MCP_TIMEOUT_SECS: u64 = 30;
/// Largest `mcp.NAME.timeout_secs` (1 h).
pub const MAX_MCP_TIMEOUT_SECS: u64 = 3600;
/// Default `mcp.NAME.max_output_bytes` (64 KiB).
pub const DEFAULT_MCP_MAX_OUTPUT_BYTES: usize = 64 * 1024;
/// Smallest `mcp.NAME.max_output_bytes`.
pub const MIN_MCP_MAX_OUTPUT_BYTES: usize = 256;
/// Largest `mcp.NAME.max_output_bytes` (4 MiB).
pub const MAX_MCP_MAX_OUTPUT_BYTES: usize = 4 * 1024 * 1024;

/// `[mcp.NAME]`: one MCP server, started as a child process over stdio
/// (`command`) or reached over Streamable HTTP (`url`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpServerConfig {
    /// stdio: the program to start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// stdio: its arguments.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// stdio: names of environment variables passed through (the rest of
    /// keel's environment is cleared).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// stdio: its working directory (unset: the workspace root).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<PathBuf>,
    /// stdio: let the confined server open TCP connections and listen.
    pub network: bool,
    /// stdio: run the server unconfined where the kernel has no Landlock.
    pub unsandboxed: bool,
    /// Streamable HTTP: the endpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Streamable HTTP: header name → the environment variable holding its value.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub headers_env: BTreeMap<String, String>,
    /// The server's tools agents may use (unset: all of them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    /// Whether agents that are delegated to may use its tools.
    pub delegatable: bool,
    /// Seconds one call (and connecting at start-up) may take.
    pub timeout_secs: u64,
    /// Bytes of one result the model reads; the rest is cut with a note.
    pub max_output_bytes: usize,
    /// Whether calls of its tools wait for a person's approval (`always`,
    /// the default, or `never`).
    pub approval: ApprovalMode,
}

impl Default for McpServerConfig {
    fn default() -> Self {
        Self {
            command: None,
            args: Vec::new(),
            env: Vec::new(),
            cwd: None,
            network: false,
            unsandboxed: false,
            url: None,
            headers_env: BTreeMap::new(),
            tools: None,
            delegatable: false,
            timeout_secs: DEFAULT_MCP_TIMEOUT_SECS,
            max_output_bytes: DEFAULT_MCP_MAX_OUTPUT_BYTES,
            approval: ApprovalMode::Always,
        }
    }
}

/// Whether `name` may name an MCP server: `[a-z][a-z0-9_-]{0,31}`.
pub fn valid_mcp_server_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= 32
        && chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}
