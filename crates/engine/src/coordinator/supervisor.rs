//! [`Supervisor`]: owns the runner tasks of the coordinator. Once closed it
//! rejects new spawns, which is what the background admission's
//! compensation path reacts to.

use std::future::Future;

use parking_lot::Mutex;
use tokio::task::{AbortHandle, JoinHandle};

/// A spawn was refused because the supervisor is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the task supervisor is closed")]
pub struct SpawnRejected;

#[derive(Default)]
struct State {
    closed: bool,
    tasks: Vec<AbortHandle>,
}

/// Tracks spawned tasks; [`Supervisor::close`] makes further spawns fail.
#[derive(Default)]
pub struct Supervisor {
    state: Mutex<State>,
}

impl Supervisor {
    /// An open supervisor with no tasks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawns `task` on the current runtime unless the supervisor is closed.
    pub fn spawn<F>(&self, task: F) -> Result<JoinHandle<F::Output>, SpawnRejected>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let mut state = self.state.lock();
        if state.closed {
            return Err(SpawnRejected);
        }
        state.tasks.retain(|t| !t.is_finished());
        let handle = tokio::spawn(task);
        state.tasks.push(handle.abort_handle());
        Ok(handle)
    }

    /// Refuses every later spawn; running tasks continue.
    pub fn close(&self) {
        self.state.lock().closed = true;
    }

    /// Accepts spawns again (after a test closed it).
    pub fn reopen(&self) {
        self.state.lock().closed = false;
    }

    /// Whether spawns are refused.
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// Tasks not finished yet.
    pub fn live(&self) -> usize {
        let mut state = self.state.lock();
        state.tasks.retain(|t| !t.is_finished());
        state.tasks.len()
    }

    /// Aborts every task (their runs stay non-terminal until the reaper or recovery ends them).
    pub fn abort_all(&self) {
        for t in self.state.lock().tasks.drain(..) {
            t.abort();
        }
    }
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock();
        f.debug_struct("Supervisor")
            .field("closed", &state.closed)
            .field("tasks", &state.tasks.len())
            .finish()
    }
}
