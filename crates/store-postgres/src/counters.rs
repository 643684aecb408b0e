//! The per-root-session row of `agent_session_state` on PostgreSQL: the
//! client revision every change of a session's runs and inbox bumps once per
//! transaction, and the counters of pending inbox events and reserved
//! completion slots that bound the inbox's capacity.

use std::collections::HashMap;

use crate::store::Tx;
use keel_core::SessionId;
use keel_store::{CounterRepair, InboxCounts, InboxUsage, Result, StoreError};

use crate::runs::NONTERMINAL_RUN;
use crate::store::from_pg;
use crate::util::non_negative;
use crate::PgStore;

/// Makes sure the session's counter row exists.
async fn ensure_state_row(tx: &Tx<'_>, root: &SessionId, now_ms: i64) -> Result<()> {
    tx.execute(
        "INSERT INTO agent_session_state (root_session_id, updated_at) VALUES ($1, $2) \
         ON CONFLICT (root_session_id) DO NOTHING",
        &[&root.to_string(), &now_ms],
    )
    .await
    .map_err(from_pg)?;
    Ok(())
}

/// The client revisions of one multi-session transaction (cancel, recover):
/// one new revision per root session, allocated on first use.
#[derive(Debug, Default)]
pub(crate) struct Revisions(HashMap<SessionId, i64>);

impl Revisions {
    /// The revision of this transaction for `root`.
    pub(crate) async fn of(&mut self, tx: &Tx<'_>, root: &SessionId, now_ms: i64) -> Result<i64> {
        if let Some(r) = self.0.get(root) {
            return Ok(*r);
        }
        let r = next_revision(tx, root, now_ms).await?;
        self.0.insert(*root, r);
        Ok(r)
    }
}

/// Allocates the one new client revision of this transaction for `root`.
pub(crate) async fn next_revision(tx: &Tx<'_>, root: &SessionId, now_ms: i64) -> Result<i64> {
    // One statement for SQLite's ensure-then-bump: a new row starts at
    // revision 0, so its first bump is 1 either way.
    let row = tx
        .query_one(
            "INSERT INTO agent_session_state (root_session_id, revision, updated_at) \
             VALUES ($1, 1, $2) \
             ON CONFLICT (root_session_id) DO UPDATE \
             SET revision = agent_session_state.revision + 1, updated_at = EXCLUDED.updated_at \
             RETURNING revision",
            &[&root.to_string(), &now_ms],
        )
        .await
        .map_err(from_pg)?;
    Ok(row.get(0))
}

/// Adds `delta` to the pending/reserved counters; with `capacity`, only if
/// pending + reserved stays within it (else `InboxFull`, nothing changed).
pub(crate) async fn adjust_counters(
    tx: &Tx<'_>,
    root: &SessionId,
    pending_delta: i64,
    reserved_delta: i64,
    capacity: Option<u32>,
    now_ms: i64,
) -> Result<()> {
    if pending_delta == 0 && reserved_delta == 0 {
        return Ok(());
    }
    ensure_state_row(tx, root, now_ms).await?;
    let n = tx
        .execute(
            "UPDATE agent_session_state \
             SET pending_event_count = pending_event_count + $2, \
                 reserved_completion_slots = reserved_completion_slots + $3, updated_at = $4 \
             WHERE root_session_id = $1 \
               AND ($5::bigint IS NULL \
                    OR pending_event_count + reserved_completion_slots + $2 + $3 <= $5::bigint)",
            &[
                &root.to_string(),
                &pending_delta,
                &reserved_delta,
                &now_ms,
                &capacity.map(i64::from),
            ],
        )
        .await
        .map_err(from_pg)?;
    if n == 0 {
        return Err(StoreError::InboxFull {
            session: root.to_string(),
            capacity: capacity.unwrap_or(0),
        });
    }
    Ok(())
}

/// A root session's counters and client revision (zeros before its first change).
pub(crate) async fn usage_tx(tx: &Tx<'_>, root: &SessionId) -> Result<InboxUsage> {
    let row = tx
        .query_opt(
            "SELECT revision, pending_event_count, reserved_completion_slots \
             FROM agent_session_state WHERE root_session_id = $1",
            &[&root.to_string()],
        )
        .await
        .map_err(from_pg)?;
    let Some(row) = row else {
        return Ok(InboxUsage::default());
    };
    Ok(InboxUsage {
        revision: non_negative("agent_session_state.revision", row.get(0))?,
        pending_event_count: non_negative("agent_session_state.pending_event_count", row.get(1))?,
        reserved_completion_slots: non_negative(
            "agent_session_state.reserved_completion_slots",
            row.get(2),
        )?,
    })
}

/// A root session's (pending events, reserved completion slots) counted from the rows.
pub(crate) async fn recount_tx(tx: &Tx<'_>, root: &str) -> Result<(i64, i64)> {
    let row = tx
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM agent_inbox_events WHERE root_session_id = $1 \
                   AND status IN ('pending', 'leased', 'admitted')), \
                 (SELECT count(*) FROM agent_runs WHERE root_session_id = $1 \
                   AND completion_slot_reserved = 1 AND status IN {NONTERMINAL_RUN}) + \
                 (SELECT count(*) FROM agent_run_groups WHERE root_session_id = $1 \
                   AND completion_slot_reserved = 1 AND status IN ('queued', 'running'))"
            ),
            &[&root],
        )
        .await
        .map_err(from_pg)?;
    Ok((row.get(0), row.get(1)))
}

/// Recomputes a root session's counters from the rows; repairs and reports a difference.
pub(crate) async fn reconcile_tx(
    tx: &Tx<'_>,
    root: &SessionId,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<Option<CounterRepair>> {
    let before = usage_tx(tx, root).await?;
    let key = root.to_string();
    let (pending, reserved) = recount_tx(tx, &key).await?;
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
    let revision = revisions.of(tx, root, now_ms).await?;
    tx.execute(
        "UPDATE agent_session_state SET pending_event_count = $2, reserved_completion_slots = $3, \
         updated_at = $4 WHERE root_session_id = $1",
        &[&key, &pending, &reserved, &now_ms],
    )
    .await
    .map_err(from_pg)?;
    Ok(Some(CounterRepair {
        root_session_id: *root,
        before,
        after: InboxUsage {
            revision: non_negative("revision", revision)?,
            ..after
        },
    }))
}

impl PgStore {
    pub(crate) async fn reconcile_counters(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
    ) -> Result<Option<CounterRepair>> {
        self.write(move |tx| {
            Box::pin(async move {
                reconcile_tx(tx, &root_session_id, now_ms, &mut Revisions::default()).await
            })
        })
        .await
    }

    pub(crate) async fn inbox_counts(&self, root_session_id: SessionId) -> Result<InboxCounts> {
        self.read(move |tx| {
            Box::pin(async move {
                let revision = usage_tx(tx, &root_session_id).await?.revision;
                let row = tx
                    .query_one(
                        "SELECT count(*) FILTER (WHERE status IN ('pending', 'leased', 'admitted')), \
                                count(*) FILTER (WHERE status = 'consumed'), \
                                count(*) FILTER (WHERE status = 'dead_letter'), \
                                count(*) FILTER (WHERE status = 'superseded') \
                         FROM agent_inbox_events WHERE root_session_id = $1",
                        &[&root_session_id.to_string()],
                    )
                    .await
                    .map_err(from_pg)?;
                Ok(InboxCounts {
                    revision,
                    pending: non_negative("pending events", row.get(0))?,
                    delivered: non_negative("consumed events", row.get(1))?,
                    dead_lettered: non_negative("dead-lettered events", row.get(2))?,
                    superseded: non_negative("superseded events", row.get(3))?,
                })
            })
        })
        .await
    }

    pub(crate) async fn inbox_usage(&self, root_session_id: SessionId) -> Result<InboxUsage> {
        self.read(move |tx| Box::pin(async move { usage_tx(tx, &root_session_id).await }))
            .await
    }
}
