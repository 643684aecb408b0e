//! A run's life after acceptance: transitions owned by its execution, the
//! terminal commit that converts its completion slot, and cancellation.

use crate::store::Tx;
use keel_core::{
    CompletionPolicy, Delivery, EventId, ExecutionMode, GroupId, RunId, RunStatus, SessionId, Usd,
};
use keel_store::{
    AcceptGroup, AcceptRun, AcceptedGroup, AcceptedRun, CallSpan, CancelReport, CompletionHandling,
    EventType, GroupRecord, GroupStatus, Result, RunRecord, ScopeKind, StoreError, TerminalCommit,
    TerminalOutcome,
};

use super::rows::{
    delivery_text, insert_run_row, query_groups, query_runs, require_group, require_run,
};
use super::NONTERMINAL_RUN;
use crate::counters::{adjust_counters, next_revision, usage_tx, Revisions};
use crate::inbox::{insert_event_tx, NewEventRow};
use crate::store::from_pg;
use crate::util::{parse, saturating_i64, to_i64};
use crate::PgStore;

async fn accept_run_tx(tx: &Tx<'_>, req: &AcceptRun) -> Result<AcceptedRun> {
    let run = &req.run;
    if let Some(key) = &run.idempotency_key {
        let existing = query_runs(
            tx,
            "WHERE root_session_id = $1 AND caller_scope_id = $2 AND idempotency_key = $3",
            &[&run.root_session_id.to_string(), &run.caller_scope_id, key],
        )
        .await?;
        if let Some(existing) = existing.into_iter().next() {
            return Ok(AcceptedRun {
                run: existing,
                existing: true,
            });
        }
    }
    let reserve = run.mode == ExecutionMode::Background;
    let root = &run.root_session_id;
    if reserve {
        adjust_counters(tx, root, 0, 1, Some(req.inbox_capacity), req.now_ms).await?;
    }
    let revision = next_revision(tx, root, req.now_ms).await?;
    insert_run_row(
        tx,
        run,
        None,
        run.idempotency_key.as_deref(),
        reserve,
        revision,
        req.now_ms,
    )
    .await?;
    Ok(AcceptedRun {
        run: require_run(tx, &run.id).await?,
        existing: false,
    })
}

async fn accept_group_tx(tx: &Tx<'_>, req: &AcceptGroup) -> Result<AcceptedGroup> {
    let g = &req.group;
    if req.runs.is_empty() {
        return Err(StoreError::InvalidInput(
            "a group needs at least one run".into(),
        ));
    }
    if let Some(r) = req
        .runs
        .iter()
        .find(|r| r.root_session_id != g.root_session_id)
    {
        return Err(StoreError::InvalidInput(format!(
            "run {} belongs to another root session than its group",
            r.id
        )));
    }
    if let Some(key) = &g.idempotency_key {
        let existing = query_groups(
            tx,
            "WHERE root_session_id = $1 AND caller_scope_id = $2 AND idempotency_key = $3",
            &[&g.root_session_id.to_string(), &g.caller_scope_id, key],
        )
        .await?;
        if let Some(group) = existing.into_iter().next() {
            let runs = query_runs(
                tx,
                "WHERE group_id = $1 ORDER BY row_order",
                &[&group.spec.id.to_string()],
            )
            .await?;
            return Ok(AcceptedGroup {
                group,
                runs,
                existing: true,
            });
        }
    }
    let background = g.mode == ExecutionMode::Background;
    let group_slot = background && g.completion_policy == CompletionPolicy::All;
    let run_slot = background && g.completion_policy == CompletionPolicy::Each;
    let slots = if group_slot {
        1
    } else if run_slot {
        i64::try_from(req.runs.len()).unwrap_or(i64::MAX)
    } else {
        0
    };
    let root = &g.root_session_id;
    if slots > 0 {
        adjust_counters(tx, root, 0, slots, Some(req.inbox_capacity), req.now_ms).await?;
    }
    let revision = next_revision(tx, root, req.now_ms).await?;
    tx.execute(
        "INSERT INTO agent_run_groups (id, root_session_id, caller_run_id, caller_scope_id, \
         idempotency_key, mode, completion_policy, expected_runs, completion_slot_reserved, \
         completion_delivery, failure_delivery, deadline_at, status, runtime_generation, \
         revision, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'queued', $13, $14, $15, $15)",
        &[
            &g.id.to_string(),
            &root.to_string(),
            &g.caller_run_id.map(|r| r.to_string()),
            &g.caller_scope_id,
            &g.idempotency_key,
            &g.mode.as_str(),
            &g.completion_policy.as_str(),
            &i64::try_from(req.runs.len()).unwrap_or(i64::MAX),
            &i64::from(group_slot),
            &delivery_text(g.completion_delivery),
            &delivery_text(g.failure_delivery),
            &g.deadline_at_ms,
            &to_i64("runtime_generation", g.runtime_generation)?,
            &revision,
            &req.now_ms,
        ],
    )
    .await
    .map_err(from_pg)?;
    for run in &req.runs {
        // Batch children carry no key: the group's key makes the retry idempotent.
        insert_run_row(tx, run, Some(&g.id), None, run_slot, revision, req.now_ms).await?;
    }
    Ok(AcceptedGroup {
        group: require_group(tx, &g.id).await?,
        runs: query_runs(
            tx,
            "WHERE group_id = $1 ORDER BY row_order",
            &[&g.id.to_string()],
        )
        .await?,
        existing: false,
    })
}

/// Moves a run from one of `from` to `to` if `execution_id` still owns it.
async fn transition_tx(
    tx: &Tx<'_>,
    run_id: &RunId,
    execution_id: &str,
    from: &[RunStatus],
    to: RunStatus,
    now_ms: i64,
) -> Result<bool> {
    let run = require_run(tx, run_id).await?;
    if run.spec.execution_id != execution_id || !from.contains(&run.status) {
        return Ok(false);
    }
    let revision = next_revision(tx, &run.spec.root_session_id, now_ms).await?;
    let n = tx
        .execute(
            "UPDATE agent_runs SET status = $1, revision = $2, updated_at = $3, \
             started_at = coalesce(started_at, $3) \
             WHERE id = $4 AND execution_id = $5 AND status = $6",
            &[
                &to.as_str(),
                &revision,
                &now_ms,
                &run_id.to_string(),
                &execution_id,
                &run.status.as_str(),
            ],
        )
        .await
        .map_err(from_pg)?;
    if n == 1 && to == RunStatus::Running {
        if let Some(g) = run.group_id {
            tx.execute(
                "UPDATE agent_run_groups SET status = 'running', revision = $1, updated_at = $2 \
                 WHERE id = $3 AND status = 'queued'",
                &[&revision, &now_ms, &g.to_string()],
            )
            .await
            .map_err(from_pg)?;
        }
    }
    Ok(n == 1)
}

fn completion_payload(run: &RunRecord, outcome: &TerminalOutcome) -> String {
    let (result, error) = match outcome {
        TerminalOutcome::Completed { result, .. } => (Some(result.as_str()), None),
        TerminalOutcome::Failed { error, .. } => (None, Some(error.clone())),
        TerminalOutcome::TimedOut { deadline_at_ms } => (
            None,
            Some(format!("timed out at deadline {deadline_at_ms}")),
        ),
        TerminalOutcome::Cancelled { reason } => (None, Some(format!("cancelled: {reason}"))),
        TerminalOutcome::Interrupted { reason } => (None, Some(format!("interrupted: {reason}"))),
        TerminalOutcome::BudgetExhausted { error, .. } => (None, Some(error.clone())),
    };
    serde_json::json!({
        "run_id": run.spec.id,
        "agent_id": run.spec.agent_id,
        "status": outcome.status().as_str(),
        "result": result,
        "error": error,
    })
    .to_string()
}

/// Inserts the completion event for a reservation being converted, and moves the counters.
#[allow(clippy::too_many_arguments)]
async fn convert_reservation(
    tx: &Tx<'_>,
    root: &SessionId,
    scope: ScopeKind,
    scope_id: &str,
    event_type: EventType,
    delivery: Delivery,
    payload_json: String,
    handling: CompletionHandling,
    revision: i64,
    now_ms: i64,
) -> Result<Option<EventId>> {
    if handling == CompletionHandling::Release {
        adjust_counters(tx, root, 0, -1, None, now_ms).await?;
        return Ok(None);
    }
    let quiet = handling == CompletionHandling::Quiet;
    let id = insert_event_tx(
        tx,
        &NewEventRow {
            root_session_id: *root,
            scope,
            scope_id,
            event_type,
            event_key: "completion",
            delivery,
            requires_continuation: !quiet,
            severity: None,
            payload_json: &payload_json,
            consumed: quiet,
            revision,
            now_ms,
        },
    )
    .await?;
    adjust_counters(tx, root, if quiet { 0 } else { 1 }, -1, None, now_ms).await?;
    Ok(Some(id))
}

/// The terminal transition and everything only its winner may do.
pub(super) async fn terminal_tx(
    tx: &Tx<'_>,
    run: &RunRecord,
    outcome: &TerminalOutcome,
    handling: CompletionHandling,
    now_ms: i64,
    revisions: &mut Revisions,
    webhook_urls: &[String],
) -> Result<TerminalCommit> {
    if run.status.is_terminal() {
        return Ok(TerminalCommit {
            won: false,
            run: run.clone(),
            event_id: None,
            finished_group: None,
        });
    }
    let status = outcome.status();
    let (result, error, usage, tool_calls, iterations) = match outcome {
        TerminalOutcome::Completed {
            result,
            usage,
            tool_calls,
            iterations,
            ..
        } => (
            Some(result.clone()),
            None,
            Some(*usage),
            *tool_calls,
            *iterations,
        ),
        TerminalOutcome::Failed { error, usage } => (None, Some(error.clone()), *usage, 0, 0),
        TerminalOutcome::TimedOut { deadline_at_ms } => (
            None,
            Some(format!("timed out at deadline {deadline_at_ms}")),
            None,
            0,
            0,
        ),
        TerminalOutcome::Cancelled { reason } => (None, Some(reason.clone()), None, 0, 0),
        TerminalOutcome::Interrupted { reason } => (None, Some(reason.clone()), None, 0, 0),
        TerminalOutcome::BudgetExhausted { error, usage, .. } => {
            (None, Some(error.clone()), Some(*usage), 0, 0)
        }
    };
    let cost = match outcome {
        TerminalOutcome::BudgetExhausted { cost, .. } | TerminalOutcome::Completed { cost, .. } => {
            cost.map(Usd::get)
        }
        _ => None,
    };
    let root = &run.spec.root_session_id;
    let revision = revisions.of(tx, root, now_ms).await?;
    let n = tx
        .execute(
            &format!(
                "UPDATE agent_runs SET status = $1, result = $2, error = $3, \
                 prompt_tokens = coalesce($4, prompt_tokens), \
                 completion_tokens = coalesce($5, completion_tokens), cost = coalesce($12, cost), \
                 tool_calls_count = GREATEST(tool_calls_count, $6), \
                 iterations = GREATEST(iterations, $7), \
                 completion_slot_reserved = 0, revision = $8, finished_at = $9, updated_at = $9 \
                 WHERE id = $10 AND execution_id = $11 AND status IN {NONTERMINAL_RUN}"
            ),
            &[
                &status.as_str(),
                &result,
                &error,
                &usage.map(|u| saturating_i64(u.prompt_tokens)),
                &usage.map(|u| saturating_i64(u.completion_tokens)),
                &i64::from(tool_calls),
                &i64::from(iterations),
                &revision,
                &now_ms,
                &run.spec.id.to_string(),
                &run.spec.execution_id,
                &cost,
            ],
        )
        .await
        .map_err(from_pg)?;
    if n != 1 {
        return Err(StoreError::Stale(format!(
            "run {} changed during its terminal commit",
            run.spec.id
        )));
    }
    super::end_run_approvals_tx(tx, &run.spec.id, revision, now_ms).await?;
    crate::webhooks::run_deliveries_tx(
        tx,
        run,
        status.as_str(),
        result.as_deref(),
        error.as_deref(),
        now_ms,
        webhook_urls,
    )
    .await?;
    let ok = status == RunStatus::Completed;
    let mut event_id = None;
    if run.completion_slot_reserved {
        let delivery = if ok {
            run.spec.completion_delivery
        } else {
            run.spec.failure_delivery.or(run.spec.completion_delivery)
        }
        .unwrap_or(Delivery::Queue);
        event_id = convert_reservation(
            tx,
            root,
            ScopeKind::Run,
            &run.spec.id.to_string(),
            EventType::Completion,
            delivery,
            completion_payload(run, outcome),
            handling,
            revision,
            now_ms,
        )
        .await?;
    }
    let mut finished_group = None;
    if let Some(gid) = run.group_id {
        tx.execute(
            "UPDATE agent_run_groups SET terminal_runs = terminal_runs + 1, \
             abnormal_runs = abnormal_runs + $1, revision = $2, updated_at = $3 WHERE id = $4",
            &[&i64::from(!ok), &revision, &now_ms, &gid.to_string()],
        )
        .await
        .map_err(from_pg)?;
        let group = require_group(tx, &gid).await?;
        if group.terminal_runs == group.expected_runs && !group.status.is_terminal() {
            let (finished, group_event) =
                finish_group(tx, &group, handling, revision, now_ms).await?;
            event_id = event_id.or(group_event);
            finished_group = Some(finished);
        }
    }
    Ok(TerminalCommit {
        won: true,
        run: require_run(tx, &run.spec.id).await?,
        event_id,
        finished_group,
    })
}

/// Final status of a group from its runs' statuses.
async fn group_final_status(tx: &Tx<'_>, group: &GroupId) -> Result<GroupStatus> {
    let statuses = tx
        .query(
            "SELECT status FROM agent_runs WHERE group_id = $1",
            &[&group.to_string()],
        )
        .await
        .map_err(from_pg)?
        .iter()
        .map(|r| parse::<RunStatus>("agent_runs.status", r.get(0)))
        .collect::<Result<Vec<_>>>()?;
    let all = |s: RunStatus| statuses.iter().all(|x| *x == s);
    Ok(if all(RunStatus::Completed) {
        GroupStatus::Completed
    } else if statuses.contains(&RunStatus::Completed) {
        GroupStatus::Partial
    } else if all(RunStatus::TimedOut) {
        GroupStatus::TimedOut
    } else if all(RunStatus::Cancelled) {
        GroupStatus::Cancelled
    } else if all(RunStatus::Interrupted) {
        GroupStatus::Interrupted
    } else {
        GroupStatus::Failed
    })
}

/// Marks a group whose runs all ended as finished; converts its reservation (policy `All`).
pub(super) async fn finish_group(
    tx: &Tx<'_>,
    group: &GroupRecord,
    handling: CompletionHandling,
    revision: i64,
    now_ms: i64,
) -> Result<(GroupRecord, Option<EventId>)> {
    let status = group_final_status(tx, &group.spec.id).await?;
    tx.execute(
        "UPDATE agent_run_groups SET status = $1, completion_slot_reserved = 0, finished_at = $2, \
         updated_at = $2, revision = $3 WHERE id = $4",
        &[
            &status.as_str(),
            &now_ms,
            &revision,
            &group.spec.id.to_string(),
        ],
    )
    .await
    .map_err(from_pg)?;
    let mut event_id = None;
    if group.completion_slot_reserved {
        let delivery = if status == GroupStatus::Completed {
            group.spec.completion_delivery
        } else {
            group
                .spec
                .failure_delivery
                .or(group.spec.completion_delivery)
        }
        .unwrap_or(Delivery::Queue);
        let runs = query_runs(
            tx,
            "WHERE group_id = $1 ORDER BY row_order",
            &[&group.spec.id.to_string()],
        )
        .await?;
        let payload = serde_json::json!({
            "group_id": group.spec.id,
            "status": status.as_str(),
            "runs": runs.iter().map(|r| serde_json::json!({
                "run_id": r.spec.id,
                "agent_id": r.spec.agent_id,
                "status": r.status.as_str(),
                "result": r.result,
                "error": r.error,
            })).collect::<Vec<_>>(),
        })
        .to_string();
        event_id = convert_reservation(
            tx,
            &group.spec.root_session_id,
            ScopeKind::Group,
            &group.spec.id.to_string(),
            EventType::GroupCompletion,
            delivery,
            payload,
            handling,
            revision,
            now_ms,
        )
        .await?;
    }
    Ok((require_group(tx, &group.spec.id).await?, event_id))
}

async fn commit_terminal_tx(
    tx: &Tx<'_>,
    run_id: &RunId,
    execution_id: &str,
    outcome: &TerminalOutcome,
    handling: CompletionHandling,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<TerminalCommit> {
    let run = require_run(tx, run_id).await?;
    if run.spec.execution_id != execution_id || run.status.is_terminal() {
        // A late or foreign result: dropped, the stored terminal state stands.
        return Ok(TerminalCommit {
            won: false,
            run,
            event_id: None,
            finished_group: None,
        });
    }
    let mut revisions = Revisions::default();
    let commit = terminal_tx(
        tx,
        &run,
        outcome,
        handling,
        now_ms,
        &mut revisions,
        webhook_urls,
    )
    .await?;
    if matches!(outcome, TerminalOutcome::Cancelled { .. }) {
        // A cancelled run's pending signals are no longer news.
        crate::inbox::supersede_run_signals_tx(tx, run_id, now_ms, &mut revisions).await?;
    }
    Ok(commit)
}

async fn cancel_session_tx(
    tx: &Tx<'_>,
    root: &SessionId,
    reason: &str,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<CancelReport> {
    let mut report = CancelReport::default();
    let runs = query_runs(
        tx,
        &format!("WHERE root_session_id = $1 AND status IN {NONTERMINAL_RUN} ORDER BY row_order"),
        &[&root.to_string()],
    )
    .await?;
    let outcome = TerminalOutcome::Cancelled {
        reason: reason.to_owned(),
    };
    let mut revisions = Revisions::default();
    for run in runs {
        // Re-read: finishing a group above may not touch this run, but be exact.
        let run = require_run(tx, &run.spec.id).await?;
        if run.status.is_terminal() {
            continue;
        }
        let before = usage_tx(tx, root).await?.reserved_completion_slots;
        let commit = terminal_tx(
            tx,
            &run,
            &outcome,
            CompletionHandling::Release,
            now_ms,
            &mut revisions,
            webhook_urls,
        )
        .await?;
        let after = usage_tx(tx, root).await?.reserved_completion_slots;
        report.reservations_released += before.saturating_sub(after);
        if commit.finished_group.is_some() {
            report.groups_cancelled += 1;
        }
        report.runs_cancelled.push(run.spec.id);
    }
    let revision = revisions.of(tx, root, now_ms).await?;
    report.events_dead_lettered =
        crate::inbox::dead_letter_session_tx(tx, root, reason, revision, now_ms).await?;
    Ok(report)
}

impl PgStore {
    pub(crate) async fn accept_run(&self, request: AcceptRun) -> Result<AcceptedRun> {
        self.write(move |tx| {
            let request = request.clone();
            Box::pin(async move { accept_run_tx(tx, &request).await })
        })
        .await
    }

    pub(crate) async fn accept_agent_group(&self, request: AcceptGroup) -> Result<AcceptedGroup> {
        self.write(move |tx| {
            let request = request.clone();
            Box::pin(async move { accept_group_tx(tx, &request).await })
        })
        .await
    }

    pub(crate) async fn mark_run_running(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        self.write(move |tx| {
            let execution_id = execution_id.clone();
            Box::pin(async move {
                transition_tx(
                    tx,
                    &run_id,
                    &execution_id,
                    &[RunStatus::Queued, RunStatus::WaitingChildren],
                    RunStatus::Running,
                    now_ms,
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn mark_run_waiting_children(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        self.write(move |tx| {
            let execution_id = execution_id.clone();
            Box::pin(async move {
                transition_tx(
                    tx,
                    &run_id,
                    &execution_id,
                    &[RunStatus::Running],
                    RunStatus::WaitingChildren,
                    now_ms,
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn commit_terminal(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
    ) -> Result<TerminalCommit> {
        self.commit_run_end(run_id, execution_id, outcome, handling, now_ms, Vec::new())
            .await
    }

    pub(crate) async fn commit_run_end(
        &self,
        run_id: RunId,
        execution_id: String,
        outcome: TerminalOutcome,
        handling: CompletionHandling,
        now_ms: i64,
        calls: Vec<CallSpan>,
    ) -> Result<TerminalCommit> {
        let urls = self.inner.hooks.urls();
        let commit = self
            .write(move |tx| {
                let (execution_id, outcome, urls, calls) = (
                    execution_id.clone(),
                    outcome.clone(),
                    urls.clone(),
                    calls.clone(),
                );
                Box::pin(async move {
                    let commit = commit_terminal_tx(
                        tx,
                        &run_id,
                        &execution_id,
                        &outcome,
                        handling,
                        now_ms,
                        &urls,
                    )
                    .await?;
                    if commit.won {
                        crate::calls::insert_run_calls_tx(
                            tx,
                            &commit.run.spec.root_session_id,
                            run_id,
                            &calls,
                        )
                        .await?;
                    }
                    Ok(commit)
                })
            })
            .await?;
        if commit.won {
            // A background run of a hooked turn has a delivery now.
            self.inner.hooks.wake();
        }
        Ok(commit)
    }

    pub(crate) async fn cancel_session(
        &self,
        root_session_id: SessionId,
        reason: String,
        now_ms: i64,
    ) -> Result<CancelReport> {
        let urls = self.inner.hooks.urls();
        let report = self
            .write(move |tx| {
                let (reason, urls) = (reason.clone(), urls.clone());
                Box::pin(async move {
                    cancel_session_tx(tx, &root_session_id, &reason, now_ms, &urls).await
                })
            })
            .await?;
        // Cancelled background runs of a hooked turn have deliveries now.
        self.inner.hooks.wake();
        Ok(report)
    }
}
