//! A server's tool manifest: what keel commits at activation and validates
//! `mcp:` references against, and the names its tools are registered under.

use std::collections::{BTreeMap, BTreeSet};

use keel_store::{McpManifestRecord, StoreError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::McpServerConfig;
use crate::error::Result;

/// Longest tool name both provider APIs accept.
const MAX_TOOL_NAME_LEN: usize = 64;

/// The tools one server listed, in the order it listed them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpManifest {
    /// Its tools.
    pub tools: Vec<ManifestTool>,
}

/// One tool of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestTool {
    /// The server's name for it.
    pub name: String,
    /// What it does, as the server says.
    pub description: String,
    /// JSON Schema of its arguments, as the server sent it.
    pub input_schema: serde_json::Value,
}

/// A manifest tool the configuration allows, with its registered name.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AllowedTool {
    /// `mcp__SERVER__TOOL`: the name the model sees.
    pub registered: String,
    /// The manifest entry.
    pub tool: ManifestTool,
}

/// The name a server's tool is registered under: `mcp__SERVER__TOOL`, with
/// every character of the tool's name outside `[A-Za-z0-9_-]` written `_`
/// (what both provider APIs accept); `None` past 64 characters.
pub fn registered_name(server: &str, tool: &str) -> Option<String> {
    let safe: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = format!("mcp__{server}__{safe}");
    (!tool.is_empty() && name.len() <= MAX_TOOL_NAME_LEN).then_some(name)
}

impl McpManifest {
    /// The store record of `server`'s manifest, committed at `now_ms`.
    pub fn record(&self, server: &str, now_ms: i64) -> Result<McpManifestRecord> {
        let manifest = serde_json::to_string(self).map_err(|e| {
            StoreError::InvalidInput(format!("the manifest of {server} does not serialize: {e}"))
        })?;
        Ok(McpManifestRecord {
            server: server.to_owned(),
            hash: sha256_hex(manifest.as_bytes()),
            manifest,
            committed_at_ms: now_ms,
        })
    }

    /// The manifest a record holds.
    pub fn from_record(record: &McpManifestRecord) -> Result<Self> {
        serde_json::from_str(&record.manifest).map_err(|e| {
            StoreError::Corruption(format!("mcp_manifests.manifest of {}: {e}", record.server))
                .into()
        })
    }

    /// The tools `config` allows (its `tools` allow-list, else all), by MCP
    /// name, with their registered names. A tool whose name cannot be
    /// registered (too long, or equal to another's after rewriting) is
    /// left out with a logged warning, as is an allow-list entry the
    /// manifest lacks.
    pub(crate) fn allowed(
        &self,
        server: &str,
        config: &McpServerConfig,
    ) -> BTreeMap<String, AllowedTool> {
        let allow: Option<BTreeSet<&str>> = config
            .tools
            .as_ref()
            .map(|t| t.iter().map(String::as_str).collect());
        if let Some(allow) = &allow {
            for missing in allow
                .iter()
                .filter(|a| !self.tools.iter().any(|t| t.name == **a))
            {
                tracing::warn!(
                    server,
                    tool = missing,
                    "mcp.{server}.tools names a tool the server does not list"
                );
            }
        }
        let mut out = BTreeMap::new();
        let mut taken = BTreeSet::new();
        for tool in &self.tools {
            if allow
                .as_ref()
                .is_some_and(|a| !a.contains(tool.name.as_str()))
            {
                continue;
            }
            let Some(registered) = registered_name(server, &tool.name) else {
                tracing::warn!(server, tool = %tool.name, "MCP tool left out: its name is too long for the provider APIs");
                continue;
            };
            if !taken.insert(registered.clone()) {
                tracing::warn!(server, tool = %tool.name, registered, "MCP tool left out: another tool of the server has the same registered name");
                continue;
            }
            out.insert(
                tool.name.clone(),
                AllowedTool {
                    registered,
                    tool: tool.clone(),
                },
            );
        }
        out
    }

    /// Logs what changed since `previous` (tools added, removed, changed).
    pub(crate) fn log_changes_from(&self, previous: &McpManifest, server: &str) {
        if self == previous {
            return;
        }
        let before: BTreeMap<&str, &ManifestTool> = previous
            .tools
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let after: BTreeMap<&str, &ManifestTool> =
            self.tools.iter().map(|t| (t.name.as_str(), t)).collect();
        let added: Vec<&str> = after
            .keys()
            .filter(|k| !before.contains_key(*k))
            .copied()
            .collect();
        let removed: Vec<&str> = before
            .keys()
            .filter(|k| !after.contains_key(*k))
            .copied()
            .collect();
        let changed: Vec<&str> = after
            .iter()
            .filter(|(k, t)| before.get(*k).is_some_and(|b| b != *t))
            .map(|(k, _)| *k)
            .collect();
        tracing::warn!(
            server,
            ?added,
            ?removed,
            ?changed,
            "the tool manifest of MCP server {server} changed; definitions naming a removed tool no longer load"
        );
    }
}

/// SHA-256 of `bytes`, lowercase hex (a manifest's hash is that of its stored JSON).
fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_names_are_valid_for_both_provider_apis() {
        assert_eq!(
            registered_name("files", "read").as_deref(),
            Some("mcp__files__read")
        );
        assert_eq!(
            registered_name("files", "files.read/v2").as_deref(),
            Some("mcp__files__files_read_v2")
        );
        assert_eq!(registered_name("files", ""), None);
        assert_eq!(registered_name("files", &"x".repeat(60)), None);
        let name = registered_name("a", &"x".repeat(MAX_TOOL_NAME_LEN - 8)).unwrap();
        assert_eq!(name.len(), MAX_TOOL_NAME_LEN);
    }

    fn tool(name: &str) -> ManifestTool {
        ManifestTool {
            name: name.to_owned(),
            description: String::new(),
            input_schema: serde_json::json!({"type": "object"}),
        }
    }

    #[test]
    fn the_allow_list_and_name_collisions_decide_what_is_registered() {
        let manifest = McpManifest {
            tools: vec![tool("a.b"), tool("a_b"), tool("c"), tool("d")],
        };
        let all = manifest.allowed("s", &McpServerConfig::default());
        assert_eq!(all.keys().collect::<Vec<_>>(), ["a.b", "c", "d"]);
        assert_eq!(all["a.b"].registered, "mcp__s__a_b");
        let config = McpServerConfig {
            tools: Some(vec!["c".into(), "gone".into()]),
            ..McpServerConfig::default()
        };
        assert_eq!(
            manifest.allowed("s", &config).keys().collect::<Vec<_>>(),
            ["c"]
        );
        // The hash follows every value.
        let mut other = manifest.clone();
        other.tools[2].description = "changed".into();
        let hash = |m: &McpManifest| m.record("s", 0).unwrap().hash;
        assert_ne!(hash(&manifest), hash(&other));
        assert_eq!(hash(&manifest).len(), 64);
    }
}
