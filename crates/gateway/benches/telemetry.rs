//! `cargo bench -p keel-gateway --bench telemetry` (`cargo xtask bench
//! telemetry`): the per-turn cost of the engine's spans, one process, the
//! four sides interleaved in blocks of turns (each on its own dialog of one
//! `SessionManager`, a zero-latency provider, auto-checkpoint on):
//!
//! - `no_subscriber`: no `tracing` subscriber at all;
//! - `off`: `keel serve`'s subscriber without `[telemetry]` (logs at
//!   `warn`, the engine's spans disabled);
//! - `sampled_0`: the OTLP pipeline installed with `sampling_ratio = 0`;
//! - `exporting`: the pipeline recording every span and exporting it to a
//!   loopback OTLP/HTTP receiver (in this process, answering 200).
//!
//! Prints `BENCH telemetry_… key=value` lines: median µs per turn of each
//! side over the blocks, and the ratios to `off`.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use keel_core::{
    AgentId, CancellationToken, ChatRequest, FinishReason, Provider, ProviderError, ProviderStream,
    StreamEvent, ToolRegistry, Usage,
};
use keel_engine::{
    AgentProfile, DialogAddress, NewSessionSpec, RuntimeBundle, SessionManager,
    SessionManagerConfig,
};
use keel_gateway::telemetry::{ExportSettings, Telemetry};
use keel_store::{Store, StoreOptions};
use tracing::Dispatch;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Blocks of turns per side (interleaved).
const BLOCKS: usize = 60;
/// Turns of one side in one block.
const BLOCK_TURNS: u32 = 50;
/// Blocks run first and not counted (warm caches, the first exports).
const WARMUP_BLOCKS: usize = 2;

/// Requests the loopback receiver answered, and their bytes.
static RECEIVED: AtomicU64 = AtomicU64::new(0);
static RECEIVED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Answers every request with 200 on loopback (HTTP/1.1 with keep-alive);
/// returns its port.
fn receiver() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    RECEIVED.fetch_add(1, Ordering::Relaxed);
                    RECEIVED_BYTES.fetch_add(length as u64, Ordering::Relaxed);
                    let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if writer.write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// Answers every request at once with a fixed text.
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
        let events = vec![
            Ok(StreamEvent::TextDelta {
                text: "A short answer of a realistic length for a chat reply.".to_owned(),
            }),
            Ok(StreamEvent::Usage {
                usage: Usage::new(100, 60),
            }),
            Ok(StreamEvent::Finish {
                reason: FinishReason::Stop,
            }),
        ];
        Ok(Box::pin(futures::stream::iter(events)))
    }
}

fn manager(store: Store) -> Arc<SessionManager> {
    let root = AgentProfile {
        name: AgentId::parse("root").unwrap(),
        system_prompt: "You are a helpful assistant.".into(),
        provider: Arc::new(InstantProvider),
        tools: Arc::new(ToolRegistry::new()),
        max_iterations: 4,
        max_output_tokens: None,
        context_window_tokens: usize::MAX,
        approval: keel_engine::ApprovalPolicy::none(),
        prices: None,
    };
    SessionManager::new(
        store,
        RuntimeBundle::new(root),
        SessionManagerConfig {
            auto_checkpoint: true,
            auto_title_after: 0,
            summary: None,
            ..SessionManagerConfig::default()
        },
    )
}

/// `keel serve`'s log layer without telemetry (`KEEL_LOG` unset), writing nowhere.
fn logs<S>() -> impl Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let filter = EnvFilter::new(format!("warn,{}=off", keel_engine::TRACE_TARGET));
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::sink)
        .with_filter(filter)
}

fn settings(port: u16, sampling_ratio: f64) -> ExportSettings {
    ExportSettings {
        traces_url: Some(format!("http://127.0.0.1:{port}/v1/traces")),
        headers: Vec::new(),
        service_name: "keel-bench".into(),
        sampling_ratio,
        record_content: false,
    }
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let port = receiver();
    // The exporters start outside the runtime (their HTTP client owns one).
    let sampled_0 = Telemetry::start(&settings(port, 0.0)).unwrap();
    let exporting = Telemetry::start(&settings(port, 1.0)).unwrap();
    let sides: Vec<(&str, Dispatch)> = vec![
        ("no_subscriber", Dispatch::none()),
        (
            "off",
            Dispatch::new(tracing_subscriber::registry().with(logs())),
        ),
        (
            "sampled_0",
            Dispatch::new(
                tracing_subscriber::registry()
                    .with(logs())
                    .with(sampled_0.layer()),
            ),
        ),
        (
            "exporting",
            Dispatch::new(
                tracing_subscriber::registry()
                    .with(logs())
                    .with(exporting.layer()),
            ),
        ),
    ];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("keel.db"), StoreOptions::default()).unwrap();
    let m = manager(store);
    let dialogs: Vec<_> = runtime.block_on(async {
        let mut ids = Vec::new();
        for (name, _) in &sides {
            let spec = NewSessionSpec {
                address: DialogAddress::new("bench", "telemetry", name).unwrap(),
                title: None,
                agent: None,
            };
            ids.push(m.create(spec).await.unwrap());
        }
        ids
    });
    println!(
        "# {BLOCKS} blocks of {BLOCK_TURNS} turns per side, interleaved, each block starting with the next side ({WARMUP_BLOCKS} warm-up blocks not counted);"
    );
    println!("# a turn: one model call (zero latency), its open and final commits; 4 spans when recorded.");
    let mut per_turn: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
    let mut n = 0u32;
    for block in 0..BLOCKS + WARMUP_BLOCKS {
        // Each block starts with another side, so none always runs first.
        for k in 0..sides.len() {
            let i = (block + k) % sides.len();
            let _default = tracing::dispatcher::set_default(&sides[i].1);
            let start = Instant::now();
            runtime.block_on(async {
                for t in 0..BLOCK_TURNS {
                    m.submit_turn(dialogs[i], &format!("question {}", n + t))
                        .await
                        .unwrap();
                }
            });
            let us = start.elapsed().as_secs_f64() * 1e6 / f64::from(BLOCK_TURNS);
            if block >= WARMUP_BLOCKS {
                per_turn[i].push(us);
            }
        }
        n += BLOCK_TURNS;
    }
    exporting.flush().unwrap();
    let medians: Vec<f64> = per_turn.iter_mut().map(|xs| median(xs)).collect();
    let off = medians[1];
    for ((name, _), us) in sides.iter().zip(&medians) {
        println!(
            "BENCH telemetry_turn side={name} us_per_turn={us:.1} ratio_to_off={:.3}",
            us / off
        );
    }
    println!(
        "BENCH telemetry_export requests={} bytes={} dropped_spans={}",
        RECEIVED.load(Ordering::Relaxed),
        RECEIVED_BYTES.load(Ordering::Relaxed),
        keel_gateway::telemetry::dropped_spans()
    );
    sampled_0.shutdown().unwrap();
    exporting.shutdown().unwrap();
}
