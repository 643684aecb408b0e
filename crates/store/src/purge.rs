//! Purging soft-deleted dialogs for good, and what a dialog occupies.
//!
//! A purge removes a deleted session's rows in bounded batches, each its own
//! transaction, in an order that keeps every intermediate state consistent
//! for the checker: queued inputs left by older builds; runs leaf first, each with its inbox
//! events (so an interrupted run never loses the completion it owes), then
//! the groups left without runs, the counters recomputed in the same
//! transaction; checkpoints; messages newest seq first, timeline by timeline,
//! children before parents (a history is always a contiguous prefix and no
//! branch ever forks past its parent's end); last the session row with its
//! head timeline. Timelines another dialog's history branches from (a fork)
//! are kept with the session row until that dialog is purged too.

use keel_core::SessionId;
use rusqlite::{params, Connection, OptionalExtension};

use crate::counters::recount_tx;
use crate::error::{Result, StoreError};
use crate::util::parse;
use crate::SqliteStore;

/// Runs (with their inbox events) and checkpoints removed per transaction.
const ROW_BATCH: i64 = 256;
/// Messages removed per transaction.
const MESSAGE_BATCH: i64 = 5_000;

/// What purging deleted dialogs removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Dialogs removed for good (their session row included).
    pub dialogs: u64,
    /// Dialogs whose history another dialog was forked from: everything but
    /// the shared timelines and the session row was removed.
    pub dialogs_kept_for_forks: u64,
    /// Message rows removed.
    pub messages: u64,
    /// Checkpoint rows removed.
    pub checkpoints: u64,
    /// Timeline rows removed.
    pub timelines: u64,
    /// Sub-agent runs removed.
    pub runs: u64,
    /// Inbox events (completions, signals) removed.
    pub events: u64,
    /// State blobs nothing referenced any more, removed.
    pub blobs: u64,
}

impl PurgeReport {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &PurgeReport) {
        self.dialogs += other.dialogs;
        self.dialogs_kept_for_forks += other.dialogs_kept_for_forks;
        self.messages += other.messages;
        self.checkpoints += other.checkpoints;
        self.timelines += other.timelines;
        self.runs += other.runs;
        self.events += other.events;
        self.blobs += other.blobs;
    }
}

/// What one dialog occupies in the database.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DialogUsage {
    /// Bytes of the values stored in the dialog's own rows (see [`Backend::dialog_usage`](crate::Backend::dialog_usage)).
    pub stored_bytes: u64,
    /// Its checkpoints.
    pub checkpoints: u64,
}

/// Refuses to touch a session that is missing or not deleted.
fn require_deleted(conn: &Connection, id: &str) -> Result<()> {
    let deleted: Option<Option<i64>> = conn
        .prepare_cached("SELECT deleted_at FROM sessions WHERE id = ?1")?
        .query_row([id], |r| r.get(0))
        .optional()?;
    match deleted {
        None => Err(StoreError::NotFound(format!("session {id}"))),
        Some(None) => Err(StoreError::InvalidInput(format!(
            "session {id} is not deleted; only a deleted dialog is purged"
        ))),
        Some(Some(_)) => Ok(()),
    }
}

/// One batch of leaf runs (no run left below them) with their run-scoped
/// events, then the groups no run is left in with theirs; the session's
/// counters recomputed. Returns (runs, events) removed.
fn runs_batch(conn: &Connection, id: &str) -> Result<(u64, u64)> {
    require_deleted(conn, id)?;
    let leaves = "SELECT r.id FROM agent_runs r WHERE r.root_session_id = ?1 \
         AND NOT EXISTS (SELECT 1 FROM agent_runs c WHERE c.parent_run_id = r.id) LIMIT ?2";
    let mut events = conn.execute(
        &format!(
            "DELETE FROM agent_inbox_events WHERE scope_kind = 'run' AND scope_id IN ({leaves})"
        ),
        params![id, ROW_BATCH],
    )? as u64;
    let runs = conn.execute(
        &format!("DELETE FROM agent_runs WHERE id IN ({leaves})"),
        params![id, ROW_BATCH],
    )? as u64;
    let empty_groups = "SELECT g.id FROM agent_run_groups g WHERE g.root_session_id = ?1 \
         AND NOT EXISTS (SELECT 1 FROM agent_runs r WHERE r.group_id = g.id)";
    events += conn.execute(
        &format!(
            "DELETE FROM agent_inbox_events WHERE scope_kind = 'group' \
             AND scope_id IN ({empty_groups})"
        ),
        [id],
    )? as u64;
    conn.execute(
        &format!("DELETE FROM agent_run_groups WHERE id IN ({empty_groups})"),
        [id],
    )?;
    let left: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM agent_runs WHERE root_session_id = ?1) \
             OR EXISTS (SELECT 1 FROM agent_run_groups WHERE root_session_id = ?1) \
             OR EXISTS (SELECT 1 FROM agent_inbox_events WHERE root_session_id = ?1)",
        [id],
        |r| r.get(0),
    )?;
    if left {
        let (pending, reserved) = recount_tx(conn, id)?;
        conn.execute(
            "UPDATE agent_session_state SET pending_event_count = ?2, \
             reserved_completion_slots = ?3 WHERE root_session_id = ?1",
            params![id, pending, reserved],
        )?;
    } else {
        conn.execute(
            "DELETE FROM agent_session_state WHERE root_session_id = ?1",
            [id],
        )?;
    }
    Ok((runs, events))
}

/// The session's timelines, newest first (a branch is newer than its parent).
fn timelines_newest_first(conn: &Connection, id: &str) -> Result<Vec<String>> {
    let mut stmt = conn.prepare(
        "SELECT id FROM timelines WHERE session_id = ?1 ORDER BY created_at DESC, rowid DESC",
    )?;
    let rows = stmt.query_map([id], |r| r.get::<_, String>(0))?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}

/// Whether a timeline of another session branches from one of `id`'s.
fn shared_with_forks(conn: &Connection, id: &str) -> Result<bool> {
    Ok(conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM timelines p JOIN timelines c ON c.parent_timeline_id = p.id \
         WHERE p.session_id = ?1 AND c.session_id <> ?1)",
        [id],
        |r| r.get(0),
    )?)
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
fn timeline_batch(conn: &Connection, id: &str, timeline: &str) -> Result<TimelineStep> {
    require_deleted(conn, id)?;
    let branched: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM timelines WHERE parent_timeline_id = ?1)",
        [timeline],
        |r| r.get(0),
    )?;
    if branched {
        return Ok(TimelineStep::Shared);
    }
    let messages = conn.execute(
        "DELETE FROM messages WHERE rowid IN (SELECT rowid FROM messages \
         WHERE timeline_id = ?1 ORDER BY seq DESC LIMIT ?2)",
        params![timeline, MESSAGE_BATCH],
    )? as u64;
    if messages == MESSAGE_BATCH as u64 {
        return Ok(TimelineStep::More(messages));
    }
    let removed = conn.execute(
        "DELETE FROM timelines WHERE id = ?1 AND NOT EXISTS \
         (SELECT 1 FROM sessions WHERE head_timeline_id = ?1)",
        [timeline],
    )? == 1;
    if !removed {
        // The head stays until the session row goes; empty, it branches from nothing.
        conn.execute(
            "UPDATE timelines SET parent_timeline_id = NULL, fork_seq = NULL WHERE id = ?1",
            [timeline],
        )?;
    }
    Ok(TimelineStep::Emptied { messages, removed })
}

/// Removes the emptied session: its head timeline and its row. Refused
/// (returns false) while any of its timelines still holds messages or is
/// shared, or any checkpoint, run or event of it remains.
fn remove_session_row(conn: &Connection, id: &str) -> Result<(bool, u64)> {
    require_deleted(conn, id)?;
    let busy: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM messages WHERE timeline_id IN \
                        (SELECT id FROM timelines WHERE session_id = ?1)) \
             OR EXISTS (SELECT 1 FROM timelines p JOIN timelines c \
                        ON c.parent_timeline_id = p.id WHERE p.session_id = ?1) \
             OR EXISTS (SELECT 1 FROM checkpoints WHERE session_id = ?1) \
             OR EXISTS (SELECT 1 FROM agent_runs WHERE root_session_id = ?1) \
             OR EXISTS (SELECT 1 FROM queued_inputs WHERE session_id = ?1) \
             OR EXISTS (SELECT 1 FROM webhook_subscriptions WHERE session_id = ?1) \
             OR EXISTS (SELECT 1 FROM tool_approvals WHERE session_id = ?1)",
        [id],
        |r| r.get(0),
    )?;
    if busy {
        return Ok((false, 0));
    }
    conn.execute(
        "UPDATE sessions SET head_timeline_id = NULL WHERE id = ?1",
        [id],
    )?;
    let timelines = conn.execute("DELETE FROM timelines WHERE session_id = ?1", [id])? as u64;
    conn.execute("DELETE FROM sessions WHERE id = ?1", [id])?;
    Ok((true, timelines))
}

impl SqliteStore {
    pub(crate) async fn deleted_sessions_before(
        &self,
        deleted_before_ms: i64,
    ) -> Result<Vec<SessionId>> {
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(
                    "SELECT id FROM sessions WHERE deleted_at IS NOT NULL AND deleted_at <= ?1 \
                     ORDER BY created_at DESC, rowid DESC",
                )?;
                let rows = stmt.query_map([deleted_before_ms], |r| r.get::<_, String>(0))?;
                let mut out = Vec::new();
                for id in rows {
                    out.push(parse("sessions.id", &id?)?);
                }
                Ok(out)
            })
            .await
    }

    pub(crate) async fn purge_session(&self, session_id: SessionId) -> Result<PurgeReport> {
        let id = session_id.to_string();
        let mut report = PurgeReport::default();
        let key = id.clone();
        // Deleting a dialog withdraws its queued inputs; older builds left
        // them. Its tool approvals (and the grants they made) go with it,
        // with what a run waiting for one had done.
        self.db
            .write(move |c| {
                require_deleted(c, &key)?;
                c.execute("DELETE FROM queued_inputs WHERE session_id = ?1", [&key])?;
                c.execute(
                    "DELETE FROM webhook_subscriptions WHERE session_id = ?1",
                    [&key],
                )?;
                c.execute(
                    "DELETE FROM tool_approval_grants WHERE session_id = ?1",
                    [&key],
                )?;
                c.execute("DELETE FROM tool_approvals WHERE session_id = ?1", [&key])?;
                c.execute("DELETE FROM agent_run_pauses WHERE session_id = ?1", [&key])?;
                Ok(())
            })
            .await?;
        // Its turns' and runs' call spans, in bounded batches.
        loop {
            let key = id.clone();
            let n = self
                .db
                .write(move |c| {
                    require_deleted(c, &key)?;
                    Ok(c.execute(
                        "DELETE FROM call_spans WHERE rowid IN \
                         (SELECT rowid FROM call_spans WHERE session_id = ?1 LIMIT ?2)",
                        params![key, ROW_BATCH],
                    )? as u64)
                })
                .await?;
            if n == 0 {
                break;
            }
        }
        loop {
            let key = id.clone();
            let (runs, events) = self.db.write(move |c| runs_batch(c, &key)).await?;
            report.runs += runs;
            report.events += events;
            if runs == 0 {
                break;
            }
        }
        loop {
            let key = id.clone();
            let n = self
                .db
                .write(move |c| {
                    require_deleted(c, &key)?;
                    Ok(c.execute(
                        "DELETE FROM checkpoints WHERE rowid IN \
                         (SELECT rowid FROM checkpoints WHERE session_id = ?1 LIMIT ?2)",
                        params![key, ROW_BATCH],
                    )? as u64)
                })
                .await?;
            report.checkpoints += n;
            if n < ROW_BATCH as u64 {
                break;
            }
        }
        let key = id.clone();
        let (shared, timelines) = self
            .db
            .read(move |c| {
                Ok((
                    shared_with_forks(c, &key)?,
                    timelines_newest_first(c, &key)?,
                ))
            })
            .await?;
        if shared {
            report.dialogs_kept_for_forks = 1;
            return Ok(report);
        }
        for timeline in timelines {
            loop {
                let (key, t) = (id.clone(), timeline.clone());
                match self.db.write(move |c| timeline_batch(c, &key, &t)).await? {
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
        let key = id.clone();
        let (removed, timelines) = self.db.write(move |c| remove_session_row(c, &key)).await?;
        if removed {
            report.dialogs = 1;
            report.timelines += timelines;
        } else {
            report.dialogs_kept_for_forks = 1;
        }
        Ok(report)
    }

    pub(crate) async fn sweep_state_blobs(&self) -> Result<u64> {
        self.db.write(crate::checkpoints::sweep_blobs).await
    }

    pub(crate) async fn dialog_usage(&self, session_id: SessionId) -> Result<DialogUsage> {
        let id = session_id.to_string();
        self.db
            .read(move |c| {
                let (bytes, checkpoints): (i64, i64) = c
                    .prepare_cached(USAGE_SQL)?
                    .query_row([&id], |r| Ok((r.get(0)?, r.get(1)?)))?;
                Ok(DialogUsage {
                    stored_bytes: u64::try_from(bytes).unwrap_or(0),
                    checkpoints: u64::try_from(checkpoints).unwrap_or(0),
                })
            })
            .await
    }
}

const USAGE_SQL: &str = "SELECT \
  (SELECT coalesce(sum(octet_length(timeline_id) + octet_length(session_id) \
      + octet_length(slot) + octet_length(role) + octet_length(content) \
      + coalesce(octet_length(tool_call_id), 0) + coalesce(octet_length(tool_name), 0) \
      + octet_length(client_visibility) + octet_length(turn_origin) \
      + coalesce(octet_length(input_state), 0)), 0) \
   FROM messages WHERE timeline_id IN (SELECT id FROM timelines WHERE session_id = ?1)) \
 + (SELECT coalesce(sum(octet_length(hash) + octet_length(bytes)), 0) FROM state_blobs \
    WHERE hash IN (SELECT state_hash FROM checkpoints WHERE session_id = ?1 \
                   UNION SELECT state_hash FROM sessions WHERE id = ?1)) \
 + (SELECT coalesce(sum(octet_length(id) + octet_length(session_id) \
      + octet_length(timeline_id) + coalesce(octet_length(parent_checkpoint_id), 0) \
      + octet_length(state_hash) + octet_length(source)), 0) \
    FROM checkpoints WHERE session_id = ?1) \
 + (SELECT coalesce(sum(octet_length(task) + coalesce(octet_length(context_json), 0) \
      + coalesce(octet_length(result), 0) + coalesce(octet_length(error), 0)), 0) \
    FROM agent_runs WHERE root_session_id = ?1) \
 + (SELECT coalesce(sum(octet_length(payload_json)), 0) FROM agent_inbox_events \
    WHERE root_session_id = ?1), \
  (SELECT count(*) FROM checkpoints WHERE session_id = ?1)";
