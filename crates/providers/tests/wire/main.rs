//! Wire tests of both HTTP adapters against a loopback server replaying
//! recorded formats: the same test list runs for OpenAI and Anthropic.
// Test helpers outside #[test] functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod fixtures;
mod server;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use keel_core::{
    CancellationToken, ChatRequest, FinishReason, Message, Provider, ProviderError,
    ProviderResponse, ProviderStream, ResponseAccumulator, StreamEvent, ToolCall, ToolDefinition,
    Usage,
};
use keel_providers::{HttpProviderConfig, SleepFn};
use serde_json::json;
use tokio::sync::Notify;

use fixtures::Wire;
use server::{End, Reply, Server};

/// A timer that records each requested wait and returns at once.
fn recording_sleep() -> (SleepFn, Arc<Mutex<Vec<Duration>>>) {
    let waits = Arc::new(Mutex::new(Vec::new()));
    let recorded = waits.clone();
    let sleep: SleepFn = Arc::new(move |d| {
        recorded.lock().unwrap().push(d);
        Box::pin(async {})
    });
    (sleep, waits)
}

fn config<W: Wire>(server: &Server) -> HttpProviderConfig {
    let mut c = HttpProviderConfig::new(server.base_url(), "model-x");
    c.api_key = Some("sk-test".into());
    c.api_key_env = Some(W::KEY_ENV.into());
    c.connect_timeout = Duration::from_secs(5);
    c.read_timeout = Duration::from_secs(10);
    c
}

/// A provider on `server` with recorded (instant) waits.
fn provider<W: Wire>(server: &Server) -> (Box<dyn Provider>, Arc<Mutex<Vec<Duration>>>) {
    let (sleep, waits) = recording_sleep();
    (W::provider(config::<W>(server), sleep), waits)
}

fn waits(w: &Arc<Mutex<Vec<Duration>>>) -> Vec<Duration> {
    w.lock().unwrap().clone()
}

fn simple_request() -> ChatRequest {
    ChatRequest::new(vec![
        Message::system("Be brief."),
        Message::user("Say hello."),
    ])
}

/// A conversation exercising every mapping: system prompt, text, assistant
/// tool calls (one with garbled arguments), tool results, tools, limits.
fn rich_request() -> ChatRequest {
    ChatRequest {
        messages: vec![
            Message::system("You are keel."),
            Message::user("What is in the repo?"),
            Message::assistant_with_tools(
                "Let me look.",
                vec![
                    ToolCall {
                        id: "call_a".into(),
                        name: "read_file".into(),
                        arguments: json!({ "path": "README.md" }),
                    },
                    ToolCall {
                        id: "call_b".into(),
                        name: "list_dir".into(),
                        arguments: json!("{oops"),
                    },
                ],
            ),
            Message::tool_result("call_a", "read_file", "# keel"),
            Message::tool_result("call_b", "list_dir", "error: arguments are not JSON"),
            Message::assistant("It is keel."),
            Message::user("Thanks."),
        ]
        .into_iter()
        .map(Into::into)
        .collect(),
        tools: vec![
            ToolDefinition {
                name: "read_file".into(),
                description: "Reads a file.".into(),
                parameters: json!({ "type": "object", "properties": { "path": { "type": "string" } },
                                    "required": ["path"] }),
            },
            ToolDefinition {
                name: "list_dir".into(),
                description: "Lists a directory.".into(),
                parameters: json!({ "type": "object", "properties": { "path": { "type": "string" } } }),
            },
        ],
        max_tokens: Some(512),
        temperature: Some(0.5),
    }
}

/// Every item of the stream: the events, then the error that ended it.
/// The error of a call that fails before any event is streamed.
async fn refused(p: &dyn Provider) -> ProviderError {
    match p.stream(&simple_request(), CancellationToken::new()).await {
        Ok(_) => panic!("the call was expected to fail before streaming"),
        Err(e) => e,
    }
}

/// Streams `request` (which must be accepted) and drains the stream.
async fn stream_all(
    p: &dyn Provider,
    request: &ChatRequest,
) -> (Vec<StreamEvent>, Option<ProviderError>) {
    let stream = p.stream(request, CancellationToken::new()).await.unwrap();
    drain(stream).await
}

async fn drain(mut stream: ProviderStream) -> (Vec<StreamEvent>, Option<ProviderError>) {
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(e) => events.push(e),
            Err(e) => {
                assert!(
                    stream.next().await.is_none(),
                    "the stream ends after an error"
                );
                return (events, Some(e));
            }
        }
    }
    (events, None)
}

fn assemble(events: &[StreamEvent]) -> ProviderResponse {
    let mut acc = ResponseAccumulator::default();
    for e in events {
        acc.push(e.clone()).unwrap();
    }
    acc.finish().unwrap()
}

fn hello_events() -> Vec<StreamEvent> {
    vec![
        StreamEvent::TextDelta {
            text: "Hello".into(),
        },
        StreamEvent::TextDelta {
            text: ", world!".into(),
        },
        StreamEvent::Usage {
            usage: Usage::new(11, 3),
        },
        StreamEvent::Finish {
            reason: FinishReason::Stop,
        },
    ]
}

async fn text_stream<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::text())]).await;
    let (p, w) = provider::<W>(&server);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(error, None);
    assert_eq!(events, hello_events());
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].path, W::PATH);
    assert_eq!(requests[0].body["stream"], json!(true));
    assert_eq!(requests[0].header("content-type"), Some("application/json"));
    assert!(waits(&w).is_empty());
}

async fn request_mapping<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::text())]).await;
    let (p, _) = provider::<W>(&server);
    let response = p
        .complete(&rich_request(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(response.message.text(), "Hello, world!");
    let request = &server.requests()[0];
    insta::assert_json_snapshot!(format!("{}_request_body", W::NAME), request.body);
    let auth: Vec<_> = ["authorization", "x-api-key", "anthropic-version"]
        .iter()
        .map(|h| (*h, request.header(h)))
        .collect();
    insta::assert_debug_snapshot!(format!("{}_request_headers", W::NAME), auth);
}

async fn split_parallel_tool_calls<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::tool_calls())]).await;
    let (p, _) = provider::<W>(&server);
    let (events, error) = stream_all(&*p, &rich_request()).await;
    assert_eq!(error, None);
    for index in [0, 1] {
        let deltas = events
            .iter()
            .filter(|e| matches!(e, StreamEvent::ToolCallDelta { index: i, .. } if *i == index))
            .count();
        assert!(deltas >= 4, "call {index} arrived in {deltas} deltas");
    }
    insta::assert_json_snapshot!(format!("{}_tool_call_events", W::NAME), events);
    let r = assemble(&events);
    assert_eq!(r.message.text(), "Checking.");
    assert_eq!(
        r.message.tool_calls,
        [
            ToolCall {
                id: "call_a".into(),
                name: "read_file".into(),
                arguments: json!({ "path": "README.md" })
            },
            ToolCall {
                id: "call_b".into(),
                name: "list_dir".into(),
                arguments: json!({ "path": "src", "depth": 2 })
            },
        ]
    );
    assert_eq!(r.finish_reason, FinishReason::ToolCalls);
    assert_eq!(r.usage, Usage::new(20, 40));
}

async fn unauthorized_is_fatal<W: Wire>() {
    let server = Server::start(vec![
        Reply::json(401, &W::unauthorized()),
        Reply::sse(W::text()),
    ])
    .await;
    let (p, w) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    let ProviderError::Auth {
        status: 401,
        message,
    } = &err
    else {
        panic!("{err:?}")
    };
    assert!(
        message.contains(&format!("check the API key in {}", W::KEY_ENV)),
        "{message}"
    );
    assert!(!err.is_retryable());
    insta::assert_snapshot!(format!("{}_unauthorized", W::NAME), err);
    assert_eq!(server.requests().len(), 1, "a 401 is never retried");
    assert!(waits(&w).is_empty());
}

async fn rate_limit_honours_retry_after<W: Wire>() {
    let in_30s = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
    let busy = r#"{"error":{"message":"Rate limit reached","type":"rate_limit_error"}}"#;
    let server = Server::start(vec![
        Reply::json(429, busy).header("retry-after", "1"),
        Reply::json(429, busy).header("retry-after", &in_30s),
        Reply::sse(W::text()),
    ])
    .await;
    let (p, w) = provider::<W>(&server);
    let r = p
        .complete(&simple_request(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.message.text(), "Hello, world!");
    assert_eq!(server.requests().len(), 3);
    let waited = waits(&w);
    assert_eq!(waited[0], Duration::from_secs(1), "retry-after in seconds");
    assert!(
        (Duration::from_secs(28)..=Duration::from_secs(30)).contains(&waited[1]),
        "retry-after as an HTTP date: {waited:?}"
    );
    assert_eq!(waited.len(), 2);
}

async fn rate_limit_beyond_the_budget_is_returned<W: Wire>() {
    let server = Server::start(vec![Reply::json(429, "{}").header("retry-after", "3600")]).await;
    let (p, w) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    assert_eq!(
        err,
        ProviderError::RateLimited {
            retry_after: Some(Duration::from_secs(3600))
        }
    );
    assert_eq!(server.requests().len(), 1, "an hour is not waited for");
    assert!(waits(&w).is_empty());
}

async fn exhausted_quota_is_fatal<W: Wire>() {
    let body = r#"{"error":{"message":"You exceeded your current quota.","type":"insufficient_quota","code":"insufficient_quota"}}"#;
    let server = Server::start(vec![Reply::json(429, body), Reply::sse(W::text())]).await;
    let (p, w) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    assert_eq!(
        err,
        ProviderError::BadRequest {
            status: 429,
            message: "You exceeded your current quota.".into()
        }
    );
    assert_eq!(server.requests().len(), 1);
    assert!(waits(&w).is_empty());
}

async fn server_error_then_success<W: Wire>() {
    let server = Server::start(vec![
        Reply::json(500, r#"{"error":{"message":"internal"}}"#),
        Reply::json(503, "upstream unavailable"),
        Reply::sse(W::text()),
    ])
    .await;
    let (p, w) = provider::<W>(&server);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(error, None);
    assert_eq!(events, hello_events());
    assert_eq!(server.requests().len(), 3);
    assert_eq!(
        waits(&w),
        [Duration::from_millis(250), Duration::from_millis(500)]
    );
}

async fn server_errors_exhaust_the_retries<W: Wire>() {
    let replies = (0..5)
        .map(|_| Reply::json(502, r#"{"error":{"message":"bad gateway"}}"#))
        .collect();
    let server = Server::start(replies).await;
    let (p, w) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    assert_eq!(
        err,
        ProviderError::Server {
            status: 502,
            message: "bad gateway".into()
        }
    );
    assert_eq!(server.requests().len(), 4, "one attempt and three retries");
    assert_eq!(waits(&w).len(), 3);
}

async fn bad_request_is_not_retried<W: Wire>() {
    let server = Server::start(vec![Reply::json(
        400,
        r#"{"error":{"message":"unknown model"}}"#,
    )])
    .await;
    let (p, _) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    assert_eq!(
        err,
        ProviderError::BadRequest {
            status: 400,
            message: "unknown model".into()
        }
    );
    assert_eq!(server.requests().len(), 1);
}

async fn huge_error_bodies_are_bounded<W: Wire>() {
    let body = "x".repeat(1 << 20);
    let server = Server::start(vec![Reply::json(400, &body)]).await;
    let (p, _) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    let ProviderError::BadRequest {
        status: 400,
        message,
    } = &err
    else {
        panic!("{err:?}")
    };
    assert!(message.chars().count() <= 501, "{} chars", message.len());
}

async fn stream_cut_midway<W: Wire>() {
    let server = Server::start(vec![
        Reply::sse(W::first_delta()).ending(End::Cut),
        Reply::sse(W::text()),
    ])
    .await;
    let (p, _) = provider::<W>(&server);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(events, [StreamEvent::TextDelta { text: "Hel".into() }]);
    assert!(
        matches!(error, Some(ProviderError::StreamInterrupted(_))),
        "{error:?}"
    );
    assert_eq!(
        server.requests().len(),
        1,
        "no retry once output was emitted"
    );
}

async fn clean_close_midway_is_interrupted<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::first_delta())]).await;
    let (p, _) = provider::<W>(&server);
    let err = p
        .complete(&simple_request(), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProviderError::StreamInterrupted(_)),
        "{err:?}"
    );
}

async fn cut_before_output_is_retried<W: Wire>() {
    let server = Server::start(vec![
        Reply::sse(Vec::new()).ending(End::Cut),
        Reply::sse(W::text()),
    ])
    .await;
    let (p, w) = provider::<W>(&server);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(error, None);
    assert_eq!(events, hello_events());
    assert_eq!(server.requests().len(), 2);
    assert_eq!(waits(&w), [Duration::from_millis(250)]);
}

async fn malformed_chunk<W: Wire>() {
    let mut frames = W::first_delta();
    frames.push(W::malformed());
    let server = Server::start(vec![Reply::sse(frames).ending(End::Stall)]).await;
    let (p, _) = provider::<W>(&server);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(events, [StreamEvent::TextDelta { text: "Hel".into() }]);
    assert!(
        matches!(error, Some(ProviderError::Protocol(_))),
        "{error:?}"
    );
}

async fn malformed_before_output_is_not_retried<W: Wire>() {
    let server = Server::start(vec![
        Reply::sse(vec![W::malformed()]),
        Reply::sse(W::text()),
    ])
    .await;
    let (p, w) = provider::<W>(&server);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert!(events.is_empty());
    assert!(
        matches!(error, Some(ProviderError::Protocol(_))),
        "{error:?}"
    );
    assert_eq!(server.requests().len(), 1);
    assert!(waits(&w).is_empty());
}

async fn cancel_mid_stream<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::first_delta()).ending(End::Stall)]).await;
    let (p, _) = provider::<W>(&server);
    let cancel = CancellationToken::new();
    let mut stream = p.stream(&simple_request(), cancel.clone()).await.unwrap();
    // Receiving the delta proves the server sent it and is now silent.
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(first, StreamEvent::TextDelta { text: "Hel".into() });
    cancel.cancel();
    let next = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("prompt");
    assert_eq!(next, Some(Err(ProviderError::Cancelled)));
    assert!(stream.next().await.is_none());
}

async fn cancel_during_backoff<W: Wire>() {
    let server = Server::start(vec![Reply::json(503, "busy"), Reply::sse(W::text())]).await;
    let sleeping = Arc::new(Notify::new());
    let signal = sleeping.clone();
    let sleep: SleepFn = Arc::new(move |_| {
        signal.notify_one();
        Box::pin(std::future::pending())
    });
    let p = W::provider(config::<W>(&server), sleep);
    let cancel = CancellationToken::new();
    let request = simple_request();
    let call = p.stream(&request, cancel.clone());
    let canceller = async {
        sleeping.notified().await;
        cancel.cancel();
    };
    let (result, ()) = tokio::time::timeout(
        Duration::from_secs(5),
        futures::future::join(call, canceller),
    )
    .await
    .expect("prompt");
    assert_eq!(result.err(), Some(ProviderError::Cancelled));
    assert_eq!(server.requests().len(), 1);
}

async fn cancelled_before_the_call<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::text())]).await;
    let (p, _) = provider::<W>(&server);
    let cancel = CancellationToken::new();
    cancel.cancel();
    let err = p.stream(&simple_request(), cancel).await.err().unwrap();
    assert_eq!(err, ProviderError::Cancelled);
}

async fn read_timeout_mid_stream<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::first_delta()).ending(End::Stall)]).await;
    let (sleep, _) = recording_sleep();
    let mut c = config::<W>(&server);
    c.read_timeout = Duration::from_millis(500);
    let p = W::provider(c, sleep);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(events, [StreamEvent::TextDelta { text: "Hel".into() }]);
    assert!(
        matches!(error, Some(ProviderError::Timeout(_))),
        "{error:?}"
    );
    assert_eq!(server.requests().len(), 1);
}

async fn read_timeout_before_output_is_retried<W: Wire>() {
    let server = Server::start(vec![
        Reply::sse(Vec::new()).ending(End::Stall),
        Reply::sse(W::text()),
    ])
    .await;
    let (sleep, w) = recording_sleep();
    let mut c = config::<W>(&server);
    c.read_timeout = Duration::from_millis(500);
    let p = W::provider(c, sleep);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(error, None);
    assert_eq!(events, hello_events());
    assert_eq!(server.requests().len(), 2);
    assert_eq!(waits(&w), [Duration::from_millis(250)]);
}

async fn connection_refused_is_retried_then_typed<W: Wire>() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let (sleep, w) = recording_sleep();
    let mut c = HttpProviderConfig::new(format!("http://{addr}/v1"), "model-x");
    c.retry.max_retries = 2;
    let p = W::provider(c, sleep);
    let err = refused(p.as_ref()).await;
    assert!(matches!(err, ProviderError::Connect(_)), "{err:?}");
    assert_eq!(
        waits(&w),
        [Duration::from_millis(250), Duration::from_millis(500)]
    );
}

async fn json_instead_of_a_stream_is_protocol<W: Wire>() {
    let server = Server::start(vec![Reply::json(
        200,
        r#"{"error":{"message":"streaming unsupported"}}"#,
    )])
    .await;
    let (p, _) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    assert_eq!(
        err,
        ProviderError::Protocol("expected an event stream, got JSON: streaming unsupported".into())
    );
}

async fn responses_over_max_bytes_fail_naming_the_key<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::text()), Reply::sse(W::text())]).await;
    let (sleep, w) = recording_sleep();
    let mut c = config::<W>(&server);
    c.limits.max_response_bytes = 120;
    c.limits.key_path = "providers.main".into();
    let p = W::provider(c, sleep);
    let (_, error) = stream_all(&*p, &simple_request()).await;
    let Some(ProviderError::LimitExceeded(message)) = error else {
        panic!("{error:?}");
    };
    assert_eq!(
        message,
        "the response is longer than 120 bytes (the limit is providers.main.max_response_bytes)"
    );
    assert_eq!(
        server.requests().len(),
        1,
        "an oversized answer is not asked again"
    );
    assert!(waits(&w).is_empty());
}

async fn tool_arguments_over_their_cap_fail<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::tool_calls())]).await;
    let (sleep, _) = recording_sleep();
    let mut c = config::<W>(&server);
    c.limits.max_tool_argument_bytes = 25;
    let p = W::provider(c, sleep);
    let (events, error) = stream_all(&*p, &simple_request()).await;
    let argument_bytes: usize = events
        .iter()
        .map(|e| match e {
            StreamEvent::ToolCallDelta { arguments, .. } => arguments.len(),
            _ => 0,
        })
        .sum();
    assert!(
        argument_bytes <= 25,
        "{argument_bytes} bytes passed the cap"
    );
    let Some(ProviderError::LimitExceeded(message)) = error else {
        panic!("{error:?}");
    };
    assert!(message.ends_with(".max_tool_argument_bytes)"), "{message}");
    // Under the cap, the same answer passes.
    let server = Server::start(vec![Reply::sse(W::tool_calls())]).await;
    let (sleep, _) = recording_sleep();
    let mut c = config::<W>(&server);
    c.limits.max_tool_argument_bytes = 48;
    let (_, error) = stream_all(&*W::provider(c, sleep), &simple_request()).await;
    assert_eq!(error, None);
}

/// A server that keeps the connection alive with a comment every 20 ms
/// never trips the read timeout; the call's total deadline ends it.
async fn total_deadline_ends_a_trickling_stream<W: Wire>() {
    let server = Server::start(vec![
        Reply::sse(W::first_delta()).ending(End::Trickle(Duration::from_millis(20)))
    ])
    .await;
    let (sleep, _) = recording_sleep();
    let mut c = config::<W>(&server);
    c.read_timeout = Duration::from_secs(30);
    c.limits.total_timeout = Duration::from_millis(300);
    let p = W::provider(c, sleep);
    let started = std::time::Instant::now();
    let (events, error) = stream_all(&*p, &simple_request()).await;
    assert_eq!(events, [StreamEvent::TextDelta { text: "Hel".into() }]);
    let Some(ProviderError::LimitExceeded(message)) = error else {
        panic!("{error:?}");
    };
    assert!(message.ends_with(".total_timeout_secs)"), "{message}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// The deadline also bounds retries: backoff waits of a server that keeps
/// failing cannot keep a call alive past it.
async fn total_deadline_bounds_the_retries<W: Wire>() {
    let down = r#"{"error":{"message":"down"}}"#;
    let server = Server::start(vec![Reply::json(503, down); 4]).await;
    let mut c = config::<W>(&server);
    c.limits.total_timeout = Duration::from_millis(200);
    // Real waits: the first backoff (250 ms) outlasts the deadline.
    let sleep: SleepFn = Arc::new(|d| Box::pin(tokio::time::sleep(d)));
    let p = W::provider(c, sleep);
    let err = refused(p.as_ref()).await;
    assert!(matches!(err, ProviderError::LimitExceeded(_)), "{err:?}");
    assert_eq!(server.requests().len(), 1);
}

async fn absurd_retry_after_never_panics<W: Wire>() {
    let busy = r#"{"error":{"message":"Rate limit reached"}}"#;
    let server = Server::start(vec![
        Reply::json(429, busy)
            .header("retry-after", "1e300")
            .header("retry-after-ms", "NaN"),
        Reply::json(429, busy).header("retry-after", "-5"),
        Reply::json(429, busy).header("retry-after-ms", "-1e309"),
        Reply::sse(W::text()),
    ])
    .await;
    let (p, w) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    assert_eq!(
        err,
        ProviderError::RateLimited {
            retry_after: Some(keel_providers::RETRY_AFTER_CAP)
        },
        "a clamped day is longer than the policy waits"
    );
    assert!(waits(&w).is_empty());
    // Negative values are ignored: the backoff applies instead.
    let r = p
        .complete(&simple_request(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.message.text(), "Hello, world!");
    assert_eq!(
        waits(&w),
        [Duration::from_millis(250), Duration::from_millis(500)]
    );
}

async fn context_overflow_is_its_own_error<W: Wire>() {
    let server = Server::start(vec![Reply::json(400, &W::context_overflow())]).await;
    let (p, w) = provider::<W>(&server);
    let err = refused(p.as_ref()).await;
    assert!(
        matches!(err, ProviderError::ContextLengthExceeded(_)),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    assert_eq!(server.requests().len(), 1);
    assert!(waits(&w).is_empty());
}

async fn absurd_usage_saturates<W: Wire>() {
    let server = Server::start(vec![Reply::sse(W::absurd_usage())]).await;
    let (p, _) = provider::<W>(&server);
    let r = p
        .complete(&simple_request(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.message.text(), "Hi");
    assert_eq!(r.usage, Usage::new(u64::MAX, 0));
}

/// Runs every conformance case for one adapter.
macro_rules! conformance {
    ($module:ident, $wire:ty) => {
        mod $module {
            use super::*;
            conformance!(@cases $wire;
                text_stream, request_mapping, split_parallel_tool_calls, unauthorized_is_fatal,
                rate_limit_honours_retry_after, rate_limit_beyond_the_budget_is_returned,
                exhausted_quota_is_fatal,
                server_error_then_success, server_errors_exhaust_the_retries,
                bad_request_is_not_retried, huge_error_bodies_are_bounded, stream_cut_midway,
                clean_close_midway_is_interrupted, cut_before_output_is_retried, malformed_chunk,
                malformed_before_output_is_not_retried, cancel_mid_stream, cancel_during_backoff,
                cancelled_before_the_call, read_timeout_mid_stream,
                read_timeout_before_output_is_retried, connection_refused_is_retried_then_typed,
                json_instead_of_a_stream_is_protocol, responses_over_max_bytes_fail_naming_the_key,
                tool_arguments_over_their_cap_fail, total_deadline_ends_a_trickling_stream,
                total_deadline_bounds_the_retries, absurd_retry_after_never_panics,
                context_overflow_is_its_own_error, absurd_usage_saturates
            );
        }
    };
    (@cases $wire:ty; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() {
                super::$case::<$wire>().await;
            }
        )*
    };
}

conformance!(openai, fixtures::OpenAi);
conformance!(anthropic, fixtures::Anthropic);

/// A profile built by `build_provider_with_env` reaches the server, and a
/// custom base URL without `api_key_env` sends no key.
#[tokio::test]
async fn profile_with_custom_base_url_sends_no_key() {
    use keel_providers::{build_provider_with_env, ProviderKind, ProviderProfile};
    let server = Server::start(vec![Reply::sse(<fixtures::OpenAi as Wire>::text())]).await;
    let mut profile = ProviderProfile::new(ProviderKind::OpenAi, "llama3");
    profile.base_url = Some(server.base_url());
    let env = |var: &str| (var == "OPENAI_API_KEY").then(|| "sk-real".to_owned());
    let p = build_provider_with_env("local", &profile, &env).unwrap();
    let r = p
        .complete(&simple_request(), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(r.message.text(), "Hello, world!");
    let request = &server.requests()[0];
    assert_eq!(request.header("authorization"), None);
    assert_eq!(request.body["model"], "llama3");

    profile.api_key_env = Some("LOCAL_KEY".into());
    let server = Server::start(vec![Reply::sse(<fixtures::OpenAi as Wire>::text())]).await;
    profile.base_url = Some(format!("{}/", server.base_url()));
    let env = |var: &str| (var == "LOCAL_KEY").then(|| "sk-local".to_owned());
    let p = build_provider_with_env("local", &profile, &env).unwrap();
    p.complete(&simple_request(), CancellationToken::new())
        .await
        .unwrap();
    let request = &server.requests()[0];
    assert_eq!(request.path, "/v1/chat/completions");
    assert_eq!(request.header("authorization"), Some("Bearer sk-local"));
}
