//! [`SessionManager`]: creates, loads, evicts and destroys sessions, runs
//! their turns (committing each turn with its checkpoint in one store
//! transaction), and manages dialogs, slots, memory and checkpoints.
//!
//! Locking: the session map is a `parking_lot` mutex that is never held
//! across an `.await` (its guard is not `Send`, so the compiler enforces it).
//! Each session has its own async mutex; a turn holds it from start to
//! commit, so turns of one session are serialized and turns of different
//! sessions run in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use keel_core::{
    AgentId, ChatRequest, CheckpointId, Message, SessionId, ToolExecutionContext, TurnId,
};
use keel_store::{
    CheckpointRecord, DialogCursor, DialogQuery, NewSession, Page, PrunePolicy, PruneReport,
    SessionRecord, Store,
};
use parking_lot::Mutex;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::address::DialogAddress;
use crate::agent_loop::{AgentLoop, EventSink, TurnEvent, TurnOutput, TurnRequest};
use crate::coordinator::AgentCoordinator;
use crate::error::{EngineError, Result};
use crate::session::{AgentProfile, AgentSession};
use crate::snapshot::SessionSnapshot;
use crate::state::{MergeStrategy, SlotMode};

/// Channel of sessions that are not dialogs (e.g. sub-agent children).
pub(crate) const INTERNAL_CHANNEL: &str = "internal";
/// Longest title, in characters.
pub(crate) const MAX_TITLE_CHARS: usize = 80;

/// The agents sessions can run, and the loop that runs them. Child sessions
/// share their parent's bundle.
pub struct RuntimeBundle {
    agents: HashMap<AgentId, Arc<AgentProfile>>,
    root: AgentId,
    agent_loop: Arc<AgentLoop>,
    coordinator: Option<Arc<AgentCoordinator>>,
}

impl RuntimeBundle {
    /// A bundle whose default (root) agent is `root`.
    pub fn new(root: AgentProfile) -> Self {
        let name = root.name.clone();
        let mut agents = HashMap::new();
        agents.insert(name.clone(), Arc::new(root));
        Self {
            agents,
            root: name,
            agent_loop: Arc::new(AgentLoop::default()),
            coordinator: None,
        }
    }

    /// Sub-agent runs of deleted sessions are cancelled through `coordinator`.
    pub fn with_coordinator(mut self, coordinator: Arc<AgentCoordinator>) -> Self {
        self.coordinator = Some(coordinator);
        self
    }

    /// Adds another agent sessions may switch to.
    pub fn with_agent(mut self, profile: AgentProfile) -> Self {
        self.agents.insert(profile.name.clone(), Arc::new(profile));
        self
    }

    /// Runs turns with `agent_loop` (hooks, step gate).
    pub fn with_loop(mut self, agent_loop: AgentLoop) -> Self {
        self.agent_loop = Arc::new(agent_loop);
        self
    }

    /// The profile of `name`, or of the root agent when `None`.
    pub fn agent(&self, name: Option<&AgentId>) -> Result<Arc<AgentProfile>> {
        let name = name.unwrap_or(&self.root);
        self.agents
            .get(name)
            .cloned()
            .ok_or_else(|| EngineError::UnknownAgent(name.to_string()))
    }
}

/// When to summarize a slot's context automatically.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryConfig {
    /// Summarize when the replayed context exceeds this share of the budget.
    pub trigger_ratio: f32,
    /// The context budget, in estimated tokens.
    pub max_context_tokens: usize,
    /// Turns between two summaries of a session.
    pub debounce_turns: u32,
}

impl Default for SummaryConfig {
    fn default() -> Self {
        Self {
            trigger_ratio: 0.75,
            max_context_tokens: 32_000,
            debounce_turns: 3,
        }
    }
}

/// Behaviour of a [`SessionManager`].
#[derive(Debug, Clone)]
pub struct SessionManagerConfig {
    /// Checkpoint after every committed turn (default true).
    pub auto_checkpoint: bool,
    /// Sessions idle this long are dropped from memory (storage keeps them).
    pub idle_ttl: Duration,
    /// Generate a title once this many visible user messages exist while the
    /// title is still the default (0 disables; default 10).
    pub auto_title_after: u64,
    /// Automatic summaries, off when `None`.
    pub summary: Option<SummaryConfig>,
}

impl Default for SessionManagerConfig {
    fn default() -> Self {
        Self {
            auto_checkpoint: true,
            idle_ttl: Duration::from_secs(24 * 3600),
            auto_title_after: 10,
            summary: None,
        }
    }
}

/// Where a new session lives.
#[derive(Debug, Clone)]
pub struct NewSessionSpec {
    /// Channel, chat and dialog of the session.
    pub address: DialogAddress,
    /// Title; `Dialog <dialog_id>` when `None`.
    pub title: Option<String>,
    /// Agent to run; the bundle's root agent when `None`.
    pub agent: Option<AgentId>,
}

/// The default title of a dialog.
pub(crate) fn default_title(dialog_id: &str) -> String {
    format!("Dialog {dialog_id}")
}

/// A fresh dialog id: 8 hex characters.
pub(crate) fn new_dialog_id() -> String {
    let id = uuid_tail(SessionId::new());
    id[id.len() - 8..].to_owned()
}

fn uuid_tail(id: SessionId) -> String {
    id.as_uuid().simple().to_string()
}

/// The result of a committed turn.
#[derive(Debug, Clone)]
pub struct TurnReport {
    /// The turn's id.
    pub turn_id: TurnId,
    /// What the turn produced (already committed).
    pub output: TurnOutput,
    /// The automatic checkpoint, when enabled.
    pub checkpoint: Option<CheckpointId>,
}

struct Entry {
    session: Arc<AsyncMutex<AgentSession>>,
    last_access: Instant,
}

/// Manages sessions; see the module docs.
pub struct SessionManager {
    store: Store,
    bundle: Arc<RuntimeBundle>,
    config: SessionManagerConfig,
    sessions: Mutex<HashMap<SessionId, Entry>>,
    active_turns: Mutex<HashMap<SessionId, CancellationToken>>,
}

impl SessionManager {
    /// A manager over `store` running agents from `bundle`.
    pub fn new(store: Store, bundle: RuntimeBundle, config: SessionManagerConfig) -> Arc<Self> {
        Arc::new(Self {
            store,
            bundle: Arc::new(bundle),
            config,
            sessions: Mutex::new(HashMap::new()),
            active_turns: Mutex::new(HashMap::new()),
        })
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    // ── lifecycle ────────────────────────────────────────────────────────

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
        let agent = self.bundle.agent(record.agent_id.as_ref())?;
        let session = AgentSession::load(&self.store, record, agent).await?;
        tracing::debug!(session_id = %id, "session loaded");
        Ok(self.insert(session))
    }

    fn insert(&self, session: AgentSession) -> Arc<AsyncMutex<AgentSession>> {
        let id = session.id();
        let mut map = self.sessions.lock();
        let entry = map.entry(id).or_insert_with(|| Entry {
            session: Arc::new(AsyncMutex::new(session)),
            last_access: Instant::now(),
        });
        entry.last_access = Instant::now();
        entry.session.clone()
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

    /// Cancels the session's turn and its sub-agent runs (their pending
    /// inbox events are dead-lettered) and drops it from memory.
    async fn retire(&self, id: SessionId, reason: &str) -> Result<()> {
        self.stop(id);
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

    /// Makes `id` run `agent` from now on; its history is kept.
    pub async fn switch_agent(&self, id: SessionId, agent: &AgentId) -> Result<()> {
        let profile = self.bundle.agent(Some(agent))?;
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        let r = guard.record.clone();
        let updated = self
            .store
            .upsert_session(NewSession {
                id: r.id,
                channel: r.channel,
                chat_id: r.chat_id,
                dialog_id: r.dialog_id,
                title: r.title,
                agent_id: Some(profile.name.clone()),
                parent_id: r.parent_id,
                delivery_context: r.delivery_context,
                now_ms: keel_core::time::now_ms(),
            })
            .await?;
        guard.record = updated;
        guard.agent = profile;
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

    // ── turns ────────────────────────────────────────────────────────────

    /// Runs a user turn to its end and commits it.
    pub async fn submit_turn(self: &Arc<Self>, id: SessionId, input: &str) -> Result<TurnReport> {
        self.submit_turn_stream(id, vec![Message::user(input)], None)
            .await?
            .finalize()
            .await
    }

    /// Starts a turn whose events go to `events`; nothing is committed (no
    /// message, no checkpoint) unless [`PendingTurn::finalize`] is called.
    pub async fn submit_turn_stream(
        self: &Arc<Self>,
        id: SessionId,
        input: Vec<Message>,
        events: Option<EventSink>,
    ) -> Result<PendingTurn> {
        let session = self.session(id).await?;
        let guard = session.lock_owned().await;
        let slot = guard.writable_slot()?;
        let history = guard.replay(&slot)?;
        let agent = guard.agent.clone();
        let turn_id = TurnId::new();
        let cancel = CancellationToken::new();
        self.active_turns.lock().insert(id, cancel.clone());
        let origin = input.first().map(|m| m.origin).unwrap_or_default();
        let request = TurnRequest {
            provider: agent.provider.clone(),
            tools: agent.tools.clone(),
            system_prompt: Some(agent.system_prompt.clone()),
            history,
            input,
            max_iterations: agent.max_iterations,
            max_output_tokens: agent.max_output_tokens,
            context: ToolExecutionContext {
                session_id: Some(id),
                turn_id: Some(turn_id),
                run_id: None,
                origin,
                cancellation: cancel.clone(),
                extensions: Default::default(),
            },
        };
        let agent_loop = self.bundle.agent_loop.clone();
        let sink = events.clone();
        let task = tokio::spawn(async move { agent_loop.run(request, sink.as_ref()).await });
        Ok(PendingTurn {
            manager: self.clone(),
            guard: Some(guard),
            slot,
            turn_id,
            task: Some(task),
            cancel,
            events,
        })
    }

    /// Cancels the running turn of `id`; returns whether one was running.
    pub fn stop(&self, id: SessionId) -> bool {
        match self.active_turns.lock().remove(&id) {
            Some(token) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    async fn after_commit(&self, session: &mut AgentSession) {
        self.maybe_title(session).await;
        self.maybe_summarize(session, false).await;
    }

    async fn maybe_title(&self, session: &mut AgentSession) {
        let n = self.config.auto_title_after;
        let record = &session.record;
        if n == 0 || record.message_count < n || record.title != default_title(&record.dialog_id) {
            return;
        }
        match generate_title(session).await {
            Ok(title) => {
                let now = keel_core::time::now_ms();
                match self
                    .store
                    .rename_session(session.id(), title.clone(), now)
                    .await
                {
                    Ok(()) => {
                        tracing::info!(session_id = %session.id(), %title, "dialog titled");
                        session.record.title = title;
                    }
                    Err(e) => {
                        tracing::warn!(session_id = %session.id(), error = %e, "saving the generated title failed")
                    }
                }
            }
            Err(e) => {
                tracing::warn!(session_id = %session.id(), error = %e, "title generation failed; will retry after the next turn")
            }
        }
    }

    /// Summarizes the current slot when its context is over the configured
    /// ratio (or always when `force`). Failures are logged, never returned.
    async fn maybe_summarize(&self, session: &mut AgentSession, force: bool) -> bool {
        let config = self.config.summary.clone().unwrap_or_default();
        if self.config.summary.is_none() && !force {
            return false;
        }
        let slot = session.state.current_slot.clone();
        let Ok(replay) = session.replay(&slot) else {
            return false;
        };
        let tokens: usize = replay.iter().map(|m| m.estimated_tokens()).sum();
        let due = session
            .state
            .last_summary_turn
            .is_none_or(|t| session.state.turn_index.saturating_sub(t) >= config.debounce_turns);
        let over = tokens as f32 > config.trigger_ratio * config.max_context_tokens as f32;
        if !(force || over && due) {
            return false;
        }
        match summarize(session, &replay).await {
            Ok(summary) => {
                let mut state = session.state.clone();
                state.last_summary_turn = Some(state.turn_index);
                if let Some(config) = state.slots.get_mut(&slot) {
                    config.summary = Some(summary);
                }
                match session.commit(&self.store, Vec::new(), state, None).await {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(session_id = %session.id(), error = %e, "saving the summary failed");
                        false
                    }
                }
            }
            Err(e) => {
                tracing::warn!(session_id = %session.id(), error = %e, "summary failed; the turn is unaffected");
                false
            }
        }
    }

    /// Summarizes the current slot now (`/compact`); a failure is reported.
    pub async fn compact(&self, id: SessionId) -> Result<bool> {
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        Ok(self.maybe_summarize(&mut guard, true).await)
    }

    // ── slots and memory ─────────────────────────────────────────────────

    async fn edit_state<T>(
        &self,
        id: SessionId,
        edit: impl FnOnce(
            &AgentSession,
            &mut crate::state::SessionState,
        ) -> Result<(T, Vec<Message>, String)>,
    ) -> Result<T> {
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        let mut state = guard.state.clone();
        let (out, messages, slot) = edit(&guard, &mut state)?;
        let messages = messages.into_iter().map(|m| (slot.clone(), m)).collect();
        guard.commit(&self.store, messages, state, None).await?;
        Ok(out)
    }

    /// Creates an empty slot.
    pub async fn create_slot(&self, id: SessionId, name: &str, mode: SlotMode) -> Result<()> {
        self.edit_state(id, |s, st| {
            st.create_slot(name, mode, s.last_seq + 1)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Makes `name` the slot new turns use.
    pub async fn switch_slot(&self, id: SessionId, name: &str) -> Result<()> {
        self.edit_state(id, |_, st| {
            st.switch_slot(name)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Forks slot `from` into a new slot `name`.
    pub async fn derive_slot(
        &self,
        id: SessionId,
        from: &str,
        name: &str,
        mode: SlotMode,
    ) -> Result<()> {
        self.edit_state(id, |s, st| {
            st.derive_slot(from, name, mode, s.last_seq)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Merges slot `source` of session `source_session` into `target`.
    /// Merging across sessions, into itself or into a read-only slot is refused.
    pub async fn merge_slot(
        &self,
        id: SessionId,
        source_session: SessionId,
        source: &str,
        target: &str,
        strategy: MergeStrategy,
    ) -> Result<()> {
        if source_session != id {
            return Err(EngineError::SlotRule(
                "slots can only be merged within one session".into(),
            ));
        }
        self.edit_state(id, |s, st| {
            let appended = st.merge_slot(source, target, strategy, &s.history, s.last_seq)?;
            Ok(((), appended, target.to_owned()))
        })
        .await
    }

    /// Deletes a slot.
    pub async fn delete_slot(&self, id: SessionId, name: &str) -> Result<()> {
        self.edit_state(id, |_, st| {
            st.delete_slot(name)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Sets a session memory entry.
    pub async fn set_memory(
        &self,
        id: SessionId,
        key: &str,
        value: String,
        metadata: serde_json::Value,
    ) -> Result<()> {
        self.edit_state(id, |_, st| {
            st.set_memory(key, value, metadata, keel_core::time::now_ms())?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    // ── dialogs ──────────────────────────────────────────────────────────

    /// The session of a dialog, created (with the default title) if new.
    pub async fn open_dialog(
        &self,
        address: &DialogAddress,
        agent: Option<AgentId>,
    ) -> Result<SessionId> {
        let existing = self
            .store
            .get_dialog(address.channel(), address.chat_id(), address.dialog_id())
            .await?;
        match existing {
            Some(r) if r.deleted_at_ms.is_none() => Ok(r.id),
            Some(_) => Err(EngineError::InvalidInput(format!(
                "dialog {address} was deleted"
            ))),
            None => {
                self.create(NewSessionSpec {
                    address: address.clone(),
                    title: None,
                    agent,
                })
                .await
            }
        }
    }

    /// Creates a new dialog in a chat with a fresh dialog id.
    pub async fn create_dialog(
        &self,
        channel: &str,
        chat_id: &str,
        title: Option<String>,
        agent: Option<AgentId>,
    ) -> Result<SessionId> {
        let address = DialogAddress::new(channel, chat_id, &new_dialog_id())?;
        self.create(NewSessionSpec {
            address,
            title,
            agent,
        })
        .await
    }

    /// Dialogs of a chat, most recently created first, with cursor pagination.
    pub async fn list_dialogs(
        &self,
        channel: &str,
        chat_id: &str,
        limit: usize,
        cursor: Option<DialogCursor>,
    ) -> Result<Page<SessionRecord, DialogCursor>> {
        Ok(self
            .store
            .list_dialogs(DialogQuery {
                channel: channel.to_owned(),
                chat_id: chat_id.to_owned(),
                include_deleted: false,
                limit,
                cursor,
            })
            .await?)
    }

    /// The chat's most recently active dialog.
    pub async fn latest_dialog(
        &self,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<SessionRecord>> {
        Ok(self.store.latest_active_dialog(channel, chat_id).await?)
    }

    /// The stored record of a session.
    pub async fn record(&self, id: SessionId) -> Result<SessionRecord> {
        let session = self.session(id).await?;
        let guard = session.lock().await;
        Ok(guard.record.clone())
    }

    /// Renames a dialog (and turns off auto-titling for it).
    pub async fn rename_dialog(&self, id: SessionId, title: &str) -> Result<()> {
        let title = clean_title(title)?;
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        self.store
            .rename_session(id, title.clone(), keel_core::time::now_ms())
            .await?;
        guard.record.title = title;
        Ok(())
    }

    /// Soft-deletes a dialog: it disappears from listings; its rows stay, its
    /// sub-agent runs are cancelled.
    pub async fn delete_dialog(&self, id: SessionId) -> Result<()> {
        self.retire(id, "dialog deleted").await?;
        if self
            .store
            .soft_delete_session(id, keel_core::time::now_ms())
            .await?
        {
            Ok(())
        } else {
            Err(EngineError::SessionNotFound(id))
        }
    }

    // ── checkpoints ──────────────────────────────────────────────────────

    /// Checkpoints of a session, newest first (abandoned branches included).
    pub async fn list_checkpoints(&self, id: SessionId) -> Result<Vec<CheckpointRecord>> {
        Ok(self.store.list_checkpoints(id).await?)
    }

    /// The newest checkpoint of a session.
    pub async fn latest_checkpoint(&self, id: SessionId) -> Result<Option<CheckpointRecord>> {
        Ok(self.list_checkpoints(id).await?.into_iter().next())
    }

    /// Takes a manual checkpoint of the session's current state.
    pub async fn create_checkpoint(&self, id: SessionId) -> Result<CheckpointRecord> {
        let session = self.session(id).await?;
        let guard = session.lock().await;
        Ok(self
            .store
            .create_checkpoint(
                id,
                keel_store::NewCheckpoint {
                    id: CheckpointId::new(),
                    turn_index: u64::from(guard.state.turn_index),
                    source: keel_store::CheckpointSource::Manual,
                },
                guard.state.to_blob()?,
                keel_core::time::now_ms(),
            )
            .await?)
    }

    async fn checkpoint_of(
        &self,
        id: SessionId,
        checkpoint: CheckpointId,
    ) -> Result<CheckpointRecord> {
        self.store
            .get_checkpoint(checkpoint)
            .await?
            .filter(|c| c.session_id == id)
            .ok_or(EngineError::CheckpointNotFound(checkpoint))
    }

    /// Restores the session to `checkpoint` (of this session): a new branch
    /// starts there; the abandoned branch stays listable.
    pub async fn rollback(
        &self,
        id: SessionId,
        checkpoint: CheckpointId,
    ) -> Result<CheckpointRecord> {
        self.checkpoint_of(id, checkpoint).await?;
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        let record = self
            .store
            .rollback(
                id,
                checkpoint,
                CheckpointId::new(),
                keel_core::time::now_ms(),
            )
            .await?;
        let stored = self
            .store
            .get_session(id)
            .await?
            .ok_or(EngineError::SessionNotFound(id))?;
        *guard = AgentSession::load(&self.store, stored, guard.agent.clone()).await?;
        tracing::info!(session_id = %id, %checkpoint, "rolled back");
        Ok(record)
    }

    /// Creates a new session from any checkpoint of any session (no history
    /// is copied). Dialogs fork into a new dialog of the same chat.
    pub async fn fork(&self, checkpoint: CheckpointId, title: Option<String>) -> Result<SessionId> {
        let source = self
            .store
            .get_checkpoint(checkpoint)
            .await?
            .ok_or(EngineError::CheckpointNotFound(checkpoint))?;
        let origin = self
            .store
            .get_session(source.session_id)
            .await?
            .ok_or(EngineError::SessionNotFound(source.session_id))?;
        let title = match title {
            Some(t) => clean_title(&t)?,
            None => bounded_title(&format!("Fork of {}", origin.title)),
        };
        let (record, _) = self
            .store
            .fork(
                checkpoint,
                NewSession {
                    id: SessionId::new(),
                    channel: origin.channel.clone(),
                    chat_id: origin.chat_id.clone(),
                    dialog_id: new_dialog_id(),
                    title,
                    agent_id: origin.agent_id.clone(),
                    parent_id: origin.parent_id,
                    delivery_context: None,
                    now_ms: keel_core::time::now_ms(),
                },
                CheckpointId::new(),
            )
            .await?;
        Ok(record.id)
    }

    /// Deletes every checkpoint of a session.
    pub async fn delete_checkpoints(&self, id: SessionId) -> Result<PruneReport> {
        Ok(self.store.delete_checkpoints(id).await?)
    }

    /// Prunes checkpoints by `policy` (never what the live head needs).
    pub async fn prune_checkpoints(
        &self,
        id: SessionId,
        policy: PrunePolicy,
    ) -> Result<PruneReport> {
        Ok(self.store.prune_checkpoints(id, policy).await?)
    }

    // ── snapshots ────────────────────────────────────────────────────────

    /// The whole session as portable JSON-able data.
    pub async fn export_snapshot(&self, id: SessionId) -> Result<SessionSnapshot> {
        let session = self.session(id).await?;
        let guard = session.lock().await;
        Ok(SessionSnapshot::of(&guard))
    }

    /// Creates a new session from a snapshot (fresh history, same content).
    pub async fn import_snapshot(
        &self,
        snapshot: SessionSnapshot,
        address: DialogAddress,
    ) -> Result<SessionId> {
        let agent = snapshot
            .agent
            .as_deref()
            .map(AgentId::parse)
            .transpose()
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        let id = self
            .create(NewSessionSpec {
                address,
                title: snapshot.title.clone(),
                agent,
            })
            .await?;
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        let keep = guard.state.clone();
        let (seqs, _) = guard
            .commit(&self.store, snapshot.ordered_messages(), keep, None)
            .await?;
        let state = snapshot.remapped_state(&seqs)?;
        guard.commit(&self.store, Vec::new(), state, None).await?;
        Ok(id)
    }
}

/// A turn whose events are streaming; commit it with [`Self::finalize`].
/// Dropping it cancels the turn and commits nothing.
pub struct PendingTurn {
    manager: Arc<SessionManager>,
    guard: Option<OwnedMutexGuard<AgentSession>>,
    slot: String,
    turn_id: TurnId,
    task: Option<JoinHandle<Result<TurnOutput>>>,
    cancel: CancellationToken,
    events: Option<EventSink>,
}

impl PendingTurn {
    /// A token that cancels this turn.
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Waits for the loop, commits the turn (messages, state, checkpoint) in
    /// one transaction, then titles/summarizes. A storage failure after the
    /// store's retries is reported as a system notice event and returned.
    pub async fn finalize(mut self) -> Result<TurnReport> {
        let task = self.task.take();
        let result = match task {
            Some(t) => t
                .await
                .unwrap_or_else(|e| Err(EngineError::TurnPanicked(e.to_string()))),
            None => Err(EngineError::Cancelled),
        };
        let mut guard = self.guard.take().ok_or(EngineError::Cancelled)?;
        let id = guard.id();
        self.manager.active_turns.lock().remove(&id);
        let output = result?;
        let auto = self.manager.config.auto_checkpoint;
        let checkpoint = match guard
            .commit_turn(&self.manager.store, &self.slot, &output, auto)
            .await
        {
            Ok(c) => c,
            Err(e) => {
                if let Some(sink) = &self.events {
                    let _ = sink.send(TurnEvent::SystemNotice {
                        text: format!("This turn could not be saved and was discarded: {e}"),
                    });
                }
                tracing::error!(session_id = %id, error = %e, "turn commit failed");
                return Err(e);
            }
        };
        self.manager.after_commit(&mut guard).await;
        Ok(TurnReport {
            turn_id: self.turn_id,
            output,
            checkpoint,
        })
    }
}

impl Drop for PendingTurn {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            self.cancel.cancel();
            task.abort();
        }
        if let Some(guard) = self.guard.take() {
            self.manager.active_turns.lock().remove(&guard.id());
        }
    }
}

fn clean_title(title: &str) -> Result<String> {
    let t = title.trim();
    if t.is_empty() {
        return Err(EngineError::InvalidInput("a title cannot be empty".into()));
    }
    if t.chars().any(char::is_control) {
        return Err(EngineError::InvalidInput(
            "a title cannot contain control characters".into(),
        ));
    }
    Ok(bounded_title(t))
}

fn bounded_title(t: &str) -> String {
    let mut out: String = t.chars().take(MAX_TITLE_CHARS).collect();
    if out.chars().count() < t.chars().count() {
        out.push('…');
    }
    out
}

/// The prompt that asks the session's model for a dialog title.
const TITLE_PROMPT: &str = "Given the conversation history below, generate a short title \
(3 to 8 words) that captures the core topic or the user's main need. \
Reply with the title only, no explanation.\n\nHistory:\n";

async fn generate_title(session: &AgentSession) -> Result<String> {
    let visible: Vec<String> = session
        .visible_messages()?
        .iter()
        .filter(|m| {
            matches!(
                m.message.role,
                keel_core::Role::User | keel_core::Role::Assistant
            )
        })
        .map(|m| format!("{}: {}", m.message.role.as_str(), m.message.text()))
        .collect();
    let mut history = visible.join("\n");
    if history.len() > 8_000 {
        let cut = (history.len() - 8_000..history.len())
            .find(|i| history.is_char_boundary(*i))
            .unwrap_or(0);
        history = history[cut..].to_owned();
    }
    let request = ChatRequest {
        messages: vec![Arc::new(Message::user(format!("{TITLE_PROMPT}{history}")))],
        tools: Vec::new(),
        max_tokens: Some(64),
        temperature: None,
    };
    let response = session
        .agent
        .provider
        .complete(&request, CancellationToken::new())
        .await?;
    let raw = response.message.text();
    let title = raw
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .trim()
        .trim_matches(|c| c == '"' || c == '\'' || c == '“' || c == '”' || c == '#' || c == '*')
        .trim();
    clean_title(title)
}

const SUMMARY_PROMPT: &str = "Summarize the conversation below so that it can replace the \
older messages in the context: keep decisions, facts, open questions and the user's goals. \
Be concise.\n\n";

async fn summarize(session: &AgentSession, replay: &[Arc<Message>]) -> Result<String> {
    let text: Vec<String> = replay
        .iter()
        .map(|m| format!("{}: {}", m.role.as_str(), m.text()))
        .collect();
    let request = ChatRequest {
        messages: vec![Arc::new(Message::user(format!(
            "{SUMMARY_PROMPT}{}",
            text.join("\n")
        )))],
        tools: Vec::new(),
        max_tokens: Some(1024),
        temperature: None,
    };
    let response = session
        .agent
        .provider
        .complete(&request, CancellationToken::new())
        .await?;
    let summary = response.message.text().trim().to_owned();
    if summary.is_empty() {
        return Err(EngineError::EmptySummary);
    }
    Ok(summary)
}
