//! The records, requests and reports of runs and groups.

use keel_core::{
    text_enum, AgentId, CompletionPolicy, Delivery, EventId, ExecutionMode, GroupId, RunId,
    RunStatus, SessionId, TurnId, Usage, Usd,
};

use crate::counters::CounterRepair;

text_enum!(
    /// Lifecycle state of a run group.
    GroupStatus, "group status" {
        /// Accepted, no run started.
        Queued = "queued",
        /// At least one run started, not all terminal.
        Running = "running",
        /// Every run completed.
        Completed = "completed",
        /// Some runs completed, some did not.
        Partial = "partial",
        /// No run completed.
        Failed = "failed",
        /// Every run timed out.
        TimedOut = "timed_out",
        /// Every run was cancelled.
        Cancelled = "cancelled",
        /// Every run was interrupted by a runtime restart.
        Interrupted = "interrupted",
    }
);

impl GroupStatus {
    /// Whether the group can no longer change state.
    pub fn is_terminal(self) -> bool {
        !matches!(self, GroupStatus::Queued | GroupStatus::Running)
    }
}

/// A run to accept.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRun {
    /// Its id.
    pub id: RunId,
    /// The root session the run's tree belongs to (its inbox receives the completion).
    pub root_session_id: SessionId,
    /// The root turn that started the tree, if known.
    pub root_turn_id: Option<TurnId>,
    /// The delegating run (None when the root agent delegates).
    pub parent_run_id: Option<RunId>,
    /// The delegating agent.
    pub caller_agent_id: AgentId,
    /// The caller's scope for idempotency (its run id or the root turn).
    pub caller_scope_id: String,
    /// Idempotency key of a single-run request (ignored inside a group).
    pub idempotency_key: Option<String>,
    /// The agent definition that runs.
    pub agent_id: AgentId,
    /// Hash of that definition.
    pub definition_hash: String,
    /// Provider profile name.
    pub provider_profile: String,
    /// Provider name.
    pub provider_name: String,
    /// Model id.
    pub model_id: String,
    /// Foreground or background.
    pub mode: ExecutionMode,
    /// Delegation depth (1 for a child of the root).
    pub depth: u32,
    /// Bound plan item, if any.
    pub plan_item_id: Option<String>,
    /// The execution that owns the run; every later transition must present it.
    pub execution_id: String,
    /// The task text.
    pub task: String,
    /// Extra context (JSON).
    pub context_json: Option<String>,
    /// Budget (JSON).
    pub budget_json: String,
    /// Signal contract (JSON), if the definition has one.
    pub signal_contract_json: Option<String>,
    /// Delivery of the run's signals.
    pub signal_delivery: Option<Delivery>,
    /// Delivery of a successful completion.
    pub completion_delivery: Option<Delivery>,
    /// Delivery of a failed completion.
    pub failure_delivery: Option<Delivery>,
    /// Runtime generation that owns the run.
    pub runtime_generation: u64,
    /// Deadline (ms).
    pub deadline_at_ms: i64,
}

/// A stored run: what was accepted, and how far it got.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord {
    /// The run as accepted; it never changes afterwards. A run accepted in a
    /// group has no idempotency key (the group's key covers it).
    pub spec: NewRun,
    /// Its group, if it was accepted in a batch.
    pub group_id: Option<GroupId>,
    /// Status.
    pub status: RunStatus,
    /// Full result of a completed run.
    pub result: Option<String>,
    /// Error of a failed, timed-out, cancelled or interrupted run.
    pub error: Option<String>,
    /// Token usage, once known.
    pub usage: Option<Usage>,
    /// Cost, once known.
    pub cost: Option<f64>,
    /// Tool calls made.
    pub tool_calls_count: u32,
    /// Loop iterations made.
    pub iterations: u32,
    /// Attempt number.
    pub attempt: u32,
    /// Whether it holds a completion slot in the root inbox.
    pub completion_slot_reserved: bool,
    /// Client revision of its last change.
    pub revision: u64,
    /// Start time (ms).
    pub started_at_ms: Option<i64>,
    /// End time (ms).
    pub finished_at_ms: Option<i64>,
    /// Creation time (ms).
    pub created_at_ms: i64,
    /// Last update (ms).
    pub updated_at_ms: i64,
}

/// A group to accept (a batch delegation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewGroup {
    /// Its id.
    pub id: GroupId,
    /// Root session.
    pub root_session_id: SessionId,
    /// Delegating run (None for the root agent).
    pub caller_run_id: Option<RunId>,
    /// Caller scope for idempotency.
    pub caller_scope_id: String,
    /// Idempotency key of the batch request.
    pub idempotency_key: Option<String>,
    /// Foreground or background.
    pub mode: ExecutionMode,
    /// One completion for the group (`All`) or one per run (`Each`).
    pub completion_policy: CompletionPolicy,
    /// Delivery of a successful group completion.
    pub completion_delivery: Option<Delivery>,
    /// Delivery of a group completion with failures.
    pub failure_delivery: Option<Delivery>,
    /// Deadline (ms).
    pub deadline_at_ms: i64,
    /// Owning runtime generation.
    pub runtime_generation: u64,
}

/// A stored group: what was accepted, and how many of its runs ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    /// The group as accepted; it never changes afterwards.
    pub spec: NewGroup,
    /// Runs in the group.
    pub expected_runs: u32,
    /// Runs that ended.
    pub terminal_runs: u32,
    /// Runs that ended other than completed.
    pub abnormal_runs: u32,
    /// Whether the group holds a completion slot.
    pub completion_slot_reserved: bool,
    /// Status.
    pub status: GroupStatus,
    /// Client revision of its last change.
    pub revision: u64,
    /// Creation time (ms).
    pub created_at_ms: i64,
    /// Last update (ms).
    pub updated_at_ms: i64,
    /// End time (ms).
    pub finished_at_ms: Option<i64>,
}

/// Accept one run (no group); a background run reserves a completion slot.
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptRun {
    /// The run.
    pub run: NewRun,
    /// Inbox capacity of the root session (pending events + reservations).
    pub inbox_capacity: u32,
    /// Now (ms).
    pub now_ms: i64,
}

/// Result of [`Backend::accept_run`](crate::Backend::accept_run)(crate::Store::accept_run).
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptedRun {
    /// The run (the earlier one when `existing`).
    pub run: RunRecord,
    /// True when the idempotency key matched an earlier request; nothing was written.
    pub existing: bool,
}

/// Accept a group of runs; background `All` reserves one slot for the group, `Each` one per run.
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptGroup {
    /// The group.
    pub group: NewGroup,
    /// Its runs (at least one; their idempotency keys are ignored).
    pub runs: Vec<NewRun>,
    /// Inbox capacity of the root session.
    pub inbox_capacity: u32,
    /// Now (ms).
    pub now_ms: i64,
}

/// Result of [`Backend::accept_agent_group`](crate::Backend::accept_agent_group)(crate::Store::accept_agent_group).
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptedGroup {
    /// The group.
    pub group: GroupRecord,
    /// Its runs, in creation order.
    pub runs: Vec<RunRecord>,
    /// True when the idempotency key matched an earlier request; nothing was written.
    pub existing: bool,
}

/// How a run ended, as reported by its runner.
#[derive(Debug, Clone, PartialEq)]
pub enum TerminalOutcome {
    /// Finished with a result.
    Completed {
        /// The full result.
        result: String,
        /// Tokens used.
        usage: Usage,
        /// Tool calls made.
        tool_calls: u32,
        /// Loop iterations made.
        iterations: u32,
        /// What its model calls cost, when its profile has prices.
        cost: Option<Usd>,
    },
    /// Finished with an error.
    Failed {
        /// The error.
        error: String,
        /// Tokens used, if known.
        usage: Option<Usage>,
    },
    /// Passed its deadline.
    TimedOut {
        /// The deadline (ms).
        deadline_at_ms: i64,
    },
    /// Cancelled.
    Cancelled {
        /// Why.
        reason: String,
    },
    /// Stopped by a runtime restart.
    Interrupted {
        /// Why.
        reason: String,
    },
    /// Stopped before a model call that would have passed a spend budget.
    BudgetExhausted {
        /// Which budget, and what was spent of it.
        error: String,
        /// Tokens the run's own model calls used.
        usage: Usage,
        /// What they cost, when its profile has prices.
        cost: Option<Usd>,
    },
}

impl TerminalOutcome {
    /// The run status this outcome records.
    pub fn status(&self) -> RunStatus {
        match self {
            TerminalOutcome::Completed { .. } => RunStatus::Completed,
            TerminalOutcome::Failed { .. } => RunStatus::Failed,
            TerminalOutcome::TimedOut { .. } => RunStatus::TimedOut,
            TerminalOutcome::Cancelled { .. } => RunStatus::Cancelled,
            TerminalOutcome::Interrupted { .. } => RunStatus::Interrupted,
            TerminalOutcome::BudgetExhausted { .. } => RunStatus::BudgetExhausted,
        }
    }
}

/// What a terminal commit did.
#[derive(Debug, Clone, PartialEq)]
pub struct TerminalCommit {
    /// True for the one commit that moved the run to a terminal state; false for a late or stale one (nothing written).
    pub won: bool,
    /// The run as stored after the commit.
    pub run: RunRecord,
    /// The inbox event created (run completion or group completion), if any.
    pub event_id: Option<EventId>,
    /// The group, if this commit finished it.
    pub finished_group: Option<GroupRecord>,
}

/// What [`Backend::cancel_session`](crate::Backend::cancel_session)(crate::Store::cancel_session) changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CancelReport {
    /// Runs moved to cancelled.
    pub runs_cancelled: Vec<RunId>,
    /// Groups moved to cancelled.
    pub groups_cancelled: u64,
    /// Completion slots released.
    pub reservations_released: u64,
    /// Inbox events dead-lettered.
    pub events_dead_lettered: u64,
}

/// What [`Backend::recover_older_generations`](crate::Backend::recover_older_generations)(crate::Store::recover_older_generations) changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Runs of older generations moved to interrupted.
    pub interrupted_runs: Vec<RunId>,
    /// Completion events created for them (from their reservations).
    pub completion_events: u64,
    /// Groups finished during recovery.
    pub groups_finished: u64,
    /// Expired leases returned to pending.
    pub leases_expired: u64,
    /// Counters that were wrong, with before/after.
    pub counters_repaired: Vec<CounterRepair>,
    /// Root sessions whose inbox has work: pending events, due or backing
    /// off, or untold dead letters (wake each once; its worker then sleeps
    /// until the next retry or expiry).
    pub sessions_with_inbox_work: Vec<SessionId>,
    /// Turn inputs an older process left open, now marked unanswered (set
    /// by [`Backend::activate_runtime`](crate::Backend::activate_runtime)(crate::Store::activate_runtime) only).
    pub unanswered_inputs: u64,
}

/// Where a run listing continues: the (created_at, id) of the last item seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunCursor {
    /// `created_at_ms` of the last item.
    pub created_at_ms: i64,
    /// `id` of the last item.
    pub id: RunId,
}

/// What becomes of the completion slot a run (or its `All` group) reserved
/// when the run ends. Runs without a reservation (foreground) write no event
/// whichever is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionHandling {
    /// Turn the reservation into a pending event that asks for a continuation.
    Deliver,
    /// Record the event as already consumed, without a continuation (the user stopped the turn).
    Quiet,
    /// Release the reservation, no event (session cancelled or deleted).
    Release,
}
