//! The Anthropic Messages (`/messages`) adapter: request mapping (system
//! prompt apart, tool results as `tool_result` blocks) and the streaming event
//! decoder.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use eventsource_stream::Event;
use keel_core::{
    ChatRequest, ContentPart, FinishReason, Message, Provider, ProviderError, ProviderStream, Role,
    StreamEvent, Usage,
};
use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::http::{
    classify, saturating_count_opt, secret_header, truncate_chars, Decoder, HttpProviderConfig,
    Progress, SleepFn, Transport,
};

/// The Messages API version keel speaks.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` sent when neither the request nor the profile sets one (the
/// API requires it).
pub const DEFAULT_ANTHROPIC_MAX_TOKENS: u32 = 4096;

/// A provider speaking the Anthropic Messages wire format.
pub struct AnthropicProvider {
    config: HttpProviderConfig,
    transport: Arc<Transport>,
}

impl std::fmt::Debug for AnthropicProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnthropicProvider")
            .field("config", &self.config)
            .finish()
    }
}

impl AnthropicProvider {
    /// An adapter posting to `{base_url}/messages`; fails only when the HTTP
    /// client cannot be built or the key is not a valid header.
    pub fn new(config: HttpProviderConfig) -> Result<Self, ProviderError> {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(
            "anthropic-version",
            HeaderValue::from_static(ANTHROPIC_VERSION),
        );
        if let Some(key) = &config.api_key {
            headers.insert("x-api-key", secret_header(key)?);
        }
        let transport = Transport::new(&config, "messages", headers)?;
        Ok(Self {
            config,
            transport: Arc::new(transport),
        })
    }

    /// Replaces the timer of backoff and `retry-after` waits (tests record
    /// the delays instead of sleeping).
    pub fn with_sleep(mut self, sleep: SleepFn) -> Self {
        if let Some(t) = Arc::get_mut(&mut self.transport) {
            t.set_sleep(sleep);
        }
        self
    }

    /// The JSON body sent for `request`.
    pub fn request_body(&self, request: &ChatRequest) -> Value {
        let system: Vec<String> = request
            .messages
            .iter()
            .filter(|m| m.role == Role::System)
            .map(|m| m.text())
            .filter(|t| !t.is_empty())
            .collect();
        let max_tokens = request
            .max_tokens
            .or(self.config.max_tokens)
            .unwrap_or(DEFAULT_ANTHROPIC_MAX_TOKENS);
        let mut body = json!({
            "model": self.config.model,
            "max_tokens": max_tokens,
            "messages": conversation(&request.messages),
            "stream": true,
        });
        if !system.is_empty() {
            body["system"] = Value::String(system.join("\n\n"));
        }
        if !request.tools.is_empty() {
            body["tools"] = request
                .tools
                .iter()
                .map(|t| {
                    json!({
                        "name": t.name,
                        "description": t.description,
                        "input_schema": t.parameters,
                    })
                })
                .collect();
        }
        if let Some(t) = request.temperature {
            body["temperature"] = json!(t);
        }
        body
    }
}

#[async_trait]
impl Provider for AnthropicProvider {
    fn name(&self) -> &str {
        "anthropic"
    }

    fn model(&self) -> &str {
        &self.config.model
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        self.transport
            .stream_json(&self.request_body(request), AnthropicDecoder::new, cancel)
            .await
    }
}

/// The non-system messages as Anthropic turns. Tool results become user
/// turns, and consecutive turns of one role are merged, because the API wants
/// all results of an assistant turn in the single user turn that follows it.
fn conversation(messages: &[Arc<Message>]) -> Vec<Value> {
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for m in messages {
        let (role, blocks) = match m.role {
            Role::System => continue,
            Role::User => ("user", content_blocks(&m.content)),
            Role::Assistant => {
                let mut blocks = content_blocks(&m.content);
                blocks.extend(m.tool_calls.iter().map(|c| {
                    // The API accepts only an object; arguments the model
                    // garbled were already reported by the tool result.
                    let input = if c.arguments.is_object() {
                        c.arguments.clone()
                    } else {
                        json!({})
                    };
                    json!({ "type": "tool_use", "id": c.id, "name": c.name, "input": input })
                }));
                ("assistant", blocks)
            }
            Role::Tool => (
                "user",
                vec![json!({
                    "type": "tool_result",
                    "tool_use_id": m.tool_call_id.as_deref().unwrap_or_default(),
                    "content": m.text(),
                })],
            ),
        };
        // The API rejects empty turns and empty text blocks.
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, existing)) if *last == role => existing.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    turns
        .into_iter()
        .map(|(role, content)| json!({ "role": role, "content": content }))
        .collect()
}

fn content_blocks(parts: &[ContentPart]) -> Vec<Value> {
    parts
        .iter()
        .filter_map(|p| match p {
            ContentPart::Text { text } if text.is_empty() => None,
            ContentPart::Text { text } => Some(json!({ "type": "text", "text": text })),
            ContentPart::ImageRef { uri, .. } => Some(image_block(uri)),
        })
        .collect()
}

/// An image block: a `data:…;base64,` URL (a stored image, resolved by the
/// engine) as a base64 source, any other URL as a URL source.
fn image_block(uri: &str) -> Value {
    let inline = uri
        .strip_prefix("data:")
        .and_then(|rest| rest.split_once(";base64,"));
    match inline {
        Some((media_type, data)) => json!({
            "type": "image",
            "source": { "type": "base64", "media_type": media_type, "data": data },
        }),
        None => json!({
            "type": "image",
            "source": { "type": "url", "url": uri },
        }),
    }
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireEvent {
    MessageStart {
        message: WireMessage,
    },
    ContentBlockStart {
        index: u32,
        content_block: WireBlock,
    },
    ContentBlockDelta {
        index: u32,
        delta: WireDelta,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: WireMessageDelta,
        #[serde(default)]
        usage: Option<WireUsage>,
    },
    MessageStop,
    Ping,
    Error {
        error: WireError,
    },
    /// Anthropic may add event types; unknown ones are skipped.
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Deserialize)]
struct WireMessage {
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireBlock {
    Text {
        #[serde(default)]
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
    },
    /// Thinking, server tools and future block types.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireDelta {
    TextDelta {
        text: String,
    },
    InputJsonDelta {
        partial_json: String,
    },
    /// Thinking, signature, citation and future delta types.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct WireMessageDelta {
    #[serde(default)]
    stop_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct WireUsage {
    #[serde(default, deserialize_with = "saturating_count_opt")]
    input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "saturating_count_opt")]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "saturating_count_opt")]
    cache_read_input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "saturating_count_opt")]
    output_tokens: Option<u64>,
}

impl WireUsage {
    /// All input tokens, cached or not: what the prompt occupied.
    fn prompt(&self) -> Option<u64> {
        let parts = [
            self.input_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
        ];
        parts.iter().any(Option::is_some).then(|| {
            parts
                .iter()
                .flatten()
                .fold(0u64, |a, b| a.saturating_add(*b))
        })
    }
}

#[derive(Debug, Deserialize)]
struct WireError {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    message: String,
}

#[derive(Debug, Clone, Copy)]
enum Block {
    Text,
    ToolUse { ordinal: u32, ended: bool },
    Ignored,
}

/// Turns Messages stream events into [`StreamEvent`]s.
pub(crate) struct AnthropicDecoder {
    hint: Arc<str>,
    blocks: HashMap<u32, Block>,
    next_ordinal: u32,
    prompt_tokens: u64,
    completion_tokens: u64,
    stop: Option<FinishReason>,
}

impl AnthropicDecoder {
    pub(crate) fn new(hint: Arc<str>) -> Self {
        Self {
            hint,
            blocks: HashMap::new(),
            next_ordinal: 0,
            prompt_tokens: 0,
            completion_tokens: 0,
            stop: None,
        }
    }

    fn record_usage(&mut self, usage: &WireUsage) {
        // Both counts are cumulative in the stream: keep the latest.
        if let Some(p) = usage.prompt() {
            self.prompt_tokens = p;
        }
        if let Some(o) = usage.output_tokens {
            self.completion_tokens = o;
        }
    }

    fn block(&self, index: u32) -> Result<Block, ProviderError> {
        self.blocks.get(&index).copied().ok_or_else(|| {
            ProviderError::Protocol(format!("event for unknown content block #{index}"))
        })
    }

    /// The closing events once the message is complete.
    fn complete(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        let Some(reason) = self.stop.take() else {
            return Err(ProviderError::Protocol(
                "message_stop without a stop reason".into(),
            ));
        };
        let mut open: Vec<u32> = self
            .blocks
            .values()
            .filter_map(|b| match b {
                Block::ToolUse {
                    ordinal,
                    ended: false,
                } => Some(*ordinal),
                _ => None,
            })
            .collect();
        open.sort_unstable();
        out.extend(
            open.into_iter()
                .map(|index| StreamEvent::ToolCallEnd { index }),
        );
        out.push_back(StreamEvent::Usage {
            usage: Usage::new(self.prompt_tokens, self.completion_tokens),
        });
        out.push_back(StreamEvent::Finish { reason });
        Ok(())
    }
}

/// Maps an Anthropic `stop_reason`.
fn stop_reason(reason: &str) -> FinishReason {
    match reason {
        "end_turn" | "stop_sequence" => FinishReason::Stop,
        "tool_use" => FinishReason::ToolCalls,
        "max_tokens" => FinishReason::Length,
        "refusal" => FinishReason::ContentFilter,
        other => FinishReason::Other(other.to_owned()),
    }
}

/// The HTTP status an in-stream error type stands for.
fn error_status(kind: &str) -> u16 {
    match kind {
        "invalid_request_error" => 400,
        "authentication_error" => 401,
        "billing_error" => 402,
        "permission_error" => 403,
        "not_found_error" => 404,
        "request_too_large" => 413,
        "rate_limit_error" => 429,
        "overloaded_error" => 529,
        _ => 500,
    }
}

impl Decoder for AnthropicDecoder {
    fn on_event(
        &mut self,
        event: &Event,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<Progress, ProviderError> {
        let wire: WireEvent = serde_json::from_str(&event.data).map_err(|e| {
            ProviderError::Protocol(format!(
                "invalid {} event ({e}): {}",
                event.event,
                truncate_chars(&event.data, 200)
            ))
        })?;
        match wire {
            WireEvent::MessageStart { message } => {
                if let Some(usage) = message.usage {
                    self.record_usage(&usage);
                }
            }
            WireEvent::ContentBlockStart {
                index,
                content_block,
            } => {
                let block = match content_block {
                    WireBlock::Text { text } => {
                        if !text.is_empty() {
                            out.push_back(StreamEvent::TextDelta { text });
                        }
                        Block::Text
                    }
                    WireBlock::ToolUse { id, name } => {
                        let ordinal = self.next_ordinal;
                        self.next_ordinal += 1;
                        out.push_back(StreamEvent::ToolCallStart {
                            index: ordinal,
                            id,
                            name,
                        });
                        Block::ToolUse {
                            ordinal,
                            ended: false,
                        }
                    }
                    WireBlock::Other => Block::Ignored,
                };
                self.blocks.insert(index, block);
            }
            WireEvent::ContentBlockDelta { index, delta } => match (self.block(index)?, delta) {
                (Block::Text, WireDelta::TextDelta { text }) if !text.is_empty() => {
                    out.push_back(StreamEvent::TextDelta { text });
                }
                (Block::ToolUse { ordinal, .. }, WireDelta::InputJsonDelta { partial_json })
                    if !partial_json.is_empty() =>
                {
                    out.push_back(StreamEvent::ToolCallDelta {
                        index: ordinal,
                        arguments: partial_json,
                    });
                }
                _ => {}
            },
            WireEvent::ContentBlockStop { index } => {
                if let Block::ToolUse {
                    ordinal,
                    ended: false,
                } = self.block(index)?
                {
                    self.blocks.insert(
                        index,
                        Block::ToolUse {
                            ordinal,
                            ended: true,
                        },
                    );
                    out.push_back(StreamEvent::ToolCallEnd { index: ordinal });
                }
            }
            WireEvent::MessageDelta { delta, usage } => {
                if let Some(reason) = delta.stop_reason {
                    self.stop = Some(stop_reason(&reason));
                }
                if let Some(usage) = usage {
                    self.record_usage(&usage);
                }
            }
            WireEvent::MessageStop => {
                self.complete(out)?;
                return Ok(Progress::Done);
            }
            WireEvent::Error { error } => {
                let message = if error.message.is_empty() {
                    error.kind.clone()
                } else {
                    error.message
                };
                return Err(classify(
                    error_status(&error.kind),
                    &message,
                    None,
                    &self.hint,
                ));
            }
            WireEvent::Ping | WireEvent::Unknown => {}
        }
        Ok(Progress::More)
    }

    fn on_eof(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        // A stop reason without `message_stop` is a complete answer; anything
        // less is a cut stream.
        if self.stop.is_none() {
            return Err(ProviderError::StreamInterrupted(
                "the connection closed before the message was complete".into(),
            ));
        }
        self.complete(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(events: &[(&str, &str)]) -> (Vec<StreamEvent>, Result<(), ProviderError>) {
        let mut d = AnthropicDecoder::new("check the API key in ANTHROPIC_API_KEY".into());
        let mut out = VecDeque::new();
        for (name, data) in events {
            let event = Event {
                event: (*name).to_owned(),
                data: (*data).to_owned(),
                ..Event::default()
            };
            match d.on_event(&event, &mut out) {
                Ok(Progress::Done) => return (out.into(), Ok(())),
                Ok(Progress::More) => {}
                Err(e) => return (out.into(), Err(e)),
            }
        }
        let end = d.on_eof(&mut out);
        (out.into(), end)
    }

    #[test]
    fn thinking_and_unknown_events_are_skipped() {
        let (events, end) = decode(&[
            (
                "message_start",
                r#"{"type":"message_start","message":{"id":"m","usage":{"input_tokens":10,"cache_read_input_tokens":5,"output_tokens":1}}}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hmm"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"x"}}"#,
            ),
            (
                "content_block_stop",
                r#"{"type":"content_block_stop","index":0}"#,
            ),
            (
                "future_event",
                r#"{"type":"future_event","whatever":[1,2]}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"ok"}}"#,
            ),
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"refusal"},"usage":{"output_tokens":3}}"#,
            ),
            ("message_stop", r#"{"type":"message_stop"}"#),
        ]);
        end.unwrap();
        assert_eq!(
            events,
            [
                StreamEvent::TextDelta { text: "ok".into() },
                StreamEvent::Usage {
                    usage: Usage::new(15, 3)
                },
                StreamEvent::Finish {
                    reason: FinishReason::ContentFilter
                },
            ]
        );
    }

    #[test]
    fn error_events_are_typed() {
        let (_, end) = decode(&[(
            "error",
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        )]);
        assert_eq!(
            end,
            Err(ProviderError::Server {
                status: 529,
                message: "Overloaded".into()
            })
        );
        let (_, end) = decode(&[(
            "error",
            r#"{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}"#,
        )]);
        assert_eq!(
            end.unwrap_err().to_string(),
            "provider rejected the credentials (401): invalid x-api-key (check the API key in ANTHROPIC_API_KEY)"
        );
        let (_, end) = decode(&[(
            "error",
            r#"{"type":"error","error":{"type":"rate_limit_error","message":"slow"}}"#,
        )]);
        assert_eq!(end, Err(ProviderError::RateLimited { retry_after: None }));
    }

    #[test]
    fn deltas_for_unknown_blocks_and_missing_stop_reasons_are_rejected() {
        let (_, end) = decode(&[(
            "content_block_delta",
            r#"{"type":"content_block_delta","index":4,"delta":{"type":"text_delta","text":"x"}}"#,
        )]);
        assert!(matches!(end, Err(ProviderError::Protocol(_))));
        let (_, end) = decode(&[("message_stop", r#"{"type":"message_stop"}"#)]);
        assert!(matches!(end, Err(ProviderError::Protocol(_))));
        let (_, end) = decode(&[(
            "message_start",
            r#"{"type":"message_start","message":{"usage":{"input_tokens":1}}}"#,
        )]);
        assert!(matches!(end, Err(ProviderError::StreamInterrupted(_))));
    }

    #[test]
    fn eof_after_a_stop_reason_completes() {
        let (events, end) = decode(&[(
            "message_delta",
            r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"output_tokens":9}}"#,
        )]);
        end.unwrap();
        assert_eq!(
            events.last(),
            Some(&StreamEvent::Finish {
                reason: FinishReason::Length
            })
        );
    }

    #[test]
    fn inline_images_go_as_base64_and_urls_as_urls() {
        let blocks = content_blocks(&[
            ContentPart::Text {
                text: "look".into(),
            },
            ContentPart::ImageRef {
                uri: "data:image/png;base64,iVBORw0K".into(),
                mime_type: Some("image/png".into()),
            },
            ContentPart::ImageRef {
                uri: "https://example.com/a.png".into(),
                mime_type: None,
            },
        ]);
        assert_eq!(
            blocks,
            vec![
                json!({"type": "text", "text": "look"}),
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}),
                json!({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}),
            ]
        );
    }

    #[test]
    fn stop_reasons_map() {
        assert_eq!(stop_reason("end_turn"), FinishReason::Stop);
        assert_eq!(stop_reason("stop_sequence"), FinishReason::Stop);
        assert_eq!(stop_reason("tool_use"), FinishReason::ToolCalls);
        assert_eq!(
            stop_reason("pause_turn"),
            FinishReason::Other("pause_turn".into())
        );
    }
}
