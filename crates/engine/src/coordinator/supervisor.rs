//! [`Supervisor`]: owns the runner tasks of the coordinator. Once closed it
//! rejects new spawns, which is what the background admission's
//! compensation path reacts to.

use std::future::Future;

use parking_lot::Mutex;
use tokio::task::{AbortHandle, JoinHandle};

/// A spawn was refused because the supervisor is closed. The only caller
/// turns it into [`EngineError::SpawnRejected`](crate::EngineError::SpawnRejected)
/// after compensating the runs it could not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SpawnRejected;

#[derive(Default)]
struct State {
    closed: bool,
    tasks: Vec<AbortHandle>,
}

/// Tracks spawned tasks; [`Supervisor::close`] makes further spawns fail.
#[derive(Default)]
pub(crate) struct Supervisor {
    state: Mutex<State>,
}

impl Supervisor {
    /// An open supervisor with no tasks.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Spawns `task` on the current runtime unless the supervisor is closed.
    pub(crate) fn spawn<F>(&self, task: F) -> Result<JoinHandle<F::Output>, SpawnRejected>
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
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
    }

    /// Aborts every task (their runs stay non-terminal until the reaper or recovery ends them).
    #[cfg(feature = "testing")]
    pub(crate) fn abort_all(&self) {
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
