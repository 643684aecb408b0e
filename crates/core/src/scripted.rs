//! [`ScriptedProvider`]: a deterministic [`Provider`] that replays a script of
//! responses (text, tool calls, errors, delays) and records every request it
//! sees. It is the test double of every crate and the offline provider of the
//! demo. A [`Script`] is plain data (serde); reading one from a file is the
//! caller's business (keel-providers parses YAML/JSON script files).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::message::Role;
use crate::provider::{
    ChatRequest, FinishReason, Provider, ProviderError, ProviderStream, StreamEvent,
};
use crate::usage::Usage;

/// A tool call the script makes the model request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedToolCall {
    /// Call id; generated as `call_<n>` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Tool name.
    pub name: String,
    /// Arguments object.
    #[serde(default)]
    pub arguments: serde_json::Value,
}

/// The kind of error a scripted response fails with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScriptedErrorKind {
    /// [`ProviderError::RateLimited`].
    RateLimited,
    /// [`ProviderError::Server`] (status 500 unless given).
    Server,
    /// [`ProviderError::Auth`] (status 401 unless given).
    Auth,
    /// [`ProviderError::BadRequest`] (status 400 unless given).
    BadRequest,
    /// [`ProviderError::Connect`].
    Connect,
    /// [`ProviderError::Timeout`].
    Timeout,
    /// [`ProviderError::StreamInterrupted`], after any scripted text.
    StreamInterrupted,
    /// [`ProviderError::Protocol`].
    Protocol,
    /// [`ProviderError::Unavailable`].
    Unavailable,
    /// [`ProviderError::ContextLengthExceeded`].
    ContextLengthExceeded,
}

/// An error a scripted response ends with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedError {
    /// Which error.
    pub kind: ScriptedErrorKind,
    /// Its message.
    #[serde(default)]
    pub message: String,
    /// HTTP status for `server`, `auth`, `bad_request`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// `retry-after` for `rate_limited`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl ScriptedError {
    fn to_provider_error(&self) -> ProviderError {
        let message = self.message.clone();
        match self.kind {
            ScriptedErrorKind::RateLimited => ProviderError::RateLimited {
                retry_after: self.retry_after_ms.map(Duration::from_millis),
            },
            ScriptedErrorKind::Server => ProviderError::Server {
                status: self.status.unwrap_or(500),
                message,
            },
            ScriptedErrorKind::Auth => ProviderError::Auth {
                status: self.status.unwrap_or(401),
                message,
            },
            ScriptedErrorKind::BadRequest => ProviderError::BadRequest {
                status: self.status.unwrap_or(400),
                message,
            },
            ScriptedErrorKind::Connect => ProviderError::Connect(message),
            ScriptedErrorKind::Timeout => ProviderError::Timeout(message),
            ScriptedErrorKind::StreamInterrupted => ProviderError::StreamInterrupted(message),
            ScriptedErrorKind::Protocol => ProviderError::Protocol(message),
            ScriptedErrorKind::Unavailable => ProviderError::Unavailable(message),
            ScriptedErrorKind::ContextLengthExceeded => {
                ProviderError::ContextLengthExceeded(message)
            }
        }
    }
}

/// One scripted completion. Fields combine: text is streamed word by word,
/// then tool calls, then (if `error` is set) the error instead of a finish —
/// text plus an error models a stream cut mid-way.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedResponse {
    /// Wait before the first event.
    #[serde(default)]
    pub delay_ms: u64,
    /// Wait between streamed chunks.
    #[serde(default)]
    pub chunk_delay_ms: u64,
    /// Assistant text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Tool calls to request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ScriptedToolCall>,
    /// Error to end with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ScriptedError>,
    /// Reported usage; estimated from the request and text when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl ScriptedResponse {
    /// A plain text answer.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: Some(text.into()),
            ..Self::default()
        }
    }

    /// A request for one tool call.
    pub fn tool_call(name: impl Into<String>, arguments: serde_json::Value) -> Self {
        Self {
            tool_calls: vec![ScriptedToolCall {
                id: None,
                name: name.into(),
                arguments,
            }],
            ..Self::default()
        }
    }

    /// A response that fails with `kind`.
    pub fn error(kind: ScriptedErrorKind, message: impl Into<String>) -> Self {
        Self {
            error: Some(ScriptedError {
                kind,
                message: message.into(),
                status: None,
                retry_after_ms: None,
            }),
            ..Self::default()
        }
    }

    /// The same response, delayed by `ms` before its first event.
    pub fn delayed(mut self, ms: u64) -> Self {
        self.delay_ms = ms;
        self
    }
}

/// What the provider answers once the script is used up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenExhausted {
    /// Fail with [`ProviderError::Unavailable`].
    #[default]
    Error,
    /// Answer with an offline acknowledgement of the last user message.
    Echo,
}

/// A script: responses in order and what to do once they are used up. In a
/// script file it is this map, or just the list of responses.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// Responses, in order.
    #[serde(default)]
    pub responses: Vec<ScriptedResponse>,
    /// Behaviour after the last response.
    #[serde(default)]
    pub when_exhausted: WhenExhausted,
}

/// A function that answers a request once the script is used up.
pub type Responder = Arc<dyn Fn(&ChatRequest) -> ScriptedResponse + Send + Sync>;

struct State {
    queue: VecDeque<ScriptedResponse>,
    requests: Vec<ChatRequest>,
    next_call_id: u64,
}

/// A deterministic provider replaying a script; see the module docs.
#[derive(Clone)]
pub struct ScriptedProvider {
    model: String,
    state: Arc<Mutex<State>>,
    fallback: Option<Responder>,
}

impl ScriptedProvider {
    /// A provider replaying `responses` in order, failing once they run out.
    pub fn new(responses: impl IntoIterator<Item = ScriptedResponse>) -> Self {
        Self {
            model: "scripted".into(),
            state: Arc::new(Mutex::new(State {
                queue: responses.into_iter().collect(),
                requests: Vec::new(),
                next_call_id: 1,
            })),
            fallback: None,
        }
    }

    /// The offline provider: no script, answers every request by echoing.
    pub fn offline() -> Self {
        Self::from_script(Script {
            responses: Vec::new(),
            when_exhausted: WhenExhausted::Echo,
        })
    }

    /// A provider for a parsed [`Script`].
    pub fn from_script(script: Script) -> Self {
        let p = Self::new(script.responses);
        match script.when_exhausted {
            WhenExhausted::Error => p,
            WhenExhausted::Echo => p.with_fallback(Arc::new(echo)),
        }
    }

    /// Answers with `responder` once the script is used up.
    pub fn with_fallback(mut self, responder: Responder) -> Self {
        self.fallback = Some(responder);
        self
    }

    /// Reports `model` as the model id.
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// Appends responses to the script.
    pub fn push(&self, responses: impl IntoIterator<Item = ScriptedResponse>) {
        self.state.lock().queue.extend(responses);
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.state.lock().requests.clone()
    }

    /// How many scripted responses are left.
    pub fn remaining(&self) -> usize {
        self.state.lock().queue.len()
    }

    fn plan(&self, request: &ChatRequest) -> Result<Vec<Step>, ProviderError> {
        let (response, first_call_id) = {
            let mut state = self.state.lock();
            state.requests.push(request.clone());
            let response = match state.queue.pop_front() {
                Some(r) => r,
                None => match &self.fallback {
                    Some(f) => f(request),
                    None => {
                        return Err(ProviderError::Unavailable(
                            "the script has no more responses".into(),
                        ))
                    }
                },
            };
            let first = state.next_call_id;
            state.next_call_id += response.tool_calls.len() as u64;
            (response, first)
        };
        Ok(steps_for(response, request, first_call_id))
    }
}

fn echo(request: &ChatRequest) -> ScriptedResponse {
    let last = request
        .messages
        .iter()
        .rev()
        .find(|m| m.role == Role::User)
        .map(|m| m.text())
        .unwrap_or_default();
    let mut said: String = last.chars().take(200).collect();
    if said.len() < last.len() {
        said.push('…');
    }
    ScriptedResponse::text(format!(
        "(offline) I am keel's built-in offline model, so I can only acknowledge: \"{said}\". \
         Configure a provider in keel.toml to talk to a real LLM."
    ))
}

struct Step {
    delay: Duration,
    item: Result<StreamEvent, ProviderError>,
}

fn steps_for(response: ScriptedResponse, request: &ChatRequest, first_call_id: u64) -> Vec<Step> {
    let chunk_delay = Duration::from_millis(response.chunk_delay_ms);
    let mut steps = Vec::new();
    let mut delay = Duration::from_millis(response.delay_ms);
    let push = |item, steps: &mut Vec<Step>, delay: &mut Duration| {
        steps.push(Step {
            delay: std::mem::replace(delay, chunk_delay),
            item,
        });
    };
    let text = response.text.clone().unwrap_or_default();
    for chunk in text.split_inclusive(' ') {
        push(
            Ok(StreamEvent::TextDelta {
                text: chunk.to_owned(),
            }),
            &mut steps,
            &mut delay,
        );
    }
    for (i, call) in response.tool_calls.iter().enumerate() {
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        let id = call
            .id
            .clone()
            .unwrap_or_else(|| format!("call_{}", first_call_id + i as u64));
        push(
            Ok(StreamEvent::ToolCallStart {
                index,
                id,
                name: call.name.clone(),
            }),
            &mut steps,
            &mut delay,
        );
        // Split the arguments in two deltas, as real providers do.
        let args = call.arguments.to_string();
        let mid = (0..=args.len() / 2)
            .rev()
            .find(|&i| args.is_char_boundary(i))
            .unwrap_or(0);
        for part in [&args[..mid], &args[mid..]] {
            push(
                Ok(StreamEvent::ToolCallDelta {
                    index,
                    arguments: part.to_owned(),
                }),
                &mut steps,
                &mut delay,
            );
        }
        push(
            Ok(StreamEvent::ToolCallEnd { index }),
            &mut steps,
            &mut delay,
        );
    }
    if let Some(error) = &response.error {
        push(Err(error.to_provider_error()), &mut steps, &mut delay);
        return steps;
    }
    let usage = response.usage.unwrap_or_else(|| {
        let prompt: usize = request.messages.iter().map(|m| m.estimated_tokens()).sum();
        Usage::new(prompt as u64, text.len().div_ceil(4) as u64)
    });
    push(Ok(StreamEvent::Usage { usage }), &mut steps, &mut delay);
    let reason = if response.tool_calls.is_empty() {
        FinishReason::Stop
    } else {
        FinishReason::ToolCalls
    };
    push(Ok(StreamEvent::Finish { reason }), &mut steps, &mut delay);
    steps
}

#[async_trait]
impl Provider for ScriptedProvider {
    fn name(&self) -> &str {
        "scripted"
    }

    fn model(&self) -> &str {
        &self.model
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        if cancel.is_cancelled() {
            return Err(ProviderError::Cancelled);
        }
        let steps: VecDeque<Step> = self.plan(request)?.into();
        let stream = futures::stream::unfold(
            (steps, cancel, false),
            |(mut steps, cancel, done)| async move {
                if done {
                    return None;
                }
                let step = steps.pop_front()?;
                if !step.delay.is_zero() {
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => {
                            return Some((Err(ProviderError::Cancelled), (steps, cancel, true)));
                        }
                        _ = tokio::time::sleep(step.delay) => {}
                    }
                } else if cancel.is_cancelled() {
                    return Some((Err(ProviderError::Cancelled), (steps, cancel, true)));
                }
                let done = step.item.is_err();
                Some((step.item, (steps, cancel, done)))
            },
        );
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Message;
    use crate::provider::ResponseAccumulator;

    fn req(text: &str) -> ChatRequest {
        ChatRequest::new(vec![Message::system("sys"), Message::user(text)])
    }

    async fn events(
        p: &ScriptedProvider,
        r: ChatRequest,
    ) -> Vec<Result<StreamEvent, ProviderError>> {
        p.stream(&r, CancellationToken::new())
            .await
            .unwrap()
            .collect()
            .await
    }

    #[tokio::test]
    async fn replays_text_as_a_stream() {
        let p = ScriptedProvider::new([ScriptedResponse::text("hello there world")]);
        let evs = events(&p, req("hi")).await;
        let deltas: Vec<_> = evs
            .iter()
            .filter_map(|e| match e {
                Ok(StreamEvent::TextDelta { text }) => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(deltas, ["hello ", "there ", "world"]);
        assert!(matches!(
            evs.last(),
            Some(Ok(StreamEvent::Finish {
                reason: FinishReason::Stop
            }))
        ));
        let r = p.complete(&req("again"), CancellationToken::new()).await;
        assert!(
            matches!(r, Err(ProviderError::Unavailable(_))),
            "script exhausted"
        );
    }

    #[tokio::test]
    async fn replays_tool_calls_with_split_arguments() {
        let p = ScriptedProvider::new([ScriptedResponse {
            tool_calls: vec![
                ScriptedToolCall {
                    id: None,
                    name: "read_file".into(),
                    arguments: serde_json::json!({"path": "a.txt"}),
                },
                ScriptedToolCall {
                    id: Some("mine".into()),
                    name: "list_dir".into(),
                    arguments: serde_json::json!({}),
                },
            ],
            ..Default::default()
        }]);
        let evs = events(&p, req("hi")).await;
        let deltas = evs
            .iter()
            .filter(|e| matches!(e, Ok(StreamEvent::ToolCallDelta { index: 0, .. })))
            .count();
        assert_eq!(deltas, 2, "arguments arrive in two fragments");
        let mut acc = ResponseAccumulator::default();
        for e in evs {
            acc.push(e.unwrap()).unwrap();
        }
        let r = acc.finish().unwrap();
        assert_eq!(r.finish_reason, FinishReason::ToolCalls);
        let calls: Vec<_> = r
            .message
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.clone()))
            .collect();
        assert_eq!(
            calls,
            [
                ("call_1", "read_file", serde_json::json!({"path": "a.txt"})),
                ("mine", "list_dir", serde_json::json!({})),
            ]
        );
    }

    #[tokio::test]
    async fn replays_errors_including_mid_stream_cuts() {
        let mut cut = ScriptedResponse::text("partial answer");
        cut.error = Some(ScriptedError {
            kind: ScriptedErrorKind::StreamInterrupted,
            message: "connection reset".into(),
            status: None,
            retry_after_ms: None,
        });
        let p = ScriptedProvider::new([
            ScriptedResponse {
                error: Some(ScriptedError {
                    kind: ScriptedErrorKind::RateLimited,
                    message: String::new(),
                    status: None,
                    retry_after_ms: Some(250),
                }),
                ..Default::default()
            },
            cut,
        ]);
        let err = p
            .complete(&req("a"), CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(
            err,
            ProviderError::RateLimited {
                retry_after: Some(Duration::from_millis(250))
            }
        );
        assert!(err.is_retryable());
        let evs = events(&p, req("b")).await;
        assert_eq!(
            evs.len(),
            3,
            "two text chunks then the error, nothing after"
        );
        assert_eq!(
            evs[2],
            Err(ProviderError::StreamInterrupted("connection reset".into()))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn cancellation_during_a_delay_returns_cancelled_promptly() {
        let p = ScriptedProvider::new([ScriptedResponse::text("late").delayed(60_000)]);
        let cancel = CancellationToken::new();
        let started = tokio::time::Instant::now();
        let call = {
            let p = p.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move { p.complete(&req("x"), cancel).await })
        };
        // Let the call reach its delay, then cancel; with paused time the
        // 60 s delay would auto-advance if the call were not waiting on it.
        tokio::task::yield_now().await;
        cancel.cancel();
        let result = call.await.unwrap();
        assert_eq!(result, Err(ProviderError::Cancelled));
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "did not wait out the delay"
        );
        // A cancelled token is honoured before anything is consumed.
        let p2 = ScriptedProvider::new([ScriptedResponse::text("x")]);
        assert!(matches!(
            p2.stream(&req("y"), cancel).await,
            Err(ProviderError::Cancelled)
        ));
        assert_eq!(p2.remaining(), 1);
    }

    #[tokio::test]
    async fn records_requests_in_order() {
        let p = ScriptedProvider::new([ScriptedResponse::text("1"), ScriptedResponse::text("2")]);
        p.complete(&req("first"), CancellationToken::new())
            .await
            .unwrap();
        p.complete(&req("second"), CancellationToken::new())
            .await
            .unwrap();
        let seen: Vec<String> = p
            .requests()
            .iter()
            .map(|r| r.messages.last().unwrap().text())
            .collect();
        assert_eq!(seen, ["first", "second"]);
    }

    #[tokio::test]
    async fn offline_provider_echoes_forever() {
        let p = ScriptedProvider::offline();
        for i in 0..3 {
            let r = p
                .complete(&req(&format!("msg {i}")), CancellationToken::new())
                .await
                .unwrap();
            assert!(r.message.text().contains(&format!("\"msg {i}\"")));
        }
    }

    #[test]
    fn script_serde_form_is_stable() {
        let script = Script {
            responses: vec![
                ScriptedResponse::text("hi").delayed(10),
                ScriptedResponse::tool_call("sleep", serde_json::json!({"ms": 5})),
                ScriptedResponse::error(ScriptedErrorKind::Auth, "set OPENAI_API_KEY"),
            ],
            when_exhausted: WhenExhausted::Echo,
        };
        insta::assert_yaml_snapshot!(script);
    }
}
