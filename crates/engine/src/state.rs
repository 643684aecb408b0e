//! The small mutable state of a session — turn index, cost, context slots,
//! session memory — and how a slot's view of the history is computed.
//!
//! The state is serialized deterministically (sorted maps) into one blob that
//! keel-store keeps content-addressed; an unchanged state costs no bytes.
//! Messages are not part of it: they are append-only rows, and a slot is a
//! view over them: a self-contained list of segments (its own messages plus,
//! for a derived slot, a frozen prefix of the slot it came from).

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_core::{CostTracker, Message, Role};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// Name of the slot every session starts with.
pub(crate) const DEFAULT_SLOT: &str = "default";
/// Longest slot name.
pub(crate) const MAX_SLOT_NAME: usize = 64;
/// Most memory entries per session.
pub(crate) const MAX_MEMORY_ENTRIES: usize = 256;
/// Largest memory value, in bytes.
pub(crate) const MAX_MEMORY_VALUE_BYTES: usize = 16 * 1024;

/// How a slot replays history to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum SlotMode {
    /// Every message of the slot's view.
    Full,
    /// The slot's summary (if any) plus the last `window` messages.
    Focused {
        /// Messages replayed after the summary.
        window: usize,
    },
    /// Replays like `Full`; turns and merges may not write to it.
    Readonly,
}

/// A run of one slot's messages that a view includes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// The slot the messages were written to.
    pub slot: String,
    /// First included sequence number.
    pub from_seq: i64,
    /// Last included sequence number; `None` for a slot's own, growing run.
    #[serde(default)]
    pub upto_seq: Option<i64>,
}

impl Segment {
    fn contains(&self, m: &HistoryMessage) -> bool {
        m.slot == self.slot && m.seq >= self.from_seq && self.upto_seq.is_none_or(|u| m.seq <= u)
    }
}

/// Configuration of one context slot. Its view is self-contained (a list of
/// segments), so changing or deleting another slot never changes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotConfig {
    /// Replay mode.
    pub mode: SlotMode,
    /// The runs of messages the slot sees, oldest first; the last one is its
    /// own.
    pub segments: Vec<Segment>,
    /// A summary replacing older history: in `Focused` mode the messages
    /// before the window, in the other modes those up to `summary_upto`.
    #[serde(default)]
    pub summary: Option<String>,
    /// The last seq the summary covers (the compaction point): messages of
    /// the view after it replay as they are.
    #[serde(default)]
    pub summary_upto: Option<i64>,
}

impl SlotConfig {
    fn new(name: &str, mode: SlotMode, from_seq: i64) -> Self {
        Self {
            mode,
            segments: vec![Segment {
                slot: name.to_owned(),
                from_seq,
                upto_seq: None,
            }],
            summary: None,
            summary_upto: None,
        }
    }

    /// The segments up to `last_seq` (a frozen copy of the view).
    fn prefix(&self, last_seq: i64) -> Vec<Segment> {
        self.segments
            .iter()
            .filter(|s| s.from_seq <= last_seq)
            .map(|s| Segment {
                slot: s.slot.clone(),
                from_seq: s.from_seq,
                upto_seq: Some(s.upto_seq.map_or(last_seq, |u| u.min(last_seq))),
            })
            .collect()
    }

    /// Where the slot's own messages start.
    fn own_from_seq(&self, name: &str) -> i64 {
        self.segments
            .iter()
            .rev()
            .find(|s| s.slot == name && s.upto_seq.is_none())
            .map_or(i64::MAX, |s| s.from_seq)
    }
}

/// One session memory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryEntry {
    /// The value.
    pub value: String,
    /// Free-form metadata.
    #[serde(default)]
    pub metadata: serde_json::Value,
    /// When the entry was written (Unix ms).
    #[serde(default)]
    pub created_at_ms: i64,
}

/// How [`SessionManager::merge_slot`](crate::SessionManager::merge_slot) combines a slot into another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MergeStrategy {
    /// Append the source's own messages to the target.
    Append,
    /// The target's view becomes the source's view.
    Replace,
}

/// The checkpointed mutable state of a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionState {
    /// Completed turns.
    pub turn_index: u32,
    /// Usage so far.
    pub cost: CostTracker,
    /// The slot new turns use.
    pub current_slot: String,
    /// Every slot by name.
    pub slots: BTreeMap<String, SlotConfig>,
    /// Turn of the last auto-summary.
    pub last_summary_turn: Option<u32>,
    /// Session memory by key.
    pub memory: BTreeMap<String, MemoryEntry>,
}

impl Default for SessionState {
    fn default() -> Self {
        let mut slots = BTreeMap::new();
        slots.insert(
            DEFAULT_SLOT.to_owned(),
            SlotConfig::new(DEFAULT_SLOT, SlotMode::Full, 0),
        );
        Self {
            turn_index: 0,
            cost: CostTracker::default(),
            current_slot: DEFAULT_SLOT.to_owned(),
            slots,
            last_summary_turn: None,
            memory: BTreeMap::new(),
        }
    }
}

/// A message of the session's history with its position.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryMessage {
    /// Sequence number, increasing across slots.
    pub seq: i64,
    /// The slot it was written to.
    pub slot: String,
    /// The message (shared with the requests that replay it).
    pub message: Arc<Message>,
    /// When it was committed (Unix ms).
    pub created_at_ms: i64,
    /// For a turn input committed before its answer: whether it was answered.
    pub input_state: Option<keel_store::InputState>,
}

impl SessionState {
    /// Deterministic JSON bytes (the content-addressed blob). An error here
    /// is a bug; it is returned rather than stored as an empty blob that
    /// would later read as corruption.
    pub fn to_blob(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| EngineError::StateEncoding(e.to_string()))
    }

    /// The state `record` points at: its committed blob, or the default
    /// before its first commit.
    pub(crate) async fn of_record(
        store: &keel_store::Store,
        record: &keel_store::SessionRecord,
    ) -> Result<Self> {
        match &record.state_hash {
            None => Ok(SessionState::default()),
            Some(hash) => {
                let blob = store.get_state_blob(hash.clone()).await?.ok_or_else(|| {
                    EngineError::CorruptState(format!("state blob {hash} is missing"))
                })?;
                SessionState::from_blob(&blob)
            }
        }
    }

    /// Whether a stored state blob restores (the store's invariant check
    /// calls this for every checkpoint); `Err` says why not.
    pub fn check_blob(bytes: &[u8]) -> std::result::Result<(), String> {
        Self::from_blob(bytes).map(drop).map_err(|e| e.to_string())
    }

    /// Decodes a blob; missing fields take their defaults.
    pub(crate) fn from_blob(bytes: &[u8]) -> Result<Self> {
        let state: SessionState =
            serde_json::from_slice(bytes).map_err(|e| EngineError::CorruptState(e.to_string()))?;
        if !state.slots.contains_key(&state.current_slot) {
            return Err(EngineError::CorruptState(format!(
                "current slot {:?} has no configuration",
                state.current_slot
            )));
        }
        Ok(state)
    }

    /// The configuration of slot `name`.
    pub fn slot(&self, name: &str) -> Result<&SlotConfig> {
        self.slots
            .get(name)
            .ok_or_else(|| EngineError::SlotNotFound(name.to_owned()))
    }

    /// Creates an empty slot (its history starts at `next_seq`).
    pub(crate) fn create_slot(&mut self, name: &str, mode: SlotMode, next_seq: i64) -> Result<()> {
        validate_slot_name(name)?;
        if self.slots.contains_key(name) {
            return Err(EngineError::SlotExists(name.to_owned()));
        }
        self.slots
            .insert(name.to_owned(), SlotConfig::new(name, mode, next_seq));
        Ok(())
    }

    /// Makes `name` the slot new turns use.
    pub(crate) fn switch_slot(&mut self, name: &str) -> Result<()> {
        self.slot(name)?;
        self.current_slot = name.to_owned();
        Ok(())
    }

    /// Creates `name` as a fork of `from`: it sees `from`'s history up to
    /// `last_seq`, then only its own messages.
    pub(crate) fn derive_slot(
        &mut self,
        from: &str,
        name: &str,
        mode: SlotMode,
        last_seq: i64,
    ) -> Result<()> {
        let prefix = self.slot(from)?.prefix(last_seq);
        self.create_slot(name, mode, last_seq + 1)?;
        if let Some(config) = self.slots.get_mut(name) {
            config.segments.splice(0..0, prefix);
        }
        Ok(())
    }

    /// Deletes a slot (its messages stay in the history, so slots derived
    /// from it keep their view). The default slot, the last slot and the
    /// current slot cannot be deleted.
    pub(crate) fn delete_slot(&mut self, name: &str) -> Result<()> {
        self.slot(name)?;
        if name == DEFAULT_SLOT {
            return Err(EngineError::SlotRule(
                "the default slot cannot be deleted".into(),
            ));
        }
        if self.slots.len() == 1 {
            return Err(EngineError::SlotRule(
                "the last slot cannot be deleted".into(),
            ));
        }
        if self.current_slot == name {
            return Err(EngineError::SlotRule(format!(
                "slot {name:?} is the current slot; switch away first"
            )));
        }
        self.slots.remove(name);
        Ok(())
    }

    /// Checks a merge of `source` into `target` and applies its state part.
    /// For [`MergeStrategy::Append`] the caller appends the returned
    /// messages (the source's own ones) to `target`.
    pub(crate) fn merge_slot(
        &mut self,
        source: &str,
        target: &str,
        strategy: MergeStrategy,
        history: &[HistoryMessage],
        last_seq: i64,
    ) -> Result<Vec<Message>> {
        if source == target {
            return Err(EngineError::SlotRule(
                "a slot cannot be merged into itself".into(),
            ));
        }
        let source_config = self.slot(source)?.clone();
        if self.slot(target)?.mode == SlotMode::Readonly {
            return Err(EngineError::SlotReadonly(target.to_owned()));
        }
        match strategy {
            MergeStrategy::Append => {
                let from = source_config.own_from_seq(source);
                Ok(history
                    .iter()
                    .filter(|m| m.slot == source && m.seq >= from)
                    .map(|m| Message::clone(&m.message))
                    .collect())
            }
            MergeStrategy::Replace => {
                let mut segments = source_config.prefix(last_seq);
                segments.push(Segment {
                    slot: target.to_owned(),
                    from_seq: last_seq + 1,
                    upto_seq: None,
                });
                if let Some(t) = self.slots.get_mut(target) {
                    t.segments = segments;
                }
                Ok(Vec::new())
            }
        }
    }

    /// Every message slot `name` sees, in order.
    pub(crate) fn slot_view<'h>(
        &self,
        name: &str,
        history: &'h [HistoryMessage],
    ) -> Result<Vec<&'h HistoryMessage>> {
        let config = self.slot(name)?;
        Ok(history
            .iter()
            .filter(|m| config.segments.iter().any(|s| s.contains(m)))
            .collect())
    }

    /// The messages replayed to the model for slot `name`.
    pub fn replay(&self, name: &str, history: &[HistoryMessage]) -> Result<Vec<Arc<Message>>> {
        let config = self.slot(name)?;
        let view = self.slot_view(name, history)?;
        let mut out = Vec::with_capacity(view.len() + 1);
        let start = match config.mode {
            SlotMode::Focused { window } => {
                if let Some(summary) = &config.summary {
                    out.push(summary_message(summary));
                }
                let mut start = view.len().saturating_sub(window);
                // Never begin with tool results whose call was cut off.
                while start < view.len() && view[start].message.role == Role::Tool {
                    start += 1;
                }
                start
            }
            SlotMode::Full | SlotMode::Readonly => match (&config.summary, config.summary_upto) {
                (Some(summary), Some(upto)) => {
                    out.push(summary_message(summary));
                    let mut start = view.partition_point(|m| m.seq <= upto);
                    while start < view.len() && view[start].message.role == Role::Tool {
                        start += 1;
                    }
                    start
                }
                _ => 0,
            },
        };
        // Cloning an Arc: the history is shared, never copied.
        out.extend(view[start..].iter().map(|m| Arc::clone(&m.message)));
        Ok(out)
    }

    /// Sets a memory entry.
    pub(crate) fn set_memory(
        &mut self,
        key: &str,
        value: String,
        metadata: serde_json::Value,
        now_ms: i64,
    ) -> Result<()> {
        check_memory_entry(&self.memory, key, &value)?;
        self.memory.insert(
            key.to_owned(),
            MemoryEntry {
                value,
                metadata,
                created_at_ms: now_ms,
            },
        );
        Ok(())
    }
}

/// Checks that `key` may be set to `value` in `memory`: keys of 1 to 128
/// bytes, values of at most 16 KiB, at most 256 entries.
pub(crate) fn check_memory_entry(
    memory: &BTreeMap<String, MemoryEntry>,
    key: &str,
    value: &str,
) -> Result<()> {
    if key.is_empty() || key.len() > 128 {
        return Err(EngineError::InvalidInput(
            "memory keys are 1 to 128 bytes".into(),
        ));
    }
    if value.len() > MAX_MEMORY_VALUE_BYTES {
        return Err(EngineError::InvalidInput(format!(
            "memory value of {} bytes is over the {MAX_MEMORY_VALUE_BYTES}-byte limit",
            value.len()
        )));
    }
    if !memory.contains_key(key) && memory.len() >= MAX_MEMORY_ENTRIES {
        return Err(EngineError::InvalidInput(format!(
            "session memory is full ({MAX_MEMORY_ENTRIES} entries)"
        )));
    }
    Ok(())
}

/// The message that stands for the summarized part of a slot's history.
fn summary_message(summary: &str) -> Arc<Message> {
    Arc::new(Message::system(format!(
        "Summary of the earlier conversation:\n{summary}"
    )))
}

fn validate_slot_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SLOT_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(EngineError::InvalidInput(format!(
            "slot name {name:?}: use 1 to {MAX_SLOT_NAME} ASCII letters, digits, '_' or '-'"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(seq: i64, slot: &str, text: &str) -> HistoryMessage {
        HistoryMessage {
            seq,
            slot: slot.into(),
            message: Arc::new(Message::user(text)),
            created_at_ms: seq,
            input_state: None,
        }
    }

    fn texts<M: std::borrow::Borrow<Message>>(v: &[M]) -> Vec<String> {
        v.iter().map(|m| m.borrow().text()).collect()
    }

    #[test]
    fn derived_slots_see_the_prefix_then_their_own_messages() {
        let mut s = SessionState::default();
        let mut h = vec![msg(1, "default", "a"), msg(2, "default", "b")];
        s.derive_slot("default", "side", SlotMode::Full, 2).unwrap();
        h.push(msg(3, "default", "c"));
        h.push(msg(4, "side", "x"));
        assert_eq!(texts(&s.replay("default", &h).unwrap()), ["a", "b", "c"]);
        assert_eq!(texts(&s.replay("side", &h).unwrap()), ["a", "b", "x"]);
        // A slot derived from a derived slot.
        s.derive_slot("side", "deeper", SlotMode::Full, 4).unwrap();
        h.push(msg(5, "deeper", "y"));
        assert_eq!(
            texts(&s.replay("deeper", &h).unwrap()),
            ["a", "b", "x", "y"]
        );
        // Deleting the slot in the middle does not change the derived view.
        s.delete_slot("side").unwrap();
        assert_eq!(
            texts(&s.replay("deeper", &h).unwrap()),
            ["a", "b", "x", "y"]
        );
    }

    #[test]
    fn merge_append_and_replace() {
        let mut s = SessionState::default();
        let mut h = vec![msg(1, "default", "a")];
        s.derive_slot("default", "side", SlotMode::Full, 1).unwrap();
        h.push(msg(2, "side", "x"));
        let appended = s
            .merge_slot("side", "default", MergeStrategy::Append, &h, 2)
            .unwrap();
        assert_eq!(texts(&appended), ["x"]);
        let none = s
            .merge_slot("side", "default", MergeStrategy::Replace, &h, 2)
            .unwrap();
        assert!(none.is_empty());
        h.push(msg(3, "default", "after"));
        assert_eq!(
            texts(&s.replay("default", &h).unwrap()),
            ["a", "x", "after"]
        );
    }

    #[test]
    fn merge_rules() {
        let mut s = SessionState::default();
        s.create_slot("ro", SlotMode::Readonly, 1).unwrap();
        let errs: Vec<String> = [
            s.merge_slot("default", "default", MergeStrategy::Append, &[], 0),
            s.merge_slot("default", "ro", MergeStrategy::Append, &[], 0),
            s.merge_slot("nope", "default", MergeStrategy::Append, &[], 0),
        ]
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect();
        insta::assert_yaml_snapshot!(errs, @r#"
        - a slot cannot be merged into itself
        - "context slot \"ro\" is read-only"
        - "context slot \"nope\" not found"
        "#);
    }

    #[test]
    fn delete_rules() {
        let mut s = SessionState::default();
        assert!(s.delete_slot(DEFAULT_SLOT).is_err());
        s.derive_slot("default", "a", SlotMode::Full, 0).unwrap();
        s.derive_slot("a", "b", SlotMode::Full, 0).unwrap();
        s.switch_slot("b").unwrap();
        assert!(s.delete_slot("b").is_err(), "current slot");
        s.switch_slot("default").unwrap();
        s.delete_slot("a").unwrap();
        s.delete_slot("b").unwrap();
        assert_eq!(s.slots.len(), 1);
        assert!(matches!(
            s.create_slot("bad name", SlotMode::Full, 0),
            Err(EngineError::InvalidInput(_))
        ));
        assert!(matches!(
            s.create_slot("default", SlotMode::Full, 0),
            Err(EngineError::SlotExists(_))
        ));
    }

    #[test]
    fn focused_replays_summary_and_window_without_orphan_tool_results() {
        let mut s = SessionState::default();
        s.create_slot("f", SlotMode::Focused { window: 2 }, 0)
            .unwrap();
        s.slots.get_mut("f").unwrap().summary = Some("earlier stuff".into());
        let mut h = vec![msg(1, "f", "a"), msg(2, "f", "b")];
        h.push(HistoryMessage {
            seq: 3,
            slot: "f".into(),
            message: Arc::new(Message::tool_result("c1", "t", "result")),
            created_at_ms: 3,
            input_state: None,
        });
        h.push(msg(4, "f", "d"));
        let replay = s.replay("f", &h).unwrap();
        assert_eq!(
            texts(&replay),
            ["Summary of the earlier conversation:\nearlier stuff", "d"]
        );
    }

    #[test]
    fn blob_is_deterministic_and_tolerates_missing_fields() {
        let mut a = SessionState::default();
        a.set_memory("k2", "v".into(), serde_json::json!({"x": 1}), 5)
            .unwrap();
        a.set_memory("k1", "v".into(), serde_json::Value::Null, 6)
            .unwrap();
        let b = SessionState::from_blob(&a.to_blob().unwrap()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.to_blob().unwrap(), b.to_blob().unwrap());
        let old = SessionState::from_blob(br#"{"turn_index": 3}"#).unwrap();
        assert_eq!(old.turn_index, 3);
        assert_eq!(old.current_slot, DEFAULT_SLOT);
        assert!(SessionState::from_blob(br#"{"current_slot": "ghost"}"#).is_err());
        assert!(SessionState::from_blob(b"not json").is_err());
    }

    #[test]
    fn memory_limits() {
        let mut s = SessionState::default();
        assert!(s
            .set_memory("", "v".into(), serde_json::Value::Null, 0)
            .is_err());
        let big = "x".repeat(MAX_MEMORY_VALUE_BYTES + 1);
        assert!(s.set_memory("k", big, serde_json::Value::Null, 0).is_err());
        for i in 0..MAX_MEMORY_ENTRIES {
            s.set_memory(&format!("k{i}"), "v".into(), serde_json::Value::Null, 0)
                .unwrap();
        }
        assert!(s
            .set_memory("one-more", "v".into(), serde_json::Value::Null, 0)
            .is_err());
        s.set_memory("k0", "overwrite ok".into(), serde_json::Value::Null, 0)
            .unwrap();
    }
}

/// Slots against a model: random sequences of slot operations and appended
/// messages, checked after every step against a map in which each slot
/// simply owns a copy of the messages it replays (and of its own messages,
/// which an `Append` merge copies). The state shares history between slots
/// through segments instead; every replay must be the same.
#[cfg(test)]
mod model_tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::*;

    const NAMES: [&str; 4] = [DEFAULT_SLOT, "a", "b", "c"];

    #[derive(Debug, Clone)]
    enum Op {
        /// A message written to the slot (as a committed turn would).
        Append(usize),
        Create(usize),
        Derive {
            from: usize,
            name: usize,
        },
        Merge {
            source: usize,
            target: usize,
            replace: bool,
        },
        Delete(usize),
        Switch(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let name = 0..NAMES.len();
        prop_oneof![
            3 => name.clone().prop_map(Op::Append),
            1 => name.clone().prop_map(Op::Create),
            2 => (name.clone(), name.clone()).prop_map(|(from, name)| Op::Derive { from, name }),
            2 => (name.clone(), name.clone(), any::<bool>()).prop_map(|(source, target, replace)| {
                Op::Merge { source, target, replace }
            }),
            1 => name.clone().prop_map(Op::Delete),
            1 => name.prop_map(Op::Switch),
        ]
    }

    /// What each slot replays, and which of those messages are its own.
    #[derive(Debug, Default)]
    struct Model {
        current: String,
        view: BTreeMap<String, Vec<String>>,
        own: BTreeMap<String, Vec<String>>,
    }

    impl Model {
        fn new() -> Self {
            let mut m = Model {
                current: DEFAULT_SLOT.to_owned(),
                ..Model::default()
            };
            m.view.insert(DEFAULT_SLOT.to_owned(), Vec::new());
            m.own.insert(DEFAULT_SLOT.to_owned(), Vec::new());
            m
        }

        fn has(&self, name: &str) -> bool {
            self.view.contains_key(name)
        }
    }

    struct Session {
        state: SessionState,
        history: Vec<HistoryMessage>,
        next_text: usize,
    }

    impl Session {
        fn last_seq(&self) -> i64 {
            self.history.last().map_or(0, |m| m.seq)
        }

        fn append(&mut self, slot: &str, text: String) {
            let seq = self.last_seq() + 1;
            self.history.push(HistoryMessage {
                seq,
                slot: slot.to_owned(),
                message: Arc::new(Message::user(text)),
                created_at_ms: seq,
                input_state: None,
            });
        }

        fn fresh_text(&mut self) -> String {
            self.next_text += 1;
            format!("m{}", self.next_text)
        }
    }

    /// Applies `op` to the session and the model; an operation the model
    /// says is invalid must fail and leave the state as it was.
    fn step(s: &mut Session, m: &mut Model, op: &Op) -> Result<(), TestCaseError> {
        let before = s.state.clone();
        let valid = match *op {
            Op::Append(x) => {
                let x = NAMES[x];
                if m.has(x) {
                    let text = s.fresh_text();
                    s.append(x, text.clone());
                    m.view.entry(x.to_owned()).or_default().push(text.clone());
                    m.own.entry(x.to_owned()).or_default().push(text);
                }
                return Ok(());
            }
            Op::Create(x) => {
                let x = NAMES[x];
                let valid = !m.has(x);
                let r = s.state.create_slot(x, SlotMode::Full, s.last_seq() + 1);
                if valid && r.is_ok() {
                    m.view.insert(x.to_owned(), Vec::new());
                    m.own.insert(x.to_owned(), Vec::new());
                }
                (valid, r.is_ok())
            }
            Op::Derive { from, name } => {
                let (from, name) = (NAMES[from], NAMES[name]);
                let valid = m.has(from) && !m.has(name);
                let r = s
                    .state
                    .derive_slot(from, name, SlotMode::Full, s.last_seq());
                if valid && r.is_ok() {
                    let copy = m.view[from].clone();
                    m.view.insert(name.to_owned(), copy);
                    m.own.insert(name.to_owned(), Vec::new());
                }
                (valid, r.is_ok())
            }
            Op::Merge {
                source,
                target,
                replace,
            } => {
                let (source, target) = (NAMES[source], NAMES[target]);
                let valid = m.has(source) && m.has(target) && source != target;
                let strategy = if replace {
                    MergeStrategy::Replace
                } else {
                    MergeStrategy::Append
                };
                let last_seq = s.last_seq();
                let r = s
                    .state
                    .merge_slot(source, target, strategy, &s.history, last_seq);
                let ok = r.is_ok();
                if let (true, Ok(appended)) = (valid, r) {
                    if replace {
                        let copy = m.view[source].clone();
                        m.view.insert(target.to_owned(), copy);
                        m.own.insert(target.to_owned(), Vec::new());
                    } else {
                        let texts: Vec<String> = appended.iter().map(Message::text).collect();
                        prop_assert_eq!(&texts, &m.own[source], "appended messages");
                        for text in texts {
                            s.append(target, text.clone());
                            m.view
                                .entry(target.to_owned())
                                .or_default()
                                .push(text.clone());
                            m.own.entry(target.to_owned()).or_default().push(text);
                        }
                    }
                }
                (valid, ok)
            }
            Op::Delete(x) => {
                let x = NAMES[x];
                let valid = m.has(x) && x != DEFAULT_SLOT && x != m.current;
                let r = s.state.delete_slot(x);
                if valid && r.is_ok() {
                    m.view.remove(x);
                    m.own.remove(x);
                }
                (valid, r.is_ok())
            }
            Op::Switch(x) => {
                let x = NAMES[x];
                let valid = m.has(x);
                let r = s.state.switch_slot(x);
                if valid && r.is_ok() {
                    m.current = x.to_owned();
                }
                (valid, r.is_ok())
            }
        };
        let (valid, ok) = valid;
        prop_assert_eq!(
            ok,
            valid,
            "{:?} succeeded when the model says valid={}",
            op,
            valid
        );
        if !valid {
            prop_assert_eq!(&s.state, &before, "a refused {:?} changed the state", op);
        }
        Ok(())
    }

    fn check(s: &Session, m: &Model) -> Result<(), TestCaseError> {
        let names: Vec<&String> = s.state.slots.keys().collect();
        let expected: Vec<&String> = m.view.keys().collect();
        prop_assert_eq!(names, expected);
        prop_assert_eq!(&s.state.current_slot, &m.current);
        for (name, want) in &m.view {
            let got: Vec<String> = s
                .state
                .replay(name, &s.history)
                .map_err(|e| TestCaseError::fail(e.to_string()))?
                .iter()
                .map(|msg| msg.text())
                .collect();
            prop_assert_eq!(&got, want, "replay of slot {}", name);
        }
        let blob = s
            .state
            .to_blob()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let back =
            SessionState::from_blob(&blob).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&back, &s.state, "the blob round trip");
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn every_slot_replays_what_the_model_says(ops in prop::collection::vec(op(), 1..40)) {
            let mut s = Session {
                state: SessionState::default(),
                history: Vec::new(),
                next_text: 0,
            };
            let mut m = Model::new();
            for op in &ops {
                step(&mut s, &mut m, op)?;
                check(&s, &m)?;
            }
        }
    }
}
