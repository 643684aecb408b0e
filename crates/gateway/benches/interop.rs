//! `cargo bench -p keel-gateway --bench interop` (`cargo xtask bench
//! interop`): time to first token of a live `keel serve` (this package's
//! release binary, offline provider, loopback) through the OpenAI endpoint
//! (`POST /v1/chat/completions` with `stream: true`, the whole history
//! resent, as OpenAI clients do) against the native streamed send (`POST
//! /api/dialogs/{id}/messages` with `Accept: text/event-stream`), measured
//! in the same run. Prints `BENCH interop_ttft …` lines: p50 and p99 of
//! each side and their ratios.
//!
//! [`CONVERSATIONS`] pairs of conversations, one native dialog and one
//! OpenAI `user` each, grow by one turn per sample, [`TURNS`] turns each.
//! The samples are interleaved: every round sends one turn to each
//! conversation, native and OpenAI alternating which goes first, so load
//! drifting on the shared machine weighs on both sides alike. The offline
//! model answers at once, so the figure is keel's own overhead: from
//! sending the request to reading the first text of the answer (an OpenAI
//! chunk with non-empty `delta.content`, a native `text_delta` event).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

mod support;
use support::{start_server, stop_server};

/// Pairs of conversations (native dialog, OpenAI `user`).
const CONVERSATIONS: usize = 16;
/// Turns of each conversation; each is one sample of its side.
const TURNS: usize = 50;
/// Turns at each end of a conversation whose percentiles are also reported.
const WINDOW: usize = 10;
/// Untimed turns of each side before the first sample (on other dialogs).
const WARMUP: usize = 10;

/// What one streamed request gave: the time to its first token, and the
/// data lines of its events.
struct Streamed {
    ttft: Duration,
    data: Vec<String>,
}

/// Sends `request` and reads its whole event stream; `first` says whether
/// an event (name, data) carries the first token.
async fn timed(request: reqwest::RequestBuilder, first: impl Fn(&str, &str) -> bool) -> Streamed {
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
    Streamed {
        ttft: ttft.expect("a first token"),
        data,
    }
}

/// The text of an OpenAI chunk's delta, if it has some.
fn chunk_text(payload: &str) -> Option<String> {
    let chunk: Value = serde_json::from_str(payload).ok()?;
    let text = chunk["choices"][0]["delta"]["content"].as_str()?;
    (!text.is_empty()).then(|| text.to_owned())
}

/// One native conversation and one OpenAI conversation.
struct Pair {
    base: String,
    dialog: String,
    user: String,
    history: Vec<Value>,
}

impl Pair {
    async fn new(http: &reqwest::Client, base: &str, i: usize) -> Self {
        let created: Value = http
            .post(format!("{base}/api/dialogs"))
            .json(&json!({"title": format!("native {i}")}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        Self {
            base: base.to_owned(),
            dialog: created["id"].as_str().unwrap().to_owned(),
            user: format!("bench-{i}"),
            history: Vec::new(),
        }
    }

    /// A native streamed turn: its time to first token.
    async fn native(&self, http: &reqwest::Client, text: &str) -> Duration {
        let send = http
            .post(format!(
                "{}/api/dialogs/{}/messages",
                self.base, self.dialog
            ))
            .header("accept", "text/event-stream")
            .json(&json!({"text": text}));
        let streamed = timed(send, |name, _| name == "text_delta").await;
        assert!(
            streamed
                .data
                .last()
                .is_some_and(|d| d.contains("turn_committed")),
            "the native turn committed"
        );
        streamed.ttft
    }

    /// An OpenAI streamed turn resending the whole history: its time to
    /// first token. The answer joins the history as a client keeps it.
    async fn openai(&mut self, http: &reqwest::Client, text: &str) -> Duration {
        self.history.push(json!({"role": "user", "content": text}));
        let completion = http
            .post(format!("{}/v1/chat/completions", self.base))
            .json(&json!({
                "model": "keel:root",
                "messages": self.history,
                "stream": true,
                "user": self.user,
            }));
        let streamed = timed(completion, |_, payload| chunk_text(payload).is_some()).await;
        assert!(
            streamed.data.last().is_some_and(|d| d == "[DONE]"),
            "the completion ended"
        );
        let answer: String = streamed.data.iter().filter_map(|d| chunk_text(d)).collect();
        self.history
            .push(json!({"role": "assistant", "content": answer}));
        streamed.ttft
    }
}

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Samples of both sides, by turn index of their conversation.
#[derive(Default)]
struct Samples {
    native: Vec<Vec<Duration>>,
    openai: Vec<Vec<Duration>>,
}

impl Samples {
    fn report(&self, label: &str, turns: std::ops::Range<usize>) {
        let pick = |side: &[Vec<Duration>]| -> Vec<Duration> {
            side[turns.clone()].iter().flatten().copied().collect()
        };
        let (native, openai) = (pick(&self.native), pick(&self.openai));
        let (n50, n99) = (percentile(&native, 0.5), percentile(&native, 0.99));
        let (o50, o99) = (percentile(&openai, 0.5), percentile(&openai, 0.99));
        println!(
            "BENCH interop_ttft turns={label} samples={}+{} native_p50_us={:.0} native_p99_us={:.0} \
             openai_p50_us={:.0} openai_p99_us={:.0} ratio_p50={:.2} ratio_p99={:.2}",
            native.len(),
            openai.len(),
            us(n50),
            us(n99),
            us(o50),
            us(o99),
            us(o50) / us(n50),
            us(o99) / us(n99),
        );
    }
}

fn main() {
    // The client's side: one thread, so the server keeps the cores.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();
    // No auto-titling: it would add a model call to one turn of each dialog.
    std::fs::write(
        dir.path().join("keel.toml"),
        "[session]\nauto_title_after_n_messages = 0\n",
    )
    .unwrap();
    let (child, addr) = start_server(dir.path());
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    println!(
        "# time to first token: request sent -> first answer text read; release keel serve, \
         offline provider, loopback; {CONVERSATIONS} conversations per side x {TURNS} turns, interleaved"
    );
    let mut warm = Pair::new(&http, &base, CONVERSATIONS).await;
    for turn in 0..WARMUP {
        let text = format!("Warm-up question {turn}.");
        warm.native(&http, &text).await;
        warm.openai(&http, &text).await;
    }
    let mut pairs = Vec::new();
    for i in 0..CONVERSATIONS {
        pairs.push(Pair::new(&http, &base, i).await);
    }
    let mut samples = Samples::default();
    for turn in 0..TURNS {
        let (mut native, mut openai) = (Vec::new(), Vec::new());
        for (i, pair) in pairs.iter_mut().enumerate() {
            let text =
                format!("Question number {turn} of conversation {i}, about as long as a real one.");
            if (turn + i) % 2 == 0 {
                native.push(pair.native(&http, &text).await);
                openai.push(pair.openai(&http, &text).await);
            } else {
                openai.push(pair.openai(&http, &text).await);
                native.push(pair.native(&http, &text).await);
            }
        }
        samples.native.push(native);
        samples.openai.push(openai);
    }
    // Each OpenAI conversation stayed one dialog holding each message once.
    for pair in &pairs {
        let chats: Value = http
            .get(format!(
                "{base}/api/dialogs?channel=openai&chat_id={}",
                pair.user
            ))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let dialogs = chats["items"].as_array().unwrap();
        assert_eq!(dialogs.len(), 1, "{}: nothing forked", pair.user);
        assert_eq!(
            dialogs[0]["message_count"], TURNS,
            "{}: no input twice",
            pair.user
        );
    }
    samples.report("all", 0..TURNS);
    samples.report(&format!("1-{WINDOW}"), 0..WINDOW);
    samples.report(
        &format!("{}-{TURNS}", TURNS - WINDOW + 1),
        TURNS - WINDOW..TURNS,
    );
    let log = stop_server(child, dir.path());
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .count();
    println!("BENCH interop_server log_warnings={warnings}");
}
