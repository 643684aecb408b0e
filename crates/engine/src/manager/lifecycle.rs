//! Creating, loading, evicting and destroying sessions.

use std::sync::{Arc, Weak};
use std::time::Duration;

use keel_core::{AgentId, SessionId};
use keel_store::NewSession;
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{
    clean_title, default_title, uuid_tail, Entry, NewSessionSpec, SessionManager, INTERNAL_CHANNEL,
};
use crate::address::DialogAddress;
use crate::error::{EngineError, Result};
use crate::session::AgentSession;

impl SessionManager {
    /// Creates a session (persisted before this returns) and loads it.
    pub async fn create(&self, spec: NewSessionSpec) -> Result<SessionId> {
        self.create_with_parent(spec, None).await
    }

    async fn create_with_parent(
        &self,
        spec: NewSessionSpec,
        parent: Option<SessionId>,
    ) -> Result<SessionId> {
        let agent = self.bundle.agent(spec.agent.as_ref())?;
        let title = match spec.title {
            Some(t) => clean_title(&t)?,
            None => default_title(spec.address.dialog_id()),
        };
        let record = self
            .store
            .create_session(NewSession {
                id: SessionId::new(),
                channel: spec.address.channel().to_owned(),
                chat_id: spec.address.chat_id().to_owned(),
                dialog_id: spec.address.dialog_id().to_owned(),
                title,
                agent_id: Some(agent.name.clone()),
                parent_id: parent,
                delivery_context: None,
                now_ms: keel_core::time::now_ms(),
            })
            .await?;
        let id = record.id;
        let session = AgentSession::load(&self.store, record, agent).await?;
        self.insert(session);
        self.warm_dialog_ledger(id).await?;
        tracing::info!(session_id = %id, "session created");
        Ok(id)
    }

    /// Creates a child of `parent` (running `agent`, or the parent's agent).
    pub async fn create_child(
        &self,
        parent: SessionId,
        agent: Option<AgentId>,
    ) -> Result<SessionId> {
        let parent_agent = {
            let session = self.session(parent).await?;
            let guard = session.lock().await;
            guard.agent.name.clone()
        };
        let child_dialog = uuid_tail(SessionId::new());
        let address = DialogAddress::new(INTERNAL_CHANNEL, &parent.to_string(), &child_dialog)?;
        self.create_with_parent(
            NewSessionSpec {
                address,
                title: None,
                agent: Some(agent.unwrap_or(parent_agent)),
            },
            Some(parent),
        )
        .await
    }

    /// The session if it is in memory (no storage access).
    pub fn get(&self, id: SessionId) -> Result<Arc<AsyncMutex<AgentSession>>> {
        let mut map = self.sessions.lock();
        let entry = map.get_mut(&id).ok_or(EngineError::SessionNotFound(id))?;
        entry.last_access = Instant::now();
        Ok(entry.session.clone())
    }

    /// The session, from memory or else loaded from storage.
    pub async fn session(&self, id: SessionId) -> Result<Arc<AsyncMutex<AgentSession>>> {
        match self.get(id) {
            Ok(s) => Ok(s),
            Err(_) => self.load(id).await,
        }
    }

    /// Loads a session from storage into memory (replacing nothing that is
    /// already loaded: a concurrent load wins and is returned).
    pub async fn load(&self, id: SessionId) -> Result<Arc<AsyncMutex<AgentSession>>> {
        let record = self
            .store
            .get_session(id)
            .await?
            .filter(|r| r.deleted_at_ms.is_none())
            .ok_or(EngineError::SessionNotFound(id))?;
        let agent = self.bundle.loaded_agent(record.agent_id.as_ref())?;
        let session = AgentSession::load(&self.store, record, agent).await?;
        tracing::debug!(session_id = %id, "session loaded");
        let loaded = self.insert(session);
        self.warm_dialog_ledger(id).await?;
        Ok(loaded)
    }

    /// Reads the dialog's spend with the session, so a turn finds its
    /// ledger in memory and reads nothing from the store for it.
    async fn warm_dialog_ledger(&self, id: SessionId) -> Result<()> {
        self.dialog_ledgers
            .get(&self.store, id, self.config.max_cost_usd_per_dialog)
            .await
            .map(drop)
    }

    fn insert(&self, session: AgentSession) -> Arc<AsyncMutex<AgentSession>> {
        let id = session.id();
        let agent_id = session.record.agent_id.clone();
        let mut map = self.sessions.lock();
        let entry = map.entry(id).or_insert_with(|| Entry {
            session: Arc::new(AsyncMutex::new(session)),
            agent_id,
            last_access: Instant::now(),
        });
        entry.last_access = Instant::now();
        entry.session.clone()
    }

    /// The agent `id` runs (its record's), loading the session if needed.
    async fn agent_of(&self, id: SessionId) -> Result<Option<AgentId>> {
        // A session another process changed is dropped from memory when its
        // lease says so: a load racing that is loaded again.
        for _ in 0..3 {
            self.session(id).await?;
            if let Some(entry) = self.sessions.lock().get(&id) {
                return Ok(entry.agent_id.clone());
            }
        }
        Err(EngineError::SessionNotFound(id))
    }

    /// Refuses a turn of `id` when its agent is no longer defined
    /// ([`EngineError::AgentRemoved`]).
    pub(super) async fn check_agent(&self, id: SessionId) -> Result<()> {
        let agent_id = self.agent_of(id).await?;
        self.bundle.session_agent(agent_id.as_ref()).map(drop)
    }

    /// Whether the model of `session`'s agent takes images (its profile is
    /// not marked `images = false`).
    pub async fn accepts_images(&self, id: SessionId) -> Result<bool> {
        // Loaded first: a dialog an earlier process served is only stored.
        let agent_id = self.agent_of(id).await?;
        self.agent_accepts_images(agent_id.as_ref())
    }

    /// Whether the model of `agent` (`None`: the root agent) takes images.
    pub fn agent_accepts_images(&self, agent: Option<&AgentId>) -> Result<bool> {
        Ok(self.bundle.session_agent(agent)?.provider.accepts_images())
    }

    /// Ids of `parent`'s children that are not destroyed.
    pub async fn children(&self, parent: SessionId) -> Result<Vec<SessionId>> {
        Ok(self
            .store
            .child_sessions(parent)
            .await?
            .into_iter()
            .filter(|r| r.deleted_at_ms.is_none())
            .map(|r| r.id)
            .collect())
    }

    /// The parent of `child`; `None` for a root session or an orphan whose
    /// parent was destroyed.
    pub async fn parent(&self, child: SessionId) -> Result<Option<SessionId>> {
        let record = self
            .store
            .get_session(child)
            .await?
            .ok_or(EngineError::SessionNotFound(child))?;
        let Some(parent) = record.parent_id else {
            return Ok(None);
        };
        let alive = self
            .store
            .get_session(parent)
            .await?
            .is_some_and(|p| p.deleted_at_ms.is_none());
        Ok(alive.then_some(parent))
    }

    /// Cancels the session's turn, its housekeeping and its sub-agent runs (their pending
    /// inbox events are dead-lettered) and drops it from memory.
    pub(super) async fn retire(&self, id: SessionId, reason: &str) -> Result<()> {
        self.cancel_turn(id);
        self.housekeeping.cancel(id);
        if let Some(coordinator) = &self.bundle.coordinator {
            coordinator.cancel_session(id, reason).await?;
        }
        self.sessions.lock().remove(&id);
        Ok(())
    }

    /// Destroys one session: cancels its turn and runs, drops it from memory,
    /// soft-deletes it and deletes its checkpoints. Children become orphans.
    pub async fn destroy(&self, id: SessionId) -> Result<()> {
        self.retire(id, "session destroyed").await?;
        let now = keel_core::time::now_ms();
        if !self.store.soft_delete_session(id, now).await? {
            return Err(EngineError::SessionNotFound(id));
        }
        self.store.delete_checkpoints(id).await?;
        tracing::info!(session_id = %id, "session destroyed");
        Ok(())
    }

    /// Makes `id` run `agent` from its next turn on; see [`Self::update_dialog`].
    pub async fn switch_agent(&self, id: SessionId, agent: &AgentId) -> Result<()> {
        self.update_dialog(id, None, Some(agent)).await
    }

    /// Changes a dialog's title and/or agent in one write of its row; its
    /// history is kept and the new agent answers from the next turn on. A
    /// change of agent is refused with [`EngineError::TurnRunning`] while a
    /// turn runs; one that races a turn's start waits for that turn.
    pub async fn update_dialog(
        &self,
        id: SessionId,
        title: Option<&str>,
        agent: Option<&AgentId>,
    ) -> Result<()> {
        self.leased(id, self.update_dialog_leased(id, title, agent))
            .await
    }

    /// [`Self::update_dialog`] under the session's lease.
    async fn update_dialog_leased(
        &self,
        id: SessionId,
        title: Option<&str>,
        agent: Option<&AgentId>,
    ) -> Result<()> {
        let title = title.map(super::clean_title).transpose()?;
        let profile = agent.map(|a| self.bundle.agent(Some(a))).transpose()?;
        let session = self.session(id).await?;
        if profile.is_some() {
            if let Some(turn) = self.running_turn(id) {
                return Err(EngineError::TurnRunning(turn));
            }
        }
        // A turn holds this lock while it runs: a switch never changes the
        // agent of a turn in progress, only of the next one.
        let mut guard = session.lock().await;
        self.fresh(&mut guard).await?;
        let r = guard.record.clone();
        let updated = self
            .store
            .upsert_session(NewSession {
                id: r.id,
                channel: r.channel,
                chat_id: r.chat_id,
                dialog_id: r.dialog_id,
                title: title.unwrap_or(r.title),
                agent_id: profile.as_ref().map(|p| p.name.clone()).or(r.agent_id),
                parent_id: r.parent_id,
                delivery_context: r.delivery_context,
                now_ms: keel_core::time::now_ms(),
            })
            .await?;
        if let Some(entry) = self.sessions.lock().get_mut(&id) {
            entry.agent_id = updated.agent_id.clone();
        }
        guard.record = updated;
        if let Some(profile) = profile {
            guard.agent = profile;
        }
        Ok(())
    }

    /// Drops sessions idle longer than the TTL from memory (never one in
    /// use). Returns how many were evicted.
    pub fn evict_idle(&self) -> usize {
        let now = Instant::now();
        let mut map = self.sessions.lock();
        let before = map.len();
        map.retain(|_, e| {
            let idle = now.saturating_duration_since(e.last_access) >= self.config.idle_ttl;
            let in_use = Arc::strong_count(&e.session) > 1 || e.session.try_lock().is_err();
            !idle || in_use
        });
        before - map.len()
    }

    /// Number of sessions in memory.
    pub fn loaded(&self) -> usize {
        self.sessions.lock().len()
    }

    /// Runs [`Self::evict_idle`] every `interval` until the manager is dropped.
    pub fn spawn_evictor(self: &Arc<Self>, interval: Duration) -> JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(self);
        let mut ticker = tokio::time::interval_at(Instant::now() + interval, interval);
        tokio::spawn(async move {
            loop {
                ticker.tick().await;
                let Some(manager) = weak.upgrade() else { break };
                let n = manager.evict_idle();
                if n > 0 {
                    tracing::debug!(evicted = n, "idle sessions evicted");
                }
            }
        })
    }
}
