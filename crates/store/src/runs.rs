//! Durable sub-agent runs and groups (seed 002 §8.3–§8.6): acceptance with
//! completion-slot reservation, state transitions conditional on the
//! execution id, the terminal commit that converts a reservation into an
//! inbox event, session cancellation and activation recovery. Every public
//! operation is exactly one transaction.

use keel_core::{
    AgentId, CompletionPolicy, Delivery, EventId, ExecutionMode, GroupId, RunId, RunStatus,
    SessionId, TurnId, Usage,
};
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::error::{Result, StoreError};
use crate::inbox::{insert_event_tx, EventType, NewEventRow, ScopeKind};
use crate::util::{non_negative, parse, parse_opt, to_i64};
use crate::{Page, Store};

const NONTERMINAL_RUN: &str = "('queued', 'running', 'waiting_children')";

/// Lifecycle state of a run group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupStatus {
    /// Accepted, no run started.
    Queued,
    /// At least one run started, not all terminal.
    Running,
    /// Every run completed.
    Completed,
    /// Some runs completed, some did not.
    Partial,
    /// No run completed.
    Failed,
    /// Every run timed out.
    TimedOut,
    /// Every run was cancelled.
    Cancelled,
    /// Every run was interrupted by a runtime restart.
    Interrupted,
}

impl GroupStatus {
    /// The stable text form used on disk.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupStatus::Queued => "queued",
            GroupStatus::Running => "running",
            GroupStatus::Completed => "completed",
            GroupStatus::Partial => "partial",
            GroupStatus::Failed => "failed",
            GroupStatus::TimedOut => "timed_out",
            GroupStatus::Cancelled => "cancelled",
            GroupStatus::Interrupted => "interrupted",
        }
    }

    /// Whether the group can no longer change state.
    pub fn is_terminal(self) -> bool {
        !matches!(self, GroupStatus::Queued | GroupStatus::Running)
    }
}

impl std::str::FromStr for GroupStatus {
    type Err = keel_core::UnknownVariant;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "completed" => Self::Completed,
            "partial" => Self::Partial,
            "failed" => Self::Failed,
            "timed_out" => Self::TimedOut,
            "cancelled" => Self::Cancelled,
            "interrupted" => Self::Interrupted,
            _ => {
                return Err(keel_core::UnknownVariant {
                    kind: "group status",
                    value: s.chars().take(80).collect(),
                })
            }
        })
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

/// A stored run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord {
    /// Its id.
    pub id: RunId,
    /// Its group, if it was accepted in a batch.
    pub group_id: Option<GroupId>,
    /// Root session.
    pub root_session_id: SessionId,
    /// Root turn, if known.
    pub root_turn_id: Option<TurnId>,
    /// Delegating run.
    pub parent_run_id: Option<RunId>,
    /// Delegating agent.
    pub caller_agent_id: AgentId,
    /// Caller scope.
    pub caller_scope_id: String,
    /// Idempotency key.
    pub idempotency_key: Option<String>,
    /// Agent definition.
    pub agent_id: AgentId,
    /// Definition hash.
    pub definition_hash: String,
    /// Provider profile.
    pub provider_profile: String,
    /// Provider name.
    pub provider_name: String,
    /// Model id.
    pub model_id: String,
    /// Foreground or background.
    pub mode: ExecutionMode,
    /// Delegation depth.
    pub depth: u32,
    /// Bound plan item.
    pub plan_item_id: Option<String>,
    /// Owning execution.
    pub execution_id: String,
    /// Task text.
    pub task: String,
    /// Extra context (JSON).
    pub context_json: Option<String>,
    /// Budget (JSON).
    pub budget_json: String,
    /// Signal contract (JSON).
    pub signal_contract_json: Option<String>,
    /// Signal delivery.
    pub signal_delivery: Option<Delivery>,
    /// Completion delivery.
    pub completion_delivery: Option<Delivery>,
    /// Failure delivery.
    pub failure_delivery: Option<Delivery>,
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
    /// Owning runtime generation.
    pub runtime_generation: u64,
    /// Attempt number.
    pub attempt: u32,
    /// Whether it holds a completion slot in the root inbox.
    pub completion_slot_reserved: bool,
    /// Deadline (ms).
    pub deadline_at_ms: i64,
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

/// A stored group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    /// Its id.
    pub id: GroupId,
    /// Root session.
    pub root_session_id: SessionId,
    /// Delegating run.
    pub caller_run_id: Option<RunId>,
    /// Caller scope.
    pub caller_scope_id: String,
    /// Idempotency key.
    pub idempotency_key: Option<String>,
    /// Foreground or background.
    pub mode: ExecutionMode,
    /// Completion policy.
    pub completion_policy: CompletionPolicy,
    /// Runs in the group.
    pub expected_runs: u32,
    /// Runs that ended.
    pub terminal_runs: u32,
    /// Runs that ended other than completed.
    pub abnormal_runs: u32,
    /// Whether the group holds a completion slot.
    pub completion_slot_reserved: bool,
    /// Completion delivery.
    pub completion_delivery: Option<Delivery>,
    /// Failure delivery.
    pub failure_delivery: Option<Delivery>,
    /// Deadline (ms).
    pub deadline_at_ms: i64,
    /// Status.
    pub status: GroupStatus,
    /// Owning runtime generation.
    pub runtime_generation: u64,
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

/// Result of [`Store::accept_run`].
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

/// Result of [`Store::accept_agent_group`].
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

/// The capacity and revision counters of a root session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionCounters {
    /// Client revision.
    pub revision: u64,
    /// Events pending, leased or admitted.
    pub pending_event_count: u64,
    /// Completion slots reserved by non-terminal runs and groups.
    pub reserved_completion_slots: u64,
}

/// A counter that recovery found wrong and repaired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterRepair {
    /// The root session.
    pub root_session_id: SessionId,
    /// Stored before.
    pub before: SessionCounters,
    /// Recomputed and stored now.
    pub after: SessionCounters,
}

/// What [`Store::cancel_session`] changed.
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

/// What [`Store::recover`] changed.
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
    /// Root sessions that now have due pending events (wake each once).
    pub sessions_with_due_events: Vec<SessionId>,
}

/// Where a run listing continues: the (created_at, id) of the last item seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunCursor {
    /// `created_at_ms` of the last item.
    pub created_at_ms: i64,
    /// `id` of the last item.
    pub id: RunId,
}

const RUN_COLUMNS: &str = "id, group_id, root_session_id, root_turn_id, parent_run_id, \
    caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, \
    provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, task, \
    context_json, budget_json, signal_contract_json, signal_delivery, completion_delivery, \
    failure_delivery, status, result, error, prompt_tokens, completion_tokens, cost, \
    tool_calls_count, iterations, runtime_generation, attempt, completion_slot_reserved, \
    deadline_at, revision, started_at, finished_at, created_at, updated_at";

fn u32_col(what: &str, v: i64) -> Result<u32> {
    u32::try_from(v).map_err(|_| StoreError::corrupt(what, format!("out of range: {v}")))
}

fn bool_col(what: &str, v: i64) -> Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(StoreError::corrupt(what, format!("not a boolean: {v}"))),
    }
}

fn run_from_row(r: &Row<'_>) -> Result<RunRecord> {
    let s = |i: usize| -> Result<String> { Ok(r.get::<_, String>(i)?) };
    let prompt: Option<i64> = r.get(27)?;
    let completion: Option<i64> = r.get(28)?;
    let usage = match (prompt, completion) {
        (None, None) => None,
        (p, c) => Some(Usage::new(
            non_negative("agent_runs.prompt_tokens", p.unwrap_or(0))?,
            non_negative("agent_runs.completion_tokens", c.unwrap_or(0))?,
        )),
    };
    Ok(RunRecord {
        id: parse("agent_runs.id", &s(0)?)?,
        group_id: parse_opt("agent_runs.group_id", r.get(1)?)?,
        root_session_id: parse("agent_runs.root_session_id", &s(2)?)?,
        root_turn_id: parse_opt("agent_runs.root_turn_id", r.get(3)?)?,
        parent_run_id: parse_opt("agent_runs.parent_run_id", r.get(4)?)?,
        caller_agent_id: parse("agent_runs.caller_agent_id", &s(5)?)?,
        caller_scope_id: s(6)?,
        idempotency_key: r.get(7)?,
        agent_id: parse("agent_runs.agent_id", &s(8)?)?,
        definition_hash: s(9)?,
        provider_profile: s(10)?,
        provider_name: s(11)?,
        model_id: s(12)?,
        mode: parse("agent_runs.mode", &s(13)?)?,
        depth: u32_col("agent_runs.depth", r.get(14)?)?,
        plan_item_id: r.get(15)?,
        execution_id: s(16)?,
        task: s(17)?,
        context_json: r.get(18)?,
        budget_json: s(19)?,
        signal_contract_json: r.get(20)?,
        signal_delivery: parse_opt("agent_runs.signal_delivery", r.get(21)?)?,
        completion_delivery: parse_opt("agent_runs.completion_delivery", r.get(22)?)?,
        failure_delivery: parse_opt("agent_runs.failure_delivery", r.get(23)?)?,
        status: parse("agent_runs.status", &s(24)?)?,
        result: r.get(25)?,
        error: r.get(26)?,
        usage,
        cost: r.get(29)?,
        tool_calls_count: u32_col("agent_runs.tool_calls_count", r.get(30)?)?,
        iterations: u32_col("agent_runs.iterations", r.get(31)?)?,
        runtime_generation: non_negative("agent_runs.runtime_generation", r.get(32)?)?,
        attempt: u32_col("agent_runs.attempt", r.get(33)?)?,
        completion_slot_reserved: bool_col("agent_runs.completion_slot_reserved", r.get(34)?)?,
        deadline_at_ms: r.get(35)?,
        revision: non_negative("agent_runs.revision", r.get(36)?)?,
        started_at_ms: r.get(37)?,
        finished_at_ms: r.get(38)?,
        created_at_ms: r.get(39)?,
        updated_at_ms: r.get(40)?,
    })
}

const GROUP_COLUMNS: &str =
    "id, root_session_id, caller_run_id, caller_scope_id, idempotency_key, \
    mode, completion_policy, expected_runs, terminal_runs, abnormal_runs, \
    completion_slot_reserved, completion_delivery, failure_delivery, deadline_at, status, \
    runtime_generation, revision, created_at, updated_at, finished_at";

fn group_from_row(r: &Row<'_>) -> Result<GroupRecord> {
    let s = |i: usize| -> Result<String> { Ok(r.get::<_, String>(i)?) };
    Ok(GroupRecord {
        id: parse("agent_run_groups.id", &s(0)?)?,
        root_session_id: parse("agent_run_groups.root_session_id", &s(1)?)?,
        caller_run_id: parse_opt("agent_run_groups.caller_run_id", r.get(2)?)?,
        caller_scope_id: s(3)?,
        idempotency_key: r.get(4)?,
        mode: parse("agent_run_groups.mode", &s(5)?)?,
        completion_policy: parse("agent_run_groups.completion_policy", &s(6)?)?,
        expected_runs: u32_col("agent_run_groups.expected_runs", r.get(7)?)?,
        terminal_runs: u32_col("agent_run_groups.terminal_runs", r.get(8)?)?,
        abnormal_runs: u32_col("agent_run_groups.abnormal_runs", r.get(9)?)?,
        completion_slot_reserved: bool_col(
            "agent_run_groups.completion_slot_reserved",
            r.get(10)?,
        )?,
        completion_delivery: parse_opt("agent_run_groups.completion_delivery", r.get(11)?)?,
        failure_delivery: parse_opt("agent_run_groups.failure_delivery", r.get(12)?)?,
        deadline_at_ms: r.get(13)?,
        status: parse("agent_run_groups.status", &s(14)?)?,
        runtime_generation: non_negative("agent_run_groups.runtime_generation", r.get(15)?)?,
        revision: non_negative("agent_run_groups.revision", r.get(16)?)?,
        created_at_ms: r.get(17)?,
        updated_at_ms: r.get(18)?,
        finished_at_ms: r.get(19)?,
    })
}

pub(crate) fn query_runs(
    conn: &Connection,
    where_sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<RunRecord>> {
    let mut stmt =
        conn.prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM agent_runs {where_sql}"))?;
    let mut rows = stmt.query(params)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(run_from_row(r)?);
    }
    Ok(out)
}

fn query_groups(
    conn: &Connection,
    where_sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<GroupRecord>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {GROUP_COLUMNS} FROM agent_run_groups {where_sql}"
    ))?;
    let mut rows = stmt.query(params)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(group_from_row(r)?);
    }
    Ok(out)
}

pub(crate) fn get_run_tx(conn: &Connection, id: &RunId) -> Result<Option<RunRecord>> {
    Ok(query_runs(conn, "WHERE id = ?1", [id.to_string()])?.pop())
}

fn require_run(conn: &Connection, id: &RunId) -> Result<RunRecord> {
    get_run_tx(conn, id)?.ok_or_else(|| StoreError::NotFound(format!("run {id}")))
}

fn get_group_tx(conn: &Connection, id: &GroupId) -> Result<Option<GroupRecord>> {
    Ok(query_groups(conn, "WHERE id = ?1", [id.to_string()])?.pop())
}

fn require_group(conn: &Connection, id: &GroupId) -> Result<GroupRecord> {
    get_group_tx(conn, id)?.ok_or_else(|| StoreError::NotFound(format!("group {id}")))
}

/// Makes sure the session's counter row exists.
fn ensure_state_row(conn: &Connection, root: &SessionId, now_ms: i64) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO agent_session_state (root_session_id, updated_at) VALUES (?1, ?2) \
         ON CONFLICT (root_session_id) DO NOTHING",
    )?
    .execute(params![root.to_string(), now_ms])?;
    Ok(())
}

/// The client revisions of one multi-session transaction (cancel, recover):
/// one new revision per root session, allocated on first use.
#[derive(Debug, Default)]
pub(crate) struct Revisions(std::collections::HashMap<SessionId, i64>);

impl Revisions {
    /// The revision of this transaction for `root`.
    pub(crate) fn of(&mut self, conn: &Connection, root: &SessionId, now_ms: i64) -> Result<i64> {
        if let Some(r) = self.0.get(root) {
            return Ok(*r);
        }
        let r = next_revision(conn, root, now_ms)?;
        self.0.insert(*root, r);
        Ok(r)
    }
}

/// Allocates the one new client revision of this transaction for `root`.
pub(crate) fn next_revision(conn: &Connection, root: &SessionId, now_ms: i64) -> Result<i64> {
    ensure_state_row(conn, root, now_ms)?;
    Ok(conn
        .prepare_cached(
            "UPDATE agent_session_state SET revision = revision + 1, updated_at = ?2 \
             WHERE root_session_id = ?1 RETURNING revision",
        )?
        .query_row(params![root.to_string(), now_ms], |r| r.get(0))?)
}

/// Adds `delta` to the pending/reserved counters; with `capacity`, only if
/// pending + reserved stays within it (else `InboxFull`, nothing changed).
pub(crate) fn adjust_counters(
    conn: &Connection,
    root: &SessionId,
    pending_delta: i64,
    reserved_delta: i64,
    capacity: Option<u32>,
    now_ms: i64,
) -> Result<()> {
    if pending_delta == 0 && reserved_delta == 0 {
        return Ok(());
    }
    ensure_state_row(conn, root, now_ms)?;
    let n = conn
        .prepare_cached(
            "UPDATE agent_session_state \
             SET pending_event_count = pending_event_count + ?2, \
                 reserved_completion_slots = reserved_completion_slots + ?3, updated_at = ?4 \
             WHERE root_session_id = ?1 \
               AND (?5 IS NULL OR pending_event_count + reserved_completion_slots + ?2 + ?3 <= ?5)",
        )?
        .execute(params![
            root.to_string(),
            pending_delta,
            reserved_delta,
            now_ms,
            capacity
        ])?;
    if n == 0 {
        return Err(StoreError::InboxFull {
            session: root.to_string(),
            capacity: capacity.unwrap_or(0),
        });
    }
    Ok(())
}

pub(crate) fn counters_tx(conn: &Connection, root: &SessionId) -> Result<SessionCounters> {
    let row: Option<(i64, i64, i64)> = conn
        .query_row(
            "SELECT revision, pending_event_count, reserved_completion_slots \
             FROM agent_session_state WHERE root_session_id = ?1",
            [root.to_string()],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    let Some((rev, pending, reserved)) = row else {
        return Ok(SessionCounters::default());
    };
    Ok(SessionCounters {
        revision: non_negative("agent_session_state.revision", rev)?,
        pending_event_count: non_negative("agent_session_state.pending_event_count", pending)?,
        reserved_completion_slots: non_negative(
            "agent_session_state.reserved_completion_slots",
            reserved,
        )?,
    })
}

fn delivery_text(d: Option<Delivery>) -> Option<&'static str> {
    d.map(Delivery::as_str)
}

fn insert_run_row(
    conn: &Connection,
    run: &NewRun,
    group: Option<&GroupId>,
    idempotency_key: Option<&str>,
    reserved: bool,
    revision: i64,
    now_ms: i64,
) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO agent_runs (id, group_id, root_session_id, root_turn_id, parent_run_id, \
         caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, \
         provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, \
         task, context_json, budget_json, signal_contract_json, signal_delivery, \
         completion_delivery, failure_delivery, status, runtime_generation, \
         completion_slot_reserved, deadline_at, revision, created_at, updated_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
         ?18, ?19, ?20, ?21, ?22, ?23, ?24, 'queued', ?25, ?26, ?27, ?28, ?29, ?29)",
    )?
    .execute(params![
        run.id.to_string(),
        group.map(|g| g.to_string()),
        run.root_session_id.to_string(),
        run.root_turn_id.map(|t| t.to_string()),
        run.parent_run_id.map(|p| p.to_string()),
        run.caller_agent_id.as_str(),
        run.caller_scope_id,
        idempotency_key,
        run.agent_id.as_str(),
        run.definition_hash,
        run.provider_profile,
        run.provider_name,
        run.model_id,
        run.mode.as_str(),
        run.depth,
        run.plan_item_id,
        run.execution_id,
        run.task,
        run.context_json,
        run.budget_json,
        run.signal_contract_json,
        delivery_text(run.signal_delivery),
        delivery_text(run.completion_delivery),
        delivery_text(run.failure_delivery),
        to_i64("runtime_generation", run.runtime_generation)?,
        reserved,
        run.deadline_at_ms,
        revision,
        now_ms,
    ])?;
    Ok(())
}

fn accept_run_tx(conn: &Connection, req: &AcceptRun) -> Result<AcceptedRun> {
    let run = &req.run;
    if let Some(key) = &run.idempotency_key {
        let existing = query_runs(
            conn,
            "WHERE root_session_id = ?1 AND caller_scope_id = ?2 AND idempotency_key = ?3",
            params![run.root_session_id.to_string(), run.caller_scope_id, key],
        )?;
        if let Some(existing) = existing.into_iter().next() {
            return Ok(AcceptedRun {
                run: existing,
                existing: true,
            });
        }
    }
    let reserve = run.mode == ExecutionMode::Background;
    let root = &run.root_session_id;
    if reserve {
        adjust_counters(conn, root, 0, 1, Some(req.inbox_capacity), req.now_ms)?;
    }
    let revision = next_revision(conn, root, req.now_ms)?;
    insert_run_row(
        conn,
        run,
        None,
        run.idempotency_key.as_deref(),
        reserve,
        revision,
        req.now_ms,
    )?;
    Ok(AcceptedRun {
        run: require_run(conn, &run.id)?,
        existing: false,
    })
}

fn accept_group_tx(conn: &Connection, req: &AcceptGroup) -> Result<AcceptedGroup> {
    let g = &req.group;
    if req.runs.is_empty() {
        return Err(StoreError::InvalidInput(
            "a group needs at least one run".into(),
        ));
    }
    if let Some(r) = req
        .runs
        .iter()
        .find(|r| r.root_session_id != g.root_session_id)
    {
        return Err(StoreError::InvalidInput(format!(
            "run {} belongs to another root session than its group",
            r.id
        )));
    }
    if let Some(key) = &g.idempotency_key {
        let existing = query_groups(
            conn,
            "WHERE root_session_id = ?1 AND caller_scope_id = ?2 AND idempotency_key = ?3",
            params![g.root_session_id.to_string(), g.caller_scope_id, key],
        )?;
        if let Some(group) = existing.into_iter().next() {
            let runs = query_runs(
                conn,
                "WHERE group_id = ?1 ORDER BY rowid",
                [group.id.to_string()],
            )?;
            return Ok(AcceptedGroup {
                group,
                runs,
                existing: true,
            });
        }
    }
    let background = g.mode == ExecutionMode::Background;
    let group_slot = background && g.completion_policy == CompletionPolicy::All;
    let run_slot = background && g.completion_policy == CompletionPolicy::Each;
    let slots = if group_slot {
        1
    } else if run_slot {
        i64::try_from(req.runs.len()).unwrap_or(i64::MAX)
    } else {
        0
    };
    let root = &g.root_session_id;
    if slots > 0 {
        adjust_counters(conn, root, 0, slots, Some(req.inbox_capacity), req.now_ms)?;
    }
    let revision = next_revision(conn, root, req.now_ms)?;
    conn.execute(
        "INSERT INTO agent_run_groups (id, root_session_id, caller_run_id, caller_scope_id, \
         idempotency_key, mode, completion_policy, expected_runs, completion_slot_reserved, \
         completion_delivery, failure_delivery, deadline_at, status, runtime_generation, \
         revision, created_at, updated_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 'queued', ?13, ?14, ?15, ?15)",
        params![
            g.id.to_string(),
            root.to_string(),
            g.caller_run_id.map(|r| r.to_string()),
            g.caller_scope_id,
            g.idempotency_key,
            g.mode.as_str(),
            g.completion_policy.as_str(),
            i64::try_from(req.runs.len()).unwrap_or(i64::MAX),
            group_slot,
            delivery_text(g.completion_delivery),
            delivery_text(g.failure_delivery),
            g.deadline_at_ms,
            to_i64("runtime_generation", g.runtime_generation)?,
            revision,
            req.now_ms,
        ],
    )?;
    for run in &req.runs {
        // Batch children carry no key: the group's key makes the retry idempotent.
        insert_run_row(conn, run, Some(&g.id), None, run_slot, revision, req.now_ms)?;
    }
    Ok(AcceptedGroup {
        group: require_group(conn, &g.id)?,
        runs: query_runs(
            conn,
            "WHERE group_id = ?1 ORDER BY rowid",
            [g.id.to_string()],
        )?,
        existing: false,
    })
}

/// Moves a run from one of `from` to `to` if `execution_id` still owns it.
fn transition_tx(
    conn: &Connection,
    run_id: &RunId,
    execution_id: &str,
    from: &[RunStatus],
    to: RunStatus,
    now_ms: i64,
) -> Result<bool> {
    let run = require_run(conn, run_id)?;
    if run.execution_id != execution_id || !from.contains(&run.status) {
        return Ok(false);
    }
    let revision = next_revision(conn, &run.root_session_id, now_ms)?;
    let n = conn.execute(
        "UPDATE agent_runs SET status = ?1, revision = ?2, updated_at = ?3, \
         started_at = coalesce(started_at, ?3) \
         WHERE id = ?4 AND execution_id = ?5 AND status = ?6",
        params![
            to.as_str(),
            revision,
            now_ms,
            run_id.to_string(),
            execution_id,
            run.status.as_str()
        ],
    )?;
    if n == 1 && to == RunStatus::Running {
        if let Some(g) = run.group_id {
            conn.execute(
                "UPDATE agent_run_groups SET status = 'running', revision = ?1, updated_at = ?2 \
                 WHERE id = ?3 AND status = 'queued'",
                params![revision, now_ms, g.to_string()],
            )?;
        }
    }
    Ok(n == 1)
}

/// What to do with a run's reserved completion when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CompletionHandling {
    /// Turn the reservation into a pending event that asks for a continuation.
    Deliver,
    /// Record the event as already consumed, without a continuation (`/stop`).
    Quiet,
    /// Release the reservation, no event (session cancelled or deleted).
    Release,
}

fn completion_payload(run: &RunRecord, outcome: &TerminalOutcome) -> String {
    let (result, error) = match outcome {
        TerminalOutcome::Completed { result, .. } => (Some(result.as_str()), None),
        TerminalOutcome::Failed { error, .. } => (None, Some(error.clone())),
        TerminalOutcome::TimedOut { deadline_at_ms } => (
            None,
            Some(format!("timed out at deadline {deadline_at_ms}")),
        ),
        TerminalOutcome::Cancelled { reason } => (None, Some(format!("cancelled: {reason}"))),
        TerminalOutcome::Interrupted { reason } => (None, Some(format!("interrupted: {reason}"))),
    };
    serde_json::json!({
        "run_id": run.id,
        "agent_id": run.agent_id,
        "status": outcome.status().as_str(),
        "result": result,
        "error": error,
    })
    .to_string()
}

/// Inserts the completion event for a reservation being converted, and moves the counters.
#[allow(clippy::too_many_arguments)]
fn convert_reservation(
    conn: &Connection,
    root: &SessionId,
    scope: ScopeKind,
    scope_id: &str,
    event_type: EventType,
    delivery: Delivery,
    payload_json: String,
    handling: CompletionHandling,
    revision: i64,
    now_ms: i64,
) -> Result<Option<EventId>> {
    if handling == CompletionHandling::Release {
        adjust_counters(conn, root, 0, -1, None, now_ms)?;
        return Ok(None);
    }
    let quiet = handling == CompletionHandling::Quiet;
    let id = insert_event_tx(
        conn,
        &NewEventRow {
            root_session_id: *root,
            scope,
            scope_id,
            event_type,
            event_key: "completion",
            delivery,
            requires_continuation: !quiet,
            severity: None,
            payload_json: &payload_json,
            consumed: quiet,
            revision,
            now_ms,
        },
    )?;
    adjust_counters(conn, root, if quiet { 0 } else { 1 }, -1, None, now_ms)?;
    Ok(Some(id))
}

/// The terminal transition and everything only its winner may do.
pub(crate) fn terminal_tx(
    conn: &Connection,
    run: &RunRecord,
    outcome: &TerminalOutcome,
    handling: CompletionHandling,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<TerminalCommit> {
    if run.status.is_terminal() {
        return Ok(TerminalCommit {
            won: false,
            run: run.clone(),
            event_id: None,
            finished_group: None,
        });
    }
    let status = outcome.status();
    let (result, error, usage, tool_calls, iterations) = match outcome {
        TerminalOutcome::Completed {
            result,
            usage,
            tool_calls,
            iterations,
        } => (
            Some(result.clone()),
            None,
            Some(*usage),
            *tool_calls,
            *iterations,
        ),
        TerminalOutcome::Failed { error, usage } => (None, Some(error.clone()), *usage, 0, 0),
        TerminalOutcome::TimedOut { deadline_at_ms } => (
            None,
            Some(format!("timed out at deadline {deadline_at_ms}")),
            None,
            0,
            0,
        ),
        TerminalOutcome::Cancelled { reason } => (None, Some(reason.clone()), None, 0, 0),
        TerminalOutcome::Interrupted { reason } => (None, Some(reason.clone()), None, 0, 0),
    };
    let root = &run.root_session_id;
    let revision = revisions.of(conn, root, now_ms)?;
    let n = conn
        .prepare_cached(&format!(
            "UPDATE agent_runs SET status = ?1, result = ?2, error = ?3, \
             prompt_tokens = coalesce(?4, prompt_tokens), \
             completion_tokens = coalesce(?5, completion_tokens), \
             tool_calls_count = max(tool_calls_count, ?6), iterations = max(iterations, ?7), \
             completion_slot_reserved = 0, revision = ?8, finished_at = ?9, updated_at = ?9 \
             WHERE id = ?10 AND execution_id = ?11 AND status IN {NONTERMINAL_RUN}"
        ))?
        .execute(params![
            status.as_str(),
            result,
            error,
            usage
                .map(|u| to_i64("prompt_tokens", u.prompt_tokens))
                .transpose()?,
            usage
                .map(|u| to_i64("completion_tokens", u.completion_tokens))
                .transpose()?,
            tool_calls,
            iterations,
            revision,
            now_ms,
            run.id.to_string(),
            run.execution_id,
        ])?;
    if n != 1 {
        return Err(StoreError::Stale(format!(
            "run {} changed during its terminal commit",
            run.id
        )));
    }
    let ok = status == RunStatus::Completed;
    let mut event_id = None;
    if run.completion_slot_reserved {
        let delivery = if ok {
            run.completion_delivery
        } else {
            run.failure_delivery.or(run.completion_delivery)
        }
        .unwrap_or(Delivery::Queue);
        event_id = convert_reservation(
            conn,
            root,
            ScopeKind::Run,
            &run.id.to_string(),
            EventType::Completion,
            delivery,
            completion_payload(run, outcome),
            handling,
            revision,
            now_ms,
        )?;
    }
    let mut finished_group = None;
    if let Some(gid) = run.group_id {
        conn.execute(
            "UPDATE agent_run_groups SET terminal_runs = terminal_runs + 1, \
             abnormal_runs = abnormal_runs + ?1, revision = ?2, updated_at = ?3 WHERE id = ?4",
            params![!ok, revision, now_ms, gid.to_string()],
        )?;
        let group = require_group(conn, &gid)?;
        if group.terminal_runs == group.expected_runs && !group.status.is_terminal() {
            let (finished, group_event) = finish_group(conn, &group, handling, revision, now_ms)?;
            event_id = event_id.or(group_event);
            finished_group = Some(finished);
        }
    }
    Ok(TerminalCommit {
        won: true,
        run: require_run(conn, &run.id)?,
        event_id,
        finished_group,
    })
}

/// Final status of a group from its runs' statuses.
fn group_final_status(conn: &Connection, group: &GroupId) -> Result<GroupStatus> {
    let mut stmt = conn.prepare_cached("SELECT status FROM agent_runs WHERE group_id = ?1")?;
    let statuses = stmt
        .query_map([group.to_string()], |r| r.get::<_, String>(0))?
        .map(|s| parse::<RunStatus>("agent_runs.status", &s?))
        .collect::<Result<Vec<_>>>()?;
    let all = |s: RunStatus| statuses.iter().all(|x| *x == s);
    Ok(if all(RunStatus::Completed) {
        GroupStatus::Completed
    } else if statuses.contains(&RunStatus::Completed) {
        GroupStatus::Partial
    } else if all(RunStatus::TimedOut) {
        GroupStatus::TimedOut
    } else if all(RunStatus::Cancelled) {
        GroupStatus::Cancelled
    } else if all(RunStatus::Interrupted) {
        GroupStatus::Interrupted
    } else {
        GroupStatus::Failed
    })
}

/// Marks a group whose runs all ended as finished; converts its reservation (policy `All`).
fn finish_group(
    conn: &Connection,
    group: &GroupRecord,
    handling: CompletionHandling,
    revision: i64,
    now_ms: i64,
) -> Result<(GroupRecord, Option<EventId>)> {
    let status = group_final_status(conn, &group.id)?;
    conn.execute(
        "UPDATE agent_run_groups SET status = ?1, completion_slot_reserved = 0, finished_at = ?2, \
         updated_at = ?2, revision = ?3 WHERE id = ?4",
        params![status.as_str(), now_ms, revision, group.id.to_string()],
    )?;
    let mut event_id = None;
    if group.completion_slot_reserved {
        let delivery = if status == GroupStatus::Completed {
            group.completion_delivery
        } else {
            group.failure_delivery.or(group.completion_delivery)
        }
        .unwrap_or(Delivery::Queue);
        let runs = query_runs(
            conn,
            "WHERE group_id = ?1 ORDER BY rowid",
            [group.id.to_string()],
        )?;
        let payload = serde_json::json!({
            "group_id": group.id,
            "status": status.as_str(),
            "runs": runs.iter().map(|r| serde_json::json!({
                "run_id": r.id,
                "agent_id": r.agent_id,
                "status": r.status.as_str(),
                "result": r.result,
                "error": r.error,
            })).collect::<Vec<_>>(),
        })
        .to_string();
        event_id = convert_reservation(
            conn,
            &group.root_session_id,
            ScopeKind::Group,
            &group.id.to_string(),
            EventType::GroupCompletion,
            delivery,
            payload,
            handling,
            revision,
            now_ms,
        )?;
    }
    Ok((require_group(conn, &group.id)?, event_id))
}

fn commit_terminal_tx(
    conn: &Connection,
    run_id: &RunId,
    execution_id: &str,
    outcome: &TerminalOutcome,
    quiet: bool,
    now_ms: i64,
) -> Result<TerminalCommit> {
    let run = require_run(conn, run_id)?;
    if run.execution_id != execution_id || run.status.is_terminal() {
        // A late or foreign result: dropped, the stored terminal state stands.
        return Ok(TerminalCommit {
            won: false,
            run,
            event_id: None,
            finished_group: None,
        });
    }
    let handling = if quiet {
        CompletionHandling::Quiet
    } else {
        CompletionHandling::Deliver
    };
    terminal_tx(
        conn,
        &run,
        outcome,
        handling,
        now_ms,
        &mut Revisions::default(),
    )
}

fn cancel_session_tx(
    conn: &Connection,
    root: &SessionId,
    reason: &str,
    now_ms: i64,
) -> Result<CancelReport> {
    let mut report = CancelReport::default();
    let runs = query_runs(
        conn,
        &format!("WHERE root_session_id = ?1 AND status IN {NONTERMINAL_RUN} ORDER BY rowid"),
        [root.to_string()],
    )?;
    let outcome = TerminalOutcome::Cancelled {
        reason: reason.to_owned(),
    };
    let mut revisions = Revisions::default();
    for run in runs {
        // Re-read: finishing a group above may not touch this run, but be exact.
        let run = require_run(conn, &run.id)?;
        if run.status.is_terminal() {
            continue;
        }
        let before = counters_tx(conn, root)?.reserved_completion_slots;
        let commit = terminal_tx(
            conn,
            &run,
            &outcome,
            CompletionHandling::Release,
            now_ms,
            &mut revisions,
        )?;
        let after = counters_tx(conn, root)?.reserved_completion_slots;
        report.reservations_released += before.saturating_sub(after);
        if commit.finished_group.is_some() {
            report.groups_cancelled += 1;
        }
        report.runs_cancelled.push(run.id);
    }
    let revision = revisions.of(conn, root, now_ms)?;
    report.events_dead_lettered =
        crate::inbox::dead_letter_session_tx(conn, root, reason, revision, now_ms)?;
    Ok(report)
}

/// Recomputes a root session's counters from the rows; repairs and reports a difference.
fn reconcile_tx(
    conn: &Connection,
    root: &SessionId,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<Option<CounterRepair>> {
    let before = counters_tx(conn, root)?;
    let key = root.to_string();
    let pending: i64 = conn.query_row(
        "SELECT count(*) FROM agent_inbox_events WHERE root_session_id = ?1 \
         AND status IN ('pending', 'leased', 'admitted')",
        [&key],
        |r| r.get(0),
    )?;
    let reserved: i64 = conn.query_row(
        &format!(
            "SELECT (SELECT count(*) FROM agent_runs WHERE root_session_id = ?1 \
               AND completion_slot_reserved = 1 AND status IN {NONTERMINAL_RUN}) + \
             (SELECT count(*) FROM agent_run_groups WHERE root_session_id = ?1 \
               AND completion_slot_reserved = 1 AND status IN ('queued', 'running'))"
        ),
        [&key],
        |r| r.get(0),
    )?;
    let after = SessionCounters {
        revision: before.revision,
        pending_event_count: non_negative("pending events", pending)?,
        reserved_completion_slots: non_negative("reserved slots", reserved)?,
    };
    if after == before {
        return Ok(None);
    }
    tracing::warn!(
        root_session_id = %root,
        ?before,
        ?after,
        "repairing inbox counters"
    );
    let revision = revisions.of(conn, root, now_ms)?;
    conn.execute(
        "UPDATE agent_session_state SET pending_event_count = ?2, reserved_completion_slots = ?3, \
         updated_at = ?4 WHERE root_session_id = ?1",
        params![key, pending, reserved, now_ms],
    )?;
    Ok(Some(CounterRepair {
        root_session_id: *root,
        before,
        after: SessionCounters {
            revision: non_negative("revision", revision)?,
            ..after
        },
    }))
}

fn recover_tx(conn: &Connection, active_generation: u64, now_ms: i64) -> Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    let generation = to_i64("active_generation", active_generation)?;
    let mut revisions = Revisions::default();
    // 1–3: old-generation runs end as interrupted, converting their reservations.
    let stale = query_runs(
        conn,
        &format!("WHERE runtime_generation < ?1 AND status IN {NONTERMINAL_RUN} ORDER BY rowid"),
        [generation],
    )?;
    for run in stale {
        let run = require_run(conn, &run.id)?;
        if run.status.is_terminal() {
            continue;
        }
        let outcome = TerminalOutcome::Interrupted {
            reason: format!(
                "runtime generation {} stopped before the run finished",
                run.runtime_generation
            ),
        };
        let commit = terminal_tx(
            conn,
            &run,
            &outcome,
            CompletionHandling::Deliver,
            now_ms,
            &mut revisions,
        )?;
        if commit.event_id.is_some() {
            report.completion_events += 1;
        }
        if commit.finished_group.is_some() {
            report.groups_finished += 1;
        }
        report.interrupted_runs.push(run.id);
    }
    // Groups whose counters drifted from their runs (a crash between writes cannot
    // happen inside one transaction, but a hand-edited or older database can).
    let open_groups = query_groups(conn, "WHERE status IN ('queued', 'running')", [])?;
    for group in open_groups {
        let (terminal, abnormal): (i64, i64) = conn.query_row(
            &format!(
                "SELECT count(*) FILTER (WHERE status NOT IN {NONTERMINAL_RUN}), \
                 count(*) FILTER (WHERE status NOT IN {NONTERMINAL_RUN} AND status <> 'completed') \
                 FROM agent_runs WHERE group_id = ?1"
            ),
            [group.id.to_string()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let terminal = u32_col("group terminal runs", terminal)?;
        let abnormal = u32_col("group abnormal runs", abnormal)?;
        if terminal != group.terminal_runs || abnormal != group.abnormal_runs {
            let revision = revisions.of(conn, &group.root_session_id, now_ms)?;
            conn.execute(
                "UPDATE agent_run_groups SET terminal_runs = ?1, abnormal_runs = ?2, \
                 revision = ?3, updated_at = ?4 WHERE id = ?5",
                params![terminal, abnormal, revision, now_ms, group.id.to_string()],
            )?;
            if terminal == group.expected_runs {
                let group = require_group(conn, &group.id)?;
                let (_, event) =
                    finish_group(conn, &group, CompletionHandling::Deliver, revision, now_ms)?;
                if event.is_some() {
                    report.completion_events += 1;
                }
                report.groups_finished += 1;
            }
        }
    }
    // 4: expired leases go back to pending.
    report.leases_expired = crate::inbox::expire_leases_tx(conn, now_ms, &mut revisions)?;
    // 5: recompute every root session's counters.
    let mut stmt = conn.prepare(
        "SELECT root_session_id FROM agent_session_state \
         UNION SELECT root_session_id FROM agent_runs \
         UNION SELECT root_session_id FROM agent_inbox_events",
    )?;
    let roots = stmt
        .query_map([], |r| r.get::<_, String>(0))?
        .map(|s| parse::<SessionId>("root_session_id", &s?))
        .collect::<Result<Vec<_>>>()?;
    for root in &roots {
        if let Some(repair) = reconcile_tx(conn, root, now_ms, &mut revisions)? {
            report.counters_repaired.push(repair);
        }
    }
    // 6: who to wake.
    report.sessions_with_due_events = crate::inbox::sessions_with_due_events_tx(conn, now_ms)?;
    Ok(report)
}

impl Store {
    /// Accepts one run: idempotency lookup, completion-slot reservation for a background run (capacity-checked), queued row.
    pub async fn accept_run(&self, request: AcceptRun) -> Result<AcceptedRun> {
        self.db.write(move |c| accept_run_tx(c, &request)).await
    }

    /// Accepts a group and its runs in one transaction with the reservation its policy needs.
    pub async fn accept_agent_group(&self, request: AcceptGroup) -> Result<AcceptedGroup> {
        self.db.write(move |c| accept_group_tx(c, &request)).await
    }

    /// queued/waiting_children → running, if `execution_id` owns the run. Returns whether it moved.
    pub async fn mark_run_running(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        self.db
            .write(move |c| {
                transition_tx(
                    c,
                    &run_id,
                    &execution_id,
                    &[RunStatus::Queued, RunStatus::WaitingChildren],
                    RunStatus::Running,
                    now_ms,
                )
            })
            .await
    }

    /// running → waiting_children, if `execution_id` owns the run. Returns whether it moved.
    pub async fn mark_run_waiting_children(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        self.db
            .write(move |c| {
                transition_tx(
                    c,
                    &run_id,
                    &execution_id,
                    &[RunStatus::Running],
                    RunStatus::WaitingChildren,
                    now_ms,
                )
            })
            .await
    }

    /// Ends a run if (run_id, execution_id, non-terminal) still holds; the winner
    /// converts the reservation into a completion (or the group's), else nothing is written.
    /// `quiet` records the completion as consumed without a continuation (`/stop`).
    pub async fn commit_terminal(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        quiet: bool,
        now_ms: i64,
    ) -> Result<TerminalCommit> {
        self.db
            .write(move |c| commit_terminal_tx(c, &run_id, &execution_id, &outcome, quiet, now_ms))
            .await
    }

    /// Cancels every non-terminal run of a root session, releases reservations, dead-letters pending events.
    pub async fn cancel_session(
        &self,
        root_session_id: SessionId,
        reason: String,
        now_ms: i64,
    ) -> Result<CancelReport> {
        self.db
            .write(move |c| cancel_session_tx(c, &root_session_id, &reason, now_ms))
            .await
    }

    /// Activation recovery: older generations' runs → interrupted (with their
    /// completions), expired leases → pending, counters recomputed and repaired.
    pub async fn recover(&self, active_generation: u64, now_ms: i64) -> Result<RecoveryReport> {
        self.db
            .write(move |c| recover_tx(c, active_generation, now_ms))
            .await
    }

    /// Recomputes one root session's counters; returns the repair if they were wrong.
    pub async fn reconcile_counters(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
    ) -> Result<Option<CounterRepair>> {
        self.db
            .write(move |c| reconcile_tx(c, &root_session_id, now_ms, &mut Revisions::default()))
            .await
    }

    /// The counters of a root session (zeros if it never had runs).
    pub async fn session_counters(&self, root_session_id: SessionId) -> Result<SessionCounters> {
        self.db
            .read(move |c| counters_tx(c, &root_session_id))
            .await
    }

    /// One run.
    pub async fn get_run(&self, run_id: RunId) -> Result<Option<RunRecord>> {
        self.db.read(move |c| get_run_tx(c, &run_id)).await
    }

    /// One group.
    pub async fn get_group(&self, group_id: GroupId) -> Result<Option<GroupRecord>> {
        self.db.read(move |c| get_group_tx(c, &group_id)).await
    }

    /// Runs of a group, in creation order.
    pub async fn group_runs(&self, group_id: GroupId) -> Result<Vec<RunRecord>> {
        self.db
            .read(move |c| {
                query_runs(
                    c,
                    "WHERE group_id = ?1 ORDER BY rowid",
                    [group_id.to_string()],
                )
            })
            .await
    }

    /// Runs delegated by `parent_run_id`, oldest first.
    pub async fn child_runs(&self, parent_run_id: RunId) -> Result<Vec<RunRecord>> {
        self.db
            .read(move |c| {
                query_runs(
                    c,
                    "WHERE parent_run_id = ?1 ORDER BY created_at, id",
                    [parent_run_id.to_string()],
                )
            })
            .await
    }

    /// Runs of a root session, newest first, paginated by (created_at, id).
    pub async fn list_runs(
        &self,
        root_session_id: SessionId,
        cursor: Option<RunCursor>,
        limit: usize,
    ) -> Result<Page<RunRecord, RunCursor>> {
        if limit == 0 || limit > 1000 {
            return Err(StoreError::InvalidInput(format!(
                "limit {limit} is outside 1..=1000"
            )));
        }
        self.db
            .read(move |c| {
                let (at, id) = match &cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MAX, String::new()),
                };
                let mut items = query_runs(
                    c,
                    "WHERE root_session_id = ?1 AND (?2 OR (created_at, id) < (?3, ?4)) \
                     ORDER BY created_at DESC, id DESC LIMIT ?5",
                    params![
                        root_session_id.to_string(),
                        cursor.is_none(),
                        at,
                        id,
                        i64::try_from(limit + 1).unwrap_or(i64::MAX)
                    ],
                )?;
                let next_cursor = if items.len() > limit {
                    items.truncate(limit);
                    items.last().map(|r| RunCursor {
                        created_at_ms: r.created_at_ms,
                        id: r.id,
                    })
                } else {
                    None
                };
                Ok(Page { items, next_cursor })
            })
            .await
    }
}
