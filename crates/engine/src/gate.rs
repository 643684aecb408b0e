//! The execution gate: how many agent runs may exist and how many provider
//! and tool steps may execute at once — globally, per session and per agent.
//!
//! Two independent kinds of admission:
//!
//! - **Run quota** ([`RunPermit`]): counts non-terminal agent runs (queued,
//!   running, waiting for children). The coordinator takes it when it admits
//!   a run and keeps it until the run's terminal commit. Background and queued
//!   admission use [`ExecutionGate::try_admit_run`], which fails fast;
//!   [`ExecutionGate::admit_run`] waits (cancellably).
//! - **Step permits** ([`StepPermitGuard`]): held only while one provider call
//!   or one tool call executes, released as soon as the step ends.
//!
//! Root turns are not agent runs: they take no run quota (that is the
//! caller's choice — it simply never calls `admit_run` for them), but their
//! provider and tool steps go through the same global/session step limits, so
//! background runs cannot bypass the gateway-wide limits and vice versa.
//!
//! Step permits are always acquired session → agent → global and released in
//! the reverse order: a step waiting on its session's or agent's limit holds
//! no global permit, so one session's queue cannot starve the others (run
//! admission never waits, so its order does not matter).
//!
//! A run waiting for its children holds its run permit but no step permit,
//! so nested delegation never deadlocks on step permits, even with every
//! limit at 1.
//!
//! Per-session and per-agent semaphores live in keyed registries whose
//! entries are reference counted by every holder *and* every waiter; an
//! entry is removed the moment nobody uses it, so the registries do not grow
//! with the number of sessions ever seen ([`GateCounters::keyed_semaphores`]).

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use async_trait::async_trait;
use keel_core::{AgentId, SessionId, ToolExecutionContext};
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::agent_loop::{StepGate, StepPermit};
use crate::error::{EngineError, Result};

/// Concurrency limits of an [`ExecutionGate`]; every limit must be ≥ 1.
///
/// Validation (non-zero, per-session not above global …) is the
/// configuration's job; the gate itself treats a 0 as 1 so that a bad value
/// can never make it hang forever.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateLimits {
    /// Non-terminal agent runs in the whole process.
    pub max_concurrent_runs: usize,
    /// Non-terminal agent runs per session (the session passed to admission).
    pub max_concurrent_runs_per_session: usize,
    /// Provider calls executing at once in the whole process.
    pub max_concurrent_provider_steps: usize,
    /// Provider calls executing at once per session.
    pub max_concurrent_provider_steps_per_session: usize,
    /// Tool calls executing at once in the whole process.
    pub max_concurrent_tool_steps: usize,
    /// Tool calls executing at once per session.
    pub max_concurrent_tool_steps_per_session: usize,
    /// Provider calls executing at once per agent; agents not listed have no
    /// per-agent limit.
    pub max_concurrent_provider_steps_per_agent: HashMap<AgentId, usize>,
    /// Tool calls executing at once per agent; agents not listed have no
    /// per-agent limit.
    pub max_concurrent_tool_steps_per_agent: HashMap<AgentId, usize>,
}

impl GateLimits {
    /// Every global and per-session limit set to `n`, no per-agent limits.
    pub fn uniform(n: usize) -> Self {
        Self {
            max_concurrent_runs: n,
            max_concurrent_runs_per_session: n,
            max_concurrent_provider_steps: n,
            max_concurrent_provider_steps_per_session: n,
            max_concurrent_tool_steps: n,
            max_concurrent_tool_steps_per_session: n,
            max_concurrent_provider_steps_per_agent: HashMap::new(),
            max_concurrent_tool_steps_per_agent: HashMap::new(),
        }
    }
}

impl Default for GateLimits {
    /// 32 runs (8 per session), 8 provider steps (4 per session), 16 tool
    /// steps (8 per session), no per-agent limits.
    fn default() -> Self {
        Self {
            max_concurrent_runs: 32,
            max_concurrent_runs_per_session: 8,
            max_concurrent_provider_steps: 8,
            max_concurrent_provider_steps_per_session: 4,
            max_concurrent_tool_steps: 16,
            max_concurrent_tool_steps_per_session: 8,
            max_concurrent_provider_steps_per_agent: HashMap::new(),
            max_concurrent_tool_steps_per_agent: HashMap::new(),
        }
    }
}

/// Which limit refused an admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GateScope {
    /// The process-wide limit.
    Global,
    /// The per-session limit.
    Session,
}

impl fmt::Display for GateScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GateScope::Global => "global",
            GateScope::Session => "per-session",
        })
    }
}

/// The kind of step a [`StepPermitGuard`] admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// One provider call.
    Provider,
    /// One tool call.
    Tool,
}

/// Where a step's limits apply; callers may put it in
/// [`ToolExecutionContext::extensions`] for the [`StepGate`] impl to read.
///
/// `session` is the session whose per-session limits apply (normally the
/// root session of the run tree, so a whole tree shares its session's
/// limits); when `None`, `ctx.session_id` is used. `agent` selects the
/// per-agent limits, if that agent has any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepScope {
    /// The session whose per-session limit applies (falls back to `ctx.session_id`).
    pub session: Option<SessionId>,
    /// The agent whose per-agent limit applies.
    pub agent: Option<AgentId>,
}

/// How many permits are in use right now (for tests and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GateCounters {
    /// Global run permits held.
    pub runs_in_use: usize,
    /// Global provider-step permits held.
    pub provider_steps_in_use: usize,
    /// Global tool-step permits held.
    pub tool_steps_in_use: usize,
    /// Live per-session and per-agent semaphores (held or waited on).
    pub keyed_semaphores: usize,
}

/// Admission to agent runs and to provider/tool steps; share it via `Arc`.
pub struct ExecutionGate {
    limits: GateLimits,
    runs: Pool,
    provider: Pool,
    tools: Pool,
}

impl fmt::Debug for ExecutionGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutionGate")
            .field("limits", &self.limits)
            .field("in_use", &self.snapshot())
            .finish()
    }
}

impl ExecutionGate {
    /// A gate enforcing `limits` (a limit of 0 is treated as 1).
    pub fn new(limits: GateLimits) -> Self {
        let limits = effective(limits);
        let runs = Pool::new(
            "runs",
            limits.max_concurrent_runs,
            limits.max_concurrent_runs_per_session,
            HashMap::new(),
        );
        let provider = Pool::new(
            "provider",
            limits.max_concurrent_provider_steps,
            limits.max_concurrent_provider_steps_per_session,
            limits.max_concurrent_provider_steps_per_agent.clone(),
        );
        let tools = Pool::new(
            "tool",
            limits.max_concurrent_tool_steps,
            limits.max_concurrent_tool_steps_per_session,
            limits.max_concurrent_tool_steps_per_agent.clone(),
        );
        Self {
            limits,
            runs,
            provider,
            tools,
        }
    }

    /// The limits in force (after treating 0 as 1).
    #[cfg(test)]
    fn limits(&self) -> &GateLimits {
        &self.limits
    }

    /// Admits a run in `session` now or fails with
    /// [`EngineError::RunQuotaExceeded`] naming the full limit; never waits.
    pub fn try_admit_run(&self, session: SessionId) -> Result<RunPermit> {
        let admission = self.runs.try_acquire(session).inspect_err(|e| {
            tracing::debug!(%session, error = %e, "run admission refused");
        })?;
        Ok(RunPermit {
            session,
            _admission: admission,
        })
    }

    /// Admits a run in `session`, waiting for quota; fails only with
    /// [`EngineError::Cancelled`] when `cancel` fires first.
    pub async fn admit_run(
        &self,
        session: SessionId,
        cancel: &CancellationToken,
    ) -> Result<RunPermit> {
        let admission = self.runs.acquire(Some(session), None, cancel).await?;
        Ok(RunPermit {
            session,
            _admission: admission,
        })
    }

    /// Waits for a provider-step permit (session → agent → global); fails
    /// only with [`EngineError::Cancelled`], holding nothing.
    pub async fn acquire_provider_step(
        &self,
        session: Option<SessionId>,
        agent: Option<&AgentId>,
        cancel: &CancellationToken,
    ) -> Result<StepPermitGuard> {
        let admission = self.provider.acquire(session, agent, cancel).await?;
        Ok(StepPermitGuard {
            kind: StepKind::Provider,
            _admission: admission,
        })
    }

    /// Waits for a tool-step permit (session → agent → global); fails only
    /// with [`EngineError::Cancelled`], holding nothing.
    pub async fn acquire_tool_step(
        &self,
        session: Option<SessionId>,
        agent: Option<&AgentId>,
        cancel: &CancellationToken,
    ) -> Result<StepPermitGuard> {
        let admission = self.tools.acquire(session, agent, cancel).await?;
        Ok(StepPermitGuard {
            kind: StepKind::Tool,
            _admission: admission,
        })
    }

    /// Permits in use and live keyed semaphores right now.
    pub fn snapshot(&self) -> GateCounters {
        GateCounters {
            runs_in_use: self.runs.in_use(),
            provider_steps_in_use: self.provider.in_use(),
            tool_steps_in_use: self.tools.in_use(),
            keyed_semaphores: self.keyed_entries(),
        }
    }

    /// Live per-session and per-agent semaphores over all pools.
    pub(crate) fn keyed_entries(&self) -> usize {
        [&self.runs, &self.provider, &self.tools]
            .iter()
            .map(|p| p.sessions.len() + p.agents.len())
            .sum()
    }
}

#[async_trait]
impl StepGate for ExecutionGate {
    async fn provider_step(&self, ctx: &ToolExecutionContext) -> Result<StepPermit> {
        let (session, agent) = step_scope(ctx);
        let guard = self
            .acquire_provider_step(session, agent, &ctx.cancellation)
            .await?;
        Ok(Box::new(guard))
    }

    async fn tool_step(&self, ctx: &ToolExecutionContext) -> Result<StepPermit> {
        let (session, agent) = step_scope(ctx);
        let guard = self
            .acquire_tool_step(session, agent, &ctx.cancellation)
            .await?;
        Ok(Box::new(guard))
    }
}

/// The session and agent whose limits apply to a step run under `ctx`.
fn step_scope(ctx: &ToolExecutionContext) -> (Option<SessionId>, Option<&AgentId>) {
    match ctx.extensions.get::<StepScope>() {
        Some(scope) => (scope.session.or(ctx.session_id), scope.agent.as_ref()),
        None => (ctx.session_id, None),
    }
}

/// One admitted, non-terminal agent run; dropping it releases the quota.
pub struct RunPermit {
    session: SessionId,
    _admission: Admission,
}

impl RunPermit {
    /// The session the run is counted in.
    pub fn session(&self) -> SessionId {
        self.session
    }
}

impl fmt::Debug for RunPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunPermit")
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

/// A permit for one provider or tool step; dropping it releases the agent,
/// session and global permits, in that order.
pub struct StepPermitGuard {
    kind: StepKind,
    _admission: Admission,
}

impl StepPermitGuard {
    /// Whether this admits a provider call or a tool call.
    pub fn kind(&self) -> StepKind {
        self.kind
    }
}

impl fmt::Debug for StepPermitGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepPermitGuard")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------

/// A limit as a semaphore size: at least 1, at most what tokio accepts.
fn cap(n: usize) -> usize {
    n.clamp(1, Semaphore::MAX_PERMITS)
}

fn effective(limits: GateLimits) -> GateLimits {
    let caps = |m: HashMap<AgentId, usize>| m.into_iter().map(|(k, v)| (k, cap(v))).collect();
    GateLimits {
        max_concurrent_runs: cap(limits.max_concurrent_runs),
        max_concurrent_runs_per_session: cap(limits.max_concurrent_runs_per_session),
        max_concurrent_provider_steps: cap(limits.max_concurrent_provider_steps),
        max_concurrent_provider_steps_per_session: cap(
            limits.max_concurrent_provider_steps_per_session
        ),
        max_concurrent_tool_steps: cap(limits.max_concurrent_tool_steps),
        max_concurrent_tool_steps_per_session: cap(limits.max_concurrent_tool_steps_per_session),
        max_concurrent_provider_steps_per_agent: caps(
            limits.max_concurrent_provider_steps_per_agent,
        ),
        max_concurrent_tool_steps_per_agent: caps(limits.max_concurrent_tool_steps_per_agent),
    }
}

/// One kind of admission (runs, provider steps or tool steps): a global
/// semaphore plus keyed per-session and per-agent semaphores.
struct Pool {
    /// The `pool` label of its wait metrics.
    name: &'static str,
    global: Arc<Semaphore>,
    capacity: usize,
    per_session: usize,
    sessions: Arc<Keyed<SessionId>>,
    per_agent: HashMap<AgentId, usize>,
    agents: Arc<Keyed<AgentId>>,
}

impl Pool {
    fn new(
        name: &'static str,
        capacity: usize,
        per_session: usize,
        per_agent: HashMap<AgentId, usize>,
    ) -> Self {
        Self {
            name,
            global: Arc::new(Semaphore::new(capacity)),
            capacity,
            per_session,
            sessions: Arc::new(Keyed::default()),
            per_agent,
            agents: Arc::new(Keyed::default()),
        }
    }

    fn in_use(&self) -> usize {
        self.capacity
            .saturating_sub(self.global.available_permits())
    }

    /// Waits session → agent → global. A step queued behind its session's
    /// (or agent's) limit holds no global permit, so one session with many
    /// queued calls cannot starve the others. An early return (cancellation)
    /// drops what was already taken, so nothing leaks; dropping the future
    /// while it waits does the same.
    async fn acquire(
        &self,
        session: Option<SessionId>,
        agent: Option<&AgentId>,
        cancel: &CancellationToken,
    ) -> Result<Admission> {
        let session = match session {
            Some(key) => Some(
                self.sessions
                    .acquire(key, self.per_session, Stage::Session, self.name, cancel)
                    .await?,
            ),
            None => None,
        };
        let agent = match agent.and_then(|a| self.per_agent.get(a).map(|&n| (a, n))) {
            Some((key, limit)) => Some(
                self.agents
                    .acquire(key.clone(), limit, Stage::Agent, self.name, cancel)
                    .await?,
            ),
            None => None,
        };
        let global = GlobalPermit::new(wait(&self.global, self.name, cancel).await?);
        Ok(Admission {
            _global: global,
            _agent: agent,
            _session: session,
        })
    }

    /// Takes global then session permits without waiting (runs only; as
    /// nothing waits, the order cannot starve anyone, and a full global
    /// quota is the one reported).
    fn try_acquire(&self, session: SessionId) -> Result<Admission> {
        let global = Arc::clone(&self.global).try_acquire_owned().map_err(|_| {
            EngineError::RunQuotaExceeded {
                scope: GateScope::Global,
                limit: self.capacity,
            }
        })?;
        let global = GlobalPermit::new(global);
        // On failure `global` is dropped here, returning its permit.
        let session = self
            .sessions
            .try_acquire(session, self.per_session, Stage::Session)
            .ok_or(EngineError::RunQuotaExceeded {
                scope: GateScope::Session,
                limit: self.per_session,
            })?;
        Ok(Admission {
            _global: global,
            _agent: None,
            _session: Some(session),
        })
    }
}

/// Waits for one permit of `semaphore` unless `cancel` fires first (a token
/// that is already cancelled wins even when a permit is free). A wait that
/// was needed is counted for `pool`.
async fn wait(
    semaphore: &Arc<Semaphore>,
    pool: &'static str,
    cancel: &CancellationToken,
) -> Result<OwnedSemaphorePermit> {
    if cancel.is_cancelled() {
        return Err(EngineError::Cancelled);
    }
    // A free permit means nobody queues (tokio's semaphore is fair).
    if let Ok(permit) = Arc::clone(semaphore).try_acquire_owned() {
        return Ok(permit);
    }
    let started = std::time::Instant::now();
    let permit = tokio::select! {
        biased;
        _ = cancel.cancelled() => Err(EngineError::Cancelled),
        // The gate never closes its semaphores; a closed one would mean the
        // gate is going away, which callers treat like cancellation.
        permit = Arc::clone(semaphore).acquire_owned() => permit.map_err(|_| EngineError::Cancelled),
    }?;
    crate::metrics::gate_waited(pool, started.elapsed());
    Ok(permit)
}

/// Everything one admission holds.
///
/// Field order is drop order: global, then agent, then session — the
/// reverse of the step acquisition order (session → agent → global). Do not
/// reorder these fields.
struct Admission {
    _global: GlobalPermit,
    _agent: Option<KeyedPermit<AgentId>>,
    _session: Option<KeyedPermit<SessionId>>,
}

/// A permit of a pool's global semaphore.
struct GlobalPermit {
    _permit: OwnedSemaphorePermit,
    #[cfg(test)]
    _probe: probe::Probe,
}

impl GlobalPermit {
    fn new(permit: OwnedSemaphorePermit) -> Self {
        Self {
            _permit: permit,
            #[cfg(test)]
            _probe: probe::Probe::new(Stage::Global),
        }
    }
}

/// The stage of an admission (for the release-order test probe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    #[cfg_attr(not(test), allow(dead_code))]
    Global,
    Session,
    Agent,
}

/// Semaphores by key, each with the number of leases (holders and waiters)
/// using it; an entry is removed when its last lease drops.
struct Keyed<K: Eq + Hash> {
    entries: Mutex<HashMap<K, KeyedEntry>>,
}

impl<K: Eq + Hash> Default for Keyed<K> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

struct KeyedEntry {
    semaphore: Arc<Semaphore>,
    users: usize,
}

impl<K: Eq + Hash + Clone> Keyed<K> {
    fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// Registers a user of `key`'s semaphore (created with `limit` permits
    /// if absent) for as long as the lease lives.
    fn lease(self: &Arc<Self>, key: K, limit: usize) -> Lease<K> {
        let mut entries = self.entries.lock();
        let entry = entries.entry(key.clone()).or_insert_with(|| KeyedEntry {
            semaphore: Arc::new(Semaphore::new(limit)),
            users: 0,
        });
        entry.users = entry.users.saturating_add(1);
        let semaphore = Arc::clone(&entry.semaphore);
        Lease {
            registry: Arc::clone(self),
            key,
            semaphore,
        }
    }

    /// Waits for a permit of `key`; the lease counts as a user while
    /// waiting and is dropped (cleaning up) if the wait fails.
    async fn acquire(
        self: &Arc<Self>,
        key: K,
        limit: usize,
        stage: Stage,
        pool: &'static str,
        cancel: &CancellationToken,
    ) -> Result<KeyedPermit<K>> {
        let lease = self.lease(key, limit);
        let permit = wait(&lease.semaphore, pool, cancel).await?;
        Ok(KeyedPermit::new(permit, lease, stage))
    }

    /// Takes a permit of `key` if one is free.
    fn try_acquire(self: &Arc<Self>, key: K, limit: usize, stage: Stage) -> Option<KeyedPermit<K>> {
        let lease = self.lease(key, limit);
        let permit = Arc::clone(&lease.semaphore).try_acquire_owned().ok()?;
        Some(KeyedPermit::new(permit, lease, stage))
    }
}

/// A registered use of a keyed semaphore.
struct Lease<K: Eq + Hash> {
    registry: Arc<Keyed<K>>,
    key: K,
    semaphore: Arc<Semaphore>,
}

impl<K: Eq + Hash> Drop for Lease<K> {
    fn drop(&mut self) {
        let mut entries = self.registry.entries.lock();
        if let Some(entry) = entries.get_mut(&self.key) {
            entry.users = entry.users.saturating_sub(1);
            if entry.users == 0 {
                entries.remove(&self.key);
            }
        }
    }
}

/// A held permit of a keyed semaphore.
///
/// Field order matters: the permit goes back to its semaphore before the
/// lease may remove that semaphore from the registry, so a fresh semaphore
/// for the same key can never coexist with a permit of the old one.
struct KeyedPermit<K: Eq + Hash> {
    _permit: OwnedSemaphorePermit,
    _lease: Lease<K>,
    #[cfg(test)]
    _probe: probe::Probe,
}

impl<K: Eq + Hash> KeyedPermit<K> {
    #[cfg_attr(not(test), allow(unused_variables))]
    fn new(permit: OwnedSemaphorePermit, lease: Lease<K>, stage: Stage) -> Self {
        Self {
            _permit: permit,
            _lease: lease,
            #[cfg(test)]
            _probe: probe::Probe::new(stage),
        }
    }
}

/// Test-only record of acquisitions and releases, per thread.
#[cfg(test)]
mod probe {
    use std::cell::RefCell;

    use super::Stage;

    thread_local! {
        static LOG: RefCell<Vec<(&'static str, Stage)>> = const { RefCell::new(Vec::new()) };
    }

    /// Logs its stage when created ("acquire") and when dropped ("release").
    pub(super) struct Probe(Stage);

    impl Probe {
        pub(super) fn new(stage: Stage) -> Self {
            LOG.with(|l| l.borrow_mut().push(("acquire", stage)));
            Self(stage)
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            LOG.with(|l| l.borrow_mut().push(("release", self.0)));
        }
    }

    /// Takes the log of this thread.
    pub(super) fn take() -> Vec<(&'static str, Stage)> {
        LOG.with(|l| std::mem::take(&mut *l.borrow_mut()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn agent(name: &str) -> AgentId {
        AgentId::parse(name).unwrap()
    }

    #[tokio::test]
    async fn step_permits_are_released_in_reverse_order() {
        let mut limits = GateLimits::uniform(4);
        limits
            .max_concurrent_provider_steps_per_agent
            .insert(agent("worker"), 1);
        let gate = ExecutionGate::new(limits);
        let cancel = CancellationToken::new();
        probe::take();
        let guard = gate
            .acquire_provider_step(Some(SessionId::new()), Some(&agent("worker")), &cancel)
            .await
            .unwrap();
        assert_eq!(
            probe::take(),
            vec![
                ("acquire", Stage::Session),
                ("acquire", Stage::Agent),
                ("acquire", Stage::Global),
            ]
        );
        drop(guard);
        assert_eq!(
            probe::take(),
            vec![
                ("release", Stage::Global),
                ("release", Stage::Agent),
                ("release", Stage::Session),
            ]
        );
        assert_eq!(gate.snapshot(), GateCounters::default());
    }

    /// A model that issues many parallel calls in one session queues them
    /// on that session's limit; they must not hold global permits while
    /// they wait, or every other session starves behind them.
    #[tokio::test(start_paused = true)]
    async fn queued_steps_of_one_session_leave_global_permits_to_others() {
        use std::time::Duration;
        let mut limits = GateLimits::uniform(2);
        limits.max_concurrent_tool_steps_per_session = 1;
        let gate = Arc::new(ExecutionGate::new(limits));
        let (a, b) = (SessionId::new(), SessionId::new());
        let cancel = CancellationToken::new();
        let running = gate
            .acquire_tool_step(Some(a), None, &cancel)
            .await
            .unwrap();
        let queued: Vec<_> = (0..5)
            .map(|_| {
                let gate = Arc::clone(&gate);
                tokio::spawn(async move {
                    let cancel = CancellationToken::new();
                    gate.acquire_tool_step(Some(a), None, &cancel).await
                })
            })
            .collect();
        // The clock is paused: this sleep ends only once every task is idle,
        // i.e. every queued step of session A is waiting.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert_eq!(
            gate.snapshot().tool_steps_in_use,
            1,
            "only the running step holds a global permit"
        );
        let other = tokio::time::timeout(
            Duration::from_secs(3600),
            gate.acquire_tool_step(Some(b), None, &cancel),
        )
        .await;
        assert!(other.is_ok(), "session B waited behind session A's queue");
        drop((running, other));
        for task in queued {
            task.abort();
        }
    }

    #[tokio::test]
    async fn run_permits_are_released_in_reverse_order() {
        let gate = ExecutionGate::new(GateLimits::uniform(2));
        probe::take();
        let permit = gate.try_admit_run(SessionId::new()).unwrap();
        drop(permit);
        assert_eq!(
            probe::take(),
            vec![
                ("acquire", Stage::Global),
                ("acquire", Stage::Session),
                ("release", Stage::Global),
                ("release", Stage::Session),
            ]
        );
    }

    #[tokio::test]
    async fn a_refused_session_stage_returns_the_global_permit() {
        let mut limits = GateLimits::uniform(4);
        limits.max_concurrent_runs_per_session = 1;
        let gate = ExecutionGate::new(limits);
        let session = SessionId::new();
        let _held = gate.try_admit_run(session).unwrap();
        probe::take();
        let err = gate.try_admit_run(session).unwrap_err();
        assert_eq!(
            err,
            EngineError::RunQuotaExceeded {
                scope: GateScope::Session,
                limit: 1
            }
        );
        assert_eq!(
            probe::take(),
            vec![("acquire", Stage::Global), ("release", Stage::Global)]
        );
        assert_eq!(gate.snapshot().runs_in_use, 1);
    }

    #[test]
    fn zero_limits_are_treated_as_one() {
        let gate = ExecutionGate::new(GateLimits::uniform(0));
        assert_eq!(gate.limits(), &GateLimits::uniform(1));
        let session = SessionId::new();
        let _run = gate.try_admit_run(session).unwrap();
        assert!(gate.try_admit_run(session).is_err());
    }

    #[test]
    fn leases_share_one_entry_per_key_and_remove_it_with_the_last() {
        let keyed: Arc<Keyed<SessionId>> = Arc::new(Keyed::default());
        let s = SessionId::new();
        let a = keyed.lease(s, 1);
        let b = keyed.lease(s, 1);
        assert!(Arc::ptr_eq(&a.semaphore, &b.semaphore));
        assert_eq!(keyed.len(), 1);
        drop(a);
        assert_eq!(keyed.len(), 1);
        drop(b);
        assert_eq!(keyed.len(), 0);
    }
}
