//! Webhooks on PostgreSQL (ported by `approvals`; these are stubs so
//! that the history port compiles until then).
#![allow(unused_variables, dead_code)]

use keel_core::{SessionId, TurnId};
use keel_store::Result;
use tokio_postgres::Transaction;

pub(crate) async fn subscribe_tx(
    tx: &Transaction<'_>,
    turn: &TurnId,
    session: &SessionId,
    url: &str,
    now_ms: i64,
) -> Result<()> {
    todo!("ported by approvals")
}

pub(crate) async fn unsubscribe_tx(tx: &Transaction<'_>, turn: &TurnId) -> Result<()> {
    todo!("ported by approvals")
}

pub(crate) async fn bind_tx(
    tx: &Transaction<'_>,
    turn: &TurnId,
    timeline: &str,
    seq: i64,
) -> Result<()> {
    todo!("ported by approvals")
}

/// What the end of a turn tells [`deliveries_tx`].
pub(crate) struct CommittedTurn<'a> {
    pub status: &'static str,
    pub session: &'a SessionId,
    pub timeline: &'a str,
    pub answers: &'a [i64],
    pub turn_id: Option<TurnId>,
    pub messages: &'a [keel_store::NewMessage],
    pub last_seq: Option<i64>,
    pub now_ms: i64,
}

pub(crate) async fn deliveries_tx(
    tx: &Transaction<'_>,
    turn: &CommittedTurn<'_>,
    global: &[String],
) -> Result<usize> {
    todo!("ported by approvals")
}

pub(crate) async fn unanswered_deliveries_tx(
    tx: &Transaction<'_>,
    session: &SessionId,
    timeline: &str,
    seq: i64,
    now_ms: i64,
    global: &[String],
) -> Result<usize> {
    todo!("ported by approvals")
}

pub(crate) async fn run_deliveries_tx(
    tx: &Transaction<'_>,
    run: &keel_store::RunRecord,
    status: &str,
    result: Option<&str>,
    error: Option<&str>,
    now_ms: i64,
    global: &[String],
) -> Result<usize> {
    todo!("ported by approvals")
}
