//! Purging soft-deleted dialogs for good, and what a dialog occupies, on
//! PostgreSQL (keel-store's `purge.rs`, the same order of bounded batches,
//! each its own transaction, so that every intermediate state is one the
//! checker accepts: queued inputs, approvals and subscriptions; call spans;
//! runs leaf first with their inbox events, the counters recomputed;
//! checkpoints; messages newest first, timeline by timeline, children
//! before parents; last the session row with its head timeline. Timelines
//! another dialog branches from are kept until that dialog goes too).

use crate::store::Tx;
use keel_core::SessionId;
use keel_store::{DialogUsage, PurgeReport, Result, StoreError};

use crate::checkpoints::sweep_blobs;
use crate::counters::recount_tx;
use crate::store::from_pg;
use crate::util::parse;
use crate::PgStore;

/// Runs (with their inbox events), checkpoints and call spans removed per transaction.
const ROW_BATCH: i64 = 256;
/// Messages removed per transaction.
const MESSAGE_BATCH: i64 = 5_000;

/// Refuses to touch a session that is missing or not deleted.
async fn require_deleted(tx: &Tx<'_>, id: &str) -> Result<()> {
    let row = tx
        .query_opt("SELECT deleted_at FROM sessions WHERE id = $1", &[&id])
        .await
        .map_err(from_pg)?;
    match row.map(|r| r.get::<_, Option<i64>>(0)) {
        None => Err(StoreError::NotFound(format!("session {id}"))),
        Some(None) => Err(StoreError::InvalidInput(format!(
            "session {id} is not deleted; only a deleted dialog is purged"
        ))),
        Some(Some(_)) => Ok(()),
    }
}

async fn exists(tx: &Tx<'_>, sql: &str, id: &str) -> Result<bool> {
    Ok(tx.query_one(sql, &[&id]).await.map_err(from_pg)?.get(0))
}

/// One batch of leaf runs (no run left below them) with their run-scoped
/// events, then the groups no run is left in with theirs; the session's
/// counters recomputed. Returns (runs, events) removed.
async fn runs_batch(tx: &Tx<'_>, id: &str) -> Result<(u64, u64)> {
    require_deleted(tx, id).await?;
    let leaves = "SELECT r.id FROM agent_runs r WHERE r.root_session_id = $1 \
         AND NOT EXISTS (SELECT 1 FROM agent_runs c WHERE c.parent_run_id = r.id) LIMIT $2";
    let mut events = tx
        .execute(
            &format!(
                "DELETE FROM agent_inbox_events WHERE scope_kind = 'run' \
                 AND scope_id IN ({leaves})"
            ),
            &[&id, &ROW_BATCH],
        )
        .await
        .map_err(from_pg)?;
    let runs = tx
        .execute(
            &format!("DELETE FROM agent_runs WHERE id IN ({leaves})"),
            &[&id, &ROW_BATCH],
        )
        .await
        .map_err(from_pg)?;
    let empty_groups = "SELECT g.id FROM agent_run_groups g WHERE g.root_session_id = $1 \
         AND NOT EXISTS (SELECT 1 FROM agent_runs r WHERE r.group_id = g.id)";
    events += tx
        .execute(
            &format!(
                "DELETE FROM agent_inbox_events WHERE scope_kind = 'group' \
                 AND scope_id IN ({empty_groups})"
            ),
            &[&id],
        )
        .await
        .map_err(from_pg)?;
    tx.execute(
        &format!("DELETE FROM agent_run_groups WHERE id IN ({empty_groups})"),
        &[&id],
    )
    .await
    .map_err(from_pg)?;
    let left = exists(
        tx,
        "SELECT EXISTS (SELECT 1 FROM agent_runs WHERE root_session_id = $1) \
             OR EXISTS (SELECT 1 FROM agent_run_groups WHERE root_session_id = $1) \
             OR EXISTS (SELECT 1 FROM agent_inbox_events WHERE root_session_id = $1)",
        id,
    )
    .await?;
    if left {
        let (pending, reserved) = recount_tx(tx, id).await?;
        tx.execute(
            "UPDATE agent_session_state SET pending_event_count = $2, \
             reserved_completion_slots = $3 WHERE root_session_id = $1",
            &[&id, &pending, &reserved],
        )
        .await
        .map_err(from_pg)?;
    } else {
        tx.execute(
            "DELETE FROM agent_session_state WHERE root_session_id = $1",
            &[&id],
        )
        .await
        .map_err(from_pg)?;
    }
    Ok((runs, events))
}

/// The session's timelines, newest first (a branch is newer than its parent).
async fn timelines_newest_first(tx: &Tx<'_>, id: &str) -> Result<Vec<String>> {
    Ok(tx
        .query(
            "SELECT id FROM timelines WHERE session_id = $1 \
             ORDER BY created_at DESC, row_order DESC",
            &[&id],
        )
        .await
        .map_err(from_pg)?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The step a message batch ended with.
enum TimelineStep {
    /// More messages remain on the timeline.
    More(u64),
    /// The timeline is empty now (and removed unless it is the head).
    Emptied { messages: u64, removed: bool },
    /// Another timeline branches from it: it is kept.
    Shared,
}

/// Removes up to one batch of `timeline`'s messages, newest seq first, and
/// the timeline itself once it is empty (the session's head, kept until the
/// session row goes, is detached from its parent instead).
async fn timeline_batch(tx: &Tx<'_>, id: &str, timeline: &str) -> Result<TimelineStep> {
    require_deleted(tx, id).await?;
    let branched = exists(
        tx,
        "SELECT EXISTS (SELECT 1 FROM timelines WHERE parent_timeline_id = $1)",
        timeline,
    )
    .await?;
    if branched {
        return Ok(TimelineStep::Shared);
    }
    let messages = tx
        .execute(
            "DELETE FROM messages WHERE timeline_id = $1 AND seq IN (SELECT seq FROM messages \
             WHERE timeline_id = $1 ORDER BY seq DESC LIMIT $2)",
            &[&timeline, &MESSAGE_BATCH],
        )
        .await
        .map_err(from_pg)?;
    if messages == MESSAGE_BATCH as u64 {
        return Ok(TimelineStep::More(messages));
    }
    let removed = tx
        .execute(
            "DELETE FROM timelines WHERE id = $1 AND NOT EXISTS \
             (SELECT 1 FROM sessions WHERE head_timeline_id = $1)",
            &[&timeline],
        )
        .await
        .map_err(from_pg)?
        == 1;
    if !removed {
        // The head stays until the session row goes; empty, it branches from nothing.
        tx.execute(
            "UPDATE timelines SET parent_timeline_id = NULL, fork_seq = NULL WHERE id = $1",
            &[&timeline],
        )
        .await
        .map_err(from_pg)?;
    }
    Ok(TimelineStep::Emptied { messages, removed })
}

/// Removes the emptied session: its head timeline and its row. Refused
/// (false) while any of its timelines still holds messages or is shared,
/// or any checkpoint, run, input, subscription or approval of it remains.
async fn remove_session_row(tx: &Tx<'_>, id: &str) -> Result<(bool, u64)> {
    require_deleted(tx, id).await?;
    let busy = exists(
        tx,
        "SELECT EXISTS (SELECT 1 FROM messages WHERE timeline_id IN \
                        (SELECT id FROM timelines WHERE session_id = $1)) \
             OR EXISTS (SELECT 1 FROM timelines p JOIN timelines c \
                        ON c.parent_timeline_id = p.id WHERE p.session_id = $1) \
             OR EXISTS (SELECT 1 FROM checkpoints WHERE session_id = $1) \
             OR EXISTS (SELECT 1 FROM agent_runs WHERE root_session_id = $1) \
             OR EXISTS (SELECT 1 FROM queued_inputs WHERE session_id = $1) \
             OR EXISTS (SELECT 1 FROM webhook_subscriptions WHERE session_id = $1) \
             OR EXISTS (SELECT 1 FROM tool_approvals WHERE session_id = $1)",
        id,
    )
    .await?;
    if busy {
        return Ok((false, 0));
    }
    let run = |sql: &'static str| async move { tx.execute(sql, &[&id]).await.map_err(from_pg) };
    run("UPDATE sessions SET head_timeline_id = NULL WHERE id = $1").await?;
    let timelines = run("DELETE FROM timelines WHERE session_id = $1").await?;
    run("DELETE FROM sessions WHERE id = $1").await?;
    Ok((true, timelines))
}

impl PgStore {
    pub(crate) async fn deleted_sessions_before(
        &self,
        deleted_before_ms: i64,
    ) -> Result<Vec<SessionId>> {
        self.read(move |tx| {
            Box::pin(async move {
                tx.query(
                    "SELECT id FROM sessions WHERE deleted_at IS NOT NULL AND deleted_at <= $1 \
                     ORDER BY created_at DESC, row_order DESC",
                    &[&deleted_before_ms],
                )
                .await
                .map_err(from_pg)?
                .iter()
                .map(|r| parse("sessions.id", &r.get::<_, String>(0)))
                .collect()
            })
        })
        .await
    }

    pub(crate) async fn purge_session(&self, session_id: SessionId) -> Result<PurgeReport> {
        let id = session_id.to_string();
        let mut report = PurgeReport::default();
        // Deleting a dialog withdraws its queued inputs; older builds left
        // them. Its tool approvals (and the grants they made) go with it,
        // with what a run waiting for one had done.
        self.write(|tx| {
            let id = id.clone();
            Box::pin(async move {
                require_deleted(tx, &id).await?;
                for table in [
                    "queued_inputs",
                    "webhook_subscriptions",
                    "tool_approval_grants",
                    "tool_approvals",
                    "agent_run_pauses",
                ] {
                    tx.execute(
                        &format!("DELETE FROM {table} WHERE session_id = $1"),
                        &[&id],
                    )
                    .await
                    .map_err(from_pg)?;
                }
                Ok(())
            })
        })
        .await?;
        // Its turns' and runs' call spans, in bounded batches.
        loop {
            let n = self
                .write(|tx| {
                    let id = id.clone();
                    Box::pin(async move {
                        require_deleted(tx, &id).await?;
                        tx.execute(
                            "DELETE FROM call_spans WHERE ctid IN \
                             (SELECT ctid FROM call_spans WHERE session_id = $1 LIMIT $2)",
                            &[&id, &ROW_BATCH],
                        )
                        .await
                        .map_err(from_pg)
                    })
                })
                .await?;
            if n == 0 {
                break;
            }
        }
        loop {
            let (runs, events) = self
                .write(|tx| {
                    let id = id.clone();
                    Box::pin(async move { runs_batch(tx, &id).await })
                })
                .await?;
            report.runs += runs;
            report.events += events;
            if runs == 0 {
                break;
            }
        }
        loop {
            let n = self
                .write(|tx| {
                    let id = id.clone();
                    Box::pin(async move {
                        require_deleted(tx, &id).await?;
                        tx.execute(
                            "DELETE FROM checkpoints WHERE id IN \
                             (SELECT id FROM checkpoints WHERE session_id = $1 LIMIT $2)",
                            &[&id, &ROW_BATCH],
                        )
                        .await
                        .map_err(from_pg)
                    })
                })
                .await?;
            report.checkpoints += n;
            if n < ROW_BATCH as u64 {
                break;
            }
        }
        let (shared, timelines) = self
            .read(|tx| {
                let id = id.clone();
                Box::pin(async move {
                    let shared = exists(
                        tx,
                        "SELECT EXISTS (SELECT 1 FROM timelines p JOIN timelines c \
                         ON c.parent_timeline_id = p.id \
                         WHERE p.session_id = $1 AND c.session_id <> $1)",
                        &id,
                    )
                    .await?;
                    Ok((shared, timelines_newest_first(tx, &id).await?))
                })
            })
            .await?;
        if shared {
            report.dialogs_kept_for_forks = 1;
            return Ok(report);
        }
        for timeline in timelines {
            loop {
                let step = self
                    .write(|tx| {
                        let (id, t) = (id.clone(), timeline.clone());
                        Box::pin(async move { timeline_batch(tx, &id, &t).await })
                    })
                    .await?;
                match step {
                    TimelineStep::More(n) => report.messages += n,
                    TimelineStep::Emptied { messages, removed } => {
                        report.messages += messages;
                        report.timelines += u64::from(removed);
                        break;
                    }
                    TimelineStep::Shared => {
                        report.dialogs_kept_for_forks = 1;
                        return Ok(report);
                    }
                }
            }
        }
        let (removed, timelines) = self
            .write(|tx| {
                let id = id.clone();
                Box::pin(async move { remove_session_row(tx, &id).await })
            })
            .await?;
        if removed {
            report.dialogs = 1;
            report.timelines += timelines;
        } else {
            report.dialogs_kept_for_forks = 1;
        }
        Ok(report)
    }

    pub(crate) async fn sweep_state_blobs(&self) -> Result<u64> {
        self.write(|tx| Box::pin(async move { sweep_blobs(tx).await }))
            .await
    }

    pub(crate) async fn dialog_usage(&self, session_id: SessionId) -> Result<DialogUsage> {
        let id = session_id.to_string();
        self.read(move |tx| {
            let id = id.clone();
            Box::pin(async move {
                let row = tx.query_one(USAGE_SQL, &[&id]).await.map_err(from_pg)?;
                Ok(DialogUsage {
                    stored_bytes: u64::try_from(row.get::<_, i64>(0)).unwrap_or(0),
                    checkpoints: u64::try_from(row.get::<_, i64>(1)).unwrap_or(0),
                })
            })
        })
        .await
    }
}

/// Bytes of the values in the dialog's own rows (as stored: PostgreSQL's
/// `octet_length` of a TOAST-compressed value is its uncompressed length)
/// and its checkpoint count.
const USAGE_SQL: &str = "SELECT (\
  (SELECT coalesce(sum(octet_length(timeline_id) + octet_length(session_id) \
      + octet_length(slot) + octet_length(role) + octet_length(content) \
      + coalesce(octet_length(tool_call_id), 0) + coalesce(octet_length(tool_name), 0) \
      + octet_length(client_visibility) + octet_length(turn_origin) \
      + coalesce(octet_length(input_state), 0)), 0) \
   FROM messages WHERE timeline_id IN (SELECT id FROM timelines WHERE session_id = $1)) \
 + (SELECT coalesce(sum(octet_length(hash) + octet_length(bytes)), 0) FROM state_blobs \
    WHERE hash IN (SELECT state_hash FROM checkpoints WHERE session_id = $1 \
                   UNION SELECT state_hash FROM sessions WHERE id = $1)) \
 + (SELECT coalesce(sum(octet_length(id) + octet_length(session_id) \
      + octet_length(timeline_id) + coalesce(octet_length(parent_checkpoint_id), 0) \
      + octet_length(state_hash) + octet_length(source)), 0) \
    FROM checkpoints WHERE session_id = $1) \
 + (SELECT coalesce(sum(octet_length(task) + coalesce(octet_length(context_json), 0) \
      + coalesce(octet_length(result), 0) + coalesce(octet_length(error), 0)), 0) \
    FROM agent_runs WHERE root_session_id = $1) \
 + (SELECT coalesce(sum(octet_length(payload_json)), 0) FROM agent_inbox_events \
    WHERE root_session_id = $1))::bigint, \
  (SELECT count(*) FROM checkpoints WHERE session_id = $1)";
