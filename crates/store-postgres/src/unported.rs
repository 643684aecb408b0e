//! Transactions not ported to PostgreSQL yet: each panics. A module's block
//! goes when its port lands (temporary: nothing may remain here at release).
#![allow(unused_variables, unused_imports, clippy::unused_async)]

use std::collections::HashMap;

use keel_core::{ApprovalId, CheckpointId, EventId, GroupId, RunId, SessionId, TurnId, Usage, Usd};
use keel_store::*;

use crate::PgStore;

// ---- checkpoints.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn create_checkpoint(
        &self,
        session_id: SessionId,
        checkpoint: NewCheckpoint,
        state: Vec<u8>,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        todo!("PostgreSQL: create_checkpoint is not ported yet")
    }
    pub(crate) async fn rollback(
        &self,
        session_id: SessionId,
        checkpoint_id: CheckpointId,
        new_checkpoint_id: CheckpointId,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        todo!("PostgreSQL: rollback is not ported yet")
    }
    pub(crate) async fn fork(
        &self,
        checkpoint_id: CheckpointId,
        session: NewSession,
        new_checkpoint_id: CheckpointId,
    ) -> Result<(SessionRecord, CheckpointRecord)> {
        todo!("PostgreSQL: fork is not ported yet")
    }
    pub(crate) async fn list_checkpoints(
        &self,
        session_id: SessionId,
    ) -> Result<Vec<CheckpointRecord>> {
        todo!("PostgreSQL: list_checkpoints is not ported yet")
    }
    pub(crate) async fn checkpoint_page(
        &self,
        session_id: SessionId,
        cursor: Option<CheckpointCursor>,
        limit: usize,
    ) -> Result<Page<CheckpointRecord, CheckpointCursor>> {
        todo!("PostgreSQL: checkpoint_page is not ported yet")
    }
    pub(crate) async fn latest_checkpoint(
        &self,
        session_id: SessionId,
    ) -> Result<Option<CheckpointRecord>> {
        todo!("PostgreSQL: latest_checkpoint is not ported yet")
    }
    pub(crate) async fn get_checkpoint(
        &self,
        id: CheckpointId,
    ) -> Result<Option<CheckpointRecord>> {
        todo!("PostgreSQL: get_checkpoint is not ported yet")
    }
    pub(crate) async fn get_state_blob(&self, hash: String) -> Result<Option<Vec<u8>>> {
        todo!("PostgreSQL: get_state_blob is not ported yet")
    }
    pub(crate) async fn sessions_over_turn_checkpoints(
        &self,
        keep: usize,
    ) -> Result<Vec<SessionId>> {
        todo!("PostgreSQL: sessions_over_turn_checkpoints is not ported yet")
    }
    pub(crate) async fn reclaim_pages(&self, max_pages: u32) -> Result<u64> {
        todo!("PostgreSQL: reclaim_pages is not ported yet")
    }
    pub(crate) async fn delete_checkpoints(&self, session_id: SessionId) -> Result<PruneReport> {
        todo!("PostgreSQL: delete_checkpoints is not ported yet")
    }
    pub(crate) async fn prune_checkpoints(
        &self,
        session_id: SessionId,
        policy: PrunePolicy,
    ) -> Result<PruneReport> {
        todo!("PostgreSQL: prune_checkpoints is not ported yet")
    }
}

// ---- tree.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn dialog_tree(&self, session: SessionId) -> Result<DialogTree> {
        todo!("PostgreSQL: dialog_tree is not ported yet")
    }
    pub(crate) async fn import_session_tree(
        &self,
        session: NewSession,
        tree: ImportTree,
        runs: Vec<RunRecord>,
    ) -> Result<SessionRecord> {
        todo!("PostgreSQL: import_session_tree is not ported yet")
    }
}

// ---- purge.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn deleted_sessions_before(
        &self,
        deleted_before_ms: i64,
    ) -> Result<Vec<SessionId>> {
        todo!("PostgreSQL: deleted_sessions_before is not ported yet")
    }
    pub(crate) async fn purge_session(&self, session_id: SessionId) -> Result<PurgeReport> {
        todo!("PostgreSQL: purge_session is not ported yet")
    }
    pub(crate) async fn sweep_state_blobs(&self) -> Result<u64> {
        todo!("PostgreSQL: sweep_state_blobs is not ported yet")
    }
    pub(crate) async fn dialog_usage(&self, session_id: SessionId) -> Result<DialogUsage> {
        todo!("PostgreSQL: dialog_usage is not ported yet")
    }
}

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

// ---- runtime.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn activate_runtime(&self, holder: String, now_ms: i64) -> Result<Activation> {
        todo!("PostgreSQL: activate_runtime is not ported yet")
    }
}

// ---- runs/recovery.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn recover_older_generations(
        &self,
        active_generation: u64,
        now_ms: i64,
    ) -> Result<RecoveryReport> {
        todo!("PostgreSQL: recover_older_generations is not ported yet")
    }
}

// ---- runs/lifecycle.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn accept_run(&self, request: AcceptRun) -> Result<AcceptedRun> {
        todo!("PostgreSQL: accept_run is not ported yet")
    }
    pub(crate) async fn accept_agent_group(&self, request: AcceptGroup) -> Result<AcceptedGroup> {
        todo!("PostgreSQL: accept_agent_group is not ported yet")
    }
    pub(crate) async fn mark_run_running(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        todo!("PostgreSQL: mark_run_running is not ported yet")
    }
    pub(crate) async fn mark_run_waiting_children(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        todo!("PostgreSQL: mark_run_waiting_children is not ported yet")
    }
    pub(crate) async fn commit_terminal(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
    ) -> Result<TerminalCommit> {
        todo!("PostgreSQL: commit_terminal is not ported yet")
    }
    pub(crate) async fn commit_run_end(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
        calls: Vec<CallSpan>,
    ) -> Result<TerminalCommit> {
        todo!("PostgreSQL: commit_run_end is not ported yet")
    }
    pub(crate) async fn cancel_session(
        &self,
        root_session_id: SessionId,
        reason: String,
        now_ms: i64,
    ) -> Result<CancelReport> {
        todo!("PostgreSQL: cancel_session is not ported yet")
    }
}

// ---- runs/pauses.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn commit_paused_run(&self, commit: PausedRunCommit) -> Result<bool> {
        todo!("PostgreSQL: commit_paused_run is not ported yet")
    }
    pub(crate) async fn resume_paused_run(
        &self,
        run_id: RunId,
        execution_id: String,
        runtime_generation: u64,
        now_ms: i64,
    ) -> Result<Option<ResumedRun>> {
        todo!("PostgreSQL: resume_paused_run is not ported yet")
    }
    pub(crate) async fn waiting_runs(&self, session_id: SessionId) -> Result<Vec<RunRecord>> {
        todo!("PostgreSQL: waiting_runs is not ported yet")
    }
}

// ---- runs/mod.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn get_run(&self, run_id: RunId) -> Result<Option<RunRecord>> {
        todo!("PostgreSQL: get_run is not ported yet")
    }
    pub(crate) async fn get_group(&self, group_id: GroupId) -> Result<Option<GroupRecord>> {
        todo!("PostgreSQL: get_group is not ported yet")
    }
    pub(crate) async fn group_runs(&self, group_id: GroupId) -> Result<Vec<RunRecord>> {
        todo!("PostgreSQL: group_runs is not ported yet")
    }
    pub(crate) async fn child_runs(&self, parent_run_id: RunId) -> Result<Vec<RunRecord>> {
        todo!("PostgreSQL: child_runs is not ported yet")
    }
    pub(crate) async fn list_runs(
        &self,
        root_session_id: SessionId,
        cursor: Option<RunCursor>,
        limit: usize,
    ) -> Result<Page<RunRecord, RunCursor>> {
        todo!("PostgreSQL: list_runs is not ported yet")
    }
}

// ---- runs/import.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn session_runs(&self, root: SessionId) -> Result<Vec<RunRecord>> {
        todo!("PostgreSQL: session_runs is not ported yet")
    }
}

// ---- counters.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn reconcile_counters(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
    ) -> Result<Option<CounterRepair>> {
        todo!("PostgreSQL: reconcile_counters is not ported yet")
    }
    pub(crate) async fn inbox_counts(&self, root_session_id: SessionId) -> Result<InboxCounts> {
        todo!("PostgreSQL: inbox_counts is not ported yet")
    }
    pub(crate) async fn inbox_usage(&self, root_session_id: SessionId) -> Result<InboxUsage> {
        todo!("PostgreSQL: inbox_usage is not ported yet")
    }
}

// ---- inbox.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn insert_signal(&self, signal: NewSignal) -> Result<SignalCommit> {
        todo!("PostgreSQL: insert_signal is not ported yet")
    }
    pub(crate) async fn claim_inbox_batch(
        &self,
        request: ClaimRequest,
    ) -> Result<Option<InboxLease>> {
        todo!("PostgreSQL: claim_inbox_batch is not ported yet")
    }
    pub(crate) async fn admit_inbox_events(
        &self,
        event_ids: Vec<EventId>,
        lease_token: String,
        turn_id: TurnId,
        now_ms: i64,
    ) -> Result<u64> {
        todo!("PostgreSQL: admit_inbox_events is not ported yet")
    }
    pub(crate) async fn release_inbox_lease(
        &self,
        request: ReleaseRequest,
    ) -> Result<ReleaseReport> {
        todo!("PostgreSQL: release_inbox_lease is not ported yet")
    }
    pub(crate) async fn dead_letter_events(
        &self,
        event_ids: Vec<EventId>,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        todo!("PostgreSQL: dead_letter_events is not ported yet")
    }
    pub(crate) async fn commit_continuation_turn(
        &self,
        commit: ContinuationCommit,
    ) -> Result<ContinuationCommitted> {
        todo!("PostgreSQL: commit_continuation_turn is not ported yet")
    }
    pub(crate) async fn unnotified_dead_letters(
        &self,
        root_session_id: SessionId,
    ) -> Result<Vec<InboxEvent>> {
        todo!("PostgreSQL: unnotified_dead_letters is not ported yet")
    }
    pub(crate) async fn commit_dead_letter_notice(
        &self,
        commit: NoticeCommit,
    ) -> Result<TurnCommitted> {
        todo!("PostgreSQL: commit_dead_letter_notice is not ported yet")
    }
    pub(crate) async fn supersede_run_signals(&self, run_id: RunId, now_ms: i64) -> Result<u64> {
        todo!("PostgreSQL: supersede_run_signals is not ported yet")
    }
    pub(crate) async fn list_signals(
        &self,
        root_session_id: SessionId,
        limit: usize,
    ) -> Result<Vec<InboxEvent>> {
        todo!("PostgreSQL: list_signals is not ported yet")
    }
    pub(crate) async fn list_inbox_events(
        &self,
        root_session_id: SessionId,
    ) -> Result<Vec<InboxEvent>> {
        todo!("PostgreSQL: list_inbox_events is not ported yet")
    }
    pub(crate) async fn inbox_schedule(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<InboxSchedule> {
        todo!("PostgreSQL: inbox_schedule is not ported yet")
    }
    pub(crate) async fn dead_letter_expired_events(
        &self,
        root_session_id: SessionId,
        created_by_ms: i64,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        todo!("PostgreSQL: dead_letter_expired_events is not ported yet")
    }
}

// ---- projection.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn query_runs(&self, query: RunQuery) -> Result<Page<RunRecord, RunCursor>> {
        todo!("PostgreSQL: query_runs is not ported yet")
    }
    pub(crate) async fn query_session_events(
        &self,
        root_session_id: SessionId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        todo!("PostgreSQL: query_session_events is not ported yet")
    }
    pub(crate) async fn run_events(
        &self,
        run_id: RunId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        todo!("PostgreSQL: run_events is not ported yet")
    }
    pub(crate) async fn agent_changes_since(
        &self,
        root_session_id: SessionId,
        since_revision: u64,
        limit: usize,
    ) -> Result<AgentChanges> {
        todo!("PostgreSQL: agent_changes_since is not ported yet")
    }
}

// ---- observe.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn inbox_gauges(&self) -> Result<InboxGauges> {
        todo!("PostgreSQL: inbox_gauges is not ported yet")
    }
    pub(crate) async fn run_tree(&self, id: RunId) -> Result<Vec<RunRecord>> {
        todo!("PostgreSQL: run_tree is not ported yet")
    }
    pub(crate) async fn turn_runs(
        &self,
        session: Option<SessionId>,
        turn: TurnId,
    ) -> Result<Vec<RunRecord>> {
        todo!("PostgreSQL: turn_runs is not ported yet")
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

// ---- compact.rs (delete this block when you port the module) ----
impl PgStore {
    pub(crate) async fn train_dictionary_if_due(&self, now_ms: i64) -> Result<Option<u32>> {
        todo!("PostgreSQL: train_dictionary_if_due is not ported yet")
    }
}
