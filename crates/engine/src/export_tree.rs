//! The history tree of a [`DialogExport`](crate::DialogExport): every
//! timeline (the current branch and those a rollback left behind) with the
//! messages it owns, and every checkpoint with its state, read from the
//! store and turned back into an [`ImportTree`].

use std::collections::HashMap;

use keel_core::CheckpointId;
use keel_store::{
    CheckpointSource, DialogTree, ImportCheckpoint, ImportTimeline, ImportTree, NewMessage,
};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::export::{DialogExport, ExportedMessage};
use crate::state::SessionState;

/// One timeline of the dialog: where it branches off and the messages it owns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedTimeline {
    /// Its id in the exported dialog (checkpoints and children name it).
    pub id: String,
    /// The timeline it branches from (`None`: the dialog's first timeline).
    #[serde(default)]
    pub parent: Option<String>,
    /// The last seq of the parent it shares.
    #[serde(default)]
    pub fork_seq: Option<i64>,
    /// The messages it owns, in seq order (seqs follow each other from
    /// `fork_seq + 1`; the first timeline's from 1, a fork's inherited
    /// history included).
    #[serde(default)]
    pub messages: Vec<ExportedMessage>,
}

/// One checkpoint: where in which timeline, why, and the state it restores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedCheckpoint {
    /// Its id in the exported dialog.
    pub id: String,
    /// The checkpoint it follows, if that one is in the file.
    #[serde(default)]
    pub parent_id: Option<String>,
    /// Why it was taken: `turn`, `manual`, `rollback` or `fork`.
    pub source: String,
    /// The turn index it restores.
    pub turn_index: u64,
    /// The timeline whose prefix it marks.
    pub timeline: String,
    /// The last seq it sees.
    pub seq: i64,
    /// When it was taken (ms).
    pub created_at_ms: i64,
    /// The state it restores.
    pub state: SessionState,
}

fn message(m: &keel_store::StoredMessage) -> ExportedMessage {
    ExportedMessage {
        seq: m.seq,
        slot: m.slot.clone(),
        message: m.message.clone(),
    }
}

/// The exported timelines and checkpoints of a stored tree.
pub(crate) fn exported_tree(
    tree: &DialogTree,
) -> Result<(Vec<ExportedTimeline>, Vec<ExportedCheckpoint>)> {
    let timelines = tree
        .timelines
        .iter()
        .map(|t| ExportedTimeline {
            id: t.id.clone(),
            parent: t.parent.clone(),
            fork_seq: t.fork_seq,
            messages: t.messages.iter().map(message).collect(),
        })
        .collect();
    let ids: Vec<CheckpointId> = tree.checkpoints.iter().map(|(c, _)| c.id).collect();
    let checkpoints = tree
        .checkpoints
        .iter()
        .map(|(cp, state)| {
            Ok(ExportedCheckpoint {
                id: cp.id.to_string(),
                parent_id: cp
                    .parent_id
                    .filter(|p| ids.contains(p))
                    .map(|p| p.to_string()),
                source: cp.source.as_str().to_owned(),
                turn_index: cp.turn_index,
                timeline: cp.timeline_id.as_str().to_owned(),
                seq: cp.seq,
                created_at_ms: cp.created_at_ms,
                state: SessionState::from_blob(state)?,
            })
        })
        .collect::<Result<_>>()?;
    Ok((timelines, checkpoints))
}

fn invalid(what: String) -> EngineError {
    EngineError::InvalidInput(what)
}

impl DialogExport {
    /// The tree to import: timelines and checkpoints with new checkpoint
    /// ids (parents mapped), and the live state; `None` for a file without
    /// timelines (an older keel's), which is imported from `messages`.
    pub(crate) fn import_tree(&self) -> Result<Option<ImportTree>> {
        if self.timelines.is_empty() {
            return Ok(None);
        }
        let head = self
            .head_timeline
            .clone()
            .ok_or_else(|| invalid("the export has timelines but no head_timeline".into()))?;
        if !self.state.slots.contains_key(&self.state.current_slot) {
            return Err(invalid(format!(
                "the export's current slot {:?} has no configuration",
                self.state.current_slot
            )));
        }
        let timelines = self
            .timelines
            .iter()
            .map(|t| ImportTimeline {
                key: t.id.clone(),
                parent: t.parent.clone(),
                fork_seq: t.fork_seq,
                messages: t
                    .messages
                    .iter()
                    .map(|m| (m.seq, NewMessage::in_slot(&m.slot, m.message.clone())))
                    .collect(),
            })
            .collect();
        let mut ids: HashMap<&str, CheckpointId> = HashMap::new();
        let mut checkpoints = Vec::with_capacity(self.checkpoints.len());
        for cp in &self.checkpoints {
            let source: CheckpointSource = cp
                .source
                .parse()
                .map_err(|e| invalid(format!("checkpoint {:?}: {e}", cp.id)))?;
            let parent = match cp.parent_id.as_deref() {
                None => None,
                Some(p) => Some(*ids.get(p).ok_or_else(|| {
                    invalid(format!(
                        "checkpoint {:?} follows checkpoint {p:?}, which is not before it",
                        cp.id
                    ))
                })?),
            };
            let id = CheckpointId::new();
            if ids.insert(cp.id.as_str(), id).is_some() {
                return Err(invalid(format!("two checkpoints have id {:?}", cp.id)));
            }
            checkpoints.push(ImportCheckpoint {
                id,
                parent,
                timeline: cp.timeline.clone(),
                seq: cp.seq,
                turn_index: cp.turn_index,
                source,
                state: cp.state.to_blob()?,
                created_at_ms: cp.created_at_ms,
            });
        }
        Ok(Some(ImportTree {
            timelines,
            checkpoints,
            head,
            state: self.state.to_blob()?,
        }))
    }
}
