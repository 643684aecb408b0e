//! [`SessionManager`]: creates, loads, evicts and destroys sessions, runs
//! their turns (committing each turn with its checkpoint in one store
//! transaction), and manages dialogs, slots, memory and checkpoints.
//!
//! Locking: the session map is a `parking_lot` mutex that is never held
//! across an `.await` (its guard is not `Send`, so the compiler enforces it).
//! Each session has its own async mutex; a turn holds it from start to
//! commit. Turns run only on the session's worker (`worker`), one at a
//! time, so turns of one session are serialized and turns of different
//! sessions run in parallel.
//!
//! The manager's methods are grouped by what they work on:
//! `lifecycle` (create, load, evict, destroy), `worker` (the session
//! worker: send, steer, stop), `turns` (run and commit a turn), `slots` (context slots and session memory), `dialogs`,
//! `checkpoints` (list, create, roll back, fork, prune), `exports`
//! (export and import, and history a client brings) and `housekeeping`
//! (titles and summaries after a turn, in a task of their own).

mod approvals;
mod bundle;
mod checkpoints;
mod continuation;
mod dialogs;
mod exports;
mod housekeeping;
mod leases;
mod lifecycle;
mod retention;
mod signals;
mod slots;
mod turns;
mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use keel_core::{AgentId, CheckpointId, SessionId, TurnId};
use keel_store::Store;
use parking_lot::Mutex;
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use crate::address::DialogAddress;
use crate::agent_loop::TurnOutput;
use crate::error::{EngineError, Result};
use crate::events::{SessionEvents, DEFAULT_EVENT_CAPACITY};
use crate::mailbox::MailboxLimits;
use crate::session::AgentSession;

pub use bundle::{AgentSet, AgentSetBuilder, RuntimeBundle};
pub use continuation::InboxPolicy;
pub use retention::{apply_retention, RetentionPolicy, RetentionReport};
pub use worker::{SteerOutcome, StopReport, TurnTicket};

/// Channel of sessions that are not dialogs (e.g. sub-agent children).
pub(crate) const INTERNAL_CHANNEL: &str = "internal";
/// Longest title, in characters.
pub(crate) const MAX_TITLE_CHARS: usize = 80;

/// When to summarize a slot's context after a turn, before it is needed.
/// (A request that would not fit the agent's context budget is compacted
/// before it is sent, whatever this says.)
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryConfig {
    /// Summarize when the context exceeds this share of the agent's budget
    /// (its context window less its output cap).
    pub trigger_ratio: f32,
    /// Turns between two automatic summaries of a session.
    pub debounce_turns: u32,
}

impl Default for SummaryConfig {
    fn default() -> Self {
        Self {
            trigger_ratio: 0.75,
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
    /// Summaries after a turn, off when `None` (default on).
    pub summary: Option<SummaryConfig>,
    /// User turns one session may have queued behind its running turn.
    pub user_queue: usize,
    /// Capacities of a running turn's steer lanes.
    pub mailbox: MailboxLimits,
    /// Events a session feed buffers for a slow subscriber.
    pub event_capacity: usize,
    /// How background results are delivered to the root agent.
    pub inbox: InboxPolicy,
    /// How long a root turn (user or continuation) may run, from the moment
    /// it starts on the worker; past it the turn ends [`EngineError::TimedOut`].
    /// `None` (the library's default) arms no deadline; the `keel` binary
    /// always sets one (`session.turn_timeout_secs`, 900 s by default).
    pub turn_timeout: Option<Duration>,
    /// How long a tool call waits for a person's decision before it
    /// expires as a denial (`tools.approval_timeout_secs`, 24 h by default).
    pub approval_timeout: Duration,
    /// The reason a pending approval is denied with, and the model reads,
    /// when the user sends new input (`tools.approval_supersede_reason`;
    /// [`crate::SUPERSEDED_REASON`] by default).
    pub supersede_reason: String,
    /// USD one root turn and its foreground tree may spend
    /// (`orchestration.max_cost_usd_per_root_turn`); `None`: no limit.
    pub max_cost_usd_per_root_turn: Option<keel_core::Usd>,
    /// USD everything one dialog runs may spend, across restarts
    /// (`session.max_cost_usd_per_dialog`); `None`: no limit.
    pub max_cost_usd_per_dialog: Option<keel_core::Usd>,
    /// How long a dialog's lease stays this process's after a step, and
    /// its idle worker with it, on a database several processes share
    /// (`storage.lease_linger_ms`, [`DEFAULT_LEASE_LINGER`] by default);
    /// zero gives the lease back at once.
    pub lease_linger: Duration,
}

/// How long a dialog's lease lingers by default (see
/// [`SessionManagerConfig::lease_linger`]).
pub const DEFAULT_LEASE_LINGER: Duration = Duration::from_millis(100);

impl Default for SessionManagerConfig {
    fn default() -> Self {
        Self {
            auto_checkpoint: true,
            idle_ttl: Duration::from_secs(24 * 3600),
            auto_title_after: 10,
            summary: Some(SummaryConfig::default()),
            user_queue: 32,
            mailbox: MailboxLimits::default(),
            event_capacity: DEFAULT_EVENT_CAPACITY,
            inbox: InboxPolicy::default(),
            turn_timeout: None,
            approval_timeout: Duration::from_secs(24 * 3600),
            supersede_reason: crate::approval::SUPERSEDED_REASON.to_owned(),
            max_cost_usd_per_root_turn: None,
            max_cost_usd_per_dialog: None,
            lease_linger: DEFAULT_LEASE_LINGER,
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

/// The default title of a dialog (a dialog id may hold format characters
/// a title may not: they are dropped).
pub(crate) fn default_title(dialog_id: &str) -> String {
    let shown: String = dialog_id
        .chars()
        .filter(|&c| !keel_core::is_invisible(c))
        .collect();
    format!("Dialog {shown}")
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
    /// The turn paused: these approvals (one per gated call, in call
    /// order) wait for a person's decision, and the turn resumes after.
    pub approvals: Vec<keel_core::ApprovalId>,
    /// The dialog's record as the commit left it (counters, last activity).
    pub dialog: keel_store::SessionRecord,
}

struct Entry {
    session: Arc<AsyncMutex<AgentSession>>,
    /// The agent the session runs (its record's), readable while a turn
    /// holds the session.
    agent_id: Option<AgentId>,
    last_access: Instant,
}

/// Manages sessions; see the module docs.
pub struct SessionManager {
    store: Store,
    bundle: Arc<RuntimeBundle>,
    config: SessionManagerConfig,
    sessions: Mutex<HashMap<SessionId, Entry>>,
    workers: worker::Workers,
    events: Arc<SessionEvents>,
    housekeeping: housekeeping::Housekeeping,
    /// The spend ledger of each dialog a turn or run holds.
    dialog_ledgers: crate::budget::DialogLedgers,
    /// Where this process's holders of a session's lease take turns.
    lease_gates: Arc<leases::LeaseGates>,
    /// Sessions another process wrote since this one last held their lease.
    stale: Mutex<std::collections::HashSet<SessionId>>,
}

#[async_trait::async_trait]
impl crate::coordinator::SessionWaker for SessionManager {
    fn wake_inbox(self: Arc<Self>, root: SessionId) {
        SessionManager::wake_inbox(&self, root);
    }

    async fn steer_signals(self: Arc<Self>, root: SessionId) {
        SessionManager::steer_signals(&self, root).await;
    }
}

impl SessionManager {
    /// A manager over `store` running agents from `bundle`.
    pub fn new(store: Store, bundle: RuntimeBundle, config: SessionManagerConfig) -> Arc<Self> {
        let events = SessionEvents::new(store.clone(), config.event_capacity);
        let linger = config.lease_linger;
        Arc::new_cyclic(|me: &Weak<Self>| {
            if let Some(coordinator) = &bundle.coordinator {
                coordinator.attach(Arc::clone(&events), me.clone());
            }
            Self {
                store,
                bundle: Arc::new(bundle),
                config,
                sessions: Mutex::new(HashMap::new()),
                workers: Mutex::new(HashMap::new()),
                events,
                housekeeping: housekeeping::Housekeeping::default(),
                dialog_ledgers: crate::budget::DialogLedgers::default(),
                lease_gates: Arc::new(leases::LeaseGates::new(linger)),
                stale: Mutex::new(std::collections::HashSet::new()),
            }
        })
    }

    /// What dialog `session` spent on model calls, its runs' included
    /// (stored: it survives restarts and rollbacks).
    pub async fn dialog_spend(&self, session: SessionId) -> Result<crate::budget::Spend> {
        Ok(self.store.dialog_spend(session).await?.into())
    }

    /// The budget of every dialog (`max_cost_usd_per_dialog`), if any.
    pub fn dialog_budget(&self) -> Option<keel_core::Usd> {
        self.config.max_cost_usd_per_dialog
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The live feeds of sessions (turn events, run and inbox changes).
    pub fn events(&self) -> &Arc<SessionEvents> {
        &self.events
    }

    /// Whether new sessions can run `agent` now (the root agent, or one of
    /// the bundle's, which for a catalog's bundle follows reloads).
    pub fn runs_agent(&self, agent: &AgentId) -> Result<bool> {
        match self.bundle.agent(Some(agent)) {
            Ok(_) => Ok(true),
            Err(EngineError::UnknownAgent(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Every agent new sessions can run now, the root agent first.
    pub fn agent_ids(&self) -> Result<Vec<AgentId>> {
        self.bundle.agent_ids()
    }
}

/// A title a user or client gave, trimmed and bounded; refused when empty
/// or holding a control or format character (it could hide or reorder what
/// a terminal or page shows).
fn clean_title(title: &str) -> Result<String> {
    let t = title.trim();
    if t.is_empty() {
        return Err(EngineError::InvalidTitle("a title cannot be empty"));
    }
    if t.chars().any(keel_core::is_invisible) {
        return Err(EngineError::InvalidTitle(
            "a title cannot contain control or format characters (bidi controls, zero-width characters …)",
        ));
    }
    Ok(bounded_title(t))
}

/// A title the model generated, with its control and format characters
/// dropped rather than refused (nobody can be asked to fix it).
fn generated_title(text: &str) -> Result<String> {
    let kept: String = text
        .chars()
        .filter(|&c| !keel_core::is_invisible(c))
        .collect();
    clean_title(&kept)
}

fn bounded_title(t: &str) -> String {
    let mut out: String = t.chars().take(MAX_TITLE_CHARS).collect();
    if out.chars().count() < t.chars().count() {
        out.push('…');
    }
    out
}
