//! Shared setup for engine tests: a real SQLite file in a temp dir and a
//! bundle whose root agent runs a ScriptedProvider.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use keel_core::{AgentId, ScriptedProvider, ScriptedResponse, ToolRegistry};
use keel_engine::AgentProfile;
use keel_engine::DialogAddress;
use keel_engine::{NewSessionSpec, RuntimeBundle, SessionManager, SessionManagerConfig};
use keel_store::{Store, StoreOptions};

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub provider: ScriptedProvider,
    pub manager: Arc<SessionManager>,
}

pub fn profile(name: &str, provider: &ScriptedProvider, tools: ToolRegistry) -> AgentProfile {
    AgentProfile {
        name: AgentId::parse(name).unwrap(),
        system_prompt: format!("You are {name}."),
        provider: Arc::new(provider.clone()),
        tools: Arc::new(tools),
        max_iterations: 8,
        max_output_tokens: None,
        context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
        approval: keel_engine::ApprovalPolicy::none(),
        prices: None,
    }
}

pub fn open_store(dir: &Path) -> Store {
    Store::open(dir.join("keel.db"), StoreOptions::default()).unwrap()
}

pub fn manager_on(
    store: Store,
    provider: &ScriptedProvider,
    config: SessionManagerConfig,
) -> Arc<SessionManager> {
    let bundle = RuntimeBundle::new(profile("root", provider, ToolRegistry::new()))
        .with_agent(profile("helper", provider, ToolRegistry::new()));
    SessionManager::new(store, bundle, config)
}

pub fn harness(config: SessionManagerConfig) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let provider = ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    let manager = manager_on(open_store(dir.path()), &provider, config);
    Harness {
        dir,
        provider,
        manager,
    }
}

pub fn address(dialog: &str) -> DialogAddress {
    DialogAddress::new("test", "chat", dialog).unwrap()
}

pub fn spec(dialog: &str) -> NewSessionSpec {
    NewSessionSpec {
        address: address(dialog),
        title: None,
        agent: None,
    }
}

/// Texts of the visible messages of the current slot.
pub async fn visible_texts(manager: &SessionManager, id: keel_core::SessionId) -> Vec<String> {
    let s = manager.session(id).await.unwrap();
    let g = s.lock().await;
    g.visible_messages()
        .unwrap()
        .iter()
        .map(|m| m.message.text())
        .collect()
}

/// Texts of the visible user messages of the current slot no turn answered.
pub async fn unanswered(manager: &SessionManager, id: keel_core::SessionId) -> Vec<String> {
    let s = manager.session(id).await.unwrap();
    let g = s.lock().await;
    g.unanswered()
        .unwrap()
        .iter()
        .map(|m| m.message.text())
        .collect()
}

pub fn replies(p: &ScriptedProvider, texts: &[&str]) {
    p.push(texts.iter().map(|t| ScriptedResponse::text(*t)));
}

/// Waits on `feed` for a turn event matching `wanted` and returns it.
pub async fn turn_event(
    feed: &mut keel_engine::SessionSubscription,
    wanted: impl Fn(&keel_engine::TurnEvent) -> bool,
) -> keel_engine::TurnEvent {
    loop {
        let event = feed.recv().await.unwrap();
        if let keel_engine::SessionEvent::Turn { event, .. } = event.as_ref() {
            if wanted(event) {
                return event.clone();
            }
        }
    }
}

/// A provider that answers like `inner` but holds every call until the test
/// releases it: the test knows a call is in flight without any timer.
pub struct HeldProvider {
    pub inner: ScriptedProvider,
    pub started: tokio::sync::Semaphore,
    pub release: tokio::sync::Semaphore,
}

impl HeldProvider {
    pub fn new(inner: ScriptedProvider) -> Arc<Self> {
        Arc::new(Self {
            inner,
            started: tokio::sync::Semaphore::new(0),
            release: tokio::sync::Semaphore::new(0),
        })
    }

    /// Waits until a call is in flight.
    pub async fn wait_started(&self) {
        self.started.acquire().await.unwrap().forget();
    }
}

#[async_trait::async_trait]
impl keel_core::Provider for HeldProvider {
    fn name(&self) -> &str {
        "held"
    }
    fn model(&self) -> &str {
        "held-model"
    }
    async fn stream(
        &self,
        request: &keel_core::ChatRequest,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<keel_core::ProviderStream, keel_core::ProviderError> {
        self.started.add_permits(1);
        tokio::select! {
            _ = cancel.cancelled() => return Err(keel_core::ProviderError::Cancelled),
            p = self.release.acquire() => p.unwrap().forget(),
        }
        self.inner.stream(request, cancel).await
    }
}

/// A manager whose root agent runs `provider`.
pub fn manager_with(
    store: Store,
    provider: Arc<dyn keel_core::Provider>,
    config: SessionManagerConfig,
) -> Arc<SessionManager> {
    let mut root = profile(
        "root",
        &ScriptedProvider::new(Vec::<ScriptedResponse>::new()),
        ToolRegistry::new(),
    );
    root.provider = provider;
    SessionManager::new(store, RuntimeBundle::new(root), config)
}

/// Records the spans of target `keel_trace` as they close: the OTel name
/// and every field recorded on them.
#[derive(Default, Clone)]
pub struct SpanRecorder(pub std::sync::Arc<parking_lot::Mutex<Vec<ClosedSpan>>>);

/// A closed span: its OTel name and fields.
pub type ClosedSpan = (String, std::collections::BTreeMap<String, String>);

#[derive(Default)]
pub struct Fields(pub std::collections::BTreeMap<String, String>);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S> tracing_subscriber::Layer<S> for SpanRecorder
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }
    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(fields);
            }
        }
    }
    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        if span.metadata().target() != keel_engine::TRACE_TARGET {
            return;
        }
        let fields = span
            .extensions_mut()
            .remove::<Fields>()
            .unwrap_or_default()
            .0;
        let name = fields.get("otel.name").cloned().unwrap_or_default();
        self.0.lock().push((name, fields));
    }
}

impl SpanRecorder {
    /// The closed spans, in the order they closed.
    pub fn spans(&self) -> Vec<ClosedSpan> {
        self.0.lock().clone()
    }
}
