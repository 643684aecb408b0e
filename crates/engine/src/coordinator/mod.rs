//! Sub-agent runs: the [`AgentCoordinator`] admits delegations (foreground
//! or background), persists every run, executes it under the execution gate
//! with a deadline and a cancellation token, and ends it with the store's
//! conditional terminal commit.
//!
//! - **Identity.** The root agent is not a run: a root turn is identified by
//!   its session and turn ([`CallerContext::root`]). A run carries an
//!   [`AgentExecutionContext`] in its tools' context extensions.
//! - **Runs are session-less.** A run's conversation is ephemeral (system
//!   prompt = the definition's body, input = task + context, no history);
//!   what is persisted is the run record with its full result or error.
//! - **Cancellation.** Foreground children get child tokens of the caller's
//!   token, so `/stop` or a cancelled parent reaches every foreground
//!   descendant. Background runs get a token of their root session owned by
//!   the coordinator: they outlive the turn that created them.
//! - **Quotas.** Background runs take a run permit before anything is
//!   written and keep it until after their terminal commit. Foreground
//!   children of the root wait for a run permit; deeper foreground runs
//!   execute under their top-level ancestor's permit, which is what lets
//!   nested delegation complete with every limit at 1. A parent waiting on
//!   children holds no step permit (runtime-injected tools take none).
//! - **Terminal commit** is conditional on (run id, execution id,
//!   non-terminal): a late result after a cancel, a timeout or the reaper is
//!   dropped and logged.

mod context;
mod delegate;
mod pause;
mod providers;
mod runner;
mod signals;
mod supervisor;
mod tools;
mod view;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use keel_catalog::{AgentCatalog, CatalogHandle};
use keel_core::time::now_ms;
use keel_core::{CancellationToken, RunId, SessionId, Tool, ToolRegistry};
use keel_store::{CancelReport, RecoveryReport, RunRecord, Store};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent_loop::{AgentLoop, StepGate};
use crate::events::SessionEvents;
use crate::gate::ExecutionGate;

use crate::error::{EngineError, Result};
pub(crate) use context::AgentExecutionContext;
pub use context::CallerContext;
pub use providers::{ProfileProviders, ProviderFactory};
pub use signals::SignalView;
use supervisor::Supervisor;
pub(crate) use tools::AGENT_TASK_TOOL;
use tools::{AgentTaskTool, DelegateTool};
pub use view::{
    project_response, AgentRunView, DelegateRequest, DelegateResponse, DelegateTask,
    ForegroundResult, RunResult,
};

/// A point in a run's life reported to a [`RunObserver`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEvent {
    /// The runner is about to wait for run quota.
    WaitingForQuota,
    /// The run is marked running; its first step is a provider-permit wait.
    Started,
    /// A background run committed its pause for approval and its runner
    /// ended (it holds no permit until a decision resumes it).
    WaitingApproval,
    /// The terminal commit returned (by the runner, after releasing its
    /// permit, or by the reaper); `won` is false for a dropped late result.
    Committed {
        /// The status the runner tried to record.
        status: keel_core::RunStatus,
        /// Whether that commit ended the run.
        won: bool,
    },
}

/// Observes runner lifecycle points: a caller waits on them instead of
/// polling (the demo waits for a background completion; tests use them as
/// deterministic barriers).
pub trait RunObserver: Send + Sync {
    /// Called by the runner of `run_id` at `event`.
    fn on_run_event(&self, run_id: RunId, agent: &keel_core::AgentId, event: RunEvent);
}

/// Limits and settings of the coordinator (the gateway fills it from keel.toml).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// Deepest run allowed (1 = only children of the root); the catalog's own bound also applies.
    pub max_tree_depth: u32,
    /// Most runs one delegation tree may create.
    pub max_runs_per_tree: u32,
    /// Most tasks in one delegate call.
    pub max_children_per_call: u32,
    /// Inbox capacity of a root session (pending events + reserved completions).
    pub max_pending_inbox_events_per_session: u32,
    /// Most bytes of a run's result in a delegate tool output.
    pub result_preview_bytes: usize,
    /// How often the reaper looks for overdue runs without a runner.
    pub reaper_interval: Duration,
    /// The runtime generation that owns runs started by this process.
    pub runtime_generation: u64,
    /// Tools keel.toml gates behind a person's approval; a run's gate is
    /// this and its definition's `approval:` (a background run waits for a
    /// decision, a foreground run's gated call is refused, not run).
    pub approval: crate::ApprovalPolicy,
    /// How long a background run's approval waits before it expires as a
    /// denial.
    pub approval_timeout: Duration,
}

impl Default for CoordinatorConfig {
    /// Depth 3, 16 runs per tree, 8 tasks per call, inbox 64, 2 KiB previews, reaper every 5 s, generation 1, approvals expire after 24 h.
    fn default() -> Self {
        Self {
            max_tree_depth: 3,
            max_runs_per_tree: 16,
            max_children_per_call: 8,
            max_pending_inbox_events_per_session: 64,
            result_preview_bytes: 2048,
            reaper_interval: Duration::from_secs(5),
            runtime_generation: 1,
            approval: crate::ApprovalPolicy::none(),
            approval_timeout: Duration::from_secs(24 * 3600),
        }
    }
}

/// Where the coordinator reads the current agent catalog from.
pub trait CatalogSource: Send + Sync {
    /// The catalog in force now (a cheap clone).
    fn current(&self) -> AgentCatalog;
}

impl CatalogSource for AgentCatalog {
    fn current(&self) -> AgentCatalog {
        self.clone()
    }
}

impl CatalogSource for CatalogHandle {
    fn current(&self) -> AgentCatalog {
        CatalogHandle::current(self)
    }
}

/// A run with a live runner task in this process.
struct ActiveRun {
    context: Arc<AgentExecutionContext>,
    done: watch::Receiver<bool>,
}

/// A run accepted by this process whose terminal commit was not seen yet.
#[derive(Debug, Clone)]
struct PendingRun {
    root_session_id: SessionId,
    agent_id: keel_core::AgentId,
    execution_id: String,
    deadline_at_ms: i64,
}

/// Admits, executes and ends sub-agent runs; see the module docs.
pub struct AgentCoordinator {
    store: Store,
    catalog: Arc<dyn CatalogSource>,
    providers: Arc<dyn ProviderFactory>,
    tools: Arc<ToolRegistry>,
    gate: Arc<ExecutionGate>,
    agent_loop: AgentLoop,
    config: CoordinatorConfig,
    supervisor: Supervisor,
    active: Mutex<HashMap<RunId, ActiveRun>>,
    pending: Mutex<HashMap<RunId, PendingRun>>,
    /// Runs resuming after their approvals were decided.
    resuming: Mutex<HashMap<RunId, pause::Resuming>>,
    session_tokens: Mutex<HashMap<SessionId, CancellationToken>>,
    shutdown: CancellationToken,
    observer: Mutex<Option<Arc<dyn RunObserver>>>,
    /// The session manager's feeds and the manager (for inbox wakes).
    manager: OnceLock<(Arc<SessionEvents>, Weak<dyn SessionWaker>)>,
    me: Weak<AgentCoordinator>,
}

/// What the coordinator asks of the session manager above it, which
/// implements it: wake a dialog's worker, or steer signals into its turn.
#[async_trait::async_trait]
pub(crate) trait SessionWaker: Send + Sync {
    /// Wakes `root`'s worker to deliver its inbox.
    fn wake_inbox(self: Arc<Self>, root: SessionId);
    /// Steers `root`'s pending signals into its running turn (or wakes its
    /// worker when none runs).
    async fn steer_signals(self: Arc<Self>, root: SessionId);
}

impl std::fmt::Debug for AgentCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentCoordinator")
            .field("config", &self.config)
            .field("active_runs", &self.active.lock().len())
            .field("supervisor", &self.supervisor)
            .finish_non_exhaustive()
    }
}

impl AgentCoordinator {
    /// A coordinator over `store`, with agents from `catalog`, providers from
    /// `providers`, the shared built-in `tools` (never mutated) and `gate`.
    pub fn new(
        store: Store,
        catalog: Arc<dyn CatalogSource>,
        providers: Arc<dyn ProviderFactory>,
        tools: Arc<ToolRegistry>,
        gate: Arc<ExecutionGate>,
        config: CoordinatorConfig,
    ) -> Arc<Self> {
        let step_gate: Arc<dyn StepGate> = gate.clone();
        Arc::new_cyclic(|me| Self {
            store,
            catalog,
            providers,
            tools,
            gate,
            agent_loop: AgentLoop::new(step_gate),
            config,
            supervisor: Supervisor::new(),
            active: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            resuming: Mutex::new(HashMap::new()),
            session_tokens: Mutex::new(HashMap::new()),
            shutdown: CancellationToken::new(),
            observer: Mutex::new(None),
            manager: OnceLock::new(),
            me: me.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    /// Aborts every runner task as a crash of the process would: their runs
    /// stay non-terminal until the reaper or recovery ends them.
    #[cfg(feature = "testing")]
    pub fn abort_runners(&self) {
        self.supervisor.abort_all();
    }

    /// Installs `observer` for runner lifecycle events, replacing any earlier one.
    pub fn set_observer(&self, observer: Arc<dyn RunObserver>) {
        *self.observer.lock() = Some(observer);
    }

    fn notify(&self, context: &AgentExecutionContext, event: RunEvent) {
        self.notify_run(context.run_id, &context.agent_id, event);
    }

    fn notify_run(&self, run_id: RunId, agent: &keel_core::AgentId, event: RunEvent) {
        let observer = self.observer.lock().clone();
        if let Some(o) = observer {
            o.on_run_event(run_id, agent, event);
        }
    }

    /// Runs with a live runner in this process.
    pub fn active_runs(&self) -> Vec<RunId> {
        let mut ids: Vec<RunId> = self.active.lock().keys().copied().collect();
        ids.sort();
        ids
    }

    /// [`Self::root_tools_for`] the catalog in force now.
    pub fn root_tools(self: &Arc<Self>) -> Vec<Arc<dyn Tool>> {
        self.root_tools_for(&self.catalog.current())
    }

    /// The runtime tools of the root agent: `delegate` (to `catalog`'s
    /// `root_delegates`, described from it) and `agent_task`. Add them to
    /// the root's registry.
    pub fn root_tools_for(self: &Arc<Self>, catalog: &AgentCatalog) -> Vec<Arc<dyn Tool>> {
        vec![
            Arc::new(DelegateTool::new(
                Arc::downgrade(self),
                catalog,
                catalog.root_delegates(),
            )),
            Arc::new(AgentTaskTool::new(Arc::downgrade(self))),
        ]
    }

    /// A fresh run budget for one root turn: every delegation of the turn
    /// (and of its runs) draws from it, so `max_runs_per_tree` bounds the
    /// whole turn, not each delegate call.
    pub(crate) fn root_turn_budget(&self) -> Arc<context::TreeBudget> {
        Arc::new(context::TreeBudget::new(self.config.max_runs_per_tree))
    }

    /// `agent_task` limited to reading runs (get, list, get_result): what a
    /// continuation turn may use.
    pub(crate) fn read_only_task_tool(self: &Arc<Self>) -> Arc<dyn Tool> {
        Arc::new(AgentTaskTool::read_only(Arc::downgrade(self)))
    }

    /// One run of the caller's tree; any other id is [`EngineError::RunNotFound`].
    pub async fn get_run(&self, caller: &CallerContext, run_id: RunId) -> Result<AgentRunView> {
        Ok(AgentRunView::from(&self.visible_run(caller, run_id).await?))
    }

    /// The full result (or error) of a run of the caller's tree.
    pub async fn get_result(&self, caller: &CallerContext, run_id: RunId) -> Result<RunResult> {
        let r = self.visible_run(caller, run_id).await?;
        Ok(RunResult {
            run_id: r.spec.id,
            status: r.status,
            result: r.result,
            error: r.error,
        })
    }

    /// Runs of the caller's tree, newest first, at most `limit` (1..=1000):
    /// every run of the session for the root, the descendants of a run otherwise.
    pub async fn list_runs(
        &self,
        caller: &CallerContext,
        limit: usize,
    ) -> Result<Vec<AgentRunView>> {
        let limit = limit.clamp(1, 1000);
        let records = match caller.run_context() {
            None => {
                self.store
                    .list_runs(caller.root_session_id(), None, limit)
                    .await?
                    .items
            }
            Some(me) => {
                let mut out: Vec<RunRecord> = Vec::new();
                let mut queue = VecDeque::from([me.run_id]);
                while let Some(parent) = queue.pop_front() {
                    for child in self.store.child_runs(parent).await? {
                        if out.len() >= limit {
                            break;
                        }
                        queue.push_back(child.spec.id);
                        out.push(child);
                    }
                }
                out.sort_by_key(|r| std::cmp::Reverse((r.created_at_ms, r.spec.id)));
                out
            }
        };
        Ok(records.iter().map(AgentRunView::from).collect())
    }

    /// Cancels a non-terminal run of the caller's tree (and with it its
    /// foreground descendants) and waits until it is terminal. A background
    /// run's completion is recorded as consumed: the caller asked for it.
    pub async fn cancel_run(&self, caller: &CallerContext, run_id: RunId) -> Result<AgentRunView> {
        let record = self.visible_run(caller, run_id).await?;
        if !record.status.is_terminal() {
            let reason = format!("cancelled by {}", caller.agent_name());
            let active = self
                .active
                .lock()
                .get(&run_id)
                .map(|a| (Arc::clone(&a.context), a.done.clone()));
            match active {
                Some((context, mut done)) => {
                    context.cancel(reason, true);
                    // The runner commits the cancellation; wait for it.
                    let _ = done.wait_for(|finished| *finished).await;
                }
                None => {
                    let outcome = keel_store::TerminalOutcome::Cancelled { reason };
                    self.store
                        .commit_terminal(
                            run_id,
                            record.spec.execution_id.clone(),
                            outcome,
                            keel_store::CompletionHandling::Quiet,
                            now_ms(),
                        )
                        .await?;
                    self.pending.lock().remove(&run_id);
                    self.changed(record.spec.root_session_id).await;
                }
            }
        }
        let record = self
            .store
            .get_run(run_id)
            .await?
            .ok_or_else(|| EngineError::RunNotFound(run_id.to_string()))?;
        Ok(AgentRunView::from(&record))
    }

    /// Cancels the background runs of a root session (`/stop`) — running,
    /// resuming or waiting for approval — and waits until each is terminal. Their completions are recorded as
    /// consumed (no continuation turn starts for them) and their
    /// unconsumed signals are superseded. Returns the runs it cancelled.
    pub async fn stop_background_runs(&self, session: SessionId) -> Result<Vec<RunId>> {
        let resumes = self.cancel_resumes(session);
        let running: Vec<(Arc<AgentExecutionContext>, watch::Receiver<bool>)> = self
            .active
            .lock()
            .values()
            .filter(|a| {
                a.context.root_session_id == session
                    && a.context.mode == keel_core::ExecutionMode::Background
            })
            .map(|a| (Arc::clone(&a.context), a.done.clone()))
            .collect();
        let mut cancelled = Vec::with_capacity(running.len());
        for (context, _) in &running {
            context.cancel(pause::STOPPED_REASON, true);
            cancelled.push(context.run_id);
        }
        for (_, mut done) in running {
            let _ = done.wait_for(|finished| *finished).await;
        }
        cancelled.extend(self.stop_waiting_runs(session, resumes).await?);
        cancelled.sort();
        cancelled.dedup();
        Ok(cancelled)
    }

    /// Cancels every run of a root session (archive/delete): non-terminal runs
    /// end cancelled with their reservations released and pending events
    /// dead-lettered, then live runners are stopped (their late commits are dropped).
    pub async fn cancel_session(&self, session: SessionId, reason: &str) -> Result<CancelReport> {
        let report = self
            .store
            .cancel_session(session, reason.to_owned(), now_ms())
            .await?;
        if let Some(token) = self.session_tokens.lock().remove(&session) {
            token.cancel();
        }
        let contexts: Vec<Arc<AgentExecutionContext>> = self
            .active
            .lock()
            .values()
            .filter(|a| a.context.root_session_id == session)
            .map(|a| Arc::clone(&a.context))
            .collect();
        for context in contexts {
            context.cancel(reason, true);
        }
        self.pending
            .lock()
            .retain(|_, p| p.root_session_id != session);
        self.changed(session).await;
        Ok(report)
    }

    /// Activation recovery: runs of older runtime generations that are still
    /// queued/running/waiting end as interrupted (background ones turn their
    /// reserved completion into a failure event); leases and counters are repaired.
    pub async fn recover_on_activation(&self) -> Result<RecoveryReport> {
        let report = self
            .store
            .recover_older_generations(self.config.runtime_generation, now_ms())
            .await?;
        if !report.interrupted_runs.is_empty() {
            tracing::info!(
                runs = report.interrupted_runs.len(),
                completions = report.completion_events,
                "recovery: runs of older generations interrupted"
            );
        }
        Ok(report)
    }

    /// Ends as timed out every run accepted by this process that is past its
    /// deadline at `now_ms` and has no live runner (the runner itself uses
    /// `timeout_at`). Returns the runs it ended.
    pub async fn reap_overdue(&self, now_ms: i64) -> Result<Vec<RunId>> {
        let overdue: Vec<(RunId, PendingRun)> = {
            let active = self.active.lock();
            self.pending
                .lock()
                .iter()
                .filter(|(id, p)| p.deadline_at_ms <= now_ms && !active.contains_key(id))
                .map(|(id, p)| (*id, p.clone()))
                .collect()
        };
        let mut reaped = Vec::new();
        for (run_id, p) in overdue {
            let outcome = keel_store::TerminalOutcome::TimedOut {
                deadline_at_ms: p.deadline_at_ms,
            };
            let commit = self
                .store
                .commit_terminal(
                    run_id,
                    p.execution_id,
                    outcome,
                    keel_store::CompletionHandling::Deliver,
                    now_ms,
                )
                .await?;
            self.terminal_committed(
                p.root_session_id,
                &commit,
                keel_store::CompletionHandling::Deliver,
            )
            .await;
            if commit.won {
                tracing::info!(%run_id, "reaper: run passed its deadline without a runner");
                reaped.push(run_id);
            }
            self.pending.lock().remove(&run_id);
            self.notify_run(
                run_id,
                &p.agent_id,
                RunEvent::Committed {
                    status: keel_core::RunStatus::TimedOut,
                    won: commit.won,
                },
            );
        }
        Ok(reaped)
    }

    /// Starts the deadline reaper: every `interval` it runs
    /// [`AgentCoordinator::reap_overdue`] until [`AgentCoordinator::shutdown`].
    pub fn spawn_reaper(self: &Arc<Self>, interval: Duration) -> JoinHandle<()> {
        let me = Arc::downgrade(self);
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => {}
                }
                let Some(coordinator) = me.upgrade() else {
                    break;
                };
                if let Err(e) = coordinator.reap_overdue(now_ms()).await {
                    tracing::warn!(error = %e, "reaper pass failed; retrying next tick");
                }
            }
        })
    }

    /// Stops the reaper and refuses new runner tasks; running runs continue.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
        self.supervisor.close();
    }

    /// Connects the coordinator to the session manager: committed run and
    /// inbox changes reach the session feeds, and a new completion wakes its
    /// session's worker.
    pub(crate) fn attach(&self, events: Arc<SessionEvents>, manager: Weak<dyn SessionWaker>) {
        if self.manager.set((events, manager)).is_err() {
            tracing::warn!("the coordinator is already attached to a session manager");
        }
    }

    /// Publishes what changed in `root`'s runs and inbox to its subscribers.
    pub(crate) async fn changed(&self, root: SessionId) {
        if let Some((events, _)) = self.manager.get() {
            events.project(root).await;
        }
    }

    /// Wakes the worker of `root` to deliver its inbox.
    pub(crate) fn wake(&self, root: SessionId) {
        if let Some(manager) = self.manager.get().and_then(|(_, m)| m.upgrade()) {
            manager.wake_inbox(root);
        }
    }

    /// After a terminal commit: publish it, and wake the session when it
    /// left a completion to deliver.
    async fn terminal_committed(
        &self,
        root: SessionId,
        commit: &keel_store::TerminalCommit,
        handling: keel_store::CompletionHandling,
    ) {
        if commit.won {
            crate::metrics::run_ended(commit.run.spec.agent_id.as_str(), commit.run.status);
            self.changed(root).await;
            if commit.event_id.is_some() && handling == keel_store::CompletionHandling::Deliver {
                self.wake(root);
            }
        }
    }

    /// The coordinator-owned token of a root session that background runs derive from.
    fn session_token(&self, session: SessionId) -> CancellationToken {
        self.session_tokens
            .lock()
            .entry(session)
            .or_default()
            .clone()
    }

    /// The run if it belongs to the caller's tree; otherwise `NotFound`
    /// (whether or not it exists elsewhere: no existence leak).
    async fn visible_run(&self, caller: &CallerContext, run_id: RunId) -> Result<RunRecord> {
        let not_found = || EngineError::RunNotFound(run_id.to_string());
        let record = self.store.get_run(run_id).await?.ok_or_else(not_found)?;
        if record.spec.root_session_id != caller.root_session_id() {
            return Err(not_found());
        }
        let Some(me) = caller.run_context() else {
            return Ok(record);
        };
        let mut parent = record.spec.parent_run_id;
        // Depth is bounded by the catalog's cap; the hop limit guards a corrupt chain.
        for _ in 0..=keel_catalog::MAX_DELEGATION_DEPTH_CAP {
            let Some(p) = parent else { break };
            if p == me.run_id {
                return Ok(record);
            }
            parent = self
                .store
                .get_run(p)
                .await?
                .and_then(|r| r.spec.parent_run_id);
        }
        Err(not_found())
    }
}
