//! A dialog's whole history tree, read for an export and written back by an
//! import: its timelines (the current branch and the ones a rollback left
//! behind), the messages each owns, its checkpoints with their states, and
//! its head.

use std::collections::HashMap;

use keel_core::{CheckpointId, SessionId};
use rusqlite::{params, Connection};

use crate::checkpoints::{read_state_blob, CheckpointRecord, CheckpointSource};
use crate::error::{Result, StoreError};
use crate::messages::{
    encode, load_chain, visible_inputs, MessageFilter, NewMessage, StoredMessage,
};
use crate::runs::RunRecord;
use crate::sessions::{insert_session_tx, require_session, NewSession, SessionRecord};
use crate::util::{fresh_id, sha256_hex, to_i64};
use crate::SqliteStore;

/// One timeline of a dialog as read for an export.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeTimeline {
    /// Its id.
    pub id: String,
    /// The timeline it branches from (`None` for the dialog's first one).
    pub parent: Option<String>,
    /// The last seq of the parent it shares.
    pub fork_seq: Option<i64>,
    /// The messages it owns, in seq order (the first timeline's include
    /// the history a fork inherited from its source dialog).
    pub messages: Vec<StoredMessage>,
}

/// A dialog's history tree: timelines parents first, checkpoints oldest
/// first with their state bytes, and the head timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct DialogTree {
    /// Timelines, parents before children; the first has no parent.
    pub timelines: Vec<TreeTimeline>,
    /// The timeline the dialog's history continues on.
    pub head: String,
    /// Checkpoints, oldest first, each with its state blob.
    pub checkpoints: Vec<(CheckpointRecord, Vec<u8>)>,
}

/// A timeline to import: its key in the file, its parent's key and fork
/// point, and the messages it owns as (seq, message), consecutive.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportTimeline {
    /// Its key (the exported id).
    pub key: String,
    /// The key of the timeline it branches from (`None` for the first one).
    pub parent: Option<String>,
    /// The last seq of the parent it shares.
    pub fork_seq: Option<i64>,
    /// Its messages with their seqs, which follow each other.
    pub messages: Vec<(i64, NewMessage)>,
}

/// A checkpoint to import (already carrying its new id).
#[derive(Debug, Clone, PartialEq)]
pub struct ImportCheckpoint {
    /// Its new id.
    pub id: CheckpointId,
    /// The new id of the checkpoint it follows, if that one is imported too.
    pub parent: Option<CheckpointId>,
    /// The key of its timeline.
    pub timeline: String,
    /// The last seq it sees.
    pub seq: i64,
    /// Turn index.
    pub turn_index: u64,
    /// Why it was taken.
    pub source: CheckpointSource,
    /// Its state's bytes.
    pub state: Vec<u8>,
    /// When it was taken (ms).
    pub created_at_ms: i64,
}

/// A whole history tree to import: timelines parents first, checkpoints
/// oldest first (parents before children), the head's key and live state.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportTree {
    /// Timelines, parents first; exactly the first has no parent.
    pub timelines: Vec<ImportTimeline>,
    /// Checkpoints, oldest first.
    pub checkpoints: Vec<ImportCheckpoint>,
    /// The key of the head timeline.
    pub head: String,
    /// The live state's bytes.
    pub state: Vec<u8>,
}

fn invalid(what: String) -> StoreError {
    StoreError::InvalidInput(what)
}

fn read_tree_tx(c: &Connection, session: &SessionRecord) -> Result<DialogTree> {
    let id = session.id.to_string();
    let mut stmt = c.prepare(
        "SELECT t.id, CASE WHEN p.session_id = t.session_id THEN t.parent_timeline_id END, \
         CASE WHEN p.session_id = t.session_id THEN t.fork_seq END \
         FROM timelines t LEFT JOIN timelines p ON p.id = t.parent_timeline_id \
         WHERE t.session_id = ?1 ORDER BY t.created_at, t.rowid",
    )?;
    let rows = stmt.query_map([&id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    let rows: Vec<(String, Option<String>, Option<i64>)> = rows.collect::<rusqlite::Result<_>>()?;
    let mut timelines = Vec::with_capacity(rows.len());
    for (tid, parent, fork_seq) in rows {
        let messages = if parent.is_none() {
            load_chain(c, &tid, i64::MAX, &MessageFilter::default())?
        } else {
            let filter = MessageFilter {
                from_seq: Some(fork_seq.unwrap_or(0) + 1),
                ..MessageFilter::default()
            };
            load_chain(c, &tid, i64::MAX, &filter)?
        };
        timelines.push(TreeTimeline {
            id: tid,
            parent,
            fork_seq,
            messages,
        });
    }
    let mut checkpoints = Vec::new();
    for cp in crate::checkpoints::list_tx(c, &session.id)?
        .into_iter()
        .rev()
    {
        let state = read_state_blob(c, &cp.state_hash)?.ok_or_else(|| {
            StoreError::corrupt(
                "checkpoints.state_hash",
                format!("no blob {}", cp.state_hash),
            )
        })?;
        checkpoints.push((cp, state));
    }
    Ok(DialogTree {
        timelines,
        head: session.head_timeline_id.as_str().to_owned(),
        checkpoints,
    })
}

fn put_blob_tx(c: &Connection, bytes: &[u8]) -> Result<String> {
    let hash = sha256_hex(bytes);
    let (codec, stored) = crate::compress::pack_bytes(bytes, crate::compress::db_of(c));
    c.prepare_cached("INSERT OR IGNORE INTO state_blobs (hash, bytes, codec) VALUES (?1, ?2, ?3)")?
        .execute(params![hash, stored, codec])?;
    Ok(hash)
}

/// Writes the timelines of `tree` (the first one is the session's own) and
/// their messages; returns each key's new timeline id.
fn import_timelines_tx(
    c: &Connection,
    session: &SessionRecord,
    tree: &ImportTree,
    encoded: &[Vec<crate::messages::EncodedMessage>],
    now_ms: i64,
) -> Result<HashMap<String, String>> {
    let mut ids: HashMap<String, String> = HashMap::new();
    for (i, t) in tree.timelines.iter().enumerate() {
        let id = match (&t.parent, i) {
            (None, 0) => session.head_timeline_id.as_str().to_owned(),
            (None, _) => return Err(invalid("only the first timeline may have no parent".into())),
            (Some(_), 0) => return Err(invalid("the first timeline has a parent".into())),
            (Some(parent), _) => {
                let parent = ids.get(parent).ok_or_else(|| {
                    invalid(format!(
                        "timeline {:?} follows a timeline not before it",
                        t.key
                    ))
                })?;
                let fork_seq = t
                    .fork_seq
                    .filter(|s| *s >= 0)
                    .ok_or_else(|| invalid(format!("timeline {:?} has no fork point", t.key)))?;
                let id = fresh_id();
                c.execute(
                    "INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, \
                     created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![id, session.id.to_string(), parent, fork_seq, now_ms],
                )?;
                id
            }
        };
        let start = t.fork_seq.unwrap_or(0);
        if t.messages
            .iter()
            .enumerate()
            .any(|(k, (seq, _))| i64::try_from(k).map_or(true, |k| *seq != start + 1 + k))
        {
            return Err(invalid(format!(
                "the messages of timeline {:?} do not follow each other from seq {}",
                t.key,
                start + 1
            )));
        }
        crate::messages::append_tx(c, &session.id, &id, start, &encoded[i], now_ms)?;
        if ids.insert(t.key.clone(), id).is_some() {
            return Err(invalid(format!("two timelines are keyed {:?}", t.key)));
        }
    }
    Ok(ids)
}

fn import_tree_tx(
    c: &Connection,
    session: &NewSession,
    tree: &ImportTree,
    encoded: &[Vec<crate::messages::EncodedMessage>],
) -> Result<()> {
    let record = insert_session_tx(c, session, None, None)?;
    let ids = import_timelines_tx(c, &record, tree, encoded, session.now_ms)?;
    let timeline = |key: &str| {
        ids.get(key)
            .ok_or_else(|| invalid(format!("no timeline {key:?} in the file")))
    };
    for cp in &tree.checkpoints {
        let tid = timeline(&cp.timeline)?;
        let last = crate::messages::last_seq(c, tid)?;
        if cp.seq < 0 || cp.seq > last {
            return Err(invalid(format!(
                "a checkpoint of timeline {:?} is at seq {}, and the timeline ends at {last}",
                cp.timeline, cp.seq
            )));
        }
        let hash = put_blob_tx(c, &cp.state)?;
        c.prepare_cached(
            "INSERT INTO checkpoints (id, session_id, timeline_id, seq, parent_checkpoint_id, \
             turn_index, state_hash, source, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?
        .execute(params![
            cp.id.to_string(),
            session.id.to_string(),
            tid,
            cp.seq,
            cp.parent.map(|p| p.to_string()),
            to_i64("turn_index", cp.turn_index)?,
            hash,
            cp.source.as_str(),
            cp.created_at_ms,
        ])?;
    }
    let head = timeline(&tree.head)?;
    let hash = put_blob_tx(c, &tree.state)?;
    let inputs = visible_inputs(c, head, i64::MAX)?;
    c.execute(
        "UPDATE sessions SET head_timeline_id = ?1, state_hash = ?2, message_count = ?3 \
         WHERE id = ?4",
        params![head, hash, inputs, session.id.to_string()],
    )?;
    Ok(())
}

impl SqliteStore {
    pub(crate) async fn dialog_tree(&self, session: SessionId) -> Result<DialogTree> {
        self.db
            .read(move |c| {
                let record = require_session(c, &session)?;
                read_tree_tx(c, &record)
            })
            .await
    }

    pub(crate) async fn import_session_tree(
        &self,
        session: NewSession,
        tree: ImportTree,
        runs: Vec<RunRecord>,
    ) -> Result<SessionRecord> {
        let encoded = tree
            .timelines
            .iter()
            .map(|t| {
                let messages: Vec<NewMessage> = t.messages.iter().map(|(_, m)| m.clone()).collect();
                encode(self.path(), &messages)
            })
            .collect::<Result<Vec<_>>>()?;
        self.db
            .write(move |c| {
                import_tree_tx(c, &session, &tree, &encoded)?;
                crate::runs::import_runs_tx(c, &session, &runs)?;
                require_session(c, &session.id)
            })
            .await
    }
}
