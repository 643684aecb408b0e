//! The spans of a turn, named and attributed after OpenTelemetry's GenAI
//! semantic conventions: `invoke_agent {agent}` for a root turn and for each
//! sub-agent run, `chat {model}` for a model call, `execute_tool {tool}` for
//! a tool call, and keel's own `await_approval {tool}` and `keel.store
//! {operation}` (a store commit).
//!
//! They are plain `tracing` spans of target [`TARGET`]; the engine exports
//! nothing (the gateway turns them into OpenTelemetry spans). When no
//! subscriber enables that target, which is the default, each span is one
//! callsite check and no field value is computed. Message content (inputs,
//! answers, tool arguments and results) is recorded only after
//! [`set_record_content`]`(true)`.
//!
//! A background run outlives the turn that started it, so it opens a trace
//! of its own, linked to the `delegate` call that started it; the
//! continuation turn that reads its result links to the run. The run's span
//! context is carried in memory (a bounded map, through the installed
//! [`SpanLinker`]): a run that ended before a restart has no span context
//! afterwards, and its continuation names it only by `keel.run.ids`.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};

use keel_core::{ApprovalId, FinishReason, RunId, SessionId, ToolCall, TurnId, TurnOrigin, Usage};
use parking_lot::Mutex;
use tracing::field::Empty;
use tracing::Span;

/// `n` as the signed integer OpenTelemetry attributes hold (tracing-opentelemetry
/// would record a `u64` as text).
pub(crate) fn int(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The `tracing` target of every span this module opens.
pub const TARGET: &str = "keel_trace";

static RECORD_CONTENT: AtomicBool = AtomicBool::new(false);
static LINKER: OnceLock<Box<dyn SpanLinker>> = OnceLock::new();

/// Records message content on spans from now on (`[telemetry]
/// record_content`); off by default.
pub fn set_record_content(on: bool) {
    RECORD_CONTENT.store(on, Ordering::Relaxed);
}

fn record_content(span: &Span) -> bool {
    !span.is_disabled() && RECORD_CONTENT.load(Ordering::Relaxed)
}

/// The span context of an ended span, kept to link to it later; opaque to
/// the engine (the [`SpanLinker`] made it).
#[derive(Clone)]
pub struct SpanHandle(pub Arc<dyn Any + Send + Sync>);

/// What the exporter knows of spans: their context, and how to link a span
/// to another that may have ended.
pub trait SpanLinker: Send + Sync + 'static {
    /// The context of `span`, when it is recorded.
    fn capture(&self, span: &Span) -> Option<SpanHandle>;
    /// Adds a link from `span` to the span `to` was captured from.
    fn link(&self, span: &Span, to: &SpanHandle);
}

/// Installs the process's linker (once; later calls are ignored and return false).
pub fn install_span_linker(linker: Box<dyn SpanLinker>) -> bool {
    LINKER.set(linker).is_ok()
}

/// Most background runs whose span context is kept for their continuation.
const KEPT_RUN_SPANS: usize = 1024;

/// The span contexts of background runs, by run, until a continuation
/// links to them (bounded: the oldest go first). Run ids are unique, so one
/// map serves every coordinator of the process.
static RUN_SPANS: LazyLock<Mutex<KeptRunSpans>> = LazyLock::new(Mutex::default);

/// Kept span contexts by run, and the runs in the order they were kept.
type KeptRunSpans = (HashMap<RunId, SpanHandle>, VecDeque<RunId>);

/// Open approval-wait spans, by approval, until each is settled.
static APPROVAL_SPANS: LazyLock<Mutex<HashMap<ApprovalId, Span>>> = LazyLock::new(Mutex::default);

/// Keeps the context of `span`, the span of background run `run`, for the
/// continuation that reads its result.
pub(crate) fn keep_run_span(run: RunId, span: &Span) {
    if span.is_disabled() {
        return;
    }
    let Some(handle) = LINKER.get().and_then(|l| l.capture(span)) else {
        return;
    };
    {
        let mut inner = RUN_SPANS.lock();
        let (map, order) = &mut *inner;
        if map.insert(run, handle).is_none() {
            order.push_back(run);
        }
        while order.len() > KEPT_RUN_SPANS {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }
}

/// Links `span` to each of `runs` whose span context is kept (and forgets them).
pub(crate) fn link_runs(span: &Span, runs: &[RunId]) {
    let Some(linker) = LINKER.get() else { return };
    if span.is_disabled() {
        return;
    }
    let mut inner = RUN_SPANS.lock();
    let (map, order) = &mut *inner;
    for run in runs {
        if let Some(handle) = map.remove(run) {
            order.retain(|r| r != run);
            linker.link(span, &handle);
        }
    }
}

/// The span of a root turn (`invoke_agent {agent}`; the agent is recorded
/// by [`record_agent`] once the turn knows its definition).
pub(crate) fn turn_span(session: SessionId, turn: TurnId, origin: TurnOrigin) -> Span {
    tracing::info_span!(
        target: TARGET,
        "invoke_agent",
        otel.name = Empty,
        otel.kind = "internal",
        otel.status_code = Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = Empty,
        gen_ai.conversation.id = %session,
        gen_ai.input.messages = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        error.type = Empty,
        keel.turn.id = %turn,
        keel.turn.origin = origin.as_str(),
        keel.run.ids = Empty,
    )
}

/// Names the current turn's or run's span after its agent.
pub(crate) fn record_agent(span: &Span, agent: &str) {
    if span.is_disabled() {
        return;
    }
    span.record("otel.name", format!("invoke_agent {agent}"));
    span.record("gen_ai.agent.name", agent);
}

/// Records the input of an `invoke_agent` span (content recording only).
pub(crate) fn record_input(span: &Span, input: &[keel_core::Message]) {
    if record_content(span) {
        let texts: Vec<String> = input.iter().map(keel_core::Message::text).collect();
        span.record("gen_ai.input.messages", texts.join("\n"));
    }
}

/// Records the task of a sub-agent run's span (content recording only).
pub(crate) fn record_input_text(span: &Span, input: &str) {
    if record_content(span) {
        span.record("gen_ai.input.messages", input);
    }
}

/// Records how an `invoke_agent` span ended: its usage, or its error.
pub(crate) fn record_end<E: std::fmt::Display>(span: &Span, result: Result<&Usage, &E>) {
    if span.is_disabled() {
        return;
    }
    match result {
        Ok(usage) => {
            span.record("gen_ai.usage.input_tokens", int(usage.prompt_tokens));
            span.record("gen_ai.usage.output_tokens", int(usage.completion_tokens));
        }
        Err(e) => record_error(span, e),
    }
}

/// Marks `span` failed with the kind of `e` (its display text is no part of
/// the span: it may quote content).
pub(crate) fn record_error<E: std::fmt::Display>(span: &Span, e: &E) {
    span.record("otel.status_code", "ERROR");
    let text = e.to_string();
    let kind = text.split(':').next().unwrap_or("error");
    span.record("error.type", kind);
}

/// The span of a sub-agent run, a child of the current span (the
/// `delegate` call) for a foreground run; a background run starts a trace
/// of its own, linked to it.
pub(crate) fn run_span(
    session: SessionId,
    run: RunId,
    agent: &str,
    background: bool,
    resumed: bool,
) -> Span {
    let parent = if background {
        None
    } else {
        Span::current().id()
    };
    let span = tracing::info_span!(
        target: TARGET,
        parent: parent,
        "invoke_agent",
        otel.name = format!("invoke_agent {agent}"),
        otel.kind = "internal",
        otel.status_code = Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = agent,
        gen_ai.conversation.id = %session,
        gen_ai.input.messages = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        error.type = Empty,
        keel.run.id = %run,
        keel.run.mode = if background { "background" } else { "foreground" },
        keel.run.resumed = resumed,
        keel.run.status = Empty,
    );
    if background {
        span.follows_from(Span::current());
    }
    span
}

/// Records how a sub-agent run ended: its status, its usage when it has
/// one, and an error status unless it completed.
pub(crate) fn record_run_end(span: &Span, status: &str, completed: bool, usage: Option<&Usage>) {
    if span.is_disabled() {
        return;
    }
    span.record("keel.run.status", status);
    if let Some(usage) = usage {
        span.record("gen_ai.usage.input_tokens", int(usage.prompt_tokens));
        span.record("gen_ai.usage.output_tokens", int(usage.completion_tokens));
    }
    if !completed {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", status);
    }
}

/// The span of one model call (`chat {model}`).
pub(crate) fn chat_span(provider: &str, model: &str, max_tokens: Option<u32>) -> Span {
    tracing::info_span!(
        target: TARGET,
        "chat",
        otel.name = format!("chat {model}"),
        otel.kind = "client",
        otel.status_code = Empty,
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = provider,
        gen_ai.request.model = model,
        gen_ai.request.max_tokens = max_tokens.map(i64::from),
        gen_ai.response.finish_reasons = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.output.messages = Empty,
        keel.time_to_first_token_ms = Empty,
        error.type = Empty,
    )
}

/// Records what a model call answered.
pub(crate) fn record_response(span: &Span, response: &keel_core::ProviderResponse) {
    if span.is_disabled() {
        return;
    }
    span.record(
        "gen_ai.usage.input_tokens",
        int(response.usage.prompt_tokens),
    );
    span.record(
        "gen_ai.usage.output_tokens",
        int(response.usage.completion_tokens),
    );
    // The conventions' values (`tracing` has no array fields: one string).
    span.record(
        "gen_ai.response.finish_reasons",
        finish_reason(&response.finish_reason),
    );
    if record_content(span) {
        span.record("gen_ai.output.messages", response.message.text());
    }
}

/// The span of one tool call (`execute_tool {tool}`).
pub(crate) fn tool_span(call: &ToolCall) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "execute_tool",
        otel.name = format!("execute_tool {}", call.name),
        otel.kind = "internal",
        otel.status_code = Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.type = "function",
        gen_ai.tool.name = %call.name,
        gen_ai.tool.call.id = %call.id,
        gen_ai.tool.call.arguments = Empty,
        gen_ai.tool.call.result = Empty,
        keel.tool.outcome = Empty,
        error.type = Empty,
    );
    if record_content(&span) {
        span.record("gen_ai.tool.call.arguments", call.arguments.to_string());
    }
    span
}

/// Records a tool call's outcome (`ok` or `error`).
pub(crate) fn record_tool_output(span: &Span, output: &keel_core::ToolOutput) {
    if span.is_disabled() {
        return;
    }
    if output.is_error {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", "tool_error");
        span.record("keel.tool.outcome", "error");
    } else {
        span.record("keel.tool.outcome", "ok");
    }
    if record_content(span) {
        span.record("gen_ai.tool.call.result", output.content.as_str());
    }
}

/// The span of a store commit (`keel.store {operation}`), with the rows it
/// writes (message rows, or the run row).
pub(crate) fn store_span(operation: &'static str, rows: usize) -> Span {
    tracing::info_span!(
        target: TARGET,
        "keel.store",
        otel.name = format!("keel.store {operation}"),
        otel.kind = "internal",
        otel.status_code = Empty,
        keel.store.operation = operation,
        keel.store.rows = int(u64::try_from(rows).unwrap_or(u64::MAX)),
        error.type = Empty,
    )
}

/// The span of a tool call's wait for a person (`await_approval {tool}`),
/// from the pause until its decision, expiry or supersession.
fn approval_span(call: &ToolCall, approval: &ApprovalId) -> Span {
    tracing::info_span!(
        target: TARGET,
        "await_approval",
        otel.name = format!("await_approval {}", call.name),
        otel.kind = "internal",
        gen_ai.tool.name = %call.name,
        gen_ai.tool.call.id = %call.id,
        keel.approval.id = %approval,
        keel.approval.outcome = Empty,
    )
}

/// Opens the wait of approval `id` for `call`, a child of the current span,
/// kept open until [`settle_approval`].
pub(crate) fn open_approval(id: ApprovalId, call: &ToolCall) {
    let span = approval_span(call, &id);
    if !span.is_disabled() {
        APPROVAL_SPANS.lock().insert(id, span);
    }
}

/// Ends the wait of approval `id` with `outcome` (`approved`, `denied`,
/// `expired`, `superseded`).
pub(crate) fn settle_approval(id: ApprovalId, outcome: &'static str) {
    let span = APPROVAL_SPANS.lock().remove(&id);
    if let Some(span) = span {
        span.record("keel.approval.outcome", outcome);
    }
}

/// A finish reason as the GenAI conventions name it.
pub(crate) fn finish_reason(reason: &FinishReason) -> &str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::ToolCalls => "tool_call",
        FinishReason::Length => "length",
        FinishReason::ContentFilter => "content_filter",
        FinishReason::Other(other) => other.as_str(),
    }
}
