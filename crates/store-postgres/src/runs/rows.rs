//! How runs and groups map to rows of `agent_runs` and `agent_run_groups`.

use keel_core::{Delivery, GroupId, RunId, Usage};
use keel_store::{GroupRecord, NewGroup, NewRun, Result, RunRecord, StoreError};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::store::Tx;

use crate::store::from_pg;
use crate::util::{non_negative, parse, parse_opt, to_i64};

const RUN_COLUMNS: &str = "id, group_id, root_session_id, root_turn_id, parent_run_id, \
    caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, \
    provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, task, \
    context_json, budget_json, signal_contract_json, signal_delivery, completion_delivery, \
    failure_delivery, status, result, error, prompt_tokens, completion_tokens, cost, \
    tool_calls_count, iterations, runtime_generation, attempt, completion_slot_reserved, \
    deadline_at, revision, started_at, finished_at, created_at, updated_at";

pub(super) fn u32_col(what: &str, v: i64) -> Result<u32> {
    u32::try_from(v).map_err(|_| StoreError::corrupt(what, format!("out of range: {v}")))
}

pub(super) fn bool_col(what: &str, v: i64) -> Result<bool> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(StoreError::corrupt(what, format!("not a boolean: {v}"))),
    }
}

fn run_from_row(r: &Row) -> Result<RunRecord> {
    let s = |i: usize| -> String { r.get(i) };
    let prompt: Option<i64> = r.get(27);
    let completion: Option<i64> = r.get(28);
    let usage = match (prompt, completion) {
        (None, None) => None,
        (p, c) => Some(Usage::new(
            non_negative("agent_runs.prompt_tokens", p.unwrap_or(0))?,
            non_negative("agent_runs.completion_tokens", c.unwrap_or(0))?,
        )),
    };
    let spec = NewRun {
        id: parse("agent_runs.id", &s(0))?,
        root_session_id: parse("agent_runs.root_session_id", &s(2))?,
        root_turn_id: parse_opt("agent_runs.root_turn_id", r.get(3))?,
        parent_run_id: parse_opt("agent_runs.parent_run_id", r.get(4))?,
        caller_agent_id: parse("agent_runs.caller_agent_id", &s(5))?,
        caller_scope_id: s(6),
        idempotency_key: r.get(7),
        agent_id: parse("agent_runs.agent_id", &s(8))?,
        definition_hash: s(9),
        provider_profile: s(10),
        provider_name: s(11),
        model_id: s(12),
        mode: parse("agent_runs.mode", &s(13))?,
        depth: u32_col("agent_runs.depth", r.get(14))?,
        plan_item_id: r.get(15),
        execution_id: s(16),
        task: s(17),
        context_json: r.get(18),
        budget_json: s(19),
        signal_contract_json: r.get(20),
        signal_delivery: parse_opt("agent_runs.signal_delivery", r.get(21))?,
        completion_delivery: parse_opt("agent_runs.completion_delivery", r.get(22))?,
        failure_delivery: parse_opt("agent_runs.failure_delivery", r.get(23))?,
        runtime_generation: non_negative("agent_runs.runtime_generation", r.get(32))?,
        deadline_at_ms: r.get(35),
    };
    Ok(RunRecord {
        spec,
        group_id: parse_opt("agent_runs.group_id", r.get(1))?,
        status: parse("agent_runs.status", &s(24))?,
        // Stored as plain text: PostgreSQL compresses large values itself.
        result: r.get(25),
        error: r.get(26),
        usage,
        cost: r.get(29),
        tool_calls_count: u32_col("agent_runs.tool_calls_count", r.get(30))?,
        iterations: u32_col("agent_runs.iterations", r.get(31))?,
        attempt: u32_col("agent_runs.attempt", r.get(33))?,
        completion_slot_reserved: bool_col("agent_runs.completion_slot_reserved", r.get(34))?,
        revision: non_negative("agent_runs.revision", r.get(36))?,
        started_at_ms: r.get(37),
        finished_at_ms: r.get(38),
        created_at_ms: r.get(39),
        updated_at_ms: r.get(40),
    })
}

const GROUP_COLUMNS: &str =
    "id, root_session_id, caller_run_id, caller_scope_id, idempotency_key, \
    mode, completion_policy, expected_runs, terminal_runs, abnormal_runs, \
    completion_slot_reserved, completion_delivery, failure_delivery, deadline_at, status, \
    runtime_generation, revision, created_at, updated_at, finished_at";

fn group_from_row(r: &Row) -> Result<GroupRecord> {
    let s = |i: usize| -> String { r.get(i) };
    let spec = NewGroup {
        id: parse("agent_run_groups.id", &s(0))?,
        root_session_id: parse("agent_run_groups.root_session_id", &s(1))?,
        caller_run_id: parse_opt("agent_run_groups.caller_run_id", r.get(2))?,
        caller_scope_id: s(3),
        idempotency_key: r.get(4),
        mode: parse("agent_run_groups.mode", &s(5))?,
        completion_policy: parse("agent_run_groups.completion_policy", &s(6))?,
        completion_delivery: parse_opt("agent_run_groups.completion_delivery", r.get(11))?,
        failure_delivery: parse_opt("agent_run_groups.failure_delivery", r.get(12))?,
        deadline_at_ms: r.get(13),
        runtime_generation: non_negative("agent_run_groups.runtime_generation", r.get(15))?,
    };
    Ok(GroupRecord {
        spec,
        expected_runs: u32_col("agent_run_groups.expected_runs", r.get(7))?,
        terminal_runs: u32_col("agent_run_groups.terminal_runs", r.get(8))?,
        abnormal_runs: u32_col("agent_run_groups.abnormal_runs", r.get(9))?,
        completion_slot_reserved: bool_col("agent_run_groups.completion_slot_reserved", r.get(10))?,
        status: parse("agent_run_groups.status", &s(14))?,
        revision: non_negative("agent_run_groups.revision", r.get(16))?,
        created_at_ms: r.get(17),
        updated_at_ms: r.get(18),
        finished_at_ms: r.get(19),
    })
}

/// The runs `where_sql` (a `WHERE …`/`ORDER BY …` tail over `agent_runs`) selects.
pub(crate) async fn query_runs(
    tx: &Tx<'_>,
    where_sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<RunRecord>> {
    tx.query(
        &format!("SELECT {RUN_COLUMNS} FROM agent_runs {where_sql}"),
        params,
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(run_from_row)
    .collect()
}

/// The groups `where_sql` selects.
pub(super) async fn query_groups(
    tx: &Tx<'_>,
    where_sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<GroupRecord>> {
    tx.query(
        &format!("SELECT {GROUP_COLUMNS} FROM agent_run_groups {where_sql}"),
        params,
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(group_from_row)
    .collect()
}

pub(crate) async fn get_run_tx(tx: &Tx<'_>, id: &RunId) -> Result<Option<RunRecord>> {
    Ok(query_runs(tx, "WHERE id = $1", &[&id.to_string()])
        .await?
        .pop())
}

pub(super) async fn require_run(tx: &Tx<'_>, id: &RunId) -> Result<RunRecord> {
    get_run_tx(tx, id)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("run {id}")))
}

pub(super) async fn get_group_tx(tx: &Tx<'_>, id: &GroupId) -> Result<Option<GroupRecord>> {
    Ok(query_groups(tx, "WHERE id = $1", &[&id.to_string()])
        .await?
        .pop())
}

pub(super) async fn require_group(tx: &Tx<'_>, id: &GroupId) -> Result<GroupRecord> {
    get_group_tx(tx, id)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("group {id}")))
}

pub(super) fn delivery_text(d: Option<Delivery>) -> Option<&'static str> {
    d.map(Delivery::as_str)
}

pub(super) async fn insert_run_row(
    tx: &Tx<'_>,
    run: &NewRun,
    group: Option<&GroupId>,
    idempotency_key: Option<&str>,
    reserved: bool,
    revision: i64,
    now_ms: i64,
) -> Result<()> {
    tx.execute(
        "INSERT INTO agent_runs (id, group_id, root_session_id, root_turn_id, parent_run_id, \
         caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, \
         provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, \
         task, context_json, budget_json, signal_contract_json, signal_delivery, \
         completion_delivery, failure_delivery, status, runtime_generation, \
         completion_slot_reserved, deadline_at, revision, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, \
         $18, $19, $20, $21, $22, $23, $24, 'queued', $25, $26, $27, $28, $29, $29)",
        &[
            &run.id.to_string(),
            &group.map(|g| g.to_string()),
            &run.root_session_id.to_string(),
            &run.root_turn_id.map(|t| t.to_string()),
            &run.parent_run_id.map(|p| p.to_string()),
            &run.caller_agent_id.as_str(),
            &run.caller_scope_id,
            &idempotency_key,
            &run.agent_id.as_str(),
            &run.definition_hash,
            &run.provider_profile,
            &run.provider_name,
            &run.model_id,
            &run.mode.as_str(),
            &i64::from(run.depth),
            &run.plan_item_id,
            &run.execution_id,
            &run.task,
            &run.context_json,
            &run.budget_json,
            &run.signal_contract_json,
            &delivery_text(run.signal_delivery),
            &delivery_text(run.completion_delivery),
            &delivery_text(run.failure_delivery),
            &to_i64("runtime_generation", run.runtime_generation)?,
            &i64::from(reserved),
            &run.deadline_at_ms,
            &revision,
            &now_ms,
        ],
    )
    .await
    .map_err(from_pg)?;
    Ok(())
}
