//! The storage boundary: [`Backend`], the transactions keel's engine and
//! gateway need, each one transaction with the guarantees its doc states,
//! whatever the database. keel-store implements it on SQLite
//! ([`crate::SqliteStore`]); keel-store-postgres on PostgreSQL. Callers hold
//! a [`crate::Store`], which is any backend.
//!
//! Every implementation keeps the same promises, checked by the one
//! conformance suite both run (`conformance`): an answer only after
//! COMMIT; terminal commits conditional on the execution id; exactly one
//! consumer per inbox event; unknown stored enum text is
//! [`crate::StoreError::Corruption`]; transient failures retried inside
//! the backend, constraint violations never.

use std::collections::HashMap;

use keel_core::{ApprovalId, CheckpointId, EventId, GroupId, RunId, SessionId, TurnId, Usage, Usd};

use crate::*;

/// Which dialogs [`Backend::dialogs_with_history_after`] keeps.
pub type DialogFilter = Box<dyn Fn(&SessionRecord) -> bool + Send + Sync>;

/// The transactions of a keel database. Implemented by
/// [`crate::SqliteStore`] and keel-store-postgres' `PgStore`.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Where the database is, for messages and logs (a path, or a URL
    /// without its password).
    fn location(&self) -> String;

    /// How many write transactions and requests the backend has handled.
    fn commit_stats(&self) -> CommitStats;

    /// The server-wide webhook URLs and the delivery worker's wake-up this
    /// backend's transactions use.
    fn hooks(&self) -> &WebhookHooks;

    // Sessions and dialogs (keel-store: sessions.rs)
    /// Creates a session with an empty root timeline; a taken id or (channel, chat_id, dialog_id) is a `Conflict`.
    async fn create_session(&self, session: NewSession) -> Result<SessionRecord>;
    /// Creates `session`, commits `turn` to it and writes its ended `runs`
    /// (parents first, already carrying their new ids and `session.id` as
    /// root) in one transaction, so a dialog brought in from elsewhere
    /// exists whole or not at all. `turn.session_id` must be `session.id`;
    /// its messages get seqs 1, 2, ….
    async fn import_session(
        &self,
        session: NewSession,
        turn: TurnCommit,
        runs: Vec<RunRecord>,
    ) -> Result<TurnCommitted>;
    /// Creates the session, or updates title, agent, parent and delivery context of the existing one with this id.
    async fn upsert_session(&self, session: NewSession) -> Result<SessionRecord>;
    /// The session with this id (deleted or not).
    async fn get_session(&self, id: SessionId) -> Result<Option<SessionRecord>>;
    /// The session of dialog (channel, chat_id, dialog_id), deleted or not.
    async fn get_dialog(
        &self,
        channel: &str,
        chat_id: &str,
        dialog_id: &str,
    ) -> Result<Option<SessionRecord>>;
    /// Dialogs of a chat, most recently created first, paginated by (created_at, id).
    async fn list_dialogs(&self, query: DialogQuery) -> Result<Page<SessionRecord, DialogCursor>>;
    /// The most recently active, not deleted dialog of a chat ("continue the last dialog").
    async fn latest_active_dialog(
        &self,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<SessionRecord>>;
    /// Sets a session's title.
    async fn rename_session(&self, id: SessionId, title: String, now_ms: i64) -> Result<()>;
    /// Soft-deletes a session (rows stay; listings skip it) and withdraws its
    /// queued inputs, which no turn will answer now. Returns false if it was
    /// already deleted.
    async fn soft_delete_session(&self, id: SessionId, now_ms: i64) -> Result<bool>;
    /// Records activity on a session at `now_ms`.
    async fn touch_session(&self, id: SessionId, now_ms: i64) -> Result<()>;
    /// Replaces the session's durable delivery context (JSON).
    async fn set_delivery_context(
        &self,
        id: SessionId,
        context: Option<String>,
        now_ms: i64,
    ) -> Result<()>;
    /// Child sessions of `parent`, oldest first (deleted ones included).
    async fn child_sessions(&self, parent: SessionId) -> Result<Vec<SessionRecord>>;

    // Messages and turns (keel-store: messages.rs)
    /// Commits a turn's input on its own, before the model is called (and
    /// only if the history still ends at `expected_head`): the
    /// messages are appended `open` (an input some earlier turn of the
    /// session left open is marked unanswered first) and the session's
    /// activity and `message_count` are bumped. Returns their seqs.
    async fn open_turn(&self, turn: OpenTurn) -> Result<Vec<i64>>;
    /// Marks the open inputs `seqs` (of the session's head) unanswered: their
    /// turn failed or was cancelled. Inputs no longer open are left as they
    /// are. Returns how many changed.
    /// Their webhooks (and the server-wide URLs) get a delivery saying so,
    /// in the same transaction.
    async fn mark_unanswered(&self, session_id: SessionId, seqs: Vec<i64>) -> Result<usize>;
    /// Appends one message to the session's head timeline; returns its seq (see [`Backend::append_messages`]).
    async fn append_message(
        &self,
        session_id: SessionId,
        message: NewMessage,
        now_ms: i64,
    ) -> Result<i64>;
    /// Appends messages in order in one transaction; returns their seqs. Does
    /// not touch `last_active_at` or `message_count` (see [`Backend::commit_turn`], [`Backend::touch_session`]).
    async fn append_messages(
        &self,
        session_id: SessionId,
        messages: Vec<NewMessage>,
        now_ms: i64,
    ) -> Result<Vec<i64>>;
    /// Commits a turn (messages + state + optional checkpoint + counters) in one transaction.
    async fn commit_turn(&self, turn: TurnCommit) -> Result<TurnCommitted>;
    /// The session's current history (its head timeline and ancestors), filtered, in seq order.
    async fn load_messages(
        &self,
        session_id: SessionId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>>;
    /// A page of the session's current history, oldest or newest first.
    /// Messages are only ever appended above the head, so a page sequence
    /// read oldest first never skips or repeats one; read newest first, new
    /// messages appear only before the first page.
    async fn load_message_page(
        &self,
        session_id: SessionId,
        page: MessagePage,
    ) -> Result<Vec<StoredMessage>>;
    /// The session's current history as (timeline, last seq) ranges, root
    /// first: a checkpoint at (timeline, seq) lies on the current branch when
    /// one range has its timeline and a last seq at or above its seq.
    async fn history_ranges(&self, session_id: SessionId) -> Result<Vec<(TimelineId, i64)>>;
    /// The session's current history after `known`, a head the caller
    /// read before: only the messages past it when the history still
    /// continues it, else the whole history (`whole`). A history only
    /// grows on its head timeline (a rollback moves the head to a new
    /// one), so what ended at `known` is still the same prefix.
    async fn history_after(
        &self,
        session_id: SessionId,
        known: Option<SessionHead>,
        filter: MessageFilter,
    ) -> Result<HistoryDelta>;
    /// A chat's dialogs as [`Backend::list_dialogs`] lists them (one page),
    /// those `wanted` keeps each with its history after the head `known`
    /// holds for it (see [`Backend::history_after`]), in one read.
    async fn dialogs_with_history_after(
        &self,
        query: DialogQuery,
        wanted: DialogFilter,
        known: HashMap<SessionId, SessionHead>,
        filter: MessageFilter,
    ) -> Result<Vec<(SessionRecord, HistoryDelta)>>;
    /// The messages a checkpoint saw, filtered, in seq order.
    async fn load_messages_at_checkpoint(
        &self,
        checkpoint_id: CheckpointId,
        filter: MessageFilter,
    ) -> Result<Vec<StoredMessage>>;
    /// The last seq of the session's current history (0 when empty).
    async fn last_seq(&self, session_id: SessionId) -> Result<i64>;

    // Queued input (keel-store: queued.rs)
    /// Commits `input` as queued for its turn (the session must exist and
    /// not be deleted): from now on it is durable, though not yet history.
    async fn queue_input(&self, input: QueuedInput) -> Result<()>;
    /// Withdraws the queued input of `turn_id` (an acknowledgement that was
    /// never sent, or a turn that cannot start). Returns whether it was queued.
    async fn discard_queued_input(&self, turn_id: TurnId) -> Result<bool>;
    /// The queued inputs of sessions not deleted that no live process will
    /// run, in the order they were acknowledged, now this process's to run
    /// (on a backend one process owns: every one of them).
    async fn queued_inputs(&self) -> Result<Vec<QueuedInput>>;

    // Images (keel-store: images.rs)
    /// Stores `bytes` (a PNG, JPEG, GIF or WebP, recognised by its magic
    /// bytes) unless an image with the same bytes is stored; answers after
    /// COMMIT with the stored image's hash and media type (no bytes).
    async fn put_image(&self, bytes: Vec<u8>) -> Result<StoredImage>;
    /// The stored image whose SHA-256 is `sha256`, its bytes verified
    /// against the hash; `None` when none is stored.
    async fn image(&self, sha256: &str) -> Result<Option<StoredImage>>;
    /// Which of `hashes` name no stored image.
    async fn missing_images(&self, hashes: Vec<String>) -> Result<Vec<String>>;

    // Checkpoints, rollback and fork (keel-store: checkpoints.rs)
    /// Records a manual checkpoint at the session's current head with `state` as its state.
    async fn create_checkpoint(
        &self,
        session_id: SessionId,
        checkpoint: NewCheckpoint,
        state: Vec<u8>,
        now_ms: i64,
    ) -> Result<CheckpointRecord>;
    /// Moves the session back to `checkpoint_id`: a new head timeline branching at
    /// that point, its state, and a `rollback` checkpoint. O(1) rows; the old branch stays.
    async fn rollback(
        &self,
        session_id: SessionId,
        checkpoint_id: CheckpointId,
        new_checkpoint_id: CheckpointId,
        now_ms: i64,
    ) -> Result<CheckpointRecord>;
    /// Creates `session` whose history is `checkpoint_id`'s prefix (no copy) and its first `fork` checkpoint.
    async fn fork(
        &self,
        checkpoint_id: CheckpointId,
        session: NewSession,
        new_checkpoint_id: CheckpointId,
    ) -> Result<(SessionRecord, CheckpointRecord)>;
    /// Every checkpoint of a session, newest first, abandoned branches included.
    async fn list_checkpoints(&self, session_id: SessionId) -> Result<Vec<CheckpointRecord>>;
    /// A session's checkpoints, abandoned branches included, newest first,
    /// `limit` (1..=1000) at a time. New checkpoints sort before every
    /// cursor, so a page sequence never repeats or skips one.
    async fn checkpoint_page(
        &self,
        session_id: SessionId,
        cursor: Option<CheckpointCursor>,
        limit: usize,
    ) -> Result<Page<CheckpointRecord, CheckpointCursor>>;
    /// The session's newest checkpoint (the parent of its next one), if any.
    async fn latest_checkpoint(&self, session_id: SessionId) -> Result<Option<CheckpointRecord>>;
    /// One checkpoint.
    async fn get_checkpoint(&self, id: CheckpointId) -> Result<Option<CheckpointRecord>>;
    /// The bytes of a state blob.
    async fn get_state_blob(&self, hash: String) -> Result<Option<Vec<u8>>>;
    /// Sessions with more than `keep` turn checkpoints: those retention may prune.
    async fn sessions_over_turn_checkpoints(&self, keep: usize) -> Result<Vec<SessionId>>;
    /// Gives up to `max_pages` free pages back to the file system (incremental
    /// auto-vacuum; a database without it keeps them for reuse); returns how many.
    async fn reclaim_pages(&self, max_pages: u32) -> Result<u64>;
    /// Deletes every checkpoint of a session (bounded batches), then what nothing reaches any more.
    async fn delete_checkpoints(&self, session_id: SessionId) -> Result<PruneReport>;
    /// Deletes the turn checkpoints `policy` selects (see [`PrunePolicy`]), in bounded
    /// batches, then the timelines, messages and blobs nothing reaches any more.
    async fn prune_checkpoints(
        &self,
        session_id: SessionId,
        policy: PrunePolicy,
    ) -> Result<PruneReport>;

    // A dialog's whole tree (export and import) (keel-store: tree.rs)
    /// The history tree of `session`, read in one snapshot.
    async fn dialog_tree(&self, session: SessionId) -> Result<DialogTree>;
    /// Creates `session` with the whole history `tree` and its ended `runs`
    /// (see [`Backend::import_session`]) in one transaction: the session
    /// exists whole or not at all.
    async fn import_session_tree(
        &self,
        session: NewSession,
        tree: ImportTree,
        runs: Vec<RunRecord>,
    ) -> Result<SessionRecord>;

    // Purge of deleted dialogs (keel-store: purge.rs)
    /// Deleted sessions whose deletion is at or before `deleted_before_ms`,
    /// newest created first (so a fork goes before the dialog it was forked from).
    async fn deleted_sessions_before(&self, deleted_before_ms: i64) -> Result<Vec<SessionId>>;
    /// Removes a soft-deleted session and every row that belongs to it, in
    /// bounded batches, each its own transaction (safe to interrupt; the next
    /// purge carries on). A session that is not deleted is refused.
    /// Timelines another session branches from stay, with the session row.
    /// State blobs are swept by [`Backend::sweep_state_blobs`].
    async fn purge_session(&self, session_id: SessionId) -> Result<PurgeReport>;
    /// Deletes every state blob no session and no checkpoint references; returns how many.
    async fn sweep_state_blobs(&self) -> Result<u64>;
    /// What a dialog occupies: its checkpoints, and the bytes of the text
    /// and blob values stored in its rows as SQLite stores them
    /// (`octet_length`): every column of the messages on its own timelines
    /// and of its checkpoints, the state blobs its head and checkpoints
    /// reference (each once, hash and bytes), its runs' task, context,
    /// result and error, and its inbox events' payloads. Integers and
    /// SQLite's per-row, page and index overhead are not counted.
    async fn dialog_usage(&self, session_id: SessionId) -> Result<DialogUsage>;

    // Spend (keel-store: spend.rs)
    /// Adds one model call's `usage` and `cost` to the spend of `session`;
    /// returns the dialog's spend after it.
    async fn add_dialog_spend(
        &self,
        session: SessionId,
        usage: Usage,
        cost: Usd,
        now_ms: i64,
    ) -> Result<DialogSpend>;
    /// What `session` spent so far (nothing for a dialog with no model call).
    async fn dialog_spend(&self, session: SessionId) -> Result<DialogSpend>;

    // Call spans (the trace view) (keel-store: calls.rs)
    /// The stored calls of root turn `turn` (of dialog `session` only,
    /// when given), in the order they started.
    async fn turn_calls(&self, session: Option<SessionId>, turn: TurnId) -> Result<Vec<CallSpan>>;
    /// The stored calls of each of `runs` (those with none are absent),
    /// each in the order they started; one read.
    async fn runs_calls(&self, runs: Vec<RunId>) -> Result<HashMap<RunId, Vec<CallSpan>>>;

    // Approvals (keel-store: approvals.rs)
    /// Commits a turn that paused for approval — its messages, state and
    /// checkpoint, and one pending approval per gated call — in one
    /// transaction.
    async fn commit_paused_turn(&self, commit: PausedTurnCommit) -> Result<TurnCommitted>;
    /// One approval, or `None`.
    async fn get_approval(&self, id: ApprovalId) -> Result<Option<ApprovalRecord>>;
    /// The session's approvals, oldest first (only those still waiting
    /// when `pending_only`).
    async fn list_approvals(
        &self,
        session_id: SessionId,
        pending_only: bool,
    ) -> Result<Vec<ApprovalRecord>>;
    /// The tools the dialog approved for good ("approve always").
    async fn approval_grants(&self, session_id: SessionId) -> Result<Vec<String>>;
    /// Commits a person's decision on a pending approval (and, for
    /// [`Decision::ApproveAlways`], the dialog's grant of the tool). An
    /// unknown approval, one of another dialog than `session_id`, or one of
    /// a deleted dialog is `NotFound`.
    async fn decide_approval(&self, d: DecideApproval) -> Result<DecideOutcome>;
    /// Records the session's pending approvals past `now_ms` as expired (a
    /// denial); returns them.
    async fn expire_approvals(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>>;
    /// What the session's worker must do about approvals at `now_ms`
    /// (nothing for a deleted dialog).
    async fn approval_schedule(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<ApprovalSchedule>;
    /// Dialogs (not deleted) with approvals not yet settled: a new process
    /// wakes their workers, which arm the expiry timers and resume what was
    /// decided.
    async fn sessions_with_open_approvals(&self) -> Result<Vec<SessionId>>;
    /// The approvals of root turn `turn_id` not yet settled, oldest first.
    async fn unsettled_approvals(
        &self,
        session_id: SessionId,
        turn_id: TurnId,
    ) -> Result<Vec<ApprovalRecord>>;
    /// Marks an approved, unsettled call as started, before its tool runs.
    /// Returns false when it was started before (by a process that died
    /// before its result was committed): it must not run again.
    async fn begin_approved_execution(&self, id: ApprovalId, now_ms: i64) -> Result<bool>;
    /// Appends the tool results answering `commit.settle` to the history
    /// and settles those approvals, in one transaction (superseding them
    /// first when `commit.supersede` gives a reason). An approval that is
    /// settled already, or not in the state expected, fails the whole commit.
    async fn commit_approval_results(&self, commit: ApprovalResultCommit) -> Result<TurnCommitted>;

    // The webhook outbox (keel-store: webhooks.rs)
    /// Pending deliveries due at `now_ms`, oldest first, at most `limit`.
    async fn due_webhook_deliveries(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>>;
    /// When the earliest pending delivery is due (ms), if any is pending.
    async fn next_webhook_due(&self) -> Result<Option<i64>>;
    /// Records an attempt on the pending delivery `id`: delivered, retried
    /// later, or dead once `max_attempts` were made. Returns the new status
    /// (a row no longer pending is left as it is: `None`).
    async fn record_webhook_attempt(
        &self,
        id: String,
        outcome: AttemptOutcome,
        now_ms: i64,
    ) -> Result<Option<DeliveryStatus>>;
    /// Deliveries after `cursor` (a seq), oldest first, at most `limit`,
    /// only those in `status` when given.
    async fn list_webhook_deliveries(
        &self,
        status: Option<DeliveryStatus>,
        cursor: Option<i64>,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>>;

    // MCP manifests (keel-store: mcp.rs)
    /// Commits `record` as its server's manifest, replacing the one before;
    /// returns the one it replaced. An unchanged hash writes nothing.
    async fn commit_mcp_manifest(
        &self,
        record: McpManifestRecord,
    ) -> Result<Option<McpManifestRecord>>;
    /// Every committed manifest, by server name.
    async fn mcp_manifests(&self) -> Result<Vec<McpManifestRecord>>;

    // The runtime generation (keel-store: runtime.rs)
    /// Starts a new runtime generation on this database, in one
    /// transaction: the stored generation is bumped (past any generation a
    /// run was stamped with), `holder` recorded, and what older generations
    /// left unfinished is recovered (see [`Backend::recover_older_generations`];
    /// here every inbox lease returns to pending, expired or not).
    /// Every later write of this store (and its clones) is fenced to the new
    /// generation. Take a [`RuntimeLock`] first so no other process races it.
    async fn activate_runtime(&self, holder: String, now_ms: i64) -> Result<Activation>;
    /// The stored runtime generation and its holder (`None` before any activation).
    async fn runtime_generation(&self) -> Result<Option<(u64, String)>>;

    // Several processes on one database (keel-store: processes.rs). On a
    // backend one process owns (SQLite), these answer as that one process.
    /// Whether several processes may serve this database at once, each
    /// with its own generation: turns then run under session leases.
    fn shared(&self) -> bool {
        false
    }
    /// Renews this process's registration (made by
    /// [`Backend::activate_runtime`]) for another lease period; `Fenced`
    /// once another process found it expired and recovered it.
    async fn renew_runtime(&self) -> Result<()> {
        Ok(())
    }
    /// Recovers, in one transaction, every process whose registration
    /// expired: its row is deleted (its writes are refused from then on),
    /// its runs end as interrupted with their completions, and the inbox
    /// leases, session leases and open inputs of its sessions are released.
    /// `None` when no process had expired.
    async fn recover_expired_runtimes(&self, _now_ms: i64) -> Result<Option<ProcessRecovery>> {
        Ok(None)
    }
    /// Takes `session`'s turn lease for this process (held already: held
    /// again), unless another live process holds it. A session that does
    /// not exist is held without a lease (there is nothing to serialize).
    /// The holders of one session's lease within a process must take turns:
    /// the first release gives the lease back.
    async fn lease_session(&self, _session: SessionId) -> Result<SessionLease> {
        Ok(SessionLease::Held { moved: false })
    }
    /// Gives `session`'s lease back, if this process holds it.
    async fn release_session(&self, _session: SessionId) -> Result<()> {
        Ok(())
    }
    /// Messages to and from the other processes on this database (`None`
    /// on a backend one process owns).
    fn relay(&self) -> Option<std::sync::Arc<dyn Relay>> {
        None
    }

    // Recovery (keel-store: runs/recovery.rs)
    /// Run once when runtime generation `active_generation` starts, before it
    /// accepts work: runs of older generations that never finished become
    /// interrupted (with their completions), expired leases return to
    /// pending, and every root session's inbox usage is recomputed and
    /// repaired. Idempotent; nothing is stored about the generation itself.
    async fn recover_older_generations(
        &self,
        active_generation: u64,
        now_ms: i64,
    ) -> Result<RecoveryReport>;

    // Sub-agent runs: lifecycle (keel-store: runs/lifecycle.rs)
    /// Accepts one run: idempotency lookup, completion-slot reservation for a background run (capacity-checked), queued row.
    async fn accept_run(&self, request: AcceptRun) -> Result<AcceptedRun>;
    /// Accepts a group and its runs in one transaction with the reservation its policy needs.
    async fn accept_agent_group(&self, request: AcceptGroup) -> Result<AcceptedGroup>;
    /// queued/waiting_children → running, if `execution_id` owns the run. Returns whether it moved.
    async fn mark_run_running(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool>;
    /// running → waiting_children, if `execution_id` owns the run. Returns whether it moved.
    async fn mark_run_waiting_children(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool>;
    /// Ends a run if (run_id, execution_id, non-terminal) still holds; the winner
    /// converts the reservation into a completion (or the group's), else nothing is written.
    /// `handling` says what becomes of the run's completion slot, if it holds one.
    async fn commit_terminal(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
    ) -> Result<TerminalCommit>;
    /// [`Self::commit_terminal`], storing the run's model and tool `calls`
    /// (at most [`crate::MAX_CALL_SPANS`]) in the same transaction when the
    /// commit wins.
    async fn commit_run_end(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
        calls: Vec<CallSpan>,
    ) -> Result<TerminalCommit>;
    /// Cancels every non-terminal run of a root session, releases reservations, dead-letters pending events.
    async fn cancel_session(
        &self,
        root_session_id: SessionId,
        reason: String,
        now_ms: i64,
    ) -> Result<CancelReport>;

    // Sub-agent runs: approval pauses (keel-store: runs/pauses.rs)
    /// Commits a background run's pause for approval — status
    /// `waiting_approval`, what it did so far, one pending approval per gated
    /// call — in one transaction. Returns false (nothing written) when the
    /// run is no longer running under `execution_id` (it was cancelled).
    async fn commit_paused_run(&self, commit: PausedRunCommit) -> Result<bool>;
    /// Hands a run waiting for approval whose approvals are all decided to
    /// the new execution `execution_id` of `runtime_generation`, in one
    /// transaction; `None` when it is not such a run (resumed already,
    /// ended, or an approval still pending).
    async fn resume_paused_run(
        &self,
        run_id: RunId,
        execution_id: String,
        runtime_generation: u64,
        now_ms: i64,
    ) -> Result<Option<ResumedRun>>;
    /// The session's runs waiting for approval, oldest first.
    async fn waiting_runs(&self, session_id: SessionId) -> Result<Vec<RunRecord>>;

    // Sub-agent runs: reads (keel-store: runs/mod.rs)
    /// One run.
    async fn get_run(&self, run_id: RunId) -> Result<Option<RunRecord>>;
    /// One group.
    async fn get_group(&self, group_id: GroupId) -> Result<Option<GroupRecord>>;
    /// Runs of a group, in creation order.
    async fn group_runs(&self, group_id: GroupId) -> Result<Vec<RunRecord>>;
    /// Runs delegated by `parent_run_id`, oldest first.
    async fn child_runs(&self, parent_run_id: RunId) -> Result<Vec<RunRecord>>;
    /// Runs of a root session, newest first, paginated by (created_at, id)
    /// (a [`Backend::query_runs`] of one session).
    async fn list_runs(
        &self,
        root_session_id: SessionId,
        cursor: Option<RunCursor>,
        limit: usize,
    ) -> Result<Page<RunRecord, RunCursor>>;

    // Sub-agent runs of a dialog (keel-store: runs/import.rs)
    /// Every run of root session `root`, oldest first (parents before
    /// their children), for an export.
    async fn session_runs(&self, root: SessionId) -> Result<Vec<RunRecord>>;

    // Inbox counters (keel-store: counters.rs)
    /// Recomputes one root session's inbox usage from the rows; returns the repair if the stored counters were wrong.
    async fn reconcile_counters(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
    ) -> Result<Option<CounterRepair>>;
    /// How many of a root session's inbox events are in each delivery state
    /// (zeros if it never had any).
    async fn inbox_counts(&self, root_session_id: SessionId) -> Result<InboxCounts>;
    /// The inbox usage of a root session (zeros if it never had runs).
    async fn inbox_usage(&self, root_session_id: SessionId) -> Result<InboxUsage>;

    // The inbox: signals, completions, continuations (keel-store: inbox.rs)
    /// Inserts a signal of a running run: execution-id checked, deduplicated by key, capacity-checked.
    async fn insert_signal(&self, signal: NewSignal) -> Result<SignalCommit>;
    /// Leases the oldest due pending events of a root session (bounded by count and bytes); None if nothing is due.
    async fn claim_inbox_batch(&self, request: ClaimRequest) -> Result<Option<InboxLease>>;
    /// leased → admitted into `turn_id` (steer), if `lease_token` still holds them. Returns how many.
    async fn admit_inbox_events(
        &self,
        event_ids: Vec<EventId>,
        lease_token: String,
        turn_id: TurnId,
        now_ms: i64,
    ) -> Result<u64>;
    /// Returns leased/admitted events to pending with backoff, or dead-letters those out of attempts.
    async fn release_inbox_lease(&self, request: ReleaseRequest) -> Result<ReleaseReport>;
    /// Dead-letters open events (pending/leased/admitted); returns how many moved.
    async fn dead_letter_events(
        &self,
        event_ids: Vec<EventId>,
        reason: String,
        now_ms: i64,
    ) -> Result<u64>;
    /// Commits a turn and consumes the inbox events it answered in one
    /// transaction; a lost lease commits nothing.
    async fn commit_continuation_turn(
        &self,
        commit: ContinuationCommit,
    ) -> Result<ContinuationCommitted>;
    /// Dead-lettered events of a root session whose user was not told yet
    /// (oldest first); events dead-lettered by an archive or delete are never told.
    async fn unnotified_dead_letters(&self, root_session_id: SessionId) -> Result<Vec<InboxEvent>>;
    /// Commits a notice about dead-lettered events into their session's
    /// history and marks them told, in one transaction. Events already
    /// marked make the whole commit fail (another notice told of them).
    async fn commit_dead_letter_notice(&self, commit: NoticeCommit) -> Result<TurnCommitted>;
    /// Supersedes the pending signals of `run_id` (as a cancelled run's
    /// terminal commit does); returns how many.
    async fn supersede_run_signals(&self, run_id: RunId, now_ms: i64) -> Result<u64>;
    /// The signals of a root session's runs, newest first, at most `limit`.
    async fn list_signals(
        &self,
        root_session_id: SessionId,
        limit: usize,
    ) -> Result<Vec<InboxEvent>>;
    /// Events of a root session, oldest first.
    async fn list_inbox_events(&self, root_session_id: SessionId) -> Result<Vec<InboxEvent>>;
    /// When a root session's inbox has work: the creation time of its oldest
    /// pending event due at `now_ms`, and for those not yet due the earliest
    /// retry time or expiry (creation + `ttl_ms`), and how many expired.
    async fn inbox_schedule(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<InboxSchedule>;
    /// A dialog's approval and inbox schedules at `now_ms`, read together
    /// (a worker's step reads both): in one round trip where that costs one.
    async fn schedules(
        &self,
        session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<(ApprovalSchedule, InboxSchedule)> {
        Ok((
            self.approval_schedule(session_id, now_ms).await?,
            self.inbox_schedule(session_id, now_ms, ttl_ms).await?,
        ))
    }
    /// Dead-letters the pending events of a root session created at or
    /// before `created_by_ms` (past their time to live, due or backing off)
    /// with `reason`; their user is told like of any dead letter. Returns
    /// how many moved.
    async fn dead_letter_expired_events(
        &self,
        root_session_id: SessionId,
        created_by_ms: i64,
        reason: String,
        now_ms: i64,
    ) -> Result<u64>;

    // Projections for clients (keel-store: projection.rs)
    /// Runs matching `query`, newest first. New runs sort before every
    /// cursor, so a page sequence never repeats or skips an item however
    /// many runs start meanwhile.
    async fn query_runs(&self, query: RunQuery) -> Result<Page<RunRecord, RunCursor>>;
    /// Inbox events of a root session (signals and completions, whatever
    /// their status), newest first, `limit` (1..=1000) at a time. New
    /// events sort before every cursor, so a page sequence never repeats or
    /// skips one however many arrive meanwhile.
    async fn query_session_events(
        &self,
        root_session_id: SessionId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>>;
    /// Inbox events about one run (its signals and completion), oldest
    /// first, `limit` (1..=1000) at a time. New events sort after every
    /// cursor, so a page sequence never repeats or skips one.
    async fn run_events(
        &self,
        run_id: RunId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>>;
    /// Runs and events of `root_session_id` changed after `since_revision`,
    /// each in revision order, with the session's current revision; at most
    /// `limit` (1..=1000) of each. A caller that gets `limit` of either asks
    /// again from the smaller of the two last revisions it saw.
    async fn agent_changes_since(
        &self,
        root_session_id: SessionId,
        since_revision: u64,
        limit: usize,
    ) -> Result<AgentChanges>;

    // Observation (gauges, run trees) (keel-store: observe.rs)
    /// The inbox gauges: two counts over the status index of
    /// `agent_inbox_events`, in one snapshot.
    async fn inbox_gauges(&self) -> Result<InboxGauges>;
    /// Run `id` and every run below it (through `parent_run_id`), oldest
    /// first; empty when there is no such run.
    async fn run_tree(&self, id: RunId) -> Result<Vec<RunRecord>>;
    /// Every run root turn `turn` started, at any depth, oldest first. With
    /// `session`, only that dialog's (an index read); without, every
    /// dialog's runs are looked through (for `keel trace`, run once).
    async fn turn_runs(&self, session: Option<SessionId>, turn: TurnId) -> Result<Vec<RunRecord>>;

    // Invariants (keel-store: check.rs)
    /// Checks every invariant in one read snapshot (see [`check_database`]),
    /// on a reader thread.
    async fn check_invariants(&self, options: CheckOptions) -> Result<InvariantReport>;
    /// Sets every live dialog's message count to the visible user messages
    /// of its current history (builds before forks and rollbacks carried
    /// the count left some wrong); returns how many changed.
    async fn recount_message_counts(&self) -> Result<usize>;

    // Compression dictionaries (keel-store: compact.rs)
    /// Trains the database's zstd dictionary when it has none and holds
    /// enough to learn from (its newest messages and states), off the turn
    /// path (the retention pass calls it; training runs on a blocking
    /// thread, only the insert on the writer). Returns the new
    /// dictionary's id, `None` when not due.
    async fn train_dictionary_if_due(&self, now_ms: i64) -> Result<Option<u32>>;
}
