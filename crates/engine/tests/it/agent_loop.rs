//! Agent loop behaviour: text answers, tool batches, limits, cancellation.

use std::sync::Arc;

use async_trait::async_trait;
use keel_core::{
    DelegationPolicy, Message, Role, ScriptedProvider, ScriptedResponse, ScriptedToolCall, Tool,
    ToolError, ToolExecutionContext, ToolOutput, ToolRegistry,
};
use keel_engine::{AgentLoop, EngineError, TurnEvent, TurnRequest};
use serde_json::json;
use tokio::sync::{mpsc, Barrier, Notify};

/// A tool that waits at a barrier (to prove calls overlap) and echoes.
struct Rendezvous(Arc<Barrier>, &'static str);

#[async_trait]
impl Tool for Rendezvous {
    fn name(&self) -> &str {
        self.1
    }
    fn description(&self) -> &str {
        "waits for its siblings"
    }
    fn parameters(&self) -> serde_json::Value {
        json!({"type": "object"})
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        _: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        self.0.wait().await;
        Ok(ToolOutput::text(format!("{} {}", self.1, args)))
    }
}

/// A tool that announces it started, then waits for cancellation.
struct Blocks(Arc<Notify>);

#[async_trait]
impl Tool for Blocks {
    fn name(&self) -> &str {
        "blocks"
    }
    fn description(&self) -> &str {
        "never finishes by itself"
    }
    fn parameters(&self) -> serde_json::Value {
        json!({"type": "object"})
    }
    async fn execute(
        &self,
        _: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        self.0.notify_one();
        ctx.cancellation.cancelled().await;
        Err(ToolError::Cancelled)
    }
}

fn request(provider: ScriptedProvider, tools: ToolRegistry, max_iterations: u32) -> TurnRequest {
    TurnRequest {
        provider: Arc::new(provider),
        tools: Arc::new(tools),
        system_prompt: Some("You are a test agent.".into()),
        history: vec![
            Message::user("earlier").into(),
            Message::assistant("ok").into(),
        ],
        input: vec![Message::user("now")],
        max_iterations,
        max_output_tokens: Some(100),
        context: ToolExecutionContext::default(),
    }
}

#[tokio::test]
async fn text_answer_streams_and_returns_input_plus_answer() {
    let provider = ScriptedProvider::new([ScriptedResponse::text("hello there")]);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let out = AgentLoop::default()
        .run(request(provider.clone(), ToolRegistry::new(), 4), Some(&tx))
        .await
        .unwrap();
    let roles: Vec<Role> = out.messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::User, Role::Assistant]);
    assert_eq!(out.final_text(), "hello there");
    assert_eq!(out.iterations, 1);
    drop(tx);
    let mut deltas = String::new();
    while let Some(e) = rx.recv().await {
        if let TurnEvent::Stream(keel_core::StreamEvent::TextDelta { text }) = e {
            deltas.push_str(&text);
        }
    }
    assert_eq!(deltas, "hello there");
    let sent = &provider.requests()[0];
    let texts: Vec<String> = sent.messages.iter().map(|m| m.text()).collect();
    assert_eq!(texts, ["You are a test agent.", "earlier", "ok", "now"]);
    assert_eq!(sent.max_tokens, Some(100));
}

#[tokio::test]
async fn a_tool_batch_runs_concurrently_and_results_keep_call_order() {
    let barrier = Arc::new(Barrier::new(3));
    let mut tools = ToolRegistry::new();
    for name in ["a", "b", "c"] {
        tools
            .register(Arc::new(Rendezvous(barrier.clone(), name)))
            .unwrap();
    }
    let calls = ["c", "a", "b"]
        .iter()
        .map(|n| ScriptedToolCall {
            id: None,
            name: (*n).into(),
            arguments: json!({"n": n}),
        })
        .collect();
    let provider = ScriptedProvider::new([
        ScriptedResponse {
            tool_calls: calls,
            ..Default::default()
        },
        ScriptedResponse::text("done"),
    ]);
    // If the three calls ran one after another, the barrier of 3 would never
    // open and the test would hang: completion proves overlap.
    let out = AgentLoop::default()
        .run(request(provider.clone(), tools, 4), None)
        .await
        .unwrap();
    let tool_texts: Vec<String> = out
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.text())
        .collect();
    assert_eq!(
        tool_texts,
        [r#"c {"n":"c"}"#, r#"a {"n":"a"}"#, r#"b {"n":"b"}"#]
    );
    assert_eq!(out.tool_calls, 3);
    assert_eq!(out.iterations, 2);
    // The second request carried the tool results.
    assert_eq!(
        provider.requests()[1]
            .messages
            .iter()
            .filter(|m| m.role == Role::Tool)
            .count(),
        3
    );
}

#[tokio::test]
async fn unknown_tools_and_tool_errors_reach_the_model_as_text() {
    let provider = ScriptedProvider::new([
        ScriptedResponse::tool_call("nope", json!({})),
        ScriptedResponse::text("sorry"),
    ]);
    let out = AgentLoop::default()
        .run(request(provider, ToolRegistry::new(), 4), None)
        .await
        .unwrap();
    let tool = out.messages.iter().find(|m| m.role == Role::Tool).unwrap();
    assert_eq!(tool.text(), "error: unknown tool \"nope\"");
}

#[tokio::test]
async fn max_iterations_is_a_typed_error() {
    let provider = ScriptedProvider::new([
        ScriptedResponse::tool_call("nope", json!({})),
        ScriptedResponse::tool_call("nope", json!({})),
    ]);
    let err = AgentLoop::default()
        .run(request(provider, ToolRegistry::new(), 2), None)
        .await
        .unwrap_err();
    assert_eq!(err, EngineError::MaxIterations { limit: 2 });
    insta::assert_snapshot!(err, @"the agent reached its limit of 2 model calls without a final answer");
}

#[tokio::test]
async fn provider_errors_are_typed() {
    let provider = ScriptedProvider::new([ScriptedResponse::error(
        keel_core::ScriptedErrorKind::Auth,
        "check OPENAI_API_KEY",
    )]);
    let err = AgentLoop::default()
        .run(request(provider, ToolRegistry::new(), 2), None)
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        EngineError::Provider(keel_core::ProviderError::Auth { status: 401, .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn cancellation_during_the_provider_stream() {
    let mut slow = ScriptedResponse::text("one two three four");
    slow.chunk_delay_ms = 60_000;
    let provider = ScriptedProvider::new([slow]);
    let req = request(provider, ToolRegistry::new(), 2);
    let cancel = req.context.cancellation.clone();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move { AgentLoop::default().run(req, Some(&tx)).await });
    // Wait until the first delta arrived: we are mid-stream.
    loop {
        if let Some(TurnEvent::Stream(keel_core::StreamEvent::TextDelta { .. })) = rx.recv().await {
            break;
        }
    }
    cancel.cancel();
    assert_eq!(task.await.unwrap().unwrap_err(), EngineError::Cancelled);
}

#[tokio::test]
async fn cancellation_during_a_tool_batch() {
    let started = Arc::new(Notify::new());
    let mut tools = ToolRegistry::new();
    tools.register(Arc::new(Blocks(started.clone()))).unwrap();
    let provider = ScriptedProvider::new([ScriptedResponse::tool_call("blocks", json!({}))]);
    let req = request(provider.clone(), tools, 4);
    let cancel = req.context.cancellation.clone();
    let task = tokio::spawn(async move { AgentLoop::default().run(req, None).await });
    started.notified().await;
    cancel.cancel();
    assert_eq!(task.await.unwrap().unwrap_err(), EngineError::Cancelled);
    assert_eq!(
        provider.requests().len(),
        1,
        "no provider call after cancellation"
    );
}

#[tokio::test]
async fn a_turn_emits_chat_and_tool_spans_with_usage_finish_reason_and_outcome() {
    use tracing_subscriber::layer::SubscriberExt;
    let recorder = crate::common::SpanRecorder::default();
    let subscriber = tracing_subscriber::registry().with(recorder.clone());
    let _guard = tracing::subscriber::set_default(subscriber);
    let provider = ScriptedProvider::new([
        ScriptedResponse {
            usage: Some(keel_core::Usage::new(7, 3)),
            ..ScriptedResponse::tool_call("nope", json!({}))
        },
        ScriptedResponse {
            usage: Some(keel_core::Usage::new(11, 2)),
            ..ScriptedResponse::text("fine")
        },
    ]);
    AgentLoop::default()
        .run(request(provider, ToolRegistry::new(), 4), None)
        .await
        .unwrap();
    let failing = ScriptedProvider::new([ScriptedResponse::error(
        keel_core::ScriptedErrorKind::Server,
        "down",
    )]);
    AgentLoop::default()
        .run(request(failing, ToolRegistry::new(), 4), None)
        .await
        .unwrap_err();
    let spans = recorder.0.lock().clone();
    let names: Vec<&str> = spans.iter().map(|(n, _)| n.as_str()).collect();
    let model = "scripted";
    assert_eq!(
        names,
        [
            format!("chat {model}").as_str(),
            "execute_tool nope",
            &format!("chat {model}"),
            &format!("chat {model}"),
        ]
    );
    let field = |i: usize, k: &str| spans[i].1.get(k).cloned().unwrap_or_default();
    assert_eq!(field(0, "gen_ai.operation.name"), "chat");
    assert_eq!(field(0, "gen_ai.usage.input_tokens"), "7");
    assert_eq!(field(0, "gen_ai.usage.output_tokens"), "3");
    assert_eq!(field(0, "gen_ai.response.finish_reasons"), "tool_call");
    assert!(!field(0, "keel.time_to_first_token_ms").is_empty());
    assert_eq!(field(1, "gen_ai.tool.name"), "nope");
    assert_eq!(field(1, "keel.tool.outcome"), "error");
    assert_eq!(field(1, "otel.status_code"), "ERROR");
    assert_eq!(field(2, "gen_ai.response.finish_reasons"), "stop");
    assert_eq!(field(3, "otel.status_code"), "ERROR");
    // Content is not recorded by default.
    assert!(spans
        .iter()
        .all(|(_, f)| !f.contains_key("gen_ai.output.messages")
            && !f.contains_key("gen_ai.tool.call.arguments")));
}
