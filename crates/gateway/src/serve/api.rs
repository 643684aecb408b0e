//! The wire types of `keel serve`'s REST API: what clients send and receive,
//! separate from engine and store types and converted from them by hand.
//! Names are snake_case, times RFC 3339 strings (UTC, milliseconds), ids
//! UUID strings; request bodies reject unknown fields.

use std::time::{Duration, UNIX_EPOCH};

use keel_core::{ContentPart, Role};
use keel_store::{
    CheckpointRecord, InboxEvent, InputState, RunRecord, SessionRecord, StoredMessage,
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// Longest text of one message, in characters.
pub const MAX_TEXT_CHARS: usize = 100_000;
/// Largest page a listing returns.
pub const MAX_PAGE: usize = 200;
/// Page size when `limit` is not given.
pub const DEFAULT_PAGE: usize = 50;

/// A point in time: RFC 3339, UTC, milliseconds (`2026-11-30T12:00:00.000Z`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ToSchema)]
#[schema(value_type = String, format = DateTime, example = "2026-11-30T12:00:00.000Z")]
pub struct Timestamp(pub i64);

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let ms = u64::try_from(self.0).unwrap_or(0);
        let at = UNIX_EPOCH + Duration::from_millis(ms);
        s.collect_str(&humantime::format_rfc3339_millis(at))
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let at = humantime::parse_rfc3339(&text).map_err(serde::de::Error::custom)?;
        let ms = at
            .duration_since(UNIX_EPOCH)
            .map_err(serde::de::Error::custom)?
            .as_millis();
        Ok(Timestamp(
            i64::try_from(ms).map_err(serde::de::Error::custom)?,
        ))
    }
}

/// Declares a wire enum mirroring a keel-core text enum, with `From` the core type.
macro_rules! wire_enum {
    ($(#[$m:meta])* $name:ident from $core:ty { $($(#[$vm:meta])* $variant:ident),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($(#[$vm])* $variant),+ }

        impl From<$core> for $name {
            fn from(v: $core) -> Self {
                match v { $(<$core>::$variant => $name::$variant),+ }
            }
        }

        impl From<$name> for $core {
            fn from(v: $name) -> Self {
                match v { $($name::$variant => <$core>::$variant),+ }
            }
        }
    };
}

wire_enum!(
    /// What started a turn.
    TurnOrigin from keel_core::TurnOrigin {
        /// A person sent input.
        User,
        /// Results of background agent runs arrived.
        AgentContinuation,
        /// The runtime itself.
        System,
    }
);

wire_enum!(
    /// Who wrote a message.
    MessageRole from Role {
        /// Instructions for the model.
        System,
        /// A person.
        User,
        /// The model.
        Assistant,
        /// A tool's output.
        Tool,
    }
);

wire_enum!(
    /// Where a sub-agent run is in its life.
    RunStatus from keel_core::RunStatus {
        /// Accepted, not started.
        Queued,
        /// Executing.
        Running,
        /// Waiting for its foreground children.
        WaitingChildren,
        /// A background run waiting for a person to decide on a tool call.
        WaitingApproval,
        /// Finished with a result.
        Completed,
        /// Finished with an error.
        Failed,
        /// Passed its deadline.
        TimedOut,
        /// Cancelled.
        Cancelled,
        /// Stopped by a restart of keel.
        Interrupted,
        /// Stopped before a model call that would have passed a spend budget.
        BudgetExhausted,
    }
);

wire_enum!(
    /// Whether the delegating agent waited for the run.
    RunMode from keel_core::ExecutionMode {
        /// The caller waited.
        Foreground,
        /// The result arrives later, in the inbox.
        Background,
    }
);

wire_enum!(
    /// What an agent event reports.
    AgentEventType from keel_store::EventType {
        /// A signal of a running run.
        Signal,
        /// A run finished.
        Completion,
        /// A group of runs finished.
        GroupCompletion,
    }
);

wire_enum!(
    /// Where an agent event is in its delivery to the root agent.
    AgentEventStatus from keel_store::EventStatus {
        /// Waiting for a turn.
        Pending,
        /// Being delivered.
        Leased,
        /// Taken into a running turn.
        Admitted,
        /// Delivered.
        Consumed,
        /// Replaced by a later fact.
        Superseded,
        /// Given up on.
        DeadLetter,
    }
);

wire_enum!(
    /// How a checkpoint came to be.
    CheckpointSource from keel_store::CheckpointSource {
        /// After a committed turn.
        Turn,
        /// Asked for explicitly.
        Manual,
        /// Made by a rollback (the new branch's start).
        Rollback,
        /// Made by a fork (the new dialog's start).
        Fork,
    }
);

/// A dialog: one conversation of a chat. Its `id` (a session id) names it
/// in every URL and frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Dialog {
    /// The dialog's session id.
    pub id: Uuid,
    /// Channel (`api`, `cli` …).
    pub channel: String,
    /// Chat within the channel.
    pub chat_id: String,
    /// Short id within the chat (what `keel chat` shows).
    pub dialog_id: String,
    /// Title.
    pub title: String,
    /// The agent it talks to (`root` for keel's root agent).
    pub agent: Option<String>,
    /// Visible user messages so far.
    pub message_count: u64,
    /// Creation time.
    pub created_at: Timestamp,
    /// Last activity.
    pub last_active_at: Timestamp,
    /// What it occupies in the database; only `GET /api/dialogs/{id}` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<DialogStorage>,
}

/// What a dialog occupies in the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DialogStorage {
    /// Bytes of the text and blob values stored in its rows: every column
    /// of its messages and checkpoints, the state blobs they reference (each
    /// once), its sub-agent runs' task, context, result and error, and its
    /// inbox events' payloads, as stored; integers and SQLite's per-row,
    /// page and index overhead are not counted.
    pub stored_bytes: u64,
    /// Its checkpoints (every branch).
    pub checkpoints: u64,
}

impl From<&SessionRecord> for Dialog {
    fn from(r: &SessionRecord) -> Self {
        Self {
            id: r.id.as_uuid(),
            channel: r.channel.clone(),
            chat_id: r.chat_id.clone(),
            dialog_id: r.dialog_id.clone(),
            title: r.title.clone(),
            agent: r.agent_id.as_ref().map(|a| a.as_str().to_owned()),
            message_count: r.message_count,
            created_at: Timestamp(r.created_at_ms),
            last_active_at: Timestamp(r.last_active_at_ms),
            storage: None,
        }
    }
}

/// Tokens a dialog's own turns used, and what the dialog spent in all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DialogUsage {
    /// Input tokens of its committed turns.
    pub prompt_tokens: u64,
    /// Output tokens of its committed turns.
    pub completion_tokens: u64,
    /// Model calls of its committed turns.
    pub model_calls: u64,
    /// Every model call of the dialog, failed turns and sub-agent runs
    /// included: what `session.max_cost_usd_per_dialog` counts. Stored call by
    /// call, so a restart or a rollback does not reset it.
    pub spend: Spend,
    /// The dialog's budget (`session.max_cost_usd_per_dialog`), `null`
    /// without one.
    pub max_cost_usd: Option<f64>,
    /// The dialog's newest runs (at most 100), each with what it spent and
    /// what its tree (it and every run below it) spent.
    pub runs: Vec<RunSpend>,
}

/// What model calls spent.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Spend {
    /// Input tokens.
    pub prompt_tokens: u64,
    /// Output tokens.
    pub completion_tokens: u64,
    /// Model calls.
    pub model_calls: u64,
    /// USD at the profiles' prices (calls of unpriced profiles count 0).
    pub cost_usd: f64,
}

impl From<keel_engine::Spend> for Spend {
    fn from(s: keel_engine::Spend) -> Self {
        Self {
            prompt_tokens: s.usage.prompt_tokens,
            completion_tokens: s.usage.completion_tokens,
            model_calls: s.model_calls,
            cost_usd: s.cost.get(),
        }
    }
}

/// What one run and its tree spent. A run's tokens are recorded when it
/// ends completed or `budget_exhausted` (`null` before, and for a run that
/// failed otherwise); its cost only when a budget stopped it on a priced
/// profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunSpend {
    /// The run.
    pub run_id: Uuid,
    /// Its agent.
    pub agent: String,
    /// The run that delegated it (`null` when the root agent did).
    pub parent_run_id: Option<Uuid>,
    /// Its status.
    pub status: RunStatus,
    /// Its own model calls' tokens, once recorded.
    pub usage: Option<TokenUsage>,
    /// Their cost, when recorded.
    pub cost_usd: Option<f64>,
    /// Tokens recorded for it and every run below it.
    pub tree_usage: TokenUsage,
}

/// A page of dialogs, most recently created first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DialogPage {
    /// The dialogs.
    pub items: Vec<Dialog>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    pub next_cursor: Option<String>,
}

/// Which dialogs to list.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DialogListQuery {
    /// Channel (default `api`).
    #[param(pattern = r"^[^:\u0000-\u001f\u007f-\u009f]{1,128}$")]
    pub channel: Option<String>,
    /// Chat (default `default`).
    #[param(pattern = r"^[^:\u0000-\u001f\u007f-\u009f]{1,128}$")]
    pub chat_id: Option<String>,
    /// `next_cursor` of the previous page.
    #[param(
        pattern = r"^[0-9]{1,18}_[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
    )]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<usize>,
}

/// A new dialog.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewDialog {
    /// Channel (default `api`): 1..=128 characters, no `:` and no control characters.
    #[serde(default)]
    #[schema(pattern = r"^[^:\u0000-\u001f\u007f-\u009f]{1,128}$")]
    pub channel: Option<String>,
    /// Chat (default `default`), as `channel`.
    #[serde(default)]
    #[schema(pattern = r"^[^:\u0000-\u001f\u007f-\u009f]{1,128}$")]
    pub chat_id: Option<String>,
    /// Title (default `Dialog <dialog_id>`).
    #[serde(default)]
    #[schema(
        pattern = r"^[^\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]*[^\s\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb][^\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]*$"
    )]
    pub title: Option<String>,
    /// Agent to talk to (default: the root agent).
    #[serde(default)]
    #[schema(pattern = r"^[a-z][a-z0-9_-]{0,63}$")]
    pub agent: Option<String>,
}

/// A change to a dialog: its title, its agent, or both, in one write.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DialogPatch {
    /// New title (omitted: unchanged): some text, no control or format characters such as bidi controls or
    /// zero-width characters (more than 80 characters are cut).
    #[schema(
        pattern = r"^[^\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]*[^\s\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb][^\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]*$"
    )]
    #[serde(default)]
    pub title: Option<String>,
    /// The agent that answers from the next turn on, history kept (omitted:
    /// unchanged). Refused with 409 while a turn runs.
    #[schema(pattern = r"^[a-z][a-z0-9_-]{0,63}$")]
    #[serde(default)]
    pub agent: Option<String>,
}

/// A tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolCallInfo {
    /// The call's id.
    pub id: String,
    /// The tool.
    pub name: String,
    /// Its arguments (JSON).
    #[schema(value_type = Object)]
    pub arguments: serde_json::Value,
}

/// A message of a dialog's visible history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    /// Position in the dialog's history; pages continue from it.
    pub seq: i64,
    /// Author.
    pub role: MessageRole,
    /// The text (text parts joined).
    pub text: String,
    /// The message's images, in order (absent when it has none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<crate::serve::images::MessageImage>,
    /// Tool calls of an assistant message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallInfo>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The tool of a tool message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
    /// What started the turn the message belongs to.
    pub turn_origin: TurnOrigin,
    /// A user message whose turn ended without an answer (it failed, was
    /// stopped or was cut off by a crash); the next turn sees it.
    pub unanswered: bool,
    /// A tool message whose call failed or did not run (denied, expired,
    /// superseded); absent when not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
    /// When it was stored.
    pub created_at: Timestamp,
}

impl From<&StoredMessage> for ChatMessage {
    fn from(m: &StoredMessage) -> Self {
        let text = m
            .message
            .content
            .iter()
            .filter_map(|p| match p {
                ContentPart::Text { text } => Some(text.as_str()),
                ContentPart::ImageRef { .. } => None,
            })
            .collect::<Vec<_>>()
            .join("");
        Self {
            seq: m.seq,
            role: m.message.role.into(),
            text,
            images: crate::serve::images::message_images(&m.message),
            tool_calls: m
                .message
                .tool_calls
                .iter()
                .map(|c| ToolCallInfo {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                })
                .collect(),
            tool_call_id: m.message.tool_call_id.clone(),
            tool_name: m.message.tool_name.clone(),
            turn_origin: m.message.origin.into(),
            unanswered: m.input_state == Some(InputState::Unanswered),
            is_error: m.message.is_error,
            created_at: Timestamp(m.created_at_ms),
        }
    }
}

/// Reading direction of a message listing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Order {
    /// Oldest first; pages continue after the cursor.
    #[default]
    Asc,
    /// Newest first; pages continue before the cursor.
    Desc,
}

/// Which messages to list.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct MessageListQuery {
    /// `next_cursor` of the previous page.
    #[param(pattern = r"^[0-9]{1,18}$")]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<usize>,
    /// `asc` (default) or `desc`.
    pub order: Option<Order>,
}

/// A page of visible messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MessagePage {
    /// The messages.
    pub items: Vec<ChatMessage>,
    /// Pass as `cursor` (with the same `order`) for the next page; `null` when none is left now.
    pub next_cursor: Option<String>,
}

/// A message to send to a dialog: it starts a turn.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendMessage {
    /// The text (before `parts`): with the text parts, at most 100,000 characters; the message needs text or an image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 100000)]
    pub text: Option<String>,
    /// Text and images, in order (after `text`): at most `server.images_per_message` images of `server.image_max_bytes` each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<crate::serve::images::InputPart>,
    /// What to do when a turn of the dialog is running (default `enqueue`).
    #[serde(default)]
    pub if_busy: IfBusy,
    /// An http(s) URL the turn's final state is POSTed to, signed, once it
    /// commits (see PROTOCOL.md, Webhooks). Not with `if_busy: steer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 2048)]
    pub webhook: Option<String>,
}

/// Text for the dialog's running turn.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SteerText {
    /// The text: 1..=100,000 characters.
    #[schema(min_length = 1, max_length = 100000)]
    pub text: String,
}

/// What a send does when a turn of the dialog is running.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum IfBusy {
    /// Queue a new turn after the dialog's earlier ones.
    #[default]
    Enqueue,
    /// Refuse with 409 naming the running turn; nothing is stored.
    Reject,
    /// Stop the running turn as `/stop` does (its message stays, unanswered), then queue a new turn.
    Interrupt,
    /// Give the text to the running turn as a steer; with none running, queue a new turn.
    Steer,
}

/// A turn that started.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnAccepted {
    /// The dialog.
    pub session_id: Uuid,
    /// The turn: its events and its `turn_committed` or `turn_failed` carry this id.
    pub turn_id: Uuid,
    /// Whether the text went into the running turn `turn_id` as a steer (`if_busy: steer`) rather than starting a turn.
    pub steered: bool,
}

/// What `steer` did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SteerReport {
    /// Whether a running turn took the text (it reads it at its next model
    /// call); `false`: no turn was running and nothing was done.
    pub steered: bool,
    /// The turn that took it.
    pub turn_id: Option<Uuid>,
}

/// What `stop` did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StopReport {
    /// Whether a running turn was cancelled (its output is not saved).
    pub stopped: bool,
}

/// A checkpoint of a dialog. Checkpoints form a tree through `parent_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    /// Its id.
    pub id: Uuid,
    /// The checkpoint it follows (`null` for a root).
    pub parent_id: Option<Uuid>,
    /// Turns committed up to it.
    pub turn_index: u64,
    /// How it was made.
    pub source: CheckpointSource,
    /// Messages in the history it saw (its last seq).
    pub seq: i64,
    /// Whether the dialog's current history runs through it.
    pub on_current_branch: bool,
    /// Creation time.
    pub created_at: Timestamp,
}

impl Checkpoint {
    /// The wire form of `c`; `on_current_branch` as given.
    pub fn from_record(c: &CheckpointRecord, on_current_branch: bool) -> Self {
        Self {
            id: c.id.as_uuid(),
            parent_id: c.parent_id.map(|p| p.as_uuid()),
            turn_index: c.turn_index,
            source: c.source.into(),
            seq: c.seq,
            on_current_branch,
            created_at: Timestamp(c.created_at_ms),
        }
    }
}

/// A page of a dialog's checkpoints, newest first, abandoned branches included.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointPage {
    /// The checkpoints.
    pub items: Vec<Checkpoint>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    pub next_cursor: Option<String>,
}

/// A fork: a new dialog starting at a checkpoint.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Title of the new dialog (default `Fork of <title>`).
    #[serde(default)]
    #[schema(
        pattern = r"^[^\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]*[^\s\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb][^\u0000-\u001f\u007f-\u009f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]*$"
    )]
    pub title: Option<String>,
}

/// Token usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenUsage {
    /// Input tokens.
    pub prompt_tokens: u64,
    /// Output tokens.
    pub completion_tokens: u64,
}

impl From<keel_core::Usage> for TokenUsage {
    fn from(u: keel_core::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
        }
    }
}

/// A sub-agent run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentRun {
    /// Its id.
    pub id: Uuid,
    /// The dialog whose root agent started its tree.
    pub session_id: Uuid,
    /// The run that delegated it (`null` when the root agent did).
    pub parent_run_id: Option<Uuid>,
    /// Its batch, if it was started in one.
    pub group_id: Option<Uuid>,
    /// The agent.
    pub agent: String,
    /// Foreground or background.
    pub mode: RunMode,
    /// Status.
    pub status: RunStatus,
    /// Depth in the tree (1 for a child of the root agent).
    pub depth: u32,
    /// The task (at most 2 KiB shown).
    pub task: String,
    /// Bytes of the full result, once completed.
    pub result_bytes: Option<u64>,
    /// The result, cut to 2 KiB.
    pub result_preview: Option<String>,
    /// The whole result: only in `GET /api/agent-runs/{id}`, `null` in listings and frames.
    pub result: Option<String>,
    /// Why it did not complete.
    pub error: Option<String>,
    /// Tokens used, once known.
    pub usage: Option<TokenUsage>,
    /// What its model calls cost in USD, when recorded (a run on a priced
    /// profile that completed or that a budget stopped).
    #[serde(default)]
    pub cost_usd: Option<f64>,
    /// Tool calls made.
    pub tool_calls: u32,
    /// Model calls made.
    pub iterations: u32,
    /// The provider profile and model.
    pub model: String,
    /// Revision of its last change (per dialog; see the WebSocket protocol).
    pub revision: u64,
    /// Creation time.
    pub created_at: Timestamp,
    /// Start time.
    pub started_at: Option<Timestamp>,
    /// End time.
    pub finished_at: Option<Timestamp>,
    /// Deadline.
    pub deadline_at: Timestamp,
}

/// Longest task or result preview in a run listing, in bytes.
pub const PREVIEW_BYTES: usize = 2048;

impl AgentRun {
    /// The wire form of `r`, with its whole result when `full_result`.
    pub fn from_record(r: &RunRecord, full_result: bool) -> Self {
        let preview = |s: &String| keel_core::truncate_with_note(s.clone(), PREVIEW_BYTES);
        Self {
            id: r.spec.id.as_uuid(),
            session_id: r.spec.root_session_id.as_uuid(),
            parent_run_id: r.spec.parent_run_id.map(|p| p.as_uuid()),
            group_id: r.group_id.map(|g| g.as_uuid()),
            agent: r.spec.agent_id.as_str().to_owned(),
            mode: r.spec.mode.into(),
            status: r.status.into(),
            depth: r.spec.depth,
            task: keel_core::truncate_with_note(r.spec.task.clone(), PREVIEW_BYTES),
            result_bytes: r.result.as_ref().map(|s| s.len() as u64),
            result_preview: r.result.as_ref().map(preview),
            result: r.result.clone().filter(|_| full_result),
            error: r.error.clone(),
            usage: r.usage.map(TokenUsage::from),
            cost_usd: r.cost,
            tool_calls: r.tool_calls_count,
            iterations: r.iterations,
            model: format!("{}/{}", r.spec.provider_profile, r.spec.model_id),
            revision: r.revision,
            created_at: Timestamp(r.created_at_ms),
            started_at: r.started_at_ms.map(Timestamp),
            finished_at: r.finished_at_ms.map(Timestamp),
            deadline_at: Timestamp(r.spec.deadline_at_ms),
        }
    }
}

/// Which runs to list.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RunListQuery {
    /// Only runs started from this dialog.
    #[param(value_type = Option<String>, format = Uuid)]
    pub session_id: Option<String>,
    /// Only runs in these statuses, comma-separated (`running,queued`).
    #[param(
        pattern = r"^(queued|running|waiting_children|waiting_approval|completed|failed|timed_out|cancelled|interrupted|budget_exhausted)(,(queued|running|waiting_children|waiting_approval|completed|failed|timed_out|cancelled|interrupted|budget_exhausted))*$"
    )]
    pub status: Option<String>,
    /// Only runs of this agent.
    #[param(pattern = r"^[a-z][a-z0-9_-]{0,63}$")]
    pub agent: Option<String>,
    /// Only runs of this batch.
    #[param(value_type = Option<String>, format = Uuid)]
    pub group_id: Option<String>,
    /// Only runs this run delegated.
    #[param(value_type = Option<String>, format = Uuid)]
    pub parent_run_id: Option<String>,
    /// `next_cursor` of the previous page.
    #[param(
        pattern = r"^[0-9]{1,18}_[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
    )]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<usize>,
}

/// A page of runs, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentRunPage {
    /// The runs.
    pub items: Vec<AgentRun>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    pub next_cursor: Option<String>,
    /// With `session_id`: the dialog's revision read before the runs (pass
    /// it as `since_revision` when subscribing).
    pub revision: Option<u64>,
}

/// A signal or completion of a run, on its way to the root agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentEvent {
    /// Its id.
    pub id: Uuid,
    /// The dialog whose inbox holds it.
    pub session_id: Uuid,
    /// The run it is about (`null` for a group completion).
    pub run_id: Option<Uuid>,
    /// The group it is about.
    pub group_id: Option<Uuid>,
    /// What it reports.
    #[serde(rename = "type")]
    pub event_type: AgentEventType,
    /// Severity of a signal.
    pub severity: Option<String>,
    /// Its content (JSON): a signal's `{agent_id, summary, details?}`, a run
    /// completion's `{run_id, agent_id, status, result, error}`, a group
    /// completion's `{group_id, status, runs: [{run_id, agent_id, status,
    /// result, error}]}`.
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
    /// Delivery status.
    pub status: AgentEventStatus,
    /// Whether it starts a continuation turn.
    pub requires_continuation: bool,
    /// Revision of its last change (per dialog).
    pub revision: u64,
    /// Creation time.
    pub created_at: Timestamp,
    /// When a turn consumed it.
    pub consumed_at: Option<Timestamp>,
}

impl From<&InboxEvent> for AgentEvent {
    fn from(e: &InboxEvent) -> Self {
        Self {
            id: e.id.as_uuid(),
            session_id: e.root_session_id.as_uuid(),
            run_id: e.run_id.map(|r| r.as_uuid()),
            group_id: e.group_id.map(|g| g.as_uuid()),
            event_type: e.event_type.into(),
            severity: e.severity.clone(),
            payload: serde_json::from_str(&e.payload_json)
                .unwrap_or_else(|_| serde_json::Value::String(e.payload_json.clone())),
            status: e.status.into(),
            requires_continuation: e.requires_continuation,
            revision: e.revision,
            created_at: Timestamp(e.created_at_ms),
            consumed_at: e.consumed_at_ms.map(Timestamp),
        }
    }
}

/// Which page of a listing without filters (a dialog's events or
/// checkpoints, a run's events) to return.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// `next_cursor` of the previous page.
    #[param(
        pattern = r"^[0-9]{1,18}_[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
    )]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<usize>,
}

/// A page of a dialog's events, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentEventPage {
    /// The events.
    pub items: Vec<AgentEvent>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    pub next_cursor: Option<String>,
    /// The dialog's revision read before the events (pass it as
    /// `since_revision` when subscribing).
    pub revision: u64,
}

/// How many of a dialog's signals and completions are in each delivery
/// state, as of `revision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DialogInbox {
    /// Waiting for a turn, or being delivered.
    pub pending: u64,
    /// Taken into a turn.
    pub delivered: u64,
    /// Given up on: never to be delivered.
    pub dead_lettered: u64,
    /// Withdrawn before delivery (the signals of a cancelled run).
    pub superseded: u64,
    /// The dialog's revision the counts are as of.
    pub revision: u64,
}

impl From<keel_store::InboxCounts> for DialogInbox {
    fn from(c: keel_store::InboxCounts) -> Self {
        Self {
            pending: c.pending,
            delivered: c.delivered,
            dead_lettered: c.dead_lettered,
            superseded: c.superseded,
            revision: c.revision,
        }
    }
}

/// A page of a run's events, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunEventPage {
    /// The events.
    pub items: Vec<AgentEvent>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    pub next_cursor: Option<String>,
}

/// Liveness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
    /// keel's version.
    pub version: String,
}

/// Readiness: whether new turns are accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Ready {
    /// `ready`.
    pub status: String,
    /// Generation of the agent catalog in force (`null` without agent definitions).
    pub catalog_generation: Option<u64>,
    /// Turns running now.
    pub running_turns: usize,
}

/// What a catalog reload did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReloadReport {
    /// The generation now in force.
    pub generation: u64,
    /// The agents it defines.
    pub agents: Vec<String>,
    /// What the definitions have that did not fail the reload (file, line,
    /// message), e.g. a second frontmatter-like block in a role prompt.
    pub warnings: Vec<String>,
}

/// Where an approval stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalState {
    /// Waiting for a person.
    Pending,
    /// Approved: the tool runs when the turn resumes.
    Approved,
    /// Denied: the model reads the denial and its reason.
    Denied,
    /// Nobody decided within `tools.approval_timeout_secs`: a denial.
    Expired,
    /// The user sent new input while it was pending: a denial.
    Superseded,
}

impl From<keel_store::ApprovalStatus> for ApprovalState {
    fn from(s: keel_store::ApprovalStatus) -> Self {
        use keel_store::ApprovalStatus as S;
        match s {
            S::Pending => Self::Pending,
            S::Approved => Self::Approved,
            S::Denied => Self::Denied,
            S::Expired => Self::Expired,
            S::Superseded => Self::Superseded,
        }
    }
}

/// A tool call that needs (or got) a person's decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Approval {
    /// Its id (`POST /api/approvals/{id}` decides it).
    pub id: Uuid,
    /// The dialog it belongs to.
    pub session_id: Uuid,
    /// The root turn that asked, or whose delegation tree the asking run
    /// belongs to.
    pub turn_id: Uuid,
    /// The background run that asked (absent: the root turn did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<Uuid>,
    /// The agent that asked.
    pub agent: String,
    /// The model's id of the call (its line in the conversation).
    pub tool_call_id: String,
    /// The tool.
    pub tool: String,
    /// The arguments, as the model sent them.
    pub arguments: serde_json::Value,
    /// Where it stands.
    pub status: ApprovalState,
    /// Approved for every later call of this tool in the dialog.
    pub always: bool,
    /// The reason of a denial, when one was given.
    pub reason: Option<String>,
    /// When it was asked.
    pub created_at: Timestamp,
    /// When it expires as a denial, if nobody decides.
    pub expires_at: Timestamp,
    /// When it was decided.
    pub decided_at: Option<Timestamp>,
    /// The dialog's revision of its last change.
    pub revision: u64,
}

impl From<&keel_store::ApprovalRecord> for Approval {
    fn from(a: &keel_store::ApprovalRecord) -> Self {
        Self {
            id: a.id.as_uuid(),
            session_id: a.session_id.as_uuid(),
            turn_id: a.turn_id.as_uuid(),
            run_id: a.run_id.map(|r| r.as_uuid()),
            agent: a.agent_id.to_string(),
            tool_call_id: a.tool_call_id.clone(),
            tool: a.tool_name.clone(),
            arguments: serde_json::from_str(&a.arguments)
                .unwrap_or_else(|_| serde_json::Value::String(a.arguments.clone())),
            status: a.status.into(),
            always: a.always,
            reason: a.reason.clone(),
            created_at: Timestamp(a.created_at_ms),
            expires_at: Timestamp(a.expires_at_ms),
            decided_at: a.decided_at_ms.map(Timestamp),
            revision: a.revision,
        }
    }
}

/// A dialog's approvals, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalList {
    /// The approvals.
    pub items: Vec<Approval>,
}

/// Which approvals a list shows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ApprovalQuery {
    /// `pending` (the default): only those waiting; `all`: every one.
    pub status: Option<String>,
}

/// A person's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalChoice {
    /// Run the call this once.
    Approve,
    /// Run it, and every later call of this tool in this dialog, unasked.
    ApproveAlways,
    /// Do not run it; the model reads the reason.
    Deny,
}

/// The body of `POST /api/approvals/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApprovalDecision {
    /// The decision.
    pub decision: ApprovalChoice,
    /// Why (the model reads it with a denial); at most 2000 bytes are kept.
    #[serde(default)]
    pub reason: Option<String>,
}
