//! Admission of a delegation: validate the caller's
//! rights and limits without side effects, reserve tree budget and (for
//! background runs) run quota, persist the queued run(s) or group, then
//! spawn supervised runners — awaiting them (foreground) or returning ids at
//! once (background). A rejected spawn is compensated: the runs end
//! cancelled, their reservations freed, and no id is returned.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use keel_catalog::AgentDefinition;
use keel_core::time::now_ms;
use keel_core::{ExecutionMode, GroupId, Provider, RunId, ScopeRule};
use keel_store::{
    AcceptGroup, AcceptRun, NewGroup, NewRun, RunRecord, StoreError, TerminalOutcome,
};
use parking_lot::Mutex;
use tracing::Instrument;

use super::context::{AgentExecutionContext, CallerContext, TreeBudget};
use super::runner::{Launch, Quota};
use super::view::{DelegateRequest, DelegateResponse, ForegroundResult};
use super::{AgentCoordinator, PendingRun};
use crate::budget::{BudgetScope, Ledger, Spend, SpendMeter};
use crate::error::{EngineError, Result};
use crate::gate::RunPermit;
use crate::trace;

/// Longest task text, in bytes.
pub(crate) const MAX_TASK_BYTES: usize = 32 * 1024;
/// Longest context (as JSON), in bytes.
pub(crate) const MAX_CONTEXT_BYTES: usize = 16 * 1024;
/// Longest idempotency key, in bytes.
pub(crate) const MAX_IDEMPOTENCY_KEY_BYTES: usize = 128;

/// Reason recorded on runs whose runner could not be spawned.
const SPAWN_REJECTED_REASON: &str = "not started: the runtime is shutting down (spawn rejected)";

/// One validated task, ready to persist.
struct PlannedRun {
    definition: Arc<AgentDefinition>,
    provider: Arc<dyn Provider>,
    task: String,
    context_json: Option<String>,
}

/// Budget and child reservations of a plan; released on drop unless kept.
struct Reservation<'a> {
    budget: Arc<TreeBudget>,
    caller: Option<&'a AgentExecutionContext>,
    n: u32,
    kept: bool,
}

impl Reservation<'_> {
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.budget.release(self.n);
            if let Some(c) = self.caller {
                c.release_children(self.n);
            }
        }
    }
}

/// Runs as persisted by one acceptance transaction.
struct Accepted {
    group_id: Option<GroupId>,
    runs: Vec<RunRecord>,
    existing: bool,
}

impl AgentCoordinator {
    /// Delegates `request` for `caller`; see the module docs for the order of
    /// checks and writes. Policy refusals persist nothing.
    pub async fn delegate(
        &self,
        caller: CallerContext,
        request: DelegateRequest,
    ) -> Result<DelegateResponse> {
        if caller.cancellation().is_cancelled() {
            return Err(EngineError::Cancelled);
        }
        let (planned, depth, budget) = self.plan(&caller, &request)?;
        let n = u32::try_from(planned.len()).unwrap_or(u32::MAX);
        budget
            .try_reserve(n)
            .map_err(|used| EngineError::TreeBudgetExceeded {
                limit: budget.limit(),
                used,
                requested: n,
            })?;
        if let Some(me) = caller.run_context() {
            if let Err(started) = me.try_start_children(n) {
                budget.release(n);
                return Err(EngineError::ChildLimit {
                    agent: me.agent_id.to_string(),
                    limit: me.max_children(),
                    started,
                    requested: n,
                });
            }
        }
        let reservation = Reservation {
            budget: Arc::clone(&budget),
            caller: caller.run_context().map(|me| me.as_ref()),
            n,
            kept: false,
        };
        match request.mode {
            ExecutionMode::Foreground => {
                self.foreground(&caller, &request, planned, depth, budget, reservation)
                    .await
            }
            ExecutionMode::Background => {
                self.background(&caller, &request, planned, depth, budget, reservation)
                    .await
            }
        }
    }

    /// Every check that needs no write: caller rights, request shape, agents,
    /// edges, depth, providers, tool scopes. Returns the runs, their depth and
    /// the tree budget.
    fn plan(
        &self,
        caller: &CallerContext,
        request: &DelegateRequest,
    ) -> Result<(Vec<PlannedRun>, u32, Arc<TreeBudget>)> {
        if request.mode == ExecutionMode::Background && !caller.is_root() {
            return Err(EngineError::BackgroundNotAllowed);
        }
        let requested = u32::try_from(request.tasks.len()).unwrap_or(u32::MAX);
        if requested == 0 {
            return Err(EngineError::InvalidDelegation("tasks is empty".into()));
        }
        if requested > self.config.max_children_per_call {
            return Err(EngineError::TooManyTasks {
                requested,
                limit: self.config.max_children_per_call,
            });
        }
        if let Some(key) = &request.idempotency_key {
            if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_BYTES {
                return Err(EngineError::InvalidDelegation(format!(
                    "idempotency_key must be 1..={MAX_IDEMPOTENCY_KEY_BYTES} bytes"
                )));
            }
        }
        let catalog = self.catalog.current();
        let depth = caller.depth() + 1;
        let limit = self
            .config
            .max_tree_depth
            .min(catalog.max_delegation_depth());
        let mut planned = Vec::with_capacity(request.tasks.len());
        for (i, t) in request.tasks.iter().enumerate() {
            let n = i + 1;
            if t.task.trim().is_empty() {
                return Err(EngineError::InvalidDelegation(format!(
                    "task {n} has an empty task text"
                )));
            }
            if t.task.len() > MAX_TASK_BYTES {
                return Err(EngineError::InvalidDelegation(format!(
                    "task {n} is {} bytes; at most {MAX_TASK_BYTES} are allowed",
                    t.task.len()
                )));
            }
            let context_json = match &t.context {
                None | Some(serde_json::Value::Null) => None,
                Some(v) => {
                    let json = v.to_string();
                    if json.len() > MAX_CONTEXT_BYTES {
                        return Err(EngineError::InvalidDelegation(format!(
                            "the context of task {n} is {} bytes as JSON; at most {MAX_CONTEXT_BYTES} are allowed",
                            json.len()
                        )));
                    }
                    Some(json)
                }
            };
            let definition = catalog
                .get(&t.agent)
                .cloned()
                .ok_or_else(|| EngineError::UnknownAgent(t.agent.to_string()))?;
            if !catalog.may_delegate(caller.agent_id(), &t.agent) {
                return Err(EngineError::UnauthorizedEdge {
                    caller: caller.agent_name(),
                    target: t.agent.to_string(),
                });
            }
            if depth > limit {
                return Err(EngineError::DepthExceeded { depth, limit });
            }
            let provider = self
                .providers
                .provider(&definition.llm_profile)
                .ok_or_else(|| EngineError::UnknownProfile {
                    agent: t.agent.to_string(),
                    profile: definition.llm_profile.clone(),
                })?;
            self.tools
                .scoped(
                    definition.tools.iter().map(String::as_str),
                    ScopeRule::Delegated,
                )
                .map_err(|e| EngineError::ToolScope {
                    agent: t.agent.to_string(),
                    reason: e.to_string(),
                })?;
            planned.push(PlannedRun {
                definition,
                provider,
                task: t.task.clone(),
                context_json,
            });
        }
        let budget = caller.tree_budget(self.config.max_runs_per_tree);
        Ok((planned, depth, budget))
    }

    /// Persists the queued run (one task) or group (a batch) in one transaction.
    async fn accept(
        &self,
        caller: &CallerContext,
        request: &DelegateRequest,
        planned: &[PlannedRun],
        depth: u32,
    ) -> Result<Accepted> {
        let now = now_ms();
        let capacity = self.config.max_pending_inbox_events_per_session;
        let parent = caller.run_context();
        let new_runs: Vec<NewRun> = planned
            .iter()
            .map(|p| {
                let d = &p.definition;
                let timeout_ms =
                    i64::try_from(d.limits.timeout_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
                NewRun {
                    id: RunId::new(),
                    root_session_id: caller.root_session_id(),
                    root_turn_id: caller.root_turn_id(),
                    parent_run_id: parent.map(|p| p.run_id),
                    caller_agent_id: caller
                        .agent_id()
                        .cloned()
                        .unwrap_or_else(keel_core::AgentId::root),
                    caller_scope_id: caller.scope_id(),
                    idempotency_key: request.idempotency_key.clone(),
                    agent_id: d.id.clone(),
                    definition_hash: d.definition_hash.clone(),
                    provider_profile: d.llm_profile.clone(),
                    provider_name: p.provider.name().to_owned(),
                    model_id: p.provider.model().to_owned(),
                    mode: request.mode,
                    depth,
                    plan_item_id: None,
                    execution_id: format!("exec-{}", RunId::new()),
                    task: p.task.clone(),
                    context_json: p.context_json.clone(),
                    budget_json: serde_json::json!({
                        "max_iterations": d.limits.max_iterations,
                        "timeout_secs": d.limits.timeout_secs,
                        "max_output_tokens": d.limits.max_output_tokens,
                        "max_children": d.limits.max_children,
                        "max_runs_per_tree": self.config.max_runs_per_tree,
                    })
                    .to_string(),
                    signal_contract_json: d
                        .signal
                        .as_ref()
                        .and_then(|s| serde_json::to_string(s).ok()),
                    signal_delivery: d.signal.as_ref().map(|s| s.delivery),
                    completion_delivery: None,
                    failure_delivery: None,
                    runtime_generation: self.config.runtime_generation,
                    deadline_at_ms: now.saturating_add(timeout_ms),
                }
            })
            .collect();
        let result = if new_runs.len() == 1 {
            let mut runs = new_runs;
            let run = runs.remove(0);
            self.store
                .accept_run(AcceptRun {
                    run,
                    inbox_capacity: capacity,
                    now_ms: now,
                })
                .await
                .map(|a| Accepted {
                    group_id: None,
                    runs: vec![a.run],
                    existing: a.existing,
                })
        } else {
            let deadline = new_runs
                .iter()
                .map(|r| r.deadline_at_ms)
                .max()
                .unwrap_or(now);
            self.store
                .accept_agent_group(AcceptGroup {
                    group: NewGroup {
                        id: GroupId::new(),
                        root_session_id: caller.root_session_id(),
                        caller_run_id: parent.map(|p| p.run_id),
                        caller_scope_id: caller.scope_id(),
                        idempotency_key: request.idempotency_key.clone(),
                        mode: request.mode,
                        completion_policy: request.completion_policy,
                        completion_delivery: None,
                        failure_delivery: None,
                        deadline_at_ms: deadline,
                        runtime_generation: self.config.runtime_generation,
                    },
                    runs: new_runs,
                    inbox_capacity: capacity,
                    now_ms: now,
                })
                .await
                .map(|a| Accepted {
                    group_id: Some(a.group.spec.id),
                    runs: a.runs,
                    existing: a.existing,
                })
        };
        let accepted = result.map_err(|e| match e {
            StoreError::InboxFull { capacity, .. } => EngineError::InboxFull { capacity },
            other => other.into(),
        })?;
        self.changed(caller.root_session_id()).await;
        Ok(accepted)
    }

    /// The execution context of a newly accepted run.
    fn context_for(
        &self,
        caller: &CallerContext,
        record: &RunRecord,
        definition: &AgentDefinition,
        budget: &Arc<TreeBudget>,
        cancellation: keel_core::CancellationToken,
    ) -> Arc<AgentExecutionContext> {
        let mut ancestry = caller
            .run_context()
            .map(|p| p.ancestry.clone())
            .unwrap_or_default();
        ancestry.push(record.spec.agent_id.clone());
        // The run's own budget (its definition's limits), inside its caller's.
        let ledger = Ledger::new(
            BudgetScope::Run(record.spec.agent_id.clone()),
            definition.limits.max_tokens_total,
            definition.limits.max_cost_usd,
            Spend::default(),
        );
        let prices = self.providers.prices(&definition.llm_profile);
        let foreground = record.spec.mode == ExecutionMode::Foreground;
        let spend = match caller.spend() {
            Some(meter) => meter.child(ledger, prices, foreground),
            None => SpendMeter::new(vec![ledger], prices, None),
        };
        Arc::new(AgentExecutionContext {
            root_session_id: record.spec.root_session_id,
            root_turn_id: record.spec.root_turn_id,
            run_id: record.spec.id,
            parent_run_id: record.spec.parent_run_id,
            agent_id: record.spec.agent_id.clone(),
            ancestry,
            depth: record.spec.depth,
            mode: record.spec.mode,
            budget: Arc::clone(budget),
            execution_id: record.spec.execution_id.clone(),
            deadline_at_ms: record.spec.deadline_at_ms,
            cancellation,
            max_children: definition.limits.max_children,
            children_started: AtomicU32::new(0),
            cancel_cause: Mutex::new(None),
            spend,
        })
    }

    /// Registers and spawns the runners of `launches`, in order. On a rejected
    /// spawn, already spawned runs are cancelled (their runners commit it),
    /// the rest are compensated here; returns the spawned handles or the error.
    async fn spawn_all(
        &self,
        launches: Vec<Launch>,
    ) -> Result<Vec<tokio::task::JoinHandle<Option<RunRecord>>>> {
        let me = self.me.upgrade();
        let mut handles = Vec::with_capacity(launches.len());
        let mut launches = launches.into_iter();
        let mut rejected: Vec<Arc<AgentExecutionContext>> = Vec::new();
        for launch in launches.by_ref() {
            let context = Arc::clone(&launch.context);
            let Some(me) = me.clone() else {
                rejected.push(context);
                break;
            };
            let guard = self.register(&context);
            let background = context.mode == ExecutionMode::Background;
            let span = trace::run_span(
                context.root_session_id,
                context.run_id,
                context.agent_id.as_str(),
                background,
                false,
            );
            trace::record_input_text(&span, &launch.input);
            if background {
                trace::keep_run_span(context.run_id, &span);
            }
            match self
                .supervisor
                .spawn(async move { me.run_to_end(launch, guard).await }.instrument(span))
            {
                Ok(handle) => handles.push((context, handle)),
                Err(_) => {
                    // The future (with its launch and guard) was dropped unspawned.
                    rejected.push(context);
                    break;
                }
            }
        }
        rejected.extend(launches.map(|l| l.context));
        if rejected.is_empty() {
            return Ok(handles.into_iter().map(|(_, h)| h).collect());
        }
        for (context, _) in &handles {
            context.cancel(SPAWN_REJECTED_REASON, true);
        }
        for context in rejected {
            self.compensate(&context).await;
        }
        for (_, handle) in handles {
            let _ = handle.await;
        }
        Err(EngineError::SpawnRejected)
    }

    /// Ends a run whose runner never started: cancelled, completion recorded
    /// as consumed (freeing its reservation), no continuation.
    async fn compensate(&self, context: &AgentExecutionContext) {
        let outcome = TerminalOutcome::Cancelled {
            reason: SPAWN_REJECTED_REASON.into(),
        };
        match self
            .store
            .commit_terminal(
                context.run_id,
                context.execution_id.clone(),
                outcome,
                keel_store::CompletionHandling::Quiet,
                now_ms(),
            )
            .await
        {
            Ok(_) => {
                self.pending.lock().remove(&context.run_id);
                self.changed(context.root_session_id).await;
            }
            Err(e) => tracing::error!(
                run_id = %context.run_id,
                error = %e,
                "compensation of an unspawned run failed; the reaper or recovery will end it"
            ),
        }
    }

    /// Records a run as pending (for the reaper) and active (for cancel).
    pub(super) fn register(
        &self,
        context: &Arc<AgentExecutionContext>,
    ) -> super::runner::ActiveGuard {
        self.pending.lock().insert(
            context.run_id,
            PendingRun {
                root_session_id: context.root_session_id,
                agent_id: context.agent_id.clone(),
                execution_id: context.execution_id.clone(),
                deadline_at_ms: context.deadline_at_ms,
            },
        );
        super::runner::ActiveGuard::register(self, context)
    }

    async fn foreground(
        &self,
        caller: &CallerContext,
        request: &DelegateRequest,
        planned: Vec<PlannedRun>,
        depth: u32,
        budget: Arc<TreeBudget>,
        reservation: Reservation<'_>,
    ) -> Result<DelegateResponse> {
        let accepted = self.accept(caller, request, &planned, depth).await?;
        if accepted.existing {
            drop(reservation);
            return Ok(DelegateResponse::Foreground {
                group_id: accepted.group_id,
                results: accepted
                    .runs
                    .iter()
                    .map(ForegroundResult::from_record)
                    .collect(),
                existing: true,
            });
        }
        reservation.keep();
        let parent = caller.run_context().cloned();
        if let Some(p) = &parent {
            // running → waiting_children; the loop holds no step permit here.
            if let Err(e) = self
                .store
                .mark_run_waiting_children(p.run_id, p.execution_id.clone(), now_ms())
                .await
            {
                tracing::warn!(run_id = %p.run_id, error = %e, "could not mark the parent waiting");
            }
            self.changed(p.root_session_id).await;
        }
        let launches: Vec<Launch> = accepted
            .runs
            .iter()
            .zip(planned)
            .map(|(record, p)| {
                let context = self.context_for(
                    caller,
                    record,
                    &p.definition,
                    &budget,
                    caller.cancellation().child_token(),
                );
                Launch {
                    context,
                    definition: p.definition,
                    provider: p.provider,
                    input: input_text(&p.task, p.context_json.as_deref()),
                    resume: None,
                    // Children of the root wait for a run permit; deeper runs
                    // execute under their top-level ancestor's permit.
                    quota: if caller.is_root() {
                        Quota::Wait
                    } else {
                        Quota::Inherited
                    },
                }
            })
            .collect();
        let spawned = self.spawn_all(launches).await;
        let outcome = match spawned {
            Ok(handles) => {
                let joined = futures::future::join_all(handles).await;
                let mut results = Vec::with_capacity(joined.len());
                for (record, joined) in accepted.runs.iter().zip(joined) {
                    let stored = match joined {
                        Ok(Some(r)) => r,
                        // The runner's commit failed: show what is stored.
                        _ => self
                            .store
                            .get_run(record.spec.id)
                            .await
                            .ok()
                            .flatten()
                            .unwrap_or_else(|| record.clone()),
                    };
                    results.push(ForegroundResult::from_record(&stored));
                }
                Ok(DelegateResponse::Foreground {
                    group_id: accepted.group_id,
                    results,
                    existing: false,
                })
            }
            Err(e) => Err(e),
        };
        if let Some(p) = &parent {
            // waiting_children → running, unless the parent already ended.
            if let Err(e) = self
                .store
                .mark_run_running(p.run_id, p.execution_id.clone(), now_ms())
                .await
            {
                tracing::warn!(run_id = %p.run_id, error = %e, "could not mark the parent running");
            }
            self.changed(p.root_session_id).await;
        }
        if caller.cancellation().is_cancelled() {
            return Err(EngineError::Cancelled);
        }
        outcome
    }

    async fn background(
        &self,
        caller: &CallerContext,
        request: &DelegateRequest,
        planned: Vec<PlannedRun>,
        depth: u32,
        budget: Arc<TreeBudget>,
        reservation: Reservation<'_>,
    ) -> Result<DelegateResponse> {
        // Run quota before any write; released on every failure below.
        let mut permits: Vec<RunPermit> = Vec::with_capacity(planned.len());
        for _ in &planned {
            permits.push(self.gate.try_admit_run(caller.root_session_id())?);
        }
        let accepted = self.accept(caller, request, &planned, depth).await?;
        let run_ids: Vec<RunId> = accepted.runs.iter().map(|r| r.spec.id).collect();
        if accepted.existing {
            drop(reservation);
            return Ok(DelegateResponse::Background {
                group_id: accepted.group_id,
                run_ids,
                existing: true,
            });
        }
        reservation.keep();
        let session_token = self.session_token(caller.root_session_id());
        let launches: Vec<Launch> = accepted
            .runs
            .iter()
            .zip(planned)
            .zip(permits)
            .map(|((record, p), permit)| Launch {
                context: self.context_for(
                    caller,
                    record,
                    &p.definition,
                    &budget,
                    session_token.child_token(),
                ),
                definition: p.definition,
                provider: p.provider,
                input: input_text(&p.task, p.context_json.as_deref()),
                quota: Quota::Held(permit),
                resume: None,
            })
            .collect();
        self.spawn_all(launches).await?;
        Ok(DelegateResponse::Background {
            group_id: accepted.group_id,
            run_ids,
            existing: false,
        })
    }
}

/// The run's input message: the task, then its context.
fn input_text(task: &str, context_json: Option<&str>) -> String {
    match context_json {
        None => task.to_owned(),
        Some(ctx) => format!("{task}\n\nContext (JSON):\n{ctx}"),
    }
}
