//! Background runs that wait for a person.
//!
//! When a background run's model calls a gated tool, the agent loop runs the
//! other calls of the batch and returns the gated ones; the runner commits
//! the pause ([`keel_store::Store::commit_paused_run`]: `waiting_approval`,
//! the run's conversation and spend, one pending approval per call) and
//! ends, releasing its run permit — a waiting run holds no permit, no
//! runner and no session lock, and survives a restart as rows. Once every
//! approval of the run is decided, the session's worker (woken by the
//! decision like by an inbox event) calls [`AgentCoordinator::resume_run`]:
//! a task waits for a run permit, hands the run to a new execution in one
//! transaction ([`keel_store::Store::resume_paused_run`], which marks the
//! approved calls started so none runs twice), runs the approved calls,
//! gives the model their results and the denials, and goes on as any run
//! does, to the usual terminal commit.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use keel_core::time::now_ms;
use keel_core::{
    ApprovalId, CancellationToken, Message, RunId, SessionId, ToolCall, ToolExecutionContext,
    ToolRegistry, Usage, Usd,
};
use keel_store::{ApprovalRecord, ApprovalStatus, NewApproval, PausedRunCommit, TerminalOutcome};
use parking_lot::Mutex;
use tokio::sync::watch;
use tracing::Instrument;

use super::context::{AgentExecutionContext, TreeBudget};
use super::runner::{Executed, Launch, Quota, Stop};
use super::AgentCoordinator;
use crate::approval::decided_result;
use crate::budget::{BudgetScope, Ledger, Spend, SpendMeter};
use crate::events::SessionEvent;
use crate::trace;

/// The cancellation reason of runs `/stop` ended.
pub(super) const STOPPED_REASON: &str = "stopped by the user";

/// What a run did before its current loop: spend, model and tool calls.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Prior {
    pub(crate) usage: Usage,
    /// What those calls cost (0 unpriced).
    pub(crate) cost: Usd,
    pub(crate) iterations: u32,
    pub(crate) tool_calls: u32,
}

/// A decided approval a resumed run takes up.
#[derive(Debug)]
pub(crate) struct Decided {
    pub(crate) record: ApprovalRecord,
    /// This execution marked it started: the tool runs (else, approved, a
    /// crash interrupted it and it does not run again).
    pub(crate) started: bool,
}

/// How a resumed run goes on.
#[derive(Debug)]
pub(crate) struct Resume {
    /// Its conversation when it paused.
    pub(crate) history: Vec<Message>,
    pub(crate) prior: Prior,
    pub(crate) decided: Vec<Decided>,
}

/// A resume under way (waiting for a run permit or running): `/stop`
/// cancels it and waits for `done`.
pub(super) struct Resuming {
    session: SessionId,
    token: CancellationToken,
    done: watch::Receiver<bool>,
}

/// Removes a resume from the coordinator's map when its task ends or is
/// aborted, and signals `done`.
struct ResumingGuard {
    coordinator: Arc<AgentCoordinator>,
    run_id: RunId,
    done: watch::Sender<bool>,
}

impl Drop for ResumingGuard {
    fn drop(&mut self) {
        self.coordinator.resuming.lock().remove(&self.run_id);
        self.done.send_replace(true);
    }
}

impl AgentCoordinator {
    /// Commits a background run's pause for approval; returns its approvals.
    /// A run no longer running under this execution (cancelled meanwhile)
    /// is [`Stop::Superseded`].
    pub(super) async fn commit_pause(
        &self,
        context: &Arc<AgentExecutionContext>,
        executed: Executed,
    ) -> Result<Vec<ApprovalId>, Stop> {
        let Executed {
            mut out,
            mut history,
            prior,
        } = executed;
        let now = now_ms();
        let timeout = i64::try_from(self.config.approval_timeout.as_millis()).unwrap_or(i64::MAX);
        let approvals: Vec<NewApproval> = out
            .awaiting_approval
            .iter()
            .map(|call| NewApproval {
                id: ApprovalId::new(),
                agent_id: context.agent_id.clone(),
                call: call.clone(),
                expires_at_ms: now.saturating_add(timeout),
            })
            .collect();
        let ids: Vec<ApprovalId> = approvals.iter().map(|a| a.id).collect();
        let waits: Vec<(ApprovalId, ToolCall)> =
            approvals.iter().map(|a| (a.id, a.call.clone())).collect();
        history.extend(std::mem::take(&mut out.messages));
        let mut usage = prior.usage;
        usage.add(out.usage);
        let commit = PausedRunCommit {
            run_id: context.run_id,
            execution_id: context.execution_id.clone(),
            // A run outside any root turn gets an id of its own (a fresh one).
            turn_id: context.root_turn_id.unwrap_or_default(),
            messages: history,
            usage,
            iterations: prior.iterations.saturating_add(out.iterations),
            tool_calls: prior.tool_calls.saturating_add(out.tool_calls),
            remaining_ms: context.deadline_at_ms.saturating_sub(now),
            approvals,
            calls: out.calls,
            now_ms: now,
        };
        match self.store.commit_paused_run(commit).await {
            Ok(true) => {
                // Each wait is a span under the run's, until its decision.
                for (id, call) in &waits {
                    trace::open_approval(*id, call);
                }
                Ok(ids)
            }
            Ok(false) => Err(Stop::Superseded),
            Err(e) => Err(Stop::Agent(e.into())),
        }
    }

    /// After a paused run's runner let go of it: announces its approvals
    /// and wakes its dialog's worker, which resumes the run if a decision
    /// came before the runner was gone (a resume is skipped while it lives).
    pub(super) async fn announce_pause(&self, session: SessionId, ids: Vec<ApprovalId>) {
        for id in ids {
            self.publish_approval(session, id).await;
        }
        self.changed(session).await;
        self.wake(session);
    }

    /// Publishes approval `id` as it is stored now (requested or decided).
    async fn publish_approval(&self, session: SessionId, id: ApprovalId) {
        let Some((events, _)) = self.manager.get() else {
            return;
        };
        match self.store.get_approval(id).await {
            Ok(Some(record)) => {
                let event = if record.status == ApprovalStatus::Pending {
                    SessionEvent::ApprovalRequested(Box::new(record))
                } else {
                    SessionEvent::ApprovalDecided(Box::new(record))
                };
                events.publish(session, event);
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(
                session_id = %session,
                approval_id = %id,
                error = %e,
                "reading an approval to announce failed; clients see it when they list approvals"
            ),
        }
    }

    /// The conversation a resumed run goes on from: `history`, then the
    /// result of each decided call — the tool's output for a call this
    /// execution started, a denial's reason, or that a crash left the
    /// outcome unknown.
    pub(super) async fn take_up_decisions(
        &self,
        tools: &ToolRegistry,
        ctx: &ToolExecutionContext,
        mut history: Vec<Message>,
        decided: &[Decided],
    ) -> Vec<Message> {
        for d in decided {
            history.push(decided_result(&self.agent_loop, tools, ctx, &d.record, d.started).await);
        }
        history
    }

    /// Resumes background run `run_id` of `session`, whose approvals are
    /// all decided, in a task of its own (nothing happens when its runner
    /// lives or a resume is under way). `dialog` is the dialog's spend
    /// ledger its model calls count against.
    pub(crate) fn resume_run(
        self: &Arc<Self>,
        session: SessionId,
        run_id: RunId,
        dialog: Option<Arc<Ledger>>,
    ) {
        if self.active.lock().contains_key(&run_id) {
            return;
        }
        let token = self.session_token(session).child_token();
        let (done, rx) = watch::channel(false);
        {
            let mut resuming = self.resuming.lock();
            if resuming.contains_key(&run_id) {
                return;
            }
            resuming.insert(
                run_id,
                Resuming {
                    session,
                    token: token.clone(),
                    done: rx,
                },
            );
        }
        let guard = ResumingGuard {
            coordinator: Arc::clone(self),
            run_id,
            done,
        };
        let me = Arc::clone(self);
        let spawned = self.supervisor.spawn(async move {
            let _guard = guard;
            me.resume_task(session, run_id, token, dialog).await;
        });
        if spawned.is_err() {
            tracing::info!(%run_id, "shutting down: the run stays waiting and resumes at the next start");
        }
    }

    async fn resume_task(
        self: Arc<Self>,
        session: SessionId,
        run_id: RunId,
        token: CancellationToken,
        dialog: Option<Arc<Ledger>>,
    ) {
        // Cancelled while waiting: the run stays waiting (a /stop ends it).
        let Ok(permit) = self.gate.admit_run(session, &token).await else {
            return;
        };
        let execution_id = format!("exec-{}", RunId::new());
        let resumed = match self
            .store
            .resume_paused_run(
                run_id,
                execution_id,
                self.config.runtime_generation,
                now_ms(),
            )
            .await
        {
            Ok(Some(resumed)) => resumed,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(%run_id, error = %e, "resuming a run after its approvals failed; retried when its dialog's worker wakes");
                return;
            }
        };
        self.changed(session).await;
        let record = resumed.run;
        let catalog = self.catalog.current();
        let definition = catalog.get(&record.spec.agent_id).cloned();
        let provider = definition
            .as_ref()
            .and_then(|d| self.providers.provider(&d.llm_profile));
        let (Some(definition), Some(provider)) = (definition, provider) else {
            let error = format!(
                "agent {:?} (or its provider profile) is no longer configured, so its run cannot go on after the approval",
                record.spec.agent_id.as_str()
            );
            self.end_resumed(&record, error).await;
            return;
        };
        let prices = self.providers.prices(&definition.llm_profile);
        let spent = Spend {
            usage: resumed.usage,
            cost: prices.map_or(Usd::ZERO, |p| p.cost(resumed.usage)),
            model_calls: u64::from(resumed.iterations),
        };
        let ledger = Ledger::new(
            BudgetScope::Run(record.spec.agent_id.clone()),
            definition.limits.max_tokens_total,
            definition.limits.max_cost_usd,
            spent,
        );
        let spend = SpendMeter::new(
            std::iter::once(ledger).chain(dialog).collect(),
            prices,
            Some((self.store.clone(), session)),
        );
        let context = Arc::new(AgentExecutionContext {
            root_session_id: session,
            root_turn_id: record.spec.root_turn_id,
            run_id,
            parent_run_id: record.spec.parent_run_id,
            agent_id: record.spec.agent_id.clone(),
            ancestry: vec![record.spec.agent_id.clone()],
            depth: record.spec.depth,
            mode: record.spec.mode,
            budget: Arc::new(TreeBudget::with_used(
                self.config.max_runs_per_tree,
                resumed.tree_runs,
            )),
            execution_id: record.spec.execution_id.clone(),
            deadline_at_ms: record.spec.deadline_at_ms,
            cancellation: token.clone(),
            max_children: definition.limits.max_children,
            children_started: AtomicU32::new(0),
            cancel_cause: Mutex::new(None),
            spend,
        });
        let guard = self.register(&context);
        // A /stop that came before the registration cancelled the token only.
        if token.is_cancelled() {
            context.cancel(STOPPED_REASON, true);
        }
        let decided = resumed
            .approvals
            .into_iter()
            .map(|record| Decided {
                started: resumed.started.contains(&record.id),
                record,
            })
            .collect();
        let launch = Launch {
            context,
            definition,
            provider,
            input: String::new(),
            quota: Quota::Held(permit),
            resume: Some(Resume {
                history: resumed.messages,
                prior: Prior {
                    usage: resumed.usage,
                    cost: spent.cost,
                    iterations: resumed.iterations,
                    tool_calls: resumed
                        .tool_calls
                        .saturating_add(u32::try_from(resumed.started.len()).unwrap_or(u32::MAX)),
                },
                decided,
            }),
        };
        // The resumed execution's span links to the run's first one (when
        // this process recorded it) and stands in for it from now on.
        let span = trace::run_span(
            session,
            run_id,
            launch.context.agent_id.as_str(),
            true,
            true,
        );
        trace::link_runs(&span, &[run_id]);
        trace::keep_run_span(run_id, &span);
        Arc::clone(&self)
            .run_to_end(launch, guard)
            .instrument(span)
            .await;
    }

    /// Ends a resumed run that cannot go on, as failed.
    async fn end_resumed(&self, record: &keel_store::RunRecord, error: String) {
        let committed = self
            .store
            .commit_terminal(
                record.spec.id,
                record.spec.execution_id.clone(),
                TerminalOutcome::Failed { error, usage: None },
                keel_store::CompletionHandling::Deliver,
                now_ms(),
            )
            .await;
        match committed {
            Ok(commit) => {
                self.terminal_committed(
                    record.spec.root_session_id,
                    &commit,
                    keel_store::CompletionHandling::Deliver,
                )
                .await
            }
            Err(e) => {
                tracing::error!(run_id = %record.spec.id, error = %e, "ending a run that cannot resume failed; the next start interrupts it")
            }
        }
    }

    /// `/stop`, first step: cancels the resumes under way of `session`'s
    /// runs (recording why on those already registered); returns what
    /// signals their end.
    pub(super) fn cancel_resumes(&self, session: SessionId) -> Vec<watch::Receiver<bool>> {
        let resuming: Vec<(RunId, watch::Receiver<bool>)> = self
            .resuming
            .lock()
            .iter()
            .filter(|(_, r)| r.session == session)
            .map(|(id, r)| {
                r.token.cancel();
                (*id, r.done.clone())
            })
            .collect();
        let active = self.active.lock();
        for (id, _) in &resuming {
            if let Some(run) = active.get(id) {
                run.context.cancel(STOPPED_REASON, true);
            }
        }
        resuming.into_iter().map(|(_, done)| done).collect()
    }

    /// `/stop`, last step: once the cancelled resumes (`resumes`) ended,
    /// every run of `session` still waiting for a person ends cancelled (its
    /// completion consumed, its pending approvals superseded); a resume that
    /// took its run over before that is cancelled too.
    pub(super) async fn stop_waiting_runs(
        &self,
        session: SessionId,
        resumes: Vec<watch::Receiver<bool>>,
    ) -> crate::Result<Vec<RunId>> {
        for mut done in resumes {
            let _ = done.wait_for(|finished| *finished).await;
        }
        let mut stopped = Vec::new();
        for run in self.store.waiting_runs(session).await? {
            let approvals = self.store.list_approvals(session, true).await?;
            let commit = self
                .store
                .commit_terminal(
                    run.spec.id,
                    run.spec.execution_id.clone(),
                    TerminalOutcome::Cancelled {
                        reason: STOPPED_REASON.to_owned(),
                    },
                    keel_store::CompletionHandling::Quiet,
                    now_ms(),
                )
                .await?;
            self.terminal_committed(session, &commit, keel_store::CompletionHandling::Quiet)
                .await;
            self.notify_run(
                run.spec.id,
                &run.spec.agent_id,
                super::RunEvent::Committed {
                    status: keel_core::RunStatus::Cancelled,
                    won: commit.won,
                },
            );
            if commit.won {
                for a in approvals.iter().filter(|a| a.run_id == Some(run.spec.id)) {
                    trace::settle_approval(a.id, "superseded");
                    self.publish_approval(session, a.id).await;
                }
                stopped.push(run.spec.id);
            }
        }
        // No resume can take a run over from here on (none is waiting); one
        // that did before is in the map since before it did.
        for mut done in self.cancel_resumes(session) {
            let _ = done.wait_for(|finished| *finished).await;
        }
        Ok(stopped)
    }
}
