//! The runs of a [`DialogExport`](crate::DialogExport): stored runs turned
//! into [`ExportedRun`]s, and back into terminal runs of an imported dialog.

use std::collections::HashMap;

use keel_core::{AgentId, RunId, RunStatus, SessionId};
use keel_store::{NewRun, RunRecord};

use crate::error::{EngineError, Result};
use crate::export::{ExportedModel, ExportedRun, ExportedRunTimes};

/// The error an imported run that had not ended is given.
pub(crate) const UNFINISHED_RUN_ERROR: &str = "the run had not ended when its dialog was exported";

impl ExportedRun {
    /// The exported form of a stored run.
    pub(crate) fn of(run: &RunRecord) -> Self {
        let spec = &run.spec;
        Self {
            id: spec.id.to_string(),
            parent_run_id: spec.parent_run_id.map(|p| p.to_string()),
            agent: spec.agent_id.to_string(),
            caller_agent: spec.caller_agent_id.to_string(),
            caller_scope: spec.caller_scope_id.clone(),
            task: spec.task.clone(),
            context_json: spec.context_json.clone(),
            mode: spec.mode,
            depth: spec.depth,
            status: run.status,
            result: run.result.clone(),
            error: run.error.clone(),
            usage: run.usage,
            cost: run.cost,
            tool_calls: run.tool_calls_count,
            iterations: run.iterations,
            attempt: run.attempt,
            model: ExportedModel {
                profile: spec.provider_profile.clone(),
                provider: spec.provider_name.clone(),
                model: spec.model_id.clone(),
            },
            definition_hash: spec.definition_hash.clone(),
            budget_json: spec.budget_json.clone(),
            plan_item_id: spec.plan_item_id.clone(),
            times: ExportedRunTimes {
                created_at_ms: run.created_at_ms,
                started_at_ms: run.started_at_ms,
                finished_at_ms: run.finished_at_ms,
                updated_at_ms: run.updated_at_ms,
                deadline_at_ms: spec.deadline_at_ms,
            },
        }
    }
}

fn agent(what: &str, name: &str) -> Result<AgentId> {
    AgentId::parse(name).map_err(|e| EngineError::InvalidInput(format!("{what}: {e}")))
}

/// The runs of an import as terminal runs of session `root`, with new ids
/// and parent links (and a caller scope naming a run) mapped to them,
/// parents first. A run that had not ended becomes `interrupted`.
pub(crate) fn imported_runs(runs: &[ExportedRun], root: SessionId) -> Result<Vec<RunRecord>> {
    let mut ids: HashMap<&str, RunId> = HashMap::new();
    for run in runs {
        if ids.insert(run.id.as_str(), RunId::new()).is_some() {
            return Err(EngineError::InvalidInput(format!(
                "the export has two runs with id {:?}",
                run.id
            )));
        }
    }
    let mut ordered: Vec<&ExportedRun> = runs.iter().collect();
    ordered.sort_by_key(|r| (r.depth, r.times.created_at_ms));
    ordered
        .into_iter()
        .map(|run| imported_run(run, root, &ids))
        .collect()
}

fn imported_run(
    run: &ExportedRun,
    root: SessionId,
    ids: &HashMap<&str, RunId>,
) -> Result<RunRecord> {
    let parent_run_id = run
        .parent_run_id
        .as_deref()
        .map(|p| {
            ids.get(p).copied().ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "run {:?} names parent run {p:?}, which the export does not hold",
                    run.id
                ))
            })
        })
        .transpose()?;
    let caller_scope_id = ids
        .get(run.caller_scope.as_str())
        .map_or_else(|| run.caller_scope.clone(), ToString::to_string);
    let ended = run.status.is_terminal();
    let status = if ended {
        run.status
    } else {
        RunStatus::Interrupted
    };
    let error = match (&run.error, ended) {
        (None, false) => Some(UNFINISHED_RUN_ERROR.to_owned()),
        (error, _) => error.clone(),
    };
    let times = &run.times;
    Ok(RunRecord {
        spec: NewRun {
            id: ids[run.id.as_str()],
            root_session_id: root,
            root_turn_id: None,
            parent_run_id,
            caller_agent_id: agent("a run's caller agent", &run.caller_agent)?,
            caller_scope_id,
            idempotency_key: None,
            agent_id: agent("a run's agent", &run.agent)?,
            definition_hash: run.definition_hash.clone(),
            provider_profile: run.model.profile.clone(),
            provider_name: run.model.provider.clone(),
            model_id: run.model.model.clone(),
            mode: run.mode,
            depth: run.depth.max(1),
            plan_item_id: run.plan_item_id.clone(),
            execution_id: format!("import-{}", RunId::new()),
            task: run.task.clone(),
            context_json: run.context_json.clone(),
            budget_json: run.budget_json.clone(),
            signal_contract_json: None,
            signal_delivery: None,
            completion_delivery: None,
            failure_delivery: None,
            runtime_generation: 0,
            deadline_at_ms: times.deadline_at_ms,
        },
        group_id: None,
        status,
        result: run.result.clone(),
        error,
        usage: run.usage,
        cost: run.cost,
        tool_calls_count: run.tool_calls,
        iterations: run.iterations,
        attempt: run.attempt,
        completion_slot_reserved: false,
        revision: 0,
        started_at_ms: times.started_at_ms,
        finished_at_ms: times.finished_at_ms.or(Some(times.updated_at_ms)),
        created_at_ms: times.created_at_ms,
        updated_at_ms: times.updated_at_ms,
    })
}
