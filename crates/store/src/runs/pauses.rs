//! Background runs waiting for a person (schema v13).
//!
//! A background run whose model called a tool that needs approval commits
//! what it did so far — its conversation, spend and the time it had left —
//! with one pending approval per gated call, and becomes `waiting_approval`
//! ([`Backend::commit_paused_run`](crate::Backend::commit_paused_run)); its runner then ends, so it holds no
//! permit while it waits, and a restart leaves it waiting. Once every one of
//! its approvals is decided, [`Backend::resume_paused_run`](crate::Backend::resume_paused_run) hands it to a new
//! execution: running again, its deadline renewed by what was left, its
//! approvals taken up (an approved call marked as started: it runs at most
//! once), the pause row gone. A run that ends any other way supersedes its
//! approvals still pending (see `terminal_tx`).

use keel_core::{Message, RunId, RunStatus, SessionId, TurnId, Usage};
use rusqlite::{params, Connection, OptionalExtension};

use super::rows::{query_runs, require_run};
use super::types::RunRecord;
use crate::approvals::{query as query_approvals, ApprovalRecord, NewApproval};
use crate::counters::next_revision;
use crate::error::{Result, StoreError};
use crate::util::to_i64;
use crate::SqliteStore;

/// A background run that paused for approval: what it did so far, and its
/// gated calls.
#[derive(Debug, Clone, PartialEq)]
pub struct PausedRunCommit {
    /// The run.
    pub run_id: RunId,
    /// The execution that owns it (the commit is refused for another).
    pub execution_id: String,
    /// The root turn whose tree the run belongs to (its approvals' turn).
    pub turn_id: TurnId,
    /// Its conversation after the system prompt, up to and including the
    /// results of the calls that ran.
    pub messages: Vec<Message>,
    /// What its model calls spent so far.
    pub usage: Usage,
    /// Its model calls so far.
    pub iterations: u32,
    /// Its tool calls so far.
    pub tool_calls: u32,
    /// How long it had left before its deadline (ms).
    pub remaining_ms: i64,
    /// One per gated call.
    pub approvals: Vec<NewApproval>,
    /// Its model and tool calls so far (at most [`crate::MAX_CALL_SPANS`]).
    pub calls: Vec<crate::CallSpan>,
    /// Now (Unix ms).
    pub now_ms: i64,
}

/// A paused run handed to a new execution by [`Backend::resume_paused_run`](crate::Backend::resume_paused_run).
#[derive(Debug, Clone, PartialEq)]
pub struct ResumedRun {
    /// The run as stored after the hand-over (running, new execution id and
    /// deadline).
    pub run: RunRecord,
    /// Its conversation when it paused.
    pub messages: Vec<Message>,
    /// What it had spent.
    pub usage: Usage,
    /// Its model calls before the pause.
    pub iterations: u32,
    /// Its tool calls before the pause.
    pub tool_calls: u32,
    /// Its approvals, decided, oldest first; an approved one is marked as
    /// started (`executing_at_ms`) unless a crash left it started before
    /// (then it must not run).
    pub approvals: Vec<ApprovalRecord>,
    /// The ids of the approved calls this hand-over started (the others
    /// among the approved were started by an execution that died).
    pub started: Vec<keel_core::ApprovalId>,
    /// How many runs its delegation tree (its root turn's) holds.
    pub tree_runs: u32,
}

fn u32_col(what: &str, v: i64) -> Result<u32> {
    u32::try_from(v).map_err(|_| StoreError::corrupt(what, v))
}

fn commit_paused_tx(c: &Connection, p: &PausedRunCommit, messages: &str) -> Result<bool> {
    let run = require_run(c, &p.run_id)?;
    if run.spec.execution_id != p.execution_id || run.status != RunStatus::Running {
        return Ok(false);
    }
    let session = run.spec.root_session_id;
    let revision = next_revision(c, &session, p.now_ms)?;
    let n = c.execute(
        "UPDATE agent_runs SET status = 'waiting_approval', revision = ?1, updated_at = ?2 \
         WHERE id = ?3 AND execution_id = ?4 AND status = 'running'",
        params![revision, p.now_ms, p.run_id.to_string(), p.execution_id],
    )?;
    if n != 1 {
        return Ok(false);
    }
    c.execute(
        "INSERT INTO agent_run_pauses (run_id, session_id, messages, prompt_tokens, \
         completion_tokens, iterations, tool_calls, remaining_ms, paused_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            p.run_id.to_string(),
            session.to_string(),
            messages,
            to_i64("prompt tokens", p.usage.prompt_tokens)?,
            to_i64("completion tokens", p.usage.completion_tokens)?,
            p.iterations,
            p.tool_calls,
            p.remaining_ms.max(0),
            p.now_ms
        ],
    )?;
    let mut stmt = c.prepare_cached(
        "INSERT INTO tool_approvals (id, session_id, turn_id, run_id, agent_id, tool_call_id, \
         tool_name, arguments, status, revision, created_at, expires_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 'pending', ?9, ?10, ?11)",
    )?;
    for a in &p.approvals {
        stmt.execute(params![
            a.id.to_string(),
            session.to_string(),
            p.turn_id.to_string(),
            p.run_id.to_string(),
            a.agent_id.as_str(),
            a.call.id,
            a.call.name,
            a.call.arguments.to_string(),
            revision,
            p.now_ms,
            a.expires_at_ms
        ])?;
    }
    crate::calls::insert_calls_tx(
        c,
        &session,
        crate::calls::CallOwner::Run(p.run_id),
        &p.calls,
    )?;
    Ok(true)
}

fn resume_tx(
    c: &Connection,
    run_id: &RunId,
    execution_id: &str,
    generation: i64,
    now_ms: i64,
) -> Result<Option<ResumedRun>> {
    let run = require_run(c, run_id)?;
    if run.status != RunStatus::WaitingApproval {
        return Ok(None);
    }
    let approvals = query_approvals(
        c,
        "WHERE run_id = ?1 AND settled_at IS NULL ORDER BY created_at, id",
        [run_id.to_string()],
    )?;
    if approvals
        .iter()
        .any(|a| a.status == crate::ApprovalStatus::Pending)
    {
        return Ok(None);
    }
    let pause = c
        .query_row(
            "SELECT messages, prompt_tokens, completion_tokens, iterations, tool_calls, remaining_ms \
             FROM agent_run_pauses WHERE run_id = ?1",
            [run_id.to_string()],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, i64>(5)?,
                ))
            },
        )
        .optional()?
        .ok_or_else(|| StoreError::corrupt("agent_run_pauses.run_id", run_id.to_string()))?;
    let (messages, prompt, completion, iterations, tool_calls, remaining) = pause;
    let messages: Vec<Message> = serde_json::from_str(&messages)
        .map_err(|e| StoreError::corrupt("agent_run_pauses.messages", e.to_string()))?;
    let revision = next_revision(c, &run.spec.root_session_id, now_ms)?;
    c.execute(
        "UPDATE agent_runs SET status = 'running', execution_id = ?1, runtime_generation = ?2, \
         deadline_at = ?3, revision = ?4, updated_at = ?5 \
         WHERE id = ?6 AND status = 'waiting_approval'",
        params![
            execution_id,
            generation,
            now_ms.saturating_add(remaining),
            revision,
            now_ms,
            run_id.to_string()
        ],
    )?;
    let mut started = Vec::new();
    for a in &approvals {
        let fresh = a.status == crate::ApprovalStatus::Approved && a.executing_at_ms.is_none();
        if fresh {
            started.push(a.id);
        }
        c.execute(
            "UPDATE tool_approvals SET settled_at = ?1, revision = ?2, \
             executing_at = CASE WHEN ?3 THEN ?1 ELSE executing_at END WHERE id = ?4",
            params![now_ms, revision, fresh, a.id.to_string()],
        )?;
    }
    c.execute(
        "DELETE FROM agent_run_pauses WHERE run_id = ?1",
        [run_id.to_string()],
    )?;
    let approvals = query_approvals(
        c,
        "WHERE run_id = ?1 AND revision = ?2 ORDER BY created_at, id",
        params![run_id.to_string(), revision],
    )?;
    let tree_runs: i64 = c.query_row(
        "SELECT count(*) FROM agent_runs WHERE root_session_id = ?1 AND root_turn_id IS ?2",
        params![
            run.spec.root_session_id.to_string(),
            run.spec.root_turn_id.map(|t| t.to_string())
        ],
        |r| r.get(0),
    )?;
    Ok(Some(ResumedRun {
        tree_runs: u32_col("tree runs", tree_runs)?,
        run: require_run(c, run_id)?,
        messages,
        usage: Usage::new(
            u64::try_from(prompt).map_err(|_| StoreError::corrupt("prompt_tokens", prompt))?,
            u64::try_from(completion)
                .map_err(|_| StoreError::corrupt("completion_tokens", completion))?,
        ),
        iterations: u32_col("agent_run_pauses.iterations", iterations)?,
        tool_calls: u32_col("agent_run_pauses.tool_calls", tool_calls)?,
        approvals,
        started,
    }))
}

/// When a run ends: its approvals still pending are superseded (nobody can
/// act on them any more), every unsettled one is settled, and its pause row
/// is removed.
pub(crate) fn end_run_approvals_tx(
    c: &Connection,
    run_id: &RunId,
    revision: i64,
    now_ms: i64,
) -> Result<()> {
    c.prepare_cached(
        "UPDATE tool_approvals SET status = CASE status WHEN 'pending' THEN 'superseded' ELSE status END, \
         reason = CASE status WHEN 'pending' THEN 'the run ended before a decision' ELSE reason END, \
         decided_at = coalesce(decided_at, ?1), settled_at = ?1, revision = ?2 \
         WHERE run_id = ?3 AND settled_at IS NULL",
    )?
    .execute(params![now_ms, revision, run_id.to_string()])?;
    c.prepare_cached("DELETE FROM agent_run_pauses WHERE run_id = ?1")?
        .execute([run_id.to_string()])?;
    Ok(())
}

impl SqliteStore {
    pub(crate) async fn commit_paused_run(&self, commit: PausedRunCommit) -> Result<bool> {
        if commit.approvals.is_empty() {
            return Err(StoreError::InvalidInput(
                "a paused run has at least one approval".into(),
            ));
        }
        let messages = serde_json::to_string(&commit.messages)
            .map_err(|e| StoreError::InvalidInput(format!("run messages: {e}")))?;
        self.db
            .write(move |c| commit_paused_tx(c, &commit, &messages))
            .await
    }

    pub(crate) async fn resume_paused_run(
        &self,
        run_id: RunId,
        execution_id: String,
        runtime_generation: u64,
        now_ms: i64,
    ) -> Result<Option<ResumedRun>> {
        let generation = to_i64("runtime generation", runtime_generation)?;
        self.db
            .write(move |c| resume_tx(c, &run_id, &execution_id, generation, now_ms))
            .await
    }

    pub(crate) async fn waiting_runs(&self, session_id: SessionId) -> Result<Vec<RunRecord>> {
        self.db
            .read(move |c| {
                query_runs(
                    c,
                    "WHERE root_session_id = ?1 AND status = 'waiting_approval' ORDER BY rowid",
                    [session_id.to_string()],
                )
            })
            .await
    }
}
