//! Incremental, copy-on-write checkpoints: a checkpoint row records where a
//! timeline's head was plus a content-addressed state blob, so its cost does
//! not depend on history length; rollback and fork add a timeline that points
//! at the old prefix instead of copying it.

use keel_core::{text_enum, CheckpointId, SessionId};
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::error::{Result, StoreError};
use crate::messages::{last_seq, visible_inputs};
use crate::projection::page_fetch;
use crate::sessions::{insert_session_tx, require_session, NewSession, SessionRecord, TimelineId};
use crate::util::{fresh_id, non_negative, parse, parse_opt, sha256_hex, to_i64};
use crate::{Page, SqliteStore};

/// Rows handled per transaction by prune and delete.
const PRUNE_BATCH: usize = 256;
/// Message rows deleted per transaction when an unreachable timeline is dropped.
const MESSAGE_DELETE_BATCH: i64 = 5_000;

text_enum!(
    /// Why a checkpoint was taken.
    CheckpointSource, "checkpoint source" {
        /// Automatically after a committed turn.
        Turn = "turn",
        /// On request.
        Manual = "manual",
        /// By a rollback (its parent is the checkpoint rolled back to).
        Rollback = "rollback",
        /// As the first checkpoint of a forked session (its parent is in the source session).
        Fork = "fork",
    }
);

/// A checkpoint to record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewCheckpoint {
    /// Its id (chosen by the caller, so it can be reported before commit).
    pub id: CheckpointId,
    /// The session's turn index at this point.
    pub turn_index: u64,
    /// Why it is taken (`Turn` or `Manual`; rollback and fork set their own).
    pub source: CheckpointSource,
}

/// Where a checkpoint listing continues: the (created_at, id) of the last item seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointCursor {
    /// `created_at_ms` of the last item of the previous page.
    pub created_at_ms: i64,
    /// `id` of the last item of the previous page.
    pub id: CheckpointId,
}

/// A stored checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRecord {
    /// Its id.
    pub id: CheckpointId,
    /// The session it belongs to.
    pub session_id: SessionId,
    /// The timeline whose prefix it marks.
    pub timeline_id: TimelineId,
    /// The last seq it sees.
    pub seq: i64,
    /// The checkpoint it follows (may be in another session for a fork); None at a root or after pruning.
    pub parent_id: Option<CheckpointId>,
    /// Turn index.
    pub turn_index: u64,
    /// Hash of its state blob.
    pub state_hash: String,
    /// Why it was taken.
    pub source: CheckpointSource,
    /// When (ms).
    pub created_at_ms: i64,
}

/// Which checkpoints [`Backend::prune_checkpoints`](crate::Backend::prune_checkpoints) removes. Only `turn`
/// checkpoints are ever removed, and only when every rule given selects them;
/// manual, rollback and fork checkpoints, the targets of rollbacks and forks
/// and the session's newest checkpoint are always kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrunePolicy {
    /// Keep the newest N turn checkpoints.
    pub keep_latest: Option<usize>,
    /// Remove checkpoints created before this time (ms).
    pub older_than_ms: Option<i64>,
}

/// What a prune or delete removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Checkpoint rows deleted.
    pub checkpoints_deleted: u64,
    /// Timelines no head or checkpoint could reach any more, deleted.
    pub timelines_deleted: u64,
    /// Messages of those timelines, deleted.
    pub messages_deleted: u64,
    /// State blobs nothing referenced any more, deleted.
    pub blobs_deleted: u64,
}

const CHECKPOINT_COLUMNS: &str =
    "id, session_id, timeline_id, seq, parent_checkpoint_id, turn_index, state_hash, source, created_at";

fn checkpoint_from_row(r: &Row<'_>) -> Result<CheckpointRecord> {
    let id: String = r.get(0)?;
    let session: String = r.get(1)?;
    let source: String = r.get(7)?;
    Ok(CheckpointRecord {
        id: parse("checkpoints.id", &id)?,
        session_id: parse("checkpoints.session_id", &session)?,
        timeline_id: TimelineId(r.get(2)?),
        seq: r.get(3)?,
        parent_id: parse_opt("checkpoints.parent_checkpoint_id", r.get(4)?)?,
        turn_index: non_negative("checkpoints.turn_index", r.get(5)?)?,
        state_hash: r.get(6)?,
        source: parse("checkpoints.source", &source)?,
        created_at_ms: r.get(8)?,
    })
}

pub(crate) fn get_checkpoint_tx(
    conn: &Connection,
    id: &CheckpointId,
) -> Result<Option<CheckpointRecord>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE id = ?1"
    ))?;
    let mut rows = stmt.query([id.to_string()])?;
    match rows.next()? {
        Some(r) => Ok(Some(checkpoint_from_row(r)?)),
        None => Ok(None),
    }
}

pub(crate) fn require_checkpoint(conn: &Connection, id: &CheckpointId) -> Result<CheckpointRecord> {
    get_checkpoint_tx(conn, id)?.ok_or_else(|| StoreError::NotFound(format!("checkpoint {id}")))
}

/// Newest checkpoint of a session (insertion order), the parent of the next one.
fn newest_checkpoint(conn: &Connection, session: &SessionId) -> Result<Option<String>> {
    let mut stmt = conn.prepare_cached(
        "SELECT id FROM checkpoints WHERE session_id = ?1 ORDER BY rowid DESC LIMIT 1",
    )?;
    Ok(stmt
        .query_row([session.to_string()], |r| r.get(0))
        .optional()?)
}

/// Deletes every state blob no session and no checkpoint references. A
/// set-based sweep run by prune/delete only, so the turn path needs no index
/// on the (random) state hashes and a checkpoint's write cost stays flat.
pub(crate) fn sweep_blobs(conn: &Connection) -> Result<u64> {
    Ok(conn.execute(
        "DELETE FROM state_blobs WHERE hash NOT IN (SELECT state_hash FROM checkpoints) \
         AND hash NOT IN (SELECT state_hash FROM sessions WHERE state_hash IS NOT NULL)",
        [],
    )? as u64)
}

/// Stores `bytes` as the session's live state: writes the blob only if its
/// hash is new (an unchanged state costs no bytes). Replaced blobs are freed
/// by the next prune or delete of checkpoints.
pub(crate) fn put_state_tx(
    conn: &Connection,
    session: &SessionRecord,
    bytes: &[u8],
) -> Result<String> {
    let hash = sha256_hex(bytes);
    if session.state_hash.as_deref() == Some(hash.as_str()) {
        return Ok(hash);
    }
    let (codec, stored) = crate::compress::pack_bytes(bytes, crate::compress::db_of(conn));
    conn.prepare_cached(
        "INSERT OR IGNORE INTO state_blobs (hash, bytes, codec) VALUES (?1, ?2, ?3)",
    )?
    .execute(params![hash, stored, codec])?;
    conn.prepare_cached("UPDATE sessions SET state_hash = ?1 WHERE id = ?2")?
        .execute(params![hash, session.id.to_string()])?;
    Ok(hash)
}

/// The bytes of the state blob `hash` (decompressed), if it exists.
pub(crate) fn read_state_blob(conn: &Connection, hash: &str) -> Result<Option<Vec<u8>>> {
    let row: Option<(Vec<u8>, i64)> = conn
        .prepare_cached("SELECT bytes, codec FROM state_blobs WHERE hash = ?1")?
        .query_row([hash], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    row.map(|(stored, codec)| {
        crate::compress::unpack_bytes(&format!("state_blobs.bytes ({hash})"), codec, stored)
    })
    .transpose()
}

/// Inserts a checkpoint row; `parent` defaults to the session's newest checkpoint.
#[allow(clippy::too_many_arguments)]
pub(crate) fn insert_checkpoint_tx(
    conn: &Connection,
    session: &SessionId,
    timeline: &TimelineId,
    seq: i64,
    parent: Option<&CheckpointId>,
    cp: &NewCheckpoint,
    state_hash: &str,
    now_ms: i64,
) -> Result<CheckpointRecord> {
    let parent = match parent {
        Some(p) => Some(p.to_string()),
        None => newest_checkpoint(conn, session)?,
    };
    conn.prepare_cached(
        "INSERT INTO checkpoints (id, session_id, timeline_id, seq, parent_checkpoint_id, \
         turn_index, state_hash, source, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?
    .execute(params![
        cp.id.to_string(),
        session.to_string(),
        timeline.as_str(),
        seq,
        parent,
        to_i64("turn_index", cp.turn_index)?,
        state_hash,
        cp.source.as_str(),
        now_ms
    ])?;
    Ok(CheckpointRecord {
        id: cp.id,
        session_id: *session,
        timeline_id: timeline.clone(),
        seq,
        parent_id: parse_opt("checkpoints.parent_checkpoint_id", parent)?,
        turn_index: cp.turn_index,
        state_hash: state_hash.to_owned(),
        source: cp.source,
        created_at_ms: now_ms,
    })
}

/// Adds a timeline of `session` branching from `cp`'s point in history.
fn branch_timeline(
    conn: &Connection,
    session: &SessionId,
    cp: &CheckpointRecord,
    now_ms: i64,
) -> Result<TimelineId> {
    let id = fresh_id();
    conn.execute(
        "INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![
            id,
            session.to_string(),
            cp.timeline_id.as_str(),
            cp.seq,
            now_ms
        ],
    )?;
    Ok(TimelineId(id))
}

fn rollback_tx(
    conn: &Connection,
    session_id: &SessionId,
    target_id: &CheckpointId,
    new_id: &CheckpointId,
    now_ms: i64,
) -> Result<CheckpointRecord> {
    require_session(conn, session_id)?;
    let target = require_checkpoint(conn, target_id)?;
    if target.session_id != *session_id {
        return Err(StoreError::InvalidInput(format!(
            "checkpoint {target_id} belongs to session {}, not {session_id}",
            target.session_id
        )));
    }
    let timeline = branch_timeline(conn, session_id, &target, now_ms)?;
    // The history is the checkpoint's again, and so is its count of inputs.
    let message_count = visible_inputs(conn, target.timeline_id.as_str(), target.seq)?;
    conn.execute(
        "UPDATE sessions SET head_timeline_id = ?1, state_hash = ?2, \
         last_active_at = max(last_active_at, ?3), message_count = ?5 WHERE id = ?4",
        params![
            timeline.as_str(),
            target.state_hash,
            now_ms,
            session_id.to_string(),
            message_count
        ],
    )?;
    let cp = NewCheckpoint {
        id: *new_id,
        turn_index: target.turn_index,
        source: CheckpointSource::Rollback,
    };
    let record = insert_checkpoint_tx(
        conn,
        session_id,
        &timeline,
        target.seq,
        Some(target_id),
        &cp,
        &target.state_hash,
        now_ms,
    )?;
    Ok(record)
}

fn fork_tx(
    conn: &Connection,
    source_id: &CheckpointId,
    session: &NewSession,
    new_id: &CheckpointId,
) -> Result<(SessionRecord, CheckpointRecord)> {
    let source = require_checkpoint(conn, source_id)?;
    let created = insert_session_tx(
        conn,
        session,
        Some((source.timeline_id.as_str(), source.seq)),
        Some(&source.state_hash),
    )?;
    let cp = NewCheckpoint {
        id: *new_id,
        turn_index: source.turn_index,
        source: CheckpointSource::Fork,
    };
    let record = insert_checkpoint_tx(
        conn,
        &created.id,
        &created.head_timeline_id,
        source.seq,
        Some(source_id),
        &cp,
        &source.state_hash,
        session.now_ms,
    )?;
    Ok((created, record))
}

pub(crate) fn list_tx(conn: &Connection, session: &SessionId) -> Result<Vec<CheckpointRecord>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE session_id = ?1 ORDER BY rowid DESC"
    ))?;
    let mut rows = stmt.query([session.to_string()])?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(checkpoint_from_row(r)?);
    }
    Ok(out)
}

/// Deletes up to one batch of the session's checkpoints selected by `select`
/// (ids), re-parenting their children so the listed tree stays connected.
fn delete_checkpoint_batch(conn: &Connection, ids: &[String]) -> Result<u64> {
    let mut deleted = 0;
    for id in ids {
        let row: Option<Option<String>> = conn
            .query_row(
                "SELECT parent_checkpoint_id FROM checkpoints WHERE id = ?1",
                [id],
                |r| r.get(0),
            )
            .optional()?;
        let Some(parent) = row else { continue };
        conn.execute(
            "UPDATE checkpoints SET parent_checkpoint_id = ?1 WHERE parent_checkpoint_id = ?2",
            params![parent, id],
        )?;
        deleted += conn.execute("DELETE FROM checkpoints WHERE id = ?1", [id])? as u64;
    }
    Ok(deleted)
}

/// Timelines of `session` that no session head or checkpoint reaches.
fn unreachable_timelines(conn: &Connection, session: &SessionId) -> Result<Vec<String>> {
    let mut stmt = conn.prepare(
        "WITH RECURSIVE needed(id) AS ( \
           SELECT head_timeline_id FROM sessions WHERE head_timeline_id IS NOT NULL \
           UNION SELECT timeline_id FROM checkpoints \
           UNION SELECT t.parent_timeline_id FROM timelines t JOIN needed n ON t.id = n.id \
                 WHERE t.parent_timeline_id IS NOT NULL \
         ) \
         SELECT id FROM timelines WHERE session_id = ?1 AND id NOT IN (SELECT id FROM needed)",
    )?;
    let rows = stmt.query_map([session.to_string()], |r| r.get::<_, String>(0))?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}

impl SqliteStore {
    pub(crate) async fn create_checkpoint(
        &self,
        session_id: SessionId,
        checkpoint: NewCheckpoint,
        state: Vec<u8>,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        self.db
            .write(move |c| {
                let session = require_session(c, &session_id)?;
                let hash = put_state_tx(c, &session, &state)?;
                let seq = last_seq(c, session.head_timeline_id.as_str())?;
                insert_checkpoint_tx(
                    c,
                    &session_id,
                    &session.head_timeline_id,
                    seq,
                    None,
                    &checkpoint,
                    &hash,
                    now_ms,
                )
            })
            .await
    }

    pub(crate) async fn rollback(
        &self,
        session_id: SessionId,
        checkpoint_id: CheckpointId,
        new_checkpoint_id: CheckpointId,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        self.db
            .write(move |c| rollback_tx(c, &session_id, &checkpoint_id, &new_checkpoint_id, now_ms))
            .await
    }

    pub(crate) async fn fork(
        &self,
        checkpoint_id: CheckpointId,
        session: NewSession,
        new_checkpoint_id: CheckpointId,
    ) -> Result<(SessionRecord, CheckpointRecord)> {
        self.db
            .write(move |c| fork_tx(c, &checkpoint_id, &session, &new_checkpoint_id))
            .await
    }

    pub(crate) async fn list_checkpoints(
        &self,
        session_id: SessionId,
    ) -> Result<Vec<CheckpointRecord>> {
        self.db.read(move |c| list_tx(c, &session_id)).await
    }

    pub(crate) async fn checkpoint_page(
        &self,
        session_id: SessionId,
        cursor: Option<CheckpointCursor>,
        limit: usize,
    ) -> Result<Page<CheckpointRecord, CheckpointCursor>> {
        let fetch = page_fetch(limit)?;
        self.db
            .read(move |c| {
                let (at, id) = match &cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MAX, String::new()),
                };
                let mut stmt = c.prepare_cached(&format!(
                    "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE session_id = ?1 \
                     AND (?2 OR (created_at, id) < (?3, ?4)) \
                     ORDER BY created_at DESC, id DESC LIMIT ?5"
                ))?;
                let mut rows = stmt.query(params![
                    session_id.to_string(),
                    cursor.is_none(),
                    at,
                    id,
                    fetch
                ])?;
                let mut items = Vec::new();
                while let Some(r) = rows.next()? {
                    items.push(checkpoint_from_row(r)?);
                }
                let next_cursor = if items.len() > limit {
                    items.truncate(limit);
                    items.last().map(|c| CheckpointCursor {
                        created_at_ms: c.created_at_ms,
                        id: c.id,
                    })
                } else {
                    None
                };
                Ok(Page { items, next_cursor })
            })
            .await
    }

    pub(crate) async fn latest_checkpoint(
        &self,
        session_id: SessionId,
    ) -> Result<Option<CheckpointRecord>> {
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(&format!(
                    "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE session_id = ?1 \
                     ORDER BY rowid DESC LIMIT 1"
                ))?;
                let mut rows = stmt.query([session_id.to_string()])?;
                match rows.next()? {
                    Some(r) => Ok(Some(checkpoint_from_row(r)?)),
                    None => Ok(None),
                }
            })
            .await
    }

    pub(crate) async fn get_checkpoint(
        &self,
        id: CheckpointId,
    ) -> Result<Option<CheckpointRecord>> {
        self.db.read(move |c| get_checkpoint_tx(c, &id)).await
    }

    pub(crate) async fn get_state_blob(&self, hash: String) -> Result<Option<Vec<u8>>> {
        self.db.read(move |c| read_state_blob(c, &hash)).await
    }

    pub(crate) async fn sessions_over_turn_checkpoints(
        &self,
        keep: usize,
    ) -> Result<Vec<SessionId>> {
        let keep = i64::try_from(keep).unwrap_or(i64::MAX);
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(
                    "SELECT session_id FROM checkpoints WHERE source = 'turn' \
                     GROUP BY session_id HAVING count(*) > ?1",
                )?;
                let rows = stmt.query_map([keep], |r| r.get::<_, String>(0))?;
                let mut out = Vec::new();
                for id in rows {
                    out.push(parse("checkpoints.session_id", &id?)?);
                }
                Ok(out)
            })
            .await
    }

    pub(crate) async fn reclaim_pages(&self, max_pages: u32) -> Result<u64> {
        self.db
            .write(move |c| {
                let free = |c: &Connection| -> Result<i64> {
                    Ok(c.query_row("PRAGMA freelist_count", [], |r| r.get(0))?)
                };
                let before = free(c)?;
                // Each step of the pragma frees one page: run it to the end.
                let mut stmt = c.prepare(&format!("PRAGMA incremental_vacuum({max_pages})"))?;
                let mut steps = stmt.query([])?;
                while steps.next()?.is_some() {}
                Ok(u64::try_from(before - free(c)?).unwrap_or(0))
            })
            .await
    }

    pub(crate) async fn delete_checkpoints(&self, session_id: SessionId) -> Result<PruneReport> {
        self.prune_where(session_id, None).await
    }

    pub(crate) async fn prune_checkpoints(
        &self,
        session_id: SessionId,
        policy: PrunePolicy,
    ) -> Result<PruneReport> {
        self.prune_where(session_id, Some(policy)).await
    }

    async fn prune_where(
        &self,
        session_id: SessionId,
        policy: Option<PrunePolicy>,
    ) -> Result<PruneReport> {
        let mut report = PruneReport::default();
        loop {
            let deleted = self
                .db
                .write(move |c| {
                    require_session(c, &session_id)?;
                    let ids = select_prunable(c, &session_id, policy)?;
                    delete_checkpoint_batch(c, &ids)
                })
                .await?;
            report.checkpoints_deleted += deleted;
            if deleted < PRUNE_BATCH as u64 {
                break;
            }
        }
        report.blobs_deleted = self.db.write(sweep_blobs).await?;
        let timelines = self
            .db
            .read(move |c| unreachable_timelines(c, &session_id))
            .await?;
        for timeline in timelines {
            loop {
                let t = timeline.clone();
                let n = self
                    .db
                    .write(move |c| {
                        Ok(c.execute(
                            "DELETE FROM messages WHERE rowid IN \
                             (SELECT rowid FROM messages WHERE timeline_id = ?1 LIMIT ?2)",
                            params![t, MESSAGE_DELETE_BATCH],
                        )? as u64)
                    })
                    .await?;
                report.messages_deleted += n;
                if n < MESSAGE_DELETE_BATCH as u64 {
                    break;
                }
            }
        }
        // Re-check reachability inside the deleting transaction: a fork may have
        // started from one of these timelines meanwhile.
        report.timelines_deleted += self
            .db
            .write(move |c| {
                let ids = unreachable_timelines(c, &session_id)?;
                let mut n = 0u64;
                for id in &ids {
                    let has_messages: bool = c.query_row(
                        "SELECT EXISTS (SELECT 1 FROM messages WHERE timeline_id = ?1)",
                        [id],
                        |r| r.get(0),
                    )?;
                    if has_messages {
                        continue;
                    }
                    c.execute(
                        "UPDATE timelines SET parent_timeline_id = NULL, fork_seq = NULL \
                         WHERE parent_timeline_id = ?1",
                        [id],
                    )?;
                    n += c.execute("DELETE FROM timelines WHERE id = ?1", [id])? as u64;
                }
                Ok(n)
            })
            .await?;
        // Tails of surviving timelines that only abandoned, pruned checkpoints saw.
        let timelines = self
            .db
            .read(move |c| {
                let mut stmt = c.prepare("SELECT id FROM timelines WHERE session_id = ?1")?;
                let rows = stmt.query_map([session_id.to_string()], |r| r.get::<_, String>(0))?;
                Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
            })
            .await?;
        for timeline in timelines {
            loop {
                let t = timeline.clone();
                let n = self
                    .db
                    .write(move |c| {
                        let Some(upto) = needed_upto(c, &t)? else {
                            return Ok(0);
                        };
                        Ok(c.execute(
                            "DELETE FROM messages WHERE rowid IN (SELECT rowid FROM messages \
                             WHERE timeline_id = ?1 AND seq > ?2 LIMIT ?3)",
                            params![t, upto, MESSAGE_DELETE_BATCH],
                        )? as u64)
                    })
                    .await?;
                report.messages_deleted += n;
                if n < MESSAGE_DELETE_BATCH as u64 {
                    break;
                }
            }
        }
        Ok(report)
    }
}

/// The last seq of `timeline` anything still reaches (a checkpoint on it or a
/// timeline branching from it); `None` when a session head is on it (all of it is live).
fn needed_upto(conn: &Connection, timeline: &str) -> Result<Option<i64>> {
    Ok(conn.query_row(
        "SELECT CASE WHEN EXISTS (SELECT 1 FROM sessions WHERE head_timeline_id = ?1) THEN NULL \
         ELSE max(coalesce((SELECT max(seq) FROM checkpoints WHERE timeline_id = ?1), 0), \
                  coalesce((SELECT max(fork_seq) FROM timelines WHERE parent_timeline_id = ?1), 0)) \
         END",
        [timeline],
        |r| r.get(0),
    )?)
}

/// Ids of up to one batch of the session's checkpoints to delete: all of them
/// without a policy; with one, only `turn` checkpoints beyond the newest
/// `keep_latest` turn checkpoints that the rules select and nothing needs
/// (not the session's newest, not the target of a rollback or fork).
fn select_prunable(
    conn: &Connection,
    session: &SessionId,
    policy: Option<PrunePolicy>,
) -> Result<Vec<String>> {
    let sql = match policy {
        None => "SELECT id FROM checkpoints WHERE session_id = ?1 LIMIT ?2",
        Some(_) => {
            "SELECT id FROM (SELECT id, created_at, rowid AS r FROM checkpoints \
               WHERE session_id = ?1 AND source = 'turn' ORDER BY rowid DESC LIMIT -1 OFFSET ?3) c \
             WHERE c.created_at < ?4 \
               AND c.r < (SELECT max(rowid) FROM checkpoints WHERE session_id = ?1) \
               AND NOT EXISTS (SELECT 1 FROM checkpoints k WHERE k.parent_checkpoint_id = c.id \
                               AND k.source IN ('rollback', 'fork')) \
             ORDER BY c.r DESC LIMIT ?2"
        }
    };
    let (skip, older_than) = policy.map_or((0, i64::MAX), |p| {
        (
            i64::try_from(p.keep_latest.unwrap_or(0)).unwrap_or(i64::MAX),
            p.older_than_ms.unwrap_or(i64::MAX),
        )
    });
    let mut stmt = conn.prepare_cached(sql)?;
    let params = params![session.to_string(), PRUNE_BATCH as i64, skip, older_than];
    let id = |r: &Row<'_>| r.get::<_, String>(0);
    let rows = match policy {
        None => stmt.query_map(&params[..2], id)?,
        Some(_) => stmt.query_map(params, id)?,
    };
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}
