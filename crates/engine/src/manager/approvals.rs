//! Approvals of tool calls: listing and deciding them, and resuming the
//! turn that waits for them.
//!
//! A root turn whose model called a gated tool commits what it did so far
//! with one pending approval per gated call (see `turns.rs`) and ends. A
//! decision is committed in the store, then wakes the session's worker —
//! the wake the inbox uses; the worker reads [`Store::approval_schedule`]
//! before anything else. Once every approval of the paused turn is decided
//! it resumes the turn: each approved call is marked as started in the
//! store, run, and its result (or the denial) appended to the history with
//! the approvals settled in one transaction; then a continuation turn lets
//! the model go on. A call marked started whose result never committed (a
//! crash) is never run again: the model reads that its outcome is unknown.
//! Expiry is a timer of the worker (the schedule's earliest expiry), and a
//! new user message settles the root turn's approvals still pending as
//! denied ("superseded by new input") before its input enters the history.
//! A background run's approvals are decided the same way; once all are,
//! the worker hands the run to the coordinator, which resumes it (see
//! `coordinator/pause.rs`).
//!
//! [`Store::approval_schedule`]: keel_store::Store::approval_schedule

use std::sync::Arc;

use keel_core::{ApprovalId, Message, RunId, SessionId, ToolExecutionContext, TurnId, TurnOrigin};
use keel_store::{ApprovalRecord, ApprovalStatus, DecideApproval, DecideOutcome, Decision};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::worker::WorkerShared;
use super::SessionManager;
use crate::approval::{decided_result, denial_text};
use crate::clock;
use crate::error::{EngineError, Result};
use crate::events::SessionEvent;
use crate::session::AgentSession;
use crate::trace;

impl SessionManager {
    /// The approvals of a dialog, oldest first (only those waiting for a
    /// decision when `pending_only`).
    pub async fn approvals(
        &self,
        session: SessionId,
        pending_only: bool,
    ) -> Result<Vec<ApprovalRecord>> {
        match self.store.list_approvals(session, pending_only).await {
            Err(keel_store::StoreError::NotFound(_)) => Err(EngineError::SessionNotFound(session)),
            other => Ok(other?),
        }
    }

    /// Commits a person's decision on approval `id` (from dialog `session`,
    /// when the caller is one: an approval of another dialog is not found),
    /// then wakes the dialog's worker, which resumes the paused turn once
    /// all its approvals are decided. Deciding twice, or after it expired,
    /// is [`EngineError::ApprovalDecided`]; nothing runs twice.
    pub async fn decide_approval(
        self: &Arc<Self>,
        id: ApprovalId,
        session: Option<SessionId>,
        decision: Decision,
        reason: Option<String>,
    ) -> Result<ApprovalRecord> {
        let reason = reason.map(|r| keel_core::truncate_with_note(r, 2000));
        let outcome = self
            .store
            .decide_approval(DecideApproval {
                id,
                session_id: session,
                decision,
                reason,
                now_ms: clock::now_ms(),
            })
            .await;
        let outcome = match outcome {
            Err(keel_store::StoreError::NotFound(_)) => {
                return Err(EngineError::ApprovalNotFound(id))
            }
            other => other?,
        };
        match outcome {
            DecideOutcome::Decided(record) => {
                let outcome = match decision {
                    Decision::Deny => "denied",
                    Decision::Approve | Decision::ApproveAlways => "approved",
                };
                trace::settle_approval(id, outcome);
                let session = record.session_id;
                self.events.publish(
                    session,
                    SessionEvent::ApprovalDecided(Box::new(record.clone())),
                );
                self.wake_inbox(session);
                Ok(record)
            }
            DecideOutcome::Expired(record) => {
                trace::settle_approval(id, "expired");
                let session = record.session_id;
                self.events.publish(
                    session,
                    SessionEvent::ApprovalDecided(Box::new(record.clone())),
                );
                self.wake_inbox(session);
                Err(EngineError::ApprovalDecided {
                    id,
                    status: record.status.to_string(),
                })
            }
            DecideOutcome::AlreadyDecided(record) => Err(EngineError::ApprovalDecided {
                id,
                status: record.status.to_string(),
            }),
        }
    }

    /// Publishes the approvals a turn just paused for.
    pub(super) async fn announce_approvals(&self, session: SessionId, ids: &[ApprovalId]) {
        for id in ids {
            match self.store.get_approval(*id).await {
                Ok(Some(record)) => self
                    .events
                    .publish(session, SessionEvent::ApprovalRequested(Box::new(record))),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "reading a new approval failed; clients see it when they list approvals")
                }
            }
        }
    }

    /// Before new user input enters the history: denies the approvals still
    /// pending (with `supersede_reason`), their denials committed as the
    /// calls' results in one transaction.
    pub(super) async fn supersede_approvals(&self, guard: &mut AgentSession) -> Result<()> {
        let session = guard.id();
        // A background run's approvals are not the conversation's: they stay.
        let mut pending = self.store.list_approvals(session, true).await?;
        pending.retain(|a| a.run_id.is_none());
        if pending.is_empty() {
            return Ok(());
        }
        let reason = &self.config.supersede_reason;
        let results = pending
            .iter()
            .map(|a| {
                Message::tool_result(
                    a.tool_call_id.clone(),
                    a.tool_name.clone(),
                    denial_text("superseded", Some(reason)),
                )
                .failed(true)
            })
            .collect();
        let ids: Vec<ApprovalId> = pending.iter().map(|a| a.id).collect();
        guard
            .commit_approval_results(&self.store, results, ids.clone(), Some(reason.clone()))
            .await?;
        for id in ids {
            trace::settle_approval(id, "superseded");
            if let Ok(Some(record)) = self.store.get_approval(id).await {
                self.events
                    .publish(session, SessionEvent::ApprovalDecided(Box::new(record)));
            }
        }
        Ok(())
    }

    /// Hands the background runs `runs`, whose approvals are all decided,
    /// to the coordinator, which resumes each in a task of its own.
    pub(super) async fn resume_runs(&self, session: SessionId, runs: &[RunId]) -> Result<()> {
        let Some(coordinator) = &self.bundle.coordinator else {
            return Ok(());
        };
        let dialog = self
            .dialog_ledgers
            .get(&self.store, session, self.config.max_cost_usd_per_dialog)
            .await?;
        for run in runs {
            coordinator.resume_run(session, *run, Some(Arc::clone(&dialog)));
        }
        Ok(())
    }

    /// Resumes `turn`, whose approvals are all decided: runs the approved
    /// calls (each at most once), commits their results and the denials,
    /// then runs a continuation turn so the model goes on.
    pub(super) async fn resume_approved(
        self: &Arc<Self>,
        session: SessionId,
        shared: &Arc<WorkerShared>,
        turn: TurnId,
    ) -> Result<()> {
        let records = self.store.unsettled_approvals(session, turn).await?;
        if records.is_empty() {
            return Ok(());
        }
        {
            let entry = self.session(session).await?;
            let mut guard = entry.lock().await;
            self.fresh(&mut guard).await?;
            let agent = self.bundle.session_agent(guard.record.agent_id.as_ref())?;
            let mut results = Vec::with_capacity(records.len());
            let ctx = ToolExecutionContext {
                session_id: Some(session),
                turn_id: Some(turn),
                run_id: None,
                origin: TurnOrigin::User,
                cancellation: CancellationToken::new(),
                extensions: Default::default(),
            };
            for a in &records {
                // Marked started before it runs: a crash never runs it twice.
                let started = a.status == ApprovalStatus::Approved
                    && self
                        .store
                        .begin_approved_execution(a.id, clock::now_ms())
                        .await?;
                results.push(
                    decided_result(&self.bundle.agent_loop, &agent.tools, &ctx, a, started).await,
                );
            }
            let ids = records.iter().map(|a| a.id).collect();
            guard
                .commit_approval_results(&self.store, results, ids, None)
                .await?;
        }
        let turn_id = TurnId::new();
        let span = trace::turn_span(session, turn_id, TurnOrigin::AgentContinuation);
        let end = self
            .run_turn(
                session,
                shared,
                turn_id,
                TurnOrigin::AgentContinuation,
                Vec::new(),
                CancellationToken::new(),
                None,
                false,
            )
            .instrument(span)
            .await;
        if let Err(e) = &end.result {
            tracing::info!(session_id = %session, error = %e, "the turn after an approval failed; the tool results are in the history");
        }
        drop(end.done);
        Ok(())
    }
}
