//! The per-root-session row of `agent_session_state`: the client revision
//! every change of a session's runs and inbox bumps once per transaction, and
//! the counters of pending inbox events and reserved completion slots that
//! bound the inbox's capacity.

use keel_core::SessionId;
use rusqlite::{params, Connection, OptionalExtension};

use crate::error::{Result, StoreError};
use crate::runs::NONTERMINAL_RUN;
use crate::util::non_negative;
use crate::SqliteStore;

/// How much of a root session's inbox capacity is in use, and its client
/// revision. Pending events plus reserved slots may not exceed the capacity
/// a request passes in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxUsage {
    /// Client revision: bumped once by every transaction that changes the session's runs or inbox.
    pub revision: u64,
    /// Events pending, leased or admitted.
    pub pending_event_count: u64,
    /// Completion slots reserved by non-terminal runs and groups.
    pub reserved_completion_slots: u64,
}

/// How many of a root session's inbox events are in each delivery state,
/// read in one transaction with its client revision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxCounts {
    /// Client revision the counts are as of.
    pub revision: u64,
    /// Waiting for a turn, or being delivered (pending, leased, admitted).
    pub pending: u64,
    /// Consumed by a turn.
    pub delivered: u64,
    /// Given up on.
    pub dead_lettered: u64,
    /// Withdrawn before delivery (a cancelled run's signals).
    pub superseded: u64,
}

/// Inbox usage counters that recovery found wrong and repaired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterRepair {
    /// The root session.
    pub root_session_id: SessionId,
    /// Stored before.
    pub before: InboxUsage,
    /// Recomputed and stored now.
    pub after: InboxUsage,
}

/// Makes sure the session's counter row exists.
fn ensure_state_row(conn: &Connection, root: &SessionId, now_ms: i64) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO agent_session_state (root_session_id, updated_at) VALUES (?1, ?2) \
         ON CONFLICT (root_session_id) DO NOTHING",
    )?
    .execute(params![root.to_string(), now_ms])?;
    Ok(())
}

/// The client revisions of one multi-session transaction (cancel, recover):
/// one new revision per root session, allocated on first use.
#[derive(Debug, Default)]
pub(crate) struct Revisions(std::collections::HashMap<SessionId, i64>);

impl Revisions {
    /// The revision of this transaction for `root`.
    pub(crate) fn of(&mut self, conn: &Connection, root: &SessionId, now_ms: i64) -> Result<i64> {
        if let Some(r) = self.0.get(root) {
            return Ok(*r);
        }
        let r = next_revision(conn, root, now_ms)?;
        self.0.insert(*root, r);
        Ok(r)
    }
}

/// Allocates the one new client revision of this transaction for `root`.
pub(crate) fn next_revision(conn: &Connection, root: &SessionId, now_ms: i64) -> Result<i64> {
    ensure_state_row(conn, root, now_ms)?;
    Ok(conn
        .prepare_cached(
            "UPDATE agent_session_state SET revision = revision + 1, updated_at = ?2 \
             WHERE root_session_id = ?1 RETURNING revision",
        )?
        .query_row(params![root.to_string(), now_ms], |r| r.get(0))?)
}

/// Adds `delta` to the pending/reserved counters; with `capacity`, only if
/// pending + reserved stays within it (else `InboxFull`, nothing changed).
pub(crate) fn adjust_counters(
    conn: &Connection,
    root: &SessionId,
    pending_delta: i64,
    reserved_delta: i64,
    capacity: Option<u32>,
    now_ms: i64,
) -> Result<()> {
    if pending_delta == 0 && reserved_delta == 0 {
        return Ok(());
    }
    ensure_state_row(conn, root, now_ms)?;
    let n = conn
        .prepare_cached(
            "UPDATE agent_session_state \
             SET pending_event_count = pending_event_count + ?2, \
                 reserved_completion_slots = reserved_completion_slots + ?3, updated_at = ?4 \
             WHERE root_session_id = ?1 \
               AND (?5 IS NULL OR pending_event_count + reserved_completion_slots + ?2 + ?3 <= ?5)",
        )?
        .execute(params![
            root.to_string(),
            pending_delta,
            reserved_delta,
            now_ms,
            capacity
        ])?;
    if n == 0 {
        return Err(StoreError::InboxFull {
            session: root.to_string(),
            capacity: capacity.unwrap_or(0),
        });
    }
    Ok(())
}

pub(crate) fn usage_tx(conn: &Connection, root: &SessionId) -> Result<InboxUsage> {
    let row: Option<(i64, i64, i64)> = conn
        .query_row(
            "SELECT revision, pending_event_count, reserved_completion_slots \
             FROM agent_session_state WHERE root_session_id = ?1",
            [root.to_string()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    let Some((rev, pending, reserved)) = row else {
        return Ok(InboxUsage::default());
    };
    Ok(InboxUsage {
        revision: non_negative("agent_session_state.revision", rev)?,
        pending_event_count: non_negative("agent_session_state.pending_event_count", pending)?,
        reserved_completion_slots: non_negative(
            "agent_session_state.reserved_completion_slots",
            reserved,
        )?,
    })
}

/// A root session's (pending events, reserved completion slots) counted from the rows.
pub(crate) fn recount_tx(conn: &Connection, root: &str) -> Result<(i64, i64)> {
    let pending: i64 = conn
        .prepare_cached(
            "SELECT count(*) FROM agent_inbox_events WHERE root_session_id = ?1 \
             AND status IN ('pending', 'leased', 'admitted')",
        )?
        .query_row([root], |r| r.get(0))?;
    let reserved: i64 = conn
        .prepare_cached(&format!(
            "SELECT (SELECT count(*) FROM agent_runs WHERE root_session_id = ?1 \
               AND completion_slot_reserved = 1 AND status IN {NONTERMINAL_RUN}) + \
             (SELECT count(*) FROM agent_run_groups WHERE root_session_id = ?1 \
               AND completion_slot_reserved = 1 AND status IN ('queued', 'running'))"
        ))?
        .query_row([root], |r| r.get(0))?;
    Ok((pending, reserved))
}

/// Recomputes a root session's counters from the rows; repairs and reports a difference.
pub(crate) fn reconcile_tx(
    conn: &Connection,
    root: &SessionId,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<Option<CounterRepair>> {
    let before = usage_tx(conn, root)?;
    let key = root.to_string();
    let (pending, reserved) = recount_tx(conn, &key)?;
    let after = InboxUsage {
        revision: before.revision,
        pending_event_count: non_negative("pending events", pending)?,
        reserved_completion_slots: non_negative("reserved slots", reserved)?,
    };
    if after == before {
        return Ok(None);
    }
    tracing::warn!(
        root_session_id = %root,
        ?before,
        ?after,
        "repairing inbox counters"
    );
    let revision = revisions.of(conn, root, now_ms)?;
    conn.execute(
        "UPDATE agent_session_state SET pending_event_count = ?2, reserved_completion_slots = ?3, \
         updated_at = ?4 WHERE root_session_id = ?1",
        params![key, pending, reserved, now_ms],
    )?;
    Ok(Some(CounterRepair {
        root_session_id: *root,
        before,
        after: InboxUsage {
            revision: non_negative("revision", revision)?,
            ..after
        },
    }))
}

impl SqliteStore {
    pub(crate) async fn reconcile_counters(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
    ) -> Result<Option<CounterRepair>> {
        self.db
            .write(move |c| reconcile_tx(c, &root_session_id, now_ms, &mut Revisions::default()))
            .await
    }

    pub(crate) async fn inbox_counts(&self, root_session_id: SessionId) -> Result<InboxCounts> {
        self.db
            .read(move |c| {
                let revision = usage_tx(c, &root_session_id)?.revision;
                let (pending, delivered, dead, superseded): (i64, i64, i64, i64) = c
                    .prepare_cached(
                        "SELECT count(*) FILTER (WHERE status IN ('pending', 'leased', 'admitted')), \
                                count(*) FILTER (WHERE status = 'consumed'), \
                                count(*) FILTER (WHERE status = 'dead_letter'), \
                                count(*) FILTER (WHERE status = 'superseded') \
                         FROM agent_inbox_events WHERE root_session_id = ?1",
                    )?
                    .query_row([root_session_id.to_string()], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                    })?;
                Ok(InboxCounts {
                    revision,
                    pending: non_negative("pending events", pending)?,
                    delivered: non_negative("consumed events", delivered)?,
                    dead_lettered: non_negative("dead-lettered events", dead)?,
                    superseded: non_negative("superseded events", superseded)?,
                })
            })
            .await
    }

    pub(crate) async fn inbox_usage(&self, root_session_id: SessionId) -> Result<InboxUsage> {
        self.db.read(move |c| usage_tx(c, &root_session_id)).await
    }
}
