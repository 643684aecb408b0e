//! A run's life after acceptance: transitions owned by its execution, the
//! terminal commit that converts its completion slot, and cancellation.

use keel_core::{
    CompletionPolicy, Delivery, EventId, ExecutionMode, GroupId, RunId, RunStatus, SessionId, Usd,
};
use rusqlite::{params, Connection};

use super::rows::{
    delivery_text, insert_run_row, query_groups, query_runs, require_group, require_run,
};
use super::types::{
    AcceptGroup, AcceptRun, AcceptedGroup, AcceptedRun, CancelReport, CompletionHandling,
    GroupRecord, GroupStatus, RunRecord, TerminalCommit, TerminalOutcome,
};
use super::NONTERMINAL_RUN;
use crate::counters::{adjust_counters, next_revision, usage_tx, Revisions};
use crate::error::{Result, StoreError};
use crate::inbox::{insert_event_tx, EventType, NewEventRow, ScopeKind};
use crate::util::{parse, saturating_i64, to_i64};
use crate::SqliteStore;

fn accept_run_tx(conn: &Connection, req: &AcceptRun) -> Result<AcceptedRun> {
    let run = &req.run;
    if let Some(key) = &run.idempotency_key {
        let existing = query_runs(
            conn,
            "WHERE root_session_id = ?1 AND caller_scope_id = ?2 AND idempotency_key = ?3",
            params![run.root_session_id.to_string(), run.caller_scope_id, key],
        )?;
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
        adjust_counters(conn, root, 0, 1, Some(req.inbox_capacity), req.now_ms)?;
    }
    let revision = next_revision(conn, root, req.now_ms)?;
    insert_run_row(
        conn,
        run,
        None,
        run.idempotency_key.as_deref(),
        reserve,
        revision,
        req.now_ms,
    )?;
    Ok(AcceptedRun {
        run: require_run(conn, &run.id)?,
        existing: false,
    })
}

fn accept_group_tx(conn: &Connection, req: &AcceptGroup) -> Result<AcceptedGroup> {
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
            conn,
            "WHERE root_session_id = ?1 AND caller_scope_id = ?2 AND idempotency_key = ?3",
            params![g.root_session_id.to_string(), g.caller_scope_id, key],
        )?;
        if let Some(group) = existing.into_iter().next() {
            let runs = query_runs(
                conn,
                "WHERE group_id = ?1 ORDER BY rowid",
                [group.spec.id.to_string()],
            )?;
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
        adjust_counters(conn, root, 0, slots, Some(req.inbox_capacity), req.now_ms)?;
    }
    let revision = next_revision(conn, root, req.now_ms)?;
    conn.execute(
        "INSERT INTO agent_run_groups (id, root_session_id, caller_run_id, caller_scope_id, \
         idempotency_key, mode, completion_policy, expected_runs, completion_slot_reserved, \
         completion_delivery, failure_delivery, deadline_at, status, runtime_generation, \
         revision, created_at, updated_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 'queued', ?13, ?14, ?15, ?15)",
        params![
            g.id.to_string(),
            root.to_string(),
            g.caller_run_id.map(|r| r.to_string()),
            g.caller_scope_id,
            g.idempotency_key,
            g.mode.as_str(),
            g.completion_policy.as_str(),
            i64::try_from(req.runs.len()).unwrap_or(i64::MAX),
            group_slot,
            delivery_text(g.completion_delivery),
            delivery_text(g.failure_delivery),
            g.deadline_at_ms,
            to_i64("runtime_generation", g.runtime_generation)?,
            revision,
            req.now_ms,
        ],
    )?;
    for run in &req.runs {
        // Batch children carry no key: the group's key makes the retry idempotent.
        insert_run_row(conn, run, Some(&g.id), None, run_slot, revision, req.now_ms)?;
    }
    Ok(AcceptedGroup {
        group: require_group(conn, &g.id)?,
        runs: query_runs(
            conn,
            "WHERE group_id = ?1 ORDER BY rowid",
            [g.id.to_string()],
        )?,
        existing: false,
    })
}

/// Moves a run from one of `from` to `to` if `execution_id` still owns it.
fn transition_tx(
    conn: &Connection,
    run_id: &RunId,
    execution_id: &str,
    from: &[RunStatus],
    to: RunStatus,
    now_ms: i64,
) -> Result<bool> {
    let run = require_run(conn, run_id)?;
    if run.spec.execution_id != execution_id || !from.contains(&run.status) {
        return Ok(false);
    }
    let revision = next_revision(conn, &run.spec.root_session_id, now_ms)?;
    let n = conn.execute(
        "UPDATE agent_runs SET status = ?1, revision = ?2, updated_at = ?3, \
         started_at = coalesce(started_at, ?3) \
         WHERE id = ?4 AND execution_id = ?5 AND status = ?6",
        params![
            to.as_str(),
            revision,
            now_ms,
            run_id.to_string(),
            execution_id,
            run.status.as_str()
        ],
    )?;
    if n == 1 && to == RunStatus::Running {
        if let Some(g) = run.group_id {
            conn.execute(
                "UPDATE agent_run_groups SET status = 'running', revision = ?1, updated_at = ?2 \
                 WHERE id = ?3 AND status = 'queued'",
                params![revision, now_ms, g.to_string()],
            )?;
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
fn convert_reservation(
    conn: &Connection,
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
        adjust_counters(conn, root, 0, -1, None, now_ms)?;
        return Ok(None);
    }
    let quiet = handling == CompletionHandling::Quiet;
    let id = insert_event_tx(
        conn,
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
    )?;
    adjust_counters(conn, root, if quiet { 0 } else { 1 }, -1, None, now_ms)?;
    Ok(Some(id))
}

/// The terminal transition and everything only its winner may do.
pub(super) fn terminal_tx(
    conn: &Connection,
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
    let revision = revisions.of(conn, root, now_ms)?;
    let n = conn
        .prepare_cached(&format!(
            "UPDATE agent_runs SET status = ?1, result = ?2, error = ?3, \
             prompt_tokens = coalesce(?4, prompt_tokens), \
             completion_tokens = coalesce(?5, completion_tokens), cost = coalesce(?12, cost), \
             tool_calls_count = max(tool_calls_count, ?6), iterations = max(iterations, ?7), \
             completion_slot_reserved = 0, revision = ?8, finished_at = ?9, updated_at = ?9 \
             WHERE id = ?10 AND execution_id = ?11 AND status IN {NONTERMINAL_RUN}"
        ))?
        .execute(params![
            status.as_str(),
            crate::compress::pack_opt(result.as_deref(), crate::compress::db_of(conn)),
            error,
            usage.map(|u| saturating_i64(u.prompt_tokens)),
            usage.map(|u| saturating_i64(u.completion_tokens)),
            tool_calls,
            iterations,
            revision,
            now_ms,
            run.spec.id.to_string(),
            run.spec.execution_id,
            cost,
        ])?;
    if n != 1 {
        return Err(StoreError::Stale(format!(
            "run {} changed during its terminal commit",
            run.spec.id
        )));
    }
    super::end_run_approvals_tx(conn, &run.spec.id, revision, now_ms)?;
    crate::webhooks::run_deliveries_tx(
        conn,
        run,
        status.as_str(),
        result.as_deref(),
        error.as_deref(),
        now_ms,
        webhook_urls,
    )?;
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
            conn,
            root,
            ScopeKind::Run,
            &run.spec.id.to_string(),
            EventType::Completion,
            delivery,
            completion_payload(run, outcome),
            handling,
            revision,
            now_ms,
        )?;
    }
    let mut finished_group = None;
    if let Some(gid) = run.group_id {
        conn.execute(
            "UPDATE agent_run_groups SET terminal_runs = terminal_runs + 1, \
             abnormal_runs = abnormal_runs + ?1, revision = ?2, updated_at = ?3 WHERE id = ?4",
            params![!ok, revision, now_ms, gid.to_string()],
        )?;
        let group = require_group(conn, &gid)?;
        if group.terminal_runs == group.expected_runs && !group.status.is_terminal() {
            let (finished, group_event) = finish_group(conn, &group, handling, revision, now_ms)?;
            event_id = event_id.or(group_event);
            finished_group = Some(finished);
        }
    }
    Ok(TerminalCommit {
        won: true,
        run: require_run(conn, &run.spec.id)?,
        event_id,
        finished_group,
    })
}

/// Final status of a group from its runs' statuses.
fn group_final_status(conn: &Connection, group: &GroupId) -> Result<GroupStatus> {
    let mut stmt = conn.prepare_cached("SELECT status FROM agent_runs WHERE group_id = ?1")?;
    let statuses = stmt
        .query_map([group.to_string()], |r| r.get::<_, String>(0))?
        .map(|s| parse::<RunStatus>("agent_runs.status", &s?))
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
pub(super) fn finish_group(
    conn: &Connection,
    group: &GroupRecord,
    handling: CompletionHandling,
    revision: i64,
    now_ms: i64,
) -> Result<(GroupRecord, Option<EventId>)> {
    let status = group_final_status(conn, &group.spec.id)?;
    conn.execute(
        "UPDATE agent_run_groups SET status = ?1, completion_slot_reserved = 0, finished_at = ?2, \
         updated_at = ?2, revision = ?3 WHERE id = ?4",
        params![status.as_str(), now_ms, revision, group.spec.id.to_string()],
    )?;
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
            conn,
            "WHERE group_id = ?1 ORDER BY rowid",
            [group.spec.id.to_string()],
        )?;
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
            conn,
            &group.spec.root_session_id,
            ScopeKind::Group,
            &group.spec.id.to_string(),
            EventType::GroupCompletion,
            delivery,
            payload,
            handling,
            revision,
            now_ms,
        )?;
    }
    Ok((require_group(conn, &group.spec.id)?, event_id))
}

fn commit_terminal_tx(
    conn: &Connection,
    run_id: &RunId,
    execution_id: &str,
    outcome: &TerminalOutcome,
    handling: CompletionHandling,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<TerminalCommit> {
    let run = require_run(conn, run_id)?;
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
        conn,
        &run,
        outcome,
        handling,
        now_ms,
        &mut revisions,
        webhook_urls,
    )?;
    if matches!(outcome, TerminalOutcome::Cancelled { .. }) {
        // A cancelled run's pending signals are no longer news.
        crate::inbox::supersede_run_signals_tx(conn, run_id, now_ms, &mut revisions)?;
    }
    Ok(commit)
}

fn cancel_session_tx(
    conn: &Connection,
    root: &SessionId,
    reason: &str,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<CancelReport> {
    let mut report = CancelReport::default();
    let runs = query_runs(
        conn,
        &format!("WHERE root_session_id = ?1 AND status IN {NONTERMINAL_RUN} ORDER BY rowid"),
        [root.to_string()],
    )?;
    let outcome = TerminalOutcome::Cancelled {
        reason: reason.to_owned(),
    };
    let mut revisions = Revisions::default();
    for run in runs {
        // Re-read: finishing a group above may not touch this run, but be exact.
        let run = require_run(conn, &run.spec.id)?;
        if run.status.is_terminal() {
            continue;
        }
        let before = usage_tx(conn, root)?.reserved_completion_slots;
        let commit = terminal_tx(
            conn,
            &run,
            &outcome,
            CompletionHandling::Release,
            now_ms,
            &mut revisions,
            webhook_urls,
        )?;
        let after = usage_tx(conn, root)?.reserved_completion_slots;
        report.reservations_released += before.saturating_sub(after);
        if commit.finished_group.is_some() {
            report.groups_cancelled += 1;
        }
        report.runs_cancelled.push(run.spec.id);
    }
    let revision = revisions.of(conn, root, now_ms)?;
    report.events_dead_lettered =
        crate::inbox::dead_letter_session_tx(conn, root, reason, revision, now_ms)?;
    Ok(report)
}

impl SqliteStore {
    pub(crate) async fn accept_run(&self, request: AcceptRun) -> Result<AcceptedRun> {
        self.db.write(move |c| accept_run_tx(c, &request)).await
    }

    pub(crate) async fn accept_agent_group(&self, request: AcceptGroup) -> Result<AcceptedGroup> {
        self.db.write(move |c| accept_group_tx(c, &request)).await
    }

    pub(crate) async fn mark_run_running(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        self.db
            .write(move |c| {
                transition_tx(
                    c,
                    &run_id,
                    &execution_id,
                    &[RunStatus::Queued, RunStatus::WaitingChildren],
                    RunStatus::Running,
                    now_ms,
                )
            })
            .await
    }

    pub(crate) async fn mark_run_waiting_children(
        &self,
        run_id: RunId,
        execution_id: String,
        now_ms: i64,
    ) -> Result<bool> {
        self.db
            .write(move |c| {
                transition_tx(
                    c,
                    &run_id,
                    &execution_id,
                    &[RunStatus::Running],
                    RunStatus::WaitingChildren,
                    now_ms,
                )
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
        calls: Vec<crate::CallSpan>,
    ) -> Result<TerminalCommit> {
        let urls = self.webhook_urls();
        let commit = self
            .db
            .write(move |c| {
                let commit = commit_terminal_tx(
                    c,
                    &run_id,
                    &execution_id,
                    &outcome,
                    handling,
                    now_ms,
                    &urls,
                )?;
                if commit.won {
                    crate::calls::insert_calls_tx(
                        c,
                        &commit.run.spec.root_session_id,
                        crate::calls::CallOwner::Run(run_id),
                        &calls,
                    )?;
                }
                failpoint!("store::commit_terminal::before_commit");
                Ok(commit)
            })
            .await?;
        failpoint!("store::commit_terminal::after_commit");
        if commit.won {
            // A background run of a hooked turn has a delivery now.
            self.wake_webhooks();
        }
        Ok(commit)
    }

    pub(crate) async fn cancel_session(
        &self,
        root_session_id: SessionId,
        reason: String,
        now_ms: i64,
    ) -> Result<CancelReport> {
        let urls = self.webhook_urls();
        let report = self
            .db
            .write(move |c| cancel_session_tx(c, &root_session_id, &reason, now_ms, &urls))
            .await?;
        // Cancelled background runs of a hooked turn have deliveries now.
        self.wake_webhooks();
        Ok(report)
    }
}
