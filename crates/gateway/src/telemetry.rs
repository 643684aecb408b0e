//! OpenTelemetry export of the engine's spans (`[telemetry]`, docs/TELEMETRY.md):
//! the `tracing` spans of target [`keel_engine::TRACE_TARGET`] become
//! OpenTelemetry spans (tracing-opentelemetry) that a batch processor sends
//! to an OTLP/HTTP collector as protobuf, from its own thread.
//!
//! Off (no endpoint configured), no layer is installed and the engine's spans
//! are disabled at their callsites. On, a turn never waits for the collector:
//! an ended span goes into a bounded queue or, when the queue is full, is
//! dropped and counted, as is every span of a batch the collector did not
//! take ([`dropped_spans`]).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_engine::{SpanHandle, SpanLinker, TRACE_TARGET};
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, Span, SpanData,
    SpanExporter, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{Filtered, LevelFilter, Targets};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::config::TelemetryConfig;

/// Spans waiting for export at most (ended, not yet taken by the collector).
pub const QUEUE_SPANS: usize = 2048;
/// Spans per export request at most.
const BATCH_SPANS: usize = 512;
/// How long `keel serve` waits at exit for the last spans to be exported.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

static DROPPED: AtomicU64 = AtomicU64::new(0);
static QUEUED: AtomicUsize = AtomicUsize::new(0);

/// Spans this process recorded but did not export: dropped because the
/// export queue was full, or in a batch the collector did not accept.
pub fn dropped_spans() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Where and how to export, resolved from `[telemetry]` and the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSettings {
    /// The traces URL (`…/v1/traces`); `None`: the exporter reads the
    /// `OTEL_EXPORTER_OTLP_*` endpoint variables.
    pub traces_url: Option<String>,
    /// Extra headers of every export request.
    pub headers: Vec<(String, String)>,
    /// `service.name`.
    pub service_name: String,
    /// Share of root traces recorded.
    pub sampling_ratio: f64,
    /// Whether spans carry message content.
    pub record_content: bool,
}

impl ExportSettings {
    /// The settings of `config`, or `None` when export is off: no endpoint
    /// there nor in `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`, or `OTEL_SDK_DISABLED=true`.
    pub fn resolve(
        config: &TelemetryConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, String> {
        let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let traces_url = config
            .otlp_endpoint
            .as_ref()
            .map(|base| format!("{}/v1/traces", base.trim_end_matches('/')));
        let from_env = set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
            || set("OTEL_EXPORTER_OTLP_ENDPOINT").is_some();
        if traces_url.is_none() && !from_env {
            return Ok(None);
        }
        // Headers often carry a collector's key: a variable named but not
        // set is a mistake to say, not an export that every collector refuses.
        let headers =
            match config.headers_env.as_deref() {
                None => Vec::new(),
                Some(name) => parse_headers(&set(name).ok_or_else(|| {
                    format!("telemetry.headers_env names ${name}, which is not set")
                })?),
            };
        let service_name = config
            .service_name
            .clone()
            .or_else(|| set("OTEL_SERVICE_NAME"))
            .unwrap_or_else(|| "keel".to_owned());
        Ok(Some(Self {
            traces_url,
            headers,
            service_name,
            sampling_ratio: config.sampling_ratio,
            record_content: config.record_content,
        }))
    }
}

/// `key=value,key2=value2` (the `OTEL_EXPORTER_OTLP_HEADERS` form); pairs
/// without `=` are skipped.
fn parse_headers(raw: &str) -> Vec<(String, String)> {
    raw.split(',')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            let k = k.trim();
            (!k.is_empty()).then(|| (k.to_owned(), v.trim().to_owned()))
        })
        .collect()
}

/// A running exporter; [`Telemetry::shutdown`] exports what is left.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Builds the exporter of `settings`. Call it outside an async runtime
    /// (the blocking HTTP client owns one of its own).
    pub fn start(settings: &ExportSettings) -> Result<Self, String> {
        // An `https://` collector needs the process's TLS provider (the
        // MCP client installs the same one; the first install wins).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
        if let Some(url) = &settings.traces_url {
            exporter = exporter.with_endpoint(url.clone());
        }
        if !settings.headers.is_empty() {
            exporter = exporter.with_headers(settings.headers.iter().cloned().collect());
        }
        let exporter = exporter
            .build()
            .map_err(|e| format!("telemetry: cannot build the OTLP exporter: {e}"))?;
        Ok(Self::with_exporter(exporter, settings))
    }

    /// A pipeline exporting through `exporter` (tests and benches bring their own).
    pub fn with_exporter(exporter: impl SpanExporter + 'static, settings: &ExportSettings) -> Self {
        let batch = BatchSpanProcessor::builder(Counted(exporter))
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(QUEUE_SPANS)
                    .with_max_export_batch_size(BATCH_SPANS)
                    .build(),
            )
            .build();
        let ratio = settings.sampling_ratio.clamp(0.0, 1.0);
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Bounded(batch))
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(settings.service_name.clone())
                    .build(),
            )
            .build();
        keel_engine::set_record_content(settings.record_content);
        // Only the first pipeline of a process links (there is one, in `keel serve`).
        keel_engine::install_span_linker(Box::new(OtelLinker));
        Self { provider }
    }

    /// The `tracing` layer that turns the engine's spans into this pipeline's.
    pub fn layer<S>(&self) -> Filtered<impl Layer<S>, Targets, S>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    {
        let tracer = self.provider.tracer("keel");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_tracked_inactivity(false)
            // Not activated on enter: a turn's span is named after its agent
            // once the turn knows it, which a started span would ignore.
            .with_context_activation(false)
            .with_threads(false)
            .with_location(false)
            .with_target(false)
            .with_level(false)
            .with_filter(Targets::new().with_target(TRACE_TARGET, LevelFilter::INFO))
    }

    /// Exports every span ended so far; blocks until the collector answered
    /// or the export timed out.
    pub fn flush(&self) -> Result<(), String> {
        self.provider
            .force_flush()
            .map_err(|e| format!("telemetry: flushing spans failed: {e}"))
    }

    /// Exports what is left (waiting at most a few seconds) and stops.
    pub fn shutdown(self) -> Result<(), String> {
        self.provider
            .shutdown_with_timeout(SHUTDOWN_TIMEOUT)
            .map_err(|e| format!("telemetry: exporting the last spans failed: {e}"))
    }
}

/// Keeps at most [`QUEUE_SPANS`] spans between their end and their export,
/// so the batch processor's own queue never drops uncounted.
#[derive(Debug)]
struct Bounded(BatchSpanProcessor);

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.0.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if QUEUED.fetch_add(1, Ordering::AcqRel) >= QUEUE_SPANS {
            QUEUED.fetch_sub(1, Ordering::AcqRel);
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.0.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// The exporter, counting what leaves the queue and what the collector refused.
#[derive(Debug)]
struct Counted<E>(E);

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let n = batch.len();
        let export = self.0.export(batch);
        async move {
            let result = export.await;
            QUEUED.fetch_sub(n, Ordering::AcqRel);
            if result.is_err() {
                DROPPED.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
            }
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// Captures a span's OpenTelemetry context and links to it later.
struct OtelLinker;

impl SpanLinker for OtelLinker {
    fn capture(&self, span: &tracing::Span) -> Option<SpanHandle> {
        let context = span.context();
        let span_context = context.span().span_context().clone();
        span_context
            .is_valid()
            .then(|| SpanHandle(Arc::new(span_context)))
    }

    fn link(&self, span: &tracing::Span, to: &SpanHandle) {
        if let Some(target) = to.0.downcast_ref::<SpanContext>() {
            span.add_link(target.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn export_is_off_without_an_endpoint_and_on_with_one_from_config_or_env() {
        let none = TelemetryConfig::default();
        assert_eq!(ExportSettings::resolve(&none, &env(&[])), Ok(None));
        let configured = TelemetryConfig {
            otlp_endpoint: Some("http://127.0.0.1:4318/".into()),
            headers_env: Some("HDRS".into()),
            ..TelemetryConfig::default()
        };
        let on = ExportSettings::resolve(
            &configured,
            &env(&[
                ("HDRS", "api-key = s3cret, bad ,x=1"),
                ("OTEL_SERVICE_NAME", "svc"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            on.traces_url.as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        assert_eq!(
            on.headers,
            [
                ("api-key".to_owned(), "s3cret".to_owned()),
                ("x".into(), "1".into())
            ]
        );
        assert_eq!(on.service_name, "svc");
        assert!(!on.record_content);
        let from_env = ExportSettings::resolve(
            &none,
            &env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            from_env.traces_url, None,
            "the exporter reads the variable itself"
        );
        assert_eq!(from_env.service_name, "keel");
        let disabled = ExportSettings::resolve(&configured, &env(&[("OTEL_SDK_DISABLED", "true")]));
        assert_eq!(disabled, Ok(None));
        // A headers variable named but not set is said, not ignored.
        assert_eq!(
            ExportSettings::resolve(&configured, &env(&[])),
            Err("telemetry.headers_env names $HDRS, which is not set".to_owned())
        );
    }
}
