//! [`SessionSnapshot`]: a whole session as portable JSON (export/import).
//! Every field has a default, so snapshots written by older versions (with
//! fewer fields) still import.

use serde::{Deserialize, Serialize};

use keel_core::Message;

use crate::error::{EngineError, Result};
use crate::session::AgentSession;
use crate::state::SessionState;

/// Current snapshot format version.
pub(crate) const SNAPSHOT_FORMAT: u32 = 1;

/// One message of a snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SnapshotMessage {
    /// Sequence number in the exported history.
    pub seq: i64,
    /// Slot it belongs to.
    pub slot: String,
    /// The message.
    pub message: Message,
    /// Commit time (Unix ms).
    pub created_at_ms: i64,
}

impl Default for SnapshotMessage {
    fn default() -> Self {
        Self {
            seq: 0,
            slot: crate::state::DEFAULT_SLOT.to_owned(),
            message: Message::user(""),
            created_at_ms: 0,
        }
    }
}

/// A whole session: identity, state and materialized history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionSnapshot {
    /// Format version.
    pub format: u32,
    /// The exported session's id.
    pub session_id: Option<String>,
    /// Agent the session ran.
    pub agent: Option<String>,
    /// Title.
    pub title: Option<String>,
    /// Turn index, cost, slots, memory.
    pub state: SessionState,
    /// Every message, hidden included, in seq order.
    pub messages: Vec<SnapshotMessage>,
}

impl Default for SessionSnapshot {
    fn default() -> Self {
        Self {
            format: SNAPSHOT_FORMAT,
            session_id: None,
            agent: None,
            title: None,
            state: SessionState::default(),
            messages: Vec::new(),
        }
    }
}

impl SessionSnapshot {
    /// Materializes `session`.
    pub(crate) fn of(session: &AgentSession) -> Self {
        Self {
            format: SNAPSHOT_FORMAT,
            session_id: Some(session.id().to_string()),
            agent: session.record.agent_id.as_ref().map(ToString::to_string),
            title: Some(session.record.title.clone()),
            state: session.state.clone(),
            messages: session
                .history
                .iter()
                .map(|m| SnapshotMessage {
                    seq: m.seq,
                    slot: m.slot.clone(),
                    message: Message::clone(&m.message),
                    created_at_ms: m.created_at_ms,
                })
                .collect(),
        }
    }

    /// Messages with their slots, in seq order.
    pub(crate) fn ordered_messages(&self) -> Vec<(String, Message)> {
        let mut sorted: Vec<&SnapshotMessage> = self.messages.iter().collect();
        sorted.sort_by_key(|m| m.seq);
        sorted
            .into_iter()
            .map(|m| (m.slot.clone(), m.message.clone()))
            .collect()
    }

    /// The state with every sequence number mapped from the exported history
    /// to `new_seqs` (the seqs the imported messages got, in order).
    pub(crate) fn remapped_state(&self, new_seqs: &[i64]) -> Result<SessionState> {
        let mut old: Vec<i64> = self.messages.iter().map(|m| m.seq).collect();
        old.sort_unstable();
        if old.len() != new_seqs.len() {
            return Err(EngineError::InvalidInput(
                "snapshot import stored a different number of messages".into(),
            ));
        }
        let first_new = new_seqs.first().copied().unwrap_or(1);
        let last_new = new_seqs.last().copied().unwrap_or(0);
        // The first new seq at or after `x`.
        let map_from = |x: i64| {
            let i = old.partition_point(|&s| s < x);
            new_seqs.get(i).copied().unwrap_or(last_new + 1)
        };
        // The last new seq at or before `x`.
        let map_upto = |x: i64| {
            let i = old.partition_point(|&s| s <= x);
            if i == 0 {
                first_new - 1
            } else {
                new_seqs[i - 1]
            }
        };
        let mut state = self.state.clone();
        for config in state.slots.values_mut() {
            for segment in &mut config.segments {
                segment.from_seq = map_from(segment.from_seq);
                segment.upto_seq = segment.upto_seq.map(map_upto);
            }
        }
        if !state.slots.contains_key(&state.current_slot) {
            return Err(EngineError::InvalidInput(format!(
                "snapshot's current slot {:?} has no configuration",
                state.current_slot
            )));
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_snapshots_with_missing_fields_still_load() {
        let s: SessionSnapshot = serde_json::from_str(
            r#"{"title": "t", "messages": [{"message": {"role": "user", "content": [{"type": "text", "text": "hi"}]}}]}"#,
        )
        .unwrap();
        assert_eq!(s.format, SNAPSHOT_FORMAT);
        assert_eq!(s.state, SessionState::default());
        assert_eq!(s.messages[0].slot, "default");
        assert_eq!(s.messages[0].message.text(), "hi");
        let empty: SessionSnapshot = serde_json::from_str("{}").unwrap();
        assert!(empty.messages.is_empty());
    }

    #[test]
    fn remapping_keeps_slot_views() {
        let mut state = SessionState::default();
        state
            .derive_slot("default", "side", crate::state::SlotMode::Full, 20)
            .unwrap();
        let snap = SessionSnapshot {
            state,
            messages: [10, 20, 30]
                .iter()
                .map(|s| SnapshotMessage {
                    seq: *s,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let st = snap.remapped_state(&[1, 2, 3]).unwrap();
        let side = &st.slots["side"].segments;
        assert_eq!((side[0].from_seq, side[0].upto_seq), (1, Some(2)));
        assert_eq!((side[1].from_seq, side[1].upto_seq), (3, None));
        assert!(snap.remapped_state(&[1]).is_err());
    }
}
