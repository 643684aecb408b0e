//! [`EngineError`], the one error type of keel-engine, and how an error
//! becomes what the model reads at the tool boundary.
//!
//! Refusals (a depth, budget or inbox limit, an unknown agent, a malformed
//! request) are decided by the engine and reach the model as precise text: it
//! can act on them. Internal failures (storage, corrupt state, a panicked
//! task) are keel's own problem: the model reads a short generic message with
//! an error id, and the detail goes to the log under that id
//! ([`internal_message`]), so the model never reads SQLite messages.

use std::fmt;
use std::path::PathBuf;

use keel_core::{CheckpointId, ProviderError, SessionId, ToolError, ToolRegistryError, TurnId};
use keel_store::StoreError;

use crate::gate::GateScope;

/// Result of every fallible keel-engine operation.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Everything that can go wrong in keel-engine. Each variant says whether a
/// caller may retry ([`EngineError::is_retryable`]) and whether it is internal
/// ([`EngineError::is_internal`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    // ── turns and runs ───────────────────────────────────────────────────
    /// The turn, the run or the wait was cancelled; nothing was committed. Not retryable.
    #[error("cancelled")]
    Cancelled,
    /// The turn ran past its deadline (`[session] turn_timeout_secs`) and was
    /// cancelled; nothing of its answer was committed. Not retryable as is.
    #[error("the turn ran past its deadline of {secs} s and was stopped; nothing of its answer was saved")]
    TimedOut {
        /// The deadline, in seconds.
        secs: u64,
    },
    /// A spend budget (tokens or USD of a run tree, a root turn or a dialog)
    /// would be passed by the next model call, which was not made. Not retryable as is.
    #[error("the budget {budget} is exhausted ({detail}); no model call was made")]
    BudgetExhausted {
        /// The key that set the budget, e.g. `session.max_cost_usd_per_dialog`.
        budget: String,
        /// What was spent of it and what the call needed.
        detail: String,
    },
    /// The model kept calling tools past the agent's iteration limit. Not retryable as is.
    #[error("the agent reached its limit of {limit} model calls without a final answer")]
    MaxIterations {
        /// The limit.
        limit: u32,
    },
    /// The task running a turn panicked (a bug in keel); nothing was committed. Internal, not retryable.
    #[error("the turn task panicked: {0}")]
    TurnPanicked(String),

    /// The session already has this many user turns queued. Retryable when a turn ends.
    #[error("this session already has {queued} messages waiting; try again when a turn ends")]
    SessionBusy {
        /// The queue's capacity.
        queued: usize,
    },
    /// The dialog runs this turn, and the request needs it idle (switching its agent). Retryable when the turn ends.
    #[error("turn {0} is running in this dialog; try again when it ends, or stop it first")]
    TurnRunning(TurnId),
    /// No approval with this id in this dialog (or its dialog is deleted). Not retryable.
    #[error("approval {0} not found")]
    ApprovalNotFound(keel_core::ApprovalId),
    /// The approval was decided already (or expired, or was superseded by
    /// new input); nothing was done. Not retryable.
    #[error("approval {id} is {status} already; a decision is taken only once")]
    ApprovalDecided {
        /// The approval.
        id: keel_core::ApprovalId,
        /// Where it stands (`approved`, `denied`, `expired`, `superseded`).
        status: String,
    },
    /// The running turn already has this many steer messages waiting. Retryable at its next model call.
    #[error("the running turn already has {capacity} steer messages waiting for the model")]
    SteerFull {
        /// The steer lane's capacity.
        capacity: usize,
    },

    // ── sessions, slots, checkpoints, dialogs ────────────────────────────
    /// No session with this id (in memory, or in storage when loading). Not retryable.
    #[error("session {0} not found")]
    SessionNotFound(SessionId),
    /// No checkpoint with this id in this session. Not retryable.
    #[error("checkpoint {0} not found")]
    CheckpointNotFound(CheckpointId),
    /// No context slot with this name. Not retryable.
    #[error("context slot {0:?} not found")]
    SlotNotFound(String),
    /// A slot with this name exists already. Not retryable.
    #[error("context slot {0:?} already exists")]
    SlotExists(String),
    /// The slot is read-only: no turn or merge may write to it. Not retryable.
    #[error("context slot {0:?} is read-only")]
    SlotReadonly(String),
    /// A slot operation that is never allowed (e.g. deleting the default slot). Not retryable.
    #[error("{0}")]
    SlotRule(String),
    /// A title is empty or holds a control or format character (a bidi
    /// override, a zero-width character …). Not retryable.
    #[error("{0}")]
    InvalidTitle(&'static str),
    /// The input is malformed (a bad dialog address, slot name, memory entry …). Not retryable.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The model answered a summary request with no text. Retryable: another call may answer.
    #[error("the model returned an empty summary")]
    EmptySummary,
    /// Stored session state could not be decoded. Internal, not retryable.
    #[error("corrupt session state: {0}")]
    CorruptState(String),
    /// Session state could not be encoded for storage. Internal, not retryable.
    #[error("session state could not be encoded: {0}")]
    StateEncoding(String),

    // ── agents and delegation (refusals persist nothing) ─────────────────
    /// No agent profile or definition has this name. Not retryable.
    #[error("unknown agent {0:?}")]
    UnknownAgent(String),
    /// The session's agent is no longer in the agent catalog (a reload
    /// removed it); the session can still be read or switched to another
    /// agent. Not retryable until a reload restores the agent.
    #[error("agent {0:?} of this dialog is no longer defined (a reload of the agent catalog removed it); switch the dialog to another agent, or restore the definition and reload")]
    AgentRemoved(String),
    /// The tool context names neither a root turn (session + turn) nor a run. Not retryable.
    #[error("this context cannot delegate: it is neither a root turn (session and turn) nor an agent run")]
    MissingCallerIdentity,
    /// The delegate request is malformed (no tasks, empty task text, oversized field). Not retryable.
    #[error("invalid delegation request: {0}")]
    InvalidDelegation(String),
    /// The delegation graph has no edge from the caller to the target. Not retryable.
    #[error("agent {caller:?} may not delegate to {target:?}: the delegation graph has no edge {caller} → {target}")]
    UnauthorizedEdge {
        /// The delegating agent (`root` for the root agent).
        caller: String,
        /// The requested agent.
        target: String,
    },
    /// The new run would be deeper than the configured tree depth. Not retryable.
    #[error("delegation depth {depth} exceeds the limit of {limit}; do the work yourself instead")]
    DepthExceeded {
        /// Depth the new run would have (1 for a child of the root).
        depth: u32,
        /// The limit.
        limit: u32,
    },
    /// The delegation tree already created as many runs as it may. Not retryable in this tree.
    #[error("this delegation tree may create at most {limit} runs; {used} exist and {requested} more were requested")]
    TreeBudgetExceeded {
        /// The tree's run budget.
        limit: u32,
        /// Runs already created in the tree.
        used: u32,
        /// Runs this request asked for.
        requested: u32,
    },
    /// One delegate call asked for more tasks than allowed. Not retryable as is.
    #[error("{requested} tasks in one delegate call; at most {limit} are allowed")]
    TooManyTasks {
        /// Tasks requested.
        requested: u32,
        /// The per-call limit.
        limit: u32,
    },
    /// The calling run would exceed its definition's `limits.max_children`. Not retryable in this run.
    #[error("agent {agent:?} may start at most {limit} child runs per run; {started} started and {requested} more were requested")]
    ChildLimit {
        /// The calling agent.
        agent: String,
        /// Its `limits.max_children`.
        limit: u32,
        /// Children it already started.
        started: u32,
        /// Children this request asked for.
        requested: u32,
    },
    /// Only the root agent may delegate in the background. Not retryable.
    #[error(
        "only the root agent may delegate in the background; delegate with mode \"foreground\""
    )]
    BackgroundNotAllowed,
    /// The agent's `llm_profile` names no configured provider. Not retryable.
    #[error("agent {agent:?} uses provider profile {profile:?}, which is not configured")]
    UnknownProfile {
        /// The agent.
        agent: String,
        /// Its profile.
        profile: String,
    },
    /// The agent's tool list cannot be given to a delegated run (fail-closed). Not retryable.
    #[error("agent {agent:?} cannot run: {reason}")]
    ToolScope {
        /// The agent.
        agent: String,
        /// Why its tool set was refused.
        reason: String,
    },
    /// The root session's inbox has no room for another completion. Retryable after the inbox drains.
    #[error("the inbox of this session is full (capacity {capacity}); wait for pending results before starting background work")]
    InboxFull {
        /// Inbox capacity of the session.
        capacity: u32,
    },
    /// The execution gate's run quota is full. Retryable when runs finish.
    #[error("too many agent runs are active: run quota exceeded: the {scope} limit of {limit} non-terminal runs is reached; wait for some to finish")]
    RunQuotaExceeded {
        /// Which limit is full.
        scope: GateScope,
        /// Its value.
        limit: usize,
    },
    /// The runtime is shutting down and refused to start a runner; the run
    /// was cancelled and no id is valid. Retryable after a restart.
    #[error("the runtime is shutting down; the delegated run was not started")]
    SpawnRejected,
    /// A signal contract limit refused the signal (severity, size, depth,
    /// count, rate) or its run ended. Not retryable as is.
    #[error("signal refused: {0}")]
    SignalRefused(String),
    /// No run with this id in the caller's tree (also for runs that exist elsewhere). Not retryable.
    #[error("run {0} not found")]
    RunNotFound(String),

    // ── built-in tools ───────────────────────────────────────────────────
    /// The workspace root of the built-in tools is missing or not a directory. Not retryable.
    #[error("workspace root {path}: {message}")]
    Workspace {
        /// The configured root.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },

    // ── other crates' errors ─────────────────────────────────────────────
    /// The provider failed. Retryable when [`ProviderError::is_retryable`] says so.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// Storage failed after the store's own retries; memory is unchanged.
    /// Internal; retryable when [`StoreError::is_retryable`] says so.
    #[error("storage: {0}")]
    Store(#[from] StoreError),
    /// A tool registry could not be built (two tools share a name, a scope
    /// names an unknown tool). Not retryable.
    #[error(transparent)]
    ToolRegistry(#[from] ToolRegistryError),
}

impl EngineError {
    /// Whether the same request may succeed later (see each variant's doc).
    pub fn is_retryable(&self) -> bool {
        match self {
            EngineError::EmptySummary
            | EngineError::SessionBusy { .. }
            | EngineError::TurnRunning(_)
            | EngineError::SteerFull { .. }
            | EngineError::InboxFull { .. }
            | EngineError::RunQuotaExceeded { .. }
            | EngineError::SpawnRejected => true,
            EngineError::Provider(e) => e.is_retryable(),
            EngineError::Store(e) => e.is_retryable(),
            _ => false,
        }
    }

    /// Whether this is the cancellation of a turn, a run or a wait.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, EngineError::Cancelled)
    }

    /// Whether a spend budget stopped the turn or run before a model call.
    pub fn is_budget_exhausted(&self) -> bool {
        matches!(self, EngineError::BudgetExhausted { .. })
    }

    /// Whether this is a turn cancelled at its deadline.
    pub fn is_timed_out(&self) -> bool {
        matches!(self, EngineError::TimedOut { .. })
    }

    /// Whether this is a failure of keel itself (storage, corrupt state, a
    /// panicked task) rather than a refusal or a mistake of the caller: its
    /// detail belongs in the log, not in front of a model or a client. A
    /// full disk is not: the user must know, and its message names no detail.
    pub fn is_internal(&self) -> bool {
        match self {
            EngineError::Store(StoreError::DiskFull { .. }) => false,
            EngineError::TurnPanicked(_)
            | EngineError::CorruptState(_)
            | EngineError::StateEncoding(_)
            | EngineError::Store(_) => true,
            _ => false,
        }
    }

    /// What the model reads when a tool call fails with this error: policy
    /// refusals as `denied`, caller mistakes as `invalid arguments`, internal
    /// failures as a generic message with an error id (see [`internal_message`]).
    pub(crate) fn into_tool_error(self) -> ToolError {
        if self.is_internal() {
            return internal_tool_error(&self);
        }
        match self {
            EngineError::Cancelled => ToolError::Cancelled,
            EngineError::InvalidDelegation(_)
            | EngineError::InvalidInput(_)
            | EngineError::InvalidTitle(_)
            | EngineError::UnknownAgent(_)
            | EngineError::AgentRemoved(_) => ToolError::InvalidArguments(self.to_string()),
            EngineError::MissingCallerIdentity
            | EngineError::UnauthorizedEdge { .. }
            | EngineError::DepthExceeded { .. }
            | EngineError::TreeBudgetExceeded { .. }
            | EngineError::TooManyTasks { .. }
            | EngineError::ChildLimit { .. }
            | EngineError::BackgroundNotAllowed
            | EngineError::UnknownProfile { .. }
            | EngineError::ToolScope { .. }
            | EngineError::SignalRefused(_)
            | EngineError::SlotReadonly(_)
            | EngineError::SlotRule(_) => ToolError::Denied(self.to_string()),
            _ => ToolError::Failed(self.to_string()),
        }
    }
}

/// An id that ties a generic message shown to a model or a client to the
/// log line carrying the detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ErrorId(String);

impl ErrorId {
    /// A fresh id: the 16 random hex digits of a UUID v7.
    fn new() -> Self {
        let simple = uuid::Uuid::now_v7().simple().to_string();
        Self(simple[simple.len() - 16..].to_owned())
    }
}

impl fmt::Display for ErrorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Logs an internal failure at error level under a fresh error id and
/// returns the only text a model may read about it.
pub(crate) fn internal_message(detail: &dyn fmt::Display) -> String {
    let id = ErrorId::new();
    tracing::error!(error_id = %id, error = %detail, "internal error shown to the model as its id");
    format!("internal error (id {id}); the operator can find details in the logs")
}

/// [`internal_message`] as a failed tool call.
pub(crate) fn internal_tool_error(detail: &dyn fmt::Display) -> ToolError {
    ToolError::Failed(internal_message(detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_and_internal_variants() {
        let store_busy = EngineError::Store(StoreError::Busy {
            attempts: 3,
            message: "database is locked".into(),
        });
        assert!(store_busy.is_retryable() && store_busy.is_internal());
        let sqlite = EngineError::Store(StoreError::Sqlite("no such table: x".into()));
        assert!(!sqlite.is_retryable() && sqlite.is_internal());
        let full = EngineError::Store(StoreError::DiskFull {
            attempts: 1,
            message: "database or disk is full".into(),
        });
        assert!(!full.is_internal());
        let quota = EngineError::RunQuotaExceeded {
            scope: GateScope::Global,
            limit: 1,
        };
        assert!(quota.is_retryable() && !quota.is_internal());
        assert!(!EngineError::TurnPanicked("boom".into()).is_retryable());
        assert!(EngineError::TurnPanicked("boom".into()).is_internal());
        assert!(!EngineError::DepthExceeded { depth: 3, limit: 2 }.is_retryable());
        assert!(EngineError::Cancelled.is_cancelled());
    }

    #[test]
    fn internal_errors_reach_the_model_as_an_id_only() {
        let err = EngineError::Store(StoreError::Sqlite("no such table: agent_runs".into()));
        let ToolError::Failed(text) = err.into_tool_error() else {
            panic!("an internal error is a failed call");
        };
        assert!(!text.contains("agent_runs"), "{text}");
        let id = text
            .strip_prefix("internal error (id ")
            .and_then(|rest| rest.split_once(')'))
            .map(|(id, _)| id)
            .unwrap_or_default();
        assert_eq!(id.len(), 16, "{text}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{text}");
    }

    #[test]
    fn refusals_keep_their_precise_text() {
        let err = EngineError::DepthExceeded { depth: 3, limit: 2 }.into_tool_error();
        assert_eq!(
            err.to_string(),
            "denied: delegation depth 3 exceeds the limit of 2; do the work yourself instead"
        );
        assert_eq!(
            EngineError::UnknownAgent("x".into())
                .into_tool_error()
                .to_string(),
            "invalid arguments: unknown agent \"x\""
        );
    }
}
