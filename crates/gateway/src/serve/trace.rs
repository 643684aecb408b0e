//! The trace of a turn or a run: the tree of its model calls, tool calls
//! and sub-agent runs with their times, tokens and status, built from the
//! stored runs and call spans alone (so it works with telemetry off). The
//! wire types of `GET /api/agent-runs/{id}/trace` and
//! `GET /api/dialogs/{id}/turns/{turn_id}/trace`, and the tree `keel trace`
//! prints.
//!
//! What the store does not hold is not invented: the calls are those the
//! turn's or run's commit stored (at most `keel_store::MAX_CALL_SPANS`
//! each; none for a run whose loop failed); a sub-agent run is a child of
//! the turn or run that started it, not of the delegate call (the run does
//! not store that call's id).

use std::collections::HashMap;

use keel_core::{RunId, TurnId};
use keel_store::{CallKind, CallSpan, RunRecord};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::api::{RunMode, RunStatus, Timestamp, TokenUsage};

/// Longest task shown on a span, in bytes.
pub const TASK_PREVIEW_BYTES: usize = 200;

/// The trace of one turn or run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Trace {
    /// The turn or run traced, its runs below it.
    pub root: TraceSpan,
    /// Runs in the trace (the root included when it is a run).
    pub runs: usize,
    /// Model and tool calls stored in the trace, at every depth.
    pub calls: usize,
    /// Tokens of every run in the trace, and of a traced turn's own model calls.
    pub usage: TokenUsage,
}

/// What a span stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// A root turn of a dialog.
    Turn,
    /// A sub-agent run.
    Run,
    /// A model call of the turn or run above it.
    Model,
    /// A tool call of the turn or run above it.
    Tool,
}

/// One turn or run of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TraceSpan {
    /// Turn, run, model call or tool call.
    pub kind: SpanKind,
    /// The turn's or run's id; for a call, its owner's.
    pub id: Uuid,
    /// The agent (`root` for a turn), the model, or the tool.
    pub name: String,
    /// A tool call's id.
    pub call_id: Option<String>,
    /// A call's outcome: `ok` or `error` for a tool call, the finish
    /// reason for a model call.
    pub outcome: Option<String>,
    /// The root turn a run belongs to (the turn itself for a turn span).
    pub turn_id: Option<Uuid>,
    /// A run's status (`null` for a turn: its outcome is not stored by id).
    pub status: Option<RunStatus>,
    /// A run's mode.
    pub mode: Option<RunMode>,
    /// A run's provider profile and model (`profile/model`).
    pub model: Option<String>,
    /// When it was created: a run's acceptance; a turn's acknowledgement
    /// (its id is time-ordered and says when).
    pub created_at: Timestamp,
    /// When a run or call started (`null` while a run is queued); a turn's
    /// first stored call's start.
    pub started_at: Option<Timestamp>,
    /// When a run or call ended (`null` while a run runs); a turn's last
    /// stored call's end.
    pub finished_at: Option<Timestamp>,
    /// `finished_at - started_at` in milliseconds, when both are known.
    pub duration_ms: Option<i64>,
    /// A run's or model call's tokens, once known; a turn's own model calls'.
    pub usage: Option<TokenUsage>,
    /// A run's model calls; a turn's stored ones.
    pub model_calls: Option<u32>,
    /// A run's tool calls; a turn's stored ones.
    pub tool_calls: Option<u32>,
    /// A run's task, its first 200 bytes (`TASK_PREVIEW_BYTES`).
    pub task: Option<String>,
    /// Why a run did not complete.
    pub error: Option<String>,
    /// Its calls and the runs it started, in the order they started.
    #[schema(no_recursion)]
    pub children: Vec<TraceSpan>,
}

fn run_span(r: &RunRecord) -> TraceSpan {
    let duration_ms = match (r.started_at_ms, r.finished_at_ms) {
        (Some(s), Some(f)) => Some(f.saturating_sub(s).max(0)),
        _ => None,
    };
    TraceSpan {
        kind: SpanKind::Run,
        id: r.spec.id.as_uuid(),
        name: r.spec.agent_id.as_str().to_owned(),
        call_id: None,
        outcome: None,
        turn_id: r.spec.root_turn_id.map(|t| t.as_uuid()),
        status: Some(r.status.into()),
        mode: Some(r.spec.mode.into()),
        model: Some(format!("{}/{}", r.spec.provider_profile, r.spec.model_id)),
        created_at: Timestamp(r.created_at_ms),
        started_at: r.started_at_ms.map(Timestamp),
        finished_at: r.finished_at_ms.map(Timestamp),
        duration_ms,
        usage: r.usage.map(TokenUsage::from),
        model_calls: Some(r.iterations),
        tool_calls: Some(r.tool_calls_count),
        task: Some(keel_core::truncate_with_note(
            r.spec.task.clone(),
            TASK_PREVIEW_BYTES,
        )),
        error: r.error.clone(),
        children: Vec::new(),
    }
}

/// The stored calls of each run, by run id (`Store::runs_calls`).
pub type RunCalls = HashMap<RunId, Vec<CallSpan>>;

fn call_span(owner: Uuid, turn: Option<Uuid>, c: &CallSpan) -> TraceSpan {
    let usage = match (c.kind, c.input_tokens, c.output_tokens) {
        (CallKind::Model, i, o) if i.is_some() || o.is_some() => {
            Some(keel_core::Usage::new(i.unwrap_or(0), o.unwrap_or(0)).into())
        }
        _ => None,
    };
    TraceSpan {
        kind: match c.kind {
            CallKind::Model => SpanKind::Model,
            CallKind::Tool => SpanKind::Tool,
        },
        id: owner,
        name: c.name.clone(),
        call_id: c.call_id.clone(),
        outcome: Some(c.status.clone()),
        turn_id: turn,
        status: None,
        mode: None,
        model: None,
        created_at: Timestamp(c.started_at_ms),
        started_at: Some(Timestamp(c.started_at_ms)),
        finished_at: Some(Timestamp(c.ended_at_ms)),
        duration_ms: Some(c.ended_at_ms.saturating_sub(c.started_at_ms).max(0)),
        usage,
        model_calls: None,
        tool_calls: None,
        task: None,
        error: None,
        children: Vec::new(),
    }
}

/// The children of each run id among `runs` (and, under `None`, the runs
/// whose parent is not among them), each list oldest first.
fn nest(runs: &[RunRecord]) -> HashMap<Option<RunId>, Vec<&RunRecord>> {
    let ids: std::collections::HashSet<RunId> = runs.iter().map(|r| r.spec.id).collect();
    let mut children: HashMap<Option<RunId>, Vec<&RunRecord>> = HashMap::new();
    for r in runs {
        let parent = r.spec.parent_run_id.filter(|p| ids.contains(p));
        children.entry(parent).or_default().push(r);
    }
    for list in children.values_mut() {
        list.sort_by_key(|r| (r.created_at_ms, r.spec.id));
    }
    children
}

/// When a child span began, for ordering siblings: a call's start, a
/// run's acceptance.
fn begins(span: &TraceSpan) -> i64 {
    match span.kind {
        SpanKind::Model | SpanKind::Tool => span.started_at.map_or(span.created_at.0, |t| t.0),
        SpanKind::Turn | SpanKind::Run => span.created_at.0,
    }
}

/// Puts `span`'s calls `calls` and the runs below `id` under it, in the
/// order they began (a stable sort: calls before a run accepted at the
/// same millisecond).
fn attach(
    span: &mut TraceSpan,
    id: Option<RunId>,
    calls: &[CallSpan],
    children: &HashMap<Option<RunId>, Vec<&RunRecord>>,
    run_calls: &RunCalls,
) {
    let owner = span.id;
    let turn = span.turn_id;
    span.children
        .extend(calls.iter().map(|c| call_span(owner, turn, c)));
    for child in children.get(&id).into_iter().flatten() {
        let mut s = run_span(child);
        let own = run_calls.get(&child.spec.id).map_or(&[][..], Vec::as_slice);
        attach(&mut s, Some(child.spec.id), own, children, run_calls);
        span.children.push(s);
    }
    span.children.sort_by_key(begins);
}

fn total(runs: &[RunRecord], turn_calls: &[CallSpan]) -> TokenUsage {
    let mut usage = keel_core::Usage::default();
    for r in runs.iter().filter_map(|r| r.usage) {
        usage.add(r);
    }
    usage.add(calls_usage(turn_calls));
    usage.into()
}

fn calls_usage(calls: &[CallSpan]) -> keel_core::Usage {
    let mut usage = keel_core::Usage::default();
    for c in calls {
        usage.add(keel_core::Usage::new(
            c.input_tokens.unwrap_or(0),
            c.output_tokens.unwrap_or(0),
        ));
    }
    usage
}

fn count_calls(run_calls: &RunCalls, turn_calls: &[CallSpan]) -> usize {
    run_calls.values().map(Vec::len).sum::<usize>() + turn_calls.len()
}

/// The trace of run `id` from its stored tree (`Store::run_tree`: the run
/// and its descendants) and their calls; `None` when the run is not among
/// them.
pub fn run_trace(id: RunId, runs: &[RunRecord], run_calls: &RunCalls) -> Option<Trace> {
    let root = runs.iter().find(|r| r.spec.id == id)?;
    let children = nest(runs);
    let mut span = run_span(root);
    let own = run_calls.get(&id).map_or(&[][..], Vec::as_slice);
    attach(&mut span, Some(id), own, &children, run_calls);
    Some(Trace {
        root: span,
        runs: runs.len(),
        calls: count_calls(run_calls, &[]),
        usage: total(runs, &[]),
    })
}

/// The trace of root turn `turn` from its own stored calls and the runs it
/// started (`Store::turn_runs`), at any depth, with theirs.
pub fn turn_trace(
    turn: TurnId,
    calls: &[CallSpan],
    runs: &[RunRecord],
    run_calls: &RunCalls,
) -> Trace {
    let children = nest(runs);
    let created_ms = turn_created_ms(turn);
    let started = calls.iter().map(|c| c.started_at_ms).min();
    let finished = calls.iter().map(|c| c.ended_at_ms).max();
    let count = |kind: CallKind| {
        let n = calls.iter().filter(|c| c.kind == kind).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    };
    let mut span = TraceSpan {
        kind: SpanKind::Turn,
        id: turn.as_uuid(),
        name: "root".to_owned(),
        call_id: None,
        outcome: None,
        turn_id: Some(turn.as_uuid()),
        status: None,
        mode: None,
        model: None,
        created_at: Timestamp(created_ms),
        started_at: started.map(Timestamp),
        finished_at: finished.map(Timestamp),
        duration_ms: started
            .zip(finished)
            .map(|(s, f)| f.saturating_sub(s).max(0)),
        usage: (!calls.is_empty()).then(|| calls_usage(calls).into()),
        model_calls: (!calls.is_empty()).then(|| count(CallKind::Model)),
        tool_calls: (!calls.is_empty()).then(|| count(CallKind::Tool)),
        task: None,
        error: None,
        children: Vec::new(),
    };
    attach(&mut span, None, calls, &children, run_calls);
    Trace {
        root: span,
        runs: runs.len(),
        calls: count_calls(run_calls, calls),
        usage: total(runs, calls),
    }
}

/// When a turn was acknowledged: the millisecond timestamp of its UUID v7.
fn turn_created_ms(turn: TurnId) -> i64 {
    turn.as_uuid().get_timestamp().map_or(0, |t| {
        let (secs, nanos) = t.to_unix();
        i64::try_from(secs)
            .unwrap_or(i64::MAX / 1000)
            .saturating_mul(1000)
            .saturating_add(i64::from(nanos / 1_000_000))
    })
}
