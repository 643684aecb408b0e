//! [`SqliteStore`]: the SQLite backend — one write connection (group
//! commit) and a pool of readers (see `db.rs`); its transactions live in
//! the domain modules (`sessions.rs`, `messages.rs`, `runs/` …), and this
//! file lists them as the [`Backend`] they implement.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use keel_core::{ApprovalId, CheckpointId, EventId, GroupId, RunId, SessionId, TurnId, Usage, Usd};

use crate::*;

/// The SQLite backend of keel's store: a database file, migrated on open.
pub struct SqliteStore {
    pub(crate) db: Arc<crate::db::Db>,
    pub(crate) hooks: WebhookHooks,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.db.path())
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`, or at the file its
    /// symbolic links lead to, and migrates it to [`SCHEMA_VERSION`]. A
    /// newer database, or one with a second name (hard link), is refused untouched.
    pub fn open(path: impl AsRef<Path>, options: StoreOptions) -> Result<Self> {
        Ok(Self {
            db: Arc::new(crate::db::Db::open(path.as_ref(), options)?),
            hooks: WebhookHooks::default(),
        })
    }

    /// The database file, every symbolic link followed.
    pub fn path(&self) -> &Path {
        self.db.path()
    }
}

#[async_trait::async_trait]
impl Backend for SqliteStore {
    fn location(&self) -> String {
        self.db.path().display().to_string()
    }

    fn commit_stats(&self) -> CommitStats {
        self.db.commit_stats()
    }

    fn hooks(&self) -> &WebhookHooks {
        &self.hooks
    }

    async fn create_session(&self, session: NewSession) -> Result<SessionRecord> {
        SqliteStore::create_session(self, session).await
    }

    async fn import_session(
        &self,
        session: NewSession,
        turn: TurnCommit,
        runs: Vec<RunRecord>,
    ) -> Result<TurnCommitted> {
        SqliteStore::import_session(self, session, turn, runs).await
    }

    async fn upsert_session(&self, session: NewSession) -> Result<SessionRecord> {
        SqliteStore::upsert_session(self, session).await
    }

    async fn get_session(&self, id: SessionId) -> Result<Option<SessionRecord>> {
        SqliteStore::get_session(self, id).await
    }

    async fn get_dialog(
        &self,
        channel: &str,
        chat_id: &str,
        dialog_id: &str,
    ) -> Result<Option<SessionRecord>> {
        SqliteStore::get_dialog(self, channel, chat_id, dialog_id).await
    }

    async fn list_dialogs(&self, query: DialogQuery) -> Result<Page<SessionRecord, DialogCursor>> {
        SqliteStore::list_dialogs(self, query).await
    }

    async fn latest_active_dialog(
        &self,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<SessionRecord>> {
        SqliteStore::latest_active_dialog(self, channel, chat_id).await
    }

    async fn rename_session(&self, id: SessionId, title: String, now_ms: i64) -> Result<()> {
        SqliteStore::rename_session(self, id, title, now_ms).await
    }

    async fn soft_delete_session(&self, id: SessionId, now_ms: i64) -> Result<bool> {
        SqliteStore::soft_delete_session(self, id, now_ms).await
    }

    async fn touch_session(&self, id: SessionId, now_ms: i64) -> Result<()> {
        SqliteStore::touch_session(self, id, now_ms).await
    }

    async fn set_delivery_context(
        &self,
        id: SessionId,
        context: Option<String>,
        now_ms: i64,
    ) -> Result<()> {
        SqliteStore::set_delivery_context(self, id, context, now_ms).await
    }

    async fn child_sessions(&self, parent: SessionId) -> Result<Vec<SessionRecord>> {
        SqliteStore::child_sessions(self, parent).await
    }

    async fn open_turn(&self, turn: OpenTurn) -> Result<Vec<i64>> {
        SqliteStore::open_turn(self, turn).await
    }

    async fn mark_unanswered(&self, session_id: SessionId, seqs: Vec<i64>) -> Result<usize> {
        SqliteStore::mark_unanswered(self, session_id, seqs).await
    }

    async fn append_message(
        &self,
        session_id: SessionId,
        message: NewMessage,
        now_ms: i64,
    ) -> Result<i64> {
        SqliteStore::append_message(self, session_id, message, now_ms).await
    }

    async fn append_messages(
        &self,
        session_id: SessionId,
        messages: Vec<NewMessage>,
        now_ms: i64,
    ) -> Result<Vec<i64>> {
        SqliteStore::append_messages(self, session_id, messages, now_ms).await
    }

    async fn commit_turn(&self, turn: TurnCommit) -> Result<TurnCommitted> {
        SqliteStore::commit_turn(self, turn).await
    }

    async fn load_messages(
        &self,
        session_id: SessionId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        SqliteStore::load_messages(self, session_id, filter).await
    }

    async fn load_message_page(
        &self,
        session_id: SessionId,
        page: MessagePage,
    ) -> Result<Vec<StoredMessage>> {
        SqliteStore::load_message_page(self, session_id, page).await
    }

    async fn history_ranges(&self, session_id: SessionId) -> Result<Vec<(TimelineId, i64)>> {
        SqliteStore::history_ranges(self, session_id).await
    }

    async fn history_after(
        &self,
        session_id: SessionId,
        known: Option<SessionHead>,
        filter: MessageFilter,
    ) -> Result<HistoryDelta> {
        SqliteStore::history_after(self, session_id, known, filter).await
    }

    async fn dialogs_with_history_after(
        &self,
        query: DialogQuery,
        wanted: DialogFilter,
        known: HashMap<SessionId, SessionHead>,
        filter: MessageFilter,
    ) -> Result<Vec<(SessionRecord, HistoryDelta)>> {
        SqliteStore::dialogs_with_history_after(self, query, wanted, known, filter).await
    }

    async fn load_messages_at_checkpoint(
        &self,
        checkpoint_id: CheckpointId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>> {
        SqliteStore::load_messages_at_checkpoint(self, checkpoint_id, filter).await
    }

    async fn last_seq(&self, session_id: SessionId) -> Result<i64> {
        SqliteStore::last_seq(self, session_id).await
    }

    async fn queue_input(&self, input: QueuedInput) -> Result<()> {
        SqliteStore::queue_input(self, input).await
    }

    async fn discard_queued_input(&self, turn_id: TurnId) -> Result<bool> {
        SqliteStore::discard_queued_input(self, turn_id).await
    }

    async fn queued_inputs(&self) -> Result<Vec<QueuedInput>> {
        SqliteStore::queued_inputs(self).await
    }

    async fn put_image(&self, bytes: Vec<u8>) -> Result<StoredImage> {
        SqliteStore::put_image(self, bytes).await
    }

    async fn image(&self, sha256: &str) -> Result<Option<StoredImage>> {
        SqliteStore::image(self, sha256).await
    }

    async fn missing_images(&self, hashes: Vec<String>) -> Result<Vec<String>> {
        SqliteStore::missing_images(self, hashes).await
    }

    async fn create_checkpoint(
        &self,
        session_id: SessionId,
        checkpoint: NewCheckpoint,
        state: Vec<u8>,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        SqliteStore::create_checkpoint(self, session_id, checkpoint, state, now_ms).await
    }

    async fn rollback(
        &self,
        session_id: SessionId,
        checkpoint_id: CheckpointId,
        new_checkpoint_id: CheckpointId,
        now_ms: i64,
    ) -> Result<CheckpointRecord> {
        SqliteStore::rollback(self, session_id, checkpoint_id, new_checkpoint_id, now_ms).await
    }

    async fn fork(
        &self,
        checkpoint_id: CheckpointId,
        session: NewSession,
        new_checkpoint_id: CheckpointId,
    ) -> Result<(SessionRecord, CheckpointRecord)> {
        SqliteStore::fork(self, checkpoint_id, session, new_checkpoint_id).await
    }

    async fn list_checkpoints(&self, session_id: SessionId) -> Result<Vec<CheckpointRecord>> {
        SqliteStore::list_checkpoints(self, session_id).await
    }

    async fn checkpoint_page(
        &self,
        session_id: SessionId,
        cursor: Option<CheckpointCursor>,
        limit: usize,
    ) -> Result<Page<CheckpointRecord, CheckpointCursor>> {
        SqliteStore::checkpoint_page(self, session_id, cursor, limit).await
    }

    async fn latest_checkpoint(&self, session_id: SessionId) -> Result<Option<CheckpointRecord>> {
        SqliteStore::latest_checkpoint(self, session_id).await
    }

    async fn get_checkpoint(&self, id: CheckpointId) -> Result<Option<CheckpointRecord>> {
        SqliteStore::get_checkpoint(self, id).await
    }

    async fn get_state_blob(&self, hash: String) -> Result<Option<Vec<u8>>> {
        SqliteStore::get_state_blob(self, hash).await
    }

    async fn sessions_over_turn_checkpoints(&self, keep: usize) -> Result<Vec<SessionId>> {
        SqliteStore::sessions_over_turn_checkpoints(self, keep).await
    }

    async fn reclaim_pages(&self, max_pages: u32) -> Result<u64> {
        SqliteStore::reclaim_pages(self, max_pages).await
    }

    async fn delete_checkpoints(&self, session_id: SessionId) -> Result<PruneReport> {
        SqliteStore::delete_checkpoints(self, session_id).await
    }

    async fn prune_checkpoints(
        &self,
        session_id: SessionId,
        policy: PrunePolicy,
    ) -> Result<PruneReport> {
        SqliteStore::prune_checkpoints(self, session_id, policy).await
    }

    async fn dialog_tree(&self, session: SessionId) -> Result<DialogTree> {
        SqliteStore::dialog_tree(self, session).await
    }

    async fn import_session_tree(
        &self,
        session: NewSession,
        tree: ImportTree,
        runs: Vec<RunRecord>,
    ) -> Result<SessionRecord> {
        SqliteStore::import_session_tree(self, session, tree, runs).await
    }

    async fn deleted_sessions_before(&self, deleted_before_ms: i64) -> Result<Vec<SessionId>> {
        SqliteStore::deleted_sessions_before(self, deleted_before_ms).await
    }

    async fn purge_session(&self, session_id: SessionId) -> Result<PurgeReport> {
        SqliteStore::purge_session(self, session_id).await
    }

    async fn sweep_state_blobs(&self) -> Result<u64> {
        SqliteStore::sweep_state_blobs(self).await
    }

    async fn dialog_usage(&self, session_id: SessionId) -> Result<DialogUsage> {
        SqliteStore::dialog_usage(self, session_id).await
    }

    async fn add_dialog_spend(
        &self,
        session: SessionId,
        usage: Usage,
        cost: Usd,
        now_ms: i64,
    ) -> Result<DialogSpend> {
        SqliteStore::add_dialog_spend(self, session, usage, cost, now_ms).await
    }

    async fn dialog_spend(&self, session: SessionId) -> Result<DialogSpend> {
        SqliteStore::dialog_spend(self, session).await
    }

    async fn turn_calls(&self, session: Option<SessionId>, turn: TurnId) -> Result<Vec<CallSpan>> {
        SqliteStore::turn_calls(self, session, turn).await
    }

    async fn runs_calls(&self, runs: Vec<RunId>) -> Result<HashMap<RunId, Vec<CallSpan>>> {
        SqliteStore::runs_calls(self, runs).await
    }

    async fn commit_paused_turn(&self, commit: PausedTurnCommit) -> Result<TurnCommitted> {
        SqliteStore::commit_paused_turn(self, commit).await
    }

    async fn get_approval(&self, id: ApprovalId) -> Result<Option<ApprovalRecord>> {
        SqliteStore::get_approval(self, id).await
    }

    async fn list_approvals(
        &self,
        session_id: SessionId,
        pending_only: bool,
    ) -> Result<Vec<ApprovalRecord>> {
        SqliteStore::list_approvals(self, session_id, pending_only).await
    }

    async fn approval_grants(&self, session_id: SessionId) -> Result<Vec<String>> {
        SqliteStore::approval_grants(self, session_id).await
    }

    async fn decide_approval(&self, d: DecideApproval) -> Result<DecideOutcome> {
        SqliteStore::decide_approval(self, d).await
    }

    async fn expire_approvals(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>> {
        SqliteStore::expire_approvals(self, session_id, now_ms).await
    }

    async fn approval_schedule(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<ApprovalSchedule> {
        SqliteStore::approval_schedule(self, session_id, now_ms).await
    }

    async fn sessions_with_open_approvals(&self) -> Result<Vec<SessionId>> {
        SqliteStore::sessions_with_open_approvals(self).await
    }

    async fn unsettled_approvals(
        &self,
        session_id: SessionId,
        turn_id: TurnId,
    ) -> Result<Vec<ApprovalRecord>> {
        SqliteStore::unsettled_approvals(self, session_id, turn_id).await
    }

    async fn begin_approved_execution(&self, id: ApprovalId, now_ms: i64) -> Result<bool> {
        SqliteStore::begin_approved_execution(self, id, now_ms).await
    }

    async fn commit_approval_results(&self, commit: ApprovalResultCommit) -> Result<TurnCommitted> {
        SqliteStore::commit_approval_results(self, commit).await
    }

    async fn due_webhook_deliveries(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        SqliteStore::due_webhook_deliveries(self, now_ms, limit).await
    }

    async fn next_webhook_due(&self) -> Result<Option<i64>> {
        SqliteStore::next_webhook_due(self).await
    }

    async fn record_webhook_attempt(
        &self,
        id: String,
        outcome: AttemptOutcome,
        now_ms: i64,
    ) -> Result<Option<DeliveryStatus>> {
        SqliteStore::record_webhook_attempt(self, id, outcome, now_ms).await
    }

    async fn list_webhook_deliveries(
        &self,
        status: Option<DeliveryStatus>,
        cursor: Option<i64>,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        SqliteStore::list_webhook_deliveries(self, status, cursor, limit).await
    }

    async fn commit_mcp_manifest(
        &self,
        record: McpManifestRecord,
    ) -> Result<Option<McpManifestRecord>> {
        SqliteStore::commit_mcp_manifest(self, record).await
    }

    async fn mcp_manifests(&self) -> Result<Vec<McpManifestRecord>> {
        SqliteStore::mcp_manifests(self).await
    }

    async fn activate_runtime(&self, holder: String, now_ms: i64) -> Result<Activation> {
        SqliteStore::activate_runtime(self, holder, now_ms).await
    }

    async fn runtime_generation(&self) -> Result<Option<(u64, String)>> {
        SqliteStore::runtime_generation(self).await
    }

    async fn recover_older_generations(
        &self,
        active_generation: u64,
        now_ms: i64,
    ) -> Result<RecoveryReport> {
        SqliteStore::recover_older_generations(self, active_generation, now_ms).await
    }

    async fn accept_run(&self, request: AcceptRun) -> Result<AcceptedRun> {
        SqliteStore::accept_run(self, request).await
    }

    async fn accept_agent_group(&self, request: AcceptGroup) -> Result<AcceptedGroup> {
        SqliteStore::accept_agent_group(self, request).await
    }

    async fn mark_run_running(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        SqliteStore::mark_run_running(self, run_id, execution_id, now_ms).await
    }

    async fn mark_run_waiting_children(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        SqliteStore::mark_run_waiting_children(self, run_id, execution_id, now_ms).await
    }

    async fn commit_terminal(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
    ) -> Result<TerminalCommit> {
        SqliteStore::commit_terminal(self, run_id, execution_id, outcome, handling, now_ms).await
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
        SqliteStore::commit_run_end(self, run_id, execution_id, outcome, handling, now_ms, calls)
            .await
    }

    async fn cancel_session(
        &self,
        root_session_id: SessionId,
        reason: String,
        now_ms: i64,
    ) -> Result<CancelReport> {
        SqliteStore::cancel_session(self, root_session_id, reason, now_ms).await
    }

    async fn commit_paused_run(&self, commit: PausedRunCommit) -> Result<bool> {
        SqliteStore::commit_paused_run(self, commit).await
    }

    async fn resume_paused_run(
        &self,
        run_id: RunId,
        execution_id: String,
        runtime_generation: u64,
        now_ms: i64,
    ) -> Result<Option<ResumedRun>> {
        SqliteStore::resume_paused_run(self, run_id, execution_id, runtime_generation, now_ms).await
    }

    async fn waiting_runs(&self, session_id: SessionId) -> Result<Vec<RunRecord>> {
        SqliteStore::waiting_runs(self, session_id).await
    }

    async fn get_run(&self, run_id: RunId) -> Result<Option<RunRecord>> {
        SqliteStore::get_run(self, run_id).await
    }

    async fn get_group(&self, group_id: GroupId) -> Result<Option<GroupRecord>> {
        SqliteStore::get_group(self, group_id).await
    }

    async fn group_runs(&self, group_id: GroupId) -> Result<Vec<RunRecord>> {
        SqliteStore::group_runs(self, group_id).await
    }

    async fn child_runs(&self, parent_run_id: RunId) -> Result<Vec<RunRecord>> {
        SqliteStore::child_runs(self, parent_run_id).await
    }

    async fn list_runs(
        &self,
        root_session_id: SessionId,
        cursor: Option<RunCursor>,
        limit: usize,
    ) -> Result<Page<RunRecord, RunCursor>> {
        SqliteStore::list_runs(self, root_session_id, cursor, limit).await
    }

    async fn session_runs(&self, root: SessionId) -> Result<Vec<RunRecord>> {
        SqliteStore::session_runs(self, root).await
    }

    async fn reconcile_counters(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
    ) -> Result<Option<CounterRepair>> {
        SqliteStore::reconcile_counters(self, root_session_id, now_ms).await
    }

    async fn inbox_counts(&self, root_session_id: SessionId) -> Result<InboxCounts> {
        SqliteStore::inbox_counts(self, root_session_id).await
    }

    async fn inbox_usage(&self, root_session_id: SessionId) -> Result<InboxUsage> {
        SqliteStore::inbox_usage(self, root_session_id).await
    }

    async fn insert_signal(&self, signal: NewSignal) -> Result<SignalCommit> {
        SqliteStore::insert_signal(self, signal).await
    }

    async fn claim_inbox_batch(&self, request: ClaimRequest) -> Result<Option<InboxLease>> {
        SqliteStore::claim_inbox_batch(self, request).await
    }

    async fn admit_inbox_events(
        &self,
        event_ids: Vec<EventId>,
        lease_token: String,
        turn_id: TurnId,
        now_ms: i64,
    ) -> Result<u64> {
        SqliteStore::admit_inbox_events(self, event_ids, lease_token, turn_id, now_ms).await
    }

    async fn release_inbox_lease(&self, request: ReleaseRequest) -> Result<ReleaseReport> {
        SqliteStore::release_inbox_lease(self, request).await
    }

    async fn dead_letter_events(
        &self,
        event_ids: Vec<EventId>,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        SqliteStore::dead_letter_events(self, event_ids, reason, now_ms).await
    }

    async fn commit_continuation_turn(
        &self,
        commit: ContinuationCommit,
    ) -> Result<ContinuationCommitted> {
        SqliteStore::commit_continuation_turn(self, commit).await
    }

    async fn unnotified_dead_letters(&self, root_session_id: SessionId) -> Result<Vec<InboxEvent>> {
        SqliteStore::unnotified_dead_letters(self, root_session_id).await
    }

    async fn commit_dead_letter_notice(&self, commit: NoticeCommit) -> Result<TurnCommitted> {
        SqliteStore::commit_dead_letter_notice(self, commit).await
    }

    async fn supersede_run_signals(&self, run_id: RunId, now_ms: i64) -> Result<u64> {
        SqliteStore::supersede_run_signals(self, run_id, now_ms).await
    }

    async fn list_signals(
        &self,
        root_session_id: SessionId,
        limit: usize,
    ) -> Result<Vec<InboxEvent>> {
        SqliteStore::list_signals(self, root_session_id, limit).await
    }

    async fn list_inbox_events(&self, root_session_id: SessionId) -> Result<Vec<InboxEvent>> {
        SqliteStore::list_inbox_events(self, root_session_id).await
    }

    async fn inbox_schedule(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<InboxSchedule> {
        SqliteStore::inbox_schedule(self, root_session_id, now_ms, ttl_ms).await
    }

    async fn dead_letter_expired_events(
        &self,
        root_session_id: SessionId,
        created_by_ms: i64,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        SqliteStore::dead_letter_expired_events(
            self,
            root_session_id,
            created_by_ms,
            reason,
            now_ms,
        )
        .await
    }

    async fn query_runs(&self, query: RunQuery) -> Result<Page<RunRecord, RunCursor>> {
        SqliteStore::query_runs(self, query).await
    }

    async fn query_session_events(
        &self,
        root_session_id: SessionId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        SqliteStore::query_session_events(self, root_session_id, cursor, limit).await
    }

    async fn run_events(
        &self,
        run_id: RunId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        SqliteStore::run_events(self, run_id, cursor, limit).await
    }

    async fn agent_changes_since(
        &self,
        root_session_id: SessionId,
        since_revision: u64,
        limit: usize,
    ) -> Result<AgentChanges> {
        SqliteStore::agent_changes_since(self, root_session_id, since_revision, limit).await
    }

    async fn inbox_gauges(&self) -> Result<InboxGauges> {
        SqliteStore::inbox_gauges(self).await
    }

    async fn run_tree(&self, id: RunId) -> Result<Vec<RunRecord>> {
        SqliteStore::run_tree(self, id).await
    }

    async fn turn_runs(&self, session: Option<SessionId>, turn: TurnId) -> Result<Vec<RunRecord>> {
        SqliteStore::turn_runs(self, session, turn).await
    }

    async fn check_invariants(&self, options: CheckOptions) -> Result<InvariantReport> {
        SqliteStore::check_invariants(self, options).await
    }

    async fn recount_message_counts(&self) -> Result<usize> {
        SqliteStore::recount_message_counts(self).await
    }

    async fn train_dictionary_if_due(&self, now_ms: i64) -> Result<Option<u32>> {
        SqliteStore::train_dictionary_if_due(self, now_ms).await
    }
}
