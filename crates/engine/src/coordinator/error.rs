//! [`CoordinatorError`]: why a delegation or a run query was refused, and how
//! the runtime tools show it to the model.

use keel_core::ToolError;
use keel_store::StoreError;

/// Why the coordinator refused a request. Policy refusals are decided before
/// anything is persisted, so a refused delegation leaves no run behind.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoordinatorError {
    /// The tool context names neither a root turn (session + turn) nor a run. Not retryable.
    #[error("this context cannot delegate: it is neither a root turn (session and turn) nor an agent run")]
    MissingCallerIdentity,
    /// The request is malformed (no tasks, empty task text, oversized field). Not retryable.
    #[error("invalid delegation request: {0}")]
    InvalidRequest(String),
    /// No agent definition has this id. Not retryable.
    #[error("unknown agent {0:?}")]
    UnknownAgent(String),
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
    /// Only the root agent may delegate in the background in this version. Not retryable.
    #[error(
        "only the root agent may delegate in the background; delegate with mode \"foreground\""
    )]
    BackgroundNotAllowed,
    /// The root session's inbox has no room for another completion. Retryable after the inbox drains.
    #[error("the inbox of this session is full (capacity {capacity}); wait for pending results before starting background work")]
    InboxFull {
        /// Inbox capacity of the session.
        capacity: u32,
    },
    /// The execution gate's run quota is exhausted. Retryable when runs finish.
    #[error("too many agent runs are active: {0}; wait for some to finish")]
    RunQuotaFull(String),
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
    /// The supervisor refused to start the runner (shutdown); the run was cancelled and no id is valid. Retryable after restart.
    #[error("the runtime is shutting down; the delegated run was not started")]
    SpawnRejected,
    /// No run with this id in the caller's tree (also for runs that exist elsewhere). Not retryable.
    #[error("run {0} not found")]
    NotFound(String),
    /// The caller was cancelled while the request ran.
    #[error("cancelled")]
    Cancelled,
    /// Storage failed after its retries (see [`StoreError::is_retryable`]).
    #[error("storage: {0}")]
    Store(#[from] StoreError),
}

impl CoordinatorError {
    /// The tool error the model sees for this refusal.
    pub fn into_tool_error(self) -> ToolError {
        match self {
            CoordinatorError::InvalidRequest(_) | CoordinatorError::UnknownAgent(_) => {
                ToolError::InvalidArguments(self.to_string())
            }
            CoordinatorError::Cancelled => ToolError::Cancelled,
            CoordinatorError::NotFound(_)
            | CoordinatorError::SpawnRejected
            | CoordinatorError::InboxFull { .. }
            | CoordinatorError::RunQuotaFull(_)
            | CoordinatorError::Store(_) => ToolError::Failed(self.to_string()),
            CoordinatorError::MissingCallerIdentity
            | CoordinatorError::UnauthorizedEdge { .. }
            | CoordinatorError::DepthExceeded { .. }
            | CoordinatorError::TreeBudgetExceeded { .. }
            | CoordinatorError::TooManyTasks { .. }
            | CoordinatorError::ChildLimit { .. }
            | CoordinatorError::BackgroundNotAllowed
            | CoordinatorError::UnknownProfile { .. }
            | CoordinatorError::ToolScope { .. } => ToolError::Denied(self.to_string()),
        }
    }
}

impl From<CoordinatorError> for ToolError {
    fn from(e: CoordinatorError) -> Self {
        e.into_tool_error()
    }
}
