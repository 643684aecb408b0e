//! The agent inbox on PostgreSQL (ported by `inbox`; these are stubs so
//! that the runs port compiles until then).
#![allow(unused_variables, dead_code)]

use keel_core::{Delivery, EventId, RunId, SessionId};
use keel_store::{EventType, Result, ScopeKind};
use tokio_postgres::Transaction;

use crate::counters::Revisions;

/// Row of a new event (internal).
pub(crate) struct NewEventRow<'a> {
    pub root_session_id: SessionId,
    pub scope: ScopeKind,
    pub scope_id: &'a str,
    pub event_type: EventType,
    pub event_key: &'a str,
    pub delivery: Delivery,
    pub requires_continuation: bool,
    pub severity: Option<&'a str>,
    pub payload_json: &'a str,
    /// Insert as already consumed (no continuation, no pending count).
    pub consumed: bool,
    pub revision: i64,
    pub now_ms: i64,
}

pub(crate) async fn insert_event_tx(tx: &Transaction<'_>, e: &NewEventRow<'_>) -> Result<EventId> {
    todo!("ported by inbox")
}

pub(crate) async fn supersede_run_signals_tx(
    tx: &Transaction<'_>,
    run_id: &RunId,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    todo!("ported by inbox")
}

pub(crate) async fn dead_letter_session_tx(
    tx: &Transaction<'_>,
    root: &SessionId,
    reason: &str,
    revision: i64,
    now_ms: i64,
) -> Result<u64> {
    todo!("ported by inbox")
}

pub(crate) async fn expire_leases_tx(
    tx: &Transaction<'_>,
    cutoff_ms: i64,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    todo!("ported by inbox")
}

pub(crate) async fn sessions_with_inbox_work_tx(tx: &Transaction<'_>) -> Result<Vec<SessionId>> {
    todo!("ported by inbox")
}

/// The events `where_sql` (a `WHERE …`/`ORDER BY …` tail over
/// `agent_inbox_events`) selects.
pub(crate) async fn query_events(
    tx: &Transaction<'_>,
    where_sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<keel_store::InboxEvent>> {
    todo!("ported by inbox")
}

pub(crate) async fn continuation_tx(
    tx: &Transaction<'_>,
    c: &keel_store::ContinuationCommit,
    messages: &[crate::messages::EncodedMessage],
) -> Result<keel_store::ContinuationCommitted> {
    todo!("ported by inbox")
}
