//! What the engine reports to the `metrics` facade: named functions, one
//! call at each point a turn, tool call, run or gate wait ends. Without an
//! installed recorder (everything but `keel serve`) each is a no-op; the
//! engine knows no exporter. Names and labels are docs/OPERATIONS.md's.

use std::time::Duration;

use keel_core::{RunStatus, TurnOrigin};

use crate::EngineError;

/// A root turn ended: `keel_turns_total{origin, outcome}` and its latency
/// from the start on the worker (queueing not counted).
pub(crate) fn turn_ended<T>(
    origin: TurnOrigin,
    result: &Result<T, EngineError>,
    elapsed: Duration,
) {
    let outcome = match result {
        Ok(_) => "committed",
        Err(e) if e.is_cancelled() => "cancelled",
        Err(e) if e.is_timed_out() => "timed_out",
        Err(e) if e.is_budget_exhausted() => "budget_exhausted",
        Err(_) => "failed",
    };
    let origin = origin.as_str();
    metrics::counter!("keel_turns_total", "origin" => origin, "outcome" => outcome).increment(1);
    metrics::histogram!("keel_turn_duration_seconds", "origin" => origin)
        .record(elapsed.as_secs_f64());
}

/// A tool call ended: `keel_tool_calls_total{tool, outcome}`. `tool` is a
/// registered name (an unknown name the model made up counts as `unknown`,
/// so the label set stays bounded).
pub(crate) fn tool_call(tool: Option<&str>, is_error: bool) {
    let outcome = if is_error { "error" } else { "ok" };
    let tool = tool.unwrap_or("unknown").to_owned();
    metrics::counter!("keel_tool_calls_total", "tool" => tool, "outcome" => outcome).increment(1);
}

/// A sub-agent run reached a terminal status: `keel_runs_total{agent, status}`.
pub(crate) fn run_ended(agent: &str, status: RunStatus) {
    metrics::counter!("keel_runs_total", "agent" => agent.to_owned(), "status" => status.as_str())
        .increment(1);
}

/// A step or run admission found no free permit and waited `elapsed`
/// (`pool`: `runs`, `provider` or `tool`).
pub(crate) fn gate_waited(pool: &'static str, elapsed: Duration) {
    metrics::counter!("keel_gate_waits_total", "pool" => pool).increment(1);
    metrics::histogram!("keel_gate_wait_seconds", "pool" => pool).record(elapsed.as_secs_f64());
}
