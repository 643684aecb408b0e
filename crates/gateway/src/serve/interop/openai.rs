//! OpenAI chat completions on `keel serve`: `POST /v1/chat/completions`
//! (streamed or not), `GET /v1/models`, `GET /v1/models/{model}`. Each
//! agent keel can run is a model (`keel:root`, `keel:<agent-id>`); the
//! request's `user` (or an `X-Keel-Dialog` header naming a dialog) picks
//! where the conversation lives; errors are OpenAI's error object with
//! OpenAI's status codes, so the official clients raise their own
//! exception classes.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use keel_core::{AgentId, SessionId};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::transcript::Said;
use super::{
    chat_id, checked_texts, paused_for, Conversation, Conversations, Fed, Scope, TurnFeed,
};
use crate::serve::api::{Approval, Timestamp};
use crate::serve::frames::ServerFrame;
use crate::serve::problem::ApiError;
use crate::serve::Shared;

/// Channel of the dialogs OpenAI clients talk in; the chat is the `user`.
pub const CHANNEL: &str = "openai";
/// Chat of requests that name no `user`.
pub const DEFAULT_CHAT: &str = "default";
/// Header naming the dialog a request continues (and, in answers, the
/// dialog it went to).
pub const DIALOG_HEADER: &str = "x-keel-dialog";
/// Prefix of every model name.
pub const MODEL_PREFIX: &str = "keel:";

// ── errors ───────────────────────────────────────────────────────────────

/// OpenAI's error object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// For a person.
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `server_error` …
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// For a program (`model_not_found`, `invalid_api_key` …).
    pub code: Option<String>,
}

/// A failed request, answered as OpenAI answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The body.
    pub body: ErrorBody,
}

impl OpenAiError {
    fn new(status: StatusCode, kind: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            body: ErrorBody {
                error: ErrorDetail {
                    message: message.into(),
                    kind: kind.to_owned(),
                    param: None,
                    code: None,
                },
            },
        }
    }

    /// A malformed or unsupported request (400), naming the field at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).param(param)
    }

    fn param(mut self, param: &str) -> Self {
        self.body.error.param = Some(param.to_owned());
        self
    }

    fn code(mut self, code: &str) -> Self {
        self.body.error.code = Some(code.to_owned());
        self
    }

    /// No valid key (401).
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect API key provided. Use the keel serve token (server.token_env) as the API key.",
        )
        .code("invalid_api_key")
    }

    /// No such model (404).
    pub fn unknown_model(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "The model `{model}` does not exist. Models are named {MODEL_PREFIX}<agent>; GET /v1/models lists them."
            ),
        )
        .param("model")
        .code("model_not_found")
    }
}

impl From<ApiError> for OpenAiError {
    fn from(e: ApiError) -> Self {
        let status = e.status();
        let (kind, code) = match &e {
            ApiError::Unauthorized => return Self::unauthorized(),
            ApiError::NotFound(_) => ("invalid_request_error", "not_found"),
            ApiError::Forbidden(_) => ("invalid_request_error", "forbidden"),
            ApiError::Internal { .. } => ("server_error", "internal_error"),
            ApiError::Unavailable(_) => ("server_error", "unavailable"),
            ApiError::PayloadTooLarge(_) => ("invalid_request_error", "payload_too_large"),
            ApiError::Conflict(_) => ("invalid_request_error", "conflict"),
            _ => ("invalid_request_error", "invalid_request"),
        };
        Self::new(status, kind, e.to_string()).code(code)
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let retry = self.status == StatusCode::SERVICE_UNAVAILABLE;
        let mut response = (self.status, Json(self.body)).into_response();
        if retry {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// A result of the OpenAI endpoints (an OpenAI error object when it fails).
pub(super) type OpenAiResult<T> = Result<T, OpenAiError>;

// ── models ───────────────────────────────────────────────────────────────

/// A model: an agent keel can run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Model {
    /// `keel:root` or `keel:<agent-id>`.
    pub id: String,
    /// Always `model`.
    pub object: String,
    /// When this server started (Unix seconds).
    pub created: i64,
    /// Always `keel`.
    pub owned_by: String,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    /// Every model.
    pub data: Vec<Model>,
}

/// The agents keel can run now (the catalog in force), root first.
fn agents(shared: &Shared) -> OpenAiResult<Vec<AgentId>> {
    Ok(shared.app.manager.agent_ids().map_err(ApiError::from)?)
}

fn model(shared: &Shared, agent: &AgentId) -> Model {
    Model {
        id: format!("{MODEL_PREFIX}{agent}"),
        object: "model".to_owned(),
        created: shared.conversations.started_at_ms / 1000,
        owned_by: "keel".to_owned(),
    }
}

/// The agent a model name names (`None`: the root agent).
fn agent_of(shared: &Shared, name: &str) -> OpenAiResult<Option<AgentId>> {
    let known = agents(shared)?;
    let agent = name
        .strip_prefix(MODEL_PREFIX)
        .and_then(|id| AgentId::parse(id).ok())
        .filter(|id| known.contains(id))
        .ok_or_else(|| OpenAiError::unknown_model(name))?;
    Ok((agent != AgentId::root()).then_some(agent))
}

async fn list_models(State(shared): State<Arc<Shared>>) -> OpenAiResult<Json<ModelList>> {
    Ok(Json(ModelList {
        object: "list".to_owned(),
        data: agents(&shared)?.iter().map(|a| model(&shared, a)).collect(),
    }))
}

async fn get_model(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> OpenAiResult<Json<Model>> {
    let agent = agent_of(&shared, &name)?.unwrap_or_else(AgentId::root);
    Ok(Json(model(&shared, &agent)))
}

// ── the request ──────────────────────────────────────────────────────────

/// Request fields keel reads.
const READ: &[&str] = &["model", "messages", "stream", "stream_options", "user"];
/// Request fields keel accepts and does not use: sampling, limits and
/// bookkeeping are the agent definition's and provider profile's.
pub const IGNORED: &[&str] = &[
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "logit_bias",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "reasoning_effort",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
];
/// Request fields keel accepts only with the value that asks for nothing
/// (keel runs its own tools; it answers with one text choice).
const ONLY_TRIVIAL: &[&str] = &[
    "n",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
    "logprobs",
    "top_logprobs",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
];

/// Whether `value` of the field `name` asks for nothing keel lacks.
fn trivial(name: &str, value: &Value) -> bool {
    match (name, value) {
        (_, Value::Null) => true,
        ("n", v) => v.as_u64() == Some(1),
        ("tools" | "functions", Value::Array(a)) => a.is_empty(),
        ("tool_choice" | "function_call", Value::String(s)) => s == "none" || s == "auto",
        ("response_format", v) => v.get("type").and_then(Value::as_str) == Some("text"),
        ("logprobs", v) => v.as_bool() == Some(false),
        ("top_logprobs", v) => v.as_u64() == Some(0),
        ("modalities", Value::Array(a)) => a.iter().all(|m| m.as_str() == Some("text")),
        _ => false,
    }
}

/// What a request asks, checked.
#[derive(Debug)]
struct Ask {
    model: String,
    agent: Option<AgentId>,
    stream: bool,
    include_usage: bool,
    history: Vec<Said>,
    input: String,
    user: Option<String>,
}

fn field<'a>(body: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    body.get(name).filter(|v| !v.is_null())
}

fn optional_bool(body: &Map<String, Value>, name: &str) -> OpenAiResult<bool> {
    match field(body, name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(OpenAiError::invalid(
            name,
            format!("`{name}` must be a boolean"),
        )),
    }
}

/// The text of a message's `content` (a string, or text parts).
fn text_of(content: &Value, param: &str) -> OpenAiResult<String> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    // Read by `input_images` for the new input; matching reads text.
                    (Some("image_url"), _) => {}
                    (Some("text"), None) => {
                        return Err(OpenAiError::invalid(
                            &format!("{param}[{j}].text"),
                            "a text part needs a string `text`",
                        ))
                    }
                    (other, _) => {
                        return Err(OpenAiError::invalid(
                            &format!("{param}[{j}]"),
                            format!(
                                "keel reads text only; a content part of type {} is not supported",
                                other.unwrap_or("(none)")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(OpenAiError::invalid(
            param,
            "`content` must be a string or an array of text parts",
        )),
    }
}

/// One message of `messages`, as matching sees it (`None`: not part of
/// the conversation keel keeps — system and developer messages).
fn said(i: usize, message: &Value) -> OpenAiResult<Option<Said>> {
    let at = format!("messages[{i}]");
    let Some(object) = message.as_object() else {
        return Err(OpenAiError::invalid(&at, format!("{at} must be an object")));
    };
    let role = object.get("role").and_then(Value::as_str).ok_or_else(|| {
        OpenAiError::invalid(&format!("{at}.role"), format!("{at} needs a `role`"))
    })?;
    let content = field(object, "content");
    match role {
        "system" | "developer" => {
            // The agent's definition is keel's system prompt.
            if let Some(c) = content {
                text_of(c, &format!("{at}.content"))?;
            }
            Ok(None)
        }
        "user" => {
            let content = content.ok_or_else(|| {
                OpenAiError::invalid(&format!("{at}.content"), format!("{at} needs `content`"))
            })?;
            Ok(Some(Said::user(text_of(
                content,
                &format!("{at}.content"),
            )?)))
        }
        "assistant" => {
            let calls = field(object, "tool_calls")
                .or_else(|| field(object, "function_call"))
                .is_some_and(|c| c.as_array().is_none_or(|a| !a.is_empty()));
            if calls {
                return Err(OpenAiError::invalid(
                    &format!("{at}.tool_calls"),
                    "keel runs its agent's own tools and never returns tool calls; \
                     a history with client tool calls cannot continue here",
                ));
            }
            let text = match content {
                None => String::new(),
                Some(c) => text_of(c, &format!("{at}.content"))?,
            };
            Ok(Some(Said::assistant(text)))
        }
        "tool" | "function" => Err(OpenAiError::invalid(
            &format!("{at}.role"),
            "keel runs its agent's own tools; tool results from the client are not accepted",
        )),
        other => Err(OpenAiError::invalid(
            &format!("{at}.role"),
            format!("unknown role {other:?}"),
        )),
    }
}

/// Reads and checks a request body; nothing is written before this passed.
fn read_ask(shared: &Shared, body: &[u8]) -> OpenAiResult<Ask> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| OpenAiError::invalid("body", format!("the body is not valid JSON: {e}")))?;
    let Value::Object(body) = value else {
        return Err(OpenAiError::invalid(
            "body",
            "the body must be a JSON object",
        ));
    };
    for (name, value) in &body {
        let name = name.as_str();
        if ONLY_TRIVIAL.contains(&name) {
            if !trivial(name, value) {
                return Err(OpenAiError::invalid(
                    name,
                    format!(
                        "`{name}` is not supported: keel runs its agent's own tools and answers \
                         with one text choice"
                    ),
                ));
            }
        } else if !READ.contains(&name) && !IGNORED.contains(&name) {
            return Err(OpenAiError::invalid(
                name,
                format!("Unrecognized request argument supplied: {name}"),
            ));
        }
    }
    let model = match field(&body, "model") {
        Some(Value::String(m)) => m.clone(),
        _ => return Err(OpenAiError::invalid("model", "`model` must be a string")),
    };
    let stream = optional_bool(&body, "stream")?;
    let include_usage = match field(&body, "stream_options") {
        None => false,
        Some(Value::Object(o)) => optional_bool(o, "include_usage")?,
        Some(_) => {
            return Err(OpenAiError::invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };
    let user = match field(&body, "user") {
        None => None,
        Some(Value::String(u)) => Some(u.clone()),
        Some(_) => return Err(OpenAiError::invalid("user", "`user` must be a string")),
    };
    let messages = match field(&body, "messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        _ => {
            return Err(OpenAiError::invalid(
                "messages",
                "`messages` must be a non-empty array",
            ))
        }
    };
    let mut history = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if let Some(s) = said(i, m)? {
            history.push(s);
        }
    }
    let input = match history.pop() {
        Some(Said {
            speaker: super::transcript::Speaker::User,
            text,
        }) if !text.trim().is_empty() => text,
        _ => {
            return Err(OpenAiError::invalid(
                "messages",
                "the last message must be a user message with text: it is the new input",
            ))
        }
    };
    checked_texts(
        history
            .iter()
            .map(|s| s.text.as_str())
            .chain([input.as_str()]),
    )?;
    let agent = agent_of(shared, &model)?;
    Ok(Ask {
        model,
        agent,
        stream,
        include_usage,
        history,
        input,
        user,
    })
}

/// Where the conversation of a request lives.
fn scope(headers: &HeaderMap, user: Option<&str>) -> OpenAiResult<Scope> {
    if let Some(value) = headers.get(DIALOG_HEADER) {
        let id: SessionId = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| {
                OpenAiError::invalid(DIALOG_HEADER, "X-Keel-Dialog must be a dialog id (a UUID)")
            })?;
        return Ok(Scope::Dialog(id));
    }
    let chat = match user {
        Some(u) => chat_id("`user`", u).map_err(|e| OpenAiError::from(e).param("user"))?,
        None => DEFAULT_CHAT.to_owned(),
    };
    Ok(Scope::Chat {
        channel: CHANNEL,
        chat_id: chat,
    })
}

// ── the answer ───────────────────────────────────────────────────────────

/// Token usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Input tokens of the turn's model calls.
    pub prompt_tokens: u64,
    /// Output tokens.
    pub completion_tokens: u64,
    /// Their sum.
    pub total_tokens: u64,
}

impl Usage {
    fn of(prompt: u64, completion: u64) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
        }
    }
}

/// Where keel keeps what a completion said (an extension field; clients
/// that do not know it ignore it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeelRef {
    /// The dialog the conversation lives in.
    pub dialog_id: Uuid,
    /// The turn that answered.
    pub turn_id: Uuid,
    /// The dialog it was forked from, when the history was edited.
    pub forked_from: Option<Uuid>,
    /// The turn's tool calls that wait for a person's approval (the turn
    /// paused for them); absent when none waits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub awaiting_approval: Vec<AwaitingApproval>,
}

/// A tool call that waits for a person's approval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AwaitingApproval {
    /// The approval: `POST /api/approvals/{id}` decides it.
    pub id: Uuid,
    /// The tool.
    pub tool: String,
    /// Its arguments, as the model sent them.
    pub arguments: Value,
    /// When it expires as a denial, if nobody decides.
    pub expires_at: Timestamp,
}

/// What the turn `keel` names paused for, read once its commit is seen.
async fn awaiting(shared: &Shared, keel: &KeelRef) -> OpenAiResult<Vec<AwaitingApproval>> {
    let dialog = SessionId::from(keel.dialog_id);
    Ok(paused_for(shared, dialog, keel.turn_id)
        .await?
        .iter()
        .map(|a| {
            let a = Approval::from(a);
            AwaitingApproval {
                id: a.id,
                tool: a.tool,
                arguments: a.arguments,
                expires_at: a.expires_at,
            }
        })
        .collect())
}

/// The assistant's message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnswerMessage {
    /// Always `assistant`.
    pub role: String,
    /// The answer's text.
    pub content: String,
    /// Always `null`.
    pub refusal: Option<String>,
}

/// The one choice of a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Always 0.
    pub index: u32,
    /// The answer.
    pub message: AnswerMessage,
    /// `stop`, `length` or `content_filter`.
    pub finish_reason: String,
    /// Always `null`.
    pub logprobs: Option<Value>,
}

/// A completion (`stream: false`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion {
    /// `chatcmpl-` and the turn id.
    pub id: String,
    /// Always `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: i64,
    /// The model asked for.
    pub model: String,
    /// The answer.
    pub choices: Vec<Choice>,
    /// Tokens of the turn's model calls.
    pub usage: Usage,
    /// Where keel keeps it.
    pub keel: KeelRef,
}

/// What a chunk adds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// `assistant`, on the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// More text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// The choice of a chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: u32,
    /// What it adds.
    pub delta: Delta,
    /// Set on the last chunk of the answer.
    pub finish_reason: Option<String>,
    /// Always `null`.
    pub logprobs: Option<Value>,
}

/// A piece of a streamed completion (`stream: true`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// `chatcmpl-` and the turn id (the same on every chunk).
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: i64,
    /// The model asked for.
    pub model: String,
    /// One choice; none on the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// On the last chunk when `stream_options.include_usage` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// On the chunk with the finish reason: where keel keeps the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keel: Option<KeelRef>,
}

/// The finish reason a client reads for the turn's last model call:
/// tool calls never reach the client, so a turn keel ended is `stop`.
fn client_finish(reason: Option<&str>) -> String {
    match reason {
        Some(r @ ("length" | "content_filter")) => r.to_owned(),
        _ => "stop".to_owned(),
    }
}

/// How a turn that was not saved is reported.
fn turn_error(cancelled: bool, message: &str) -> OpenAiError {
    if cancelled {
        OpenAiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            .code("turn_cancelled")
    } else {
        OpenAiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            .code("turn_failed")
    }
}

fn lost() -> OpenAiError {
    OpenAiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the answer was read too slowly and could not be relayed whole; it is saved in the dialog",
    )
    .code("lagged")
}

/// Identity of one answer.
#[derive(Debug, Clone)]
struct Answering {
    id: String,
    created: i64,
    model: String,
    keel: KeelRef,
}

impl Answering {
    fn of(feed: &TurnFeed, model: String) -> Self {
        Self {
            id: format!("chatcmpl-{}", feed.turn.simple()),
            created: keel_core::time::now_ms() / 1000,
            model,
            keel: KeelRef {
                dialog_id: feed.dialog.as_uuid(),
                turn_id: feed.turn,
                forked_from: feed.forked_from.map(|d| d.as_uuid()),
                awaiting_approval: Vec::new(),
            },
        }
    }

    fn chunk(&self, delta: Delta, finish: Option<String>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".to_owned(),
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                finish_reason: finish.clone(),
                logprobs: None,
            }],
            usage: None,
            keel: finish.map(|_| self.keel.clone()),
        }
    }
}

fn data(value: &impl Serialize) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_default())
}

/// Waits for the whole answer.
async fn answer_whole(
    shared: &Shared,
    mut feed: TurnFeed,
    mut answering: Answering,
) -> OpenAiResult<ChatCompletion> {
    let mut text = String::new();
    let mut finish = None;
    while let Some(fed) = feed.next().await {
        let Fed::Frame(frame) = fed else {
            return Err(lost());
        };
        match frame.as_ref() {
            ServerFrame::TextDelta { text: t, .. } => text.push_str(t),
            ServerFrame::ModelCallFinished { finish_reason, .. } => {
                finish = Some(finish_reason.clone());
            }
            ServerFrame::TurnCommitted { usage, .. } => {
                answering.keel.awaiting_approval = awaiting(shared, &answering.keel).await?;
                return Ok(ChatCompletion {
                    id: answering.id,
                    object: "chat.completion".to_owned(),
                    created: answering.created,
                    model: answering.model,
                    choices: vec![Choice {
                        index: 0,
                        message: AnswerMessage {
                            role: "assistant".to_owned(),
                            content: text,
                            refusal: None,
                        },
                        finish_reason: client_finish(finish.as_deref()),
                        logprobs: None,
                    }],
                    usage: Usage::of(usage.prompt_tokens, usage.completion_tokens),
                    keel: answering.keel,
                });
            }
            ServerFrame::TurnFailed {
                cancelled, message, ..
            } => return Err(turn_error(*cancelled, message)),
            _ => {}
        }
    }
    Err(lost())
}

/// The answer as server-sent events: a role chunk, a chunk per text
/// delta, the finish chunk once the turn is saved, the usage chunk when
/// asked for, then `[DONE]`; an error object when the turn was not saved.
fn answer_streamed(
    shared: Arc<Shared>,
    feed: TurnFeed,
    answering: Answering,
    include_usage: bool,
) -> impl Stream<Item = Event> + Send {
    let first = data(&answering.chunk(
        Delta {
            role: Some("assistant".to_owned()),
            content: Some(String::new()),
        },
        None,
    ));
    struct Flow {
        shared: Arc<Shared>,
        feed: TurnFeed,
        answering: Answering,
        include_usage: bool,
        finish: Option<String>,
        after: Vec<Event>,
        ended: bool,
    }
    let flow = Flow {
        shared,
        feed,
        answering,
        include_usage,
        finish: None,
        after: Vec::new(),
        ended: false,
    };
    let rest = futures::stream::unfold(flow, |mut flow| async move {
        loop {
            if let Some(event) = flow.after.pop() {
                return Some((event, flow));
            }
            if flow.ended {
                return None;
            }
            let Some(fed) = flow.feed.next().await else {
                flow.ended = true;
                return Some((data(&lost().body), flow));
            };
            let Fed::Frame(frame) = fed else {
                flow.ended = true;
                return Some((data(&lost().body), flow));
            };
            match frame.as_ref() {
                ServerFrame::TextDelta { text, .. } => {
                    let delta = Delta {
                        role: None,
                        content: Some(text.clone()),
                    };
                    return Some((data(&flow.answering.chunk(delta, None)), flow));
                }
                ServerFrame::ModelCallFinished { finish_reason, .. } => {
                    flow.finish = Some(finish_reason.clone());
                }
                ServerFrame::TurnCommitted { usage, .. } => {
                    flow.ended = true;
                    match awaiting(&flow.shared, &flow.answering.keel).await {
                        Ok(waiting) => flow.answering.keel.awaiting_approval = waiting,
                        Err(e) => return Some((data(&e.body), flow)),
                    }
                    // `after` is a stack: pushed in reverse order.
                    flow.after.push(Event::default().data("[DONE]"));
                    if flow.include_usage {
                        let mut last = flow.answering.chunk(Delta::default(), None);
                        last.choices.clear();
                        last.usage = Some(Usage::of(usage.prompt_tokens, usage.completion_tokens));
                        flow.after.push(data(&last));
                    }
                    let finish = client_finish(flow.finish.as_deref());
                    let chunk = flow.answering.chunk(Delta::default(), Some(finish));
                    return Some((data(&chunk), flow));
                }
                ServerFrame::TurnFailed {
                    cancelled, message, ..
                } => {
                    flow.ended = true;
                    return Some((data(&turn_error(*cancelled, message).body), flow));
                }
                _ => {}
            }
        }
    });
    futures::StreamExt::chain(futures::stream::once(async move { first }), rest)
}

/// `POST /v1/chat/completions`.
async fn completions(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> OpenAiResult<Response> {
    let body = body
        .map_err(|r| OpenAiError::from(ApiError::PayloadTooLarge(r.body_text())).param("body"))?;
    let ask = read_ask(&shared, &body)?;
    let conversation = Conversation {
        scope: scope(&headers, ask.user.as_deref())?,
        agent: ask.agent,
        history: ask.history,
        input: ask.input,
    };
    if shared.turns.is_draining() {
        return Err(ApiError::Unavailable(
            "the server is shutting down; no new turns are started".to_owned(),
        )
        .into());
    }
    // Checked before a dialog is placed: a refused image creates none.
    let checked = shared.check_input(
        Some(conversation.input.clone()),
        super::images::openai_images(&body)?,
    )?;
    crate::serve::images::check_agent_takes(&shared, conversation.agent.as_ref(), &checked)?;
    let placed = shared.conversations.place(&shared, &conversation).await?;
    let input = shared.store_input(placed.dialog, checked).await?;
    let feed = Conversations::start_turn(&shared, placed, input).await?;
    let dialog = HeaderValue::from_str(&feed.dialog.to_string())
        .map_err(|e| OpenAiError::from(ApiError::internal(&e)))?;
    let answering = Answering::of(&feed, ask.model);
    let mut response = if ask.stream {
        use futures::StreamExt;
        Sse::new(
            answer_streamed(shared.clone(), feed, answering, ask.include_usage)
                .map(Ok::<Event, Infallible>),
        )
        .keep_alive(KeepAlive::default())
        .into_response()
    } else {
        Json(answer_whole(&shared, feed, answering).await?).into_response()
    };
    response.headers_mut().insert(DIALOG_HEADER, dialog);
    Ok(response)
}

async fn require_key(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    if let Some(refused) = crate::serve::origin::refusal(&request, &shared.allowed_origins) {
        tracing::info!(reason = %refused, "request refused");
        return OpenAiError::from(refused).into_response();
    }
    if crate::serve::auth::authorized(&shared, &request) {
        next.run(request).await
    } else {
        OpenAiError::unauthorized().into_response()
    }
}

async fn no_route(axum::extract::OriginalUri(uri): axum::extract::OriginalUri) -> OpenAiError {
    OpenAiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("Unknown request URL: {}", uri.path()),
    )
    .code("unknown_url")
}

async fn wrong_method() -> OpenAiError {
    OpenAiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method not allowed",
    )
}

/// The routes under `/v1`, behind the serve token as the API key.
pub(crate) fn router(shared: Arc<Shared>) -> Router<Arc<Shared>> {
    Router::new()
        .route("/chat/completions", post(completions))
        .route("/models", get(list_models))
        .route("/models/{model}", get(get_model))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::middleware::from_fn_with_state(shared, require_key))
        .layer(DefaultBodyLimit::max(super::MAX_BODY_BYTES))
}
