//! Incremental, copy-on-write checkpoints on PostgreSQL (keel-store's
//! `checkpoints.rs`, the same transactions): a checkpoint row records where
//! a timeline's head was plus a content-addressed state blob; rollback and
//! fork add a timeline that points at the old prefix. Listings follow
//! insertion order, `row_order` (SQLite's rowid). Prune and delete work in
//! bounded batches, each its own transaction, as on SQLite (see its crate
//! doc for why an interrupted prune is safe).

use keel_core::{CheckpointId, SessionId};
use keel_store::{
    CheckpointCursor, CheckpointRecord, CheckpointSource, NewCheckpoint, NewSession, Page,
    PrunePolicy, PruneReport, Result, SessionRecord, StoreError, TimelineId,
};
use tokio_postgres::Row;

use crate::store::Tx;

use crate::messages::{last_seq, visible_inputs};
use crate::sessions::{insert_session_tx, lock_session};
use crate::store::from_pg;
use crate::util::{fresh_id, non_negative, page_fetch, parse, parse_opt, sha256_hex, to_i64};
use crate::PgStore;

/// Which messages of a timeline a prune deletes.
#[derive(Debug, Clone, Copy)]
enum Messages {
    /// All of them: nothing reaches the timeline any more.
    All,
    /// Those past the last seq anything still reaches on it.
    Unneeded,
}

/// Rows handled per transaction by prune and delete.
const PRUNE_BATCH: i64 = 256;
/// Message rows deleted per transaction when an unreachable timeline is dropped.
const MESSAGE_DELETE_BATCH: i64 = 5_000;

const CHECKPOINT_COLUMNS: &str = "id, session_id, timeline_id, seq, parent_checkpoint_id, \
                                  turn_index, state_hash, source, created_at";

fn checkpoint_from_row(r: &Row) -> Result<CheckpointRecord> {
    let id: String = r.get(0);
    let session: String = r.get(1);
    let source: String = r.get(7);
    Ok(CheckpointRecord {
        id: parse("checkpoints.id", &id)?,
        session_id: parse("checkpoints.session_id", &session)?,
        timeline_id: TimelineId(r.get(2)),
        seq: r.get(3),
        parent_id: parse_opt("checkpoints.parent_checkpoint_id", r.get(4))?,
        turn_index: non_negative("checkpoints.turn_index", r.get(5))?,
        state_hash: r.get(6),
        source: parse("checkpoints.source", &source)?,
        created_at_ms: r.get(8),
    })
}

pub(crate) async fn get_checkpoint_tx(
    tx: &Tx<'_>,
    id: &CheckpointId,
) -> Result<Option<CheckpointRecord>> {
    tx.query_opt(
        &format!("SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE id = $1"),
        &[&id.to_string()],
    )
    .await
    .map_err(from_pg)?
    .as_ref()
    .map(checkpoint_from_row)
    .transpose()
}

pub(crate) async fn require_checkpoint(tx: &Tx<'_>, id: &CheckpointId) -> Result<CheckpointRecord> {
    get_checkpoint_tx(tx, id)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("checkpoint {id}")))
}

/// Deletes every state blob no session and no checkpoint references (run
/// by prune/delete only, so the turn path needs no index on state hashes).
pub(crate) async fn sweep_blobs(tx: &Tx<'_>) -> Result<u64> {
    tx.execute(
        "DELETE FROM state_blobs b WHERE NOT EXISTS \
           (SELECT 1 FROM checkpoints c WHERE c.state_hash = b.hash) \
         AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.state_hash = b.hash)",
        &[],
    )
    .await
    .map_err(from_pg)
}

/// Stores `bytes` as the session's live state: the blob is written only if
/// its hash is new (an unchanged state costs no bytes).
pub(crate) async fn put_state_tx(
    tx: &Tx<'_>,
    session: &SessionRecord,
    bytes: &[u8],
) -> Result<String> {
    let hash = sha256_hex(bytes);
    if session.state_hash.as_deref() == Some(hash.as_str()) {
        return Ok(hash);
    }
    keep_blob_tx(tx, &hash, bytes).await?;
    tx.execute(
        "UPDATE sessions SET state_hash = $1 WHERE id = $2",
        &[&hash, &session.id.to_string()],
    )
    .await
    .map_err(from_pg)?;
    Ok(hash)
}

/// The CTEs `kept` and `put` that keep state blob `$hash` (its bytes
/// `$bytes`): a present row share-locked, a missing one inserted; it is
/// kept when [`BLOB_KEPT`] holds.
macro_rules! keep_blob_ctes {
    ($hash:literal, $bytes:literal) => {
        concat!(
            "kept AS (SELECT 1 FROM state_blobs WHERE hash = ",
            $hash,
            " FOR KEY SHARE), put AS (INSERT INTO state_blobs (hash, bytes, codec) SELECT ",
            $hash,
            ", ",
            $bytes,
            ", 0 WHERE NOT EXISTS (SELECT 1 FROM kept) ON CONFLICT (hash) DO NOTHING RETURNING 1)"
        )
    };
}
pub(crate) use keep_blob_ctes;

/// Whether the blob [`keep_blob_ctes`] looked for is kept.
macro_rules! blob_kept {
    () => {
        "(EXISTS (SELECT 1 FROM kept) OR EXISTS (SELECT 1 FROM put))"
    };
}
pub(crate) use blob_kept;

/// The session `$session`'s newest checkpoint (a new one's parent).
macro_rules! newest_checkpoint {
    ($session:literal) => {
        concat!(
            "(SELECT id FROM checkpoints WHERE session_id = ",
            $session,
            " ORDER BY row_order DESC LIMIT 1)"
        )
    };
}
pub(crate) use newest_checkpoint;

/// Makes sure the state blob `hash` exists and stays until the transaction
/// ends, in one statement ([`keep_blob_ctes`]): a present row is
/// share-locked (a sweep deleting it waits, then sees the reference), a
/// missing one inserted. At `READ COMMITTED` a sweep may delete the row the
/// statement looked for, or another writer insert the one it meant to:
/// then it is tried again.
pub(crate) async fn keep_blob_tx(tx: &Tx<'_>, hash: &str, bytes: &[u8]) -> Result<()> {
    for _ in 0..3 {
        let kept: bool = tx
            .query_one(
                concat!(
                    "WITH ",
                    keep_blob_ctes!("$1", "$2"),
                    " SELECT ",
                    blob_kept!()
                ),
                &[&hash, &bytes],
            )
            .await
            .map_err(from_pg)?
            .get(0);
        if kept {
            return Ok(());
        }
    }
    Err(StoreError::Busy {
        message: format!("state blob {hash} was deleted while it was being kept"),
        attempts: 3,
    })
}

/// The bytes of the state blob `hash`, if it exists. A row another keel
/// stored compressed (`codec` 1) is not one this backend writes: corruption.
pub(crate) async fn read_state_blob(tx: &Tx<'_>, hash: &str) -> Result<Option<Vec<u8>>> {
    let row = tx
        .query_opt(
            "SELECT bytes, codec FROM state_blobs WHERE hash = $1",
            &[&hash],
        )
        .await
        .map_err(from_pg)?;
    row.map(|r| match r.get::<_, i64>(1) {
        0 => Ok(r.get(0)),
        codec => Err(StoreError::corrupt(
            &format!("state_blobs.codec ({hash})"),
            format!("codec {codec} is never written on PostgreSQL"),
        )),
    })
    .transpose()
}

/// Inserts a checkpoint row; `parent` defaults to the session's newest checkpoint.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn insert_checkpoint_tx(
    tx: &Tx<'_>,
    session: &SessionId,
    timeline: &TimelineId,
    seq: i64,
    parent: Option<&CheckpointId>,
    cp: &NewCheckpoint,
    state_hash: &str,
    now_ms: i64,
) -> Result<CheckpointRecord> {
    // Without a parent given, the session's newest checkpoint (read in the
    // same statement).
    let row = tx
        .query_one(
            concat!(
                "INSERT INTO checkpoints (id, session_id, timeline_id, seq, parent_checkpoint_id, ",
                "turn_index, state_hash, source, created_at) VALUES ($1, $2, $3, $4, coalesce($5, ",
                newest_checkpoint!("$2"),
                "), $6, $7, $8, $9) RETURNING parent_checkpoint_id"
            ),
            &[
                &cp.id.to_string(),
                &session.to_string(),
                &timeline.as_str(),
                &seq,
                &parent.map(ToString::to_string),
                &to_i64("turn_index", cp.turn_index)?,
                &state_hash,
                &cp.source.as_str(),
                &now_ms,
            ],
        )
        .await
        .map_err(from_pg)?;
    checkpoint_record(cp, session, timeline, seq, row.get(0), state_hash, now_ms)
}

/// The record of checkpoint `cp` as inserted: of `session` at `seq` of
/// `timeline`, its parent the id the insert answered.
pub(crate) fn checkpoint_record(
    cp: &NewCheckpoint,
    session: &SessionId,
    timeline: &TimelineId,
    seq: i64,
    parent: Option<String>,
    state_hash: &str,
    now_ms: i64,
) -> Result<CheckpointRecord> {
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
async fn branch_timeline(
    tx: &Tx<'_>,
    session: &SessionId,
    cp: &CheckpointRecord,
    now_ms: i64,
) -> Result<TimelineId> {
    let id = fresh_id();
    tx.execute(
        "INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, created_at) \
         VALUES ($1, $2, $3, $4, $5)",
        &[
            &id,
            &session.to_string(),
            &cp.timeline_id.as_str(),
            &cp.seq,
            &now_ms,
        ],
    )
    .await
    .map_err(from_pg)?;
    Ok(TimelineId(id))
}

async fn rollback_tx(
    tx: &Tx<'_>,
    session_id: &SessionId,
    target_id: &CheckpointId,
    new_id: &CheckpointId,
    now_ms: i64,
) -> Result<CheckpointRecord> {
    lock_session(tx, session_id).await?;
    let target = require_checkpoint(tx, target_id).await?;
    if target.session_id != *session_id {
        return Err(StoreError::InvalidInput(format!(
            "checkpoint {target_id} belongs to session {}, not {session_id}",
            target.session_id
        )));
    }
    let timeline = branch_timeline(tx, session_id, &target, now_ms).await?;
    // The history is the checkpoint's again, and so is its count of inputs.
    let message_count = visible_inputs(tx, target.timeline_id.as_str(), target.seq).await?;
    tx.execute(
        "UPDATE sessions SET head_timeline_id = $1, state_hash = $2, \
         last_active_at = GREATEST(last_active_at, $3), message_count = $5 WHERE id = $4",
        &[
            &timeline.as_str(),
            &target.state_hash,
            &now_ms,
            &session_id.to_string(),
            &message_count,
        ],
    )
    .await
    .map_err(from_pg)?;
    let cp = NewCheckpoint {
        id: *new_id,
        turn_index: target.turn_index,
        source: CheckpointSource::Rollback,
    };
    insert_checkpoint_tx(
        tx,
        session_id,
        &timeline,
        target.seq,
        Some(target_id),
        &cp,
        &target.state_hash,
        now_ms,
    )
    .await
}

async fn fork_tx(
    tx: &Tx<'_>,
    source_id: &CheckpointId,
    session: &NewSession,
    new_id: &CheckpointId,
) -> Result<(SessionRecord, CheckpointRecord)> {
    let source = require_checkpoint(tx, source_id).await?;
    let created = insert_session_tx(
        tx,
        session,
        Some((source.timeline_id.as_str(), source.seq)),
        Some(&source.state_hash),
    )
    .await?;
    let cp = NewCheckpoint {
        id: *new_id,
        turn_index: source.turn_index,
        source: CheckpointSource::Fork,
    };
    let record = insert_checkpoint_tx(
        tx,
        &created.id,
        &created.head_timeline_id,
        source.seq,
        Some(source_id),
        &cp,
        &source.state_hash,
        session.now_ms,
    )
    .await?;
    Ok((created, record))
}

pub(crate) async fn list_tx(tx: &Tx<'_>, session: &SessionId) -> Result<Vec<CheckpointRecord>> {
    tx.query(
        &format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE session_id = $1 \
             ORDER BY row_order DESC"
        ),
        &[&session.to_string()],
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(checkpoint_from_row)
    .collect()
}

/// Deletes the checkpoints `ids`, re-parenting their children so the
/// listed tree stays connected.
async fn delete_checkpoint_batch(tx: &Tx<'_>, ids: &[String]) -> Result<u64> {
    let mut deleted = 0;
    for id in ids {
        let Some(row) = tx
            .query_opt(
                "SELECT parent_checkpoint_id FROM checkpoints WHERE id = $1",
                &[id],
            )
            .await
            .map_err(from_pg)?
        else {
            continue;
        };
        let parent: Option<String> = row.get(0);
        tx.execute(
            "UPDATE checkpoints SET parent_checkpoint_id = $1 WHERE parent_checkpoint_id = $2",
            &[&parent, id],
        )
        .await
        .map_err(from_pg)?;
        deleted += tx
            .execute("DELETE FROM checkpoints WHERE id = $1", &[id])
            .await
            .map_err(from_pg)?;
    }
    Ok(deleted)
}

/// Timelines of `session` that no session head or checkpoint reaches.
async fn unreachable_timelines(tx: &Tx<'_>, session: &SessionId) -> Result<Vec<String>> {
    Ok(tx
        .query(
            "WITH RECURSIVE needed(id) AS ( \
               SELECT head_timeline_id FROM sessions WHERE head_timeline_id IS NOT NULL \
               UNION SELECT timeline_id FROM checkpoints \
               UNION SELECT t.parent_timeline_id FROM timelines t JOIN needed n ON t.id = n.id \
                     WHERE t.parent_timeline_id IS NOT NULL \
             ) \
             SELECT id FROM timelines WHERE session_id = $1 \
               AND id NOT IN (SELECT id FROM needed)",
            &[&session.to_string()],
        )
        .await
        .map_err(from_pg)?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The last seq of `timeline` anything still reaches (a checkpoint on it
/// or a timeline branching from it); `None` when a session head is on it
/// (all of it is live).
async fn needed_upto(tx: &Tx<'_>, timeline: &str) -> Result<Option<i64>> {
    Ok(tx
        .query_one(
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM sessions WHERE head_timeline_id = $1) \
               THEN NULL \
               ELSE GREATEST( \
                 coalesce((SELECT max(seq) FROM checkpoints WHERE timeline_id = $1), 0), \
                 coalesce((SELECT max(fork_seq) FROM timelines WHERE parent_timeline_id = $1), 0)) \
             END",
            &[&timeline],
        )
        .await
        .map_err(from_pg)?
        .get(0))
}

/// Ids of up to one batch of the session's checkpoints to delete: all of
/// them without a policy; with one, only `turn` checkpoints beyond the
/// newest `keep_latest` turn checkpoints that the rules select and nothing
/// needs (not the session's newest, not the target of a rollback or fork).
async fn select_prunable(
    tx: &Tx<'_>,
    session: &SessionId,
    policy: Option<PrunePolicy>,
) -> Result<Vec<String>> {
    let session = session.to_string();
    let rows = match policy {
        None => tx
            .query(
                "SELECT id FROM checkpoints WHERE session_id = $1 LIMIT $2",
                &[&session, &PRUNE_BATCH],
            )
            .await
            .map_err(from_pg)?,
        Some(p) => {
            let skip = i64::try_from(p.keep_latest.unwrap_or(0)).unwrap_or(i64::MAX);
            let older_than = p.older_than_ms.unwrap_or(i64::MAX);
            tx.query(
                "SELECT id FROM (SELECT id, created_at, row_order AS r FROM checkpoints \
                   WHERE session_id = $1 AND source = 'turn' \
                   ORDER BY row_order DESC OFFSET $3) c \
                 WHERE c.created_at < $4 \
                   AND c.r < (SELECT max(row_order) FROM checkpoints WHERE session_id = $1) \
                   AND NOT EXISTS (SELECT 1 FROM checkpoints k WHERE k.parent_checkpoint_id = c.id \
                                   AND k.source IN ('rollback', 'fork')) \
                 ORDER BY c.r DESC LIMIT $2",
                &[&session, &PRUNE_BATCH, &skip, &older_than],
            )
            .await
            .map_err(from_pg)?
        }
    };
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

impl PgStore {
    pub(crate) async fn create_checkpoint(
        &self,
        session_id: SessionId,
        checkpoint: NewCheckpoint,
        state: Vec<u8>,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        self.write_committed(move |tx| {
            let state = state.clone();
            Box::pin(async move {
                let session = lock_session(tx, &session_id).await?;
                let hash = put_state_tx(tx, &session, &state).await?;
                let seq = last_seq(tx, session.head_timeline_id.as_str()).await?;
                insert_checkpoint_tx(
                    tx,
                    &session_id,
                    &session.head_timeline_id,
                    seq,
                    None,
                    &checkpoint,
                    &hash,
                    now_ms,
                )
                .await
            })
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
        self.write(move |tx| {
            Box::pin(async move {
                rollback_tx(tx, &session_id, &checkpoint_id, &new_checkpoint_id, now_ms).await
            })
        })
        .await
    }

    pub(crate) async fn fork(
        &self,
        checkpoint_id: CheckpointId,
        session: NewSession,
        new_checkpoint_id: CheckpointId,
    ) -> Result<(SessionRecord, CheckpointRecord)> {
        self.write(move |tx| {
            let session = session.clone();
            Box::pin(async move { fork_tx(tx, &checkpoint_id, &session, &new_checkpoint_id).await })
        })
        .await
    }

    pub(crate) async fn list_checkpoints(
        &self,
        session_id: SessionId,
    ) -> Result<Vec<CheckpointRecord>> {
        self.read(move |tx| Box::pin(async move { list_tx(tx, &session_id).await }))
            .await
    }

    pub(crate) async fn checkpoint_page(
        &self,
        session_id: SessionId,
        cursor: Option<CheckpointCursor>,
        limit: usize,
    ) -> Result<Page<CheckpointRecord, CheckpointCursor>> {
        let fetch = page_fetch(limit)?;
        self.read(move |tx| {
            Box::pin(async move {
                let (at, id) = match &cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MAX, String::new()),
                };
                let mut items = tx
                    .query(
                        &format!(
                            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE session_id = $1 \
                             AND ($2 OR (created_at, id) < ($3, $4)) \
                             ORDER BY created_at DESC, id DESC LIMIT $5"
                        ),
                        &[&session_id.to_string(), &cursor.is_none(), &at, &id, &fetch],
                    )
                    .await
                    .map_err(from_pg)?
                    .iter()
                    .map(checkpoint_from_row)
                    .collect::<Result<Vec<_>>>()?;
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
        })
        .await
    }

    pub(crate) async fn latest_checkpoint(
        &self,
        session_id: SessionId,
    ) -> Result<Option<CheckpointRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                tx.query_opt(
                    &format!(
                        "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE session_id = $1 \
                         ORDER BY row_order DESC LIMIT 1"
                    ),
                    &[&session_id.to_string()],
                )
                .await
                .map_err(from_pg)?
                .as_ref()
                .map(checkpoint_from_row)
                .transpose()
            })
        })
        .await
    }

    pub(crate) async fn get_checkpoint(
        &self,
        id: CheckpointId,
    ) -> Result<Option<CheckpointRecord>> {
        self.read(move |tx| Box::pin(async move { get_checkpoint_tx(tx, &id).await }))
            .await
    }

    pub(crate) async fn get_state_blob(&self, hash: String) -> Result<Option<Vec<u8>>> {
        self.read(move |tx| {
            let hash = hash.clone();
            Box::pin(async move { read_state_blob(tx, &hash).await })
        })
        .await
    }

    pub(crate) async fn sessions_over_turn_checkpoints(
        &self,
        keep: usize,
    ) -> Result<Vec<SessionId>> {
        let keep = i64::try_from(keep).unwrap_or(i64::MAX);
        self.read(move |tx| {
            Box::pin(async move {
                // SQLite groups in session id order (by its index or a
                // sort); a hash aggregate here would not, hence the ORDER BY.
                tx.query(
                    "SELECT session_id FROM checkpoints WHERE source = 'turn' \
                     GROUP BY session_id HAVING count(*) > $1 ORDER BY session_id",
                    &[&keep],
                )
                .await
                .map_err(from_pg)?
                .iter()
                .map(|r| parse("checkpoints.session_id", &r.get::<_, String>(0)))
                .collect()
            })
        })
        .await
    }

    /// SQLite's incremental vacuum; on PostgreSQL autovacuum makes the space
    /// of deleted rows reusable on its own, so there is nothing to do and
    /// no page is reported given back: always `Ok(0)`.
    pub(crate) async fn reclaim_pages(&self, max_pages: u32) -> Result<u64> {
        let _ = max_pages;
        Ok(0)
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
                .write(move |tx| {
                    Box::pin(async move {
                        lock_session(tx, &session_id).await?;
                        let ids = select_prunable(tx, &session_id, policy).await?;
                        delete_checkpoint_batch(tx, &ids).await
                    })
                })
                .await?;
            report.checkpoints_deleted += deleted;
            if deleted < PRUNE_BATCH as u64 {
                break;
            }
        }
        report.blobs_deleted = self
            .write(|tx| Box::pin(async move { sweep_blobs(tx).await }))
            .await?;
        let timelines = self
            .read(move |tx| Box::pin(async move { unreachable_timelines(tx, &session_id).await }))
            .await?;
        for timeline in timelines {
            report.messages_deleted += self.delete_messages(&timeline, Messages::All).await?;
        }
        // Re-check reachability inside the deleting transaction: a fork may
        // have started from one of these timelines meanwhile.
        report.timelines_deleted += self
            .write(move |tx| {
                Box::pin(async move {
                    let mut n = 0u64;
                    for id in unreachable_timelines(tx, &session_id).await? {
                        let has_messages: bool = tx
                            .query_one(
                                "SELECT EXISTS (SELECT 1 FROM messages WHERE timeline_id = $1)",
                                &[&id],
                            )
                            .await
                            .map_err(from_pg)?
                            .get(0);
                        if has_messages {
                            continue;
                        }
                        tx.execute(
                            "UPDATE timelines SET parent_timeline_id = NULL, fork_seq = NULL \
                             WHERE parent_timeline_id = $1",
                            &[&id],
                        )
                        .await
                        .map_err(from_pg)?;
                        n += tx
                            .execute("DELETE FROM timelines WHERE id = $1", &[&id])
                            .await
                            .map_err(from_pg)?;
                    }
                    Ok(n)
                })
            })
            .await?;
        // Tails of surviving timelines that only abandoned, pruned checkpoints saw.
        let timelines: Vec<String> = self
            .read(move |tx| {
                Box::pin(async move {
                    Ok(tx
                        .query(
                            "SELECT id FROM timelines WHERE session_id = $1",
                            &[&session_id.to_string()],
                        )
                        .await
                        .map_err(from_pg)?
                        .iter()
                        .map(|r| r.get(0))
                        .collect())
                })
            })
            .await?;
        for timeline in timelines {
            report.messages_deleted += self.delete_messages(&timeline, Messages::Unneeded).await?;
        }
        Ok(report)
    }

    /// Deletes `which` messages of `timeline`, a batch per transaction.
    async fn delete_messages(&self, timeline: &str, which: Messages) -> Result<u64> {
        let mut deleted = 0;
        loop {
            let t = timeline.to_owned();
            let n = self
                .write(move |tx| {
                    let t = t.clone();
                    Box::pin(async move {
                        let after = match which {
                            Messages::All => 0,
                            Messages::Unneeded => match needed_upto(tx, &t).await? {
                                Some(upto) => upto,
                                None => return Ok(0),
                            },
                        };
                        tx.execute(
                            "DELETE FROM messages WHERE (timeline_id, seq) IN \
                               (SELECT timeline_id, seq FROM messages \
                                WHERE timeline_id = $1 AND seq > $2 LIMIT $3)",
                            &[&t, &after, &MESSAGE_DELETE_BATCH],
                        )
                        .await
                        .map_err(from_pg)
                    })
                })
                .await?;
            deleted += n;
            if n < MESSAGE_DELETE_BATCH as u64 {
                return Ok(deleted);
            }
        }
    }
}
