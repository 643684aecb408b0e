//! The agent loop of one turn: call the provider with the tool definitions,
//! run the requested tool calls as a parallel batch, repeat until the model
//! answers without tools or the iteration limit is reached.
//!
//! The loop is stateless across turns and writes nothing: it returns the
//! turn's new messages and usage, and the caller commits them in one store
//! transaction. So a cancelled or failed turn leaves nothing half-committed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use keel_core::{
    ChatRequest, DelegationPolicy, Message, Provider, ProviderError, ResponseAccumulator,
    StreamEvent, ToolCall, ToolError, ToolExecutionContext, ToolOutput, ToolRegistry, Usage,
};
use keel_store::{CallKind, CallSpan};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::approval::{ApprovalGate, GateMode, SUB_AGENT_REFUSAL};
use crate::budget::SpendMeter;
use crate::context::estimate_request_tokens;
use crate::error::{EngineError, Result};
use crate::mailbox::TurnMailbox;
use crate::trace;

/// Something the loop reports while a turn runs.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnEvent {
    /// A provider stream event (text deltas, tool call fragments, usage …).
    Stream(StreamEvent),
    /// A tool call is about to run.
    ToolStarted {
        /// The call.
        call: ToolCall,
    },
    /// A tool call finished.
    ToolFinished {
        /// The call's id.
        call_id: String,
        /// The tool's name.
        name: String,
        /// What the model will see.
        output: ToolOutput,
    },
    /// A notice for the user that is not part of the history (e.g. a
    /// storage failure).
    SystemNotice {
        /// The text.
        text: String,
    },
}

/// Where turn events go; dropped receivers are ignored.
pub type EventSink = mpsc::UnboundedSender<TurnEvent>;

/// What a running turn did so far that a rerun would repeat; the loop
/// reads it from the turn's extensions, when there.
#[derive(Debug, Default)]
pub(crate) struct TurnProgress {
    /// A tool call started.
    pub(crate) acted: AtomicBool,
}

/// A permit held while one provider or tool step runs (dropping it releases).
pub type StepPermit = Box<dyn std::any::Any + Send>;

/// Admission to provider and tool steps (the execution gate). Waiting must
/// end with [`EngineError::Cancelled`] when `ctx.cancellation` fires.
#[async_trait]
pub trait StepGate: Send + Sync {
    /// A permit for one provider call.
    async fn provider_step(&self, ctx: &ToolExecutionContext) -> Result<StepPermit>;
    /// A permit for one tool call.
    async fn tool_step(&self, ctx: &ToolExecutionContext) -> Result<StepPermit>;
}

/// A gate that admits everything at once.
pub struct OpenGate;

#[async_trait]
impl StepGate for OpenGate {
    async fn provider_step(&self, _ctx: &ToolExecutionContext) -> Result<StepPermit> {
        Ok(Box::new(()))
    }
    async fn tool_step(&self, _ctx: &ToolExecutionContext) -> Result<StepPermit> {
        Ok(Box::new(()))
    }
}

/// Everything one turn needs.
pub struct TurnRequest {
    /// The model.
    pub provider: Arc<dyn Provider>,
    /// Tools the model may call.
    pub tools: Arc<ToolRegistry>,
    /// The agent's role prompt, sent first.
    pub system_prompt: Option<String>,
    /// The replayed context before this turn (shared, not copied).
    pub history: Vec<Arc<Message>>,
    /// The turn's input (a user message, or a hidden trigger).
    pub input: Vec<Message>,
    /// Most provider calls in this turn.
    pub max_iterations: u32,
    /// Output token cap per provider call.
    pub max_output_tokens: Option<u32>,
    /// Identity and cancellation of the turn, handed to tools.
    pub context: ToolExecutionContext,
}

/// What a completed turn produced.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnOutput {
    /// Input, assistant and tool messages, in order, ready to commit.
    pub messages: Vec<Message>,
    /// Usage of every provider call of the turn.
    pub usage: Usage,
    /// Provider calls made.
    pub iterations: u32,
    /// Tool calls executed.
    pub tool_calls: u32,
    /// The timing of each model call and tool call, in the order they
    /// started (the first [`keel_store::MAX_CALL_SPANS`]; stored with the
    /// turn's or run's commit for its trace view).
    pub calls: Vec<CallSpan>,
    /// Calls of the last assistant message that wait for a person's
    /// approval: the turn ended after running the others (never set for a
    /// turn without an approval gate).
    pub awaiting_approval: Vec<ToolCall>,
}

impl TurnOutput {
    /// The text of the last assistant message.
    pub fn final_text(&self) -> String {
        self.messages
            .iter()
            .rev()
            .find(|m| m.role == keel_core::Role::Assistant)
            .map(|m| m.text())
            .unwrap_or_default()
    }
}

/// Runs turns. What a turn does is observable as `tracing` spans (see
/// `trace.rs`): a downstream crate observes turns with a subscriber layer.
pub struct AgentLoop {
    gate: Arc<dyn StepGate>,
}

impl Default for AgentLoop {
    fn default() -> Self {
        Self::new(Arc::new(OpenGate))
    }
}

impl AgentLoop {
    /// A loop taking step permits from `gate`.
    pub fn new(gate: Arc<dyn StepGate>) -> Self {
        Self { gate }
    }

    /// The gate every provider and tool step of this loop goes through.
    pub(crate) fn gate(&self) -> &Arc<dyn StepGate> {
        &self.gate
    }

    /// Runs one turn to its end.
    pub async fn run(
        &self,
        request: TurnRequest,
        events: Option<&EventSink>,
    ) -> Result<TurnOutput> {
        let TurnRequest {
            provider,
            tools,
            system_prompt,
            history,
            input,
            max_iterations,
            max_output_tokens,
            context,
        } = request;
        let cancel = context.cancellation.clone();
        // A root turn's steer input enters at each model-call boundary.
        let mailbox = context.extensions.get::<Arc<TurnMailbox>>().cloned();
        // The spend budgets over this loop, when it has any.
        let meter = context.extensions.get::<Arc<SpendMeter>>().cloned();
        let emit = |e: TurnEvent| {
            if let Some(tx) = events {
                // A client that went away does not stop the turn.
                let _ = tx.send(e);
            }
        };
        // One request grows across the turn's iterations: the history is
        // moved in once and each iteration only appends its new messages.
        let mut messages: Vec<Arc<Message>> = Vec::with_capacity(history.len() + input.len() + 8);
        messages.extend(system_prompt.map(|p| Arc::new(Message::system(p))));
        messages.extend(history);
        messages.extend(input.iter().cloned().map(Arc::new));
        let mut chat = ChatRequest {
            messages,
            tools: tools.definitions(),
            max_tokens: max_output_tokens,
            temperature: None,
        };
        let mut new_messages = input;
        let mut usage = Usage::default();
        let mut tool_calls = 0u32;
        let mut spans: Vec<CallSpan> = Vec::new();
        for iteration in 1..=max_iterations {
            if let Some(mailbox) = &mailbox {
                for m in mailbox.drain() {
                    chat.messages.push(Arc::new(m.clone()));
                    new_messages.push(m);
                }
            }
            // A call that would pass a budget is not made; its reservation
            // is released if the call fails.
            let estimate = || u64::try_from(estimate_request_tokens(&chat)).unwrap_or(u64::MAX);
            let reservation = meter.as_ref().map(|m| m.reserve(estimate())).transpose()?;
            let response = {
                let _permit = self.gate.provider_step(&context).await?;
                let started_at_ms = keel_core::time::now_ms();
                let span = trace::chat_span(provider.name(), provider.model(), max_output_tokens);
                let response = stream_response(provider.as_ref(), &chat, &context, &emit, &span)
                    .instrument(span.clone())
                    .await;
                match &response {
                    Ok(r) => {
                        trace::record_response(&span, r);
                        push_span(&mut spans, model_span(provider.model(), started_at_ms, r));
                    }
                    Err(e) => trace::record_error(&span, e),
                }
                response?
            };
            if let (Some(meter), Some(reservation)) = (&meter, reservation) {
                // Unrecorded spend would let a restart reset a dialog budget:
                // the turn stops, like a turn whose commit failed.
                if let Err(e) = meter.settle(reservation, response.usage).await {
                    emit(TurnEvent::SystemNotice {
                        text: format!(
                            "This turn's answer could not be saved and was discarded: what its model call spent could not be recorded: {e}"
                        ),
                    });
                    return Err(e);
                }
            }
            usage.add(response.usage);
            let calls = response.message.tool_calls.clone();
            chat.messages.push(Arc::new(response.message.clone()));
            new_messages.push(response.message);
            // Steer that arrived during the answer gets an answer too, while
            // the iteration limit allows; otherwise it becomes the next turn.
            let steered =
                iteration < max_iterations && mailbox.as_ref().is_some_and(|m| m.has_input());
            if calls.is_empty() && !steered {
                return Ok(TurnOutput {
                    messages: new_messages,
                    usage,
                    iterations: iteration,
                    tool_calls,
                    calls: spans,
                    awaiting_approval: Vec::new(),
                });
            }
            if calls.is_empty() {
                continue;
            }
            let gate = context.extensions.get::<Arc<ApprovalGate>>();
            let gated = |call: &ToolCall| gate.is_some_and(|g| g.gates(&call.name));
            let pause = gate.is_some_and(|g| g.mode == GateMode::Pause);
            let (waiting, calls): (Vec<ToolCall>, Vec<ToolCall>) = if pause {
                calls.into_iter().partition(|c| gated(c))
            } else {
                (Vec::new(), calls)
            };
            tool_calls = tool_calls.saturating_add(u32::try_from(calls.len()).unwrap_or(u32::MAX));
            let results = futures::future::join_all(calls.iter().map(|call| async {
                let started_at_ms = keel_core::time::now_ms();
                let output = self
                    .tool_or_refusal(&tools, call, gated(call), &context, &emit)
                    .await;
                (started_at_ms, keel_core::time::now_ms(), output)
            }))
            .await;
            if cancel.is_cancelled() {
                return Err(EngineError::Cancelled);
            }
            for (call, (started_at_ms, ended_at_ms, output)) in calls.iter().zip(results) {
                push_span(
                    &mut spans,
                    tool_span(call, started_at_ms, ended_at_ms, output.is_error),
                );
                // Failures reach the model as text starting with "error:".
                let result =
                    Message::tool_result(call.id.clone(), call.name.clone(), output.content);
                chat.messages.push(Arc::new(result.clone()));
                new_messages.push(result);
            }
            if !waiting.is_empty() {
                return Ok(TurnOutput {
                    messages: new_messages,
                    usage,
                    iterations: iteration,
                    tool_calls,
                    calls: spans,
                    awaiting_approval: waiting,
                });
            }
        }
        Err(EngineError::MaxIterations {
            limit: max_iterations,
        })
    }

    /// Runs `call`, or refuses it when it is `gated` (a sub-agent run
    /// cannot ask a person yet).
    async fn tool_or_refusal(
        &self,
        tools: &ToolRegistry,
        call: &ToolCall,
        gated: bool,
        ctx: &ToolExecutionContext,
        emit: &impl Fn(TurnEvent),
    ) -> ToolOutput {
        if !gated {
            return self.run_tool(tools, call, ctx, emit).await;
        }
        let output = ToolOutput {
            content: SUB_AGENT_REFUSAL.to_owned(),
            is_error: true,
        };
        emit(TurnEvent::ToolFinished {
            call_id: call.id.clone(),
            name: call.name.clone(),
            output: output.clone(),
        });
        output
    }

    /// Runs one call of `tools` outside a turn's batch (an approved call
    /// when its turn resumes), under a tool-step permit.
    pub(crate) async fn execute_tool(
        &self,
        tools: &ToolRegistry,
        call: &ToolCall,
        ctx: &ToolExecutionContext,
    ) -> ToolOutput {
        self.run_tool(tools, call, ctx, &|_| {}).await
    }

    async fn run_tool(
        &self,
        tools: &ToolRegistry,
        call: &ToolCall,
        ctx: &ToolExecutionContext,
        emit: &impl Fn(TurnEvent),
    ) -> ToolOutput {
        let span = trace::tool_span(call);
        let output = self
            .execute_in_span(tools, call, ctx, emit)
            .instrument(span.clone())
            .await;
        trace::record_tool_output(&span, &output);
        output
    }

    async fn execute_in_span(
        &self,
        tools: &ToolRegistry,
        call: &ToolCall,
        ctx: &ToolExecutionContext,
        emit: &impl Fn(TurnEvent),
    ) -> ToolOutput {
        if let Some(progress) = ctx.extensions.get::<Arc<TurnProgress>>() {
            progress.acted.store(true, Ordering::Release);
        }
        emit(TurnEvent::ToolStarted { call: call.clone() });
        let output = match tools.get(&call.name) {
            None => ToolOutput {
                content: format!("error: unknown tool {:?}", call.name),
                is_error: true,
            },
            Some(tool) => {
                // Runtime-control tools (delegate, agent_task) take no tool-step
                // permit: a parent waiting on children must hold no permit, or
                // nested delegation with every limit at 1 would deadlock.
                let permit = if tool.delegation_policy() == DelegationPolicy::RuntimeInjected {
                    Ok(None)
                } else {
                    self.gate.tool_step(ctx).await.map(Some)
                };
                let result = match permit {
                    Err(_) => Err(ToolError::Cancelled),
                    Ok(_permit) => tokio::select! {
                        biased;
                        _ = ctx.cancellation.cancelled() => Err(ToolError::Cancelled),
                        r = tool.execute(call.arguments.clone(), ctx) => r,
                    },
                };
                match result {
                    Ok(out) => out,
                    Err(e) => ToolOutput {
                        content: format!("error: {e}"),
                        is_error: true,
                    },
                }
            }
        };
        crate::metrics::tool_call(tools.get(&call.name).map(|t| t.name()), output.is_error);
        emit(TurnEvent::ToolFinished {
            call_id: call.id.clone(),
            name: call.name.clone(),
            output: output.clone(),
        });
        output
    }
}

async fn stream_response(
    provider: &dyn Provider,
    chat: &ChatRequest,
    ctx: &ToolExecutionContext,
    emit: &impl Fn(TurnEvent),
    span: &tracing::Span,
) -> Result<keel_core::ProviderResponse> {
    let cancel = &ctx.cancellation;
    // Time to first token, measured only for a recorded span.
    let mut started = (!span.is_disabled()).then(std::time::Instant::now);
    let mut stream = tokio::select! {
        biased;
        _ = cancel.cancelled() => return Err(EngineError::Cancelled),
        s = provider.stream(chat, cancel.clone()) => s.map_err(provider_error)?,
    };
    let mut acc = ResponseAccumulator::default();
    loop {
        let next = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(EngineError::Cancelled),
            n = stream.next() => n,
        };
        match next {
            None => return acc.finish().map_err(provider_error),
            Some(Err(e)) => return Err(provider_error(e)),
            Some(Ok(event)) => {
                if let Some(at) = started.take() {
                    let ms = u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX);
                    span.record("keel.time_to_first_token_ms", trace::int(ms));
                }
                acc.push(event.clone()).map_err(provider_error)?;
                emit(TurnEvent::Stream(event));
            }
        }
    }
}

/// Keeps the first [`keel_store::MAX_CALL_SPANS`] spans of a turn.
fn push_span(spans: &mut Vec<CallSpan>, span: CallSpan) {
    if spans.len() < keel_store::MAX_CALL_SPANS {
        spans.push(span);
    }
}

/// Longest finish reason stored on a model call's span, in bytes.
const FINISH_REASON_BYTES: usize = 40;

fn model_span(model: &str, started_at_ms: i64, r: &keel_core::ProviderResponse) -> CallSpan {
    let ended_at_ms = keel_core::time::now_ms().max(started_at_ms);
    let mut status = trace::finish_reason(&r.finish_reason).to_owned();
    if status.len() > FINISH_REASON_BYTES {
        let cut = (0..=FINISH_REASON_BYTES)
            .rev()
            .find(|&i| status.is_char_boundary(i))
            .unwrap_or(0);
        status.truncate(cut);
    }
    CallSpan {
        kind: CallKind::Model,
        name: model.to_owned(),
        call_id: None,
        started_at_ms,
        ended_at_ms,
        input_tokens: Some(r.usage.prompt_tokens),
        output_tokens: Some(r.usage.completion_tokens),
        status,
    }
}

fn tool_span(call: &ToolCall, started_at_ms: i64, ended_at_ms: i64, is_error: bool) -> CallSpan {
    CallSpan {
        kind: CallKind::Tool,
        name: call.name.clone(),
        call_id: Some(call.id.clone()),
        started_at_ms,
        ended_at_ms: ended_at_ms.max(started_at_ms),
        input_tokens: None,
        output_tokens: None,
        status: if is_error { "error" } else { "ok" }.to_owned(),
    }
}

fn provider_error(e: ProviderError) -> EngineError {
    match e {
        ProviderError::Cancelled => EngineError::Cancelled,
        other => EngineError::Provider(other),
    }
}
