//! The WebSocket protocol of `/api/ws` (also the events of a streamed send,
//! as SSE): JSON text frames tagged by `type`. docs/PROTOCOL.md shows every
//! frame; a test parses its examples into these types.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::api::{AgentEvent, AgentRun, Approval, Dialog, IfBusy, TokenUsage, TurnOrigin};

/// Longest client-chosen request `id`, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 64;

/// A frame a client sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientFrame {
    /// Receive a dialog's turns and agent updates. With `since_revision`,
    /// agent changes at or after it are sent first.
    Subscribe {
        /// Echoed in the answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// The last revision the client saw (after a reconnect).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_revision: Option<u64>,
        /// The `event_id` of the last turn frame the client saw: every turn
        /// frame after it is sent first (or a `replay_gap`), then live ones.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resume_from: Option<u64>,
        /// Without `resume_from`: first send the frames so far of the turn
        /// running now, if any (a page that reloaded mid-answer).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        join: bool,
    },
    /// Stop receiving a dialog's frames.
    Unsubscribe {
        /// Echoed in the answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
    },
    /// Send a message: starts a turn (and subscribes to the dialog).
    Send {
        /// Echoed in the answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// The text (before `parts`); the message needs text or an image.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        text: Option<String>,
        /// Text and images, in order, as in `POST /api/dialogs/{id}/messages`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        parts: Vec<crate::serve::images::InputPart>,
        /// What to do when a turn of the dialog is running (default `enqueue`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        if_busy: Option<IfBusy>,
        /// An http(s) URL the turn's final state is POSTed to, signed, once it
        /// commits (see PROTOCOL.md, Webhooks). Not with `if_busy: steer`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schema(max_length = 2048)]
        webhook: Option<String>,
    },
    /// Cancel the dialog's running turn.
    Stop {
        /// Echoed in the answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
    },
    /// Give text to the dialog's running turn: the model reads it at its
    /// next call. With no running turn nothing is done (`steered: false`):
    /// send it as a message instead.
    Steer {
        /// Echoed in the answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// The text.
        text: String,
    },
    /// A page of the dialog's sub-agent runs, newest first.
    GetAgentRuns {
        /// Echoed in the answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// `next_cursor` of the previous page.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cursor: Option<String>,
        /// Page size, 1..=200 (default 50).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<usize>,
    },
}

/// A frame the server sends. Turn frames carry the dialog and turn; agent
/// frames the dialog's revision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ServerFrame {
    /// The subscription is active; `revision` is the dialog's agent revision now.
    Subscribed {
        /// The request's `id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// The dialog's revision.
        revision: u64,
    },
    /// The subscription ended.
    Unsubscribed {
        /// The request's `id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
    },
    /// A sent message started a turn.
    TurnAccepted {
        /// The request's `id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// The turn.
        turn_id: Uuid,
        /// Whether the text went into the running turn as a steer.
        steered: bool,
    },
    /// What a `stop` did.
    Stopped {
        /// The request's `id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// Whether a running turn was cancelled.
        stopped: bool,
    },
    /// What a `steer` did.
    Steered {
        /// The request's `id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// Whether a running turn took the text.
        steered: bool,
        /// The turn that took it.
        turn_id: Option<Uuid>,
    },
    /// A page of runs (answer to `get_agent_runs`).
    AgentRuns {
        /// The request's `id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The dialog.
        session_id: Uuid,
        /// The dialog's revision, read before the runs.
        revision: u64,
        /// The runs.
        runs: Vec<AgentRun>,
        /// Cursor of the next page.
        next_cursor: Option<String>,
    },
    /// A turn began.
    TurnStarted {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// What started it.
        turn_origin: TurnOrigin,
    },
    /// A piece of the answer's text.
    TextDelta {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// The text.
        text: String,
    },
    /// A tool call is about to run.
    ToolStarted {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// The call.
        call_id: String,
        /// The tool.
        name: String,
        /// Its arguments (JSON).
        #[schema(value_type = Object)]
        arguments: serde_json::Value,
    },
    /// A tool call finished.
    ToolFinished {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// The call.
        call_id: String,
        /// The tool.
        name: String,
        /// What the model reads (at most 2 KiB shown).
        output: String,
        /// Whether it failed.
        is_error: bool,
    },
    /// A model call of the turn ended (tool calls, if it asked for any,
    /// run next, then the next model call).
    ModelCallFinished {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// Why the model stopped: `stop`, `tool_calls`, `length`,
        /// `content_filter`, or the provider's own word.
        finish_reason: String,
    },
    /// A notice about the turn that is not part of the history.
    Notice {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// The text.
        text: String,
    },
    /// The turn is saved: its messages are in the history.
    TurnCommitted {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// What started it.
        turn_origin: TurnOrigin,
        /// Its automatic checkpoint.
        checkpoint_id: Option<Uuid>,
        /// Tokens of the turn's model calls (its sub-agents' are on their runs).
        usage: TokenUsage,
    },
    /// The turn ended without being saved.
    TurnFailed {
        /// The dialog.
        session_id: Uuid,
        /// Its place in the dialog's stream (see `resume_from`), set when published.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<u64>,
        /// The turn.
        turn_id: Uuid,
        /// What started it.
        turn_origin: TurnOrigin,
        /// Whether it was stopped (by `stop` or a shutdown) rather than failing.
        cancelled: bool,
        /// Whether it ran past its deadline (`session.turn_timeout_secs`)
        /// and was stopped there.
        timed_out: bool,
        /// Whether a spend budget (`session.max_cost_usd_per_dialog`,
        /// `orchestration.max_cost_usd_per_root_turn`) stopped it before a
        /// model call that would have passed it.
        budget_exhausted: bool,
        /// Whether the user's message stays in the history, marked unanswered
        /// (it was stored before the model was called).
        input_kept: bool,
        /// Why, for a person.
        message: String,
    },
    /// A sub-agent run changed.
    AgentRunUpdated {
        /// The dialog.
        session_id: Uuid,
        /// The dialog's revision of this change.
        revision: u64,
        /// The run now.
        run: AgentRun,
    },
    /// A signal or completion changed.
    AgentEventUpdated {
        /// The dialog.
        session_id: Uuid,
        /// The dialog's revision of this change.
        revision: u64,
        /// The event now.
        event: AgentEvent,
    },
    /// A tool call waits for a person's decision (`POST /api/approvals/{id}`);
    /// the turn that asked ended waiting for it.
    ApprovalRequested {
        /// The dialog.
        session_id: Uuid,
        /// The dialog's revision of this change.
        revision: u64,
        /// The approval.
        approval: Approval,
    },
    /// An approval was decided (approved, denied, expired or superseded by
    /// new input).
    ApprovalDecided {
        /// The dialog.
        session_id: Uuid,
        /// The dialog's revision of this change.
        revision: u64,
        /// The approval now.
        approval: Approval,
    },
    /// The dialog changed: its title (renamed, or titled automatically),
    /// its message count, its last activity.
    DialogUpdated {
        /// The dialog.
        session_id: Uuid,
        /// The dialog now.
        dialog: Dialog,
    },
    /// Frames of this dialog were dropped (the client read too slowly, or
    /// its `since_revision` is too old): re-read what you show
    /// (`get_agent_runs`, the messages) and continue from `revision`.
    Resync {
        /// The dialog.
        session_id: Uuid,
        /// The dialog's revision when the gap was noticed.
        revision: u64,
        /// Why.
        reason: String,
    },
    /// Turn frames the client asked for (`resume_from`, `Last-Event-ID`)
    /// are no longer kept (`server.stream_replay_secs`,
    /// `server.stream_replay_bytes`) or are unknown to this server: re-read
    /// the messages; every frame still kept follows, then live ones.
    ReplayGap {
        /// The dialog.
        session_id: Uuid,
        /// The event id the client asked to resume after.
        after_event_id: u64,
        /// Why, for a person.
        reason: String,
    },
    /// A request failed; the connection stays open.
    Error {
        /// The request's `id`, when it had one and could be read.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// The HTTP status the same failure has in the REST API.
        status: u16,
        /// What was wrong, for a program.
        code: String,
        /// What was wrong, for a person.
        detail: String,
    },
}

impl ServerFrame {
    /// The frame's `type`, which is also its SSE event name.
    pub fn kind(&self) -> &'static str {
        match self {
            ServerFrame::Subscribed { .. } => "subscribed",
            ServerFrame::Unsubscribed { .. } => "unsubscribed",
            ServerFrame::TurnAccepted { .. } => "turn_accepted",
            ServerFrame::Stopped { .. } => "stopped",
            ServerFrame::Steered { .. } => "steered",
            ServerFrame::AgentRuns { .. } => "agent_runs",
            ServerFrame::TurnStarted { .. } => "turn_started",
            ServerFrame::TextDelta { .. } => "text_delta",
            ServerFrame::ToolStarted { .. } => "tool_started",
            ServerFrame::ToolFinished { .. } => "tool_finished",
            ServerFrame::ModelCallFinished { .. } => "model_call_finished",
            ServerFrame::Notice { .. } => "notice",
            ServerFrame::TurnCommitted { .. } => "turn_committed",
            ServerFrame::TurnFailed { .. } => "turn_failed",
            ServerFrame::AgentRunUpdated { .. } => "agent_run_updated",
            ServerFrame::AgentEventUpdated { .. } => "agent_event_updated",
            ServerFrame::DialogUpdated { .. } => "dialog_updated",
            ServerFrame::ApprovalRequested { .. } => "approval_requested",
            ServerFrame::ApprovalDecided { .. } => "approval_decided",
            ServerFrame::Resync { .. } => "resync",
            ServerFrame::ReplayGap { .. } => "replay_gap",
            ServerFrame::Error { .. } => "error",
        }
    }

    /// The turn a turn frame belongs to.
    pub fn turn_id(&self) -> Option<Uuid> {
        match self {
            ServerFrame::TurnStarted { turn_id, .. }
            | ServerFrame::TextDelta { turn_id, .. }
            | ServerFrame::ToolStarted { turn_id, .. }
            | ServerFrame::ToolFinished { turn_id, .. }
            | ServerFrame::ModelCallFinished { turn_id, .. }
            | ServerFrame::Notice { turn_id, .. }
            | ServerFrame::TurnCommitted { turn_id, .. }
            | ServerFrame::TurnFailed { turn_id, .. } => Some(*turn_id),
            _ => None,
        }
    }

    /// A turn frame's place in its dialog's stream, once published.
    pub fn event_id(&self) -> Option<u64> {
        match self {
            ServerFrame::TurnStarted { event_id, .. }
            | ServerFrame::TextDelta { event_id, .. }
            | ServerFrame::ToolStarted { event_id, .. }
            | ServerFrame::ToolFinished { event_id, .. }
            | ServerFrame::ModelCallFinished { event_id, .. }
            | ServerFrame::Notice { event_id, .. }
            | ServerFrame::TurnCommitted { event_id, .. }
            | ServerFrame::TurnFailed { event_id, .. } => *event_id,
            _ => None,
        }
    }

    /// A turn frame's `event_id` field (other frames have none).
    fn event_id_mut(&mut self) -> Option<&mut Option<u64>> {
        match self {
            ServerFrame::TurnStarted { event_id, .. }
            | ServerFrame::TextDelta { event_id, .. }
            | ServerFrame::ToolStarted { event_id, .. }
            | ServerFrame::ToolFinished { event_id, .. }
            | ServerFrame::ModelCallFinished { event_id, .. }
            | ServerFrame::Notice { event_id, .. }
            | ServerFrame::TurnCommitted { event_id, .. }
            | ServerFrame::TurnFailed { event_id, .. } => Some(event_id),
            _ => None,
        }
    }

    /// Sets a turn frame's `event_id` (other frames have none); whether it had a place for one.
    pub(crate) fn set_event_id(&mut self, id: u64) -> bool {
        self.event_id_mut().map(|slot| *slot = Some(id)).is_some()
    }

    /// Removes a turn frame's `event_id`.
    pub(crate) fn clear_event_id(&mut self) {
        if let Some(slot) = self.event_id_mut() {
            *slot = None;
        }
    }

    /// About what a kept turn frame occupies in memory, in bytes (the frame,
    /// its shared allocation and window entry, and its texts), for the
    /// replay window's byte bound.
    pub(crate) fn approx_bytes(&self) -> usize {
        // The frame itself, the Arc's counts, the window's entry and the
        // allocator's overhead of the frame and its text.
        let fixed = std::mem::size_of::<ServerFrame>() + 16 + 48 + 32;
        fixed
            + match self {
                ServerFrame::TextDelta { text, .. } | ServerFrame::Notice { text, .. } => {
                    text.len()
                }
                ServerFrame::ToolStarted {
                    call_id,
                    name,
                    arguments,
                    ..
                } => call_id.len() + name.len() + arguments.to_string().len(),
                ServerFrame::ToolFinished {
                    call_id,
                    name,
                    output,
                    ..
                } => call_id.len() + name.len() + output.len(),
                ServerFrame::ModelCallFinished { finish_reason, .. } => finish_reason.len(),
                ServerFrame::TurnFailed { message, .. } => message.len(),
                _ => 0,
            }
    }

    /// The revision of an agent frame.
    pub fn revision(&self) -> Option<u64> {
        match self {
            ServerFrame::AgentRunUpdated { revision, .. }
            | ServerFrame::AgentEventUpdated { revision, .. } => Some(*revision),
            _ => None,
        }
    }

    /// Whether this frame ends its turn.
    pub fn ends_turn(&self) -> bool {
        matches!(
            self,
            ServerFrame::TurnCommitted { .. } | ServerFrame::TurnFailed { .. }
        )
    }
}
