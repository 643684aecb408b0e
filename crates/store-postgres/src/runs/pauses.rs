//! Background runs waiting for a person (schema v13): the pause commit (what
//! the run did so far, one pending approval per gated call), the hand-over
//! to a new execution once every approval is decided, and the settling of a
//! run's approvals when it ends any other way.

use crate::store::Tx;
use keel_core::{Message, RunId, RunStatus, SessionId, Usage};
use keel_store::{ApprovalStatus, PausedRunCommit, Result, ResumedRun, RunRecord, StoreError};

use super::rows::{query_runs, require_run};
use crate::approvals::query as query_approvals;
use crate::counters::next_revision;
use crate::store::from_pg;
use crate::util::to_i64;
use crate::PgStore;

fn u32_col(what: &str, v: i64) -> Result<u32> {
    u32::try_from(v).map_err(|_| StoreError::corrupt(what, v))
}

async fn commit_paused_tx(tx: &Tx<'_>, p: &PausedRunCommit, messages: &str) -> Result<bool> {
    let run = require_run(tx, &p.run_id).await?;
    if run.spec.execution_id != p.execution_id || run.status != RunStatus::Running {
        return Ok(false);
    }
    let session = run.spec.root_session_id;
    let revision = next_revision(tx, &session, p.now_ms).await?;
    let n = tx
        .execute(
            "UPDATE agent_runs SET status = 'waiting_approval', revision = $1, updated_at = $2 \
             WHERE id = $3 AND execution_id = $4 AND status = 'running'",
            &[&revision, &p.now_ms, &p.run_id.to_string(), &p.execution_id],
        )
        .await
        .map_err(from_pg)?;
    if n != 1 {
        return Ok(false);
    }
    tx.execute(
        "INSERT INTO agent_run_pauses (run_id, session_id, messages, prompt_tokens, \
         completion_tokens, iterations, tool_calls, remaining_ms, paused_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        &[
            &p.run_id.to_string(),
            &session.to_string(),
            &messages,
            &to_i64("prompt tokens", p.usage.prompt_tokens)?,
            &to_i64("completion tokens", p.usage.completion_tokens)?,
            &i64::from(p.iterations),
            &i64::from(p.tool_calls),
            &p.remaining_ms.max(0),
            &p.now_ms,
        ],
    )
    .await
    .map_err(from_pg)?;
    let insert =
        "INSERT INTO tool_approvals (id, session_id, turn_id, run_id, agent_id, tool_call_id, \
             tool_name, arguments, status, revision, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', $9, $10, $11)";
    for a in &p.approvals {
        tx.execute(
            insert,
            &[
                &a.id.to_string(),
                &session.to_string(),
                &p.turn_id.to_string(),
                &p.run_id.to_string(),
                &a.agent_id.as_str(),
                &a.call.id,
                &a.call.name,
                &a.call.arguments.to_string(),
                &revision,
                &p.now_ms,
                &a.expires_at_ms,
            ],
        )
        .await
        .map_err(from_pg)?;
    }
    crate::calls::insert_run_calls_tx(tx, &session, p.run_id, &p.calls).await?;
    Ok(true)
}

async fn resume_tx(
    tx: &Tx<'_>,
    run_id: &RunId,
    execution_id: &str,
    generation: i64,
    now_ms: i64,
) -> Result<Option<ResumedRun>> {
    let run = require_run(tx, run_id).await?;
    if run.status != RunStatus::WaitingApproval {
        return Ok(None);
    }
    let approvals = query_approvals(
        tx,
        "WHERE run_id = $1 AND settled_at IS NULL ORDER BY created_at, id",
        &[&run_id.to_string()],
    )
    .await?;
    if approvals
        .iter()
        .any(|a| a.status == ApprovalStatus::Pending)
    {
        return Ok(None);
    }
    let pause = tx
        .query_opt(
            "SELECT messages, prompt_tokens, completion_tokens, iterations, tool_calls, remaining_ms \
             FROM agent_run_pauses WHERE run_id = $1",
            &[&run_id.to_string()],
        )
        .await
        .map_err(from_pg)?
        .ok_or_else(|| StoreError::corrupt("agent_run_pauses.run_id", run_id.to_string()))?;
    let messages: String = pause.get(0);
    let (prompt, completion): (i64, i64) = (pause.get(1), pause.get(2));
    let (iterations, tool_calls, remaining): (i64, i64, i64) =
        (pause.get(3), pause.get(4), pause.get(5));
    let messages: Vec<Message> = serde_json::from_str(&messages)
        .map_err(|e| StoreError::corrupt("agent_run_pauses.messages", e.to_string()))?;
    let revision = next_revision(tx, &run.spec.root_session_id, now_ms).await?;
    tx.execute(
        "UPDATE agent_runs SET status = 'running', execution_id = $1, runtime_generation = $2, \
         deadline_at = $3, revision = $4, updated_at = $5 \
         WHERE id = $6 AND status = 'waiting_approval'",
        &[
            &execution_id,
            &generation,
            &now_ms.saturating_add(remaining),
            &revision,
            &now_ms,
            &run_id.to_string(),
        ],
    )
    .await
    .map_err(from_pg)?;
    let mut started = Vec::new();
    for a in &approvals {
        let fresh = a.status == ApprovalStatus::Approved && a.executing_at_ms.is_none();
        if fresh {
            started.push(a.id);
        }
        tx.execute(
            "UPDATE tool_approvals SET settled_at = $1, revision = $2, \
             executing_at = CASE WHEN $3::boolean THEN $1 ELSE executing_at END WHERE id = $4",
            &[&now_ms, &revision, &fresh, &a.id.to_string()],
        )
        .await
        .map_err(from_pg)?;
    }
    tx.execute(
        "DELETE FROM agent_run_pauses WHERE run_id = $1",
        &[&run_id.to_string()],
    )
    .await
    .map_err(from_pg)?;
    let approvals = query_approvals(
        tx,
        "WHERE run_id = $1 AND revision = $2 ORDER BY created_at, id",
        &[&run_id.to_string(), &revision],
    )
    .await?;
    let tree_runs: i64 = tx
        .query_one(
            "SELECT count(*) FROM agent_runs WHERE root_session_id = $1 \
             AND root_turn_id IS NOT DISTINCT FROM $2",
            &[
                &run.spec.root_session_id.to_string(),
                &run.spec.root_turn_id.map(|t| t.to_string()),
            ],
        )
        .await
        .map_err(from_pg)?
        .get(0);
    Ok(Some(ResumedRun {
        tree_runs: u32_col("tree runs", tree_runs)?,
        run: require_run(tx, run_id).await?,
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
pub(crate) async fn end_run_approvals_tx(
    tx: &Tx<'_>,
    run_id: &RunId,
    revision: i64,
    now_ms: i64,
) -> Result<()> {
    tx.execute(
        "UPDATE tool_approvals SET status = CASE status WHEN 'pending' THEN 'superseded' ELSE status END, \
         reason = CASE status WHEN 'pending' THEN 'the run ended before a decision' ELSE reason END, \
         decided_at = coalesce(decided_at, $1), settled_at = $1, revision = $2 \
         WHERE run_id = $3 AND settled_at IS NULL",
        &[&now_ms, &revision, &run_id.to_string()],
    )
    .await
    .map_err(from_pg)?;
    tx.execute(
        "DELETE FROM agent_run_pauses WHERE run_id = $1",
        &[&run_id.to_string()],
    )
    .await
    .map_err(from_pg)?;
    Ok(())
}

impl PgStore {
    pub(crate) async fn commit_paused_run(&self, commit: PausedRunCommit) -> Result<bool> {
        if commit.approvals.is_empty() {
            return Err(StoreError::InvalidInput(
                "a paused run has at least one approval".into(),
            ));
        }
        let messages = serde_json::to_string(&commit.messages)
            .map_err(|e| StoreError::InvalidInput(format!("run messages: {e}")))?;
        self.write(move |tx| {
            let (commit, messages) = (commit.clone(), messages.clone());
            Box::pin(async move { commit_paused_tx(tx, &commit, &messages).await })
        })
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
        self.write(move |tx| {
            let execution_id = execution_id.clone();
            Box::pin(async move { resume_tx(tx, &run_id, &execution_id, generation, now_ms).await })
        })
        .await
    }

    pub(crate) async fn waiting_runs(&self, session_id: SessionId) -> Result<Vec<RunRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                query_runs(
                    tx,
                    "WHERE root_session_id = $1 AND status = 'waiting_approval' ORDER BY row_order",
                    &[&session_id.to_string()],
                )
                .await
            })
        })
        .await
    }
}
