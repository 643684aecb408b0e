//! A dialog's whole history tree on PostgreSQL (keel-store's `tree.rs`):
//! read for an export — its timelines, the messages each owns, its
//! checkpoints with their states, its head — and written back by an import
//! in one transaction.

use std::collections::HashMap;
use std::sync::Arc;

use crate::store::Tx;
use keel_core::SessionId;
use keel_store::{
    DialogTree, ImportTree, MessageFilter, NewMessage, NewSession, Result, RunRecord,
    SessionRecord, StoreError, TreeTimeline,
};

use crate::checkpoints::{list_tx, read_state_blob};
use crate::messages::{append_tx, encode, last_seq, load_chain, visible_inputs, EncodedMessage};
use crate::sessions::{insert_session_tx, require_session};
use crate::store::from_pg;
use crate::util::{fresh_id, sha256_hex, to_i64};
use crate::PgStore;

fn invalid(what: String) -> StoreError {
    StoreError::InvalidInput(what)
}

async fn read_tree_tx(tx: &Tx<'_>, session: &SessionRecord) -> Result<DialogTree> {
    let rows = tx
        .query(
            "SELECT t.id, CASE WHEN p.session_id = t.session_id THEN t.parent_timeline_id END, \
             CASE WHEN p.session_id = t.session_id THEN t.fork_seq END \
             FROM timelines t LEFT JOIN timelines p ON p.id = t.parent_timeline_id \
             WHERE t.session_id = $1 ORDER BY t.created_at, t.row_order",
            &[&session.id.to_string()],
        )
        .await
        .map_err(from_pg)?;
    let mut timelines = Vec::with_capacity(rows.len());
    for r in rows {
        let (tid, parent, fork_seq): (String, Option<String>, Option<i64>) =
            (r.get(0), r.get(1), r.get(2));
        let filter = match parent {
            None => MessageFilter::default(),
            Some(_) => MessageFilter {
                from_seq: Some(fork_seq.unwrap_or(0) + 1),
                ..MessageFilter::default()
            },
        };
        let messages = load_chain(tx, &tid, i64::MAX, &filter).await?;
        timelines.push(TreeTimeline {
            id: tid,
            parent,
            fork_seq,
            messages,
        });
    }
    let mut checkpoints = Vec::new();
    for cp in list_tx(tx, &session.id).await?.into_iter().rev() {
        let state = read_state_blob(tx, &cp.state_hash).await?.ok_or_else(|| {
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

async fn put_blob_tx(tx: &Tx<'_>, bytes: &[u8]) -> Result<String> {
    let hash = sha256_hex(bytes);
    tx.execute(
        "INSERT INTO state_blobs (hash, bytes, codec) VALUES ($1, $2, 0) \
         ON CONFLICT (hash) DO NOTHING",
        &[&hash, &bytes],
    )
    .await
    .map_err(from_pg)?;
    Ok(hash)
}

/// Writes the timelines of `tree` (the first one is the session's own) and
/// their messages; returns each key's new timeline id.
async fn import_timelines_tx(
    tx: &Tx<'_>,
    session: &SessionRecord,
    tree: &ImportTree,
    encoded: &[Vec<EncodedMessage>],
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
                tx.execute(
                    "INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, \
                     created_at) VALUES ($1, $2, $3, $4, $5)",
                    &[&id, &session.id.to_string(), parent, &fork_seq, &now_ms],
                )
                .await
                .map_err(from_pg)?;
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
        append_tx(tx, &session.id, &id, start, &encoded[i], now_ms).await?;
        if ids.insert(t.key.clone(), id).is_some() {
            return Err(invalid(format!("two timelines are keyed {:?}", t.key)));
        }
    }
    Ok(ids)
}

async fn import_tree_tx(
    tx: &Tx<'_>,
    session: &NewSession,
    tree: &ImportTree,
    encoded: &[Vec<EncodedMessage>],
) -> Result<()> {
    let record = insert_session_tx(tx, session, None, None).await?;
    let ids = import_timelines_tx(tx, &record, tree, encoded, session.now_ms).await?;
    let timeline = |key: &str| {
        ids.get(key)
            .cloned()
            .ok_or_else(|| invalid(format!("no timeline {key:?} in the file")))
    };
    for cp in &tree.checkpoints {
        let tid = timeline(&cp.timeline)?;
        let last = last_seq(tx, &tid).await?;
        if cp.seq < 0 || cp.seq > last {
            return Err(invalid(format!(
                "a checkpoint of timeline {:?} is at seq {}, and the timeline ends at {last}",
                cp.timeline, cp.seq
            )));
        }
        let hash = put_blob_tx(tx, &cp.state).await?;
        tx.execute(
            "INSERT INTO checkpoints (id, session_id, timeline_id, seq, parent_checkpoint_id, \
             turn_index, state_hash, source, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            &[
                &cp.id.to_string(),
                &session.id.to_string(),
                &tid,
                &cp.seq,
                &cp.parent.map(|p| p.to_string()),
                &to_i64("turn_index", cp.turn_index)?,
                &hash,
                &cp.source.as_str(),
                &cp.created_at_ms,
            ],
        )
        .await
        .map_err(from_pg)?;
    }
    let head = timeline(&tree.head)?;
    let hash = put_blob_tx(tx, &tree.state).await?;
    let inputs = visible_inputs(tx, &head, i64::MAX).await?;
    tx.execute(
        "UPDATE sessions SET head_timeline_id = $1, state_hash = $2, message_count = $3 \
         WHERE id = $4",
        &[&head, &hash, &inputs, &session.id.to_string()],
    )
    .await
    .map_err(from_pg)?;
    Ok(())
}

impl PgStore {
    pub(crate) async fn dialog_tree(&self, session: SessionId) -> Result<DialogTree> {
        self.read(move |tx| {
            Box::pin(async move {
                let record = require_session(tx, &session).await?;
                read_tree_tx(tx, &record).await
            })
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
                encode(&messages)
            })
            .collect::<Result<Vec<_>>>()?;
        // Shared by the attempts of the transaction (retries), never copied.
        let (tree, encoded, runs) = (Arc::new(tree), Arc::new(encoded), Arc::new(runs));
        self.write(move |tx| {
            let (session, tree, encoded, runs) = (
                session.clone(),
                Arc::clone(&tree),
                Arc::clone(&encoded),
                Arc::clone(&runs),
            );
            Box::pin(async move {
                import_tree_tx(tx, &session, &tree, &encoded).await?;
                crate::runs::import_runs_tx(tx, &session, &runs).await?;
                require_session(tx, &session.id).await
            })
        })
        .await
    }
}
