//! `keel trace TURN_OR_RUN_ID`: the tree of a run (its calls and the runs
//! below it) or of a root turn (its calls and the runs it started), with
//! offsets, durations, tokens, call outcomes and status — the trace view of the web page in the
//! terminal, from the stored runs. It only reads and takes no lock, so it
//! works while `keel serve` runs.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;

use keel_core::{RunId, TurnId};
use keel_store::Store;

use crate::config::Config;
use crate::error::{AppError, Result};
use crate::serve::trace::{run_trace, turn_trace, SpanKind, Trace, TraceSpan};
use crate::storage::Location;
use crate::terminal::neutralize;

/// Runs `keel trace ID`: prints the trace of run `id`, or else of turn `id`.
pub async fn run(
    config_file: Option<&Path>,
    data_dir: Option<&Path>,
    id: &str,
) -> Result<ExitCode> {
    let uuid: uuid::Uuid = id
        .trim()
        .parse()
        .map_err(|_| AppError::InvalidInput(format!("{id:?} is not a turn or run id (a UUID)")))?;
    let loaded = Config::load(config_file, data_dir)?;
    let store = Location::existing(&loaded.config)?
        .open(&loaded.config)
        .await?;
    let trace = find(&store, uuid).await?.ok_or_else(|| {
        AppError::InvalidInput(format!(
            "no run {uuid} and no call or run of a turn {uuid} is stored"
        ))
    })?;
    print!("{}", render(&trace));
    Ok(ExitCode::SUCCESS)
}

/// The trace of run `id`, or else of the root turn `id`.
async fn find(store: &Store, id: uuid::Uuid) -> Result<Option<Trace>> {
    let run = RunId::from(id);
    let tree = store.run_tree(run).await?;
    if !tree.is_empty() {
        let calls = store
            .runs_calls(tree.iter().map(|r| r.spec.id).collect())
            .await?;
        return Ok(run_trace(run, &tree, &calls));
    }
    let turn = TurnId::from(id);
    let calls = store.turn_calls(None, turn).await?;
    let runs = store.turn_runs(None, turn).await?;
    if runs.is_empty() && calls.is_empty() {
        return Ok(None);
    }
    let run_calls = store
        .runs_calls(runs.iter().map(|r| r.spec.id).collect())
        .await?;
    Ok(Some(turn_trace(turn, &calls, &runs, &run_calls)))
}

/// The tree as `keel trace` prints it: one line per span, offsets from the
/// root's creation, names passed through [`neutralize`].
pub fn render(trace: &Trace) -> String {
    let mut out = String::new();
    let origin = trace.root.created_at.0;
    out.push_str(&line(&trace.root, origin));
    out.push('\n');
    children(&mut out, &trace.root.children, "", origin);
    let _ = writeln!(
        out,
        "{} run(s), {} call(s), {} tokens in / {} out",
        trace.runs, trace.calls, trace.usage.prompt_tokens, trace.usage.completion_tokens
    );
    out
}

fn children(out: &mut String, spans: &[TraceSpan], prefix: &str, origin: i64) {
    for (i, span) in spans.iter().enumerate() {
        let last = i + 1 == spans.len();
        let _ = writeln!(
            out,
            "{prefix}{} {}",
            if last { "└─" } else { "├─" },
            line(span, origin)
        );
        let deeper = format!("{prefix}{}", if last { "   " } else { "│  " });
        children(out, &span.children, &deeper, origin);
    }
}

fn word<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn line(span: &TraceSpan, origin: i64) -> String {
    let mut s = match span.kind {
        SpanKind::Turn => format!("turn {} {}", span.id, neutralize(&span.name)),
        SpanKind::Run => format!("run {} {}", span.id, neutralize(&span.name)),
        SpanKind::Model => format!("model {}", neutralize(&span.name)),
        SpanKind::Tool => format!(
            "tool {} {}",
            neutralize(&span.name),
            neutralize(span.call_id.as_deref().unwrap_or(""))
        ),
    };
    if let Some(outcome) = &span.outcome {
        let _ = write!(s, " {}", neutralize(outcome));
    }
    if let Some(mode) = &span.mode {
        let _ = write!(s, " {}", word(mode));
    }
    if let Some(status) = &span.status {
        let _ = write!(s, " {}", word(status));
    }
    match (&span.started_at, span.duration_ms) {
        (Some(start), Some(ms)) => {
            let _ = write!(s, " at +{} ms, {ms} ms", start.0 - origin);
        }
        (Some(start), None) => {
            let _ = write!(s, " at +{} ms, running", start.0 - origin);
        }
        (None, _) if span.kind == SpanKind::Run => s.push_str(" not started"),
        (None, _) => {}
    }
    if let Some(u) = &span.usage {
        let _ = write!(
            s,
            ", {} tokens in / {} out",
            u.prompt_tokens, u.completion_tokens
        );
    }
    if let (Some(m), Some(t)) = (span.model_calls, span.tool_calls) {
        let _ = write!(s, ", {m} model call(s), {t} tool call(s)");
    }
    if let Some(model) = &span.model {
        let _ = write!(s, " [{}]", neutralize(model));
    }
    if let Some(e) = &span.error {
        let _ = write!(s, ": {}", neutralize(e));
    }
    s
}
