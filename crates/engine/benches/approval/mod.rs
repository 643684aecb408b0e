//! The approval figure of the engine benchmark: how soon a decision puts
//! the approved tool to work, for a root turn and for a background run,
//! against a user turn's send → first streamed text in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use keel_catalog::{AgentCatalog, CatalogInputs};
use keel_core::{
    AgentId, CancellationToken, ChatRequest, DelegationPolicy, Provider, ProviderError,
    ProviderStream, Role, ScriptedProvider, ScriptedResponse, StreamEvent, Tool, ToolError,
    ToolExecutionContext, ToolOutput, ToolRegistry,
};
use keel_engine::{
    AgentCoordinator, AgentProfile, ApprovalPolicy, CoordinatorConfig, ExecutionGate, GateLimits,
    ProfileProviders, RuntimeBundle, SessionEvent, SessionManager, SessionManagerConfig,
};
use keel_store::{Decision, Store, StoreOptions};
use parking_lot::Mutex;

/// Samples per figure.
const SAMPLES: usize = 200;

/// When the figure's ends happened, noted by the tool and the model.
#[derive(Default)]
struct Marks {
    /// The gated tool started.
    acted: Mutex<Option<Instant>>,
    /// The root model's first streamed text since the last reset.
    first_text: Mutex<Option<Instant>>,
}

/// The gated tool: notes when it starts.
struct Act(Arc<Marks>);

#[async_trait]
impl Tool for Act {
    fn name(&self) -> &str {
        "act"
    }
    fn description(&self) -> &str {
        "acts"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({"type": "object"})
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    async fn execute(
        &self,
        _: serde_json::Value,
        _: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        self.0.acted.lock().get_or_insert_with(Instant::now);
        Ok(ToolOutput::text("acted"))
    }
}

/// Root and sub-agent model: "go" calls `act`, "bg" delegates to `bg`, a
/// background task calls `act`; after a tool result or anything else it
/// answers.
fn model(request: &ChatRequest) -> ScriptedResponse {
    match request.messages.last() {
        Some(m) if m.role == Role::User && m.text() == "go" => {
            ScriptedResponse::tool_call("act", serde_json::json!({}))
        }
        Some(m) if m.role == Role::User && m.text() == "bg" => ScriptedResponse::tool_call(
            "delegate",
            serde_json::json!({"mode": "background", "tasks": [{"agent": "bg", "task": "act now"}]}),
        ),
        Some(m) if m.role == Role::User && m.text() == "act now" => {
            ScriptedResponse::tool_call("act", serde_json::json!({}))
        }
        Some(m) if m.role == Role::Tool => ScriptedResponse::text("done"),
        _ => ScriptedResponse::text("noted"),
    }
}

/// [`model`], noting when its first text is polled.
struct Noting {
    model: ScriptedProvider,
    marks: Arc<Marks>,
}

#[async_trait]
impl Provider for Noting {
    fn name(&self) -> &str {
        self.model.name()
    }
    fn model(&self) -> &str {
        self.model.model()
    }
    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let marks = self.marks.clone();
        let stream = self.model.stream(request, cancel).await?;
        Ok(Box::pin(stream.inspect(move |event| {
            if let Ok(StreamEvent::TextDelta { .. }) = event {
                marks.first_text.lock().get_or_insert_with(Instant::now);
            }
        })))
    }
}

fn runtime(store: Store, marks: Arc<Marks>) -> Arc<SessionManager> {
    let act: Arc<dyn Tool> = Arc::new(Act(marks.clone()));
    let mut shared = ToolRegistry::new();
    shared.register(act.clone()).unwrap();
    let mut inputs = CatalogInputs::new(["default"], Arc::new(shared));
    inputs.root_delegates = vec![AgentId::parse("bg").unwrap()];
    let bg = "---\nid: bg\ndescription: Acts in the background.\nllm_profile: default\n\
              tools: [act]\napproval: [act]\n---\nYou are bg.\n";
    let catalog = AgentCatalog::from_texts([("bg.md", bg)], &inputs, 1).unwrap();
    let provider: Arc<dyn Provider> = Arc::new(Noting {
        model: ScriptedProvider::new(Vec::new()).with_fallback(Arc::new(model)),
        marks,
    });
    let gate = Arc::new(ExecutionGate::new(GateLimits::uniform(64)));
    let mut registry = ToolRegistry::new();
    registry.register(act.clone()).unwrap();
    let coordinator = AgentCoordinator::new(
        store.clone(),
        Arc::new(catalog),
        Arc::new(ProfileProviders::new().with("default", provider.clone())),
        Arc::new(registry),
        gate.clone(),
        CoordinatorConfig::default(),
    );
    let mut tools = ToolRegistry::new();
    tools.register(act).unwrap();
    for t in coordinator.root_tools() {
        tools.register(t).unwrap();
    }
    let profile = AgentProfile {
        name: AgentId::root(),
        system_prompt: "You are the root.".into(),
        provider,
        tools: Arc::new(tools),
        max_iterations: 4,
        max_output_tokens: None,
        context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
        approval: ApprovalPolicy::tools(["act"]),
        prices: None,
    };
    let bundle = RuntimeBundle::new(profile)
        .with_loop(keel_engine::AgentLoop::new(gate))
        .with_coordinator(coordinator);
    SessionManager::new(
        store,
        bundle,
        SessionManagerConfig {
            auto_title_after: 0,
            ..Default::default()
        },
    )
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Decision latency: `decide_approval` returned (the decision committed)
/// → the approved tool started, for a root turn's call and for a
/// background run's; against a user turn's `send` → first streamed text,
/// same manager, same model.
pub async fn decision_latency(dir: &std::path::Path) {
    let store = Store::open(dir.join("approval.db"), StoreOptions::default()).unwrap();
    let marks = Arc::new(Marks::default());
    let m = runtime(store, marks.clone());
    let (mut root, mut run, mut user) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..SAMPLES {
        let id = m
            .create(super::spec("approval", &format!("d{i}")))
            .await
            .unwrap();
        let mut feed = m.events().subscribe(id).await.unwrap();
        for (input, samples) in [("go", &mut root), ("bg", &mut run)] {
            m.submit_turn(id, input).await.unwrap();
            let asked = loop {
                if let SessionEvent::ApprovalRequested(a) = feed.recv().await.unwrap().as_ref() {
                    break (**a).clone();
                }
            };
            *marks.acted.lock() = None;
            m.decide_approval(asked.id, Some(id), Decision::Approve, None)
                .await
                .unwrap();
            let decided = Instant::now();
            // The continuation answering the decision (root) or the run's
            // result (background) commits last.
            loop {
                if let SessionEvent::TurnCommitted {
                    origin: keel_core::TurnOrigin::AgentContinuation,
                    ..
                } = feed.recv().await.unwrap().as_ref()
                {
                    break;
                }
            }
            let acted = marks.acted.lock().expect("the approved tool ran");
            samples.push(acted.saturating_duration_since(decided));
        }
        *marks.first_text.lock() = None;
        let sent = Instant::now();
        m.submit_turn(id, "hello").await.unwrap();
        let first = marks.first_text.lock().unwrap();
        user.push(first - sent);
    }
    let fig = |name: &'static str, samples: &mut Vec<Duration>| {
        (
            name,
            super::inbox::percentile(samples, 0.5),
            super::inbox::percentile(samples, 0.99),
        )
    };
    let figures = [fig("root_turn", &mut root), fig("background_run", &mut run)];
    let (u50, u99) = (
        super::inbox::percentile(&mut user, 0.5),
        super::inbox::percentile(&mut user, 0.99),
    );
    for (name, p50, p99) in figures {
        println!(
            "BENCH approval_resume kind={name} samples={SAMPLES} p50_us={:.0} p99_us={:.0} \
             user_turn_p50_us={:.0} user_turn_p99_us={:.0} ratio_p50={:.2} ratio_p99={:.2} target_ratio<=2",
            us(p50),
            us(p99),
            us(u50),
            us(u99),
            super::ratio(us(p50), us(u50)),
            super::ratio(us(p99), us(u99)),
        );
    }
}
