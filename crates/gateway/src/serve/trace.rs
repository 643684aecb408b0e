//! The trace of a turn or a run: the tree of its sub-agent runs with their
//! times, tokens, model and tool call counts and status, built from the
//! stored runs alone (so it works with telemetry off). The wire types of
//! `GET /api/agent-runs/{id}/trace` and `GET /api/dialogs/{id}/turns/{turn_id}/trace`,
//! and the tree `keel trace` prints.
//!
//! What the store does not hold is not invented: a root turn's own model
//! and tool calls are not stored one by one (only their messages, stamped
//! at the turn's commit), nor are a run's; a span says how many it made.

use std::collections::HashMap;

use keel_core::{RunId, TurnId};
use keel_store::RunRecord;
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
    /// Tokens of every run in the trace.
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
}

/// One turn or run of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TraceSpan {
    /// Turn or run.
    pub kind: SpanKind,
    /// The turn's or run's id.
    pub id: Uuid,
    /// The agent (`root` for a turn).
    pub name: String,
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
    /// When a run started executing (`null` while queued, and for a turn).
    pub started_at: Option<Timestamp>,
    /// When a run ended (`null` while it runs, and for a turn).
    pub finished_at: Option<Timestamp>,
    /// `finished_at - started_at` in milliseconds, when both are known.
    pub duration_ms: Option<i64>,
    /// A run's tokens, once known.
    pub usage: Option<TokenUsage>,
    /// A run's model calls.
    pub model_calls: Option<u32>,
    /// A run's tool calls.
    pub tool_calls: Option<u32>,
    /// A run's task, its first 200 bytes (`TASK_PREVIEW_BYTES`).
    pub task: Option<String>,
    /// Why a run did not complete.
    pub error: Option<String>,
    /// The runs it started, oldest first.
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

fn attach(span: &mut TraceSpan, id: RunId, children: &HashMap<Option<RunId>, Vec<&RunRecord>>) {
    for child in children.get(&Some(id)).into_iter().flatten() {
        let mut s = run_span(child);
        attach(&mut s, child.spec.id, children);
        span.children.push(s);
    }
}

fn total(runs: &[RunRecord]) -> TokenUsage {
    let mut usage = keel_core::Usage::default();
    for r in runs.iter().filter_map(|r| r.usage) {
        usage.add(r);
    }
    usage.into()
}

/// The trace of run `id` from its stored tree (`Store::run_tree`: the run
/// and its descendants); `None` when the run is not among them.
pub fn run_trace(id: RunId, runs: &[RunRecord]) -> Option<Trace> {
    let root = runs.iter().find(|r| r.spec.id == id)?;
    let children = nest(runs);
    let mut span = run_span(root);
    attach(&mut span, id, &children);
    Some(Trace {
        root: span,
        runs: runs.len(),
        usage: total(runs),
    })
}

/// The trace of root turn `turn` from the runs it started
/// (`Store::turn_runs`), at any depth.
pub fn turn_trace(turn: TurnId, runs: &[RunRecord]) -> Trace {
    let children = nest(runs);
    let created_ms = turn_created_ms(turn);
    let mut span = TraceSpan {
        kind: SpanKind::Turn,
        id: turn.as_uuid(),
        name: "root".to_owned(),
        turn_id: Some(turn.as_uuid()),
        status: None,
        mode: None,
        model: None,
        created_at: Timestamp(created_ms),
        started_at: None,
        finished_at: None,
        duration_ms: None,
        usage: None,
        model_calls: None,
        tool_calls: None,
        task: None,
        error: None,
        children: Vec::new(),
    };
    for top in children.get(&None).into_iter().flatten() {
        let mut s = run_span(top);
        attach(&mut s, top.spec.id, &children);
        span.children.push(s);
    }
    Trace {
        root: span,
        runs: runs.len(),
        usage: total(runs),
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
