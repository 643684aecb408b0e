//! `remember`, `recall` and `forget`: the root agent's session memory.
//!
//! A turn works on its own copy of the session's memory ([`TurnMemory`],
//! in the turn's extensions); what the tools change is committed with the
//! turn's answer, in the same transaction, or not at all. The bounds are the
//! session memory's: at most 256 entries, keys of 1 to 128 bytes, values of
//! at most 16 KiB.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use keel_core::{
    DelegationPolicy, Tool, ToolError, ToolExecutionContext, ToolOutput, ToolRegistry,
};
use parking_lot::Mutex;
use serde::Deserialize;

use super::{parse_args, MAX_TOOL_OUTPUT_BYTES};
use crate::error::Result;
use crate::state::{check_memory_entry, MemoryEntry};

/// Most entries `recall` lists at once.
const MAX_LISTED: usize = 50;
/// Longest value preview in a listing, in characters.
const PREVIEW_CHARS: usize = 120;

/// The session memory as a running turn sees it: the committed entries
/// plus the turn's own changes.
#[derive(Debug)]
pub(crate) struct TurnMemory {
    entries: Mutex<BTreeMap<String, MemoryEntry>>,
    changed: std::sync::atomic::AtomicBool,
}

impl TurnMemory {
    /// A turn's copy of `entries`.
    pub(crate) fn new(entries: BTreeMap<String, MemoryEntry>) -> Self {
        Self {
            entries: Mutex::new(entries),
            changed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The entries after the turn's changes, if it made any.
    pub(crate) fn changes(&self) -> Option<BTreeMap<String, MemoryEntry>> {
        self.changed
            .load(std::sync::atomic::Ordering::Acquire)
            .then(|| self.entries.lock().clone())
    }

    fn mark(&self) {
        self.changed
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

/// Registers the memory tools in `tools` (for the root agent).
pub fn register_memory_tools(tools: &mut ToolRegistry) -> Result<()> {
    tools.register(Arc::new(Remember))?;
    tools.register(Arc::new(Recall))?;
    tools.register(Arc::new(Forget))?;
    Ok(())
}

/// Whether `tools` holds the memory tools (the turn then carries a copy).
pub(crate) fn has_memory_tools(tools: &ToolRegistry) -> bool {
    tools.get(RECALL).is_some()
}

const REMEMBER: &str = "remember";
const RECALL: &str = "recall";
const FORGET: &str = "forget";

fn memory(ctx: &ToolExecutionContext) -> std::result::Result<&Arc<TurnMemory>, ToolError> {
    ctx.extensions
        .get::<Arc<TurnMemory>>()
        .ok_or_else(|| ToolError::Denied("session memory is not available here".into()))
}

struct Remember;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RememberArgs {
    key: String,
    value: String,
}

#[async_trait]
impl Tool for Remember {
    fn name(&self) -> &str {
        REMEMBER
    }

    fn description(&self) -> &str {
        "Store a fact in this dialog's memory under a short key (replacing what the key held); \
         it stays across turns and compactions. At most 256 entries, keys up to 128 bytes, \
         values up to 16 KiB."
    }

    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {
                "key": {"type": "string", "minLength": 1, "maxLength": 128, "description": "A short name for the fact."},
                "value": {"type": "string", "description": "The fact."},
            },
            "required": ["key", "value"],
            "additionalProperties": false,
        })
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RuntimeInjected
    }

    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> std::result::Result<ToolOutput, ToolError> {
        let RememberArgs { key, value } = parse_args(args)?;
        let memory = memory(ctx)?;
        let mut entries = memory.entries.lock();
        check_memory_entry(&entries, &key, &value)
            .map_err(|e| ToolError::InvalidArguments(e.to_string()))?;
        let replaced = entries
            .insert(
                key.clone(),
                MemoryEntry {
                    value,
                    metadata: serde_json::Value::Null,
                    created_at_ms: keel_core::time::now_ms(),
                },
            )
            .is_some();
        drop(entries);
        memory.mark();
        Ok(ToolOutput::text(if replaced {
            format!("replaced {key:?}")
        } else {
            format!("remembered {key:?}")
        }))
    }
}

struct Recall;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecallArgs {
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    query: Option<String>,
}

#[async_trait]
impl Tool for Recall {
    fn name(&self) -> &str {
        RECALL
    }

    fn description(&self) -> &str {
        "Read this dialog's memory: the value of `key`, the entries whose key or value contains \
         `query`, or (with neither) every key with the start of its value."
    }

    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {
                "key": {"type": "string", "description": "Read this entry in full."},
                "query": {"type": "string", "description": "List the entries containing this text (case-insensitive)."},
            },
            "additionalProperties": false,
        })
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RuntimeInjected
    }

    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> std::result::Result<ToolOutput, ToolError> {
        let RecallArgs { key, query } = parse_args(args)?;
        let memory = memory(ctx)?;
        let entries = memory.entries.lock();
        if let Some(key) = key {
            return Ok(match entries.get(&key) {
                Some(entry) => ToolOutput::bounded(entry.value.clone(), MAX_TOOL_OUTPUT_BYTES),
                None => ToolOutput::text(format!("no entry {key:?}")),
            });
        }
        let needle = query.map(|q| q.to_lowercase());
        let matching: Vec<(&String, &MemoryEntry)> = entries
            .iter()
            .filter(|(k, e)| {
                needle.as_ref().is_none_or(|n| {
                    k.to_lowercase().contains(n) || e.value.to_lowercase().contains(n)
                })
            })
            .collect();
        if matching.is_empty() {
            return Ok(ToolOutput::text("no entries".to_owned()));
        }
        let mut out = String::new();
        for (k, e) in matching.iter().take(MAX_LISTED) {
            out.push_str(&format!("{k}: {}\n", preview(&e.value)));
        }
        if matching.len() > MAX_LISTED {
            out.push_str(&format!(
                "… and {} more; narrow with `query`\n",
                matching.len() - MAX_LISTED
            ));
        }
        Ok(ToolOutput::bounded(out, MAX_TOOL_OUTPUT_BYTES))
    }
}

/// The start of `value` on one line.
pub(crate) fn preview(value: &str) -> String {
    let line: String = value
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(PREVIEW_CHARS)
        .collect();
    if value.chars().count() > PREVIEW_CHARS {
        format!("{line}…")
    } else {
        line
    }
}

struct Forget;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForgetArgs {
    key: String,
}

#[async_trait]
impl Tool for Forget {
    fn name(&self) -> &str {
        FORGET
    }

    fn description(&self) -> &str {
        "Delete an entry of this dialog's memory."
    }

    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {"key": {"type": "string", "description": "The entry's key."}},
            "required": ["key"],
            "additionalProperties": false,
        })
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RuntimeInjected
    }

    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> std::result::Result<ToolOutput, ToolError> {
        let ForgetArgs { key } = parse_args(args)?;
        let memory = memory(ctx)?;
        let removed = memory.entries.lock().remove(&key).is_some();
        if removed {
            memory.mark();
            Ok(ToolOutput::text(format!("forgot {key:?}")))
        } else {
            Ok(ToolOutput::text(format!("no entry {key:?}")))
        }
    }
}
