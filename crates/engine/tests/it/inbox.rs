//! Background results reach the root agent: completions wake the session
//! worker, a hidden continuation turn answers them and consumes exactly
//! the events it claimed, failures back off and end in a dead letter the
//! user is told about, fairness lets results overtake a burst of user turns,
//! `/stop` leaves nothing leased, and a restart delivers what a crash left.
//! Synchronized through the session feed, run observer events and provider
//! holds, never a sleep.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_catalog::{AgentCatalog, CatalogInputs};
use keel_core::{
    AgentId, CancellationToken, ChatRequest, ClientVisibility, Message, Provider, ProviderError,
    ProviderStream, Role, RunId, ScriptedErrorKind, ScriptedProvider, ScriptedResponse, SessionId,
    ToolRegistry, TurnOrigin,
};
use keel_engine::{
    AgentCoordinator, AgentProfile, CoordinatorConfig, ExecutionGate, GateLimits, InboxPolicy,
    ProfileProviders, RunEvent, RunObserver, RuntimeBundle, SessionEvent, SessionManager,
    SessionManagerConfig, SessionSubscription,
};
use keel_store::{EventStatus, Store, StoreOptions};
use parking_lot::Mutex;
use serde_json::json;
use tokio::sync::{mpsc, Notify};

use crate::common::spec;

/// Guards a wait on the other side: a hang fails the test instead of CI.
const HANG: Duration = Duration::from_secs(30);

/// A provider that answers from a script but holds chosen calls (by their
/// 1-based index) until released, and records when each call arrived.
struct Held {
    inner: ScriptedProvider,
    calls: AtomicUsize,
    holds: Mutex<HashMap<usize, Arc<Notify>>>,
    arrived: mpsc::UnboundedSender<usize>,
    at: Mutex<Vec<tokio::time::Instant>>,
}

impl Held {
    fn new(inner: ScriptedProvider) -> (Arc<Self>, mpsc::UnboundedReceiver<usize>) {
        let (arrived, rx) = mpsc::unbounded_channel();
        (
            Arc::new(Self {
                inner,
                calls: AtomicUsize::new(0),
                holds: Mutex::new(HashMap::new()),
                arrived,
                at: Mutex::new(Vec::new()),
            }),
            rx,
        )
    }

    /// Holds call `n` until the returned notify is notified.
    fn hold(&self, n: usize) -> Arc<Notify> {
        Arc::clone(self.holds.lock().entry(n).or_default())
    }
}

#[async_trait]
impl Provider for Held {
    fn name(&self) -> &str {
        "held"
    }
    fn model(&self) -> &str {
        "held-model"
    }
    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.at.lock().push(tokio::time::Instant::now());
        let _ = self.arrived.send(n);
        let hold = self.holds.lock().get(&n).cloned();
        if let Some(hold) = hold {
            tokio::select! {
                _ = cancel.cancelled() => return Err(ProviderError::Cancelled),
                () = hold.notified() => {}
            }
        }
        self.inner.stream(request, cancel).await
    }
}

/// Reports `AGENT:committed` for every terminal commit.
struct Commits(mpsc::UnboundedSender<(RunId, String)>);

impl RunObserver for Commits {
    fn on_run_event(&self, run: RunId, agent: &AgentId, event: RunEvent) {
        if let RunEvent::Committed { won: true, .. } = event {
            let _ = self.0.send((run, agent.to_string()));
        }
    }
}

fn echo_task(request: &ChatRequest) -> ScriptedResponse {
    let task = request
        .messages
        .iter()
        .find(|m| m.role == Role::User)
        .map(|m| m.text())
        .unwrap_or_default();
    ScriptedResponse::text(format!("result of: {task}"))
}

struct Inbox {
    _dir: tempfile::TempDir,
    store: Store,
    manager: Arc<SessionManager>,
    root: Arc<Held>,
    root_calls: mpsc::UnboundedReceiver<usize>,
    sub: Arc<Held>,
    commits: mpsc::UnboundedReceiver<(RunId, String)>,
    session: SessionId,
    feed: SessionSubscription,
}

struct Options {
    policy: InboxPolicy,
    config: CoordinatorConfig,
    gate: GateLimits,
    /// Give the root agent the built-in tools (sleep among them).
    builtin: bool,
    /// Extra frontmatter of the `bg` agent (e.g. a signal contract).
    bg_frontmatter: &'static str,
    /// What `bg` answers before falling back to echoing its task.
    sub_script: Vec<ScriptedResponse>,
    /// Tools `bg` may be given (`tools:` in `bg_frontmatter`).
    tools: Vec<Arc<dyn keel_core::Tool>>,
    /// The data directory and dialog of a restart (fresh ones when `None`).
    reopen: Option<(tempfile::TempDir, SessionId)>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            policy: InboxPolicy::default(),
            config: CoordinatorConfig::default(),
            gate: GateLimits::uniform(32),
            builtin: false,
            bg_frontmatter: "",
            sub_script: Vec::new(),
            tools: Vec::new(),
            reopen: None,
        }
    }
}

/// A root agent on `root` that may delegate to `bg` (answered by `sub`),
/// and one dialog with its feed.
async fn inbox(root: ScriptedProvider, options: Options) -> Inbox {
    let (dir, reopened) = match options.reopen {
        Some((dir, session)) => (dir, Some(session)),
        None => (tempfile::tempdir().unwrap(), None),
    };
    let store = Store::open(dir.path().join("keel.db"), StoreOptions::default()).unwrap();
    let mut registry = ToolRegistry::new();
    for tool in options.tools {
        registry.register(tool).unwrap();
    }
    let tools = Arc::new(registry);
    let mut inputs = CatalogInputs::new(["default"], Arc::clone(&tools));
    inputs.root_delegates = vec![AgentId::parse("bg").unwrap()];
    let bg = format!(
        "---\nid: bg\ndescription: Works in the background.\nllm_profile: default\n{}---\nYou are bg.\n",
        options.bg_frontmatter
    );
    let catalog = AgentCatalog::from_texts([("bg.md", bg.as_str())], &inputs, 1).unwrap();
    let (sub, _) =
        Held::new(ScriptedProvider::new(options.sub_script).with_fallback(Arc::new(echo_task)));
    let gate = Arc::new(ExecutionGate::new(options.gate));
    let coordinator = AgentCoordinator::new(
        store.clone(),
        Arc::new(catalog),
        Arc::new(ProfileProviders::new().with("default", sub.clone() as Arc<dyn Provider>)),
        tools,
        gate,
        options.config,
    );
    let (tx, commits) = mpsc::unbounded_channel();
    coordinator.set_observer(Arc::new(Commits(tx)));
    let (held_root, root_calls) = Held::new(root);
    let mut root_tools = if options.builtin {
        keel_engine::builtin_registry(&keel_engine::BuiltinToolsConfig::new(dir.path())).unwrap()
    } else {
        ToolRegistry::new()
    };
    for tool in coordinator.root_tools() {
        root_tools.register(tool).unwrap();
    }
    let profile = AgentProfile {
        name: AgentId::root(),
        system_prompt: "You are root.".into(),
        provider: held_root.clone(),
        tools: Arc::new(root_tools),
        max_iterations: 8,
        max_output_tokens: None,
        context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
        approval: keel_engine::ApprovalPolicy::none(),
        prices: None,
    };
    let bundle = RuntimeBundle::new(profile).with_coordinator(coordinator);
    let manager = SessionManager::new(
        store.clone(),
        bundle,
        SessionManagerConfig {
            inbox: options.policy,
            ..SessionManagerConfig::default()
        },
    );
    let session = match reopened {
        Some(session) => session,
        None => manager.create(spec("d1")).await.unwrap(),
    };
    let feed = manager.events().subscribe(session).await.unwrap();
    Inbox {
        _dir: dir,
        store,
        manager,
        root: held_root,
        root_calls,
        sub,
        commits,
        session,
        feed,
    }
}

fn background(tasks: &[&str]) -> ScriptedResponse {
    let tasks: Vec<_> = tasks
        .iter()
        .map(|t| json!({"agent": "bg", "task": t}))
        .collect();
    ScriptedResponse::tool_call(
        "delegate",
        json!({"mode": "background", "tasks": tasks, "completion_policy": "each"}),
    )
}

impl Inbox {
    /// Waits for `n` terminal run commits.
    async fn committed(&mut self, n: usize) -> Vec<RunId> {
        let mut runs = Vec::new();
        for _ in 0..n {
            let (run, _) = tokio::time::timeout(HANG, self.commits.recv())
                .await
                .expect("a run commit")
                .unwrap();
            runs.push(run);
        }
        runs
    }

    /// Waits for the next turn end on the feed: (origin, committed?).
    async fn turn_end(&mut self) -> (TurnOrigin, bool) {
        loop {
            let event = match tokio::time::timeout(HANG, self.feed.recv())
                .await
                .expect("a turn end")
            {
                Ok(event) => event,
                // Only the 200-run test produces more than the feed holds.
                Err(keel_engine::SubscriptionError::Lagged { .. }) => continue,
                Err(e) => panic!("{e}"),
            };
            match event.as_ref() {
                SessionEvent::TurnCommitted { origin, .. } => return (*origin, true),
                SessionEvent::TurnFailed { origin, .. } => return (*origin, false),
                _ => {}
            }
        }
    }

    async fn events(&self) -> Vec<keel_store::InboxEvent> {
        self.store.list_inbox_events(self.session).await.unwrap()
    }

    async fn history(&self) -> Vec<Arc<Message>> {
        let s = self.manager.session(self.session).await.unwrap();
        let g = s.lock().await;
        g.history().iter().map(|m| m.message.clone()).collect()
    }
}

#[tokio::test]
async fn a_completion_while_idle_is_answered_by_a_hidden_continuation_that_consumes_it() {
    let root = ScriptedProvider::new([
        background(&["count the stars"]),
        ScriptedResponse::text("started it"),
        ScriptedResponse::text("The stars are counted."),
    ]);
    let mut h = inbox(root, Options::default()).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    let runs = h.committed(1).await;
    // The worker wakes by itself: a continuation answers while idle.
    assert_eq!(h.turn_end().await, (TurnOrigin::AgentContinuation, true));
    let events = h.events().await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].status, EventStatus::Consumed);
    let usage = h.store.inbox_usage(h.session).await.unwrap();
    assert_eq!(
        (usage.pending_event_count, usage.reserved_completion_slots),
        (0, 0)
    );
    // The model saw the hidden trigger naming the run, its agent and result (fenced as data),
    // and only read-only tools (agent_task without cancel, no delegate).
    let request = h.root.inner.requests()[2].clone();
    let trigger = request.messages.last().unwrap();
    assert_eq!(trigger.visibility, ClientVisibility::Hidden);
    assert_eq!(trigger.origin, TurnOrigin::AgentContinuation);
    let text = trigger.text();
    assert!(
        text.contains(&format!(
            "Completed run {0} (agent bg) completed:\n<<<keel:data run {0} agent bg>>>\nresult of: count the stars\n<<<keel:end>>>",
            runs[0]
        )),
        "{text}"
    );
    let tools: Vec<_> = request.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(tools, ["agent_task"]);
    let actions = &request.tools[0].parameters["properties"]["action"]["enum"];
    assert_eq!(actions, &json!(["get", "list", "get_result"]));
    // History: the trigger is hidden, the answer visible; message_count
    // counts the user's one message only.
    let history = h.history().await;
    let last = history.last().unwrap();
    assert_eq!(last.text(), "The stars are counted.");
    assert_eq!(last.origin, TurnOrigin::AgentContinuation);
    let visible: Vec<String> = h
        .store
        .load_messages(
            h.session,
            keel_store::MessageFilter {
                visible_only: true,
                ..Default::default()
            },
        )
        .await
        .unwrap()
        .iter()
        .map(|m| m.message.text())
        .collect();
    assert!(
        !visible.iter().any(|t| t.starts_with("[Background results")),
        "{visible:?}"
    );
    assert_eq!(visible.last().unwrap(), "The stars are counted.");
    assert_eq!(h.manager.record(h.session).await.unwrap().message_count, 1);
}

#[tokio::test]
async fn several_due_events_are_answered_by_one_continuation() {
    let root = ScriptedProvider::new([
        background(&["a", "b", "c"]),
        ScriptedResponse::text("three started"),
        ScriptedResponse::text("all three are back"),
    ]);
    let mut h = inbox(root, Options::default()).await;
    // The user turn's final answer waits until all three runs committed, so
    // their events are all due when the worker looks.
    let answer = h.root.hold(2);
    let ticket = h
        .manager
        .send(h.session, Message::user("go"))
        .await
        .unwrap();
    h.committed(3).await;
    answer.notify_one();
    ticket.outcome().await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    assert_eq!(h.turn_end().await, (TurnOrigin::AgentContinuation, true));
    assert_eq!(h.root.inner.requests().len(), 3, "one continuation");
    let trigger = h.root.inner.requests()[2].messages.last().unwrap().text();
    for t in ["a", "b", "c"] {
        assert!(trigger.contains(&format!("result of: {t}")), "{trigger}");
    }
    assert!(h
        .events()
        .await
        .iter()
        .all(|e| e.status == EventStatus::Consumed));
}

#[tokio::test]
async fn a_failing_continuation_backs_off_then_is_dead_lettered_with_a_notice_naming_the_run() {
    let fail = || ScriptedResponse::error(ScriptedErrorKind::Unavailable, "model down");
    let root = ScriptedProvider::new([
        background(&["x"]),
        ScriptedResponse::text("started"),
        fail(),
        fail(),
        fail(),
    ]);
    let options = Options {
        policy: InboxPolicy {
            max_delivery_attempts: 3,
            retry_backoff: Duration::from_millis(20),
            ..InboxPolicy::default()
        },
        ..Options::default()
    };
    let mut h = inbox(root, options).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    let run = h.committed(1).await[0];
    for _ in 0..3 {
        assert_eq!(h.turn_end().await, (TurnOrigin::AgentContinuation, false));
    }
    let notice = loop {
        let event = tokio::time::timeout(HANG, h.feed.recv())
            .await
            .unwrap()
            .unwrap();
        if let SessionEvent::Notice { text } = event.as_ref() {
            break text.clone();
        }
    };
    insta::assert_snapshot!(notice.replace(&run.to_string(), "<run>"), @r"
    keel could not deliver 1 background result(s) to the assistant:
    - the result of run <run> (agent bg): gave up after 3 failed attempts (last error: provider unavailable: model down)
    The runs and their full results stay listed (/runs, agent_task).
    ");
    // Retries waited at least 20 ms, then 40 ms (doubling).
    let at = h.root.at.lock().clone();
    assert!(
        at[3] - at[2] >= Duration::from_millis(20),
        "{:?}",
        at[3] - at[2]
    );
    assert!(
        at[4] - at[3] >= Duration::from_millis(40),
        "{:?}",
        at[4] - at[3]
    );
    let events = h.events().await;
    assert_eq!(
        (events[0].status, events[0].attempt_count),
        (EventStatus::DeadLetter, 3)
    );
    let usage = h.store.inbox_usage(h.session).await.unwrap();
    assert_eq!(usage.pending_event_count, 0);
    // The notice is in the visible history, said by the system.
    let history = h.history().await;
    let last = history.last().unwrap();
    assert_eq!(
        (last.role, last.visibility, last.origin),
        (Role::System, ClientVisibility::Visible, TurnOrigin::System)
    );
    assert_eq!(last.text(), notice);
    assert!(
        !history
            .iter()
            .any(|m| m.text().starts_with("[Background results")),
        "no trigger is stored without an answer"
    );
}

#[tokio::test]
async fn results_overtake_a_burst_of_user_turns() {
    let root = ScriptedProvider::new([background(&["slow"]), ScriptedResponse::text("started")])
        .with_fallback(Arc::new(|r: &ChatRequest| {
            let last = r.messages.last().map(|m| m.text()).unwrap_or_default();
            if last.starts_with("[Background results") {
                ScriptedResponse::text("C")
            } else {
                ScriptedResponse::text(format!("re: {last}"))
            }
        }));
    let options = Options {
        policy: InboxPolicy {
            max_user_turn_burst: 3,
            ..InboxPolicy::default()
        },
        ..Options::default()
    };
    let mut h = inbox(root, options).await;
    // The background run answers only when released.
    let run_answer = h.sub.hold(1);
    h.manager.submit_turn(h.session, "start").await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    // U1 is held at its model call while the run completes; U2..U5 queue.
    let u1 = h.root.hold(3);
    let mut tickets = Vec::new();
    for i in 1..=5 {
        tickets.push(
            h.manager
                .send(h.session, Message::user(format!("U{i}")))
                .await
                .unwrap(),
        );
    }
    while h.root_calls.recv().await != Some(3) {}
    run_answer.notify_one();
    h.committed(1).await;
    u1.notify_one();
    let mut order = Vec::new();
    for _ in 0..6 {
        let (origin, ok) = h.turn_end().await;
        assert!(ok);
        order.push(origin);
    }
    use TurnOrigin::{AgentContinuation as C, User as U};
    assert_eq!(
        order,
        [U, U, U, U, C, U],
        "U1, three more user turns, then the results"
    );
    for t in tickets {
        t.outcome().await.unwrap();
    }
}

#[tokio::test]
async fn stop_during_a_continuation_leaves_nothing_leased_and_pauses_the_inbox() {
    let root = ScriptedProvider::new([
        background(&["x"]),
        ScriptedResponse::text("started"),
        // (the stopped continuation never reaches the script)
        ScriptedResponse::text("answer to later"),
        ScriptedResponse::text("results, at last"),
    ]);
    let mut h = inbox(root, Options::default()).await;
    let continuation = h.root.hold(3);
    h.manager.submit_turn(h.session, "go").await.unwrap();
    h.committed(1).await;
    while h.root_calls.recv().await != Some(3) {}
    let report = h.manager.stop(h.session).await.unwrap();
    assert!(report.turn.is_some());
    // Nothing is leased or admitted; the event waits untouched (a stop is no
    // failed delivery).
    let events = h.events().await;
    assert_eq!(
        (
            events[0].status,
            events[0].attempt_count,
            events[0].lease_token.clone()
        ),
        (EventStatus::Pending, 0, None)
    );
    drop(continuation);
    // No continuation starts by itself after /stop; the next user turn runs
    // first, then the results are delivered.
    h.manager.submit_turn(h.session, "later").await.unwrap();
    loop {
        if h.turn_end().await == (TurnOrigin::AgentContinuation, true) {
            break;
        }
    }
    assert_eq!(h.root.calls.load(Ordering::SeqCst), 5);
    assert_eq!(h.history().await.last().unwrap().text(), "results, at last");
    assert_eq!(h.events().await[0].status, EventStatus::Consumed);
}

#[tokio::test]
async fn stop_cancels_the_sessions_background_runs_without_a_continuation() {
    let root = ScriptedProvider::new([background(&["x", "y"]), ScriptedResponse::text("started")]);
    let mut h = inbox(root, Options::default()).await;
    let _never = h.sub.hold(1);
    let _never2 = h.sub.hold(2);
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let report = h.manager.stop(h.session).await.unwrap();
    assert_eq!(report.turn, None);
    assert_eq!(report.runs_cancelled.len(), 2);
    h.committed(2).await;
    let runs = h.store.list_runs(h.session, None, 10).await.unwrap().items;
    assert!(runs
        .iter()
        .all(|r| r.status == keel_core::RunStatus::Cancelled));
    // Their completions are recorded as consumed: no continuation, nothing pending.
    let events = h.events().await;
    assert_eq!(events.len(), 2);
    assert!(events
        .iter()
        .all(|e| e.status == EventStatus::Consumed && !e.requires_continuation));
    let usage = h.store.inbox_usage(h.session).await.unwrap();
    assert_eq!(
        (usage.pending_event_count, usage.reserved_completion_slots),
        (0, 0)
    );
    assert_eq!(h.root.inner.requests().len(), 2, "no continuation ran");
}

#[tokio::test]
async fn two_hundred_background_runs_in_one_dialog_are_all_delivered() {
    // 25 delegate calls of 8 background tasks in one model response.
    let calls: Vec<_> = (0..25)
        .map(|c| keel_core::ScriptedToolCall {
            id: None,
            name: "delegate".into(),
            arguments: json!({
                "mode": "background",
                "completion_policy": "each",
                "tasks": (0..8).map(|t| json!({"agent": "bg", "task": format!("t{c}-{t}")})).collect::<Vec<_>>(),
            }),
        })
        .collect();
    let root = ScriptedProvider::new([
        ScriptedResponse {
            tool_calls: calls,
            ..Default::default()
        },
        ScriptedResponse::text("200 started"),
    ])
    .with_fallback(Arc::new(|_: &ChatRequest| ScriptedResponse::text("noted")));
    let options = Options {
        config: CoordinatorConfig {
            max_runs_per_tree: 256,
            max_pending_inbox_events_per_session: 256,
            ..CoordinatorConfig::default()
        },
        gate: GateLimits::uniform(256),
        ..Options::default()
    };
    let mut h = inbox(root, options).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    h.committed(200).await;
    loop {
        h.turn_end().await;
        let usage = h.store.inbox_usage(h.session).await.unwrap();
        if usage.pending_event_count == 0 && usage.reserved_completion_slots == 0 {
            break;
        }
    }
    let events = h.events().await;
    assert_eq!(events.len(), 200);
    assert!(events.iter().all(|e| e.status == EventStatus::Consumed));
    // Batches of at most 8: at least 25 continuations (one model call each,
    // after the user turn's two).
    let continuations = h.root.calls.load(Ordering::SeqCst) - 2;
    assert!(continuations >= 25, "{continuations}");
    assert!(h
        .store
        .unnotified_dead_letters(h.session)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn a_restart_delivers_exactly_once_what_a_crash_left_leased() {
    let root = ScriptedProvider::new([background(&["x"]), ScriptedResponse::text("started")]);
    let mut h = inbox(root, Options::default()).await;
    // The continuation's model call never answers: the process "crashes"
    // with the event leased.
    let _crash = h.root.hold(3);
    h.manager.submit_turn(h.session, "go").await.unwrap();
    h.committed(1).await;
    while h.root_calls.recv().await != Some(3) {}
    assert_eq!(h.events().await[0].status, EventStatus::Leased);
    let dir = h._dir;
    let session = h.session;
    drop((h.manager, h.feed, h.store));
    // A new process: activation releases the lease, the start-up wake delivers.
    let store = Store::open(dir.path().join("keel.db"), StoreOptions::default()).unwrap();
    let activation = store
        .activate_runtime("restart".into(), keel_core::time::now_ms())
        .await
        .unwrap();
    assert_eq!(activation.recovery.sessions_with_inbox_work, [session]);
    let provider = ScriptedProvider::new([ScriptedResponse::text("delivered after the crash")]);
    let manager =
        crate::common::manager_on(store.clone(), &provider, SessionManagerConfig::default());
    let mut feed = manager.events().subscribe(session).await.unwrap();
    for s in &activation.recovery.sessions_with_inbox_work {
        manager.wake_inbox(*s);
    }
    loop {
        let event = tokio::time::timeout(HANG, feed.recv())
            .await
            .unwrap()
            .unwrap();
        if let SessionEvent::TurnCommitted { origin, .. } = event.as_ref() {
            assert_eq!(*origin, TurnOrigin::AgentContinuation);
            break;
        }
    }
    let events = store.list_inbox_events(session).await.unwrap();
    assert_eq!(
        (events[0].status, events[0].attempt_count),
        (EventStatus::Consumed, 1)
    );
    assert_eq!(provider.requests().len(), 1, "delivered once");
    let answers = store
        .load_messages(session, keel_store::MessageFilter::default())
        .await
        .unwrap()
        .iter()
        .filter(|m| m.message.text() == "delivered after the crash")
        .count();
    assert_eq!(answers, 1);
}

#[tokio::test]
async fn a_deleted_dialog_starts_no_continuation_and_keeps_no_reservation() {
    let root = ScriptedProvider::new([background(&["x"]), ScriptedResponse::text("started")]);
    let h = inbox(root, Options::default()).await;
    let _held = h.sub.hold(1);
    h.manager.submit_turn(h.session, "go").await.unwrap();
    h.manager.delete_dialog(h.session).await.unwrap();
    let usage = h.store.inbox_usage(h.session).await.unwrap();
    assert_eq!(
        (usage.pending_event_count, usage.reserved_completion_slots),
        (0, 0)
    );
    assert!(h
        .store
        .unnotified_dead_letters(h.session)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(h.root.inner.requests().len(), 2, "no continuation");
}

#[tokio::test]
async fn a_result_waiting_longer_than_max_wait_goes_before_the_next_user_turn() {
    let root = ScriptedProvider::new([background(&["slow"]), ScriptedResponse::text("started")])
        .with_fallback(Arc::new(|_: &ChatRequest| ScriptedResponse::text("ok")));
    let options = Options {
        policy: InboxPolicy {
            max_user_turn_burst: 100,
            max_wait: Duration::ZERO,
            ..InboxPolicy::default()
        },
        ..Options::default()
    };
    let mut h = inbox(root, options).await;
    let run_answer = h.sub.hold(1);
    h.manager.submit_turn(h.session, "start").await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    let u1 = h.root.hold(3);
    let first = h
        .manager
        .send(h.session, Message::user("U1"))
        .await
        .unwrap();
    let second = h
        .manager
        .send(h.session, Message::user("U2"))
        .await
        .unwrap();
    while h.root_calls.recv().await != Some(3) {}
    run_answer.notify_one();
    h.committed(1).await;
    u1.notify_one();
    let mut order = Vec::new();
    for _ in 0..3 {
        order.push(h.turn_end().await.0);
    }
    use TurnOrigin::{AgentContinuation as C, User as U};
    assert_eq!(order, [U, C, U]);
    first.outcome().await.unwrap();
    second.outcome().await.unwrap();
}

#[tokio::test]
async fn a_root_sleep_wakes_when_background_results_arrive_and_says_only_how_many() {
    let root = ScriptedProvider::new([
        background(&["secret task"]),
        ScriptedResponse::tool_call("sleep", json!({"ms": 3_600_000})),
        ScriptedResponse::text("I will tell you once it is delivered"),
        ScriptedResponse::text("here it is"),
    ]);
    let options = Options {
        builtin: true,
        ..Options::default()
    };
    let mut h = inbox(root, options).await;
    let run_answer = h.sub.hold(1);
    let ticket = h
        .manager
        .send(h.session, Message::user("go"))
        .await
        .unwrap();
    // The root is asleep (its third model call comes only after the sleep).
    loop {
        let event = h.feed.recv().await.unwrap();
        if let SessionEvent::Turn {
            event: keel_engine::TurnEvent::ToolStarted { call },
            ..
        } = event.as_ref()
        {
            if call.name == "sleep" {
                break;
            }
        }
    }
    run_answer.notify_one();
    ticket.outcome().await.unwrap();
    let woke = h.root.inner.requests()[2]
        .messages
        .iter()
        .rev()
        .find(|m| m.role == Role::Tool)
        .unwrap()
        .text();
    assert!(
        woke.ends_with(
            "background results are waiting (1 event(s)); they are delivered after this turn"
        ),
        "{woke}"
    );
    assert!(
        !woke.contains("secret"),
        "queued results are counted, not shown"
    );
    loop {
        if h.turn_end().await == (TurnOrigin::AgentContinuation, true) {
            break;
        }
    }
}

/// A continuation that fails once leaves its event backing off for an hour.
fn fails_once_then_backs_off(ttl: Duration) -> Options {
    Options {
        policy: InboxPolicy {
            retry_backoff: Duration::from_secs(3600),
            max_retry_backoff: Duration::from_secs(3600),
            event_ttl: ttl,
            ..InboxPolicy::default()
        },
        ..Options::default()
    }
}

#[tokio::test]
async fn an_event_backing_off_is_dead_lettered_when_its_time_to_live_ends_without_traffic() {
    let fail = ScriptedResponse::error(ScriptedErrorKind::Unavailable, "model down");
    let root = ScriptedProvider::new([background(&["x"]), ScriptedResponse::text("started"), fail]);
    let mut h = inbox(root, fails_once_then_backs_off(Duration::from_millis(300))).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    let run = h.committed(1).await[0];
    assert_eq!(h.turn_end().await, (TurnOrigin::AgentContinuation, false));
    // Its retry is an hour away; nobody types. The worker wakes at the
    // expiry (300 ms after the result) and dead-letters it, telling the user.
    let notice = loop {
        let event = tokio::time::timeout(HANG, h.feed.recv())
            .await
            .expect("the expiry is enforced by a timer, not by the retry or traffic")
            .unwrap();
        if let SessionEvent::Notice { text } = event.as_ref() {
            break text.clone();
        }
    };
    assert!(
        notice.contains(&format!("the result of run {run} (agent bg): expired")),
        "{notice}"
    );
    assert_eq!(h.events().await[0].status, EventStatus::DeadLetter);
    assert_eq!(h.root.inner.requests().len(), 3, "no second continuation");
}

#[tokio::test]
async fn a_restart_wakes_an_event_that_was_backing_off_at_its_retry_time() {
    let fail = ScriptedResponse::error(ScriptedErrorKind::Unavailable, "model down");
    let root = ScriptedProvider::new([background(&["x"]), ScriptedResponse::text("started"), fail]);
    let mut options = fails_once_then_backs_off(Duration::from_secs(3600));
    options.policy.retry_backoff = Duration::from_millis(300);
    let mut h = inbox(root, options).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    h.committed(1).await;
    assert_eq!(h.turn_end().await, (TurnOrigin::AgentContinuation, false));
    // The failed continuation gives its event back, backing off.
    loop {
        let event = tokio::time::timeout(HANG, h.feed.recv())
            .await
            .unwrap()
            .unwrap();
        if let SessionEvent::InboxEventUpdated { event, .. } = event.as_ref() {
            if event.status == EventStatus::Pending {
                break;
            }
        }
    }
    let dir = h._dir;
    let session = h.session;
    drop((h.manager, h.feed, h.store));
    // A new process starts while the event still backs off (not due yet).
    let store = Store::open(dir.path().join("keel.db"), StoreOptions::default()).unwrap();
    let activation = store
        .activate_runtime("restart".into(), keel_core::time::now_ms())
        .await
        .unwrap();
    let event = &store.list_inbox_events(session).await.unwrap()[0];
    assert_eq!(event.status, EventStatus::Pending);
    assert!(event.next_attempt_at_ms.unwrap() > keel_core::time::now_ms());
    assert_eq!(activation.recovery.sessions_with_inbox_work, [session]);
    let provider = ScriptedProvider::new([ScriptedResponse::text("delivered at its retry")]);
    let manager =
        crate::common::manager_on(store.clone(), &provider, SessionManagerConfig::default());
    let mut feed = manager.events().subscribe(session).await.unwrap();
    for s in &activation.recovery.sessions_with_inbox_work {
        manager.wake_inbox(*s);
    }
    // Nothing else happens: the worker sleeps until the retry time.
    loop {
        let event = tokio::time::timeout(HANG, feed.recv())
            .await
            .expect("delivered at its retry time")
            .unwrap();
        if let SessionEvent::TurnCommitted { origin, .. } = event.as_ref() {
            assert_eq!(*origin, TurnOrigin::AgentContinuation);
            break;
        }
    }
    let events = store.list_inbox_events(session).await.unwrap();
    assert_eq!(events[0].status, EventStatus::Consumed);
}

#[tokio::test]
async fn an_event_past_its_time_to_live_is_dead_lettered_and_the_user_told() {
    let root = ScriptedProvider::new([background(&["x"]), ScriptedResponse::text("started")]);
    let options = Options {
        policy: InboxPolicy {
            event_ttl: Duration::ZERO,
            ..InboxPolicy::default()
        },
        ..Options::default()
    };
    let mut h = inbox(root, options).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let run = h.committed(1).await[0];
    let notice = loop {
        let event = tokio::time::timeout(HANG, h.feed.recv())
            .await
            .unwrap()
            .unwrap();
        if let SessionEvent::Notice { text } = event.as_ref() {
            break text.clone();
        }
    };
    assert!(
        notice.contains(&format!(
            "the result of run {run} (agent bg): expired: undelivered for more than 0 hours"
        )),
        "{notice}"
    );
    assert_eq!(h.events().await[0].status, EventStatus::DeadLetter);
    assert_eq!(h.root.inner.requests().len(), 2, "no continuation for it");
}

#[tokio::test]
async fn one_root_turn_shares_one_run_budget_across_its_delegate_calls() {
    let batch = |c: usize| keel_core::ScriptedToolCall {
        id: None,
        name: "delegate".into(),
        arguments: json!({"tasks": (0..8).map(|t| json!({"agent": "bg", "task": format!("{c}-{t}")})).collect::<Vec<_>>()}),
    };
    let root = ScriptedProvider::new([
        ScriptedResponse {
            tool_calls: (0..3).map(batch).collect(),
            ..Default::default()
        },
        ScriptedResponse::text("done"),
    ]);
    let h = inbox(root, Options::default()).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let results: Vec<String> = h.root.inner.requests()[1]
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.text())
        .collect();
    let refused: Vec<&String> = results
        .iter()
        .filter(|r| r.contains("this delegation tree may create at most 16 runs"))
        .collect();
    assert_eq!(refused.len(), 1, "{results:?}");
    let runs = h.store.list_runs(h.session, None, 100).await.unwrap().items;
    assert_eq!(runs.len(), 16);
}

/// A background run's `steer` signal is admitted into the running root
/// turn and read by its very next model call; the turn's commit consumes
/// it, and the dialog's signal list shows it delivered.
#[tokio::test]
async fn a_steer_signal_reaches_the_next_model_call_of_the_running_turn() {
    let root = ScriptedProvider::new([
        background(&["watch the disk"]),
        ScriptedResponse::tool_call("agent_task", json!({"action": "list"})),
        ScriptedResponse::text("noted: the disk is almost full"),
        ScriptedResponse::text("the watcher finished"),
    ]);
    let mut h = inbox(
        root,
        Options {
            bg_frontmatter: "signal:\n  delivery: steer\n  severities: [warning]\n",
            sub_script: vec![
                ScriptedResponse::tool_call(
                    "emit_signal",
                    json!({"severity": "warning", "summary": "disk almost full"}),
                ),
                ScriptedResponse::text("watched"),
            ],
            ..Options::default()
        },
    )
    .await;
    // The root's second call and the sub-agent's first both wait, so the
    // signal arrives while the root turn is inside a model call.
    let root_call_2 = h.root.hold(2);
    let sub_call_1 = h.sub.hold(1);
    let ticket = h
        .manager
        .send(h.session, Message::user("watch it"))
        .await
        .unwrap();
    for expected in [1, 2] {
        let n = tokio::time::timeout(HANG, h.root_calls.recv())
            .await
            .unwrap();
        assert_eq!(n, Some(expected));
    }
    sub_call_1.notify_one();
    // The signal is on the feed, then admitted into the running turn.
    let mut seen_signal = None;
    loop {
        let event = tokio::time::timeout(HANG, h.feed.recv())
            .await
            .expect("the signal is admitted")
            .unwrap();
        match event.as_ref() {
            SessionEvent::Signal(s) => seen_signal = Some(s.clone()),
            SessionEvent::InboxEventUpdated { event, .. }
                if event.status == EventStatus::Admitted =>
            {
                assert_eq!(event.admitted_turn_id, Some(ticket.turn_id()));
                break;
            }
            _ => {}
        }
    }
    let signal = seen_signal.expect("the feed shows the signal before its admission");
    assert_eq!(
        (
            signal.agent_id.as_str(),
            signal.severity.as_str(),
            signal.summary.as_str()
        ),
        ("bg", "warning", "disk almost full")
    );
    root_call_2.notify_one();
    ticket.outcome().await.unwrap();
    let requests = h.root.inner.requests();
    let steered = |i: usize| {
        requests[i]
            .messages
            .iter()
            .any(|m| m.text().contains("disk almost full"))
    };
    assert!(!steered(1), "the call in flight did not see it");
    assert!(steered(2), "the very next call read it");
    let carrier = requests[2]
        .messages
        .iter()
        .find(|m| m.text().contains("disk almost full"))
        .unwrap();
    assert_eq!(carrier.visibility, ClientVisibility::Hidden);
    // The sub-agent had the tool; its contract allows warnings only.
    let sub_tools = &h.sub.inner.requests()[0].tools;
    let emit = sub_tools.iter().find(|t| t.name == "emit_signal").unwrap();
    assert_eq!(
        emit.parameters["properties"]["severity"]["enum"],
        json!(["warning"])
    );
    // The completion is answered by a continuation; the signal was consumed
    // by the user turn, not answered again.
    h.committed(1).await;
    loop {
        if h.turn_end().await == (TurnOrigin::AgentContinuation, true) {
            break;
        }
    }
    let signals = h.manager.signals(h.session, 10).await.unwrap();
    assert_eq!(signals.len(), 1);
    assert_eq!(signals[0].status, EventStatus::Consumed);
    assert!(h
        .events()
        .await
        .iter()
        .all(|e| e.status == EventStatus::Consumed));
    let continuation = h.root.inner.requests()[3].clone();
    let trigger = continuation.messages.last().unwrap().text();
    assert!(!trigger.contains("disk almost full"), "{trigger}");
}

/// A `queue` signal emitted while the dialog is idle is answered by a
/// continuation, like a completion; the root agent never gets the tool.
#[tokio::test]
async fn a_queue_signal_is_answered_by_a_continuation() {
    let root = ScriptedProvider::new([
        background(&["index the notes"]),
        ScriptedResponse::text("started"),
        ScriptedResponse::text("noted"),
        ScriptedResponse::text("noted"),
    ]);
    let mut h = inbox(
        root,
        Options {
            bg_frontmatter: "signal:\n  delivery: queue\n",
            sub_script: vec![
                ScriptedResponse::tool_call(
                    "emit_signal",
                    json!({"severity": "info", "summary": "half of the notes indexed",
                           "details": {"done": 50}}),
                ),
                ScriptedResponse::text("indexed"),
            ],
            ..Options::default()
        },
    )
    .await;
    h.manager.submit_turn(h.session, "index").await.unwrap();
    assert_eq!(h.turn_end().await, (TurnOrigin::User, true));
    let root_tools: Vec<String> = h.root.inner.requests()[0]
        .tools
        .iter()
        .map(|t| t.name.clone())
        .collect();
    assert!(
        !root_tools.iter().any(|t| t == "emit_signal"),
        "{root_tools:?}"
    );
    h.committed(1).await;
    // The signal and the completion: one or two continuations, each committed.
    let mut answered = String::new();
    while !(answered.contains("half of the notes indexed") && answered.contains("Completed run")) {
        assert_eq!(h.turn_end().await, (TurnOrigin::AgentContinuation, true));
        for r in h.root.inner.requests().iter().skip(2) {
            answered.push_str(&r.messages.last().unwrap().text());
        }
    }
    assert!(answered.contains("severity info"), "{answered}");
    assert!(answered.contains(r#"details: {"done":50}"#), "{answered}");
    assert!(h
        .events()
        .await
        .iter()
        .all(|e| e.status == EventStatus::Consumed));
}

/// `/stop` while a steer signal is admitted into the running turn: the turn
/// is cancelled, the signal is neither leased nor admitted afterwards
/// (superseded with its cancelled run), the run's completion needs no
/// continuation, and none runs.
#[tokio::test]
async fn stop_releases_an_admitted_signal_and_cancels_its_run() {
    let root = ScriptedProvider::new([
        background(&["watch the disk"]),
        ScriptedResponse::text("never read"),
    ]);
    let mut h = inbox(
        root,
        Options {
            bg_frontmatter: "signal:\n  delivery: steer\n",
            sub_script: vec![ScriptedResponse::tool_call(
                "emit_signal",
                json!({"severity": "error", "summary": "disk full"}),
            )],
            ..Options::default()
        },
    )
    .await;
    let _root_call_2 = h.root.hold(2);
    // The run's second call never answers: it runs until cancelled.
    let _sub_call_2 = h.sub.hold(2);
    let ticket = h
        .manager
        .send(h.session, Message::user("watch it"))
        .await
        .unwrap();
    loop {
        let event = tokio::time::timeout(HANG, h.feed.recv())
            .await
            .expect("the signal is admitted")
            .unwrap();
        if let SessionEvent::InboxEventUpdated { event, .. } = event.as_ref() {
            if event.status == EventStatus::Admitted {
                break;
            }
        }
    }
    let report = h.manager.stop(h.session).await.unwrap();
    assert_eq!(report.turn, Some(ticket.turn_id()));
    assert_eq!(report.runs_cancelled.len(), 1);
    assert!(ticket.outcome().await.unwrap_err().is_cancelled());
    let events = h.events().await;
    assert_eq!(events.len(), 2, "{events:?}");
    for e in &events {
        assert!(
            !matches!(e.status, EventStatus::Leased | EventStatus::Admitted)
                && e.lease_token.is_none(),
            "{e:?}"
        );
    }
    let signal = events
        .iter()
        .find(|e| e.event_type == keel_store::EventType::Signal)
        .unwrap();
    assert_eq!(signal.status, EventStatus::Superseded);
    assert_eq!(signal.attempt_count, 0, "a stop is no failed delivery");
    let completion = events
        .iter()
        .find(|e| e.event_type == keel_store::EventType::Completion)
        .unwrap();
    assert_eq!(
        (completion.status, completion.requires_continuation),
        (EventStatus::Consumed, false)
    );
    let runs = h.store.list_runs(h.session, None, 10).await.unwrap().items;
    assert_eq!(runs[0].status, keel_core::RunStatus::Cancelled);
    let usage = h.store.inbox_usage(h.session).await.unwrap();
    assert_eq!(
        (usage.pending_event_count, usage.reserved_completion_slots),
        (0, 0)
    );
    assert_eq!(
        h.root.calls.load(Ordering::SeqCst),
        2,
        "no continuation ran"
    );
}

/// A tool a sub-agent may be given, which counts its runs.
struct Write(Arc<AtomicUsize>);

#[async_trait]
impl keel_core::Tool for Write {
    fn name(&self) -> &str {
        "write"
    }
    fn description(&self) -> &str {
        "writes"
    }
    fn parameters(&self) -> serde_json::Value {
        json!({"type": "object"})
    }
    fn delegation_policy(&self) -> keel_core::DelegationPolicy {
        keel_core::DelegationPolicy::Delegatable
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        _: &keel_core::ToolExecutionContext,
    ) -> Result<keel_core::ToolOutput, keel_core::ToolError> {
        let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(keel_core::ToolOutput::text(format!("wrote {args} ({n})")))
    }
}

/// `bg` may call `write`, which needs approval; its first model call calls it.
fn gated_bg(writes: &Arc<AtomicUsize>) -> Options {
    Options {
        bg_frontmatter: "tools: [write]\napproval: [write]\n",
        sub_script: vec![ScriptedResponse::tool_call("write", json!({"path": "a"}))],
        tools: vec![Arc::new(Write(Arc::clone(writes)))],
        ..Options::default()
    }
}

impl Inbox {
    /// Waits until the feed showed `turns` turn ends and `asked` approval
    /// requests (in any order); returns them.
    async fn until(
        &mut self,
        turns: usize,
        asked: usize,
    ) -> (Vec<(TurnOrigin, bool)>, Vec<keel_store::ApprovalRecord>) {
        let (mut ends, mut approvals) = (Vec::new(), Vec::new());
        while ends.len() < turns || approvals.len() < asked {
            let event = tokio::time::timeout(HANG, self.feed.recv())
                .await
                .expect("a turn end or an approval request")
                .unwrap();
            match event.as_ref() {
                SessionEvent::TurnCommitted { origin, .. } => ends.push((*origin, true)),
                SessionEvent::TurnFailed { origin, .. } => ends.push((*origin, false)),
                SessionEvent::ApprovalRequested(a) => approvals.push((**a).clone()),
                _ => {}
            }
        }
        (ends, approvals)
    }

    async fn run(&self, id: RunId) -> keel_store::RunRecord {
        self.store.get_run(id).await.unwrap().unwrap()
    }
}

#[tokio::test]
async fn a_background_run_waits_for_approval_holding_no_permit_then_resumes_once() {
    use keel_core::RunStatus;
    let writes = Arc::new(AtomicUsize::new(0));
    let root = ScriptedProvider::new([
        background(&["write it"]),
        ScriptedResponse::text("started"),
        ScriptedResponse::text("hello from another dialog"),
        background(&["other"]),
        ScriptedResponse::text("started another"),
        ScriptedResponse::text("the other is done"),
        ScriptedResponse::text("the write is done"),
    ]);
    let mut h = inbox(
        root,
        Options {
            gate: GateLimits::uniform(1),
            ..gated_bg(&writes)
        },
    )
    .await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let (ends, asked) = h.until(1, 1).await;
    assert_eq!(ends, [(TurnOrigin::User, true)]);
    let asked = asked[0].clone();
    assert_eq!(
        (asked.tool_name.as_str(), asked.agent_id.as_str()),
        ("write", "bg")
    );
    assert_eq!(asked.arguments, r#"{"path":"a"}"#);
    let run_id = asked.run_id.expect("the run asked, not the root turn");
    assert_eq!(h.run(run_id).await.status, RunStatus::WaitingApproval);
    assert_eq!(
        writes.load(Ordering::SeqCst),
        0,
        "nothing runs until decided"
    );
    // Every limit is 1 and the run waits: another dialog answers, the root
    // still answers, and another background run is admitted, runs and is
    // delivered.
    let elsewhere = h.manager.create(spec("d2")).await.unwrap();
    let report = h
        .manager
        .send(elsewhere, Message::user("hi"))
        .await
        .unwrap()
        .outcome()
        .await
        .unwrap();
    assert_eq!(report.output.final_text(), "hello from another dialog");
    h.manager.submit_turn(h.session, "more").await.unwrap();
    let (ends, _) = h.until(2, 0).await;
    assert_eq!(
        ends,
        [
            (TurnOrigin::User, true),
            (TurnOrigin::AgentContinuation, true)
        ]
    );
    let other = h.committed(1).await;
    assert_ne!(other, [run_id]);
    assert_eq!(h.run(run_id).await.status, RunStatus::WaitingApproval);
    // The decision resumes the run where it stopped: the call runs once and
    // the run's model reads its result.
    h.manager
        .decide_approval(
            asked.id,
            Some(h.session),
            keel_store::Decision::Approve,
            None,
        )
        .await
        .unwrap();
    assert_eq!(h.committed(1).await, [run_id]);
    let (ends, _) = h.until(1, 0).await;
    assert_eq!(ends, [(TurnOrigin::AgentContinuation, true)]);
    assert_eq!(writes.load(Ordering::SeqCst), 1);
    let run = h.run(run_id).await;
    assert_eq!(run.status, RunStatus::Completed);
    assert_eq!(run.result.as_deref(), Some("result of: write it"));
    assert_eq!((run.iterations, run.tool_calls_count), (2, 1));
    let requests = h.sub.inner.requests();
    let resumed = requests.last().unwrap();
    let roles: Vec<Role> = resumed.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [Role::System, Role::User, Role::Assistant, Role::Tool],
        "the resumed run goes on from its own conversation"
    );
    assert_eq!(resumed.messages[3].text(), r#"wrote {"path":"a"} (1)"#);
    // Deciding again is refused; nothing runs twice.
    let again = h
        .manager
        .decide_approval(
            asked.id,
            Some(h.session),
            keel_store::Decision::Approve,
            None,
        )
        .await;
    assert!(
        matches!(again, Err(keel_engine::EngineError::ApprovalDecided { .. })),
        "{again:?}"
    );
    assert_eq!(writes.load(Ordering::SeqCst), 1);
    let check = h
        .store
        .check_invariants(keel_store::CheckOptions {
            owner_alive: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(check.findings.is_empty(), "{:?}", check.findings);
}

#[tokio::test]
async fn a_denied_call_of_a_background_run_is_not_run_and_its_model_reads_the_reason() {
    let writes = Arc::new(AtomicUsize::new(0));
    let root = ScriptedProvider::new([
        background(&["write it"]),
        ScriptedResponse::text("started"),
        ScriptedResponse::text("the run is done"),
    ]);
    let mut h = inbox(root, gated_bg(&writes)).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let (_, asked) = h.until(1, 1).await;
    h.manager
        .decide_approval(
            asked[0].id,
            None,
            keel_store::Decision::Deny,
            Some("not that file".into()),
        )
        .await
        .unwrap();
    h.committed(1).await;
    assert_eq!(writes.load(Ordering::SeqCst), 0);
    let requests = h.sub.inner.requests();
    let denied = requests.last().unwrap().messages.last().unwrap();
    let result = denied.text();
    assert!(result.contains("reason: not that file"), "{result}");
    assert!(
        denied.is_error,
        "a denial is a failed call, as in a root turn"
    );
}

#[tokio::test]
async fn a_waiting_run_survives_a_restart_and_a_decision_after_it_resumes_it_once() {
    use keel_core::RunStatus;
    let writes = Arc::new(AtomicUsize::new(0));
    let root =
        ScriptedProvider::new([background(&["write it"]), ScriptedResponse::text("started")]);
    let mut h = inbox(root, gated_bg(&writes)).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let (_, asked) = h.until(1, 1).await;
    let (dir, session, run_id) = (h._dir, h.session, asked[0].run_id.unwrap());
    drop((h.manager, h.feed, h.store));
    // A new runtime generation interrupts what older ones were running, not
    // a run waiting for a person.
    let store = Store::open(dir.path().join("keel.db"), StoreOptions::default()).unwrap();
    let report = store
        .recover_older_generations(2, keel_core::time::now_ms())
        .await
        .unwrap();
    assert!(report.interrupted_runs.is_empty(), "{report:?}");
    let open = store.sessions_with_open_approvals().await.unwrap();
    assert_eq!(open, [session]);
    drop(store);
    let root = ScriptedProvider::new([ScriptedResponse::text("the write is done")]);
    let mut h = inbox(
        root,
        Options {
            config: CoordinatorConfig {
                runtime_generation: 2,
                ..CoordinatorConfig::default()
            },
            sub_script: Vec::new(),
            reopen: Some((dir, session)),
            ..gated_bg(&writes)
        },
    )
    .await;
    for s in open {
        h.manager.wake_inbox(s);
    }
    assert_eq!(h.run(run_id).await.status, RunStatus::WaitingApproval);
    h.manager
        .decide_approval(
            asked[0].id,
            Some(session),
            keel_store::Decision::Approve,
            None,
        )
        .await
        .unwrap();
    assert_eq!(h.committed(1).await, [run_id]);
    let (ends, _) = h.until(1, 0).await;
    assert_eq!(ends, [(TurnOrigin::AgentContinuation, true)]);
    assert_eq!(writes.load(Ordering::SeqCst), 1);
    let run = h.run(run_id).await;
    assert_eq!(
        (run.status, run.spec.runtime_generation),
        (RunStatus::Completed, 2)
    );
}

#[tokio::test]
async fn stop_ends_a_waiting_run_and_supersedes_its_approval() {
    use keel_core::RunStatus;
    let writes = Arc::new(AtomicUsize::new(0));
    let root =
        ScriptedProvider::new([background(&["write it"]), ScriptedResponse::text("started")]);
    let mut h = inbox(root, gated_bg(&writes)).await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let (_, asked) = h.until(1, 1).await;
    let run_id = asked[0].run_id.unwrap();
    let report = h.manager.stop(h.session).await.unwrap();
    assert_eq!(report.runs_cancelled, [run_id]);
    assert_eq!(h.run(run_id).await.status, RunStatus::Cancelled);
    let approval = h.store.get_approval(asked[0].id).await.unwrap().unwrap();
    assert_eq!(approval.status, keel_store::ApprovalStatus::Superseded);
    let late = h
        .manager
        .decide_approval(asked[0].id, None, keel_store::Decision::Approve, None)
        .await;
    assert!(
        matches!(late, Err(keel_engine::EngineError::ApprovalDecided { .. })),
        "{late:?}"
    );
    assert_eq!(writes.load(Ordering::SeqCst), 0);
    assert_eq!(h.root.inner.requests().len(), 2, "no continuation ran");
    let check = h
        .store
        .check_invariants(keel_store::CheckOptions {
            owner_alive: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(check.findings.is_empty(), "{:?}", check.findings);
}

#[tokio::test]
async fn a_decision_racing_a_stop_or_a_delete_runs_the_call_at_most_once() {
    use keel_core::RunStatus;
    for delete in [false, true] {
        let writes = Arc::new(AtomicUsize::new(0));
        let root =
            ScriptedProvider::new([background(&["write it"]), ScriptedResponse::text("started")]);
        let mut h = inbox(root, gated_bg(&writes)).await;
        h.manager.submit_turn(h.session, "go").await.unwrap();
        let (_, asked) = h.until(1, 1).await;
        let run_id = asked[0].run_id.unwrap();
        let decide =
            h.manager
                .decide_approval(asked[0].id, None, keel_store::Decision::Approve, None);
        let end = async {
            if delete {
                h.manager.delete_dialog(h.session).await.map(|_| ())
            } else {
                h.manager.stop(h.session).await.map(|_| ())
            }
        };
        let (decided, ended) = tokio::join!(decide, end);
        ended.unwrap();
        let run = h.run(run_id).await;
        assert!(run.status.is_terminal(), "{delete}: {:?}", run.status);
        let ran = writes.load(Ordering::SeqCst);
        assert!(ran <= 1, "{delete}: ran {ran} times");
        if decided.is_err() {
            assert_eq!(ran, 0, "{delete}: refused, and ran");
        }
        if run.status == RunStatus::Cancelled && decided.is_err() {
            let a = h.store.get_approval(asked[0].id).await.unwrap().unwrap();
            assert_ne!(a.status, keel_store::ApprovalStatus::Pending);
        }
    }
}

#[tokio::test]
async fn a_waiting_runs_approval_is_a_span_until_its_decision_or_its_stop() {
    use tracing_subscriber::layer::SubscriberExt;
    let recorder = crate::common::SpanRecorder::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(recorder.clone()));
    let waits = || {
        recorder
            .spans()
            .into_iter()
            .filter(|(n, _)| n == "await_approval write")
            .map(|(_, f)| {
                (
                    f["keel.approval.id"].clone(),
                    f["keel.approval.outcome"].clone(),
                )
            })
            .collect::<Vec<_>>()
    };
    let writes = Arc::new(AtomicUsize::new(0));
    let root = ScriptedProvider::new([
        background(&["write it"]),
        ScriptedResponse::text("started"),
        ScriptedResponse::text("the write is done"),
        background(&["write again"]),
        ScriptedResponse::text("started again"),
    ]);
    let mut h = inbox(
        root,
        Options {
            sub_script: vec![
                ScriptedResponse::tool_call("write", json!({"path": "a"})),
                ScriptedResponse::text("wrote a"),
                ScriptedResponse::tool_call("write", json!({"path": "b"})),
            ],
            ..gated_bg(&writes)
        },
    )
    .await;
    h.manager.submit_turn(h.session, "go").await.unwrap();
    let (_, asked) = h.until(1, 1).await;
    assert_eq!(waits(), [], "the run's wait is open while it waits");
    h.manager
        .decide_approval(
            asked[0].id,
            Some(h.session),
            keel_store::Decision::Approve,
            None,
        )
        .await
        .unwrap();
    let (ends, _) = h.until(1, 0).await;
    assert_eq!(ends, [(TurnOrigin::AgentContinuation, true)]);
    assert_eq!(waits(), [(asked[0].id.to_string(), "approved".to_owned())]);
    // A run stopped while it waits ends its wait as superseded.
    h.manager.submit_turn(h.session, "again").await.unwrap();
    let (_, again) = h.until(1, 1).await;
    h.manager.stop(h.session).await.unwrap();
    assert_eq!(
        waits(),
        [
            (asked[0].id.to_string(), "approved".to_owned()),
            (again[0].id.to_string(), "superseded".to_owned())
        ]
    );
}
