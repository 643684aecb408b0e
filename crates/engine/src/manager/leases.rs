//! Session leases across processes: when several processes serve one
//! database ([`keel_store::Backend::shared`]), a session's worker takes the
//! session's lease in the store before each step that may run a turn or
//! write the session, and gives it back after, so at most one turn of a
//! session runs anywhere at a time. While another process holds it the
//! worker waits (asking again with a growing pause). A lease taken after
//! another process held it means the session may have changed under this
//! process: what it remembers of the session is dropped and reloaded.
//! Within the process, the holders of one session's lease (its worker, an
//! API write such as a rollback) take turns at a gate first, so the lease
//! is taken and given back by one of them at a time. A lease given back
//! stays this process's a moment ([`SessionManagerConfig::lease_linger`])
//! before it returns to the store: a dialog's next step (the user's next
//! message, a continuation) usually comes sooner and takes it again
//! without a round trip; another process that wants it waits that much
//! longer. Shutting down returns them all
//! ([`SessionManager::give_back_leases`]). On a database one process owns
//! (SQLite) nothing is asked, written or waited for.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex as AsyncMutex;

use keel_core::SessionId;
use keel_store::{SessionLease, Store};

use super::SessionManager;
#[cfg(doc)]
use super::SessionManagerConfig;
use crate::error::Result;
use crate::session::AgentSession;

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
    /// This process's turn at the session's gate (shared databases only).
    gate: Option<tokio::sync::OwnedMutexGuard<()>>,
    gates: Arc<LeaseGates>,
}

/// Each session's gate: the holders of its lease in this process take
/// turns there. Gates nobody waits at are dropped. And the leases given
/// back but lingering, each with the number of its pending return.
pub(super) struct LeaseGates {
    /// How long a lease given back lingers.
    linger: Duration,
    gates: parking_lot::Mutex<HashMap<SessionId, Arc<AsyncMutex<()>>>>,
    lingering: parking_lot::Mutex<HashMap<SessionId, u64>>,
    returns: std::sync::atomic::AtomicU64,
    /// Set when the process shuts down: a lease given back returns at once.
    closing: std::sync::atomic::AtomicBool,
}

impl LeaseGates {
    /// Gates whose leases linger `linger` once given back.
    pub(super) fn new(linger: Duration) -> Self {
        Self {
            linger,
            gates: Default::default(),
            lingering: Default::default(),
            returns: Default::default(),
            closing: Default::default(),
        }
    }

    async fn enter(&self, session: SessionId) -> tokio::sync::OwnedMutexGuard<()> {
        let gate = {
            let mut gates = self.gates.lock();
            gates.retain(|_, g| Arc::strong_count(g) > 1);
            Arc::clone(gates.entry(session).or_default())
        };
        gate.lock_owned().await
    }

    /// Takes `session`'s lingering lease, if it has one (at its gate).
    fn take_lingering(&self, session: SessionId) -> bool {
        self.lingering.lock().remove(&session).is_some()
    }
}

impl SessionHold {
    /// Gives the lease back: it lingers a moment, then returns to the
    /// store unless this process took it again meanwhile.
    pub(super) async fn release(mut self) {
        if !std::mem::take(&mut self.held) {
            return;
        }
        let gates = Arc::clone(&self.gates);
        // The gate stays shut until the lease is back (or lingering), so
        // this process's next holder never has it given back under it.
        let Some(gate) = self.gate.take() else {
            return give_back(&self.store, self.session).await;
        };
        if gates.linger.is_zero() || gates.closing.load(std::sync::atomic::Ordering::Acquire) {
            give_back(&self.store, self.session).await;
            return drop(gate);
        }
        let number = gates
            .returns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        gates.lingering.lock().insert(self.session, number);
        let door = Arc::clone(tokio::sync::OwnedMutexGuard::mutex(&gate));
        drop(gate);
        let (store, session) = (self.store.clone(), self.session);
        tokio::spawn(async move {
            tokio::time::sleep(gates.linger).await;
            // At the gate: nobody takes the lease while it returns.
            let _gate = door.lock_owned().await;
            let pending = {
                let mut lingering = gates.lingering.lock();
                let ours = lingering.get(&session) == Some(&number);
                ours && lingering.remove(&session).is_some()
            };
            if pending {
                give_back(&store, session).await;
            }
        });
    }
}

/// Returns `session`'s lease to the store.
async fn give_back(store: &Store, session: SessionId) {
    if let Err(e) = store.release_session(session).await {
        tracing::warn!(session_id = %session, error = %e, "giving a session lease back failed; it returns when this process stops");
    }
}

impl Drop for SessionHold {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        let (store, session) = (self.store.clone(), self.session);
        // The gate stays shut until the lease is back, so this process's
        // next holder never has its lease given back under it.
        let gate = self.gate.take();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                give_back(&store, session).await;
                drop(gate);
            });
        }
    }
}

impl SessionManager {
    /// Takes `session`'s lease for this process, waiting while another
    /// process holds it; reloads the session when another held it since.
    pub(super) async fn hold(&self, session: SessionId) -> Result<SessionHold> {
        let mut hold = SessionHold {
            store: self.store.clone(),
            session,
            held: false,
            gate: None,
            gates: Arc::clone(&self.lease_gates),
        };
        if !self.store.shared() {
            return Ok(hold);
        }
        hold.gate = Some(self.lease_gates.enter(session).await);
        if self.lease_gates.take_lingering(session) {
            // Held all along: nobody else wrote the session meanwhile.
            hold.held = true;
            return Ok(hold);
        }
        let mut pause = FIRST_PAUSE;
        loop {
            match self.store.lease_session(session).await? {
                SessionLease::Held { moved } => {
                    hold.held = true;
                    if moved {
                        // Whoever writes the session next under this lease
                        // reads it again first (`fresh`); meanwhile nobody
                        // uses the copy in memory.
                        self.stale.lock().insert(session);
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

    /// Returns every lingering lease to the store now, and every lease
    /// given back from now on at once (the process is shutting down).
    pub async fn give_back_leases(&self) {
        let gates = &self.lease_gates;
        gates
            .closing
            .store(true, std::sync::atomic::Ordering::Release);
        let sessions: Vec<SessionId> = gates.lingering.lock().keys().copied().collect();
        for session in sessions {
            let _gate = gates.enter(session).await;
            if gates.take_lingering(session) {
                give_back(&self.store, session).await;
            }
        }
    }

    /// Whether this process has `session` in memory: it exists, and was
    /// not deleted here since it was loaded.
    pub fn holds(&self, session: SessionId) -> bool {
        self.sessions.lock().contains_key(&session)
    }

    /// Drops what this process remembers of `session` (its next use loads
    /// it again): another process may have changed it.
    pub(super) fn forget(&self, session: SessionId) {
        self.sessions.lock().remove(&session);
        self.dialog_ledgers.forget(session);
    }

    /// Reloads `session` (held, locked) when another process held its lease
    /// since this one last wrote it: a copy loaded before the lease was
    /// taken may be in memory. Every write under the lease calls it first.
    pub(super) async fn fresh(&self, session: &mut AgentSession) -> Result<()> {
        let id = session.id();
        if !self.stale.lock().remove(&id) {
            return Ok(());
        }
        if let Err(e) = self.reload(session).await {
            self.stale.lock().insert(id);
            return Err(e);
        }
        Ok(())
    }

    /// Reads `session` (held, locked) again from the store, in place.
    pub(super) async fn reload(&self, session: &mut AgentSession) -> Result<()> {
        let id = session.id();
        let record = self
            .store
            .get_session(id)
            .await?
            .filter(|r| r.deleted_at_ms.is_none())
            .ok_or(crate::error::EngineError::SessionNotFound(id))?;
        *session = AgentSession::load(&self.store, record, Arc::clone(&session.agent)).await?;
        self.dialog_ledgers.forget(id);
        tracing::debug!(session_id = %id, "session reloaded: another process changed it");
        Ok(())
    }

    /// Runs `body` under `session`'s lease (see [`Self::hold`]), for the
    /// writes outside turns (rollback, rename, slots …), giving the lease
    /// back after.
    pub(super) async fn leased<T>(
        &self,
        session: SessionId,
        body: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let hold = self.hold(session).await?;
        let out = body.await;
        hold.release().await;
        out
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
