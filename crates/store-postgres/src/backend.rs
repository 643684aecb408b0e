//! `PgStore` as keel's storage [`Backend`]: each transaction is an inherent
//! method in the module of the same name as keel-store's SQLite one
//! (`sessions.rs`, `messages.rs`, `runs/` …); this file lists them.

use std::collections::HashMap;

use keel_core::{ApprovalId, CheckpointId, EventId, GroupId, RunId, SessionId, TurnId, Usage, Usd};
use keel_store::*;

use crate::PgStore;

#[async_trait::async_trait]
impl Backend for PgStore {
    fn location(&self) -> String {
        self.inner.location.clone()
    }

    fn commit_stats(&self) -> CommitStats {
        PgStore::commit_stats(self)
    }

    fn hooks(&self) -> &WebhookHooks {
        &self.inner.hooks
    }

    async fn create_session(&self, session: NewSession) -> Result<SessionRecord> {
        PgStore::create_session(self, session).await
    }

    async fn import_session(
        &self,
        session: NewSession,
        turn: TurnCommit,
        runs: Vec<RunRecord>,
    ) -> Result<TurnCommitted> {
        PgStore::import_session(self, session, turn, runs).await
    }

    async fn upsert_session(&self, session: NewSession) -> Result<SessionRecord> {
        PgStore::upsert_session(self, session).await
    }

    async fn get_session(&self, id: SessionId) -> Result<Option<SessionRecord>> {
        PgStore::get_session(self, id).await
    }

    async fn get_dialog(
        &self,
        channel: &str,
        chat_id: &str,
        dialog_id: &str,
    ) -> Result<Option<SessionRecord>> {
        PgStore::get_dialog(self, channel, chat_id, dialog_id).await
    }

    async fn list_dialogs(&self, query: DialogQuery) -> Result<Page<SessionRecord, DialogCursor>> {
        PgStore::list_dialogs(self, query).await
    }

    async fn latest_active_dialog(
        &self,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<SessionRecord>> {
        PgStore::latest_active_dialog(self, channel, chat_id).await
    }

    async fn rename_session(&self, id: SessionId, title: String, now_ms: i64) -> Result<()> {
        PgStore::rename_session(self, id, title, now_ms).await
    }

    async fn soft_delete_session(&self, id: SessionId, now_ms: i64) -> Result<bool> {
        PgStore::soft_delete_session(self, id, now_ms).await
    }

    async fn touch_session(&self, id: SessionId, now_ms: i64) -> Result<()> {
        PgStore::touch_session(self, id, now_ms).await
    }

    async fn set_delivery_context(
        &self,
        id: SessionId,
        context: Option<String>,
        now_ms: i64,
    ) -> Result<()> {
        PgStore::set_delivery_context(self, id, context, now_ms).await
    }

    async fn child_sessions(&self, parent: SessionId) -> Result<Vec<SessionRecord>> {
        PgStore::child_sessions(self, parent).await
    }

    async fn open_turn(&self, turn: OpenTurn) -> Result<Vec<i64>> {
        PgStore::open_turn(self, turn).await
    }

    async fn mark_unanswered(&self, session_id: SessionId, seqs: Vec<i64>) -> Result<usize> {
        PgStore::mark_unanswered(self, session_id, seqs).await
    }

    async fn append_message(
        &self,
        session_id: SessionId,
        message: NewMessage,
        now_ms: i64,
    ) -> Result<i64> {
        PgStore::append_message(self, session_id, message, now_ms).await
    }

    async fn append_messages(
        &self,
        session_id: SessionId,
        messages: Vec<NewMessage>,
        now_ms: i64,
    ) -> Result<Vec<i64>> {
        PgStore::append_messages(self, session_id, messages, now_ms).await
    }

    async fn commit_turn(&self, turn: TurnCommit) -> Result<TurnCommitted> {
        PgStore::commit_turn(self, turn).await
    }

    async fn load_messages(
        &self,
        session_id: SessionId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        PgStore::load_messages(self, session_id, filter).await
    }

    async fn load_message_page(
        &self,
        session_id: SessionId,
        page: MessagePage,
    ) -> Result<Vec<StoredMessage>> {
        PgStore::load_message_page(self, session_id, page).await
    }

    async fn history_ranges(&self, session_id: SessionId) -> Result<Vec<(TimelineId, i64)>> {
        PgStore::history_ranges(self, session_id).await
    }

    async fn history_after(
        &self,
        session_id: SessionId,
        known: Option<SessionHead>,
        filter: MessageFilter,
    ) -> Result<HistoryDelta> {
        PgStore::history_after(self, session_id, known, filter).await
    }

    async fn dialogs_with_history_after(
        &self,
        query: DialogQuery,
        wanted: DialogFilter,
        known: HashMap<SessionId, SessionHead>,
        filter: MessageFilter,
    ) -> Result<Vec<(SessionRecord, HistoryDelta)>> {
        PgStore::dialogs_with_history_after(self, query, wanted, known, filter).await
    }

    async fn load_messages_at_checkpoint(
        &self,
        checkpoint_id: CheckpointId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        PgStore::load_messages_at_checkpoint(self, checkpoint_id, filter).await
    }

    async fn last_seq(&self, session_id: SessionId) -> Result<i64> {
        PgStore::last_seq(self, session_id).await
    }

    async fn queue_input(&self, input: QueuedInput) -> Result<()> {
        PgStore::queue_input(self, input).await
    }

    async fn discard_queued_input(&self, turn_id: TurnId) -> Result<bool> {
        PgStore::discard_queued_input(self, turn_id).await
    }

    async fn queued_inputs(&self) -> Result<Vec<QueuedInput>> {
        PgStore::queued_inputs(self).await
    }

    async fn put_image(&self, bytes: Vec<u8>) -> Result<StoredImage> {
        PgStore::put_image(self, bytes).await
    }

    async fn image(&self, sha256: &str) -> Result<Option<StoredImage>> {
        PgStore::image(self, sha256).await
    }

    async fn missing_images(&self, hashes: Vec<String>) -> Result<Vec<String>> {
        PgStore::missing_images(self, hashes).await
    }

    async fn create_checkpoint(
        &self,
        session_id: SessionId,
        checkpoint: NewCheckpoint,
        state: Vec<u8>,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        PgStore::create_checkpoint(self, session_id, checkpoint, state, now_ms).await
    }

    async fn rollback(
        &self,
        session_id: SessionId,
        checkpoint_id: CheckpointId,
        new_checkpoint_id: CheckpointId,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        PgStore::rollback(self, session_id, checkpoint_id, new_checkpoint_id, now_ms).await
    }

    async fn fork(
        &self,
        checkpoint_id: CheckpointId,
        session: NewSession,
        new_checkpoint_id: CheckpointId,
    ) -> Result<(SessionRecord, CheckpointRecord)> {
        PgStore::fork(self, checkpoint_id, session, new_checkpoint_id).await
    }

    async fn list_checkpoints(&self, session_id: SessionId) -> Result<Vec<CheckpointRecord>> {
        PgStore::list_checkpoints(self, session_id).await
    }

    async fn checkpoint_page(
        &self,
        session_id: SessionId,
        cursor: Option<CheckpointCursor>,
        limit: usize,
    ) -> Result<Page<CheckpointRecord, CheckpointCursor>> {
        PgStore::checkpoint_page(self, session_id, cursor, limit).await
    }

    async fn latest_checkpoint(&self, session_id: SessionId) -> Result<Option<CheckpointRecord>> {
        PgStore::latest_checkpoint(self, session_id).await
    }

    async fn get_checkpoint(&self, id: CheckpointId) -> Result<Option<CheckpointRecord>> {
        PgStore::get_checkpoint(self, id).await
    }

    async fn get_state_blob(&self, hash: String) -> Result<Option<Vec<u8>>> {
        PgStore::get_state_blob(self, hash).await
    }

    async fn sessions_over_turn_checkpoints(&self, keep: usize) -> Result<Vec<SessionId>> {
        PgStore::sessions_over_turn_checkpoints(self, keep).await
    }

    async fn reclaim_pages(&self, max_pages: u32) -> Result<u64> {
        PgStore::reclaim_pages(self, max_pages).await
    }

    async fn delete_checkpoints(&self, session_id: SessionId) -> Result<PruneReport> {
        PgStore::delete_checkpoints(self, session_id).await
    }

    async fn prune_checkpoints(
        &self,
        session_id: SessionId,
        policy: PrunePolicy,
    ) -> Result<PruneReport> {
        PgStore::prune_checkpoints(self, session_id, policy).await
    }

    async fn dialog_tree(&self, session: SessionId) -> Result<DialogTree> {
        PgStore::dialog_tree(self, session).await
    }

    async fn import_session_tree(
        &self,
        session: NewSession,
        tree: ImportTree,
        runs: Vec<RunRecord>,
    ) -> Result<SessionRecord> {
        PgStore::import_session_tree(self, session, tree, runs).await
    }

    async fn deleted_sessions_before(&self, deleted_before_ms: i64) -> Result<Vec<SessionId>> {
        PgStore::deleted_sessions_before(self, deleted_before_ms).await
    }

    async fn purge_session(&self, session_id: SessionId) -> Result<PurgeReport> {
        PgStore::purge_session(self, session_id).await
    }

    async fn sweep_state_blobs(&self) -> Result<u64> {
        PgStore::sweep_state_blobs(self).await
    }

    async fn dialog_usage(&self, session_id: SessionId) -> Result<DialogUsage> {
        PgStore::dialog_usage(self, session_id).await
    }

    async fn add_dialog_spend(
        &self,
        session: SessionId,
        usage: Usage,
        cost: Usd,
        now_ms: i64,
    ) -> Result<DialogSpend> {
        PgStore::add_dialog_spend(self, session, usage, cost, now_ms).await
    }

    async fn dialog_spend(&self, session: SessionId) -> Result<DialogSpend> {
        PgStore::dialog_spend(self, session).await
    }

    async fn turn_calls(&self, session: Option<SessionId>, turn: TurnId) -> Result<Vec<CallSpan>> {
        PgStore::turn_calls(self, session, turn).await
    }

    async fn runs_calls(&self, runs: Vec<RunId>) -> Result<HashMap<RunId, Vec<CallSpan>>> {
        PgStore::runs_calls(self, runs).await
    }

    async fn commit_paused_turn(&self, commit: PausedTurnCommit) -> Result<TurnCommitted> {
        PgStore::commit_paused_turn(self, commit).await
    }

    async fn get_approval(&self, id: ApprovalId) -> Result<Option<ApprovalRecord>> {
        PgStore::get_approval(self, id).await
    }

    async fn list_approvals(
        &self,
        session_id: SessionId,
        pending_only: bool,
    ) -> Result<Vec<ApprovalRecord>> {
        PgStore::list_approvals(self, session_id, pending_only).await
    }

    async fn approval_grants(&self, session_id: SessionId) -> Result<Vec<String>> {
        PgStore::approval_grants(self, session_id).await
    }

    async fn decide_approval(&self, d: DecideApproval) -> Result<DecideOutcome> {
        PgStore::decide_approval(self, d).await
    }

    async fn expire_approvals(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>> {
        PgStore::expire_approvals(self, session_id, now_ms).await
    }

    async fn approval_schedule(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<ApprovalSchedule> {
        PgStore::approval_schedule(self, session_id, now_ms).await
    }

    async fn sessions_with_open_approvals(&self) -> Result<Vec<SessionId>> {
        PgStore::sessions_with_open_approvals(self).await
    }

    async fn unsettled_approvals(
        &self,
        session_id: SessionId,
        turn_id: TurnId,
    ) -> Result<Vec<ApprovalRecord>> {
        PgStore::unsettled_approvals(self, session_id, turn_id).await
    }

    async fn begin_approved_execution(&self, id: ApprovalId, now_ms: i64) -> Result<bool> {
        PgStore::begin_approved_execution(self, id, now_ms).await
    }

    async fn commit_approval_results(&self, commit: ApprovalResultCommit) -> Result<TurnCommitted> {
        PgStore::commit_approval_results(self, commit).await
    }

    async fn due_webhook_deliveries(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        PgStore::due_webhook_deliveries(self, now_ms, limit).await
    }

    async fn next_webhook_due(&self) -> Result<Option<i64>> {
        PgStore::next_webhook_due(self).await
    }

    async fn record_webhook_attempt(
        &self,
        id: String,
        outcome: AttemptOutcome,
        now_ms: i64,
    ) -> Result<Option<DeliveryStatus>> {
        PgStore::record_webhook_attempt(self, id, outcome, now_ms).await
    }

    async fn list_webhook_deliveries(
        &self,
        status: Option<DeliveryStatus>,
        cursor: Option<i64>,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        PgStore::list_webhook_deliveries(self, status, cursor, limit).await
    }

    async fn commit_mcp_manifest(
        &self,
        record: McpManifestRecord,
    ) -> Result<Option<McpManifestRecord>> {
        PgStore::commit_mcp_manifest(self, record).await
    }

    async fn mcp_manifests(&self) -> Result<Vec<McpManifestRecord>> {
        PgStore::mcp_manifests(self).await
    }

    async fn activate_runtime(&self, holder: String, now_ms: i64) -> Result<Activation> {
        PgStore::activate_runtime(self, holder, now_ms).await
    }

    async fn runtime_generation(&self) -> Result<Option<(u64, String)>> {
        PgStore::runtime_generation(self).await
    }

    fn shared(&self) -> bool {
        true
    }

    async fn renew_runtime(&self) -> Result<()> {
        PgStore::renew_runtime(self).await
    }

    async fn recover_expired_runtimes(&self, now_ms: i64) -> Result<Option<ProcessRecovery>> {
        PgStore::recover_expired_runtimes(self, now_ms).await
    }

    async fn lease_session(&self, session: SessionId) -> Result<SessionLease> {
        PgStore::lease_session(self, session).await
    }

    async fn release_session(&self, session: SessionId) -> Result<()> {
        PgStore::release_session(self, session).await
    }

    fn relay(&self) -> Option<std::sync::Arc<dyn keel_store::Relay>> {
        PgStore::relay(self)
    }

    async fn recover_older_generations(
        &self,
        active_generation: u64,
        now_ms: i64,
    ) -> Result<RecoveryReport> {
        PgStore::recover_older_generations(self, active_generation, now_ms).await
    }

    async fn accept_run(&self, request: AcceptRun) -> Result<AcceptedRun> {
        PgStore::accept_run(self, request).await
    }

    async fn accept_agent_group(&self, request: AcceptGroup) -> Result<AcceptedGroup> {
        PgStore::accept_agent_group(self, request).await
    }

    async fn mark_run_running(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        PgStore::mark_run_running(self, run_id, execution_id, now_ms).await
    }

    async fn mark_run_waiting_children(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        PgStore::mark_run_waiting_children(self, run_id, execution_id, now_ms).await
    }

    async fn commit_terminal(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
    ) -> Result<TerminalCommit> {
        PgStore::commit_terminal(self, run_id, execution_id, outcome, handling, now_ms).await
    }

    async fn commit_run_end(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
        calls: Vec<CallSpan>,
    ) -> Result<TerminalCommit> {
        PgStore::commit_run_end(self, run_id, execution_id, outcome, handling, now_ms, calls).await
    }

    async fn cancel_session(
        &self,
        root_session_id: SessionId,
        reason: String,
        now_ms: i64,
    ) -> Result<CancelReport> {
        PgStore::cancel_session(self, root_session_id, reason, now_ms).await
    }

    async fn commit_paused_run(&self, commit: PausedRunCommit) -> Result<bool> {
        PgStore::commit_paused_run(self, commit).await
    }

    async fn resume_paused_run(
        &self,
        run_id: RunId,
        execution_id: String,
        runtime_generation: u64,
        now_ms: i64,
    ) -> Result<Option<ResumedRun>> {
        PgStore::resume_paused_run(self, run_id, execution_id, runtime_generation, now_ms).await
    }

    async fn waiting_runs(&self, session_id: SessionId) -> Result<Vec<RunRecord>> {
        PgStore::waiting_runs(self, session_id).await
    }

    async fn get_run(&self, run_id: RunId) -> Result<Option<RunRecord>> {
        PgStore::get_run(self, run_id).await
    }

    async fn get_group(&self, group_id: GroupId) -> Result<Option<GroupRecord>> {
        PgStore::get_group(self, group_id).await
    }

    async fn group_runs(&self, group_id: GroupId) -> Result<Vec<RunRecord>> {
        PgStore::group_runs(self, group_id).await
    }

    async fn child_runs(&self, parent_run_id: RunId) -> Result<Vec<RunRecord>> {
        PgStore::child_runs(self, parent_run_id).await
    }

    async fn list_runs(
        &self,
        root_session_id: SessionId,
        cursor: Option<RunCursor>,
        limit: usize,
    ) -> Result<Page<RunRecord, RunCursor>> {
        PgStore::list_runs(self, root_session_id, cursor, limit).await
    }

    async fn session_runs(&self, root: SessionId) -> Result<Vec<RunRecord>> {
        PgStore::session_runs(self, root).await
    }

    async fn reconcile_counters(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
    ) -> Result<Option<CounterRepair>> {
        PgStore::reconcile_counters(self, root_session_id, now_ms).await
    }

    async fn inbox_counts(&self, root_session_id: SessionId) -> Result<InboxCounts> {
        PgStore::inbox_counts(self, root_session_id).await
    }

    async fn inbox_usage(&self, root_session_id: SessionId) -> Result<InboxUsage> {
        PgStore::inbox_usage(self, root_session_id).await
    }

    async fn insert_signal(&self, signal: NewSignal) -> Result<SignalCommit> {
        PgStore::insert_signal(self, signal).await
    }

    async fn claim_inbox_batch(&self, request: ClaimRequest) -> Result<Option<InboxLease>> {
        PgStore::claim_inbox_batch(self, request).await
    }

    async fn admit_inbox_events(
        &self,
        event_ids: Vec<EventId>,
        lease_token: String,
        turn_id: TurnId,
        now_ms: i64,
    ) -> Result<u64> {
        PgStore::admit_inbox_events(self, event_ids, lease_token, turn_id, now_ms).await
    }

    async fn release_inbox_lease(&self, request: ReleaseRequest) -> Result<ReleaseReport> {
        PgStore::release_inbox_lease(self, request).await
    }

    async fn dead_letter_events(
        &self,
        event_ids: Vec<EventId>,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        PgStore::dead_letter_events(self, event_ids, reason, now_ms).await
    }

    async fn commit_continuation_turn(
        &self,
        commit: ContinuationCommit,
    ) -> Result<ContinuationCommitted> {
        PgStore::commit_continuation_turn(self, commit).await
    }

    async fn unnotified_dead_letters(&self, root_session_id: SessionId) -> Result<Vec<InboxEvent>> {
        PgStore::unnotified_dead_letters(self, root_session_id).await
    }

    async fn commit_dead_letter_notice(&self, commit: NoticeCommit) -> Result<TurnCommitted> {
        PgStore::commit_dead_letter_notice(self, commit).await
    }

    async fn supersede_run_signals(&self, run_id: RunId, now_ms: i64) -> Result<u64> {
        PgStore::supersede_run_signals(self, run_id, now_ms).await
    }

    async fn list_signals(
        &self,
        root_session_id: SessionId,
        limit: usize,
    ) -> Result<Vec<InboxEvent>> {
        PgStore::list_signals(self, root_session_id, limit).await
    }

    async fn list_inbox_events(&self, root_session_id: SessionId) -> Result<Vec<InboxEvent>> {
        PgStore::list_inbox_events(self, root_session_id).await
    }

    async fn inbox_schedule(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<InboxSchedule> {
        PgStore::inbox_schedule(self, root_session_id, now_ms, ttl_ms).await
    }

    async fn schedules(
        &self,
        session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<(ApprovalSchedule, InboxSchedule)> {
        PgStore::schedules(self, session_id, now_ms, ttl_ms).await
    }

    async fn dead_letter_expired_events(
        &self,
        root_session_id: SessionId,
        created_by_ms: i64,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        PgStore::dead_letter_expired_events(self, root_session_id, created_by_ms, reason, now_ms)
            .await
    }

    async fn query_runs(&self, query: RunQuery) -> Result<Page<RunRecord, RunCursor>> {
        PgStore::query_runs(self, query).await
    }

    async fn query_session_events(
        &self,
        root_session_id: SessionId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        PgStore::query_session_events(self, root_session_id, cursor, limit).await
    }

    async fn run_events(
        &self,
        run_id: RunId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        PgStore::run_events(self, run_id, cursor, limit).await
    }

    async fn agent_changes_since(
        &self,
        root_session_id: SessionId,
        since_revision: u64,
        limit: usize,
    ) -> Result<AgentChanges> {
        PgStore::agent_changes_since(self, root_session_id, since_revision, limit).await
    }

    async fn inbox_gauges(&self) -> Result<InboxGauges> {
        PgStore::inbox_gauges(self).await
    }

    async fn run_tree(&self, id: RunId) -> Result<Vec<RunRecord>> {
        PgStore::run_tree(self, id).await
    }

    async fn turn_runs(&self, session: Option<SessionId>, turn: TurnId) -> Result<Vec<RunRecord>> {
        PgStore::turn_runs(self, session, turn).await
    }

    async fn check_invariants(&self, options: CheckOptions) -> Result<InvariantReport> {
        PgStore::check_invariants(self, options).await
    }

    async fn recount_message_counts(&self) -> Result<usize> {
        PgStore::recount_message_counts(self).await
    }

    async fn train_dictionary_if_due(&self, now_ms: i64) -> Result<Option<u32>> {
        PgStore::train_dictionary_if_due(self, now_ms).await
    }
}
