//! `GET /metrics`: keel's Prometheus metrics. The store and the engine
//! report through the `metrics` facade (named functions in their own
//! `metrics` modules); this module installs the recorder that renders the
//! Prometheus text format, meters every model call by its profile
//! (`MeteredProvider`), counts the WebSocket and SSE clients
//! (`ClientGauge`), and reads what is a state rather than an event — the
//! inbox, the gate's permits, dropped telemetry — at scrape time.
//! docs/OPERATIONS.md documents each name in [`METRICS`]; a test keeps the
//! two equal.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::Stream;
use keel_core::{
    ChatRequest, Provider, ProviderError, ProviderResponse, ProviderStream, StreamEvent,
};
use keel_engine::ExecutionGate;
use keel_store::Store;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

/// The kind of a metric, as Prometheus types it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (`_total`).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Observations in buckets (`_bucket`, `_sum`, `_count`).
    Histogram,
}

impl MetricKind {
    /// The `# TYPE` word.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// One metric `GET /metrics` exposes.
#[derive(Debug, Clone, Copy)]
pub struct MetricInfo {
    /// Its name.
    pub name: &'static str,
    /// Its type.
    pub kind: MetricKind,
    /// Its labels.
    pub labels: &'static [&'static str],
    /// The `# HELP` text.
    pub help: &'static str,
}

const fn metric(
    name: &'static str,
    kind: MetricKind,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricInfo {
    MetricInfo {
        name,
        kind,
        labels,
        help,
    }
}

use MetricKind::{Counter, Gauge, Histogram};

/// Every metric keel exposes (docs/OPERATIONS.md lists the same).
pub const METRICS: &[MetricInfo] = &[
    metric("keel_turns_total", Counter, &["origin", "outcome"], "Root turns ended, by what started them and how they ended."),
    metric("keel_turn_duration_seconds", Histogram, &["origin"], "How long a root turn ran on its dialog's worker, from its start to its commit or failure."),
    metric("keel_model_calls_total", Counter, &["profile", "outcome"], "Model calls ended, by provider profile and outcome."),
    metric("keel_model_tokens_total", Counter, &["profile", "type"], "Tokens the model calls reported, by profile; type is input or output."),
    metric("keel_model_time_to_first_token_seconds", Histogram, &["profile"], "From the start of a model call to its first streamed event."),
    metric("keel_model_call_duration_seconds", Histogram, &["profile"], "From the start of a model call to its end."),
    metric("keel_tool_calls_total", Counter, &["tool", "outcome"], "Tool calls ended, by registered tool name (unknown for a name the model made up) and outcome."),
    metric("keel_runs_total", Counter, &["agent", "status"], "Sub-agent runs that reached a terminal status in this process, by agent and status."),
    metric("keel_inbox_pending_events", Gauge, &[], "Signals and completions waiting for a turn of their dialog (pending, leased or admitted)."),
    metric("keel_inbox_oldest_pending_age_seconds", Gauge, &[], "Age of the oldest event waiting for a turn; 0 when none waits."),
    metric("keel_inbox_dead_letter_events", Gauge, &[], "Events given up on (dead-lettered) and still stored."),
    metric("keel_gate_permits_in_use", Gauge, &["pool"], "Global permits of the execution gate held right now; pool is runs, provider or tool."),
    metric("keel_gate_waits_total", Counter, &["pool"], "Admissions that found no free permit and waited."),
    metric("keel_gate_wait_seconds", Histogram, &["pool"], "How long an admission that waited waited."),
    metric("keel_store_commit_duration_seconds", Histogram, &[], "How long one write transaction took, BEGIN to COMMIT."),
    metric("keel_store_commit_batch_size", Histogram, &[], "Write requests committed in one transaction (group commit)."),
    metric("keel_websocket_clients", Gauge, &[], "Open WebSocket connections of /api/ws."),
    metric("keel_sse_clients", Gauge, &[], "Open SSE streams of streamed sends."),
    metric("keel_telemetry_dropped_spans_total", Counter, &[], "Spans the trace exporter dropped (queue full or collector unreachable); 0 while no exporter runs."),
];

const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// How often histograms are folded into their buckets between scrapes, so
/// a server nobody scrapes keeps bounded memory.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
type DroppedSpans = Box<dyn Fn() -> u64 + Send + Sync>;
static DROPPED_SPANS: Mutex<Option<DroppedSpans>> = Mutex::new(None);

/// The process's Prometheus recorder, installed as the `metrics` facade's
/// global recorder on first use; `None` if another recorder was installed
/// first (then `/metrics` says so and nothing is recorded here).
pub fn handle() -> Option<&'static PrometheusHandle> {
    HANDLE.get_or_init(install).as_ref()
}

fn install() -> Option<PrometheusHandle> {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("keel_store_commit_batch_size".into()),
                BATCH_BUCKETS,
            )
        });
    let handle = match builder.map(PrometheusBuilder::install_recorder) {
        Ok(Ok(handle)) => handle,
        Ok(Err(e)) | Err(e) => {
            tracing::error!(error = %e, "the Prometheus recorder could not be installed; /metrics reports nothing");
            return None;
        }
    };
    for m in METRICS {
        let name = m.name;
        match m.kind {
            Counter => metrics::describe_counter!(name, m.help),
            Gauge => metrics::describe_gauge!(name, m.help),
            Histogram => metrics::describe_histogram!(name, m.help),
        }
    }
    // What exists before anything happens reads 0, not absent.
    for pool in ["runs", "provider", "tool"] {
        metrics::counter!("keel_gate_waits_total", "pool" => pool).absolute(0);
    }
    metrics::gauge!("keel_websocket_clients").set(0.0);
    metrics::gauge!("keel_sse_clients").set(0.0);
    Some(handle)
}

/// Installs the recorder and folds histograms every few seconds until
/// `stop` fires (`keel serve`).
pub fn start(stop: CancellationToken) {
    let Some(handle) = handle() else { return };
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = every.tick() => handle.run_upkeep(),
            }
        }
    });
}

/// Registers where `keel_telemetry_dropped_spans_total` comes from: the
/// trace exporter's count of dropped spans, read at every scrape. Until
/// something registers, the metric is absent (`keel serve` always does).
pub fn register_dropped_spans(count: impl Fn() -> u64 + Send + Sync + 'static) {
    *DROPPED_SPANS.lock() = Some(Box::new(count));
}

/// The metrics text: the recorded metrics plus the gauges read now from
/// the store and the gate. A failed store read leaves its gauges at their
/// last value and is logged (a scrape must not fail on a busy store).
pub async fn render(store: &Store, gate: &ExecutionGate) -> Option<String> {
    let handle = handle()?;
    match store.inbox_gauges().await {
        Ok(inbox) => {
            metrics::gauge!("keel_inbox_pending_events").set(count(inbox.pending));
            let age_ms = inbox
                .oldest_pending_at_ms
                .map_or(0, |at| keel_core::time::now_ms().saturating_sub(at).max(0));
            #[allow(clippy::cast_precision_loss)]
            metrics::gauge!("keel_inbox_oldest_pending_age_seconds").set(age_ms as f64 / 1000.0);
            metrics::gauge!("keel_inbox_dead_letter_events").set(count(inbox.dead_lettered));
        }
        Err(e) => tracing::warn!(error = %e, "metrics: the inbox gauges could not be read"),
    }
    let permits = gate.snapshot();
    for (pool, n) in [
        ("runs", permits.runs_in_use),
        ("provider", permits.provider_steps_in_use),
        ("tool", permits.tool_steps_in_use),
    ] {
        metrics::gauge!("keel_gate_permits_in_use", "pool" => pool).set(count(n as u64));
    }
    if let Some(dropped) = DROPPED_SPANS.lock().as_ref() {
        metrics::counter!("keel_telemetry_dropped_spans_total").absolute(dropped());
    }
    Some(handle.render())
}

#[allow(clippy::cast_precision_loss)]
fn count(n: u64) -> f64 {
    n as f64
}

/// Counts one open client stream in `keel_websocket_clients` or
/// `keel_sse_clients` while it lives.
pub(crate) struct ClientGauge(&'static str);

impl ClientGauge {
    /// An open WebSocket.
    pub(crate) fn websocket() -> Self {
        Self::open("keel_websocket_clients")
    }

    /// An open SSE stream.
    pub(crate) fn sse() -> Self {
        Self::open("keel_sse_clients")
    }

    fn open(name: &'static str) -> Self {
        metrics::gauge!(name).increment(1.0);
        Self(name)
    }
}

impl Drop for ClientGauge {
    fn drop(&mut self) {
        metrics::gauge!(self.0).decrement(1.0);
    }
}

/// A provider whose calls are counted under the name of the profile
/// (`[providers.NAME]`) they were made with.
pub(crate) struct MeteredProvider {
    profile: Arc<str>,
    inner: Arc<dyn Provider>,
}

impl MeteredProvider {
    /// `inner`, metered as `profile`.
    pub(crate) fn wrap(profile: &str, inner: Arc<dyn Provider>) -> Arc<dyn Provider> {
        Arc::new(Self {
            profile: profile.into(),
            inner,
        })
    }
}

#[async_trait]
impl Provider for MeteredProvider {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn model(&self) -> &str {
        self.inner.model()
    }

    fn accepts_images(&self) -> bool {
        self.inner.accepts_images()
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let call = ModelCall {
            profile: Arc::clone(&self.profile),
            started: Instant::now(),
            first_event: false,
            ended: false,
        };
        match self.inner.stream(request, cancel).await {
            Ok(inner) => Ok(Box::pin(MeteredStream { inner, call })),
            Err(e) => {
                let mut call = call;
                call.end(outcome_of(&e));
                Err(e)
            }
        }
    }

    async fn complete(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderResponse, ProviderError> {
        // A whole completion has no first token to time; its usage and end count.
        let mut call = ModelCall {
            profile: Arc::clone(&self.profile),
            started: Instant::now(),
            first_event: true,
            ended: false,
        };
        let response = self.inner.complete(request, cancel).await;
        match &response {
            Ok(r) => {
                call.event(&StreamEvent::Usage { usage: r.usage });
                call.end("ok");
            }
            Err(e) => call.end(outcome_of(e)),
        }
        response
    }
}

fn outcome_of(e: &ProviderError) -> &'static str {
    match e {
        ProviderError::Cancelled => "cancelled",
        _ => "error",
    }
}

/// One model call being metered; a call dropped before its end (the turn
/// was cancelled) counts as `cancelled`.
struct ModelCall {
    profile: Arc<str>,
    started: Instant,
    first_event: bool,
    ended: bool,
}

impl ModelCall {
    fn event(&mut self, event: &StreamEvent) {
        let profile = self.profile.to_string();
        if !self.first_event {
            self.first_event = true;
            metrics::histogram!("keel_model_time_to_first_token_seconds", "profile" => profile.clone())
                .record(self.started.elapsed().as_secs_f64());
        }
        if let StreamEvent::Usage { usage } = event {
            metrics::counter!("keel_model_tokens_total", "profile" => profile.clone(), "type" => "input")
                .increment(usage.prompt_tokens);
            metrics::counter!("keel_model_tokens_total", "profile" => profile, "type" => "output")
                .increment(usage.completion_tokens);
        }
    }

    fn end(&mut self, outcome: &'static str) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let profile = self.profile.to_string();
        metrics::counter!("keel_model_calls_total", "profile" => profile.clone(), "outcome" => outcome)
            .increment(1);
        metrics::histogram!("keel_model_call_duration_seconds", "profile" => profile)
            .record(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for ModelCall {
    fn drop(&mut self) {
        self.end("cancelled");
    }
}

struct MeteredStream {
    inner: ProviderStream,
    call: ModelCall,
}

impl Stream for MeteredStream {
    type Item = Result<StreamEvent, ProviderError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let next = this.inner.as_mut().poll_next(cx);
        match &next {
            Poll::Ready(Some(Ok(event))) => this.call.event(event),
            Poll::Ready(Some(Err(e))) => this.call.end(outcome_of(e)),
            Poll::Ready(None) => this.call.end("ok"),
            Poll::Pending => {}
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::{Message, ScriptedProvider, ScriptedResponse};

    fn sample(text: &str, line_start: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(line_start))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// One test: the recorder is the process's, so its counts are shared.
    #[tokio::test]
    async fn a_registered_dropped_span_count_and_metered_calls_reach_the_text() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path().join("keel.db"), Default::default()).expect("store");
        let gate = ExecutionGate::new(Default::default());
        let before = render(&store, &gate).await.expect("a recorder");
        assert!(
            !before.contains("keel_telemetry_dropped_spans_total"),
            "{before}"
        );
        register_dropped_spans(|| 7);

        let provider = MeteredProvider::wrap(
            "unit",
            Arc::new(ScriptedProvider::new(vec![
                ScriptedResponse::text("one two"),
                ScriptedResponse::text("three four"),
            ])),
        );
        let request = ChatRequest::new([Message::user("hi")]);
        provider
            .complete(&request, CancellationToken::new())
            .await
            .expect("a completion");
        // A stream dropped before its end is a cancelled call.
        let mut stream = provider
            .stream(&request, CancellationToken::new())
            .await
            .expect("a stream");
        use futures::StreamExt;
        stream.next().await.expect("a first event").expect("ok");
        drop(stream);

        let text = render(&store, &gate).await.expect("a recorder");
        assert_eq!(
            sample(&text, "keel_telemetry_dropped_spans_total "),
            Some(7.0),
            "{text}"
        );
        let calls = |outcome: &str| {
            sample(
                &text,
                &format!("keel_model_calls_total{{profile=\"unit\",outcome=\"{outcome}\"}}"),
            )
        };
        assert_eq!(calls("ok"), Some(1.0), "{text}");
        assert_eq!(calls("cancelled"), Some(1.0), "{text}");
        assert_eq!(
            sample(
                &text,
                "keel_model_time_to_first_token_seconds_count{profile=\"unit\"}"
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "keel_inbox_pending_events "),
            Some(0.0),
            "{text}"
        );
    }
}
