//! `emit_signal`: how a background run tells the root agent something
//! before it finishes.
//!
//! The tool exists only in background runs whose definition has a signal
//! contract. The coordinator checks what the payload alone decides
//! (severity allowlist, summary and details bytes, JSON depth); the store
//! checks, in the insert's transaction, what depends on earlier signals
//! (count per run, burst and refill, dedupe window) and the session's inbox
//! capacity (completion slots reserved first). An accepted signal is on the
//! session feed at once ([`SessionEvent::Signal`]); its delivery is `queue`
//! (answered by a continuation turn) or `steer` (admitted into the running
//! root turn at its next model call; with no turn running, a continuation).

use std::sync::{Arc, Weak};

use async_trait::async_trait;
use keel_catalog::{Severity, SignalContract};
use keel_core::time::now_ms;
use keel_core::{
    DelegationPolicy, Delivery, EventId, RunId, Tool, ToolError, ToolExecutionContext, ToolOutput,
};
use keel_store::{EventStatus, InboxEvent, NewSignal, SignalCommit, SignalLimits, StoreError};
use serde::Deserialize;
use serde_json::Value;

use super::context::AgentExecutionContext;
use super::AgentCoordinator;
use crate::error::{EngineError, Result};
use crate::events::SessionEvent;

/// Name of the emit_signal tool.
pub(crate) const EMIT_SIGNAL_TOOL: &str = "emit_signal";

/// Longest dedupe key, in bytes.
const MAX_DEDUPE_KEY_BYTES: usize = 128;

/// A signal of a background run, as clients and the chat show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalView {
    /// The inbox event carrying it.
    pub event_id: EventId,
    /// The run that emitted it.
    pub run_id: Option<RunId>,
    /// That run's agent.
    pub agent_id: String,
    /// `info`, `warning` or `error`.
    pub severity: String,
    /// One line for the user and the root agent.
    pub summary: String,
    /// Optional structured details (bounded by the contract).
    pub details: Option<Value>,
    /// Queue (a continuation turn) or steer (into the running turn).
    pub delivery: Delivery,
    /// Where delivery stands: pending, leased, admitted, consumed,
    /// superseded (its run was cancelled) or dead-lettered.
    pub status: EventStatus,
    /// When it was emitted (Unix ms).
    pub created_at_ms: i64,
}

impl SignalView {
    /// The view of a stored signal event (`None` for other event types).
    pub fn from_event(event: &InboxEvent) -> Option<SignalView> {
        if event.event_type != keel_store::EventType::Signal {
            return None;
        }
        let payload: Value = serde_json::from_str(&event.payload_json).unwrap_or(Value::Null);
        let text = |k: &str| {
            payload
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        Some(SignalView {
            event_id: event.id,
            run_id: event.run_id,
            agent_id: text("agent_id"),
            severity: event.severity.clone().unwrap_or_else(|| "info".into()),
            summary: text("summary"),
            details: payload.get("details").filter(|d| !d.is_null()).cloned(),
            delivery: event.delivery,
            status: event.status,
            created_at_ms: event.created_at_ms,
        })
    }
}

/// What the model sends.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalArgs {
    severity: Severity,
    summary: String,
    #[serde(default)]
    details: Option<Value>,
    #[serde(default)]
    dedupe_key: Option<String>,
}

/// Nesting depth of a JSON value (a scalar is 0, `[1]` is 1).
fn json_depth(v: &Value) -> u32 {
    match v {
        Value::Array(items) => 1 + items.iter().map(json_depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(json_depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Checks what the payload alone decides; returns the refusal's text.
fn check_payload(contract: &SignalContract, args: &SignalArgs) -> Result<(), String> {
    if !contract.severities.contains(&args.severity) {
        let allowed: Vec<&str> = contract.severities.iter().map(|s| s.as_str()).collect();
        return Err(format!(
            "severity {} is not allowed for this agent; use one of: {}",
            args.severity.as_str(),
            allowed.join(", ")
        ));
    }
    if args.summary.trim().is_empty() {
        return Err("summary is empty".into());
    }
    if args.summary.len() > contract.max_summary_bytes as usize {
        return Err(format!(
            "summary is {} bytes; at most {} are allowed",
            args.summary.len(),
            contract.max_summary_bytes
        ));
    }
    if let Some(details) = &args.details {
        let bytes = details.to_string().len();
        if bytes > contract.max_details_bytes as usize {
            return Err(format!(
                "details are {bytes} bytes of JSON; at most {} are allowed",
                contract.max_details_bytes
            ));
        }
        let depth = json_depth(details);
        if depth > contract.max_json_depth {
            return Err(format!(
                "details nest {depth} levels deep; at most {} are allowed",
                contract.max_json_depth
            ));
        }
    }
    if let Some(key) = &args.dedupe_key {
        if key.is_empty() || key.len() > MAX_DEDUPE_KEY_BYTES {
            return Err(format!(
                "dedupe_key must be 1 to {MAX_DEDUPE_KEY_BYTES} bytes"
            ));
        }
    }
    Ok(())
}

impl AgentCoordinator {
    /// Records a signal of the background run `context` under `contract`
    /// and delivers it; returns the tool's answer. Refusals are
    /// [`EngineError::SignalRefused`] or [`EngineError::InboxFull`].
    async fn emit_signal(
        &self,
        context: &AgentExecutionContext,
        contract: &SignalContract,
        args: SignalArgs,
    ) -> Result<String> {
        check_payload(contract, &args).map_err(EngineError::SignalRefused)?;
        let (severity, summary, details) = (args.severity.as_str(), args.summary, args.details);
        let mut payload = serde_json::json!({
            "agent_id": context.agent_id.as_str(),
            "summary": summary,
        });
        if let Some(details) = &details {
            payload["details"] = details.clone();
        }
        let now = now_ms();
        let commit = self
            .store
            .insert_signal(NewSignal {
                run_id: context.run_id,
                execution_id: context.execution_id.clone(),
                dedupe_key: args.dedupe_key,
                delivery: contract.delivery,
                severity: Some(severity.to_owned()),
                payload_json: payload.to_string(),
                inbox_capacity: self.config.max_pending_inbox_events_per_session,
                limits: SignalLimits {
                    max_signals: contract.max_signals,
                    burst: contract.burst,
                    min_interval_ms: contract.min_interval_ms,
                    dedupe_window_ms: contract.dedupe_window_secs.saturating_mul(1000),
                },
                now_ms: now,
            })
            .await
            .map_err(|e| match e {
                StoreError::InboxFull { capacity, .. } => EngineError::InboxFull { capacity },
                StoreError::Stale(_) => EngineError::SignalRefused(
                    "this run is no longer running; the signal was dropped".into(),
                ),
                other => other.into(),
            })?;
        let root = context.root_session_id;
        let event_id = match commit {
            SignalCommit::Accepted { event_id } => event_id,
            SignalCommit::Deduplicated { event_id } => {
                return Ok(format!(
                    "signal {event_id} with this dedupe_key was sent already; nothing new was sent"
                ))
            }
            SignalCommit::TooMany { max_signals } => {
                return Err(EngineError::SignalRefused(format!(
                    "this run sent its {max_signals} signals; report the rest in your result"
                )))
            }
            SignalCommit::TooSoon { retry_after_ms } => {
                return Err(EngineError::SignalRefused(format!(
                    "signals are rate-limited; the next one fits in {retry_after_ms} ms"
                )))
            }
        };
        self.changed(root).await;
        if let Some((events, manager)) = self.manager.get() {
            let view = SignalView {
                event_id,
                run_id: Some(context.run_id),
                agent_id: context.agent_id.as_str().to_owned(),
                severity: severity.to_owned(),
                summary,
                details,
                delivery: contract.delivery,
                status: EventStatus::Pending,
                created_at_ms: now,
            };
            events.publish(root, SessionEvent::Signal(Box::new(view)));
            if let Some(manager) = manager.upgrade() {
                match contract.delivery {
                    Delivery::Steer => manager.steer_signals(root).await,
                    Delivery::Queue => manager.wake_inbox(root),
                }
            }
        }
        let how = match contract.delivery {
            Delivery::Steer => "the root agent reads it at its next step",
            Delivery::Queue => "the root agent reads it in its next turn",
        };
        Ok(format!("signal {event_id} sent; {how}"))
    }
}

/// `emit_signal`: offered to background runs whose definition has a signal
/// contract; see the module docs.
pub(crate) struct EmitSignalTool {
    coordinator: Weak<AgentCoordinator>,
    contract: SignalContract,
    description: String,
}

impl EmitSignalTool {
    /// The tool of a run under `contract`.
    pub(crate) fn new(coordinator: Weak<AgentCoordinator>, contract: SignalContract) -> Self {
        let when = match contract.delivery {
            Delivery::Steer => "it reaches the root agent while it works, at its next step",
            Delivery::Queue => "it reaches the root agent in its next turn",
        };
        let description = format!(
            "Tell the root agent something now, before your result: progress, a finding or a \
             problem it should act on ({when}). At most {} signals per run; repeat a \
             dedupe_key to avoid sending the same news twice.",
            contract.max_signals
        );
        Self {
            coordinator,
            contract,
            description,
        }
    }
}

#[async_trait]
impl Tool for EmitSignalTool {
    fn name(&self) -> &str {
        EMIT_SIGNAL_TOOL
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn parameters(&self) -> Value {
        let severities: Vec<&str> = self
            .contract
            .severities
            .iter()
            .map(|s| s.as_str())
            .collect();
        serde_json::json!({
            "type": "object",
            "properties": {
                "severity": {"type": "string", "enum": severities},
                "summary": {"type": "string", "description": "one line for the root agent",
                            "maxLength": self.contract.max_summary_bytes},
                "details": {"description": "optional structured details (any JSON)"},
                "dedupe_key": {"type": "string", "description": "the same key again soon returns the earlier signal"}
            },
            "required": ["severity", "summary"],
            "additionalProperties": false
        })
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RuntimeInjected
    }

    async fn execute(
        &self,
        args: Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let coordinator = self
            .coordinator
            .upgrade()
            .ok_or_else(|| ToolError::Failed("the agent runtime is shutting down".into()))?;
        let context = match (
            ctx.run_id,
            ctx.extensions.get::<Arc<AgentExecutionContext>>(),
        ) {
            (Some(run), Some(c)) if c.run_id == run => Arc::clone(c),
            _ => return Err(EngineError::MissingCallerIdentity.into_tool_error()),
        };
        let args: SignalArgs =
            serde_json::from_value(args).map_err(|e| ToolError::InvalidArguments(e.to_string()))?;
        coordinator
            .emit_signal(&context, &self.contract, args)
            .await
            .map(ToolOutput::text)
            .map_err(EngineError::into_tool_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: Value) -> SignalArgs {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_payload_is_checked_against_the_contract() {
        let contract = SignalContract {
            severities: vec![Severity::Warning, Severity::Error],
            max_summary_bytes: 10,
            max_details_bytes: 20,
            max_json_depth: 2,
            ..SignalContract::default()
        };
        let check = |v: Value| check_payload(&contract, &args(v));
        assert_eq!(
            check(serde_json::json!({"severity": "warning", "summary": "disk full"})),
            Ok(())
        );
        let refusals = [
            serde_json::json!({"severity": "info", "summary": "x"}),
            serde_json::json!({"severity": "error", "summary": " "}),
            serde_json::json!({"severity": "error", "summary": "01234567890"}),
            serde_json::json!({"severity": "error", "summary": "x", "details": "012345678901234567890"}),
            serde_json::json!({"severity": "error", "summary": "x", "details": [[[1]]]}),
            serde_json::json!({"severity": "error", "summary": "x", "dedupe_key": ""}),
        ];
        let texts: Vec<String> = refusals
            .into_iter()
            .map(|v| check(v).unwrap_err())
            .collect();
        insta::assert_debug_snapshot!(texts);
    }

    #[test]
    fn json_depth_counts_containers() {
        assert_eq!(json_depth(&serde_json::json!(1)), 0);
        assert_eq!(json_depth(&serde_json::json!({"a": [1, {"b": 2}]})), 3);
        assert_eq!(json_depth(&serde_json::json!([])), 1);
    }
}
