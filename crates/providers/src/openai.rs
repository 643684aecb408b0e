//! The OpenAI-compatible `/chat/completions` adapter (OpenAI, DeepSeek, Qwen,
//! Ollama, vLLM, llama.cpp server, LiteLLM …): request mapping and the
//! streaming chunk decoder.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use eventsource_stream::Event;
use keel_core::{
    ChatRequest, ContentPart, FinishReason, Message, Provider, ProviderError, ProviderStream, Role,
    StreamEvent, ToolCall, Usage,
};
use reqwest::header::HeaderValue;
use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_TYPE};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::http::{
    classify, saturating_count, secret_header, truncate_chars, Decoder, HttpProviderConfig,
    Progress, SleepFn, Transport,
};

/// A provider speaking the OpenAI chat completions wire format.
pub struct OpenAiProvider {
    config: HttpProviderConfig,
    transport: Arc<Transport>,
}

impl std::fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiProvider")
            .field("config", &self.config)
            .finish()
    }
}

impl OpenAiProvider {
    /// An adapter posting to `{base_url}/chat/completions`; fails only when
    /// the HTTP client cannot be built or the key is not a valid header.
    pub fn new(config: HttpProviderConfig) -> Result<Self, ProviderError> {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(key) = &config.api_key {
            headers.insert(AUTHORIZATION, secret_header(&format!("Bearer {key}"))?);
        }
        let transport = Transport::new(&config, "chat/completions", headers)?;
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
        let mut body = json!({
            "model": self.config.model,
            "messages": request.messages.iter().map(|m| message_json(m)).collect::<Vec<_>>(),
            "stream": true,
            "stream_options": { "include_usage": true },
        });
        if !request.tools.is_empty() {
            body["tools"] = request
                .tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "function",
                        "function": {
                            "name": t.name,
                            "description": t.description,
                            "parameters": t.parameters,
                        }
                    })
                })
                .collect();
        }
        if let Some(max) = request.max_tokens.or(self.config.max_tokens) {
            body["max_tokens"] = json!(max);
        }
        if let Some(t) = request.temperature {
            body["temperature"] = json!(t);
        }
        body
    }
}

#[async_trait]
impl Provider for OpenAiProvider {
    fn name(&self) -> &str {
        "openai"
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
            .stream_json(&self.request_body(request), OpenAiDecoder::new, cancel)
            .await
    }
}

/// One message in the chat completions format.
fn message_json(m: &Message) -> Value {
    match m.role {
        Role::System => json!({ "role": "system", "content": m.text() }),
        Role::User => json!({ "role": "user", "content": user_content(&m.content) }),
        Role::Assistant => {
            let text = m.text();
            let mut v = json!({
                "role": "assistant",
                "content": if text.is_empty() { Value::Null } else { Value::String(text) },
            });
            if !m.tool_calls.is_empty() {
                v["tool_calls"] = m.tool_calls.iter().map(tool_call_json).collect();
            }
            v
        }
        // A missing id is left for the server to reject: the engine always
        // sets it, and a local error would hide which message was wrong.
        Role::Tool => json!({
            "role": "tool",
            "tool_call_id": m.tool_call_id.as_deref().unwrap_or_default(),
            "content": m.text(),
        }),
    }
}

/// Plain text stays a string (every compatible server accepts it); images
/// need the array form.
fn user_content(parts: &[ContentPart]) -> Value {
    if parts.iter().all(|p| matches!(p, ContentPart::Text { .. })) {
        let text: String = parts
            .iter()
            .filter_map(|p| match p {
                ContentPart::Text { text } => Some(text.as_str()),
                ContentPart::ImageRef { .. } => None,
            })
            .collect();
        return Value::String(text);
    }
    parts
        .iter()
        .map(|p| match p {
            ContentPart::Text { text } => json!({ "type": "text", "text": text }),
            ContentPart::ImageRef { uri, .. } => {
                json!({ "type": "image_url", "image_url": { "url": uri } })
            }
        })
        .collect()
}

fn tool_call_json(call: &ToolCall) -> Value {
    // Arguments that were not valid JSON are kept as a string: send them back
    // verbatim so the model sees what it wrote.
    let arguments = match &call.arguments {
        Value::String(raw) => raw.clone(),
        other => other.to_string(),
    };
    json!({
        "id": call.id,
        "type": "function",
        "function": { "name": call.name, "arguments": arguments },
    })
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<WireError>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
}

#[derive(Debug, Deserialize)]
struct WireToolCall {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunction>,
}

#[derive(Debug, Default, Deserialize)]
struct WireFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    #[serde(default, deserialize_with = "saturating_count")]
    prompt_tokens: u64,
    #[serde(default, deserialize_with = "saturating_count")]
    completion_tokens: u64,
}

#[derive(Debug, Deserialize)]
struct WireError {
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    code: Option<Value>,
}

/// A tool call being streamed, keyed by the wire `index`.
#[derive(Debug)]
struct OpenCall {
    /// The keel index: order of appearance in this response.
    ordinal: u32,
    id: Option<String>,
    name: String,
    /// Whether `ToolCallStart` was emitted (needs the name).
    started: bool,
    /// Argument fragments that arrived before the name.
    buffered: String,
    ended: bool,
}

/// Turns chat completion chunks into [`StreamEvent`]s.
pub(crate) struct OpenAiDecoder {
    hint: Arc<str>,
    calls: BTreeMap<u32, OpenCall>,
    next_ordinal: u32,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
}

impl OpenAiDecoder {
    pub(crate) fn new(hint: Arc<str>) -> Self {
        Self {
            hint,
            calls: BTreeMap::new(),
            next_ordinal: 0,
            finish: None,
            usage: None,
        }
    }

    fn tool_delta(
        &mut self,
        position: usize,
        wire: WireToolCall,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<(), ProviderError> {
        let key = wire
            .index
            .unwrap_or_else(|| u32::try_from(position).unwrap_or(u32::MAX));
        let id = wire.id.filter(|s| !s.is_empty());
        let function = wire.function.unwrap_or_default();
        // Some servers reuse index 0 for parallel calls: a new id at a used
        // index starts a new call.
        let fresh = match self.calls.get(&key) {
            None => true,
            Some(c) => c.ended || matches!((&c.id, &id), (Some(old), Some(new)) if old != new),
        };
        if fresh {
            if let Some(previous) = self.calls.remove(&key) {
                end_call(previous, out)?;
            }
            let ordinal = self.next_ordinal;
            self.next_ordinal += 1;
            self.calls.insert(
                key,
                OpenCall {
                    ordinal,
                    id: None,
                    name: String::new(),
                    started: false,
                    buffered: String::new(),
                    ended: false,
                },
            );
        }
        let Some(call) = self.calls.get_mut(&key) else {
            return Ok(());
        };
        if call.id.is_none() {
            call.id = id;
        }
        let arguments = function.arguments.unwrap_or_default();
        if call.started {
            if !arguments.is_empty() {
                out.push_back(StreamEvent::ToolCallDelta {
                    index: call.ordinal,
                    arguments,
                });
            }
            return Ok(());
        }
        if let Some(name) = function.name {
            call.name.push_str(&name);
        }
        call.buffered.push_str(&arguments);
        if !call.name.is_empty() {
            call.started = true;
            out.push_back(StreamEvent::ToolCallStart {
                index: call.ordinal,
                id: call
                    .id
                    .clone()
                    .unwrap_or_else(|| format!("call_{}", call.ordinal)),
                name: call.name.clone(),
            });
            if !call.buffered.is_empty() {
                out.push_back(StreamEvent::ToolCallDelta {
                    index: call.ordinal,
                    arguments: std::mem::take(&mut call.buffered),
                });
            }
        }
        Ok(())
    }

    /// Ends every open call, in the order they appeared.
    fn close_calls(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        let mut open: Vec<&mut OpenCall> = self.calls.values_mut().filter(|c| !c.ended).collect();
        open.sort_by_key(|c| c.ordinal);
        for call in open {
            if !call.started {
                return Err(ProviderError::Protocol(format!(
                    "tool call #{} has no function name",
                    call.ordinal
                )));
            }
            call.ended = true;
            out.push_back(StreamEvent::ToolCallEnd {
                index: call.ordinal,
            });
        }
        Ok(())
    }

    /// The closing events once the response is complete.
    fn complete(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<Progress, ProviderError> {
        let Some(reason) = self.finish.take() else {
            return Err(ProviderError::StreamInterrupted(
                "the stream ended without a finish reason".into(),
            ));
        };
        self.close_calls(out)?;
        if let Some(usage) = self.usage.take() {
            out.push_back(StreamEvent::Usage { usage });
        }
        // Some servers say `stop` after tool calls; the calls are what counts.
        let reason = match reason {
            FinishReason::Stop if !self.calls.is_empty() => FinishReason::ToolCalls,
            r => r,
        };
        out.push_back(StreamEvent::Finish { reason });
        Ok(Progress::Done)
    }
}

fn end_call(call: OpenCall, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
    if call.ended {
        return Ok(());
    }
    if !call.started {
        return Err(ProviderError::Protocol(format!(
            "tool call #{} has no function name",
            call.ordinal
        )));
    }
    out.push_back(StreamEvent::ToolCallEnd {
        index: call.ordinal,
    });
    Ok(())
}

/// Maps an OpenAI `finish_reason`.
fn finish_reason(reason: &str) -> FinishReason {
    match reason {
        "stop" => FinishReason::Stop,
        "tool_calls" | "function_call" => FinishReason::ToolCalls,
        "length" => FinishReason::Length,
        "content_filter" => FinishReason::ContentFilter,
        other => FinishReason::Other(other.to_owned()),
    }
}

impl Decoder for OpenAiDecoder {
    fn on_event(
        &mut self,
        event: &Event,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<Progress, ProviderError> {
        let data = event.data.trim();
        if data.is_empty() {
            return Ok(Progress::More);
        }
        if data == "[DONE]" {
            return self.complete(out);
        }
        let chunk: Chunk = serde_json::from_str(data).map_err(|e| {
            ProviderError::Protocol(format!(
                "invalid chunk ({e}): {}",
                truncate_chars(data, 200)
            ))
        })?;
        if let Some(error) = chunk.error {
            let status = error
                .code
                .as_ref()
                .and_then(Value::as_u64)
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| (400..600).contains(c))
                .unwrap_or(500);
            let message = error
                .message
                .unwrap_or_else(|| "error in the stream".into());
            return Err(classify(status, &message, None, &self.hint));
        }
        if let Some(u) = chunk.usage {
            self.usage = Some(Usage::new(u.prompt_tokens, u.completion_tokens));
        }
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(delta) = choice.delta {
                if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                    out.push_back(StreamEvent::TextDelta { text });
                }
                for (position, call) in delta.tool_calls.unwrap_or_default().into_iter().enumerate()
                {
                    self.tool_delta(position, call, out)?;
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(finish_reason(&reason));
                self.close_calls(out)?;
            }
        }
        Ok(Progress::More)
    }

    fn on_eof(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
        // A finish reason without `[DONE]` is a complete answer (some servers
        // omit the marker); anything less is a cut stream.
        if self.finish.is_none() {
            return Err(ProviderError::StreamInterrupted(
                "the connection closed before the response was complete".into(),
            ));
        }
        self.complete(out).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(datas: &[&str]) -> (Vec<StreamEvent>, Result<(), ProviderError>) {
        let mut d = OpenAiDecoder::new("check the API key in OPENAI_API_KEY".into());
        let mut out = VecDeque::new();
        for data in datas {
            let event = Event {
                event: "message".into(),
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
    fn servers_reusing_index_zero_get_separate_calls() {
        let (events, end) = decode(&[
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"x","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"b","function":{"name":"y","arguments":"{\"k\":1}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
        ]);
        end.unwrap();
        insta::assert_json_snapshot!(events);
    }

    #[test]
    fn arguments_before_the_name_are_buffered_and_missing_ids_generated() {
        let (events, end) = decode(&[
            r#"{"choices":[{"delta":{"tool_calls":[{"index":3,"function":{"arguments":"{\"a\""}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":3,"function":{"name":"t","arguments":":1}"}}]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
            "[DONE]",
        ]);
        end.unwrap();
        assert_eq!(
            events,
            [
                StreamEvent::ToolCallStart {
                    index: 0,
                    id: "call_0".into(),
                    name: "t".into()
                },
                StreamEvent::ToolCallDelta {
                    index: 0,
                    arguments: "{\"a\":1}".into()
                },
                StreamEvent::ToolCallEnd { index: 0 },
                StreamEvent::Finish {
                    reason: FinishReason::ToolCalls
                },
            ]
        );
    }

    #[test]
    fn a_call_without_a_name_is_a_protocol_error() {
        let (_, end) = decode(&[
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
        ]);
        assert!(matches!(end, Err(ProviderError::Protocol(_))), "{end:?}");
    }

    #[test]
    fn eof_after_finish_is_complete_but_eof_before_is_interrupted() {
        let (events, end) =
            decode(&[r#"{"choices":[{"delta":{"content":"hi"},"finish_reason":"length"}]}"#]);
        end.unwrap();
        assert_eq!(
            events.last(),
            Some(&StreamEvent::Finish {
                reason: FinishReason::Length
            })
        );
        let (_, end) = decode(&[r#"{"choices":[{"delta":{"content":"hi"}}]}"#]);
        assert!(matches!(end, Err(ProviderError::StreamInterrupted(_))));
        let (_, end) = decode(&["[DONE]"]);
        assert!(matches!(end, Err(ProviderError::StreamInterrupted(_))));
    }

    #[test]
    fn in_stream_errors_are_typed() {
        let (_, end) = decode(&[r#"{"error":{"message":"overloaded","code":503}}"#]);
        assert_eq!(
            end,
            Err(ProviderError::Server {
                status: 503,
                message: "overloaded".into()
            })
        );
        let (_, end) = decode(&[r#"{"error":{"message":"boom","code":"internal"}}"#]);
        assert!(matches!(
            end,
            Err(ProviderError::Server { status: 500, .. })
        ));
        let (_, end) = decode(&[r#"{"choices":"nope"}"#]);
        assert!(matches!(end, Err(ProviderError::Protocol(_))));
    }

    #[test]
    fn other_finish_reasons_are_kept() {
        assert_eq!(finish_reason("content_filter"), FinishReason::ContentFilter);
        assert_eq!(finish_reason("function_call"), FinishReason::ToolCalls);
        assert_eq!(finish_reason("eos"), FinishReason::Other("eos".into()));
    }
}
