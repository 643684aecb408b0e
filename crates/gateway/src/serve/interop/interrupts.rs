//! AG-UI interrupts and resume: a run whose turn paused for approvals ends
//! with the interrupt outcome, one [`Interrupt`] per call waiting; a later
//! `RunAgentInput` whose `resume` answers them commits each answer as a
//! decision (the engine path of `POST /api/approvals/{id}`) and streams the
//! continuation turn the decisions start as its run.

use std::sync::Arc;

use axum::response::Response;
use futures::StreamExt;
use keel_core::{AgentId, ApprovalId, SessionId};
use keel_store::{Decision, SessionRecord};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::agui::{
    bad, run_error, run_events, sse, sse_response, AgUiError, AgUiEvent, KeelRef, RunEncoder,
    CHANNEL,
};
use crate::serve::api::{Approval, Timestamp, TurnOrigin, PREVIEW_BYTES};
use crate::serve::problem::ApiError;
use crate::serve::Shared;

/// `reason` of the interrupts keel raises: a tool call waits for approval.
pub const APPROVAL_REASON: &str = "tool_approval";

/// A tool call that waits for a person's approval (a keel approval).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interrupt {
    /// The approval's id (`POST /api/approvals/{id}` decides it too).
    pub id: String,
    /// [`APPROVAL_REASON`].
    pub reason: String,
    /// For a person: which tool waits.
    pub message: String,
    /// The call it concerns (its `TOOL_CALL_START` is in the same run).
    pub tool_call_id: String,
    /// The answer a resume entry's `payload` carries.
    pub response_schema: Value,
    /// When it expires as a denial, if nobody decides.
    pub expires_at: Timestamp,
    /// keel's view of the call.
    pub metadata: InterruptMetadata,
}

/// `metadata` of an interrupt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterruptMetadata {
    /// The call.
    pub keel: PausedCall,
}

/// A call that waits, as keel keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PausedCall {
    /// The tool.
    pub tool: String,
    /// Its arguments, as the model sent them.
    pub arguments: Value,
    /// The agent that asked.
    pub agent: String,
}

/// What a resume entry's `payload` must be for an approval.
fn response_schema() -> Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "decision": {"type": "string", "enum": ["approve", "approve_always", "deny"]},
            "reason": {"type": "string"}
        },
        "required": ["decision"],
        "additionalProperties": false
    })
}

impl From<&Approval> for Interrupt {
    fn from(a: &Approval) -> Self {
        Self {
            id: a.id.to_string(),
            reason: APPROVAL_REASON.to_owned(),
            message: format!(
                "{} wants to run {}: approve, approve_always or deny",
                a.agent, a.tool
            ),
            tool_call_id: a.tool_call_id.clone(),
            response_schema: response_schema(),
            expires_at: a.expires_at,
            metadata: InterruptMetadata {
                keel: PausedCall {
                    tool: a.tool.clone(),
                    arguments: a.arguments.clone(),
                    agent: a.agent.clone(),
                },
            },
        }
    }
}

/// One resume entry, read as a decision.
#[derive(Debug)]
pub(super) struct Answer {
    interrupt_id: String,
    decision: Decision,
    reason: Option<String>,
    /// `status: cancelled`: the client abandoned the interrupt.
    abandoned: bool,
}

/// What the model reads as the reason of an abandoned interrupt.
const ABANDONED: &str = "the client abandoned the interrupt";

fn read_answer(i: usize, entry: &Value) -> Result<Answer, AgUiError> {
    let at = format!("resume[{i}]");
    let interrupt_id = match entry.get("interruptId") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => s.clone(),
        _ => {
            return Err(bad(format!(
                "{at}.interruptId must be a string of 1 to 256 bytes"
            )))
        }
    };
    let reason_of = |payload: &Value| match payload.get("reason") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(r)) => Ok(Some(r.clone())),
        Some(_) => Err(bad(format!("{at}.payload.reason must be a string"))),
    };
    let payload = entry.get("payload").unwrap_or(&Value::Null);
    match entry.get("status").and_then(Value::as_str) {
        Some("resolved") => {
            let decision = match payload.get("decision").and_then(Value::as_str) {
                Some("approve") => Decision::Approve,
                Some("approve_always") => Decision::ApproveAlways,
                Some("deny") => Decision::Deny,
                _ => {
                    return Err(bad(format!(
                        "{at}.payload must be {{\"decision\": \"approve\" | \"approve_always\" \
                         | \"deny\", \"reason\"?: string}}"
                    )))
                }
            };
            Ok(Answer {
                interrupt_id,
                decision,
                reason: reason_of(payload)?,
                abandoned: false,
            })
        }
        Some("cancelled") => Ok(Answer {
            interrupt_id,
            decision: Decision::Deny,
            reason: Some(reason_of(payload)?.unwrap_or_else(|| ABANDONED.to_owned())),
            abandoned: true,
        }),
        _ => Err(bad(format!(
            "{at}.status must be \"resolved\" or \"cancelled\""
        ))),
    }
}

pub(super) fn read_resume(resume: &[Value]) -> Result<Vec<Answer>, AgUiError> {
    let answers = resume
        .iter()
        .enumerate()
        .map(|(i, e)| read_answer(i, e))
        .collect::<Result<Vec<_>, _>>()?;
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = answers
        .iter()
        .find(|a| !seen.insert(a.interrupt_id.as_str()))
    {
        return Err(bad(format!(
            "`resume` answers interrupt {:?} twice",
            twice.interrupt_id
        )));
    }
    Ok(answers)
}

/// A run whose input answers the interrupts the thread's last run ended
/// with: each answer is committed as a decision (as by `POST
/// /api/approvals/{id}`), then the continuation turn the decisions start is
/// the run. Refused before anything is decided when an interrupt of that
/// run has no answer, or an answer resolves one that is not pending.
pub(super) async fn resume(
    shared: Arc<Shared>,
    agent: Option<AgentId>,
    thread_id: String,
    run_id: String,
    answers: Vec<Answer>,
) -> Result<Response, AgUiError> {
    let store = &shared.app.store;
    let mut dialog: Option<SessionRecord> = None;
    let mut known = Vec::new();
    let mut notices = Vec::new();
    for answer in answers {
        let record = match answer.interrupt_id.parse::<ApprovalId>() {
            Ok(id) => store.get_approval(id).await.map_err(ApiError::from)?,
            Err(_) => None,
        };
        // A background run's approval is no interrupt of a run: not answered here.
        let record = record.filter(|r| r.run_id.is_none());
        let session = match &record {
            Some(r) => store
                .get_session(r.session_id)
                .await
                .map_err(ApiError::from)?
                .filter(|s| {
                    s.deleted_at_ms.is_none() && s.channel == CHANNEL && s.chat_id == thread_id
                }),
            None => None,
        };
        let (Some(record), Some(session)) = (record, session) else {
            // An answer to nothing this thread asked: the run goes on without it.
            notices.push(format!(
                "resume entry {:?} names no interrupt of this thread; it was ignored",
                answer.interrupt_id
            ));
            continue;
        };
        match &dialog {
            Some(d) if d.id != session.id => {
                return Err(bad(
                    "`resume` answers interrupts of two runs; answer those of the thread's last \
                     interrupted run",
                ))
            }
            Some(_) => {}
            None => dialog = Some(session),
        }
        known.push((answer, record));
    }
    let Some(dialog) = dialog else {
        return Err(ApiError::Conflict(
            "`resume` names no interrupt of this thread: there is nothing to resume".to_owned(),
        )
        .into());
    };
    super::check_agent(&dialog, agent.as_ref())?;
    let resuming = shared.conversations.resuming(&shared, dialog.id).await?;
    let mut pending = shared
        .app
        .manager
        .approvals(dialog.id, true)
        .await
        .map_err(ApiError::from)?;
    // What the paused root turn waits for; a background run's approvals wait apart.
    pending.retain(|a| a.run_id.is_none());
    let missing: Vec<String> = pending
        .iter()
        .filter(|p| !known.iter().any(|(_, r)| r.id == p.id))
        .map(|p| p.id.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(bad(format!(
            "`resume` must answer every interrupt of the run it continues; nothing answers {}",
            missing.join(", ")
        )));
    }
    let mut decide = Vec::new();
    for (answer, record) in known {
        if pending.iter().any(|p| p.id == record.id) {
            decide.push((answer, record));
        } else if !answer.abandoned {
            // Decided already, expired or superseded: nothing runs twice.
            return Err(ApiError::from(keel_engine::EngineError::ApprovalDecided {
                id: record.id,
                status: record.status.to_string(),
            })
            .into());
        }
    }
    if decide.is_empty() {
        return Err(ApiError::Conflict(
            "no interrupt of this thread waits for an answer any more: they were decided or \
             expired, and the dialog went on"
                .to_owned(),
        )
        .into());
    }
    for (answer, record) in &decide {
        shared
            .app
            .manager
            .decide_approval(
                record.id,
                Some(dialog.id),
                answer.decision,
                answer.reason.clone(),
            )
            .await
            .map_err(ApiError::from)?;
    }
    shared.conversations.threads().moved(&thread_id, dialog.id);
    let calls: Vec<String> = decide.iter().map(|(_, r)| r.tool_call_id.clone()).collect();
    let events = futures::stream::once(async move {
        let Some(feed) = resuming.feed(&shared).await else {
            let closing = run_error("closing", "the server is shutting down");
            return futures::stream::once(async move { sse(&closing) }).boxed();
        };
        let feed = feed.with_runs(shared.projections.clone());
        let keel = KeelRef {
            dialog_id: feed.dialog.as_uuid(),
            turn_id: feed.turn,
            checkpoint_id: None,
            forked_from: None,
            turn_origin: TurnOrigin::AgentContinuation,
        };
        let encoder = RunEncoder::new(&thread_id, &run_id, keel);
        let mut first = vec![encoder.start()];
        first.extend(notices.into_iter().map(|text| AgUiEvent::Custom {
            name: "keel.notice".to_owned(),
            value: Value::String(text),
        }));
        first.extend(resumed_results(&shared, feed.dialog, &calls).await);
        run_events(shared, feed, encoder, first).boxed()
    })
    .flatten();
    Ok(sse_response(events))
}

/// `TOOL_CALL_RESULT`s of the calls a resume decided: what the model reads
/// for each (the approved tool's output, or the denial), committed before
/// the continuation turn started.
async fn resumed_results(shared: &Shared, dialog: SessionId, calls: &[String]) -> Vec<AgUiEvent> {
    let page = keel_store::MessagePage {
        visible_only: true,
        newest_first: true,
        cursor: None,
        limit: (calls.len() + 16).min(1000),
    };
    let messages = match shared.app.store.load_message_page(dialog, page).await {
        Ok(messages) => messages,
        Err(e) => {
            tracing::warn!(session_id = %dialog, error = %e, "cannot read the resumed calls' results; the run shows none");
            return Vec::new();
        }
    };
    calls
        .iter()
        .filter_map(|call| {
            let m = messages.iter().find(|m| {
                m.message.role == keel_core::Role::Tool
                    && m.message.tool_call_id.as_deref() == Some(call.as_str())
            })?;
            Some(AgUiEvent::ToolCallResult {
                message_id: format!("{dialog}-{}", m.seq),
                tool_call_id: call.clone(),
                content: keel_core::truncate_with_note(m.message.text(), PREVIEW_BYTES),
                role: "tool".to_owned(),
            })
        })
        .collect()
}
