//! Session leases across processes: when several processes serve one
//! database ([`keel_store::Backend::shared`]), a session's worker takes the
//! session's lease in the store before each step that may run a turn or
//! write the session, and gives it back after, so at most one turn of a
//! session runs anywhere at a time. While another process holds it the
//! worker waits (asking again with a growing pause). A lease taken after
//! another process held it means the session may have changed under this
//! process: what it remembers of the session is dropped and reloaded.
//! On a database one process owns (SQLite) nothing is asked or written.

use std::sync::Arc;
use std::time::Duration;

use keel_core::SessionId;
use keel_store::{SessionLease, Store};

use super::SessionManager;
use crate::error::Result;

/// The first pause before asking again for a lease another process holds.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
/// The longest pause between two asks.
const MAX_PAUSE: Duration = Duration::from_millis(200);

/// A session's lease, held by this process until [`Self::release`] (or,
/// as a fallback, its drop).
pub(super) struct SessionHold {
    store: Store,
    session: SessionId,
    held: bool,
}

impl SessionHold {
    /// Gives the lease back and waits until the store has it.
    pub(super) async fn release(mut self) {
        if std::mem::take(&mut self.held) {
            if let Err(e) = self.store.release_session(self.session).await {
                tracing::warn!(session_id = %self.session, error = %e, "giving a session lease back failed; it returns when this process stops");
            }
        }
    }
}

impl Drop for SessionHold {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let (store, session) = (self.store.clone(), self.session);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.release_session(session).await {
                    tracing::warn!(session_id = %session, error = %e, "giving a session lease back failed; it returns when this process stops");
                }
            });
        }
    }
}

impl SessionManager {
    /// Takes `session`'s lease for this process, waiting while another
    /// process holds it; reloads the session when another held it since.
    pub(super) async fn hold(self: &Arc<Self>, session: SessionId) -> Result<SessionHold> {
        let mut hold = SessionHold {
            store: self.store.clone(),
            session,
            held: false,
        };
        if !self.store.shared() {
            return Ok(hold);
        }
        let mut pause = FIRST_PAUSE;
        loop {
            match self.store.lease_session(session).await? {
                SessionLease::Held { moved } => {
                    hold.held = true;
                    if moved {
                        self.forget(session);
                    }
                    return Ok(hold);
                }
                SessionLease::Busy { holder } => {
                    tracing::debug!(session_id = %session, %holder, "another process runs this session's turn; waiting");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_PAUSE);
                }
            }
        }
    }

    /// Drops what this process remembers of `session` (its next use loads
    /// it again): another process may have changed it.
    fn forget(&self, session: SessionId) {
        self.sessions.lock().remove(&session);
        self.dialog_ledgers.forget(session);
    }
}

impl SessionManager {
    /// Takes over the work of processes whose registration expired (see
    /// [`keel_store::Backend::recover_expired_runtimes`]): their runs'
    /// results and their dialogs' inboxes are woken here, their approvals'
    /// timers restart here, and the inputs they acknowledged but never ran
    /// are queued here (`adopt` is told each, as by [`Self::resume_queued`]).
    /// `None` when no process had expired.
    pub async fn take_over_expired(
        self: &Arc<Self>,
        adopt: impl FnMut(SessionId, keel_core::TurnId),
    ) -> Result<Option<keel_store::ProcessRecovery>> {
        let Some(recovered) = self
            .store
            .recover_expired_runtimes(keel_core::time::now_ms())
            .await?
        else {
            return Ok(None);
        };
        for (generation, holder) in &recovered.processes {
            tracing::warn!(generation, %holder, "a process stopped renewing its registration; its work is taken over");
        }
        let resumed = self.resume_queued(adopt).await?;
        let mut wake: Vec<SessionId> = recovered.recovery.sessions_with_inbox_work.clone();
        wake.extend(self.store.sessions_with_open_approvals().await?);
        wake.sort_unstable();
        wake.dedup();
        for session in wake {
            self.wake_inbox(session);
        }
        tracing::info!(
            runs = recovered.recovery.interrupted_runs.len(),
            inputs_unanswered = recovered.recovery.unanswered_inputs,
            inputs_resumed = resumed,
            "took over the work of stopped processes"
        );
        Ok(Some(recovered))
    }
}
