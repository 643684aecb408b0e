//! Transactions not ported to PostgreSQL yet: each panics. A module's block
//! goes when its port lands (temporary: nothing may remain here at release).
#![allow(unused_variables, unused_imports, clippy::unused_async)]

use std::collections::HashMap;

use keel_core::{ApprovalId, CheckpointId, EventId, GroupId, RunId, SessionId, TurnId, Usage, Usd};
use keel_store::*;

use crate::PgStore;

// ---- approvals.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn commit_paused_turn(
        &self,
        commit: PausedTurnCommit,
    ) -> Result<TurnCommitted> {
        todo!("PostgreSQL: commit_paused_turn is not ported yet")
    }
    pub(crate) async fn get_approval(&self, id: ApprovalId) -> Result<Option<ApprovalRecord>> {
        todo!("PostgreSQL: get_approval is not ported yet")
    }
    pub(crate) async fn list_approvals(
        &self,
        session_id: SessionId,
        pending_only: bool,
    ) -> Result<Vec<ApprovalRecord>> {
        todo!("PostgreSQL: list_approvals is not ported yet")
    }
    pub(crate) async fn approval_grants(&self, session_id: SessionId) -> Result<Vec<String>> {
        todo!("PostgreSQL: approval_grants is not ported yet")
    }
    pub(crate) async fn decide_approval(&self, d: DecideApproval) -> Result<DecideOutcome> {
        todo!("PostgreSQL: decide_approval is not ported yet")
    }
    pub(crate) async fn expire_approvals(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>> {
        todo!("PostgreSQL: expire_approvals is not ported yet")
    }
    pub(crate) async fn approval_schedule(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<ApprovalSchedule> {
        todo!("PostgreSQL: approval_schedule is not ported yet")
    }
    pub(crate) async fn sessions_with_open_approvals(&self) -> Result<Vec<SessionId>> {
        todo!("PostgreSQL: sessions_with_open_approvals is not ported yet")
    }
    pub(crate) async fn unsettled_approvals(
        &self,
        session_id: SessionId,
        turn_id: TurnId,
    ) -> Result<Vec<ApprovalRecord>> {
        todo!("PostgreSQL: unsettled_approvals is not ported yet")
    }
    pub(crate) async fn begin_approved_execution(
        &self,
        id: ApprovalId,
        now_ms: i64,
    ) -> Result<bool> {
        todo!("PostgreSQL: begin_approved_execution is not ported yet")
    }
    pub(crate) async fn commit_approval_results(
        &self,
        commit: ApprovalResultCommit,
    ) -> Result<TurnCommitted> {
        todo!("PostgreSQL: commit_approval_results is not ported yet")
    }
}

// ---- webhooks.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn due_webhook_deliveries(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        todo!("PostgreSQL: due_webhook_deliveries is not ported yet")
    }
    pub(crate) async fn next_webhook_due(&self) -> Result<Option<i64>> {
        todo!("PostgreSQL: next_webhook_due is not ported yet")
    }
    pub(crate) async fn record_webhook_attempt(
        &self,
        id: String,
        outcome: AttemptOutcome,
        now_ms: i64,
    ) -> Result<Option<DeliveryStatus>> {
        todo!("PostgreSQL: record_webhook_attempt is not ported yet")
    }
    pub(crate) async fn list_webhook_deliveries(
        &self,
        status: Option<DeliveryStatus>,
        cursor: Option<i64>,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        todo!("PostgreSQL: list_webhook_deliveries is not ported yet")
    }
}

// ---- check.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn check_invariants(&self, options: CheckOptions) -> Result<InvariantReport> {
        todo!("PostgreSQL: check_invariants is not ported yet")
    }
    pub(crate) async fn recount_message_counts(&self) -> Result<usize> {
        todo!("PostgreSQL: recount_message_counts is not ported yet")
    }
}
