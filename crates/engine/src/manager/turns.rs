//! Running a turn and committing it: [`SessionManager::submit_turn_stream`]
//! starts the loop, [`PendingTurn::finalize`] commits its messages, state
//! and checkpoint in one store transaction.

use std::sync::Arc;

use keel_core::{Message, SessionId, ToolExecutionContext, TurnId};
use tokio::sync::OwnedMutexGuard;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{SessionManager, TurnReport};
use crate::agent_loop::{EventSink, TurnEvent, TurnOutput, TurnRequest};
use crate::error::{EngineError, Result};
use crate::session::AgentSession;

impl SessionManager {
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

    /// The turn's id (also in its [`TurnReport`]).
    pub fn turn_id(&self) -> TurnId {
        self.turn_id
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
