//! The inbox figures of the engine benchmark: how fast a background result
//! reaches the root agent, and how many results the engine delivers per
//! second, each against a baseline measured in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use keel_catalog::{AgentCatalog, CatalogInputs};
use keel_core::{
    AgentId, CancellationToken, ChatRequest, Message, Provider, ProviderError, ProviderStream,
    Role, ScriptedProvider, ScriptedResponse, SessionId, StreamEvent, ToolRegistry, TurnOrigin,
};
use keel_engine::{
    AgentCoordinator, AgentProfile, CoordinatorConfig, ExecutionGate, GateLimits, ProfileProviders,
    RuntimeBundle, SessionEvent, SessionManager, SessionManagerConfig,
};
use keel_store::{
    AcceptRun, ClaimRequest, CompletionHandling, ContinuationCommit, LeasedEvents, NewMessage,
    NewRun, NewSession, Store, StoreOptions, TerminalOutcome, TurnCommit,
};
use parking_lot::Mutex;
use tokio::sync::Semaphore;

/// Latency samples per side.
const LATENCY_SAMPLES: usize = 200;
/// Dialogs of the delivery-rate figure.
const DIALOGS: usize = 8;
/// Background runs per dialog (one delegate call each).
const RUNS_PER_DIALOG: usize = 16;
/// Rounds of the delivery-rate figure (the median is reported).
const ROUNDS: usize = 5;

/// The root's model, a pure function of the request: "fan" delegates
/// [`RUNS_PER_DIALOG`] background tasks, "go" one; after a tool result or
/// any other input (a continuation's trigger among them) it answers.
fn root_model(request: &ChatRequest) -> ScriptedResponse {
    let last = request.messages.last();
    let tasks = |n: usize| -> Vec<serde_json::Value> {
        (0..n)
            .map(|i| serde_json::json!({"agent": "bg", "task": format!("task {i}")}))
            .collect()
    };
    let delegate = |n: usize| {
        ScriptedResponse::tool_call(
            "delegate",
            serde_json::json!({"mode": "background", "tasks": tasks(n), "completion_policy": "each"}),
        )
    };
    match last {
        Some(m) if m.role == Role::User && m.text() == "fan" => delegate(RUNS_PER_DIALOG),
        Some(m) if m.role == Role::User && m.text() == "go" => delegate(1),
        Some(m) if m.role == Role::Tool => ScriptedResponse::text("started"),
        _ => ScriptedResponse::text("noted"),
    }
}

/// When the latency figure's two ends happened, recorded by the models
/// themselves (a feed reader on this single-threaded runtime may be polled
/// only after both events are queued).
#[derive(Default)]
struct Marks {
    /// The background run's model answered (its terminal commit follows).
    answered: Mutex<Option<Instant>>,
    /// The root model's first streamed text since the last reset.
    first_text: Mutex<Option<Instant>>,
}

/// The background agent's model: answers at once, or after a permit of
/// its gate when it has one.
struct SubModel {
    gate: Option<Arc<Semaphore>>,
    marks: Arc<Marks>,
}

#[async_trait]
impl Provider for SubModel {
    fn name(&self) -> &str {
        "sub"
    }

    fn model(&self) -> &str {
        "sub"
    }

    async fn stream(
        &self,
        _request: &ChatRequest,
        _cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        if let Some(gate) = &self.gate {
            gate.acquire().await.unwrap().forget();
        }
        *self.marks.answered.lock() = Some(Instant::now());
        let events = vec![
            Ok(StreamEvent::TextDelta {
                text: "done".into(),
            }),
            Ok(StreamEvent::Finish {
                reason: keel_core::FinishReason::Stop,
            }),
        ];
        Ok(Box::pin(futures::stream::iter(events)))
    }
}

/// The root's model: [`root_model`], noting when its first text is polled
/// (the engine publishes it in the same poll).
struct RootModel {
    model: ScriptedProvider,
    marks: Arc<Marks>,
}

#[async_trait]
impl Provider for RootModel {
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

/// A manager whose root may delegate to `bg` (answered by `sub`).
fn runtime(store: Store, sub: Arc<dyn Provider>, marks: Arc<Marks>) -> Arc<SessionManager> {
    let mut inputs = CatalogInputs::new(["default", "sub"], Arc::new(ToolRegistry::new()));
    inputs.root_delegates = vec![AgentId::parse("bg").unwrap()];
    let bg =
        "---\nid: bg\ndescription: Works in the background.\nllm_profile: sub\n---\nYou are bg.\n";
    let catalog = AgentCatalog::from_texts([("bg.md", bg)], &inputs, 1).unwrap();
    let gate = Arc::new(ExecutionGate::new(GateLimits::uniform(1024)));
    let root: Arc<dyn Provider> = Arc::new(RootModel {
        model: ScriptedProvider::new(Vec::new()).with_fallback(Arc::new(root_model)),
        marks,
    });
    let coordinator = AgentCoordinator::new(
        store.clone(),
        Arc::new(catalog),
        Arc::new(
            ProfileProviders::new()
                .with("default", root.clone())
                .with("sub", sub),
        ),
        Arc::new(ToolRegistry::new()),
        gate.clone(),
        CoordinatorConfig {
            max_children_per_call: RUNS_PER_DIALOG as u32,
            max_runs_per_tree: RUNS_PER_DIALOG as u32,
            ..CoordinatorConfig::default()
        },
    );
    let mut tools = ToolRegistry::new();
    for t in coordinator.root_tools() {
        tools.register(t).unwrap();
    }
    let profile = AgentProfile {
        name: AgentId::root(),
        system_prompt: "You are the root.".into(),
        provider: root,
        tools: Arc::new(tools),
        max_iterations: 4,
        max_output_tokens: None,
        context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
        approval: keel_engine::ApprovalPolicy::none(),
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

/// The `p` quantile of `samples` (sorted in place).
pub(crate) fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i]
}

/// Continuation latency: from a background run's model answer (its
/// terminal commit, the wake and the claim follow) to the first streamed
/// text of the continuation that answers it while the dialog is idle;
/// against a user turn's latency from `send` to its first streamed text,
/// same manager, same model. Both ends are noted by the models.
pub async fn continuation_latency(dir: &std::path::Path) {
    let store = Store::open(dir.join("latency.db"), StoreOptions::default()).unwrap();
    let gate = Arc::new(Semaphore::new(0));
    let marks = Arc::new(Marks::default());
    let m = runtime(
        store,
        Arc::new(SubModel {
            gate: Some(gate.clone()),
            marks: marks.clone(),
        }),
        marks.clone(),
    );
    let (mut continuation, mut user) = (Vec::new(), Vec::new());
    for i in 0..LATENCY_SAMPLES {
        let id = m
            .create(super::spec("latency", &format!("d{i}")))
            .await
            .unwrap();
        let mut feed = m.events().subscribe(id).await.unwrap();
        // The run waits until the user turn committed: its result arrives
        // while the dialog is idle.
        m.submit_turn(id, "go").await.unwrap();
        *marks.first_text.lock() = None;
        gate.add_permits(1);
        loop {
            if let SessionEvent::TurnCommitted {
                origin: TurnOrigin::AgentContinuation,
                ..
            } = feed.recv().await.unwrap().as_ref()
            {
                break;
            }
        }
        let (answered, first) = (*marks.answered.lock(), *marks.first_text.lock());
        continuation.push(first.unwrap() - answered.unwrap());
        *marks.first_text.lock() = None;
        let sent = Instant::now();
        m.submit_turn(id, "hello").await.unwrap();
        let first = marks.first_text.lock().unwrap();
        user.push(first - sent);
    }
    let (c50, c99) = (
        percentile(&mut continuation, 0.5),
        percentile(&mut continuation, 0.99),
    );
    let (u50, u99) = (percentile(&mut user, 0.5), percentile(&mut user, 0.99));
    println!(
        "BENCH continuation_latency samples={LATENCY_SAMPLES} p50_us={:.0} p99_us={:.0} \
         user_turn_p50_us={:.0} user_turn_p99_us={:.0} ratio_p50={:.2} target_p50_ms<=5 target_p99_ms<=25",
        super::us(c50),
        super::us(c99),
        super::us(u50),
        super::us(u99),
        super::ratio(super::us(c50), super::us(u50))
    );
}

/// One round of [`DIALOGS`] × [`RUNS_PER_DIALOG`] background runs, all
/// started at once.
struct Round {
    /// Seconds until every completion was consumed by a continuation.
    total: f64,
    /// Seconds until the last run's end was on its dialog's feed.
    runs_done: f64,
    /// Continuation turns started, all dialogs together.
    continuations: usize,
    /// Store write requests during the round.
    writes: u64,
}

async fn delivery_round(m: &Arc<SessionManager>, round: usize) -> Round {
    let mut ids = Vec::new();
    for d in 0..DIALOGS {
        ids.push(
            m.create(super::spec("rate", &format!("r{round}d{d}")))
                .await
                .unwrap(),
        );
    }
    let mut feeds = Vec::new();
    for id in &ids {
        feeds.push(m.events().subscribe(*id).await.unwrap());
    }
    let writes = m.store().commit_stats().requests;
    let started = Instant::now();
    let mut tickets = Vec::new();
    for id in &ids {
        tickets.push(m.send(*id, Message::user("fan")).await.unwrap());
    }
    let waits = ids.iter().zip(feeds).map(|(id, mut feed)| {
        let store = m.store().clone();
        let id = *id;
        async move {
            let (mut last_run, mut continuations) = (started, 0);
            loop {
                let delivered = store.inbox_usage(id).await.unwrap();
                let runs = store.list_runs(id, None, 100).await.unwrap().items;
                if runs.len() == RUNS_PER_DIALOG
                    && delivered.pending_event_count == 0
                    && delivered.reserved_completion_slots == 0
                {
                    return (last_run, continuations);
                }
                // Look again after the next committed turn (or a lag).
                loop {
                    match feed.recv().await.as_deref() {
                        Ok(SessionEvent::TurnCommitted { .. }) | Err(_) => break,
                        Ok(SessionEvent::RunUpdated { run, .. }) if run.status.is_terminal() => {
                            last_run = Instant::now();
                        }
                        Ok(SessionEvent::TurnStarted {
                            origin: TurnOrigin::AgentContinuation,
                            ..
                        }) => continuations += 1,
                        Ok(_) => {}
                    }
                }
            }
        }
    });
    let ends = futures::future::join_all(waits).await;
    let total = started.elapsed().as_secs_f64();
    for t in tickets {
        t.outcome().await.unwrap();
    }
    Round {
        total,
        runs_done: ends
            .iter()
            .map(|(at, _)| (*at - started).as_secs_f64())
            .fold(0.0, f64::max),
        continuations: ends.iter().map(|(_, n)| n).sum(),
        writes: m.store().commit_stats().requests - writes,
    }
}

/// A background run of `root`, as the store benchmark makes them.
fn bench_run(root: SessionId) -> NewRun {
    let id = keel_core::RunId::new();
    NewRun {
        id,
        root_session_id: root,
        root_turn_id: None,
        parent_run_id: None,
        caller_agent_id: AgentId::root(),
        caller_scope_id: "scope".into(),
        idempotency_key: None,
        agent_id: AgentId::parse("bg").unwrap(),
        definition_hash: "h".into(),
        provider_profile: "sub".into(),
        provider_name: "sub".into(),
        model_id: "sub".into(),
        mode: keel_core::ExecutionMode::Background,
        depth: 1,
        plan_item_id: None,
        execution_id: id.to_string(),
        task: "t".into(),
        context_json: None,
        budget_json: "{}".into(),
        signal_contract_json: None,
        signal_delivery: None,
        completion_delivery: None,
        failure_delivery: None,
        runtime_generation: 1,
        deadline_at_ms: i64::MAX,
    }
}

/// Commits [`RUNS_PER_DIALOG`] background runs of each of `sessions`
/// terminal at `now_ms`, so their completions wait in the inbox, due at
/// once (the engine dead-letters events older than its TTL by the wall
/// clock, so its figure passes the wall clock).
async fn fill_inbox(store: &Store, sessions: &[SessionId], now_ms: i64) {
    for s in sessions {
        for _ in 0..RUNS_PER_DIALOG {
            let run = bench_run(*s);
            store
                .accept_run(AcceptRun {
                    run: run.clone(),
                    inbox_capacity: 1000,
                    now_ms,
                })
                .await
                .unwrap();
            store
                .commit_terminal(
                    run.id,
                    run.execution_id,
                    TerminalOutcome::Completed {
                        result: "done".into(),
                        usage: keel_core::Usage::default(),
                        tool_calls: 0,
                        iterations: 1,
                        cost: None,
                    },
                    CompletionHandling::Deliver,
                    now_ms,
                )
                .await
                .unwrap();
        }
    }
}

/// The store alone: [`DIALOGS`] × [`RUNS_PER_DIALOG`] completions already
/// in the inbox, claimed 8 at a time and consumed by a continuation commit
/// of two messages; returns events per second.
async fn store_claim_consume(store: &Store) -> f64 {
    let mut sessions = Vec::new();
    for _ in 0..DIALOGS {
        let s = store
            .create_session(NewSession {
                id: SessionId::new(),
                channel: "bench".into(),
                chat_id: "store".into(),
                dialog_id: format!("s{}", SessionId::new()),
                title: "bench".into(),
                agent_id: None,
                parent_id: None,
                delivery_context: None,
                now_ms: 1,
            })
            .await
            .unwrap();
        sessions.push(s.id);
    }
    fill_inbox(store, &sessions, 2).await;
    let started = Instant::now();
    let mut consumed = 0u64;
    for (turn, id) in sessions.iter().enumerate() {
        while let Some(lease) = store
            .claim_inbox_batch(ClaimRequest {
                root_session_id: *id,
                now_ms: 10,
                lease_ms: 60_000,
                max_events: 8,
                max_bytes: 32 * 1024,
                delivery: None,
            })
            .await
            .unwrap()
        {
            let event_ids = lease.events.iter().map(|e| e.id).collect();
            consumed += store
                .commit_continuation_turn(ContinuationCommit {
                    turn: TurnCommit {
                        calls: None,
                        session_id: *id,
                        messages: vec![
                            NewMessage::new(Message::user("[results]").hidden()),
                            NewMessage::new(Message::assistant("noted")),
                        ],
                        state: turn.to_string().into_bytes(),
                        checkpoint: None,
                        visible_user_inputs: 0,
                        answers: Vec::new(),
                        expected_head: None,
                        now_ms: 11,
                    },
                    consumed: vec![LeasedEvents {
                        lease_token: lease.token,
                        event_ids,
                    }],
                })
                .await
                .unwrap()
                .consumed;
        }
    }
    consumed as f64 / started.elapsed().as_secs_f64()
}

/// The engine delivering completions already in the inbox, the same
/// [`DIALOGS`] × [`RUNS_PER_DIALOG`] as [`store_claim_consume`]: from
/// waking every dialog (as start-up does for sessions with due events)
/// until none has an event pending, the continuation turns committed;
/// returns events per second and the continuations per dialog.
async fn engine_delivery(m: &Arc<SessionManager>, round: usize) -> (f64, f64) {
    let mut ids = Vec::new();
    for d in 0..DIALOGS {
        ids.push(
            m.create(super::spec("deliver", &format!("q{round}d{d}")))
                .await
                .unwrap(),
        );
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    fill_inbox(m.store(), &ids, now_ms).await;
    let mut feeds = Vec::new();
    for id in &ids {
        feeds.push(m.events().subscribe(*id).await.unwrap());
    }
    let started = Instant::now();
    for id in &ids {
        m.wake_inbox(*id);
    }
    let waits = ids.iter().zip(feeds).map(|(id, mut feed)| {
        let store = m.store().clone();
        let id = *id;
        async move {
            let mut continuations = 0;
            while store.inbox_counts(id).await.unwrap().pending > 0 {
                // Look again after the next committed turn (or a lag).
                loop {
                    match feed.recv().await.as_deref() {
                        Ok(SessionEvent::TurnCommitted { .. }) | Err(_) => break,
                        Ok(SessionEvent::TurnStarted {
                            origin: TurnOrigin::AgentContinuation,
                            ..
                        }) => continuations += 1,
                        Ok(_) => {}
                    }
                }
            }
            continuations
        }
    });
    let continuations: usize = futures::future::join_all(waits).await.into_iter().sum();
    let elapsed = started.elapsed().as_secs_f64();
    for id in &ids {
        let counts = m.store().inbox_counts(*id).await.unwrap();
        assert_eq!(
            (counts.pending, counts.delivered, counts.dead_lettered),
            (0, RUNS_PER_DIALOG as u64, 0),
            "every completion consumed by a continuation"
        );
    }
    (
        (DIALOGS * RUNS_PER_DIALOG) as f64 / elapsed,
        continuations as f64 / DIALOGS as f64,
    )
}

/// Completions delivered per second end to end (run → terminal commit →
/// wake → claim → continuation turn → commit) against the store's own
/// claim → consume rate of as many events.
pub async fn delivery_rate(dir: &std::path::Path) {
    let store = Store::open(dir.join("rate.db"), StoreOptions::default()).unwrap();
    let marks = Arc::new(Marks::default());
    let m = runtime(
        store.clone(),
        Arc::new(SubModel {
            gate: None,
            marks: marks.clone(),
        }),
        marks,
    );
    let total = (DIALOGS * RUNS_PER_DIALOG) as f64;
    let (mut rates, mut store_rates, mut runs_share, mut continuations, mut writes) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut delivery_only, mut delivery_continuations) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let r = delivery_round(&m, round).await;
        rates.push(total / r.total);
        runs_share.push(r.runs_done / r.total);
        continuations.push(r.continuations as f64 / DIALOGS as f64);
        writes.push(r.writes as f64 / total);
        store_rates.push(store_claim_consume(&store).await);
        let (rate, continuations) = engine_delivery(&m, round).await;
        delivery_only.push(rate);
        delivery_continuations.push(continuations);
    }
    let median = |xs: &mut Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    let (e2e, raw) = (median(&mut rates), median(&mut store_rates));
    println!(
        "BENCH inbox_delivery dialogs={DIALOGS} runs_per_dialog={RUNS_PER_DIALOG} rounds={ROUNDS} \
         delivered_per_s={e2e:.0} store_claim_consume_per_s={raw:.0} ratio={:.2} \
         runs_done_share={:.2} continuations_per_dialog={:.1} writes_per_completion={:.1} target_ratio>=0.3",
        super::ratio(e2e, raw),
        median(&mut runs_share),
        median(&mut continuations),
        median(&mut writes),
    );
    let only = median(&mut delivery_only);
    println!(
        "BENCH inbox_delivery_only dialogs={DIALOGS} events_per_dialog={RUNS_PER_DIALOG} rounds={ROUNDS} \
         delivered_per_s={only:.0} store_claim_consume_per_s={raw:.0} ratio={:.2} \
         continuations_per_dialog={:.1} target_ratio>=0.3",
        super::ratio(only, raw),
        median(&mut delivery_continuations),
    );
}
