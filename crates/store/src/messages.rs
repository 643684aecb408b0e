//! Messages: append-only rows keyed by (timeline, seq), loads that walk a
//! timeline's ancestors, durable turn inputs, and the one-transaction turn
//! commit.
//!
//! A user turn commits its input first ([`Backend::open_turn`](crate::Backend::open_turn): the rows are
//! `open`; a message acknowledged while another turn ran leaves the store's
//! queue in the same transaction, see `queued.rs`), then its outputs with state and checkpoint ([`Backend::commit_turn`](crate::Backend::commit_turn),
//! which marks the input `answered`). A failed turn marks it `unanswered`
//! ([`Backend::mark_unanswered`](crate::Backend::mark_unanswered)); inputs an older process left open are marked
//! so when a new runtime activates ([`Backend::activate_runtime`](crate::Backend::activate_runtime)). `input_state` is the only
//! column of a message row that ever changes, and only once.

use std::collections::HashMap;

use keel_core::{text_enum, CheckpointId, Message, SessionId};
use rusqlite::{params, Connection};

use crate::checkpoints::{insert_checkpoint_tx, put_state_tx, CheckpointRecord, NewCheckpoint};
use crate::db::{HeadState, WriteCache};
use crate::error::{Result, StoreError};
use crate::sessions::{
    bump_activity, check_limit, list_dialogs_tx, require_session, DialogQuery, SessionRecord,
    TimelineId,
};
use crate::SqliteStore;

/// The slot name of the default context slot.
pub const DEFAULT_SLOT: &str = "default";

text_enum!(
    /// Where a durably committed turn input stands.
    InputState, "input state" {
        /// Its turn is running (or its process died; recovery closes it).
        Open = "open",
        /// Its turn committed an answer.
        Answered = "answered",
        /// Its turn failed, was cancelled or crashed: nothing answered it.
        Unanswered = "unanswered",
    }
);

/// A message to append to a slot of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct NewMessage {
    /// The context slot (`"default"` for the default slot).
    pub slot: String,
    /// The message; its visibility and origin are stored as columns too.
    pub message: Message,
    /// Set for a turn input committed before its answer (`None` otherwise).
    pub input_state: Option<InputState>,
}

impl NewMessage {
    /// A message for the default slot.
    pub fn new(message: Message) -> Self {
        Self::in_slot(DEFAULT_SLOT, message)
    }

    /// A message for `slot`.
    pub fn in_slot(slot: &str, message: Message) -> Self {
        Self {
            slot: slot.to_owned(),
            message,
            input_state: None,
        }
    }
}

/// A message as loaded back.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredMessage {
    /// Position in the session's history (increasing across slots).
    pub seq: i64,
    /// The slot it belongs to.
    pub slot: String,
    /// The message.
    pub message: Message,
    /// When it was appended (ms).
    pub created_at_ms: i64,
    /// For a turn input committed before its answer: whether it was answered.
    pub input_state: Option<InputState>,
}

/// Which messages a load returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessageFilter {
    /// Only messages clients see (hidden continuation triggers are skipped).
    pub visible_only: bool,
    /// Only messages with `seq >= from_seq`.
    pub from_seq: Option<i64>,
    /// Only messages of this slot.
    pub slot: Option<String>,
}

/// One page of a session's current history (see [`Backend::load_message_page`](crate::Backend::load_message_page)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagePage {
    /// Only messages clients see.
    pub visible_only: bool,
    /// Newest first (continue below `cursor`) instead of oldest first (above it).
    pub newest_first: bool,
    /// The seq of the last message of the previous page.
    pub cursor: Option<i64>,
    /// Page size (1..=1000).
    pub limit: usize,
}

/// Everything one committed turn writes, in one transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnCommit {
    /// The session.
    pub session_id: SessionId,
    /// Messages of the turn, appended to the head timeline in order.
    pub messages: Vec<NewMessage>,
    /// The session's mutable state after the turn (opaque bytes, content-addressed).
    pub state: Vec<u8>,
    /// The checkpoint to record at the end of the turn, if any.
    pub checkpoint: Option<NewCheckpoint>,
    /// Visible user inputs in this turn (added to `message_count`).
    pub visible_user_inputs: u32,
    /// Seqs (on the head timeline) of the open inputs this turn answers.
    pub answers: Vec<i64>,
    /// Where the history ended when the turn started; if it has moved since
    /// (another writer appended or moved the head), nothing is committed.
    pub expected_head: Option<SessionHead>,
    /// Commit time (ms).
    pub now_ms: i64,
    /// The model and tool calls of the root turn this commit ends, stored
    /// with it (at most [`crate::MAX_CALL_SPANS`]).
    pub calls: Option<crate::TurnCalls>,
}

/// A turn's input, committed before the model is called.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenTurn {
    /// The session.
    pub session_id: SessionId,
    /// The input messages; they are stored `open`.
    pub messages: Vec<NewMessage>,
    /// Where the history ended when the turn started (see [`TurnCommit::expected_head`]).
    pub expected_head: Option<SessionHead>,
    /// The turn whose queued input these messages are ([`Backend::queue_input`](crate::Backend::queue_input)):
    /// taken off the queue in the same transaction (refused if it is not queued).
    pub queued: Option<keel_core::TurnId>,
    /// Commit time (ms).
    pub now_ms: i64,
}

/// The end of a session's history: its head timeline and the last seq on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionHead {
    /// The head timeline.
    pub timeline: TimelineId,
    /// The last seq visible from it (0 for an empty history).
    pub last_seq: i64,
}

/// What [`Backend::history_after`](crate::Backend::history_after) read.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryDelta {
    /// Where the session's history ends now.
    pub head: SessionHead,
    /// Whether `messages` is the whole history rather than what follows
    /// the head the caller knew.
    pub whole: bool,
    /// The messages, filtered, in seq order.
    pub messages: Vec<StoredMessage>,
}

/// What a turn commit assigned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnCommitted {
    /// The seq of each message, in order.
    pub seqs: Vec<i64>,
    /// Hash of the state blob now live.
    pub state_hash: String,
    /// The checkpoint recorded, if one was asked for.
    pub checkpoint: Option<CheckpointRecord>,
}

/// Last seq visible from `timeline` (its own, or the fork point when it has none).
pub(crate) fn last_seq(conn: &Connection, timeline: &str) -> Result<i64> {
    let mut stmt = conn.prepare_cached(
        "SELECT coalesce((SELECT max(seq) FROM messages WHERE timeline_id = ?1), \
                (SELECT coalesce(fork_seq, 0) FROM timelines WHERE id = ?1))",
    )?;
    Ok(stmt.query_row([timeline], |r| r.get(0))?)
}

/// The head timeline of a session (a light lookup for the append path).
pub(crate) fn head_timeline(conn: &Connection, session: &SessionId) -> Result<String> {
    let mut stmt = conn.prepare_cached("SELECT head_timeline_id FROM sessions WHERE id = ?1")?;
    let mut rows = stmt.query([session.to_string()])?;
    match rows.next()? {
        Some(r) => r
            .get::<_, Option<String>>(0)?
            .ok_or_else(|| StoreError::corrupt("sessions.head_timeline_id", "NULL")),
        None => Err(StoreError::NotFound(format!("session {session}"))),
    }
}

/// A message serialized by the caller's task, so the writer thread only runs SQL.
pub(crate) struct EncodedMessage {
    slot: String,
    role: &'static str,
    /// The message's JSON, packed ([`crate::compress::pack`]).
    content: rusqlite::types::Value,
    tool_call_id: Option<String>,
    tool_name: Option<String>,
    visibility: &'static str,
    origin: &'static str,
    input_state: Option<&'static str>,
}

/// Validates and serializes messages before they reach the writer.
pub(crate) fn encode(db: &std::path::Path, messages: &[NewMessage]) -> Result<Vec<EncodedMessage>> {
    messages
        .iter()
        .map(|m| {
            if m.slot.is_empty() {
                return Err(StoreError::InvalidInput("message slot is empty".into()));
            }
            Ok(EncodedMessage {
                slot: m.slot.clone(),
                role: m.message.role.as_str(),
                content: crate::compress::pack(
                    serde_json::to_string(&m.message).map_err(|e| {
                        StoreError::InvalidInput(format!("message does not serialize: {e}"))
                    })?,
                    Some(db),
                ),
                tool_call_id: m.message.tool_call_id.clone(),
                tool_name: m.message.tool_name.clone(),
                visibility: m.message.visibility.as_str(),
                origin: m.message.origin.as_str(),
                input_state: m.input_state.map(InputState::as_str),
            })
        })
        .collect()
}

/// Where the next append to `session` goes: the writer's cached head state,
/// or looked up (head timeline, last seq) when the cache does not know it.
fn head_state(conn: &Connection, cache: &WriteCache, session: &SessionId) -> Result<HeadState> {
    if let Some(state) = cache.get(session) {
        return Ok(state.clone());
    }
    let timeline = head_timeline(conn, session)?;
    let last_seq = last_seq(conn, &timeline)?;
    Ok(HeadState { timeline, last_seq })
}

/// Appends `messages` to `timeline` of `session` after seq `last`; returns their seqs.
pub(crate) fn append_tx(
    conn: &Connection,
    session: &SessionId,
    timeline: &str,
    last: i64,
    messages: &[EncodedMessage],
    now_ms: i64,
) -> Result<Vec<i64>> {
    let mut seq = last;
    let mut stmt = conn.prepare_cached(
        "INSERT INTO messages (timeline_id, seq, session_id, slot, role, content, tool_call_id, \
         tool_name, created_at, client_visibility, turn_origin, input_state) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
    )?;
    let session_id = session.to_string();
    let mut seqs = Vec::with_capacity(messages.len());
    for m in messages {
        seq += 1;
        stmt.execute(params![
            timeline,
            seq,
            session_id,
            m.slot,
            m.role,
            m.content,
            m.tool_call_id,
            m.tool_name,
            now_ms,
            m.visibility,
            m.origin,
            m.input_state,
        ])?;
        seqs.push(seq);
    }
    Ok(seqs)
}

/// The ancestor chain of `timeline` as (timeline, last visible seq), root first.
fn chain(conn: &Connection, timeline: &str, upto: i64) -> Result<Vec<(String, i64)>> {
    let mut stmt = conn.prepare_cached(
        "WITH RECURSIVE chain(depth, tid, upto, parent, fseq) AS ( \
           SELECT 0, id, ?2, parent_timeline_id, fork_seq FROM timelines WHERE id = ?1 \
           UNION ALL \
           SELECT c.depth + 1, t.id, min(c.upto, c.fseq), t.parent_timeline_id, t.fork_seq \
           FROM timelines t JOIN chain c ON t.id = c.parent \
         ) SELECT tid, upto FROM chain ORDER BY depth DESC",
    )?;
    let rows = stmt.query_map(params![timeline, upto], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}

/// Visible user inputs in the history visible from `timeline` up to
/// `upto`: what `sessions.message_count` holds for a session whose history
/// that is (every commit adds its turn's visible user inputs).
pub(crate) fn visible_inputs(conn: &Connection, timeline: &str, upto: i64) -> Result<i64> {
    let mut stmt = conn.prepare_cached(
        "SELECT count(*) FROM messages WHERE timeline_id = ?1 AND seq <= ?2 \
           AND role = 'user' AND client_visibility = 'visible'",
    )?;
    let mut total = 0;
    for (tid, cut) in chain(conn, timeline, upto)? {
        total += stmt.query_row(params![tid, cut], |r| r.get::<_, i64>(0))?;
    }
    Ok(total)
}

/// The history visible from `timeline` after `known` (see [`Backend::history_after`](crate::Backend::history_after)).
fn history_after_tx(
    c: &Connection,
    timeline: TimelineId,
    known: Option<&SessionHead>,
    filter: &MessageFilter,
) -> Result<HistoryDelta> {
    let last = last_seq(c, timeline.as_str())?;
    let after = known.filter(|k| k.timeline == timeline && k.last_seq <= last);
    let filter = MessageFilter {
        from_seq: after.map(|k| k.last_seq + 1).max(filter.from_seq),
        ..filter.clone()
    };
    Ok(HistoryDelta {
        messages: load_chain(c, timeline.as_str(), last, &filter)?,
        whole: after.is_none(),
        head: SessionHead {
            timeline,
            last_seq: last,
        },
    })
}

/// Messages visible from `timeline` up to `upto`: one indexed range scan per
/// ancestor, root first. The ranges are disjoint and increasing (a child's
/// seqs start after its fork point), so the concatenation is in seq order.
/// One timeline's messages in a seq range, optionally visible-only or one slot.
const LOAD_RANGE_SQL: &str = "SELECT seq, slot, content, created_at, input_state FROM messages \
     WHERE timeline_id = ?1 AND seq >= ?2 AND seq <= ?3 \
       AND (NOT ?4 OR client_visibility = 'visible') AND (?5 IS NULL OR slot = ?5) \
     ORDER BY seq";

pub(crate) fn load_chain(
    conn: &Connection,
    timeline: &str,
    upto: i64,
    filter: &MessageFilter,
) -> Result<Vec<StoredMessage>> {
    let mut stmt = conn.prepare_cached(LOAD_RANGE_SQL)?;
    let mut out = Vec::new();
    for (tid, cut) in chain(conn, timeline, upto)? {
        let mut rows = stmt.query(params![
            tid,
            filter.from_seq.unwrap_or(i64::MIN),
            cut,
            filter.visible_only,
            filter.slot
        ])?;
        while let Some(r) = rows.next()? {
            out.push(stored_from_row(r)?);
        }
    }
    Ok(out)
}

/// One timeline's messages in a seq range, newest first (for pages read backwards).
const LOAD_RANGE_DESC_SQL: &str =
    "SELECT seq, slot, content, created_at, input_state FROM messages \
     WHERE timeline_id = ?1 AND seq >= ?2 AND seq <= ?3 \
       AND (NOT ?4 OR client_visibility = 'visible') \
     ORDER BY seq DESC LIMIT ?5";

/// One timeline's messages in a seq range, oldest first, at most `?5`.
const LOAD_RANGE_ASC_SQL: &str =
    "SELECT seq, slot, content, created_at, input_state FROM messages \
     WHERE timeline_id = ?1 AND seq >= ?2 AND seq <= ?3 \
       AND (NOT ?4 OR client_visibility = 'visible') \
     ORDER BY seq LIMIT ?5";

fn stored_from_row(r: &rusqlite::Row<'_>) -> Result<StoredMessage> {
    let seq: i64 = r.get(0)?;
    let what = || format!("messages.content (seq {seq})");
    // Parsed straight from the row's bytes (a frame is decompressed into a
    // reused buffer): no copy into a String; serde_json validates UTF-8.
    let message: Message = crate::compress::with_text(&what(), r.get_ref(2)?, |bytes| {
        serde_json::from_slice(bytes).map_err(|e| StoreError::corrupt(&what(), e))
    })?;
    Ok(StoredMessage {
        seq,
        slot: r.get(1)?,
        message,
        created_at_ms: r.get(3)?,
        input_state: crate::util::parse_opt("messages.input_state", r.get(4)?)?,
    })
}

/// A page of the history visible from `timeline`: the ancestor chain is
/// walked forwards or backwards, each timeline one bounded range scan.
fn load_page(conn: &Connection, timeline: &str, page: &MessagePage) -> Result<Vec<StoredMessage>> {
    let mut ranges = chain(conn, timeline, i64::MAX)?;
    let (sql, low, high) = if page.newest_first {
        ranges.reverse();
        (
            LOAD_RANGE_DESC_SQL,
            i64::MIN,
            page.cursor.map_or(i64::MAX, |c| c - 1),
        )
    } else {
        (
            LOAD_RANGE_ASC_SQL,
            page.cursor.map_or(i64::MIN, |c| c + 1),
            i64::MAX,
        )
    };
    let mut stmt = conn.prepare_cached(sql)?;
    let mut out = Vec::new();
    for (tid, cut) in ranges {
        let left = page.limit.saturating_sub(out.len());
        if left == 0 {
            break;
        }
        let left = i64::try_from(left).unwrap_or(i64::MAX);
        let mut rows = stmt.query(params![tid, low, cut.min(high), page.visible_only, left])?;
        while let Some(r) = rows.next()? {
            out.push(stored_from_row(r)?);
        }
    }
    Ok(out)
}

/// Refuses a write when the session's history no longer ends where the
/// writer last saw it (another writer appended or moved the head).
fn check_head(session: &SessionId, expected: &SessionHead, head: &str, last: i64) -> Result<()> {
    if expected.timeline.as_str() == head && expected.last_seq == last {
        return Ok(());
    }
    Err(StoreError::Conflict(format!(
        "session {session} changed since the turn started (its history ended at seq {} and now \
         ends at seq {last}{}); the turn was not saved",
        expected.last_seq,
        if expected.timeline.as_str() == head {
            ""
        } else {
            " on another branch"
        }
    )))
}

/// The whole turn commit: messages, state, checkpoint, counters, and the
/// webhook deliveries of the inputs it answers (and to `webhook_urls`). With the
/// writer's `cache`, the last seq comes from it when it knows the session's
/// head, and the new head state is staged in it.
pub(crate) fn commit_turn_tx(
    conn: &Connection,
    turn: &TurnCommit,
    messages: &[EncodedMessage],
    cache: Option<&mut WriteCache>,
    webhook_urls: &[String],
) -> Result<TurnCommitted> {
    let session = require_session(conn, &turn.session_id)?;
    let head = session.head_timeline_id.as_str();
    let cached = cache
        .as_deref()
        .and_then(|c| c.get(&session.id))
        .filter(|s| s.timeline == head)
        .map(|s| s.last_seq);
    let last = match cached {
        Some(seq) => seq,
        None => last_seq(conn, head)?,
    };
    if let Some(expected) = &turn.expected_head {
        check_head(&session.id, expected, head, last)?;
    }
    let seqs = append_tx(conn, &session.id, head, last, messages, turn.now_ms)?;
    let last = seqs.last().copied().unwrap_or(last);
    answer_inputs_tx(conn, head, &turn.answers)?;
    if !turn.answers.is_empty() {
        crate::webhooks::deliveries_tx(
            conn,
            &crate::webhooks::CommittedTurn {
                status: "committed",
                session: &session.id,
                timeline: head,
                answers: &turn.answers,
                turn_id: turn.calls.as_ref().map(|calls| calls.turn_id),
                messages: &turn.messages,
                last_seq: seqs.last().copied(),
                now_ms: turn.now_ms,
            },
            webhook_urls,
        )?;
    }
    if let Some(calls) = &turn.calls {
        crate::calls::insert_calls_tx(
            conn,
            &session.id,
            crate::calls::CallOwner::Turn(calls.turn_id),
            &calls.spans,
        )?;
    }
    let state_hash = put_state_tx(conn, &session, &turn.state)?;
    let checkpoint = match &turn.checkpoint {
        Some(cp) => {
            let seq = last;
            Some(insert_checkpoint_tx(
                conn,
                &session.id,
                &session.head_timeline_id,
                seq,
                None,
                cp,
                &state_hash,
                turn.now_ms,
            )?)
        }
        None => None,
    };
    bump_activity(conn, &session.id, turn.now_ms, turn.visible_user_inputs)?;
    if let Some(cache) = cache {
        cache.stage(
            session.id,
            HeadState {
                timeline: head.to_owned(),
                last_seq: last,
            },
        );
    }
    Ok(TurnCommitted {
        seqs,
        state_hash,
        checkpoint,
    })
}

/// Marks the inputs `seqs` of `timeline` answered. Each must be open: an
/// input already declared unanswered is never answered after the fact.
fn answer_inputs_tx(conn: &Connection, timeline: &str, seqs: &[i64]) -> Result<()> {
    let mut stmt = conn.prepare_cached(
        "UPDATE messages SET input_state = 'answered' \
         WHERE timeline_id = ?1 AND seq = ?2 AND input_state = 'open'",
    )?;
    for seq in seqs {
        if stmt.execute(params![timeline, seq])? != 1 {
            return Err(StoreError::Stale(format!(
                "the turn input at seq {seq} is not open any more"
            )));
        }
    }
    Ok(())
}

/// Marks every input of `session` still open unanswered; returns how many.
fn close_open_inputs_tx(conn: &Connection, session: &SessionId) -> Result<usize> {
    Ok(conn
        .prepare_cached(
            "UPDATE messages SET input_state = 'unanswered' \
             WHERE session_id = ?1 AND input_state = 'open'",
        )?
        .execute([session.to_string()])?)
}

/// Marks every open input of every session unanswered (no turn runs yet).
pub(crate) const CLOSE_INTERRUPTED_SQL: &str =
    "UPDATE messages INDEXED BY idx_messages_open_inputs \
     SET input_state = 'unanswered' WHERE input_state = 'open' AND session_id >= '' \
     RETURNING session_id, timeline_id, seq";

fn open_turn_tx(
    conn: &Connection,
    cache: &mut WriteCache,
    turn: &OpenTurn,
    messages: &[EncodedMessage],
    visible_user_inputs: u32,
) -> Result<Vec<i64>> {
    let session = &turn.session_id;
    let head = head_state(conn, cache, session)?;
    if let Some(expected) = &turn.expected_head {
        check_head(session, expected, &head.timeline, head.last_seq)?;
    }
    if let Some(turn) = &turn.queued {
        crate::queued::take_queued_tx(conn, turn)?;
    }
    // Inputs a dropped or crashed turn left open were never answered.
    close_open_inputs_tx(conn, session)?;
    let seqs = append_tx(
        conn,
        session,
        &head.timeline,
        head.last_seq,
        messages,
        turn.now_ms,
    )?;
    if let Some(queued) = &turn.queued {
        // The subscription follows the turn's user message (the input it answers).
        let input = turn
            .messages
            .iter()
            .position(|m| m.message.role == keel_core::Role::User)
            .and_then(|i| seqs.get(i));
        if let Some(seq) = input {
            crate::webhooks::bind_tx(conn, queued, &head.timeline, *seq)?;
        }
    }
    bump_activity(conn, session, turn.now_ms, visible_user_inputs)?;
    let last_seq = seqs.last().copied().unwrap_or(head.last_seq);
    cache.stage(
        *session,
        HeadState {
            timeline: head.timeline,
            last_seq,
        },
    );
    Ok(seqs)
}

impl SqliteStore {
    pub(crate) async fn open_turn(&self, turn: OpenTurn) -> Result<Vec<i64>> {
        let mut messages = turn.messages.clone();
        for m in &mut messages {
            m.input_state = Some(InputState::Open);
        }
        let encoded = encode(self.path(), &messages)?;
        let visible = messages
            .iter()
            .filter(|m| m.message.is_visible_user_input())
            .count();
        let visible = u32::try_from(visible).unwrap_or(u32::MAX);
        let seqs = self
            .db
            .write_cached(move |c, cache| {
                let seqs = open_turn_tx(c, cache, &turn, &encoded, visible)?;
                failpoint!("store::open_turn::before_commit");
                Ok(seqs)
            })
            .await?;
        failpoint!("store::open_turn::after_commit");
        Ok(seqs)
    }

    pub(crate) async fn mark_unanswered(
        &self,
        session_id: SessionId,
        seqs: Vec<i64>,
    ) -> Result<usize> {
        let urls = self.webhook_urls();
        let (changed, deliveries) = self
            .db
            .write(move |c| {
                let timeline = head_timeline(c, &session_id)?;
                let mut stmt = c.prepare_cached(
                    "UPDATE messages SET input_state = 'unanswered' \
                     WHERE timeline_id = ?1 AND seq = ?2 AND input_state = 'open'",
                )?;
                let (mut changed, mut deliveries) = (0, 0);
                for seq in &seqs {
                    if stmt.execute(params![timeline, seq])? == 1 {
                        changed += 1;
                        deliveries += crate::webhooks::unanswered_deliveries_tx(
                            c,
                            &session_id,
                            &timeline,
                            *seq,
                            keel_core::time::now_ms(),
                            &urls,
                        )?;
                    }
                }
                Ok((changed, deliveries))
            })
            .await?;
        if deliveries > 0 {
            self.wake_webhooks();
        }
        Ok(changed)
    }

    pub(crate) async fn append_message(
        &self,
        session_id: SessionId,
        message: NewMessage,
        now_ms: i64,
    ) -> Result<i64> {
        let seqs = self
            .append_messages(session_id, vec![message], now_ms)
            .await?;
        seqs.first()
            .copied()
            .ok_or_else(|| StoreError::Sqlite("append returned no seq".into()))
    }

    pub(crate) async fn append_messages(
        &self,
        session_id: SessionId,
        messages: Vec<NewMessage>,
        now_ms: i64,
    ) -> Result<Vec<i64>> {
        let encoded = encode(self.path(), &messages)?;
        self.db
            .write_cached(move |c, cache| {
                let head = head_state(c, cache, &session_id)?;
                let seqs = append_tx(
                    c,
                    &session_id,
                    &head.timeline,
                    head.last_seq,
                    &encoded,
                    now_ms,
                )?;
                let last_seq = seqs.last().copied().unwrap_or(head.last_seq);
                cache.stage(
                    session_id,
                    HeadState {
                        timeline: head.timeline,
                        last_seq,
                    },
                );
                Ok(seqs)
            })
            .await
    }

    pub(crate) async fn commit_turn(&self, turn: TurnCommit) -> Result<TurnCommitted> {
        let encoded = encode(self.path(), &turn.messages)?;
        let global = self.webhook_urls();
        let answers = !turn.answers.is_empty();
        let committed = self
            .db
            .write_cached(move |c, cache| {
                let committed = commit_turn_tx(c, &turn, &encoded, Some(cache), &global)?;
                failpoint!("store::commit_turn::before_commit");
                Ok(committed)
            })
            .await?;
        failpoint!("store::commit_turn::after_commit");
        if answers {
            self.wake_webhooks();
        }
        Ok(committed)
    }

    pub(crate) async fn load_messages(
        &self,
        session_id: SessionId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        self.db
            .read(move |c| {
                let session = require_session(c, &session_id)?;
                load_chain(c, session.head_timeline_id.as_str(), i64::MAX, &filter)
            })
            .await
    }

    pub(crate) async fn load_message_page(
        &self,
        session_id: SessionId,
        page: MessagePage,
    ) -> Result<Vec<StoredMessage>> {
        if page.limit == 0 || page.limit > 1000 {
            return Err(StoreError::InvalidInput(format!(
                "limit {} is outside 1..=1000",
                page.limit
            )));
        }
        self.db
            .read(move |c| {
                let session = require_session(c, &session_id)?;
                load_page(c, session.head_timeline_id.as_str(), &page)
            })
            .await
    }

    pub(crate) async fn history_ranges(
        &self,
        session_id: SessionId,
    ) -> Result<Vec<(TimelineId, i64)>> {
        self.db
            .read(move |c| {
                let session = require_session(c, &session_id)?;
                Ok(chain(c, session.head_timeline_id.as_str(), i64::MAX)?
                    .into_iter()
                    .map(|(t, upto)| (TimelineId(t), upto))
                    .collect())
            })
            .await
    }

    pub(crate) async fn history_after(
        &self,
        session_id: SessionId,
        known: Option<SessionHead>,
        filter: MessageFilter,
    ) -> Result<HistoryDelta> {
        self.db
            .read(move |c| {
                let session = require_session(c, &session_id)?;
                history_after_tx(c, session.head_timeline_id, known.as_ref(), &filter)
            })
            .await
    }

    pub(crate) async fn dialogs_with_history_after(
        &self,
        query: DialogQuery,
        wanted: crate::DialogFilter,
        known: HashMap<SessionId, SessionHead>,
        filter: MessageFilter,
    ) -> Result<Vec<(SessionRecord, HistoryDelta)>> {
        check_limit(&query)?;
        self.db
            .read(move |c| {
                let mut out = Vec::new();
                for record in list_dialogs_tx(c, &query)?.items {
                    if !wanted(&record) {
                        continue;
                    }
                    let timeline = record.head_timeline_id.clone();
                    let delta = history_after_tx(c, timeline, known.get(&record.id), &filter)?;
                    out.push((record, delta));
                }
                Ok(out)
            })
            .await
    }

    pub(crate) async fn load_messages_at_checkpoint(
        &self,
        checkpoint_id: CheckpointId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        self.db
            .read(move |c| {
                let cp = crate::checkpoints::require_checkpoint(c, &checkpoint_id)?;
                load_chain(c, cp.timeline_id.as_str(), cp.seq, &filter)
            })
            .await
    }

    pub(crate) async fn last_seq(&self, session_id: SessionId) -> Result<i64> {
        self.db
            .read(move |c| {
                let session = require_session(c, &session_id)?;
                last_seq(c, session.head_timeline_id.as_str())
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every load, visible-only included, is a range search of the primary
    /// key. The only other index holds open turn inputs alone (a partial
    /// index), so appends of other messages never pay for it.
    #[test]
    fn loads_search_the_primary_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conn =
            crate::db::open_writer(&dir.path().join("k.db"), &Default::default()).expect("open");
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {LOAD_RANGE_SQL}"))
            .expect("explain")
            .query_map(params!["t", 1, 10, true, Option::<String>::None], |r| {
                r.get::<_, String>(3)
            })
            .expect("plan")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        assert_eq!(
            plan,
            ["SEARCH messages USING INDEX sqlite_autoindex_messages_1 (timeline_id=? AND seq>? AND seq<?)"]
        );
        let indexes: Vec<String> = conn
            .prepare(
                "SELECT coalesce(sql, name) FROM sqlite_master \
                 WHERE type = 'index' AND tbl_name = 'messages' ORDER BY name",
            )
            .expect("indexes")
            .query_map([], |r| r.get(0))
            .expect("rows")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        assert_eq!(
            indexes,
            [
                "CREATE INDEX idx_messages_open_inputs ON messages(session_id) WHERE input_state = 'open'",
                "sqlite_autoindex_messages_1",
            ]
        );
        // Recovery reads the open inputs through that index, not the table.
        let plan: String = conn
            .query_row(
                &format!("EXPLAIN QUERY PLAN {CLOSE_INTERRUPTED_SQL}"),
                [],
                |r| r.get(3),
            )
            .expect("plan");
        assert!(plan.contains("idx_messages_open_inputs"), "{plan}");
    }
}
