//! Executing one run: wait for run quota if needed, mark it running, run the
//! agent loop under the run's deadline and token with its scoped tool set,
//! then end it through the store's conditional terminal commit. The run
//! permit is dropped only after that commit.

use std::sync::{Arc, Weak};
use std::time::Duration;

use keel_catalog::AgentDefinition;
use keel_core::time::now_ms;
use keel_core::{
    ExecutionMode, Extensions, Message, Provider, RunId, ScopeRule, ToolExecutionContext,
    ToolRegistry,
};
use keel_store::{CompletionHandling, RunRecord, TerminalOutcome};
use tokio::sync::watch;
use tracing::Instrument;

use super::context::AgentExecutionContext;
use super::signals::EmitSignalTool;
use super::tools::{AgentTaskTool, DelegateTool};
use super::{ActiveRun, AgentCoordinator, RunEvent};
use crate::agent_loop::{TurnOutput, TurnRequest};
use crate::error::{internal_message, EngineError};
use crate::gate::{RunPermit, StepScope};
use crate::trace;

/// How a run obtains its run quota.
pub(crate) enum Quota {
    /// Admitted before acceptance (background); kept until the terminal commit.
    Held(RunPermit),
    /// Wait for a permit (bounded by the deadline and the token).
    Wait,
    /// Runs under its top-level foreground ancestor's permit.
    Inherited,
}

/// Everything a runner needs.
pub(crate) struct Launch {
    pub(crate) context: Arc<AgentExecutionContext>,
    pub(crate) definition: Arc<AgentDefinition>,
    pub(crate) provider: Arc<dyn Provider>,
    pub(crate) input: String,
    pub(crate) quota: Quota,
    /// A run that paused for approval and goes on (already running under
    /// this execution): `input` is unused.
    pub(crate) resume: Option<super::pause::Resume>,
}

/// What the agent loop of a run produced, with what came before it when
/// the run resumed after a pause.
pub(crate) struct Executed {
    pub(crate) out: TurnOutput,
    /// The conversation the loop started from (empty for a fresh run).
    pub(crate) history: Vec<Message>,
    /// Spend, model calls and tool calls before the loop started.
    pub(crate) prior: super::pause::Prior,
}

/// Keeps a run in the coordinator's active map while its runner lives; on
/// drop (normal end or abort) removes it and signals `done`.
pub(crate) struct ActiveGuard {
    coordinator: Weak<AgentCoordinator>,
    run_id: RunId,
    done: watch::Sender<bool>,
}

/// Extra attempts at a run's terminal commit the store refused as busy.
const TERMINAL_RETRIES: u32 = 8;
/// The first pause before one (doubling up to [`TERMINAL_RETRY_MAX`]).
const TERMINAL_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(200);
/// The longest pause between two.
const TERMINAL_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

impl ActiveGuard {
    pub(crate) fn register(
        coordinator: &AgentCoordinator,
        context: &Arc<AgentExecutionContext>,
    ) -> ActiveGuard {
        let (done, rx) = watch::channel(false);
        coordinator.active.lock().insert(
            context.run_id,
            ActiveRun {
                context: Arc::clone(context),
                done: rx,
            },
        );
        ActiveGuard {
            coordinator: coordinator.me.clone(),
            run_id: context.run_id,
            done,
        }
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        if let Some(c) = self.coordinator.upgrade() {
            let mut active = c.active.lock();
            if let Some(run) = active.remove(&self.run_id) {
                let session = run.context.root_session_id;
                let background_left = active.values().any(|a| {
                    a.context.root_session_id == session
                        && a.context.mode == ExecutionMode::Background
                });
                drop(active);
                // The session token only exists for live background runs.
                if run.context.mode == ExecutionMode::Background && !background_left {
                    c.session_tokens.lock().remove(&session);
                }
            }
        }
        self.done.send_replace(true);
    }
}

/// Why the loop did not produce an output.
pub(crate) enum Stop {
    Agent(EngineError),
    Setup(String),
    /// The run was no longer queued (ended by cancel_session or the reaper).
    Superseded,
}

impl AgentCoordinator {
    /// Runs `launch` to its terminal commit; returns the run as stored after
    /// it (`None` only if storage failed).
    pub(crate) async fn run_to_end(
        self: Arc<Self>,
        launch: Launch,
        guard: ActiveGuard,
    ) -> Option<RunRecord> {
        let Launch {
            context,
            definition,
            provider,
            input,
            quota,
            resume,
        } = launch;
        let (mut permit, wait) = match quota {
            Quota::Held(p) => (Some(p), false),
            Quota::Wait => (None, true),
            Quota::Inherited => (None, false),
        };
        let remaining = u64::try_from(context.deadline_at_ms.saturating_sub(now_ms())).unwrap_or(0);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(remaining);
        let result = tokio::time::timeout_at(
            deadline,
            self.execute(
                &context,
                &definition,
                provider,
                input,
                resume,
                wait,
                &mut permit,
            ),
        )
        .await;
        // A background run whose model called a gated tool waits for a
        // person with no runner: its quota and guard are released here.
        let result = match result {
            Ok(Ok(executed)) if !executed.out.awaiting_approval.is_empty() => {
                match self.commit_pause(&context, executed).await {
                    Ok(approvals) => {
                        self.pending.lock().remove(&context.run_id);
                        drop(permit);
                        drop(guard);
                        self.announce_pause(context.root_session_id, approvals)
                            .await;
                        self.notify(&context, RunEvent::WaitingApproval);
                        return self.store.get_run(context.run_id).await.ok().flatten();
                    }
                    Err(stop) => Ok(Err(stop)),
                }
            }
            other => other,
        };
        // Its model and tool calls, stored with its end (a loop that failed
        // returned none).
        let calls = match &result {
            Ok(Ok(executed)) => executed.out.calls.clone(),
            _ => Vec::new(),
        };
        let outcome = outcome_of(&context, result);
        let usage = match &outcome {
            TerminalOutcome::Completed { usage, .. } => Some(*usage),
            TerminalOutcome::BudgetExhausted { usage, .. } => Some(*usage),
            TerminalOutcome::Failed { usage, .. } => *usage,
            _ => None,
        };
        trace::record_run_end(
            &tracing::Span::current(),
            outcome.status().as_str(),
            matches!(outcome, TerminalOutcome::Completed { .. }),
            usage.as_ref(),
        );
        // Structured concurrency: a run ends after its foreground children
        // (cancelled with it when it was cancelled or timed out).
        let children: Vec<watch::Receiver<bool>> = self
            .active
            .lock()
            .values()
            .filter(|a| a.context.parent_run_id == Some(context.run_id))
            .map(|a| a.done.clone())
            .collect();
        for mut done in children {
            let _ = done.wait_for(|finished| *finished).await;
        }
        let handling = if matches!(outcome, TerminalOutcome::Cancelled { .. })
            && context.cancel_cause().quiet
        {
            CompletionHandling::Quiet
        } else {
            CompletionHandling::Deliver
        };
        let status = outcome.status();
        // The result is in memory and nothing else will commit it: a busy
        // database is asked again for a while (several processes on one
        // PostgreSQL conflict more than the store's own retries absorb).
        let mut pause = TERMINAL_RETRY_FIRST;
        let mut attempts = 0;
        let committed = loop {
            let committed = self
                .store
                .commit_run_end(
                    context.run_id,
                    context.execution_id.clone(),
                    outcome.clone(),
                    handling,
                    now_ms(),
                    calls.clone(),
                )
                .instrument(trace::store_span("commit_terminal", 1))
                .await;
            match committed {
                Err(e) if e.is_retryable() && attempts < TERMINAL_RETRIES => {
                    attempts += 1;
                    tracing::warn!(run_id = %context.run_id, error = %e, attempts, "terminal commit failed; asking again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(TERMINAL_RETRY_MAX);
                }
                committed => break committed,
            }
        };
        let (record, won) = match committed {
            Ok(commit) => {
                self.terminal_committed(context.root_session_id, &commit, handling)
                    .await;
                if !commit.won {
                    tracing::info!(
                        run_id = %context.run_id,
                        dropped = %status,
                        stored = %commit.run.status,
                        "late run result dropped: the run had already ended"
                    );
                }
                self.pending.lock().remove(&context.run_id);
                (Some(commit.run), commit.won)
            }
            Err(e) => {
                tracing::error!(
                    run_id = %context.run_id,
                    error = %e,
                    "terminal commit failed; the reaper or recovery will end the run"
                );
                (None, false)
            }
        };
        // Quota is released only after the terminal commit, so the count of
        // non-terminal runs never undercounts what the store holds.
        drop(permit);
        drop(guard);
        self.notify(&context, RunEvent::Committed { status, won });
        record
    }

    #[allow(clippy::too_many_arguments)]
    async fn execute(
        &self,
        context: &Arc<AgentExecutionContext>,
        definition: &AgentDefinition,
        provider: Arc<dyn Provider>,
        input: String,
        resume: Option<super::pause::Resume>,
        wait_for_quota: bool,
        permit: &mut Option<RunPermit>,
    ) -> Result<Executed, Stop> {
        if wait_for_quota {
            self.notify(context, RunEvent::WaitingForQuota);
            let p = self
                .gate
                .admit_run(context.root_session_id, &context.cancellation)
                .await
                .map_err(|_| Stop::Agent(EngineError::Cancelled))?;
            *permit = Some(p);
        }
        if context.cancellation.is_cancelled() {
            return Err(Stop::Agent(EngineError::Cancelled));
        }
        if resume.is_none() {
            match self
                .store
                .mark_run_running(context.run_id, context.execution_id.clone(), now_ms())
                .await
            {
                Ok(true) => self.changed(context.root_session_id).await,
                Ok(false) => return Err(Stop::Superseded),
                Err(e) => return Err(Stop::Agent(e.into())),
            }
        }
        let (tools, system_prompt) = self
            .run_tools(definition, context.mode)
            .map_err(Stop::Setup)?;
        self.notify(context, RunEvent::Started);
        let mut extensions = Extensions::default();
        extensions.insert(Arc::clone(context));
        extensions.insert(Arc::clone(&context.spend));
        extensions.insert(StepScope {
            session: Some(context.root_session_id),
            agent: Some(context.agent_id.clone()),
        });
        let policy = match &definition.approval {
            Some(keel_catalog::Approval::All(_)) => crate::ApprovalPolicy::all(),
            Some(keel_catalog::Approval::Tools(tools)) => {
                crate::ApprovalPolicy::tools(tools.iter().cloned())
            }
            None => crate::ApprovalPolicy::none(),
        }
        .union(&self.config.approval);
        if !policy.is_empty() {
            // A background run waits for a person; a foreground one has a
            // caller waiting on it, so its gated calls are refused.
            let mode = match context.mode {
                ExecutionMode::Background => crate::approval::GateMode::Pause,
                ExecutionMode::Foreground => crate::approval::GateMode::Refuse,
            };
            let granted = match mode {
                crate::approval::GateMode::Pause => self
                    .store
                    .approval_grants(context.root_session_id)
                    .await
                    .map_err(|e| Stop::Agent(e.into()))?,
                crate::approval::GateMode::Refuse => Vec::new(),
            };
            extensions.insert(Arc::new(crate::approval::ApprovalGate {
                policy,
                granted: granted.into_iter().collect(),
                mode,
            }));
        }
        let tools = Arc::new(tools);
        let tool_context = ToolExecutionContext {
            session_id: Some(context.root_session_id),
            turn_id: context.root_turn_id,
            run_id: Some(context.run_id),
            origin: Default::default(),
            cancellation: context.cancellation.clone(),
            extensions,
        };
        let (history, input, prior) = match resume {
            None => (
                Vec::new(),
                vec![Message::user(input)],
                super::pause::Prior::default(),
            ),
            Some(resume) => {
                let history = self
                    .take_up_decisions(&tools, &tool_context, resume.history, &resume.decided)
                    .await;
                (history, Vec::new(), resume.prior)
            }
        };
        if context.cancellation.is_cancelled() {
            return Err(Stop::Agent(EngineError::Cancelled));
        }
        let request = TurnRequest {
            provider,
            tools,
            system_prompt: Some(system_prompt),
            history: history.iter().cloned().map(Arc::new).collect(),
            input,
            // A resumed run has what its model calls before the pause left.
            max_iterations: definition
                .limits
                .max_iterations
                .saturating_sub(prior.iterations)
                .max(1),
            max_output_tokens: Some(definition.limits.max_output_tokens),
            context: tool_context,
        };
        let out = self
            .agent_loop
            .run(request, None)
            .await
            .map_err(Stop::Agent)?;
        Ok(Executed {
            out,
            history,
            prior,
        })
    }

    /// The run's tool set and system prompt: the definition's tools from the
    /// shared registry (fail-closed: only `Delegatable`), plus `delegate` and
    /// `agent_task` when the agent has delegates (depth and budget are
    /// enforced per call, so the model sees a typed refusal rather than a
    /// missing tool), plus `emit_signal` for a background run whose
    /// definition has a signal contract, plus `get_skill` and the list of
    /// its skills when its definition names some.
    fn run_tools(
        &self,
        definition: &AgentDefinition,
        mode: ExecutionMode,
    ) -> Result<(ToolRegistry, String), String> {
        let mut registry = self
            .tools
            .scoped(
                definition.tools.iter().map(String::as_str),
                ScopeRule::Delegated,
            )
            .map_err(|e| format!("tool set refused: {e}"))?;
        let catalog = self.catalog.current();
        if !definition.delegates.is_empty() {
            let delegate = DelegateTool::new(self.me.clone(), &catalog, &definition.delegates);
            registry
                .register(Arc::new(delegate))
                .map_err(|e| format!("tool set refused: {e}"))?;
            registry
                .register(Arc::new(AgentTaskTool::new(self.me.clone())))
                .map_err(|e| format!("tool set refused: {e}"))?;
        }
        if let (Some(contract), ExecutionMode::Background) = (&definition.signal, mode) {
            registry
                .register(Arc::new(EmitSignalTool::new(
                    self.me.clone(),
                    contract.clone(),
                )))
                .map_err(|e| format!("tool set refused: {e}"))?;
        }
        let mut prompt = definition.body.clone();
        crate::tools::grant_skills(
            catalog.skills(),
            &definition.skills,
            &mut registry,
            &mut prompt,
        )
        .map_err(|e| format!("tool set refused: {e}"))?;
        Ok((registry, prompt))
    }
}

/// The terminal outcome of a run from what its execution returned
/// (`Err`: its deadline passed).
fn outcome_of(
    context: &AgentExecutionContext,
    result: Result<Result<Executed, Stop>, tokio::time::error::Elapsed>,
) -> TerminalOutcome {
    match result {
        Err(_elapsed) => {
            // Foreground descendants derive from this token: stop them too.
            context.cancel("the parent run timed out", false);
            TerminalOutcome::TimedOut {
                deadline_at_ms: context.deadline_at_ms,
            }
        }
        Ok(Ok(Executed { out, prior, .. })) => {
            let mut usage = prior.usage;
            usage.add(out.usage);
            // Its own calls' cost, those before a pause included.
            let cost = context
                .spend
                .priced()
                .then(|| context.spend.own().cost.saturating_add(prior.cost));
            TerminalOutcome::Completed {
                result: out.final_text(),
                usage,
                tool_calls: out.tool_calls.saturating_add(prior.tool_calls),
                iterations: out.iterations.saturating_add(prior.iterations),
                cost,
            }
        }
        // Recorded with what the run's own calls spent.
        Ok(Err(Stop::Agent(e @ EngineError::BudgetExhausted { .. }))) => {
            let own = context.spend.own();
            TerminalOutcome::BudgetExhausted {
                error: e.to_string(),
                usage: own.usage,
                cost: context.spend.priced().then_some(own.cost),
            }
        }
        Ok(Err(Stop::Agent(EngineError::Cancelled))) | Ok(Err(Stop::Superseded)) => {
            TerminalOutcome::Cancelled {
                reason: context.cancel_cause().reason,
            }
        }
        // The run's error is what the delegating model reads: internal
        // detail goes to the log under an id.
        Ok(Err(Stop::Agent(e))) if e.is_internal() => TerminalOutcome::Failed {
            error: internal_message(&e),
            usage: None,
        },
        Ok(Err(Stop::Agent(e))) => TerminalOutcome::Failed {
            error: e.to_string(),
            usage: None,
        },
        Ok(Err(Stop::Setup(e))) => TerminalOutcome::Failed {
            error: e,
            usage: None,
        },
    }
}
