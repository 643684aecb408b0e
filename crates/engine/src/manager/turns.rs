//! Running a turn and committing it: [`SessionManager::start_turn`] starts
//! the loop under the session's lock, [`PendingTurn::finalize`] commits its
//! messages, state and checkpoint in one store transaction. Only the session
//! worker (`worker.rs`) calls them: every turn of a session goes through it.
//!
//! A user turn's input is durable from the moment it is acknowledged:
//! [`SessionManager::send`] queues it in the store. When the turn starts, its
//! input moves into the history in one transaction, before the model is
//! called: from then on it is visible, `open`. The
//! final commit marks it answered. A turn that fails, is cancelled or is
//! dropped commits none of its outputs and leaves its input in the history,
//! unanswered, where the next turn sees it. A checkpoint is taken only by a
//! turn's final commit, so none ever points into a half turn.
//!
//! Before the loop starts, the context is fitted into the agent's budget:
//! when the request would be larger, older history is summarized first
//! (see `housekeeping`). A provider that still refuses it as too long, before
//! the turn called a tool, gets one rerun after a compaction.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use keel_core::ApprovalId;
use keel_core::{
    Extensions, Message, ProviderError, Role, SessionId, ToolExecutionContext, ToolRegistry,
    TurnId, TurnOrigin,
};
use keel_store::{LeasedEvents, NewApproval};
use tokio::sync::OwnedMutexGuard;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{SessionManager, TurnReport};
use crate::agent_loop::{EventSink, TurnEvent, TurnOutput, TurnProgress, TurnRequest};
use crate::approval::{ApprovalGate, GateMode};
use crate::budget::{BudgetScope, Ledger, Spend, SpendMeter};
use crate::coordinator;
use crate::error::{EngineError, Result};
use crate::mailbox::TurnMailbox;
use crate::session::{AgentSession, FinishedTurn};
use crate::tools::memory::{has_memory_tools, TurnMemory};
use crate::trace;
use keel_store::InputState;

/// How a turn starts.
pub(crate) struct TurnStart {
    /// The turn's id (known to the caller before the turn runs).
    pub(crate) turn_id: TurnId,
    /// Who started it.
    pub(crate) origin: TurnOrigin,
    /// The user's message, or a hidden trigger.
    pub(crate) input: Vec<Message>,
    /// Where the loop's events go.
    pub(crate) events: Option<EventSink>,
    /// Steer input for the running turn.
    pub(crate) mailbox: Arc<TurnMailbox>,
    /// Cancels the turn (`/stop`).
    pub(crate) cancel: CancellationToken,
    /// Only tools that read (a continuation may not act on the world).
    pub(crate) read_only: bool,
    /// Inbox events the turn answers (a continuation's lease): consumed by
    /// its commit, in the same transaction.
    pub(crate) answers: Option<LeasedEvents>,
    /// The input is queued in the store ([`keel_store::Store::queue_input`]):
    /// opening the turn takes it off the queue.
    pub(crate) queued: bool,
    /// Approvals of the session may be pending: a user input supersedes them.
    pub(crate) approvals_open: bool,
}

impl SessionManager {
    /// Starts a turn whose events go to `start.events`; nothing is committed
    /// (no message, no checkpoint) unless [`PendingTurn::finalize`] is called.
    pub(crate) async fn start_turn(
        self: &Arc<Self>,
        id: SessionId,
        start: TurnStart,
    ) -> Result<PendingTurn> {
        let session = self.session(id).await?;
        let mut guard = session.lock_owned().await;
        self.fresh(&mut guard).await?;
        // Each turn runs the definition in force when it starts (a reload
        // may have changed or removed it); the turn keeps it to its end.
        guard.agent = self.bundle.session_agent(guard.record.agent_id.as_ref())?;
        let span = tracing::Span::current();
        trace::record_agent(&span, guard.agent.name.as_str());
        trace::record_input(&span, &start.input);
        let slot = guard.writable_slot()?;
        // A root turn that may act asks before the tools its agent gates
        // (continuations only read, and never ask).
        let approval = if start.read_only || guard.agent.approval.is_empty() {
            None
        } else {
            let granted = self.store.approval_grants(id).await?;
            Some(Arc::new(ApprovalGate {
                policy: guard.agent.approval.clone(),
                granted: granted.into_iter().collect(),
                mode: GateMode::Pause,
            }))
        };
        // The user's words are durable before the model sees them; other
        // turns (continuations) commit their trigger with their answer.
        let opened = if start.origin == TurnOrigin::User && !start.input.is_empty() {
            // New input denies what still waits for a decision.
            if start.approvals_open {
                self.supersede_approvals(&mut guard).await?;
            }
            let queued = start.queued.then_some(start.turn_id);
            let opened = guard
                .open_turn(&self.store, &slot, &start.input, queued)
                .instrument(trace::store_span("open_turn", start.input.len()))
                .await;
            match opened {
                // Another process changed the session without its lease
                // telling (an API write there): read it again, once.
                Err(EngineError::Store(keel_store::StoreError::Conflict(_)))
                    if self.store.shared() =>
                {
                    self.reload(&mut guard).await?;
                    guard
                        .open_turn(&self.store, &slot, &start.input, queued)
                        .instrument(trace::store_span("open_turn", start.input.len()))
                        .await?
                }
                opened => opened?,
            }
        } else {
            Vec::new()
        };
        let committed_inputs = if opened.is_empty() {
            0
        } else {
            start.input.len()
        };
        // A turn of an agent with the memory tools works on a copy of the
        // session's memory, committed with its answer.
        let memory = has_memory_tools(&guard.agent.tools)
            .then(|| Arc::new(TurnMemory::new(guard.state.memory.clone())));
        // The turn's calls count against a fresh root-turn budget and the
        // dialog's (a rerun of the turn keeps both).
        let dialog = self
            .dialog_ledgers
            .get(&self.store, id, self.config.max_cost_usd_per_dialog)
            .await?;
        let turn = Ledger::new(
            BudgetScope::RootTurn,
            None,
            self.config.max_cost_usd_per_root_turn,
            Spend::default(),
        );
        let spend = SpendMeter::new(
            vec![turn, dialog],
            guard.agent.prices,
            Some((self.store.clone(), id)),
        );
        let mut pending = PendingTurn {
            manager: self.clone(),
            guard: Some(guard),
            slot,
            turn_id: start.turn_id,
            origin: start.origin,
            opened,
            committed_inputs,
            task: None,
            cancel: start.cancel.clone(),
            events: start.events.clone(),
            progress: Arc::new(TurnProgress::default()),
            memory,
            approval,
            spend,
            start,
        };
        pending.launch(false).await?;
        Ok(pending)
    }

    /// The tools of a continuation turn: those of `tools` that only read,
    /// and (for an agent that delegates) `agent_task` limited to reading runs.
    fn read_only_tools(&self, tools: &ToolRegistry) -> ToolRegistry {
        let mut scoped = tools.filtered(|t| t.read_only());
        if let Some(coordinator) = &self.bundle.coordinator {
            if tools.contains(coordinator::AGENT_TASK_TOOL) {
                if let Err(e) = scoped.register(coordinator.read_only_task_tool()) {
                    tracing::warn!(error = %e, "continuation tools: agent_task not added");
                }
            }
        }
        scoped
    }
}

/// A turn whose events are streaming; commit it with [`Self::finalize`].
/// Dropping it cancels the turn: none of its output is committed, and its
/// input (committed already) stays, unanswered.
pub(crate) struct PendingTurn {
    manager: Arc<SessionManager>,
    guard: Option<OwnedMutexGuard<AgentSession>>,
    slot: String,
    turn_id: TurnId,
    origin: TurnOrigin,
    /// Seqs of the input committed before the model was called.
    opened: Vec<i64>,
    /// How many leading messages of the loop's output that input is.
    committed_inputs: usize,
    task: Option<JoinHandle<Result<TurnOutput>>>,
    cancel: CancellationToken,
    events: Option<EventSink>,
    /// Set by the loop; a turn that acted is never rerun.
    progress: Arc<TurnProgress>,
    /// The session memory the turn's tools work on.
    memory: Option<Arc<TurnMemory>>,
    /// The turn's approval gate, when its agent gates tools.
    approval: Option<Arc<ApprovalGate>>,
    /// The budgets the turn's model calls count against.
    spend: Arc<SpendMeter>,
    /// How it started (a rerun starts the same way).
    start: TurnStart,
}

impl PendingTurn {
    /// Fits the context into the agent's budget (compacting it first when
    /// it would not fit, or always when `force`), then spawns the loop.
    async fn launch(&mut self, force: bool) -> Result<()> {
        let manager = Arc::clone(&self.manager);
        let guard = self.guard.as_mut().ok_or(EngineError::Cancelled)?;
        let exclude_from = self.opened.first().copied();
        let extra = if self.committed_inputs == 0 {
            self.start.input.iter().map(Message::estimated_tokens).sum()
        } else {
            0
        };
        manager
            .fit_context(guard, extra, exclude_from, force, &self.cancel)
            .await;
        let mut history = guard.replay(&self.slot)?;
        // The committed input is the end of the replay; the loop adds it.
        let keep = history.len().saturating_sub(self.committed_inputs);
        history.truncate(keep);
        let agent = guard.agent.clone();
        let start = &self.start;
        let tools = if start.read_only {
            Arc::new(manager.read_only_tools(&agent.tools))
        } else {
            agent.tools.clone()
        };
        let mut extensions = Extensions::default();
        extensions.insert(Arc::clone(&start.mailbox));
        extensions.insert(Arc::clone(&self.progress));
        extensions.insert(Arc::clone(&self.spend));
        if let Some(memory) = &self.memory {
            extensions.insert(Arc::clone(memory));
        }
        if let Some(approval) = &self.approval {
            extensions.insert(Arc::clone(approval));
        }
        if let Some(coordinator) = &manager.bundle.coordinator {
            // One run budget for every delegation of this root turn.
            extensions.insert(coordinator.root_turn_budget());
        }
        let request = TurnRequest {
            // Stored images become `data:` URLs for the call only.
            provider: crate::ResolvingImages::wrap(agent.provider.clone(), manager.store.clone()),
            tools,
            system_prompt: Some(agent.system_prompt.clone()),
            history,
            input: start.input.clone(),
            max_iterations: agent.max_iterations,
            max_output_tokens: agent.max_output_tokens,
            context: ToolExecutionContext {
                session_id: Some(guard.id()),
                turn_id: Some(start.turn_id),
                run_id: None,
                origin: start.origin,
                cancellation: start.cancel.clone(),
                extensions,
            },
        };
        let agent_loop = manager.bundle.agent_loop.clone();
        let sink = start.events.clone();
        self.task = Some(tokio::spawn(
            async move { agent_loop.run(request, sink.as_ref()).await }.in_current_span(),
        ));
        Ok(())
    }

    /// Waits for the loop. A provider that refuses the request as too long
    /// before the turn acted gets one rerun, after a compaction.
    async fn outcome(&mut self) -> Result<TurnOutput> {
        let mut rerun = false;
        loop {
            let result = match self.task.take() {
                Some(t) => t
                    .await
                    .unwrap_or_else(|e| Err(EngineError::TurnPanicked(e.to_string()))),
                None => Err(EngineError::Cancelled),
            };
            let overflow = matches!(
                &result,
                Err(EngineError::Provider(ProviderError::ContextLengthExceeded(
                    _
                )))
            );
            if !overflow || rerun || self.progress.acted.load(Ordering::Acquire) {
                return result;
            }
            rerun = true;
            tracing::info!(turn_id = %self.turn_id, "the provider found the context too long; compacting and retrying once");
            self.launch(true).await?;
        }
    }

    /// Whether the turn's input is committed already (it stays, unanswered,
    /// if the turn ends without an answer).
    pub(crate) fn input_committed(&self) -> bool {
        !self.opened.is_empty()
    }

    /// Waits for the loop, commits the turn (outputs, state, checkpoint) in
    /// one transaction, then starts titling/summarizing in the background. A storage failure after the
    /// store's retries is reported as a system notice event and returned.
    /// When the turn or its commit fails, its input stays, unanswered.
    pub(crate) async fn finalize(mut self) -> Result<TurnReport> {
        let result = self.outcome().await;
        let mut guard = self.guard.take().ok_or(EngineError::Cancelled)?;
        let id = guard.id();
        let mut output = match result {
            Ok(output) => output,
            Err(e) => {
                self.leave_unanswered(&mut guard).await;
                return Err(e);
            }
        };
        if self.cancel.is_cancelled() {
            // Stopped after the loop's last await: nothing is committed.
            self.leave_unanswered(&mut guard).await;
            return Err(EngineError::Cancelled);
        }
        if self.origin != TurnOrigin::User {
            for m in &mut output.messages {
                if matches!(m.role, Role::Assistant | Role::Tool) {
                    m.origin = self.origin;
                }
            }
        }
        let auto = self.manager.config.auto_checkpoint;
        // The events the model answered (a continuation's lease, and steered
        // events it read) are consumed in the turn's own transaction.
        let consumed: Vec<LeasedEvents> = self
            .start
            .answers
            .take()
            .into_iter()
            .chain(self.start.mailbox.drained_events())
            .collect();
        let expires = keel_core::time::now_ms().saturating_add(
            i64::try_from(self.manager.config.approval_timeout.as_millis()).unwrap_or(i64::MAX),
        );
        let approvals: Vec<NewApproval> = output
            .awaiting_approval
            .iter()
            .map(|call| NewApproval {
                id: ApprovalId::new(),
                agent_id: guard.agent.name.clone(),
                call: call.clone(),
                expires_at_ms: expires,
            })
            .collect();
        let approval_ids = approvals.iter().map(|a| a.id).collect();
        let waits: Vec<(ApprovalId, keel_core::ToolCall)> =
            approvals.iter().map(|a| (a.id, a.call.clone())).collect();
        let paused = (!approvals.is_empty()).then_some((self.turn_id, approvals));
        let rows = output.messages.len().saturating_sub(self.committed_inputs);
        let checkpoint = match guard
            .commit_turn(
                &self.manager.store,
                FinishedTurn {
                    slot: &self.slot,
                    output: &output,
                    committed_inputs: self.committed_inputs,
                    answers: &self.opened,
                    consumed,
                    memory: self.memory.as_ref().and_then(|m| m.changes()),
                    paused,
                    turn_id: self.turn_id,
                },
                auto,
            )
            .instrument(trace::store_span("commit_turn", rows))
            .await
        {
            Ok(c) => {
                for (id, call) in &waits {
                    trace::open_approval(*id, call);
                }
                c
            }
            Err(e) => {
                if let Some(sink) = &self.events {
                    let _ = sink.send(TurnEvent::SystemNotice {
                        text: format!(
                            "This turn's answer could not be saved and was discarded: {e}"
                        ),
                    });
                }
                tracing::error!(session_id = %id, error = %e, "turn commit failed");
                if matches!(e, EngineError::Store(keel_store::StoreError::Conflict(_))) {
                    // What this process remembers is stale: the next turn reloads.
                    self.manager.forget(id);
                }
                self.leave_unanswered(&mut guard).await;
                return Err(e);
            }
        };
        self.manager.after_commit(&guard);
        Ok(TurnReport {
            turn_id: self.turn_id,
            output,
            checkpoint,
            approvals: approval_ids,
            dialog: guard.record.clone(),
        })
    }
}

impl PendingTurn {
    /// The turn ends without an answer: its committed input stays in the
    /// history, marked unanswered. A failure to mark it in the store is
    /// logged: the session's next turn marks it.
    async fn leave_unanswered(&self, session: &mut AgentSession) {
        if self.opened.is_empty() {
            return;
        }
        if let Err(e) = session
            .mark_unanswered(&self.manager.store, &self.opened)
            .await
        {
            tracing::warn!(session_id = %session.id(), error = %e, "could not mark the turn's input unanswered; the next turn will");
        }
    }
}

impl Drop for PendingTurn {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            self.cancel.cancel();
            task.abort();
        }
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        if self.opened.is_empty() {
            return;
        }
        // A dropped turn cannot await: memory says unanswered now, the store
        // is told in the background (and the session's next turn closes the
        // input there anyway).
        guard.set_input_state(&self.opened, InputState::Unanswered);
        let (store, id, seqs) = (self.manager.store.clone(), guard.id(), self.opened.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.mark_unanswered(id, seqs).await {
                    tracing::warn!(session_id = %id, error = %e, "could not mark a dropped turn's input unanswered; the next turn will");
                }
            });
        }
    }
}
