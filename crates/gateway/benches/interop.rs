//! `cargo bench -p keel-gateway --bench interop` (`cargo xtask bench
//! interop`): `keel serve`'s time to first token through the OpenAI
//! endpoint (`POST /v1/chat/completions`, streamed, the whole history
//! resent) against the native streamed send (`POST
//! /api/dialogs/{id}/messages` with `Accept: text/event-stream`), measured
//! in the same run on one in-process server. Prints `BENCH …` lines.
//!
//! Both conversations grow one turn per sample, alternating native and
//! OpenAI turns, so each OpenAI request also pays for matching a history
//! as long as the native dialog's. The model answers at once (a
//! zero-latency provider), so the figure is keel's own overhead: the
//! time from sending the request to reading the first text delta.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use keel_core::{
    CancellationToken, ChatRequest, FinishReason, Provider, ProviderError, ProviderStream,
    StreamEvent, Usage,
};
use keel_gateway::app::App;
use keel_gateway::serve::{Limits, ServeOptions, Server};
use serde_json::{json, Value};

/// Turns per conversation (each a sample).
const TURNS: usize = 200;
/// Turns at each end whose medians are reported.
const WINDOW: usize = 40;
/// Untimed turns of each kind before the first sample.
const WARMUP: usize = 5;

/// Answers every request at once, in four text deltas.
struct InstantProvider;

#[async_trait]
impl Provider for InstantProvider {
    fn name(&self) -> &str {
        "instant"
    }

    fn model(&self) -> &str {
        "instant"
    }

    async fn stream(
        &self,
        _request: &ChatRequest,
        _cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let mut events: Vec<Result<StreamEvent, ProviderError>> =
            ["A ", "short ", "answer ", "here."]
                .iter()
                .map(|t| {
                    Ok(StreamEvent::TextDelta {
                        text: (*t).to_owned(),
                    })
                })
                .collect();
        events.push(Ok(StreamEvent::Usage {
            usage: Usage::new(40, 4),
        }));
        events.push(Ok(StreamEvent::Finish {
            reason: FinishReason::Stop,
        }));
        Ok(futures::stream::iter(events).boxed())
    }
}

/// Sends `request` and reads its event stream: the time until `first`
/// holds for an event's data (the first token), and all the data.
async fn timed(
    request: reqwest::RequestBuilder,
    first: impl Fn(&str, &str) -> bool,
) -> (Duration, Vec<String>) {
    let started = Instant::now();
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut buffer = String::new();
    let mut ttft = None;
    let mut data = Vec::new();
    while let Some(chunk) = body.next().await {
        buffer.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let name = event
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or("");
            let Some(payload) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if ttft.is_none() && first(name, payload) {
                ttft = Some(started.elapsed());
            }
            data.push(payload.to_owned());
        }
    }
    (ttft.expect("a first token"), data)
}

fn median(samples: &[Duration]) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    sorted[sorted.len() / 2]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("keel.toml"),
        "[session]\nauto_title_after_n_messages = 0\n",
    )
    .unwrap();
    let app = App::open_with_provider(
        "keel bench",
        None,
        Some(dir.path()),
        Some(Arc::new(InstantProvider)),
    )
    .await
    .unwrap();
    let server = Server::start(
        app,
        ServeOptions {
            bind: "127.0.0.1:0".parse().unwrap(),
            token: None,
            allowed_origins: Vec::new(),
            shutdown_grace: Duration::from_secs(5),
            limits: Limits::default(),
        },
    )
    .await
    .unwrap();
    let base = format!("http://{}", server.addr());
    let http = reqwest::Client::new();
    let created: Value = http
        .post(format!("{base}/api/dialogs"))
        .json(&json!({"title": "bench"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let dialog = created["id"].as_str().unwrap().to_owned();
    let mut history: Vec<Value> = Vec::new();
    let mut native = Vec::new();
    let mut openai = Vec::new();
    for turn in 0..WARMUP + TURNS {
        let text = format!("Question number {turn}, about as long as a real one.");
        let native_send = http
            .post(format!("{base}/api/dialogs/{dialog}/messages"))
            .header("accept", "text/event-stream")
            .json(&json!({"text": text}));
        let (native_ttft, _) = timed(native_send, |name, _| name == "text_delta").await;
        history.push(json!({"role": "user", "content": text}));
        let completion = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&json!({
                "model": "keel:root",
                "messages": history,
                "stream": true,
                "user": "bench",
            }));
        let (openai_ttft, data) = timed(completion, |_, payload| {
            serde_json::from_str::<Value>(payload).is_ok_and(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            })
        })
        .await;
        let answer: String = data
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect();
        assert!(
            data.last().is_some_and(|d| d == "[DONE]"),
            "the completion ended"
        );
        history.push(json!({"role": "assistant", "content": answer}));
        if turn >= WARMUP {
            native.push(native_ttft);
            openai.push(openai_ttft);
        }
    }
    // The OpenAI conversation stayed one dialog: nothing forked.
    let chats: Value = http
        .get(format!("{base}/api/dialogs?channel=openai&chat_id=bench"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(chats["items"].as_array().unwrap().len(), 1);
    println!(
        "# time to first token: request sent → first text delta read, zero-latency model, \
         in-process server and client, medians"
    );
    for (label, range) in [
        ("turns_1_40", 0..WINDOW),
        ("turns_161_200", TURNS - WINDOW..TURNS),
        ("all_turns", 0..TURNS),
    ] {
        let n = median(&native[range.clone()]);
        let o = median(&openai[range]);
        println!(
            "BENCH serve_ttft window={label} native_sse_us={:.0} openai_stream_us={:.0} ratio={:.2}",
            us(n),
            us(o),
            us(o) / us(n)
        );
    }
    server.shutdown().await;
}
