//! Messages on PostgreSQL: append-only rows keyed by (timeline, seq), loads
//! that walk a timeline's ancestors, durable turn inputs, and the
//! one-transaction turn commit (keel-store's `messages.rs`, the same state
//! machine; content is plain TEXT, which TOAST compresses).

use std::collections::HashMap;
use std::sync::Arc;

use keel_core::{CheckpointId, Message, SessionId};
use keel_store::{
    DialogFilter, DialogQuery, HistoryDelta, InputState, MessageFilter, MessagePage, NewMessage,
    OpenTurn, Result, SessionHead, SessionRecord, StoreError, StoredMessage, TimelineId,
    TurnCommit, TurnCommitted,
};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::store::Tx;

use crate::checkpoints::checkpoint_record;
use crate::sessions::{check_limit, list_dialogs_tx, locked_session, require_session};
use crate::store::from_pg;
use crate::util::sha256_hex;
use crate::PgStore;

/// The ancestor chain of timeline `$1` as (depth, tid, upto): each
/// ancestor's last visible seq is the fork point of its child, the head's
/// is `$2`.
const CHAIN_CTE: &str = "WITH RECURSIVE chain(depth, tid, upto, parent, fseq) AS ( \
       SELECT 0, id, $2::bigint, parent_timeline_id, fork_seq FROM timelines WHERE id = $1 \
       UNION ALL \
       SELECT c.depth + 1, t.id, LEAST(c.upto, c.fseq), t.parent_timeline_id, t.fork_seq \
       FROM timelines t JOIN chain c ON t.id = c.parent \
     )";

/// The last seq visible from timeline `$1`.
const LAST_SEQ: &str = "SELECT coalesce((SELECT max(seq) FROM messages WHERE timeline_id = $1), \
     (SELECT coalesce(fork_seq, 0) FROM timelines WHERE id = $1))";

/// Last seq visible from `timeline` (its own, or the fork point when it has none).
pub(crate) async fn last_seq(tx: &Tx<'_>, timeline: &str) -> Result<i64> {
    let row = tx
        .query_one(LAST_SEQ, &[&timeline])
        .await
        .map_err(from_pg)?;
    last_seq_from(&row, timeline)
}

fn last_seq_from(row: &Row, timeline: &str) -> Result<i64> {
    row.get::<_, Option<i64>>(0)
        .ok_or_else(|| StoreError::corrupt("timelines.id", format!("no timeline {timeline}")))
}

/// Locks session `$1` (as `lock_session` does) and this process's
/// registration (generation `$2`, as `check_fence` does), and reads where
/// the session's history ends. Answers the session's columns, whether the
/// fence holds, and the last seq on its head timeline. That read shares
/// the statement's snapshot, taken before the lock: were the lock waited
/// for, a writer that held it may have appended since. A turn's writes
/// then collide with those rows (their seqs are taken), which
/// [`under_head`] reports as the conflict it is; without an expected head
/// the last seq is read again after the lock.
const LOCK_HEAD: &str = concat!(
    "WITH ",
    fence_cte!("$2"),
    " SELECT ",
    session_columns!(),
    ", ",
    fence_holds!("$2"),
    ", coalesce((SELECT max(seq) FROM messages WHERE timeline_id = s.head_timeline_id), \
       (SELECT coalesce(fork_seq, 0) FROM timelines WHERE id = s.head_timeline_id)) \
     FROM sessions s WHERE s.id = $1 FOR NO KEY UPDATE OF s"
);

/// Locks `session` and this process's registration (generation
/// `generation`) and reads where the session's history ends, in one
/// statement ([`LOCK_HEAD`]): the session, and the last seq on its head
/// timeline as of the statement's snapshot.
async fn lock_head(
    tx: &Tx<'_>,
    session: &SessionId,
    generation: i64,
) -> Result<(SessionRecord, i64)> {
    let row = tx
        .query_opt(LOCK_HEAD, &[&session.to_string(), &generation])
        .await
        .map_err(from_pg)?;
    let fenced = row.as_ref().is_some_and(|r| !r.get::<_, bool>(14));
    let last = row.as_ref().and_then(|r| r.get::<_, Option<i64>>(15));
    let record = locked_session(row, session)?;
    if fenced {
        return Err(StoreError::TakenOver {
            generation: crate::util::non_negative("generation", generation)?,
        });
    }
    let last = last.ok_or_else(|| {
        StoreError::corrupt(
            "timelines.id",
            format!("no timeline {}", record.head_timeline_id),
        )
    })?;
    Ok((record, last))
}

/// Runs a turn's writes (`writes`, given the head timeline and the last
/// seq on it) under its dialog's lock. With an expected head they are sent
/// with the lock, in the same round trip, written against that head: they
/// count only when the lock's answer shows the head is as expected (else
/// the transaction is rolled back, whatever they did); without one they
/// follow the lock's answer.
async fn under_head<'a, T, F, Fut>(
    tx: &'a Tx<'a>,
    session: &'a SessionId,
    generation: i64,
    expected: Option<&'a SessionHead>,
    writes: F,
) -> Result<T>
where
    F: FnOnce(TimelineId, i64) -> Fut,
    Fut: std::future::Future<Output = Result<T>> + 'a,
{
    let Some(expected) = expected else {
        let (record, _) = lock_head(tx, session, generation).await?;
        let last = last_seq(tx, record.head_timeline_id.as_str()).await?;
        return writes(record.head_timeline_id, last).await;
    };
    let (head, written) = futures::join!(
        lock_head(tx, session, generation),
        writes(expected.timeline.clone(), expected.last_seq)
    );
    let (record, last) = head?;
    check_head(session, expected, record.head_timeline_id.as_str(), last)?;
    match written {
        // The seqs after the expected head are taken: a writer appended
        // there while this transaction waited for the lock.
        Err(StoreError::Constraint(message)) if message.contains(MESSAGES_KEY) => {
            Err(StoreError::Conflict(format!(
                "session {session} changed since the turn started (its history ended at seq {}); \
                 the turn was not saved",
                expected.last_seq
            )))
        }
        written => written,
    }
}

/// The primary key of `messages`, named in the error of an append whose
/// seqs are taken.
const MESSAGES_KEY: &str = "messages_pkey";

/// The head timeline of a session, its row locked as `lock_session` does
/// (a light lookup for the append path).
pub(crate) async fn head_timeline(tx: &Tx<'_>, session: &SessionId) -> Result<String> {
    let row = tx
        .query_opt(
            "SELECT head_timeline_id FROM sessions WHERE id = $1 FOR NO KEY UPDATE",
            &[&session.to_string()],
        )
        .await
        .map_err(from_pg)?;
    match row {
        Some(r) => r
            .get::<_, Option<String>>(0)
            .ok_or_else(|| StoreError::corrupt("sessions.head_timeline_id", "NULL")),
        None => Err(StoreError::NotFound(format!("session {session}"))),
    }
}

/// A message serialized before its transaction starts (a retried
/// transaction reuses it).
#[derive(Debug, Clone)]
pub(crate) struct EncodedMessage {
    slot: String,
    role: &'static str,
    /// The message's JSON.
    content: String,
    tool_call_id: Option<String>,
    tool_name: Option<String>,
    visibility: &'static str,
    origin: &'static str,
    input_state: Option<&'static str>,
}

/// Validates and serializes messages before their transaction.
pub(crate) fn encode(messages: &[NewMessage]) -> Result<Vec<EncodedMessage>> {
    messages
        .iter()
        .map(|m| {
            if m.slot.is_empty() {
                return Err(StoreError::InvalidInput("message slot is empty".into()));
            }
            Ok(EncodedMessage {
                slot: m.slot.clone(),
                role: m.message.role.as_str(),
                content: serde_json::to_string(&m.message).map_err(|e| {
                    StoreError::InvalidInput(format!("message does not serialize: {e}"))
                })?,
                tool_call_id: m.message.tool_call_id.clone(),
                tool_name: m.message.tool_name.clone(),
                visibility: m.message.visibility.as_str(),
                origin: m.message.origin.as_str(),
                input_state: m.input_state.map(InputState::as_str),
            })
        })
        .collect()
}

/// Where the next append to `session` goes: its head timeline and the last seq on it.
async fn head_state(tx: &Tx<'_>, session: &SessionId) -> Result<(String, i64)> {
    let timeline = head_timeline(tx, session).await?;
    let last = last_seq(tx, &timeline).await?;
    Ok((timeline, last))
}

/// Appends `messages` to `timeline` of `session` after seq `last`; returns
/// their seqs. One statement whatever the number of messages.
pub(crate) async fn append_tx(
    tx: &Tx<'_>,
    session: &SessionId,
    timeline: &str,
    last: i64,
    messages: &[EncodedMessage],
    now_ms: i64,
) -> Result<Vec<i64>> {
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    let columns = append_columns(messages);
    let session = session.to_string();
    tx.execute(
        APPEND,
        &append_params(&timeline, &last, &session, &now_ms, &columns),
    )
    .await
    .map_err(from_pg)?;
    Ok(new_seqs(last, messages.len()))
}

/// Appends messages: timeline `$1` after seq `$2`, session `$3`, at `$4`,
/// their columns in the arrays `$5`..`$12` ([`append_columns`]).
macro_rules! append_sql {
    () => {
        "INSERT INTO messages (timeline_id, seq, session_id, slot, role, content, \
         tool_call_id, tool_name, created_at, client_visibility, turn_origin, input_state) \
         SELECT $1, $2::bigint + m.n, $3, m.slot, m.role, m.content, m.tool_call_id, \
                m.tool_name, $4, m.visibility, m.origin, m.input_state \
         FROM unnest($5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[], \
                     $11::text[], $12::text[]) WITH ORDINALITY \
              AS m(slot, role, content, tool_call_id, tool_name, visibility, origin, \
                   input_state, n) \
         ORDER BY m.n"
    };
}
const APPEND: &str = append_sql!();

/// The columns of `messages`, one array each, as [`APPEND`] reads them.
fn append_columns(messages: &[EncodedMessage]) -> [Vec<Option<&str>>; 8] {
    let column = |f: fn(&EncodedMessage) -> Option<&str>| -> Vec<Option<&str>> {
        messages.iter().map(f).collect()
    };
    [
        column(|m| Some(m.slot.as_str())),
        column(|m| Some(m.role)),
        column(|m| Some(m.content.as_str())),
        column(|m| m.tool_call_id.as_deref()),
        column(|m| m.tool_name.as_deref()),
        column(|m| Some(m.visibility)),
        column(|m| Some(m.origin)),
        column(|m| m.input_state),
    ]
}

/// [`APPEND`]'s parameters `$1`..`$12`.
fn append_params<'a>(
    timeline: &'a (dyn ToSql + Sync),
    last: &'a (dyn ToSql + Sync),
    session: &'a (dyn ToSql + Sync),
    now_ms: &'a (dyn ToSql + Sync),
    columns: &'a [Vec<Option<&str>>; 8],
) -> Vec<&'a (dyn ToSql + Sync)> {
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![timeline, last, session, now_ms];
    params.extend(columns.iter().map(|c| c as &(dyn ToSql + Sync)));
    params
}

/// The seqs of `n` messages appended after seq `last`.
fn new_seqs(last: i64, n: usize) -> Vec<i64> {
    (1..).take(n).map(|i| last + i).collect()
}

/// The ancestor chain of `timeline` as (timeline, last visible seq), root first.
async fn chain(tx: &Tx<'_>, timeline: &str, upto: i64) -> Result<Vec<(String, i64)>> {
    let sql = format!("{CHAIN_CTE} SELECT tid, upto FROM chain ORDER BY depth DESC");
    Ok(tx
        .query(&sql, &[&timeline, &upto])
        .await
        .map_err(from_pg)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Visible user inputs in the history visible from `timeline` up to
/// `upto`: what `sessions.message_count` holds for a session whose history
/// that is (every commit adds its turn's visible user inputs).
pub(crate) async fn visible_inputs(tx: &Tx<'_>, timeline: &str, upto: i64) -> Result<i64> {
    let sql = format!(
        "{CHAIN_CTE} SELECT count(*) FROM chain c JOIN messages m \
           ON m.timeline_id = c.tid AND m.seq <= c.upto \
         WHERE m.role = 'user' AND m.client_visibility = 'visible'"
    );
    Ok(tx
        .query_one(&sql, &[&timeline, &upto])
        .await
        .map_err(from_pg)?
        .get(0))
}

/// The history visible from `timeline` after `known` (see `Backend::history_after`).
async fn history_after_tx(
    tx: &Tx<'_>,
    timeline: TimelineId,
    known: Option<&SessionHead>,
    filter: &MessageFilter,
) -> Result<HistoryDelta> {
    let last = last_seq(tx, timeline.as_str()).await?;
    let after = known.filter(|k| k.timeline == timeline && k.last_seq <= last);
    let filter = MessageFilter {
        from_seq: after.map(|k| k.last_seq + 1).max(filter.from_seq),
        ..filter.clone()
    };
    Ok(HistoryDelta {
        messages: load_chain(tx, timeline.as_str(), last, &filter).await?,
        whole: after.is_none(),
        head: SessionHead {
            timeline,
            last_seq: last,
        },
    })
}

const MESSAGE_COLUMNS: &str = "m.seq, m.slot, m.content, m.created_at, m.input_state";

/// Messages visible from `timeline` up to `upto`, in seq order: one range
/// of each ancestor, root first. The ranges are disjoint and increasing (a
/// child's seqs start after its fork point), so ordering by depth then seq
/// is the concatenation SQLite builds range by range.
pub(crate) async fn load_chain(
    tx: &Tx<'_>,
    timeline: &str,
    upto: i64,
    filter: &MessageFilter,
) -> Result<Vec<StoredMessage>> {
    let sql = format!(
        "{CHAIN_CTE} SELECT {MESSAGE_COLUMNS} FROM chain c JOIN messages m \
           ON m.timeline_id = c.tid AND m.seq >= $3 AND m.seq <= c.upto \
         WHERE (NOT $4::boolean OR m.client_visibility = 'visible') \
           AND ($5::text IS NULL OR m.slot = $5) \
         ORDER BY c.depth DESC, m.seq"
    );
    tx.query(
        &sql,
        &[
            &timeline,
            &upto,
            &filter.from_seq.unwrap_or(i64::MIN),
            &filter.visible_only,
            &filter.slot,
        ],
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(stored_from_row)
    .collect()
}

fn stored_from_row(r: &Row) -> Result<StoredMessage> {
    let seq: i64 = r.get(0);
    let content: String = r.get(2);
    let message: Message = serde_json::from_str(&content)
        .map_err(|e| StoreError::corrupt(&format!("messages.content (seq {seq})"), e))?;
    Ok(StoredMessage {
        seq,
        slot: r.get(1),
        message,
        created_at_ms: r.get(3),
        input_state: crate::util::parse_opt("messages.input_state", r.get(4))?,
    })
}

/// A page of the history visible from `timeline`: the ancestor chain
/// walked forwards (root first, oldest first, above the cursor) or
/// backwards (head first, newest first, below it), the first `limit` rows
/// of that walk. Each ancestor's range is read with the page's limit, so
/// no range is scanned further than the page needs.
async fn load_page(tx: &Tx<'_>, timeline: &str, page: &MessagePage) -> Result<Vec<StoredMessage>> {
    let (order, low, high) = if page.newest_first {
        (
            ("c.depth", "m.seq DESC"),
            i64::MIN,
            page.cursor.map_or(i64::MAX, |c| c - 1),
        )
    } else {
        (
            ("c.depth DESC", "m.seq"),
            page.cursor.map_or(i64::MIN, |c| c + 1),
            i64::MAX,
        )
    };
    let (depth_order, seq_order) = order;
    let sql = format!(
        "{CHAIN_CTE} SELECT {MESSAGE_COLUMNS} FROM chain c CROSS JOIN LATERAL ( \
           SELECT * FROM messages m \
           WHERE m.timeline_id = c.tid AND m.seq >= $3 AND m.seq <= LEAST(c.upto, $4) \
             AND (NOT $5::boolean OR m.client_visibility = 'visible') \
           ORDER BY {seq_order} LIMIT $6) m \
         ORDER BY {depth_order}, {seq_order} LIMIT $6"
    );
    let limit = i64::try_from(page.limit).unwrap_or(i64::MAX);
    tx.query(
        &sql,
        &[
            &timeline,
            &i64::MAX,
            &low,
            &high,
            &page.visible_only,
            &limit,
        ],
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(stored_from_row)
    .collect()
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
/// webhook deliveries of the inputs it answers (and to `webhook_urls`).
pub(crate) async fn commit_turn_tx(
    tx: &Tx<'_>,
    turn: &TurnCommit,
    messages: &[EncodedMessage],
    webhook_urls: &[String],
) -> Result<TurnCommitted> {
    // The caller's transaction checked the fence already.
    Ok(commit_turn_counted_tx(tx, turn, messages, webhook_urls, 0)
        .await?
        .0)
}

/// `commit_turn_tx`, and how many webhook deliveries it queued.
async fn commit_turn_counted_tx(
    tx: &Tx<'_>,
    turn: &TurnCommit,
    messages: &[EncodedMessage],
    webhook_urls: &[String],
    generation: i64,
) -> Result<(TurnCommitted, usize)> {
    let session = &turn.session_id;
    under_head(
        tx,
        session,
        generation,
        turn.expected_head.as_ref(),
        |head, last| commit_writes(tx, turn, messages, webhook_urls, head, last),
    )
    .await
}

/// A turn's commit after its dialog's lock, in one statement: the state
/// blob kept (`$15`, its bytes `$16`: share-locked when present, else
/// inserted), the messages appended ([`APPEND`]'s `$1`..`$12`), the inputs
/// at seqs `$13` answered (each must be open), the call spans of turn
/// `$21` inserted (the nine arrays `$22`..`$30`), the session's counters
/// bumped by `$14` and its state set, and checkpoint `$17` (turn index
/// `$18`, source `$19`, at seq `$20`; none when NULL) inserted with the
/// session's newest checkpoint as its parent. The parts touch disjoint
/// rows; the foreign keys to the blob are checked at the statement's end,
/// after it was inserted. Answers whether the blob is kept, the seqs
/// answered, whether the session was bumped, and the checkpoint's parent.
const COMMIT: &str = concat!(
    "WITH ",
    crate::checkpoints::keep_blob_ctes!("$15", "$16"),
    ", appended AS (",
    append_sql!(),
    " RETURNING 1), ",
    "answered AS (UPDATE messages SET input_state = 'answered' ",
    "WHERE timeline_id = $1 AND seq = ANY($13::bigint[]) AND input_state = 'open' RETURNING seq), ",
    "spans AS (",
    crate::calls::insert_spans_sql!(
        "$3", "$21", "NULL", "$22", "$23", "$24", "$25", "$26", "$27", "$28", "$29", "$30"
    ),
    " RETURNING 1), ",
    "bumped AS (UPDATE sessions SET last_active_at = GREATEST(last_active_at, $4), ",
    "message_count = message_count + $14, state_hash = $15 WHERE id = $3 RETURNING 1), ",
    "cp AS (INSERT INTO checkpoints (id, session_id, timeline_id, seq, parent_checkpoint_id, ",
    "turn_index, state_hash, source, created_at) SELECT $17, $3, $1, $20, ",
    crate::checkpoints::newest_checkpoint!("$3"),
    ", $18, $15, $19, $4 WHERE $17::text IS NOT NULL RETURNING parent_checkpoint_id) ",
    "SELECT ",
    crate::checkpoints::blob_kept!(),
    ", ",
    "ARRAY(SELECT seq FROM answered), EXISTS (SELECT 1 FROM bumped), ",
    "(SELECT parent_checkpoint_id FROM cp)"
);

/// A turn commit's writes, on `head` after seq `last`: [`COMMIT`], and the
/// webhook deliveries of the inputs it answers sent with it.
async fn commit_writes(
    tx: &Tx<'_>,
    turn: &TurnCommit,
    messages: &[EncodedMessage],
    webhook_urls: &[String],
    head: TimelineId,
    last: i64,
) -> Result<(TurnCommitted, usize)> {
    let session = &turn.session_id;
    let seqs = new_seqs(last, messages.len());
    let end = seqs.last().copied().unwrap_or(last);
    let state_hash = sha256_hex(&turn.state);
    let no_spans = Vec::new();
    let spans = crate::calls::SpanColumns::new(
        turn.calls.as_ref().map_or(&no_spans, |calls| &calls.spans),
    )?;
    let span_turn = turn.calls.as_ref().map(|calls| calls.turn_id.to_string());
    let checkpoint = turn.checkpoint.as_ref();
    let checkpoint_id = checkpoint.map(|cp| cp.id.to_string());
    let turn_index = checkpoint
        .map(|cp| crate::util::to_i64("turn_index", cp.turn_index))
        .transpose()?;
    let source = checkpoint.map(|cp| cp.source.as_str());
    let columns = append_columns(messages);
    let id = session.to_string();
    let inputs = i64::from(turn.visible_user_inputs);
    let timeline = head.as_str();
    let mut params = append_params(&timeline, &last, &id, &turn.now_ms, &columns);
    params.extend([
        &turn.answers as &(dyn ToSql + Sync),
        &inputs,
        &state_hash,
        &turn.state,
        &checkpoint_id,
        &turn_index,
        &source,
        &end,
        &span_turn,
    ]);
    params.extend(spans.params());
    let written = async {
        let row = tx.query_one(COMMIT, &params).await.map_err(from_pg)?;
        if !row.get::<_, bool>(0) {
            return Err(StoreError::Busy {
                message: format!("state blob {state_hash} was deleted while it was being kept"),
                attempts: 1,
            });
        }
        let answered: Vec<i64> = row.get(1);
        if let Some(seq) = turn.answers.iter().find(|seq| !answered.contains(seq)) {
            return Err(StoreError::Stale(format!(
                "the turn input at seq {seq} is not open any more"
            )));
        }
        if !row.get::<_, bool>(2) {
            return Err(StoreError::NotFound(format!("session {session}")));
        }
        let parent: Option<String> = row.get(3);
        Ok(parent)
    };
    let deliveries = async {
        if turn.answers.is_empty() {
            return Ok(0);
        }
        crate::webhooks::deliveries_tx(
            tx,
            &crate::webhooks::CommittedTurn {
                status: "committed",
                session,
                timeline: head.as_str(),
                answers: &turn.answers,
                turn_id: turn.calls.as_ref().map(|calls| calls.turn_id),
                messages: &turn.messages,
                last_seq: seqs.last().copied(),
                now_ms: turn.now_ms,
            },
            webhook_urls,
        )
        .await
    };
    let (parent, deliveries) = futures::try_join!(written, deliveries)?;
    let checkpoint = checkpoint
        .map(|cp| checkpoint_record(cp, session, &head, end, parent, &state_hash, turn.now_ms))
        .transpose()?;
    let committed = TurnCommitted {
        seqs,
        state_hash,
        checkpoint,
    };
    Ok((committed, deliveries))
}

/// Marks every open input of the sessions no live process leases
/// unanswered (no turn of theirs runs); answers (session_id, timeline_id, seq) of each in the order SQLite's
/// index walk returns them (by session, then as appended).
pub(crate) const CLOSE_INTERRUPTED_SQL: &str = "WITH closed AS ( \
       UPDATE messages SET input_state = 'unanswered' WHERE input_state = 'open' \
       AND session_id NOT IN (SELECT session_id FROM session_leases WHERE generation IS NOT NULL) \
       RETURNING session_id, timeline_id, seq) \
     SELECT session_id, timeline_id, seq FROM closed ORDER BY session_id COLLATE \"C\", timeline_id COLLATE \"C\", seq";

async fn open_turn_tx(
    tx: &Tx<'_>,
    turn: &OpenTurn,
    messages: &[EncodedMessage],
    visible_user_inputs: u32,
    generation: i64,
) -> Result<Vec<i64>> {
    let session = &turn.session_id;
    under_head(
        tx,
        session,
        generation,
        turn.expected_head.as_ref(),
        |head, last| open_writes(tx, turn, messages, visible_user_inputs, head, last),
    )
    .await
}

/// A turn opening's writes ([`OPEN`]), on `head` after seq `last`.
async fn open_writes(
    tx: &Tx<'_>,
    turn: &OpenTurn,
    messages: &[EncodedMessage],
    visible_user_inputs: u32,
    head: TimelineId,
    last: i64,
) -> Result<Vec<i64>> {
    let session = &turn.session_id;
    let timeline = head.as_str();
    let seqs = new_seqs(last, messages.len());
    // The subscription follows the turn's user message (the input it answers).
    let bound = turn.queued.as_ref().and_then(|_| {
        let i = turn
            .messages
            .iter()
            .position(|m| m.message.role == keel_core::Role::User)?;
        seqs.get(i).copied()
    });
    let queued = turn.queued.map(|t| t.to_string());
    let columns = append_columns(messages);
    let id = session.to_string();
    let mut params = append_params(&timeline, &last, &id, &turn.now_ms, &columns);
    let inputs = i64::from(visible_user_inputs);
    params.extend([&queued as &(dyn ToSql + Sync), &bound, &inputs]);
    let row = tx.query_one(OPEN, &params).await.map_err(from_pg)?;
    if let Some(queued) = &turn.queued {
        if row.get::<_, i64>(0) == 0 {
            return Err(StoreError::Stale(format!(
                "the input of turn {queued} is not queued"
            )));
        }
    }
    if row.get::<_, i64>(1) == 0 {
        return Err(StoreError::NotFound(format!("session {session}")));
    }
    Ok(seqs)
}

/// A turn's opening after its dialog's lock, in one statement: the input
/// taken off the queue (turn `$13`, if queued), inputs a dropped or
/// crashed turn left open marked unanswered, the input appended
/// ([`APPEND`]'s `$1`..`$12`), a webhook subscription bound to its seq
/// (`$14`), the session's counters bumped by `$15`. The parts run on one
/// snapshot and touch disjoint rows (the unanswered update cannot see the
/// rows appended beside it). Answers (inputs taken, sessions bumped).
const OPEN: &str = concat!(
    "WITH taken AS (DELETE FROM queued_inputs WHERE turn_id = $13 RETURNING 1), ",
    "closed AS (UPDATE messages SET input_state = 'unanswered' ",
    "WHERE session_id = $3 AND input_state = 'open' RETURNING 1), ",
    "appended AS (",
    append_sql!(),
    " RETURNING 1), ",
    "bound AS (UPDATE webhook_subscriptions SET timeline_id = $1, input_seq = $14 ",
    "WHERE turn_id = $13 AND timeline_id IS NULL AND $14::bigint IS NOT NULL RETURNING 1), ",
    "bumped AS (UPDATE sessions SET last_active_at = GREATEST(last_active_at, $4), ",
    "message_count = message_count + $15 WHERE id = $3 RETURNING 1) ",
    "SELECT (SELECT count(*) FROM taken), (SELECT count(*) FROM bumped)"
);

impl PgStore {
    pub(crate) async fn open_turn(&self, turn: OpenTurn) -> Result<Vec<i64>> {
        let mut messages = turn.messages.clone();
        for m in &mut messages {
            m.input_state = Some(InputState::Open);
        }
        let encoded = Arc::new(encode(&messages)?);
        let visible = messages
            .iter()
            .filter(|m| m.message.is_visible_user_input())
            .count();
        let visible = u32::try_from(visible).unwrap_or(u32::MAX);
        let turn = Arc::new(turn);
        self.write_committed_fenced(move |tx, generation| {
            let (turn, encoded) = (turn.clone(), encoded.clone());
            Box::pin(async move { open_turn_tx(tx, &turn, &encoded, visible, generation).await })
        })
        .await
    }

    pub(crate) async fn mark_unanswered(
        &self,
        session_id: SessionId,
        seqs: Vec<i64>,
    ) -> Result<usize> {
        let urls = Arc::new(self.inner.hooks.urls());
        let seqs = Arc::new(seqs);
        let (changed, deliveries) = self
            .write_committed(move |tx| {
                let (urls, seqs) = (urls.clone(), seqs.clone());
                Box::pin(async move {
                    let timeline = head_timeline(tx, &session_id).await?;
                    let (mut changed, mut deliveries) = (0, 0);
                    for seq in seqs.iter() {
                        let n = tx
                            .execute(
                                "UPDATE messages SET input_state = 'unanswered' \
                                 WHERE timeline_id = $1 AND seq = $2 AND input_state = 'open'",
                                &[&timeline, seq],
                            )
                            .await
                            .map_err(from_pg)?;
                        if n == 1 {
                            changed += 1;
                            deliveries += crate::webhooks::unanswered_deliveries_tx(
                                tx,
                                &session_id,
                                &timeline,
                                *seq,
                                keel_core::time::now_ms(),
                                &urls,
                            )
                            .await?;
                        }
                    }
                    Ok((changed, deliveries))
                })
            })
            .await?;
        if deliveries > 0 {
            self.inner.hooks.wake();
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
            .ok_or_else(|| StoreError::Postgres("append returned no seq".into()))
    }

    pub(crate) async fn append_messages(
        &self,
        session_id: SessionId,
        messages: Vec<NewMessage>,
        now_ms: i64,
    ) -> Result<Vec<i64>> {
        let encoded = Arc::new(encode(&messages)?);
        self.write_committed(move |tx| {
            let encoded = encoded.clone();
            Box::pin(async move {
                let (timeline, last) = head_state(tx, &session_id).await?;
                append_tx(tx, &session_id, &timeline, last, &encoded, now_ms).await
            })
        })
        .await
    }

    pub(crate) async fn commit_turn(&self, turn: TurnCommit) -> Result<TurnCommitted> {
        let encoded = Arc::new(encode(&turn.messages)?);
        let global = Arc::new(self.inner.hooks.urls());
        let turn = Arc::new(turn);
        let (committed, deliveries) = self
            .write_committed_fenced(move |tx, generation| {
                let (turn, encoded, global) = (turn.clone(), encoded.clone(), global.clone());
                Box::pin(async move {
                    commit_turn_counted_tx(tx, &turn, &encoded, &global, generation).await
                })
            })
            .await?;
        if deliveries > 0 {
            self.inner.hooks.wake();
        }
        Ok(committed)
    }

    pub(crate) async fn load_messages(
        &self,
        session_id: SessionId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        self.read(move |tx| {
            let filter = filter.clone();
            Box::pin(async move {
                let session = require_session(tx, &session_id).await?;
                load_chain(tx, session.head_timeline_id.as_str(), i64::MAX, &filter).await
            })
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
        self.read(move |tx| {
            let page = page.clone();
            Box::pin(async move {
                let session = require_session(tx, &session_id).await?;
                load_page(tx, session.head_timeline_id.as_str(), &page).await
            })
        })
        .await
    }

    pub(crate) async fn history_ranges(
        &self,
        session_id: SessionId,
    ) -> Result<Vec<(TimelineId, i64)>> {
        self.read(move |tx| {
            Box::pin(async move {
                let session = require_session(tx, &session_id).await?;
                Ok(chain(tx, session.head_timeline_id.as_str(), i64::MAX)
                    .await?
                    .into_iter()
                    .map(|(t, upto)| (TimelineId(t), upto))
                    .collect())
            })
        })
        .await
    }

    pub(crate) async fn history_after(
        &self,
        session_id: SessionId,
        known: Option<SessionHead>,
        filter: MessageFilter,
    ) -> Result<HistoryDelta> {
        self.read(move |tx| {
            let (known, filter) = (known.clone(), filter.clone());
            Box::pin(async move {
                let session = require_session(tx, &session_id).await?;
                history_after_tx(tx, session.head_timeline_id, known.as_ref(), &filter).await
            })
        })
        .await
    }

    pub(crate) async fn dialogs_with_history_after(
        &self,
        query: DialogQuery,
        wanted: DialogFilter,
        known: HashMap<SessionId, SessionHead>,
        filter: MessageFilter,
    ) -> Result<Vec<(SessionRecord, HistoryDelta)>> {
        check_limit(&query)?;
        let (wanted, known) = (Arc::new(wanted), Arc::new(known));
        self.read(move |tx| {
            let (query, filter) = (query.clone(), filter.clone());
            let (wanted, known) = (wanted.clone(), known.clone());
            Box::pin(async move {
                let mut out = Vec::new();
                for record in list_dialogs_tx(tx, &query).await?.items {
                    if !wanted(&record) {
                        continue;
                    }
                    let timeline = record.head_timeline_id.clone();
                    let delta =
                        history_after_tx(tx, timeline, known.get(&record.id), &filter).await?;
                    out.push((record, delta));
                }
                Ok(out)
            })
        })
        .await
    }

    pub(crate) async fn load_messages_at_checkpoint(
        &self,
        checkpoint_id: CheckpointId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        self.read(move |tx| {
            let filter = filter.clone();
            Box::pin(async move {
                let cp = crate::checkpoints::require_checkpoint(tx, &checkpoint_id).await?;
                load_chain(tx, cp.timeline_id.as_str(), cp.seq, &filter).await
            })
        })
        .await
    }

    pub(crate) async fn last_seq(&self, session_id: SessionId) -> Result<i64> {
        self.read(move |tx| {
            Box::pin(async move {
                let session = require_session(tx, &session_id).await?;
                last_seq(tx, session.head_timeline_id.as_str()).await
            })
        })
        .await
    }
}
