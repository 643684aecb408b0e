//! Checkpoints on PostgreSQL (ported by `checkpoints`; these are stubs
//! so that the history port compiles until then).
#![allow(unused_variables, clippy::too_many_arguments)]

use keel_core::{CheckpointId, SessionId};
use keel_store::{CheckpointRecord, NewCheckpoint, Result, SessionRecord, TimelineId};
use tokio_postgres::Transaction;

pub(crate) async fn require_checkpoint(
    tx: &Transaction<'_>,
    id: &CheckpointId,
) -> Result<CheckpointRecord> {
    todo!("ported by checkpoints")
}

pub(crate) async fn put_state_tx(
    tx: &Transaction<'_>,
    session: &SessionRecord,
    bytes: &[u8],
) -> Result<String> {
    todo!("ported by checkpoints")
}

pub(crate) async fn insert_checkpoint_tx(
    tx: &Transaction<'_>,
    session: &SessionId,
    timeline: &TimelineId,
    seq: i64,
    parent: Option<&CheckpointId>,
    cp: &NewCheckpoint,
    state_hash: &str,
    now_ms: i64,
) -> Result<CheckpointRecord> {
    todo!("ported by checkpoints")
}
