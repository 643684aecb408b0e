//! [`DialogExport`]: one dialog as portable, versioned JSON (`keel export`,
//! `keel import`, `GET /api/dialogs/{id}/export`, `POST /api/dialogs/import`).
//!
//! The format is an API (docs/EXPORT.md): `format` names it, `version` is
//! its major version. A reader ignores fields it does not know (a newer
//! writer may add them) and defaults the ones an older writer left out; a
//! file whose `version` is newer than [`DIALOG_FORMAT_VERSION`] is refused
//! before anything else in it is read.

use serde::{Deserialize, Serialize};

use keel_core::{ExecutionMode, Message, RunStatus, Usage};

use crate::error::{EngineError, Result};
use crate::export_tree::{ExportedCheckpoint, ExportedTimeline};
use crate::session::AgentSession;
use crate::state::SessionState;

/// The `format` of every dialog export.
pub const DIALOG_FORMAT: &str = "keel.dialog";
/// The newest format version this build writes and reads.
pub const DIALOG_FORMAT_VERSION: u32 = 1;
/// The largest export file or request body an import reads, in bytes.
pub const MAX_DIALOG_EXPORT_BYTES: usize = 64 * 1024 * 1024;

/// One dialog: who it is, every message of its current history (hidden
/// included) in order, and its state (turn index, cost, slots, memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DialogExport {
    /// Always [`DIALOG_FORMAT`].
    pub format: String,
    /// The format version the file was written in.
    pub version: u32,
    /// The dialog's identity and names.
    pub dialog: ExportedDialog,
    /// Every message, hidden included, in history order.
    #[serde(default)]
    pub messages: Vec<ExportedMessage>,
    /// Turn index, cost, slots (positions are the messages' `seq`s), memory.
    #[serde(default)]
    pub state: SessionState,
    /// Every sub-agent run of the dialog, parents before their children.
    #[serde(default)]
    pub runs: Vec<ExportedRun>,
    /// Every timeline of the dialog, parents first: the current branch and
    /// the branches rollbacks left behind (empty in an older keel's file).
    #[serde(default)]
    pub timelines: Vec<ExportedTimeline>,
    /// The timeline the dialog continues on.
    #[serde(default)]
    pub head_timeline: Option<String>,
    /// Every checkpoint of the dialog, oldest first.
    #[serde(default)]
    pub checkpoints: Vec<ExportedCheckpoint>,
    /// Every stored image its messages refer to (`keel-image:sha256:…`);
    /// left out when there is none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<ExportedImage>,
}

/// A stored image a message of the export refers to, with its bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedImage {
    /// SHA-256 of the bytes, lowercase hex: the hash its references name.
    pub sha256: String,
    /// Its media type (`image/png`, …).
    pub media_type: String,
    /// The bytes, base64 (standard alphabet, padded).
    pub data: String,
}

/// One sub-agent run of the dialog: what was asked, of whom, and how it ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedRun {
    /// Its id in the exported dialog (an import gives it a new one).
    pub id: String,
    /// The run that delegated it (`None`: the dialog's own agent did).
    #[serde(default)]
    pub parent_run_id: Option<String>,
    /// The agent that ran it.
    pub agent: String,
    /// The agent that delegated it.
    pub caller_agent: String,
    /// The delegating scope (the parent run's id or the root turn's).
    #[serde(default)]
    pub caller_scope: String,
    /// The task text.
    pub task: String,
    /// Extra context given with the task (JSON), if any.
    #[serde(default)]
    pub context_json: Option<String>,
    /// Foreground or background.
    pub mode: ExecutionMode,
    /// Delegation depth (1 for a child of the dialog's agent).
    #[serde(default = "one")]
    pub depth: u32,
    /// Status when exported (an import turns a run that had not ended into
    /// `interrupted`).
    pub status: RunStatus,
    /// Full result of a completed run.
    #[serde(default)]
    pub result: Option<String>,
    /// Error of a run that did not complete.
    #[serde(default)]
    pub error: Option<String>,
    /// Tokens used, once known.
    #[serde(default)]
    pub usage: Option<Usage>,
    /// Cost in USD, once known.
    #[serde(default)]
    pub cost: Option<f64>,
    /// Tool calls made.
    #[serde(default)]
    pub tool_calls: u32,
    /// Loop iterations made.
    #[serde(default)]
    pub iterations: u32,
    /// Attempt number.
    #[serde(default = "one")]
    pub attempt: u32,
    /// Provider profile, provider and model it ran on.
    #[serde(default)]
    pub model: ExportedModel,
    /// Hash of the agent definition it ran.
    #[serde(default)]
    pub definition_hash: String,
    /// Budget (JSON).
    #[serde(default)]
    pub budget_json: String,
    /// Bound plan item, if any.
    #[serde(default)]
    pub plan_item_id: Option<String>,
    /// When it was accepted, started, finished, last changed and due (ms).
    pub times: ExportedRunTimes,
}

/// Where a run's model calls went.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExportedModel {
    /// Provider profile name.
    #[serde(default)]
    pub profile: String,
    /// Provider name.
    #[serde(default)]
    pub provider: String,
    /// Model id.
    #[serde(default)]
    pub model: String,
}

/// A run's timestamps (ms since the epoch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedRunTimes {
    /// Accepted.
    pub created_at_ms: i64,
    /// Started, if it did.
    #[serde(default)]
    pub started_at_ms: Option<i64>,
    /// Ended, if it did.
    #[serde(default)]
    pub finished_at_ms: Option<i64>,
    /// Last changed.
    pub updated_at_ms: i64,
    /// Deadline.
    pub deadline_at_ms: i64,
}

fn one() -> u32 {
    1
}

/// The exported dialog's identity; an import keeps the names and gives it new ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedDialog {
    /// The exported session's id.
    #[serde(default)]
    pub id: Option<String>,
    /// Channel of its address.
    pub channel: String,
    /// Chat of its address.
    pub chat_id: String,
    /// Dialog id of its address (an import picks a fresh one).
    #[serde(default)]
    pub dialog_id: Option<String>,
    /// Title.
    pub title: String,
    /// Agent the dialog runs (`None`: the root agent).
    #[serde(default)]
    pub agent: Option<String>,
}

/// One message of the history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedMessage {
    /// Its position in the exported history; the state's slots refer to it.
    pub seq: i64,
    /// The context slot it belongs to.
    #[serde(default = "default_slot")]
    pub slot: String,
    /// The message.
    pub message: Message,
}

fn default_slot() -> String {
    crate::state::DEFAULT_SLOT.to_owned()
}

/// What is read of a file before the rest: its format and version.
#[derive(Deserialize)]
struct Header {
    format: Option<String>,
    version: Option<u32>,
}

fn not_an_export(e: serde_json::Error) -> EngineError {
    EngineError::InvalidInput(format!("the file is not a keel dialog export: {e}"))
}

impl DialogExport {
    /// Materializes `session`, its `runs` and its history `tree`.
    pub(crate) fn of(
        session: &AgentSession,
        runs: &[keel_store::RunRecord],
        tree: &keel_store::DialogTree,
    ) -> Result<Self> {
        let record = &session.record;
        let (timelines, checkpoints) = crate::export_tree::exported_tree(tree)?;
        Ok(Self {
            format: DIALOG_FORMAT.to_owned(),
            version: DIALOG_FORMAT_VERSION,
            dialog: ExportedDialog {
                id: Some(record.id.to_string()),
                channel: record.channel.clone(),
                chat_id: record.chat_id.clone(),
                dialog_id: Some(record.dialog_id.clone()),
                title: record.title.clone(),
                agent: record.agent_id.as_ref().map(ToString::to_string),
            },
            messages: session
                .history
                .iter()
                .map(|m| ExportedMessage {
                    seq: m.seq,
                    slot: m.slot.clone(),
                    message: Message::clone(&m.message),
                })
                .collect(),
            state: session.state.clone(),
            runs: runs.iter().map(ExportedRun::of).collect(),
            timelines,
            head_timeline: Some(tree.head.clone()),
            checkpoints,
            images: Vec::new(),
        })
    }

    /// The hashes of the stored images its messages (of every timeline)
    /// refer to, each once, in order.
    pub(crate) fn image_hashes(&self) -> std::collections::BTreeSet<String> {
        let timelines = self.timelines.iter().flat_map(|t| &t.messages);
        self.messages
            .iter()
            .chain(timelines)
            .flat_map(|m| &m.message.content)
            .filter_map(|part| match part {
                keel_core::ContentPart::ImageRef { uri, .. } => {
                    keel_core::image::stored_image_hash(uri).map(str::to_owned)
                }
                keel_core::ContentPart::Text { .. } => None,
            })
            .collect()
    }

    /// Parses an export file, refusing another format, a newer version or
    /// more than [`MAX_DIALOG_EXPORT_BYTES`].
    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        if bytes.len() > MAX_DIALOG_EXPORT_BYTES {
            return Err(EngineError::InvalidInput(format!(
                "the export is {} bytes; at most {MAX_DIALOG_EXPORT_BYTES} are imported",
                bytes.len()
            )));
        }
        let value = serde_json::from_slice(bytes).map_err(not_an_export)?;
        Self::from_value(value)
    }

    /// [`Self::from_json`] of JSON already parsed (a request body).
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        let header = Header::deserialize(&value).map_err(not_an_export)?;
        match (header.format.as_deref(), header.version) {
            (Some(DIALOG_FORMAT), Some(v)) if v > DIALOG_FORMAT_VERSION => {
                return Err(EngineError::InvalidInput(format!(
                    "the file is {DIALOG_FORMAT} version {v}; this keel reads version \
                     {DIALOG_FORMAT_VERSION} and older, so import it with a newer keel"
                )))
            }
            (Some(DIALOG_FORMAT), Some(_)) => {}
            (format, version) => {
                let shown = |v: Option<String>| v.unwrap_or_else(|| "missing".to_owned());
                return Err(EngineError::InvalidInput(format!(
                    "the file is not a keel dialog export (format {}, version {}; \
                     expected format \"{DIALOG_FORMAT}\")",
                    shown(format.map(|f| format!("{f:?}"))),
                    shown(version.map(|v| v.to_string())),
                )));
            }
        }
        serde_json::from_value(value).map_err(not_an_export)
    }

    /// The export as pretty JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| EngineError::StateEncoding(format!("a dialog export: {e}")))
    }

    /// Messages with their slots, in seq order.
    pub(crate) fn ordered_messages(&self) -> Vec<(String, Message)> {
        let mut sorted: Vec<&ExportedMessage> = self.messages.iter().collect();
        sorted.sort_by_key(|m| m.seq);
        sorted
            .into_iter()
            .map(|m| (m.slot.clone(), m.message.clone()))
            .collect()
    }

    /// The state with every position mapped from the exported history to
    /// the imported one, whose messages get seqs 1, 2, … in order.
    pub(crate) fn remapped_state(&self) -> Result<SessionState> {
        let mut old: Vec<i64> = self.messages.iter().map(|m| m.seq).collect();
        old.sort_unstable();
        if old.windows(2).any(|w| w[0] == w[1]) {
            return Err(EngineError::InvalidInput(
                "the export has two messages with the same seq".into(),
            ));
        }
        let count = i64::try_from(old.len()).unwrap_or(i64::MAX);
        let new_seq = |i: usize| i64::try_from(i).unwrap_or(i64::MAX);
        // The first new seq at or after `x` (a start before every message,
        // such as a fresh slot's 0, is kept as it was).
        let map_from = |x: i64| match old.partition_point(|&s| s < x) {
            0 => x.min(1),
            i => new_seq(i) + 1,
        };
        // The last new seq at or before `x`.
        let map_upto = |x: i64| new_seq(old.partition_point(|&s| s <= x)).min(count);
        let mut state = self.state.clone();
        for config in state.slots.values_mut() {
            for segment in &mut config.segments {
                segment.from_seq = map_from(segment.from_seq);
                segment.upto_seq = segment.upto_seq.map(map_upto);
            }
        }
        if !state.slots.contains_key(&state.current_slot) {
            return Err(EngineError::InvalidInput(format!(
                "the export's current slot {:?} has no configuration",
                state.current_slot
            )));
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(messages: &[i64]) -> DialogExport {
        DialogExport {
            format: DIALOG_FORMAT.to_owned(),
            version: DIALOG_FORMAT_VERSION,
            dialog: ExportedDialog {
                id: None,
                channel: "api".into(),
                chat_id: "default".into(),
                dialog_id: None,
                title: "t".into(),
                agent: None,
            },
            messages: messages
                .iter()
                .map(|s| ExportedMessage {
                    seq: *s,
                    slot: default_slot(),
                    message: Message::user("hi"),
                })
                .collect(),
            state: SessionState::default(),
            runs: Vec::new(),
            timelines: Vec::new(),
            head_timeline: None,
            checkpoints: Vec::new(),
            images: Vec::new(),
        }
    }

    #[test]
    fn fields_an_older_writer_left_out_default_and_unknown_ones_are_ignored() {
        let e = DialogExport::from_json(
            br#"{"format": "keel.dialog", "version": 1, "added_later": {"x": 1},
                 "dialog": {"channel": "api", "chat_id": "default", "title": "t", "color": "red"},
                 "messages": [{"seq": 4, "message": {"role": "user", "content": [{"type": "text", "text": "hi"}]}}]}"#,
        )
        .unwrap();
        assert_eq!(e.state, SessionState::default());
        assert_eq!(e.messages[0].slot, "default");
        assert_eq!(e.messages[0].message.text(), "hi");
    }

    #[test]
    fn a_newer_version_or_another_format_is_refused_with_both_versions_named() {
        let newer = br#"{"format": "keel.dialog", "version": 2, "dialog": "changed shape"}"#;
        let errors = [
            DialogExport::from_json(newer),
            DialogExport::from_json(br#"{"format": "other", "version": 1}"#),
            DialogExport::from_json(br#"{"title": "a SessionSnapshot"}"#),
            DialogExport::from_json(b"not json"),
            DialogExport::from_json(&vec![b' '; MAX_DIALOG_EXPORT_BYTES + 1]),
        ]
        .map(|r| r.unwrap_err().to_string());
        insta::assert_debug_snapshot!(errors);
    }

    #[test]
    fn remapping_keeps_slot_views() {
        let mut e = export(&[10, 20, 30]);
        e.state
            .derive_slot("default", "side", crate::state::SlotMode::Full, 20)
            .unwrap();
        let st = e.remapped_state().unwrap();
        let side = &st.slots["side"].segments;
        assert_eq!((side[0].from_seq, side[0].upto_seq), (0, Some(2)));
        assert_eq!((side[1].from_seq, side[1].upto_seq), (3, None));
        assert!(export(&[1, 1]).remapped_state().is_err());
    }
}
