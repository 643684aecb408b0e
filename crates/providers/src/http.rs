//! The HTTP layer both adapters share: one `reqwest::Client` per provider,
//! bounded retries with exponential backoff or the server's `retry-after`
//! (clamped), connect and per-chunk read timeouts, the bounds of one call
//! ([`ResponseLimits`]: response bytes, tool-argument bytes, a total
//! deadline), cancellation at every await, error classification, and the SSE
//! event loop that feeds a wire [`Decoder`].
//!
//! Invariant: a request is sent again only while no [`StreamEvent`] has reached
//! the caller. Once output was emitted, any failure ends the stream with a
//! typed error, so the engine never commits a half answer twice.

use std::collections::VecDeque;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use keel_core::{ProviderError, ProviderStream, StreamEvent};
use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use reqwest::{Response, StatusCode};
use tokio_util::sync::CancellationToken;

/// Error bodies are read up to this many bytes; the rest is discarded.
const ERROR_BODY_LIMIT: usize = 8 * 1024;
/// Provider messages quoted in errors are cut to this many characters.
const MESSAGE_LIMIT: usize = 500;
/// A `retry-after` above this (a day) is read as this: absurd header values
/// are clamped, never turned into a panic or an overflow.
pub const RETRY_AFTER_CAP: Duration = Duration::from_secs(24 * 3600);
/// Default [`ResponseLimits::max_response_bytes`] (32 MiB: streamed chunks
/// carry a few hundred bytes of framing per token).
pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 32 * 1024 * 1024;
/// Default [`ResponseLimits::max_tool_argument_bytes`] (4 MiB).
pub const DEFAULT_MAX_TOOL_ARGUMENT_BYTES: u64 = 4 * 1024 * 1024;
/// Default [`ResponseLimits::total_timeout`], in seconds.
pub const DEFAULT_TOTAL_TIMEOUT_SECS: u64 = 600;
/// Longest accepted total deadline of one call (30 days), so a deadline is
/// always a representable instant.
const TOTAL_TIMEOUT_CAP: Duration = Duration::from_secs(30 * 24 * 3600);

/// The bounds of one model call. A call that breaks one fails with
/// [`ProviderError::LimitExceeded`] naming the configuration key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseLimits {
    /// Most bytes of one response body (event-stream framing included).
    pub max_response_bytes: u64,
    /// Most bytes of tool-call arguments in one response, over all its calls.
    pub max_tool_argument_bytes: u64,
    /// Longest time one call may take, from the first request to the end of
    /// the stream, retries and waits included.
    pub total_timeout: Duration,
    /// Where these limits are configured (`providers.NAME`); errors name
    /// `{key_path}.max_response_bytes` and so on.
    pub key_path: String,
}

impl Default for ResponseLimits {
    fn default() -> Self {
        Self {
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            max_tool_argument_bytes: DEFAULT_MAX_TOOL_ARGUMENT_BYTES,
            total_timeout: Duration::from_secs(DEFAULT_TOTAL_TIMEOUT_SECS),
            key_path: "providers.NAME".to_owned(),
        }
    }
}

impl ResponseLimits {
    fn exceeded(&self, key: &str, what: String) -> ProviderError {
        ProviderError::LimitExceeded(format!("{what} (the limit is {}.{key})", self.key_path))
    }

    fn too_many_bytes(&self) -> ProviderError {
        self.exceeded(
            "max_response_bytes",
            format!(
                "the response is longer than {} bytes",
                self.max_response_bytes
            ),
        )
    }

    fn too_many_argument_bytes(&self) -> ProviderError {
        self.exceeded(
            "max_tool_argument_bytes",
            format!(
                "the tool-call arguments are longer than {} bytes",
                self.max_tool_argument_bytes
            ),
        )
    }

    fn past_deadline(&self) -> ProviderError {
        self.exceeded(
            "total_timeout_secs",
            format!(
                "the call took longer than {} s",
                self.total_timeout.as_secs()
            ),
        )
    }

    /// The instant a call started now must end by.
    fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.total_timeout.min(TOTAL_TIMEOUT_CAP)
    }
}

/// A timer: returns a future that completes after the given duration.
/// Replaceable so tests can record backoff and `retry-after` waits instead of
/// sleeping.
pub type SleepFn = Arc<dyn Fn(Duration) -> BoxFuture<'static, ()> + Send + Sync>;

/// The real timer, `tokio::time::sleep`.
pub(crate) fn tokio_sleep() -> SleepFn {
    Arc::new(|d| Box::pin(tokio::time::sleep(d)))
}

/// How often and how long a request is retried before any output was emitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (so `max_retries + 1` requests at most).
    pub max_retries: u32,
    /// Backoff before the first retry; doubles on each further retry.
    pub base_delay: Duration,
    /// Upper bound of the exponential backoff.
    pub max_delay: Duration,
    /// A `retry-after` longer than this is not waited for: the 429 is returned.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 3,
            base_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(8),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The backoff before retry number `retry` (0-based): `base × 2^retry`, capped.
    pub fn backoff(&self, retry: u32) -> Duration {
        let factor = 2u32.saturating_pow(retry.min(16));
        self.base_delay.saturating_mul(factor).min(self.max_delay)
    }

    /// The wait before retrying after `error` when `done` retries already
    /// happened, or `None` when the error is final.
    pub(crate) fn delay_after(&self, error: &ProviderError, done: u32) -> Option<Duration> {
        if done >= self.max_retries {
            return None;
        }
        match error {
            ProviderError::RateLimited {
                retry_after: Some(wait),
            } => (*wait <= self.max_retry_after).then_some(*wait),
            // Nothing reached the caller yet, so a cut stream is as safe to
            // resend as a refused connection.
            e if e.is_retryable() || matches!(e, ProviderError::StreamInterrupted(_)) => {
                Some(self.backoff(done))
            }
            _ => None,
        }
    }
}

/// Endpoint settings of one HTTP provider, resolved from a profile (the key
/// already read from its environment variable).
#[derive(Clone)]
pub struct HttpProviderConfig {
    /// API root without the endpoint path, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// Model identifier sent with each request.
    pub model: String,
    /// The API key, if one is sent.
    pub api_key: Option<String>,
    /// The environment variable the key came from, named in auth errors.
    pub api_key_env: Option<String>,
    /// Time allowed to establish the TCP/TLS connection.
    pub connect_timeout: Duration,
    /// Longest wait for response headers or for the next body chunk.
    pub read_timeout: Duration,
    /// Retries before any output was emitted.
    pub retry: RetryPolicy,
    /// Output token cap used when the request sets none.
    pub max_tokens: Option<u32>,
    /// Bounds of each call.
    pub limits: ResponseLimits,
}

impl HttpProviderConfig {
    /// Settings for `model` at `base_url`, no key, default timeouts and retries.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            api_key_env: None,
            connect_timeout: Duration::from_secs(crate::profile::DEFAULT_CONNECT_TIMEOUT_SECS),
            read_timeout: Duration::from_secs(crate::profile::DEFAULT_READ_TIMEOUT_SECS),
            retry: RetryPolicy::default(),
            max_tokens: None,
            limits: ResponseLimits::default(),
        }
    }

    /// `{base_url}/{path}` with exactly one slash in between.
    pub(crate) fn endpoint(&self, path: &str) -> String {
        format!("{}/{}", self.base_url.trim_end_matches('/'), path)
    }

    /// What an auth error tells the user to fix.
    pub(crate) fn credential_hint(&self) -> String {
        match (&self.api_key, &self.api_key_env) {
            (Some(_), Some(var)) => format!("check the API key in {var}"),
            (Some(_), None) => "check the configured API key".to_owned(),
            (None, Some(var)) => format!("no API key was sent: set {var}"),
            (None, None) => "no API key was sent: set api_key_env in the provider profile \
                             to the environment variable that holds the key"
                .to_owned(),
        }
    }
}

impl fmt::Debug for HttpProviderConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpProviderConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("api_key_env", &self.api_key_env)
            .field("connect_timeout", &self.connect_timeout)
            .field("read_timeout", &self.read_timeout)
            .field("retry", &self.retry)
            .field("max_tokens", &self.max_tokens)
            .field("limits", &self.limits)
            .finish()
    }
}

/// A header value that is never printed (API keys).
pub(crate) fn secret_header(value: &str) -> Result<HeaderValue, ProviderError> {
    let mut v = HeaderValue::from_str(value).map_err(|_| {
        ProviderError::Unavailable(
            "the API key contains characters not allowed in HTTP headers".into(),
        )
    })?;
    v.set_sensitive(true);
    Ok(v)
}

/// Whether a wire decoder wants more events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// Keep reading.
    More,
    /// The response is complete; stop reading.
    Done,
}

/// Turns one provider's SSE events into [`StreamEvent`]s.
pub(crate) trait Decoder: Send + 'static {
    /// Handles one SSE event, pushing zero or more stream events.
    fn on_event(
        &mut self,
        event: &Event,
        out: &mut VecDeque<StreamEvent>,
    ) -> Result<Progress, ProviderError>;

    /// The body ended: completes the response, or says why it is incomplete.
    fn on_eof(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError>;
}

/// The sending side of one provider: client, endpoint, fixed headers, policy.
pub(crate) struct Transport {
    client: reqwest::Client,
    url: String,
    headers: HeaderMap,
    connect_timeout: Duration,
    read_timeout: Duration,
    retry: RetryPolicy,
    limits: ResponseLimits,
    hint: Arc<str>,
    sleep: SleepFn,
}

/// Why reading the body failed.
#[derive(Debug)]
enum BodyError {
    /// No byte arrived within the read timeout.
    Timeout(Duration),
    /// The connection failed.
    Read(reqwest::Error),
    /// The body grew past `max_response_bytes`.
    TooLarge,
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::Timeout(d) => write!(f, "no data for {} ms", d.as_millis()),
            BodyError::Read(e) => f.write_str(&error_chain(e)),
            BodyError::TooLarge => f.write_str("the response is too large"),
        }
    }
}

type SseStream = BoxStream<'static, Result<Event, EventStreamError<BodyError>>>;

impl Transport {
    /// A transport posting to `path` under the config's base URL.
    pub(crate) fn new(
        config: &HttpProviderConfig,
        path: &str,
        headers: HeaderMap,
    ) -> Result<Self, ProviderError> {
        let mut builder = reqwest::Client::builder();
        if is_loopback(&config.base_url) {
            // A local server (Ollama, llama.cpp, tests) is never behind the
            // HTTP(S)_PROXY meant for the internet.
            builder = builder.no_proxy();
        }
        let client = builder
            .connect_timeout(config.connect_timeout)
            // A redirect could carry the key header to another host.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| {
                ProviderError::Unavailable(format!(
                    "cannot build the HTTP client: {}",
                    error_chain(&e)
                ))
            })?;
        Ok(Self {
            client,
            url: config.endpoint(path),
            headers,
            connect_timeout: config.connect_timeout,
            read_timeout: config.read_timeout,
            retry: config.retry.clone(),
            limits: config.limits.clone(),
            hint: config.credential_hint().into(),
            sleep: tokio_sleep(),
        })
    }

    /// Replaces the timer used for backoff and `retry-after` waits.
    pub(crate) fn set_sleep(&mut self, sleep: SleepFn) {
        self.sleep = sleep;
    }

    /// The auth hint, for decoders mapping in-stream errors.
    pub(crate) fn hint(&self) -> Arc<str> {
        self.hint.clone()
    }

    /// Encodes `body` as JSON and streams the response through decoders made
    /// by `new_decoder` (given the key hint for error messages).
    pub(crate) async fn stream_json<D, F>(
        self: &Arc<Self>,
        body: &serde_json::Value,
        new_decoder: F,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError>
    where
        D: Decoder,
        F: Fn(Arc<str>) -> D + Send + 'static,
    {
        let bytes = serde_json::to_vec(body)
            .map_err(|e| ProviderError::Protocol(format!("cannot encode the request: {e}")))?;
        let hint = self.hint();
        self.stream(
            Bytes::from(bytes),
            move || new_decoder(hint.clone()),
            cancel,
        )
        .await
    }

    /// Sends `body` (retrying as the policy allows) and returns the stream of
    /// events `new_decoder` makes of the response.
    pub(crate) async fn stream<D, F>(
        self: &Arc<Self>,
        body: Bytes,
        new_decoder: F,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError>
    where
        D: Decoder,
        F: Fn() -> D + Send + 'static,
    {
        let mut retries = 0;
        let deadline = self.limits.deadline();
        let response =
            tokio::time::timeout_at(deadline, self.connect(&body, &cancel, &mut retries))
                .await
                .map_err(|_| self.limits.past_deadline())??;
        let state = StreamState {
            events: self.sse(response),
            transport: self.clone(),
            deadline,
            argument_bytes: 0,
            body,
            decoder: new_decoder(),
            new_decoder,
            pending: VecDeque::new(),
            emitted: false,
            finished: false,
            retries,
            cancel,
        };
        let stream = futures::stream::unfold(state, |mut state| async move {
            let item = state.next().await?;
            Some((item, state))
        });
        Ok(stream.boxed())
    }

    /// Sends until a success response arrives or the error is final.
    async fn connect(
        &self,
        body: &Bytes,
        cancel: &CancellationToken,
        retries: &mut u32,
    ) -> Result<Response, ProviderError> {
        loop {
            match self.send_once(body, cancel).await {
                Ok(response) => return Ok(response),
                Err(error) => self.before_retry(error, cancel, retries).await?,
            }
        }
    }

    /// Waits before the next attempt, or returns `error` when it is final.
    async fn before_retry(
        &self,
        error: ProviderError,
        cancel: &CancellationToken,
        retries: &mut u32,
    ) -> Result<(), ProviderError> {
        let Some(delay) = self.retry.delay_after(&error, *retries) else {
            return Err(error);
        };
        *retries += 1;
        tracing::warn!(
            url = %self.url,
            retry = *retries,
            delay_ms = delay.as_millis() as u64,
            %error,
            "provider request failed, retrying"
        );
        tokio::select! {
            biased;
            _ = cancel.cancelled() => Err(ProviderError::Cancelled),
            _ = (self.sleep)(delay) => Ok(()),
        }
    }

    /// One request: the response if its status is a success, else the
    /// classified error.
    async fn send_once(
        &self,
        body: &Bytes,
        cancel: &CancellationToken,
    ) -> Result<Response, ProviderError> {
        let send = self
            .client
            .post(&self.url)
            .headers(self.headers.clone())
            .body(body.clone())
            .send();
        let wait = self.connect_timeout.saturating_add(self.read_timeout);
        let response = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(ProviderError::Cancelled),
            sent = tokio::time::timeout(wait, send) => match sent {
                Err(_) => {
                    return Err(ProviderError::Timeout(format!(
                        "no response within {} ms",
                        wait.as_millis()
                    )))
                }
                Ok(Err(e)) => return Err(send_error(&e)),
                Ok(Ok(response)) => response,
            },
        };
        let status = response.status();
        if status.is_success() {
            return self.expect_event_stream(response, cancel).await;
        }
        let retry_after = retry_after(response.headers(), SystemTime::now());
        let text = self.read_bounded(response, cancel).await?;
        let message = error_message(&text, status);
        if status == StatusCode::TOO_MANY_REQUESTS && is_quota_exhausted(&text) {
            // OpenAI's 429 for an empty balance: waiting will not help.
            return Err(ProviderError::BadRequest {
                status: status.as_u16(),
                message,
            });
        }
        if status.is_client_error() && is_context_overflow(&text) {
            return Err(ProviderError::ContextLengthExceeded(message));
        }
        Err(classify(status.as_u16(), &message, retry_after, &self.hint))
    }

    /// A 200 with a JSON body means the server ignored `stream: true` or
    /// reported an error in-band; both are protocol errors.
    async fn expect_event_stream(
        &self,
        response: Response,
        cancel: &CancellationToken,
    ) -> Result<Response, ProviderError> {
        let is_json = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.trim()
                    .to_ascii_lowercase()
                    .starts_with("application/json")
            });
        if !is_json {
            return Ok(response);
        }
        let status = response.status();
        let text = self.read_bounded(response, cancel).await?;
        Err(ProviderError::Protocol(format!(
            "expected an event stream, got JSON: {}",
            error_message(&text, status)
        )))
    }

    /// At most [`ERROR_BODY_LIMIT`] bytes of the body, lossily decoded. Read
    /// failures end the read quietly: the status already says what happened.
    async fn read_bounded(
        &self,
        mut response: Response,
        cancel: &CancellationToken,
    ) -> Result<String, ProviderError> {
        let mut buf = Vec::new();
        while buf.len() < ERROR_BODY_LIMIT {
            let chunk = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(ProviderError::Cancelled),
                chunk = tokio::time::timeout(self.read_timeout, response.chunk()) => chunk,
            };
            match chunk {
                Ok(Ok(Some(bytes))) => buf.extend_from_slice(&bytes),
                _ => break,
            }
        }
        buf.truncate(ERROR_BODY_LIMIT);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// The response body as SSE events, each chunk awaited at most
    /// `read_timeout`, the whole body at most `max_response_bytes`.
    fn sse(&self, response: Response) -> SseStream {
        let read_timeout = self.read_timeout;
        let max_bytes = self.limits.max_response_bytes;
        let bytes = response.bytes_stream().boxed();
        let timed = futures::stream::unfold(Some((bytes, 0u64)), move |state| async move {
            let (mut bytes, seen) = state?;
            match tokio::time::timeout(read_timeout, bytes.next()).await {
                Ok(Some(Ok(chunk))) => {
                    let seen = seen.saturating_add(chunk.len() as u64);
                    if seen > max_bytes {
                        return Some((Err(BodyError::TooLarge), None));
                    }
                    Some((Ok(chunk), Some((bytes, seen))))
                }
                Ok(Some(Err(e))) => Some((Err(BodyError::Read(e)), None)),
                Ok(None) => None,
                Err(_) => Some((Err(BodyError::Timeout(read_timeout)), None)),
            }
        });
        timed.eventsource().boxed()
    }
}

/// The state behind one [`ProviderStream`].
struct StreamState<D, F> {
    transport: Arc<Transport>,
    /// When the whole call must be over.
    deadline: tokio::time::Instant,
    /// Tool-call argument bytes handed out so far.
    argument_bytes: u64,
    body: Bytes,
    events: SseStream,
    decoder: D,
    new_decoder: F,
    /// Decoded events not yet handed out.
    pending: VecDeque<StreamEvent>,
    /// Whether any event reached the caller (then no more retries).
    emitted: bool,
    finished: bool,
    retries: u32,
    cancel: CancellationToken,
}

impl<D: Decoder, F: Fn() -> D + Send + 'static> StreamState<D, F> {
    async fn next(&mut self) -> Option<Result<StreamEvent, ProviderError>> {
        loop {
            if self.cancel.is_cancelled() && !self.finished {
                self.finished = true;
                return Some(Err(ProviderError::Cancelled));
            }
            if let Some(event) = self.pending.pop_front() {
                if let StreamEvent::ToolCallDelta { arguments, .. } = &event {
                    self.argument_bytes =
                        self.argument_bytes.saturating_add(arguments.len() as u64);
                    let limits = &self.transport.limits;
                    if self.argument_bytes > limits.max_tool_argument_bytes {
                        self.finished = true;
                        self.pending.clear();
                        return Some(Err(limits.too_many_argument_bytes()));
                    }
                }
                self.emitted = true;
                return Some(Ok(event));
            }
            if self.finished {
                return None;
            }
            let read = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => {
                    self.finished = true;
                    return Some(Err(ProviderError::Cancelled));
                }
                _ = tokio::time::sleep_until(self.deadline) => {
                    self.finished = true;
                    return Some(Err(self.transport.limits.past_deadline()));
                }
                read = self.events.next() => read,
            };
            let failure = match read {
                Some(Ok(event)) => match self.decoder.on_event(&event, &mut self.pending) {
                    Ok(Progress::More) => continue,
                    Ok(Progress::Done) => {
                        self.finished = true;
                        continue;
                    }
                    Err(e) => e,
                },
                Some(Err(EventStreamError::Transport(BodyError::TooLarge))) => {
                    self.transport.limits.too_many_bytes()
                }
                Some(Err(e)) => sse_error(e),
                None => match self.decoder.on_eof(&mut self.pending) {
                    Ok(()) => {
                        self.finished = true;
                        continue;
                    }
                    Err(e) => e,
                },
            };
            // Events decoded in the same step as the failure belong to a
            // response that will not complete.
            self.pending.clear();
            if self.emitted {
                self.finished = true;
                return Some(Err(failure));
            }
            if let Err(e) = self.restart(failure).await {
                self.finished = true;
                return Some(Err(e));
            }
        }
    }

    /// Sends the request again after a failure before any output.
    async fn restart(&mut self, failure: ProviderError) -> Result<(), ProviderError> {
        let transport = self.transport.clone();
        let retry = async {
            transport
                .before_retry(failure, &self.cancel, &mut self.retries)
                .await?;
            transport
                .connect(&self.body, &self.cancel, &mut self.retries)
                .await
        };
        let response = tokio::time::timeout_at(self.deadline, retry)
            .await
            .map_err(|_| transport.limits.past_deadline())??;
        self.events = transport.sse(response);
        self.decoder = (self.new_decoder)();
        Ok(())
    }
}

/// Whether `url` points at this machine.
fn is_loopback(url: &str) -> bool {
    let Ok(url) = reqwest::Url::parse(url) else {
        return false;
    };
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Maps a failure of the SSE layer.
fn sse_error(e: EventStreamError<BodyError>) -> ProviderError {
    match e {
        EventStreamError::Transport(BodyError::Timeout(d)) => ProviderError::Timeout(format!(
            "no data from the provider for {} ms",
            d.as_millis()
        )),
        EventStreamError::Transport(read @ (BodyError::Read(_) | BodyError::TooLarge)) => {
            ProviderError::StreamInterrupted(format!("the connection failed: {read}"))
        }
        EventStreamError::Utf8(e) => {
            ProviderError::Protocol(format!("the event stream is not UTF-8: {e}"))
        }
        EventStreamError::Parser(e) => {
            ProviderError::Protocol(format!("invalid event stream: {e}"))
        }
    }
}

/// Maps a failure to get response headers.
fn send_error(e: &reqwest::Error) -> ProviderError {
    let message = error_chain(e);
    if e.is_timeout() {
        ProviderError::Timeout(message)
    } else {
        // Refused, reset or closed before the response: the request can be
        // sent again safely, as with a refused connection.
        ProviderError::Connect(message)
    }
}

/// An error and its sources, joined by `: ` (reqwest's own text is terse).
pub(crate) fn error_chain(e: &dyn StdError) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The typed error for an HTTP status (also used for in-stream error events).
pub(crate) fn classify(
    status: u16,
    message: &str,
    retry_after: Option<Duration>,
    hint: &str,
) -> ProviderError {
    let message = message.to_owned();
    match status {
        401 | 403 => ProviderError::Auth {
            status,
            message: format!("{message} ({hint})"),
        },
        429 => ProviderError::RateLimited { retry_after },
        400..=499 if is_context_overflow(&message) => ProviderError::ContextLengthExceeded(message),
        408 => ProviderError::Timeout(format!("the provider answered 408: {message}")),
        500.. => ProviderError::Server { status, message },
        _ => ProviderError::BadRequest { status, message },
    }
}

/// The provider's own message from an error body: `error.message`,
/// `error` as a string, or `message`; else the bounded raw text.
pub(crate) fn error_message(body: &str, status: StatusCode) -> String {
    let from_json = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            let text = v
                .pointer("/error/message")
                .or_else(|| v.get("error").filter(|e| e.is_string()))
                .or_else(|| v.get("message"))?;
            text.as_str().map(str::to_owned)
        });
    let text = from_json.unwrap_or_else(|| body.trim().to_owned());
    if text.is_empty() {
        return status
            .canonical_reason()
            .map_or_else(|| format!("HTTP {}", status.as_u16()), str::to_owned);
    }
    truncate_chars(&text, MESSAGE_LIMIT)
}

/// Whether an error body or message says the request is longer than the
/// model's context window (OpenAI's `context_length_exceeded`, Anthropic's
/// "prompt is too long", vLLM's and llama.cpp's wordings).
pub(crate) fn is_context_overflow(text: &str) -> bool {
    const MARKERS: [&str; 7] = [
        "context_length_exceeded",
        "maximum context length",
        "context length exceeded",
        "context window",
        "prompt is too long",
        "exceed_context_size",
        "exceeds the available context size",
    ];
    let text = text.to_ascii_lowercase();
    MARKERS.iter().any(|m| text.contains(m))
}

/// Whether an error body carries OpenAI's `insufficient_quota` code.
fn is_quota_exhausted(body: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(body).is_ok_and(|v| {
        ["/error/code", "/error/type"]
            .iter()
            .any(|p| v.pointer(p).and_then(|c| c.as_str()) == Some("insufficient_quota"))
    })
}

/// `text` cut to `max` characters, with an ellipsis when cut.
pub(crate) fn truncate_chars(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// How long the server asked to wait: OpenAI's `retry-after-ms`, else the
/// standard `retry-after` (seconds or an HTTP date relative to `now`).
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    if let Some(ms) = header("retry-after-ms").and_then(|v| v.trim().parse::<f64>().ok()) {
        if let Some(wait) = clamped_secs(ms / 1000.0) {
            return Some(wait);
        }
    }
    parse_retry_after(header(RETRY_AFTER.as_str())?, now)
}

/// Parses a `retry-after` value: delay seconds or an HTTP date (a date in the
/// past means "now"). Negative and NaN values are ignored; waits above
/// [`RETRY_AFTER_CAP`] (infinite ones included) are read as the cap.
pub(crate) fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs).min(RETRY_AFTER_CAP));
    }
    if let Ok(secs) = value.parse::<f64>() {
        return clamped_secs(secs);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(RETRY_AFTER_CAP),
    )
}

/// `secs` as a wait of at most [`RETRY_AFTER_CAP`]; `None` when negative or NaN.
fn clamped_secs(secs: f64) -> Option<Duration> {
    if secs.is_nan() || secs < 0.0 {
        return None;
    }
    Some(Duration::try_from_secs_f64(secs).map_or(RETRY_AFTER_CAP, |d| d.min(RETRY_AFTER_CAP)))
}

/// A token count from the wire: any JSON number, saturated into `u64`
/// (negative → 0, above `u64::MAX` → `u64::MAX`); `None` for `null` or a
/// non-number. A provider's absurd usage never fails a response.
fn count(value: serde_json::Value) -> Option<u64> {
    let serde_json::Value::Number(n) = value else {
        return None;
    };
    Some(match (n.as_u64(), n.as_f64()) {
        (Some(v), _) => v,
        (None, Some(f)) if f.is_nan() || f <= 0.0 => 0,
        // `as` saturates: floats above u64::MAX become u64::MAX.
        (None, Some(f)) => f as u64,
        (None, None) => 0,
    })
}

/// Deserializes a token count with [`count`]; a missing number is 0.
pub(crate) fn saturating_count<'de, D>(deserializer: D) -> Result<u64, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let value = <serde_json::Value as serde::Deserialize>::deserialize(deserializer)?;
    Ok(count(value).unwrap_or(0))
}

/// Deserializes an optional token count with [`count`].
pub(crate) fn saturating_count_opt<'de, D>(deserializer: D) -> Result<Option<u64>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let value = <serde_json::Value as serde::Deserialize>::deserialize(deserializer)?;
    Ok(count(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_accepts_seconds_dates_and_ms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("2", now), Some(Duration::from_secs(2)));
        assert_eq!(
            parse_retry_after(" 1.5 ", now),
            Some(Duration::from_millis(1500))
        );
        let date = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(parse_retry_after(&date, now), Some(Duration::from_secs(30)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-3", now), None);

        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("7"));
        assert_eq!(retry_after(&headers, now), Some(Duration::from_secs(7)));
        headers.insert("retry-after-ms", HeaderValue::from_static("120"));
        assert_eq!(retry_after(&headers, now), Some(Duration::from_millis(120)));
    }

    #[test]
    fn absurd_retry_after_values_are_clamped_never_a_panic() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let cap = Some(RETRY_AFTER_CAP);
        for huge in [
            "1e300",
            "inf",
            "18446744073709551615",
            "99999999999999999999999",
        ] {
            assert_eq!(parse_retry_after(huge, now), cap, "{huge}");
        }
        for ignored in ["NaN", "-1", "-1e300", "-inf"] {
            assert_eq!(parse_retry_after(ignored, now), None, "{ignored}");
        }
        let far =
            httpdate::fmt_http_date(SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_799));
        assert_eq!(parse_retry_after(&far, now), cap);
        let ms = |v: &'static str, plain: Option<&'static str>| {
            let mut h = HeaderMap::new();
            h.insert("retry-after-ms", HeaderValue::from_static(v));
            if let Some(p) = plain {
                h.insert(RETRY_AFTER, HeaderValue::from_static(p));
            }
            retry_after(&h, now)
        };
        assert_eq!(ms("1e308", None), cap);
        assert_eq!(ms("inf", None), cap);
        // A negative or NaN `retry-after-ms` falls back to `retry-after`.
        assert_eq!(ms("-5", Some("2")), Some(Duration::from_secs(2)));
        assert_eq!(ms("NaN", None), None);
        // A clamped wait is longer than any policy waits for: the 429 is returned.
        let limited = ProviderError::RateLimited { retry_after: cap };
        assert_eq!(RetryPolicy::default().delay_after(&limited, 0), None);
    }

    #[test]
    fn usage_counts_saturate() {
        #[derive(serde::Deserialize)]
        struct U {
            #[serde(deserialize_with = "saturating_count")]
            n: u64,
        }
        let n = |json: &str| serde_json::from_str::<U>(json).unwrap().n;
        assert_eq!(n(r#"{"n": 12}"#), 12);
        assert_eq!(n(r#"{"n": 18446744073709551615}"#), u64::MAX);
        assert_eq!(n(r#"{"n": 1e30}"#), u64::MAX);
        assert_eq!(n(r#"{"n": 99999999999999999999999}"#), u64::MAX);
        assert_eq!(n(r#"{"n": -7}"#), 0);
        assert_eq!(n(r#"{"n": null}"#), 0);
        assert_eq!(n(r#"{"n": "12"}"#), 0);
    }

    #[test]
    fn context_overflow_wordings_are_recognised() {
        for text in [
            r#"{"error":{"message":"This model's maximum context length is 128000 tokens.","code":"context_length_exceeded"}}"#,
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#,
            r#"{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}}"#,
        ] {
            assert!(is_context_overflow(text), "{text}");
        }
        assert!(!is_context_overflow(r#"{"error":{"message":"bad model"}}"#));
        assert!(matches!(
            classify(400, "prompt is too long: 9 tokens > 8 maximum", None, "h"),
            ProviderError::ContextLengthExceeded(_)
        ));
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = RetryPolicy::default();
        let waits: Vec<_> = (0..7).map(|n| p.backoff(n).as_millis()).collect();
        assert_eq!(waits, [250, 500, 1000, 2000, 4000, 8000, 8000]);
        assert_eq!(p.backoff(u32::MAX), Duration::from_secs(8));
    }

    #[test]
    fn retry_decisions() {
        let p = RetryPolicy::default();
        let server = ProviderError::Server {
            status: 502,
            message: "x".into(),
        };
        assert_eq!(p.delay_after(&server, 0), Some(Duration::from_millis(250)));
        assert_eq!(p.delay_after(&server, 3), None, "budget used up");
        let limited = ProviderError::RateLimited {
            retry_after: Some(Duration::from_secs(2)),
        };
        assert_eq!(p.delay_after(&limited, 1), Some(Duration::from_secs(2)));
        let too_long = ProviderError::RateLimited {
            retry_after: Some(Duration::from_secs(600)),
        };
        assert_eq!(p.delay_after(&too_long, 0), None);
        let unspecified = ProviderError::RateLimited { retry_after: None };
        assert_eq!(
            p.delay_after(&unspecified, 1),
            Some(Duration::from_millis(500))
        );
        let cut = ProviderError::StreamInterrupted("x".into());
        assert!(p.delay_after(&cut, 0).is_some());
        for fatal in [
            ProviderError::Auth {
                status: 401,
                message: "x".into(),
            },
            ProviderError::BadRequest {
                status: 400,
                message: "x".into(),
            },
            ProviderError::Protocol("x".into()),
            ProviderError::Cancelled,
        ] {
            assert_eq!(p.delay_after(&fatal, 0), None, "{fatal}");
        }
    }

    #[test]
    fn error_messages_are_extracted_and_bounded() {
        let s = StatusCode::BAD_REQUEST;
        assert_eq!(
            error_message(r#"{"error":{"message":"bad model"}}"#, s),
            "bad model"
        );
        assert_eq!(
            error_message(r#"{"error":"model not found"}"#, s),
            "model not found"
        );
        assert_eq!(error_message(r#"{"message":"nope"}"#, s), "nope");
        assert_eq!(error_message("  plain text ", s), "plain text");
        assert_eq!(error_message("", s), "Bad Request");
        let long = "é".repeat(2000);
        assert_eq!(error_message(&long, s).chars().count(), MESSAGE_LIMIT + 1);
    }

    #[test]
    fn quota_errors_are_recognised() {
        assert!(is_quota_exhausted(
            r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#
        ));
        assert!(!is_quota_exhausted(
            r#"{"error":{"message":"slow down","type":"requests"}}"#
        ));
        assert!(!is_quota_exhausted("not json"));
    }

    #[test]
    fn statuses_are_classified() {
        let hint = "check the API key in OPENAI_API_KEY";
        let auth = classify(401, "Incorrect API key", None, hint);
        assert_eq!(
            auth.to_string(),
            "provider rejected the credentials (401): Incorrect API key (check the API key in OPENAI_API_KEY)"
        );
        assert!(matches!(
            classify(403, "x", None, hint),
            ProviderError::Auth { status: 403, .. }
        ));
        assert_eq!(
            classify(429, "slow down", Some(Duration::from_secs(1)), hint),
            ProviderError::RateLimited {
                retry_after: Some(Duration::from_secs(1))
            }
        );
        assert!(matches!(
            classify(404, "x", None, hint),
            ProviderError::BadRequest { status: 404, .. }
        ));
        assert!(matches!(
            classify(529, "x", None, hint),
            ProviderError::Server { status: 529, .. }
        ));
        assert!(classify(408, "x", None, hint).is_retryable());
    }

    #[test]
    fn loopback_urls_are_recognised() {
        assert!(is_loopback("http://127.0.0.1:11434/v1"));
        assert!(is_loopback("http://localhost:8080/v1"));
        assert!(is_loopback("http://[::1]:8080/v1"));
        assert!(!is_loopback("https://api.openai.com/v1"));
        assert!(!is_loopback("not a url"));
    }

    #[test]
    fn config_debug_redacts_the_key() {
        let mut c = HttpProviderConfig::new("http://127.0.0.1:1/v1/", "m");
        c.api_key = Some("sk-secret".into());
        assert!(!format!("{c:?}").contains("sk-secret"));
        assert_eq!(
            c.endpoint("chat/completions"),
            "http://127.0.0.1:1/v1/chat/completions"
        );
    }
}
