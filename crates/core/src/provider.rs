//! The [`Provider`] trait: a streaming chat completion with tool definitions,
//! the [`StreamEvent`]s it emits, its typed [`ProviderError`], and the
//! [`ResponseAccumulator`] that folds a stream into one assistant message.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::message::{Message, ToolCall};
use crate::usage::Usage;

/// A tool as the model sees it: name, description, JSON schema of arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// Unique tool name.
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// JSON schema of the arguments object.
    pub parameters: serde_json::Value,
}

/// One chat completion request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The conversation so far, system prompt first. Messages are shared
    /// (`Arc`) so a turn's request costs no copy of the history.
    pub messages: Vec<Arc<Message>>,
    /// Tools the model may call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolDefinition>,
    /// Upper bound on output tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
}

impl ChatRequest {
    /// A request for `messages` with no tools.
    pub fn new(messages: impl IntoIterator<Item = Message>) -> Self {
        Self {
            messages: messages.into_iter().map(Arc::new).collect(),
            ..Self::default()
        }
    }
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A natural end of the answer.
    Stop,
    /// The model wants tool calls executed.
    ToolCalls,
    /// The output token limit was reached.
    Length,
    /// The provider filtered the content.
    ContentFilter,
    /// A reason keel has no name for (kept verbatim).
    Other(String),
}

/// One increment of a streamed completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// A piece of assistant text.
    TextDelta {
        /// The new text.
        text: String,
    },
    /// A tool call begins at position `index` of this response.
    ToolCallStart {
        /// Position of the call in the response (stable across its deltas).
        index: u32,
        /// Provider-assigned call id.
        id: String,
        /// Tool name.
        name: String,
    },
    /// A fragment of a tool call's JSON arguments.
    ToolCallDelta {
        /// Which call the fragment belongs to.
        index: u32,
        /// The raw JSON fragment.
        arguments: String,
    },
    /// The call at `index` is complete.
    ToolCallEnd {
        /// Which call ended.
        index: u32,
    },
    /// Token usage of this call.
    Usage {
        /// The usage.
        usage: Usage,
    },
    /// The model stopped.
    Finish {
        /// Why.
        reason: FinishReason,
    },
}

/// A failed provider call. Variants document whether retrying may help.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProviderError {
    /// 429: retryable after `retry_after` when the provider said so.
    #[error("rate limited by the provider{}", match retry_after { Some(d) => format!(" (retry after {} ms)", d.as_millis()), None => String::new() })]
    RateLimited {
        /// The provider's `retry-after`, if any.
        retry_after: Option<Duration>,
    },
    /// 5xx: retryable.
    #[error("provider server error {status}: {message}")]
    Server {
        /// HTTP status.
        status: u16,
        /// The provider's message, bounded.
        message: String,
    },
    /// The connection could not be established: retryable.
    #[error("cannot connect to the provider: {0}")]
    Connect(String),
    /// No response or no new bytes within the configured time: retryable.
    #[error("provider timed out: {0}")]
    Timeout(String),
    /// 401/403: fatal; the message says which credential to fix.
    #[error("provider rejected the credentials ({status}): {message}")]
    Auth {
        /// HTTP status.
        status: u16,
        /// What to fix, e.g. which env var holds the key.
        message: String,
    },
    /// 400 and other 4xx: fatal, the request itself is wrong.
    #[error("provider rejected the request ({status}): {message}")]
    BadRequest {
        /// HTTP status.
        status: u16,
        /// The provider's message, bounded.
        message: String,
    },
    /// The stream ended before the response was complete: fatal for this call
    /// (output was already emitted), the caller may start the step over.
    #[error("provider stream ended early: {0}")]
    StreamInterrupted(String),
    /// The provider sent something keel cannot parse: fatal.
    #[error("provider sent a malformed response: {0}")]
    Protocol(String),
    /// The call's cancellation token fired.
    #[error("provider call cancelled")]
    Cancelled,
    /// The provider cannot answer at all (e.g. a script ran out): fatal.
    #[error("provider unavailable: {0}")]
    Unavailable(String),
    /// The request is longer than the model's context window: fatal as sent;
    /// a shorter (compacted) request may succeed.
    #[error("the request exceeds the model's context window: {0}")]
    ContextLengthExceeded(String),
    /// The response broke a configured bound (total bytes, tool-argument
    /// bytes, total time of the call); the message names the key: fatal.
    #[error("provider response over a limit: {0}")]
    LimitExceeded(String),
}

impl ProviderError {
    /// Whether the same request may succeed if sent again.
    pub fn is_retryable(&self) -> bool {
        match self {
            ProviderError::RateLimited { .. }
            | ProviderError::Connect(_)
            | ProviderError::Timeout(_) => true,
            ProviderError::Server { status, .. } => *status >= 500,
            ProviderError::Auth { .. }
            | ProviderError::BadRequest { .. }
            | ProviderError::StreamInterrupted(_)
            | ProviderError::Protocol(_)
            | ProviderError::Cancelled
            | ProviderError::Unavailable(_)
            | ProviderError::ContextLengthExceeded(_)
            | ProviderError::LimitExceeded(_) => false,
        }
    }

    /// How long the provider asked to wait before retrying.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ProviderError::RateLimited { retry_after } => *retry_after,
            _ => None,
        }
    }
}

/// The stream of events of one completion.
pub type ProviderStream = BoxStream<'static, Result<StreamEvent, ProviderError>>;

/// A whole completion: the assistant message, usage and finish reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderResponse {
    /// The assistant message (text and/or tool calls).
    pub message: Message,
    /// Usage reported by the provider (zero when it reported none).
    pub usage: Usage,
    /// Why the model stopped.
    pub finish_reason: FinishReason,
}

/// A chat model behind some API.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Provider kind, e.g. `openai`, `anthropic`, `scripted`.
    fn name(&self) -> &str;

    /// Model identifier sent to the provider.
    fn model(&self) -> &str;

    /// Whether the model takes images (a profile's `images = false` says it does not).
    fn accepts_images(&self) -> bool {
        true
    }

    /// Starts a streamed completion of `request` (borrowed: callers reuse it
    /// across the iterations of a turn). The stream ends with
    /// `Err(ProviderError::Cancelled)` soon after `cancel` fires.
    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError>;

    /// Runs a completion to its end and assembles the response.
    async fn complete(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderResponse, ProviderError> {
        let mut stream = self.stream(request, cancel.clone()).await?;
        let mut acc = ResponseAccumulator::default();
        loop {
            let next = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(ProviderError::Cancelled),
                next = stream.next() => next,
            };
            match next {
                Some(event) => acc.push(event?)?,
                None => return acc.finish(),
            }
        }
    }
}

#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// Folds [`StreamEvent`]s into a [`ProviderResponse`].
#[derive(Debug, Default)]
pub struct ResponseAccumulator {
    text: String,
    calls: BTreeMap<u32, PartialCall>,
    usage: Usage,
    finish: Option<FinishReason>,
}

impl ResponseAccumulator {
    /// Applies one event. A delta for a call that never started is a
    /// protocol error.
    pub fn push(&mut self, event: StreamEvent) -> Result<(), ProviderError> {
        match event {
            StreamEvent::TextDelta { text } => self.text.push_str(&text),
            StreamEvent::ToolCallStart { index, id, name } => {
                self.calls.insert(
                    index,
                    PartialCall {
                        id,
                        name,
                        arguments: String::new(),
                    },
                );
            }
            StreamEvent::ToolCallDelta { index, arguments } => {
                let call = self.calls.get_mut(&index).ok_or_else(|| {
                    ProviderError::Protocol(format!("arguments for unknown tool call #{index}"))
                })?;
                call.arguments.push_str(&arguments);
            }
            StreamEvent::ToolCallEnd { index } => {
                if !self.calls.contains_key(&index) {
                    return Err(ProviderError::Protocol(format!(
                        "end of unknown tool call #{index}"
                    )));
                }
            }
            StreamEvent::Usage { usage } => self.usage.add(usage),
            StreamEvent::Finish { reason } => self.finish = Some(reason),
        }
        Ok(())
    }

    /// The assembled response. Arguments that are not valid JSON are kept as
    /// a JSON string so the tool can report them to the model.
    pub fn finish(self) -> Result<ProviderResponse, ProviderError> {
        let has_calls = !self.calls.is_empty();
        let calls: Vec<ToolCall> = self
            .calls
            .into_values()
            .map(|c| {
                let arguments = if c.arguments.trim().is_empty() {
                    serde_json::Value::Object(Default::default())
                } else {
                    serde_json::from_str(&c.arguments)
                        .unwrap_or(serde_json::Value::String(c.arguments))
                };
                ToolCall {
                    id: c.id,
                    name: c.name,
                    arguments,
                }
            })
            .collect();
        let finish_reason = match self.finish {
            Some(r) => r,
            None if has_calls => FinishReason::ToolCalls,
            None => {
                return Err(ProviderError::StreamInterrupted(
                    "no finish reason received".into(),
                ))
            }
        };
        Ok(ProviderResponse {
            message: Message::assistant_with_tools(self.text, calls),
            usage: self.usage,
            finish_reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulator_assembles_split_parallel_tool_calls() {
        let mut acc = ResponseAccumulator::default();
        let events = [
            StreamEvent::TextDelta {
                text: "Let me ".into(),
            },
            StreamEvent::TextDelta {
                text: "look.".into(),
            },
            StreamEvent::ToolCallStart {
                index: 1,
                id: "b".into(),
                name: "list_dir".into(),
            },
            StreamEvent::ToolCallStart {
                index: 0,
                id: "a".into(),
                name: "read_file".into(),
            },
            StreamEvent::ToolCallDelta {
                index: 0,
                arguments: "{\"pa".into(),
            },
            StreamEvent::ToolCallDelta {
                index: 1,
                arguments: "{}".into(),
            },
            StreamEvent::ToolCallDelta {
                index: 0,
                arguments: "th\":\"x\"}".into(),
            },
            StreamEvent::ToolCallEnd { index: 0 },
            StreamEvent::Usage {
                usage: Usage::new(5, 7),
            },
            StreamEvent::Finish {
                reason: FinishReason::ToolCalls,
            },
        ];
        for e in events {
            acc.push(e).unwrap();
        }
        let r = acc.finish().unwrap();
        assert_eq!(r.message.text(), "Let me look.");
        let names: Vec<_> = r
            .message
            .tool_calls
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(names, ["read_file", "list_dir"], "ordered by index");
        assert_eq!(
            r.message.tool_calls[0].arguments,
            serde_json::json!({"path": "x"})
        );
        assert_eq!(r.usage, Usage::new(5, 7));
    }

    #[test]
    fn accumulator_rejects_orphan_delta_and_missing_finish() {
        let mut acc = ResponseAccumulator::default();
        let err = acc
            .push(StreamEvent::ToolCallDelta {
                index: 3,
                arguments: "{".into(),
            })
            .unwrap_err();
        assert_eq!(
            err,
            ProviderError::Protocol("arguments for unknown tool call #3".into())
        );
        let mut acc = ResponseAccumulator::default();
        acc.push(StreamEvent::TextDelta {
            text: "half".into(),
        })
        .unwrap();
        assert!(matches!(
            acc.finish(),
            Err(ProviderError::StreamInterrupted(_))
        ));
    }

    #[test]
    fn invalid_arguments_are_kept_verbatim() {
        let mut acc = ResponseAccumulator::default();
        acc.push(StreamEvent::ToolCallStart {
            index: 0,
            id: "a".into(),
            name: "t".into(),
        })
        .unwrap();
        acc.push(StreamEvent::ToolCallDelta {
            index: 0,
            arguments: "{oops".into(),
        })
        .unwrap();
        let r = acc.finish().unwrap();
        assert_eq!(r.finish_reason, FinishReason::ToolCalls);
        assert_eq!(
            r.message.tool_calls[0].arguments,
            serde_json::json!("{oops")
        );
    }

    #[test]
    fn retry_classification() {
        let retryable = [
            ProviderError::RateLimited {
                retry_after: Some(Duration::from_millis(1500)),
            },
            ProviderError::Server {
                status: 503,
                message: "busy".into(),
            },
            ProviderError::Connect("refused".into()),
            ProviderError::Timeout("read".into()),
        ];
        let fatal = [
            ProviderError::Auth {
                status: 401,
                message: "set OPENAI_API_KEY".into(),
            },
            ProviderError::BadRequest {
                status: 400,
                message: "bad".into(),
            },
            ProviderError::Protocol("x".into()),
            ProviderError::StreamInterrupted("cut".into()),
            ProviderError::Cancelled,
            ProviderError::Unavailable("script exhausted".into()),
            ProviderError::ContextLengthExceeded("prompt is too long".into()),
            ProviderError::LimitExceeded(
                "the response is longer than 1024 bytes (the limit is providers.main.max_response_bytes)"
                    .into(),
            ),
        ];
        assert!(retryable.iter().all(ProviderError::is_retryable));
        assert!(!fatal.iter().any(ProviderError::is_retryable));
        let all: Vec<String> = retryable
            .iter()
            .chain(&fatal)
            .map(|e| e.to_string())
            .collect();
        insta::assert_yaml_snapshot!(all);
        assert_eq!(
            retryable[0].retry_after(),
            Some(Duration::from_millis(1500))
        );
    }

    #[test]
    fn serde_forms_are_stable() {
        let events = vec![
            StreamEvent::TextDelta { text: "hi".into() },
            StreamEvent::ToolCallStart {
                index: 0,
                id: "c1".into(),
                name: "sleep".into(),
            },
            StreamEvent::ToolCallDelta {
                index: 0,
                arguments: "{\"ms\":1}".into(),
            },
            StreamEvent::ToolCallEnd { index: 0 },
            StreamEvent::Usage {
                usage: Usage::new(1, 2),
            },
            StreamEvent::Finish {
                reason: FinishReason::Stop,
            },
            StreamEvent::Finish {
                reason: FinishReason::Other("pause_turn".into()),
            },
        ];
        let request = ChatRequest {
            messages: vec![Message::system("s").into(), Message::user("u").into()],
            tools: vec![ToolDefinition {
                name: "sleep".into(),
                description: "Waits.".into(),
                parameters: serde_json::json!({"type": "object"}),
            }],
            max_tokens: Some(256),
            temperature: None,
        };
        insta::assert_json_snapshot!((events, request));
    }
}
