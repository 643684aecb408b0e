//! Runs brought in with an imported dialog: every run of a root session
//! read whole, and terminal runs written back as rows of a new session.

use crate::store::Tx;
use keel_core::SessionId;
use keel_store::{NewSession, Result, RunRecord, StoreError};

use super::rows::{delivery_text, query_runs};
use crate::store::from_pg;
use crate::util::to_i64;
use crate::PgStore;

/// Writes `run` (already given its new ids, parents first) as a terminal row
/// of its root session: it holds no completion slot, belongs to no group and
/// no runtime generation's recovery ever picks it up.
async fn insert_imported_run_tx(tx: &Tx<'_>, run: &RunRecord, revision: i64) -> Result<()> {
    if !run.status.is_terminal() {
        return Err(StoreError::InvalidInput(format!(
            "an imported run must have ended, and run {} is {}",
            run.spec.id, run.status
        )));
    }
    let spec = &run.spec;
    tx.execute(
        "INSERT INTO agent_runs (id, group_id, root_session_id, root_turn_id, parent_run_id, \
         caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, \
         provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, \
         task, context_json, budget_json, signal_contract_json, signal_delivery, \
         completion_delivery, failure_delivery, status, result, error, prompt_tokens, \
         completion_tokens, cost, tool_calls_count, iterations, runtime_generation, attempt, \
         completion_slot_reserved, deadline_at, revision, started_at, finished_at, created_at, \
         updated_at) \
         VALUES ($1, NULL, $2, NULL, $3, $4, $5, NULL, $6, $7, $8, $9, $10, $11, $12, $13, $14, \
         $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, \
         0, $32, $33, $34, $35, $36, $37)",
        &[
            &spec.id.to_string(),
            &spec.root_session_id.to_string(),
            &spec.parent_run_id.map(|p| p.to_string()),
            &spec.caller_agent_id.as_str(),
            &spec.caller_scope_id,
            &spec.agent_id.as_str(),
            &spec.definition_hash,
            &spec.provider_profile,
            &spec.provider_name,
            &spec.model_id,
            &spec.mode.as_str(),
            &i64::from(spec.depth),
            &spec.plan_item_id,
            &spec.execution_id,
            &spec.task,
            &spec.context_json,
            &spec.budget_json,
            &spec.signal_contract_json,
            &delivery_text(spec.signal_delivery),
            &delivery_text(spec.completion_delivery),
            &delivery_text(spec.failure_delivery),
            &run.status.as_str(),
            &run.result,
            &run.error,
            &run.usage
                .map(|u| to_i64("prompt_tokens", u.prompt_tokens))
                .transpose()?,
            &run.usage
                .map(|u| to_i64("completion_tokens", u.completion_tokens))
                .transpose()?,
            &run.cost,
            &i64::from(run.tool_calls_count),
            &i64::from(run.iterations),
            &to_i64("runtime_generation", spec.runtime_generation)?,
            &i64::from(run.attempt),
            &spec.deadline_at_ms,
            &revision,
            &run.started_at_ms,
            &run.finished_at_ms,
            &run.created_at_ms,
            &run.updated_at_ms,
        ],
    )
    .await
    .map_err(from_pg)?;
    Ok(())
}

/// Writes the ended `runs` of imported session `session` (parents first),
/// all under one new client revision.
pub(crate) async fn import_runs_tx(
    tx: &Tx<'_>,
    session: &NewSession,
    runs: &[RunRecord],
) -> Result<()> {
    if let Some(bad) = runs.iter().find(|r| r.spec.root_session_id != session.id) {
        return Err(StoreError::Conflict(format!(
            "imported run {} belongs to session {}, not {}",
            bad.spec.id, bad.spec.root_session_id, session.id
        )));
    }
    if runs.is_empty() {
        return Ok(());
    }
    let revision = crate::counters::next_revision(tx, &session.id, session.now_ms).await?;
    for run in runs {
        insert_imported_run_tx(tx, run, revision).await?;
    }
    Ok(())
}

impl PgStore {
    pub(crate) async fn session_runs(&self, root: SessionId) -> Result<Vec<RunRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                query_runs(
                    tx,
                    "WHERE root_session_id = $1 ORDER BY depth, created_at, id",
                    &[&root.to_string()],
                )
                .await
            })
        })
        .await
    }
}
