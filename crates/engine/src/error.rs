//! Errors of the engine: [`AgentError`] for a turn or run, [`EngineError`] for
//! session, checkpoint and dialog operations.

use keel_core::{CheckpointId, ProviderError, SessionId};
use keel_store::StoreError;

/// Why a turn (or a run's loop) did not complete.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AgentError {
    /// The turn's cancellation token fired; nothing was committed.
    #[error("the turn was cancelled")]
    Cancelled,
    /// The turn or run passed its deadline; nothing was committed.
    #[error("the turn timed out")]
    TimedOut,
    /// The model kept calling tools past the agent's iteration limit.
    #[error("the agent reached its limit of {limit} model calls without a final answer")]
    MaxIterations {
        /// The limit.
        limit: u32,
    },
    /// The provider failed (see [`ProviderError::is_retryable`]).
    #[error(transparent)]
    Provider(#[from] ProviderError),
}

/// Why a session, checkpoint or dialog operation failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No session with this id (in memory, or in storage for `recover`).
    #[error("session {0} not found")]
    SessionNotFound(SessionId),
    /// No checkpoint with this id in this session.
    #[error("checkpoint {0} not found")]
    CheckpointNotFound(CheckpointId),
    /// No context slot with this name.
    #[error("context slot {0:?} not found")]
    SlotNotFound(String),
    /// A slot with this name exists already.
    #[error("context slot {0:?} already exists")]
    SlotExists(String),
    /// The slot is read-only: no turn or merge may write to it.
    #[error("context slot {0:?} is read-only")]
    SlotReadonly(String),
    /// A slot operation that is never allowed (e.g. deleting the default slot).
    #[error("{0}")]
    SlotRule(String),
    /// No agent profile with this name is registered.
    #[error("unknown agent {0:?}")]
    UnknownAgent(String),
    /// The input is malformed (e.g. a bad unified session id).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The turn failed.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// Storage failed after its retries; the session in memory is unchanged.
    #[error("storage: {0}")]
    Store(#[from] StoreError),
    /// A sub-agent operation failed.
    #[error(transparent)]
    Coordinator(#[from] crate::coordinator::CoordinatorError),
    /// Stored session state could not be decoded.
    #[error("corrupt session state: {0}")]
    CorruptState(String),
}

impl EngineError {
    /// Whether this is the turn's cancellation.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, EngineError::Agent(AgentError::Cancelled))
    }
}
