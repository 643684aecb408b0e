//! AG-UI (protocol 1.0) on `keel serve`: `POST /ag-ui` (the root agent)
//! or `POST /ag-ui/{agent}` takes a `RunAgentInput` and answers one run as
//! server-sent AG-UI events; `GET /ag-ui/threads/{thread_id}` streams the
//! thread's continuation turns (answers to background results) as runs of
//! their own.
//!
//! A run is one keel turn: `RUN_STARTED`; per model call `STEP_STARTED`,
//! its text as `TEXT_MESSAGE_START/CONTENT/END`, `STEP_FINISHED`; each
//! tool call keel ran as `TOOL_CALL_START/ARGS/END` and its
//! `TOOL_CALL_RESULT`; sub-agent runs as `ACTIVITY_SNAPSHOT`s; then
//! `RUN_FINISHED` once the turn is saved (with the interrupt outcome when
//! it paused for approvals, which a `resume` input answers: `interrupts`),
//! or `RUN_ERROR`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use keel_core::{AgentId, SessionId};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;
use uuid::Uuid;

use super::interrupts::{read_resume, resume, Answer};
pub use super::interrupts::{Interrupt, InterruptMetadata, PausedCall, APPROVAL_REASON};
use super::transcript::{Said, Speaker};
use super::{
    chat_id, checked_texts, paused_for, Conversation, Conversations, Fed, Scope, TurnFeed,
};
use crate::serve::api::{AgentRun, Approval, TokenUsage as KeelUsage, TurnOrigin};
use crate::serve::frames::ServerFrame;
use crate::serve::problem::ApiError;
use crate::serve::Shared;

/// Channel of the dialogs AG-UI clients talk in; the chat is the thread id.
pub const CHANNEL: &str = "ag-ui";
/// The AG-UI protocol version keel speaks.
pub const PROTOCOL_VERSION: &str = "1.0";
/// `activityType` of the activity messages that show sub-agent runs.
pub const RUN_ACTIVITY: &str = "keel.agent_run";

// ── events ───────────────────────────────────────────────────────────────

/// Token usage of a run's model calls, AG-UI's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Their sum.
    pub total_tokens: u64,
}

/// How a run that did not fail ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Outcome {
    /// It completed.
    Success,
    /// It paused: tool calls wait for a person's decision, which a
    /// resuming run (`resume`) gives.
    Interrupt {
        /// One per call waiting (at least one).
        interrupts: Vec<Interrupt>,
    },
    /// It was stopped before it completed (nothing of it was saved).
    Cancelled,
}

/// Where keel keeps a run (in an event's `metadata`, under `keel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeelRef {
    /// The dialog the thread's conversation lives in.
    pub dialog_id: Uuid,
    /// The keel turn of the run.
    pub turn_id: Uuid,
    /// The turn's checkpoint, once saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_id: Option<Uuid>,
    /// The dialog this one was forked from, when the history was edited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<Uuid>,
    /// `user`, or `agent_continuation` for a run answering background results.
    pub turn_origin: TurnOrigin,
}

/// `metadata` of an event: keel's references.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    /// Where keel keeps the run.
    pub keel: KeelRef,
}

/// The AG-UI events keel emits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "SCREAMING_SNAKE_CASE",
    rename_all_fields = "camelCase"
)]
pub enum AgUiEvent {
    /// A run begins.
    RunStarted {
        /// The thread.
        thread_id: String,
        /// The run.
        run_id: String,
        /// The protocol version keel speaks.
        protocol_version: String,
        /// Where keel keeps it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        metadata: Option<Metadata>,
    },
    /// A run ended without failing.
    RunFinished {
        /// The thread.
        thread_id: String,
        /// The run.
        run_id: String,
        /// How it ended.
        outcome: Outcome,
        /// Tokens of its model calls.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        usage: Vec<TokenUsage>,
        /// Where keel keeps it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        metadata: Option<Metadata>,
    },
    /// A run failed; nothing of it was saved.
    RunError {
        /// What went wrong.
        message: String,
        /// For a program.
        code: String,
    },
    /// A model call begins.
    StepStarted {
        /// `model_call_<n>`.
        step_name: String,
    },
    /// A model call ended.
    StepFinished {
        /// `model_call_<n>`.
        step_name: String,
    },
    /// A model call's text begins.
    TextMessageStart {
        /// The message.
        message_id: String,
        /// Always `assistant`.
        role: String,
    },
    /// More of the text.
    TextMessageContent {
        /// The message.
        message_id: String,
        /// The text.
        delta: String,
    },
    /// The text is complete.
    TextMessageEnd {
        /// The message.
        message_id: String,
    },
    /// A tool call keel runs.
    ToolCallStart {
        /// The call.
        tool_call_id: String,
        /// The tool.
        tool_call_name: String,
        /// The message of the model call that asked for it, when it had text.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent_message_id: Option<String>,
    },
    /// The call's arguments (JSON text, whole).
    ToolCallArgs {
        /// The call.
        tool_call_id: String,
        /// The arguments.
        delta: String,
    },
    /// The arguments are complete.
    ToolCallEnd {
        /// The call.
        tool_call_id: String,
    },
    /// What the tool returned (at most 2 KiB shown).
    ToolCallResult {
        /// The tool message.
        message_id: String,
        /// The call.
        tool_call_id: String,
        /// The result.
        content: String,
        /// Always `tool`.
        role: String,
    },
    /// A sub-agent run as it is now.
    ActivitySnapshot {
        /// `run-<run id>`: one activity message per run.
        message_id: String,
        /// [`RUN_ACTIVITY`].
        activity_type: String,
        /// The run (keel's `AgentRun`).
        content: Value,
        /// Always `true`: the snapshot replaces the previous one.
        replace: bool,
    },
    /// A notice about the run that is not part of the conversation.
    Custom {
        /// `keel.notice`.
        name: String,
        /// The text.
        value: Value,
    },
}

pub(super) fn run_error(code: &str, message: impl Into<String>) -> AgUiEvent {
    AgUiEvent::RunError {
        message: message.into(),
        code: code.to_owned(),
    }
}

/// A request refused before its run started: an HTTP error status with a
/// `RUN_ERROR`-shaped JSON body (the run never started, so no stream).
#[derive(Debug, Clone, PartialEq)]
pub struct AgUiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// For a program (`bad_request`, `not_found` …).
    pub code: &'static str,
    /// For a person.
    pub message: String,
}

impl AgUiError {
    /// The body: a `RUN_ERROR` event.
    pub fn body(&self) -> AgUiEvent {
        run_error(self.code, self.message.clone())
    }
}

impl From<ApiError> for AgUiError {
    fn from(e: ApiError) -> Self {
        Self {
            status: e.status(),
            code: e.code(),
            message: e.to_string(),
        }
    }
}

impl IntoResponse for AgUiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

pub(super) fn bad(message: impl Into<String>) -> AgUiError {
    ApiError::BadRequest(message.into()).into()
}

// ── from keel frames to AG-UI events ─────────────────────────────────────

/// Turns one keel turn's frames into one AG-UI run, keeping the protocol's
/// order: everything the run opened (text messages, steps) is closed
/// before its `RUN_FINISHED`; tool calls open and close together.
#[derive(Debug, Clone)]
pub struct RunEncoder {
    thread_id: String,
    run_id: String,
    keel: KeelRef,
    model_calls: u32,
    step_open: bool,
    text_open: Option<String>,
    /// The text message of the last model call, if it had text.
    last_text: Option<String>,
    /// The calls the turn paused for, once its commit is known to hold any.
    paused: Vec<Approval>,
    finished: bool,
}

impl RunEncoder {
    /// A run `run_id` of `thread_id` for the keel turn `keel`.
    pub fn new(thread_id: &str, run_id: &str, keel: KeelRef) -> Self {
        Self {
            thread_id: thread_id.to_owned(),
            run_id: run_id.to_owned(),
            keel,
            model_calls: 0,
            step_open: false,
            text_open: None,
            last_text: None,
            paused: Vec::new(),
            finished: false,
        }
    }

    /// Says the turn paused for `approvals`: its `TurnCommitted` ends the
    /// run with their calls and the interrupt outcome.
    pub fn pause(&mut self, approvals: Vec<Approval>) {
        self.paused = approvals;
    }

    /// Whether the run ended.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// `RUN_STARTED`.
    pub fn start(&self) -> AgUiEvent {
        AgUiEvent::RunStarted {
            thread_id: self.thread_id.clone(),
            run_id: self.run_id.clone(),
            protocol_version: PROTOCOL_VERSION.to_owned(),
            metadata: Some(Metadata { keel: self.keel }),
        }
    }

    fn open_step(&mut self, out: &mut Vec<AgUiEvent>) {
        if !self.step_open {
            self.model_calls += 1;
            self.step_open = true;
            self.last_text = None;
            out.push(AgUiEvent::StepStarted {
                step_name: self.step_name(),
            });
        }
    }

    fn step_name(&self) -> String {
        format!("model_call_{}", self.model_calls)
    }

    /// Closes the open text message and step.
    fn close(&mut self, out: &mut Vec<AgUiEvent>) {
        if let Some(message_id) = self.text_open.take() {
            out.push(AgUiEvent::TextMessageEnd { message_id });
        }
        if self.step_open {
            self.step_open = false;
            out.push(AgUiEvent::StepFinished {
                step_name: self.step_name(),
            });
        }
    }

    /// The events of one frame of the turn (or of its dialog's runs).
    pub fn encode(&mut self, frame: &ServerFrame) -> Vec<AgUiEvent> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        match frame {
            ServerFrame::TurnStarted { .. } => self.open_step(&mut out),
            ServerFrame::TextDelta { text, .. } => {
                self.open_step(&mut out);
                let message_id = match &self.text_open {
                    Some(id) => id.clone(),
                    None => {
                        let id = format!("{}-{}", self.keel.turn_id, self.model_calls);
                        out.push(AgUiEvent::TextMessageStart {
                            message_id: id.clone(),
                            role: "assistant".to_owned(),
                        });
                        self.text_open = Some(id.clone());
                        self.last_text = Some(id.clone());
                        id
                    }
                };
                out.push(AgUiEvent::TextMessageContent {
                    message_id,
                    delta: text.clone(),
                });
            }
            ServerFrame::ModelCallFinished { .. } => {
                // A model call that streamed no text opens its step here.
                self.open_step(&mut out);
                self.close(&mut out);
            }
            ServerFrame::ToolStarted {
                call_id,
                name,
                arguments,
                ..
            } => {
                // The model call that asked for tools has ended.
                self.close(&mut out);
                out.push(AgUiEvent::ToolCallStart {
                    tool_call_id: call_id.clone(),
                    tool_call_name: name.clone(),
                    parent_message_id: self.last_text.clone(),
                });
                out.push(AgUiEvent::ToolCallArgs {
                    tool_call_id: call_id.clone(),
                    delta: arguments.to_string(),
                });
                out.push(AgUiEvent::ToolCallEnd {
                    tool_call_id: call_id.clone(),
                });
            }
            ServerFrame::ToolFinished {
                call_id, output, ..
            } => out.push(AgUiEvent::ToolCallResult {
                message_id: format!("{}-{}-{call_id}", self.keel.turn_id, self.model_calls),
                tool_call_id: call_id.clone(),
                content: output.clone(),
                role: "tool".to_owned(),
            }),
            ServerFrame::Notice { text, .. } => out.push(AgUiEvent::Custom {
                name: "keel.notice".to_owned(),
                value: Value::String(text.clone()),
            }),
            ServerFrame::AgentRunUpdated { run, .. } => out.push(activity(run)),
            ServerFrame::TurnCommitted {
                checkpoint_id,
                usage,
                ..
            } => {
                self.close(&mut out);
                self.finished = true;
                let mut keel = self.keel;
                keel.checkpoint_id = *checkpoint_id;
                // The calls that wait ran not: they are shown, then asked about.
                for a in &self.paused {
                    out.push(AgUiEvent::ToolCallStart {
                        tool_call_id: a.tool_call_id.clone(),
                        tool_call_name: a.tool.clone(),
                        parent_message_id: self.last_text.clone(),
                    });
                    out.push(AgUiEvent::ToolCallArgs {
                        tool_call_id: a.tool_call_id.clone(),
                        delta: a.arguments.to_string(),
                    });
                    out.push(AgUiEvent::ToolCallEnd {
                        tool_call_id: a.tool_call_id.clone(),
                    });
                }
                let outcome = if self.paused.is_empty() {
                    Outcome::Success
                } else {
                    Outcome::Interrupt {
                        interrupts: self.paused.iter().map(Interrupt::from).collect(),
                    }
                };
                out.push(AgUiEvent::RunFinished {
                    thread_id: self.thread_id.clone(),
                    run_id: self.run_id.clone(),
                    outcome,
                    usage: vec![token_usage(usage)],
                    metadata: Some(Metadata { keel }),
                });
            }
            ServerFrame::TurnFailed {
                cancelled, message, ..
            } => {
                self.finished = true;
                if *cancelled {
                    self.close(&mut out);
                    out.push(AgUiEvent::RunFinished {
                        thread_id: self.thread_id.clone(),
                        run_id: self.run_id.clone(),
                        outcome: Outcome::Cancelled,
                        usage: Vec::new(),
                        metadata: Some(Metadata { keel: self.keel }),
                    });
                } else {
                    out.push(run_error("turn_failed", message.clone()));
                }
            }
            _ => {}
        }
        out
    }

    /// The run's end when its frames stopped: some were dropped (`lagged`)
    /// or the server is closing.
    pub fn abandon(&mut self, lagged: bool) -> Vec<AgUiEvent> {
        if self.finished {
            return Vec::new();
        }
        self.finished = true;
        vec![if lagged {
            run_error(
                "lagged",
                "this stream was read too slowly and events were dropped; the turn goes on and \
                 is saved in the dialog",
            )
        } else {
            run_error("closing", "the server is shutting down")
        }]
    }
}

fn token_usage(u: &KeelUsage) -> TokenUsage {
    TokenUsage {
        input_tokens: u.prompt_tokens,
        output_tokens: u.completion_tokens,
        total_tokens: u.prompt_tokens.saturating_add(u.completion_tokens),
    }
}

fn activity(run: &AgentRun) -> AgUiEvent {
    AgUiEvent::ActivitySnapshot {
        message_id: format!("run-{}", run.id),
        activity_type: RUN_ACTIVITY.to_owned(),
        content: serde_json::to_value(run).unwrap_or(Value::Null),
        replace: true,
    }
}

pub(super) fn sse(event: &AgUiEvent) -> Event {
    Event::default().data(serde_json::to_string(event).unwrap_or_default())
}

// ── the input ────────────────────────────────────────────────────────────

/// What a `RunAgentInput` asks, checked.
#[derive(Debug)]
struct Input {
    thread_id: String,
    run_id: String,
    ask: Ask,
}

/// A new turn, or the answers to the interrupts a run ended with.
#[derive(Debug)]
enum Ask {
    /// The history and the new input.
    Turn { history: Vec<Said>, input: String },
    /// `resume`: one answer per interrupt.
    Resume(Vec<Answer>),
}

fn string_field(body: &Map<String, Value>, name: &str) -> Result<String, AgUiError> {
    match body.get(name) {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => Ok(s.clone()),
        _ => Err(bad(format!("`{name}` must be a string of 1 to 256 bytes"))),
    }
}

/// The text of a user message's content: a string, or its text parts
/// (other parts are skipped: keel's models read text).
fn user_text(content: Option<&Value>, at: &str) -> Result<String, AgUiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect()),
        _ => Err(bad(format!(
            "{at}.content must be a string or an array of content parts"
        ))),
    }
}

/// Reads and checks a `RunAgentInput`; nothing is written before this passed.
fn read_input(body: &[u8]) -> Result<Input, AgUiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("the body is not a valid JSON RunAgentInput: {e}")))?;
    let Value::Object(body) = value else {
        return Err(bad("the body must be a RunAgentInput object"));
    };
    let thread_id = string_field(&body, "threadId")?;
    chat_id("`threadId`", &thread_id).map_err(AgUiError::from)?;
    let run_id = string_field(&body, "runId")?;
    match body.get("state") {
        None | Some(Value::Null | Value::Object(_)) => {}
        Some(_) => return Err(bad("`state` must be an object")),
    }
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(bad("`messages` must be an array"));
    };
    match body.get("resume") {
        None | Some(Value::Null) => {}
        Some(Value::Array(resume)) if resume.is_empty() => {}
        // The run continues the dialog the interrupts belong to, which
        // holds the history: `messages` is not read.
        Some(Value::Array(resume)) => {
            return Ok(Input {
                thread_id,
                run_id,
                ask: Ask::Resume(read_resume(resume)?),
            })
        }
        Some(_) => return Err(bad("`resume` must be an array")),
    }
    let mut history = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("{at} must be an object with a `role`")))?;
        match role {
            "user" => history.push(Said::user(user_text(m.get("content"), &at)?)),
            "assistant" => {
                let text = match m.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(_) => return Err(bad(format!("{at}.content must be a string"))),
                };
                history.push(Said::assistant(text));
            }
            // Tool calls and results are keel's own, restated; system,
            // developer, activity and reasoning messages are not part of
            // the conversation keel keeps.
            "tool" | "system" | "developer" | "activity" | "reasoning" => {}
            other => return Err(bad(format!("{at} has an unknown role {other:?}"))),
        }
    }
    let input = match history.pop() {
        Some(Said {
            speaker: Speaker::User,
            text,
        }) if !text.trim().is_empty() => text,
        _ => {
            return Err(bad(
                "the last user or assistant message must be a user message with text: it is \
                 the run's input",
            ))
        }
    };
    checked_texts(
        history
            .iter()
            .map(|s| s.text.as_str())
            .chain([input.as_str()]),
    )
    .map_err(AgUiError::from)?;
    Ok(Input {
        thread_id,
        run_id,
        ask: Ask::Turn { history, input },
    })
}

// ── threads ──────────────────────────────────────────────────────────────

/// The dialog each followed thread's last run went to (a fork moves a
/// thread to a new dialog), watched by its thread streams. Only threads
/// someone follows are kept.
#[derive(Debug, Default)]
pub(crate) struct Threads {
    dialogs: Mutex<HashMap<String, watch::Sender<Option<SessionId>>>>,
    /// Dialogs a resume is deciding, until it knows its continuation turn.
    resuming: Mutex<HashMap<SessionId, usize>>,
    /// The continuation turns resumes answer (the newest ones): a thread
    /// stream leaves them out, their requests stream them.
    claimed: Mutex<VecDeque<Uuid>>,
}

/// Most continuation turns [`Threads`] remembers as a resume's.
const CLAIMED: usize = 256;

impl Threads {
    /// The watch of `thread`, made if nobody follows it yet.
    fn follow(&self, thread: &str) -> watch::Sender<Option<SessionId>> {
        let mut dialogs = self.dialogs.lock();
        dialogs.retain(|_, d| d.receiver_count() > 0);
        dialogs
            .entry(thread.to_owned())
            .or_insert_with(|| watch::channel(None).0)
            .clone()
    }

    /// A resume of `dialog` starts deciding: its continuation is its own.
    pub(super) fn begin_resume(&self, dialog: SessionId) {
        *self.resuming.lock().entry(dialog).or_default() += 1;
    }

    /// The resume of `dialog` knows its continuation turn (`Some`), or
    /// gave up (`None`).
    pub(super) fn end_resume(&self, dialog: SessionId, turn: Option<Uuid>) {
        if let Some(turn) = turn {
            let mut claimed = self.claimed.lock();
            if claimed.len() == CLAIMED {
                claimed.pop_front();
            }
            claimed.push_back(turn);
        }
        let mut resuming = self.resuming.lock();
        if let Some(n) = resuming.get_mut(&dialog) {
            *n -= 1;
            if *n == 0 {
                resuming.remove(&dialog);
            }
        }
    }

    /// Whether continuation `turn` of `dialog` is a resume's run.
    fn resumed(&self, dialog: SessionId, turn: Uuid) -> bool {
        self.claimed.lock().contains(&turn) || self.resuming.lock().contains_key(&dialog)
    }

    /// Records that `thread` now lives in `dialog`, for its followers.
    pub(super) fn moved(&self, thread: &str, dialog: SessionId) {
        if let Some(followers) = self.dialogs.lock().get(thread) {
            followers.send_if_modified(|d| {
                let changed = *d != Some(dialog);
                *d = Some(dialog);
                changed
            });
        }
    }
}

/// Follows a thread's dialog for its stream: turns of other origins than
/// the stream's own requests become runs; sub-agent updates between runs
/// wait for the next run (an event outside a run breaks the protocol).
#[derive(Debug)]
pub struct ThreadFollower {
    thread_id: String,
    dialog: SessionId,
    run: Option<RunEncoder>,
    waiting: BTreeMap<Uuid, AgentRun>,
    /// A continuation another request streams (a resume's).
    skipped: Option<Uuid>,
}

impl ThreadFollower {
    /// Follows `dialog` for `thread_id`.
    pub fn new(thread_id: &str, dialog: SessionId) -> Self {
        Self {
            thread_id: thread_id.to_owned(),
            dialog,
            run: None,
            waiting: BTreeMap::new(),
            skipped: None,
        }
    }

    /// Leaves turn `turn` out: a resume's request streams it.
    pub fn skip(&mut self, turn: Uuid) {
        self.skipped = Some(turn);
    }

    /// Whether a run is open (the dialog must not change under it).
    pub fn in_run(&self) -> bool {
        self.run.is_some()
    }

    /// The events of one frame of the dialog.
    pub fn encode(&mut self, frame: &ServerFrame) -> Vec<AgUiEvent> {
        if self.skipped.is_some() && frame.turn_id() == self.skipped {
            return Vec::new();
        }
        if let ServerFrame::TurnStarted {
            turn_id,
            turn_origin: TurnOrigin::AgentContinuation,
            ..
        } = frame
        {
            let mut out = self.abandon(false);
            let keel = KeelRef {
                dialog_id: self.dialog.as_uuid(),
                turn_id: *turn_id,
                checkpoint_id: None,
                forked_from: None,
                turn_origin: TurnOrigin::AgentContinuation,
            };
            let mut run = RunEncoder::new(&self.thread_id, &turn_id.to_string(), keel);
            out.push(run.start());
            out.extend(std::mem::take(&mut self.waiting).values().map(activity));
            out.extend(run.encode(frame));
            self.run = Some(run);
            return out;
        }
        let Some(run) = &mut self.run else {
            if let ServerFrame::AgentRunUpdated { run, .. } = frame {
                self.waiting.insert(run.id, run.clone());
            }
            return Vec::new();
        };
        let ours = match frame.turn_id() {
            Some(turn) => turn == run.keel.turn_id,
            None => matches!(frame, ServerFrame::AgentRunUpdated { .. }),
        };
        if !ours {
            return Vec::new();
        }
        let out = run.encode(frame);
        if run.finished() {
            self.run = None;
        }
        out
    }

    /// Ends the open run, if any, because frames stopped (see
    /// [`RunEncoder::abandon`]).
    pub fn abandon(&mut self, lagged: bool) -> Vec<AgUiEvent> {
        self.run
            .take()
            .map(|mut r| r.abandon(lagged))
            .unwrap_or_default()
    }
}

// ── handlers ─────────────────────────────────────────────────────────────

/// `POST /ag-ui` and `POST /ag-ui/{agent}`: one run.
async fn run(
    shared: Arc<Shared>,
    agent: Option<AgentId>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AgUiError> {
    let body = body.map_err(|r| AgUiError::from(ApiError::PayloadTooLarge(r.body_text())))?;
    let input = read_input(&body)?;
    let images = super::images::agui_images(&body);
    if shared.turns.is_draining() {
        return Err(ApiError::Unavailable(
            "the server is shutting down; no new runs are started".to_owned(),
        )
        .into());
    }
    let (history, text) = match input.ask {
        Ask::Resume(answers) => {
            return resume(shared, agent, input.thread_id, input.run_id, answers).await
        }
        Ask::Turn { history, input } => (history, input),
    };
    let conversation = Conversation {
        scope: Scope::Chat {
            channel: CHANNEL,
            chat_id: input.thread_id.clone(),
        },
        agent,
        history,
        input: text,
    };
    // Checked before a dialog is placed: a refused image creates none.
    let checked = shared.check_input(Some(conversation.input.clone()), images)?;
    crate::serve::images::check_agent_takes(&shared, conversation.agent.as_ref(), &checked)?;
    let placed = shared.conversations.place(&shared, &conversation).await?;
    // Sub-agent runs of the dialog are published from now on.
    shared.projections.watch(placed.dialog).await?;
    let message = shared.store_input(placed.dialog, checked).await?;
    let feed = Conversations::start_turn(&shared, placed, message)
        .await?
        .with_runs(shared.projections.clone());
    shared
        .conversations
        .threads()
        .moved(&input.thread_id, feed.dialog);
    let keel = KeelRef {
        dialog_id: feed.dialog.as_uuid(),
        turn_id: feed.turn,
        checkpoint_id: None,
        forked_from: feed.forked_from.map(|d| d.as_uuid()),
        turn_origin: TurnOrigin::User,
    };
    let encoder = RunEncoder::new(&input.thread_id, &input.run_id, keel);
    let first = vec![encoder.start()];
    Ok(sse_response(run_events(shared, feed, encoder, first)))
}

/// A run's events: `first`, then the turn's frames encoded. A turn that
/// paused for approvals ends with the interrupt outcome.
pub(super) fn run_events(
    shared: Arc<Shared>,
    feed: TurnFeed,
    encoder: RunEncoder,
    first: Vec<AgUiEvent>,
) -> impl Stream<Item = Event> + Send + 'static {
    futures::stream::unfold(
        (shared, feed, encoder, VecDeque::from(first)),
        |(shared, mut feed, mut encoder, mut queued)| async move {
            loop {
                if let Some(event) = queued.pop_front() {
                    return Some((sse(&event), (shared, feed, encoder, queued)));
                }
                if encoder.finished() {
                    return None;
                }
                let next = feed.next().await;
                if let Some(Fed::Frame(frame)) = &next {
                    if let ServerFrame::TurnCommitted { turn_id, .. } = frame.as_ref() {
                        // The pause is committed with the turn: what waits is read now.
                        match paused_for(&shared, feed.dialog, *turn_id).await {
                            Ok(paused) => {
                                encoder.pause(paused.iter().map(Approval::from).collect())
                            }
                            Err(e) => {
                                encoder.finished = true;
                                queued.push_back(AgUiError::from(e).body());
                                continue;
                            }
                        }
                    }
                }
                queued.extend(match next {
                    Some(Fed::Frame(frame)) => encoder.encode(&frame),
                    Some(Fed::Lost) => encoder.abandon(true),
                    None => encoder.abandon(false),
                });
            }
        },
    )
}

pub(super) fn sse_response(events: impl Stream<Item = Event> + Send + 'static) -> Response {
    use futures::StreamExt;
    Sse::new(events.map(Ok::<Event, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn run_root(
    State(shared): State<Arc<Shared>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AgUiError> {
    run(shared, None, body).await
}

async fn run_agent(
    State(shared): State<Arc<Shared>>,
    Path(agent): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, AgUiError> {
    let unknown = || AgUiError::from(ApiError::NotFound(format!("no agent {agent:?}")));
    let id = AgentId::parse(&agent).map_err(|_| unknown())?;
    if !shared.app.manager.runs_agent(&id).map_err(ApiError::from)? {
        return Err(unknown());
    }
    let agent = (id != AgentId::root()).then_some(id);
    run(shared, agent, body).await
}

/// `GET /ag-ui/threads/{thread_id}`: the thread's continuation turns, each
/// a run, for as long as the client listens.
async fn follow(
    State(shared): State<Arc<Shared>>,
    Path(thread_id): Path<String>,
) -> Result<Response, AgUiError> {
    chat_id("the thread id", &thread_id).map_err(AgUiError::from)?;
    let sender = shared.conversations.threads().follow(&thread_id);
    let mut dialog_rx = sender.subscribe();
    let known = sender.borrow().is_some();
    if !known {
        let latest = shared
            .app
            .manager
            .latest_dialog(CHANNEL, &thread_id)
            .await
            .map_err(ApiError::from)?;
        if let Some(latest) = latest {
            // A run that moved the thread meanwhile wins.
            sender.send_if_modified(|d| {
                let unset = d.is_none();
                if unset {
                    *d = Some(latest.id);
                }
                unset
            });
        }
    }
    // Subscribed before answering, so a turn that starts once the client
    // has the response is seen.
    let subscribe = {
        let shared = shared.clone();
        move |dialog: SessionId| {
            let frames = shared.hub.subscribe(dialog);
            // Continuation turns reach the hub only while it is watched.
            let turns = shared.turns.clone();
            tokio::spawn(async move { turns.follow_continuations(dialog).await });
            (ThreadFollower::new(&thread_id, dialog), frames)
        }
    };
    let dialog = *dialog_rx.borrow_and_update();
    let mut current = match dialog {
        Some(dialog) => {
            shared.projections.watch(dialog).await?;
            Some(subscribe(dialog))
        }
        None => None,
    };
    let closing = shared.closing.clone();
    let threads = shared.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<AgUiEvent>(64);
    tokio::spawn(async move {
        loop {
            let wanted = *dialog_rx.borrow_and_update();
            let switch = match (&current, wanted) {
                (None, Some(_)) => true,
                (Some((f, _)), Some(d)) => f.dialog != d && !f.in_run(),
                _ => false,
            };
            if let (true, Some(dialog)) = (switch, wanted) {
                current = Some(subscribe(dialog));
            }
            let events = tokio::select! {
                () = closing.cancelled() => return,
                () = tx.closed() => return,
                changed = dialog_rx.changed() => {
                    if changed.is_err() { return; }
                    continue;
                }
                frame = async {
                    match &mut current {
                        Some((_, frames)) => frames.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    let Some((follower, _)) = &mut current else { continue };
                    match frame {
                        Ok(frame) => {
                            if let ServerFrame::TurnStarted { turn_id, turn_origin: TurnOrigin::AgentContinuation, .. } = frame.as_ref() {
                                if threads.conversations.threads().resumed(follower.dialog, *turn_id) {
                                    follower.skip(*turn_id);
                                }
                            }
                            follower.encode(&frame)
                        }
                        Err(RecvError::Lagged(_)) => follower.abandon(true),
                        Err(RecvError::Closed) => return,
                    }
                }
            };
            for event in events {
                if tx.send(event).await.is_err() {
                    return;
                }
            }
        }
    });
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (sse(&e), rx))
    });
    Ok(sse_response(events))
}

async fn require_key(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    if let Some(refused) = crate::serve::origin::refusal(&request, &shared.allowed_origins) {
        tracing::info!(reason = %refused, "request refused");
        return AgUiError::from(refused).into_response();
    }
    if crate::serve::auth::authorized(&shared, &request) {
        next.run(request).await
    } else {
        AgUiError::from(ApiError::Unauthorized).into_response()
    }
}

async fn no_route(axum::extract::OriginalUri(uri): axum::extract::OriginalUri) -> AgUiError {
    ApiError::NotFound(format!("no route {}", uri.path())).into()
}

async fn wrong_method() -> AgUiError {
    ApiError::MethodNotAllowed.into()
}

/// The routes under `/ag-ui`, behind the serve token.
pub(crate) fn router(shared: Arc<Shared>) -> Router<Arc<Shared>> {
    Router::new()
        .route("/", post(run_root))
        .route("/{agent}", post(run_agent))
        .route("/threads/{thread_id}", get(follow))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::middleware::from_fn_with_state(shared, require_key))
        .layer(DefaultBodyLimit::max(super::MAX_BODY_BYTES))
}
