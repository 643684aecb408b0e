//! `keel demo`: an offline, deterministic tour of the engine — streaming,
//! tool calls, sub-agents (background results answered by continuation
//! turns, a signal that steers a running turn), dialogs with an automatic
//! title, checkpoint → rollback → fork, and a restart that recovers
//! everything from SQLite.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use keel_catalog::{AgentCatalog, CatalogInputs};
use keel_core::{
    ChatRequest, Message, Provider, Role, ScriptedProvider, ScriptedResponse, ScriptedToolCall,
    StreamEvent, TurnOrigin,
};
use keel_engine::AgentLoop;
use keel_engine::AgentProfile;
use keel_engine::DialogAddress;
use keel_engine::TurnEvent;
use keel_engine::{builtin_registry, BuiltinToolsConfig};
use keel_engine::{AgentCoordinator, CoordinatorConfig, ProfileProviders, RunEvent, RunObserver};
use keel_engine::{ExecutionGate, GateLimits};
use keel_engine::{NewSessionSpec, RuntimeBundle, SessionManager, SessionManagerConfig};
use keel_engine::{SessionEvent, SessionSubscription};
use keel_store::{describe_process, RuntimeLock, Store, StoreOptions};
use serde_json::json;
use tokio::sync::Notify;

use crate::app::{database_path, ROOT_PROMPT};
use crate::chat::{run_tree, short};
use crate::error::{io_err, AppError, Result};

const NOTES: &str = "# Launch plan\n\n- Freeze the schema at v6\n- Record benchmarks\n- Ship the offline demo first\n";

/// The scripted model's answers, in the order the tour asks for them.
fn script() -> Vec<ScriptedResponse> {
    let calls = |calls: Vec<(&str, serde_json::Value)>| ScriptedResponse {
        tool_calls: calls
            .into_iter()
            .map(|(name, arguments)| ScriptedToolCall {
                id: None,
                name: name.into(),
                arguments,
            })
            .collect(),
        ..Default::default()
    };
    vec![
        // 1. streaming
        ScriptedResponse::text("Hello! I run on keel's scripted model, so this whole tour is deterministic and offline."),
        // 2. tools: two calls in one batch, then the answer
        calls(vec![("list_dir", json!({})), ("read_file", json!({"path": "notes.md"}))]),
        ScriptedResponse::text("The notes are a launch plan: freeze the schema at v6, record benchmarks, and ship the offline demo first."),
        // 3. sub-agents: a foreground batch of two, then one background run
        calls(vec![(
            "delegate",
            json!({"mode": "foreground", "tasks": [
                {"agent": "researcher", "task": "List the launch steps in notes.md."},
                {"agent": "writer", "task": "Write a one-line launch announcement."}
            ]}),
        )]),
        calls(vec![(
            "delegate",
            json!({"mode": "background", "tasks": [
                {"agent": "archivist", "task": "File today's launch decisions."}
            ]}),
        )]),
        ScriptedResponse::text("Done: the researcher found three steps, the writer drafted the announcement, and the archivist files the decisions in the background."),
        // 3b. the archivist's result arrives while the dialog is idle: a
        // hidden continuation turn answers it
        ScriptedResponse::text("The archivist is done: today's launch decisions are filed, with the schema frozen at v6."),
        // 3c. a background monitor's signal steers the running turn: the
        // root waits in sleep, the signal wakes it, the next call reads it
        calls(vec![(
            "delegate",
            json!({"mode": "background", "tasks": [
                {"agent": "monitor", "task": "Watch the benchmark run."}
            ]}),
        )]),
        calls(vec![("sleep", json!({"ms": 60000}))]),
        ScriptedResponse::text("The monitor warns that the benchmark machine's disk is almost full: I will free space before we record numbers."),
        // 3d. the monitor's own result, answered by a continuation
        ScriptedResponse::text("The monitor finished: the benchmark run is watched, with one disk warning."),
        // 4. a second dialog: three user messages, then the title request
        ScriptedResponse::text("Sure — what should the checklist cover?"),
        ScriptedResponse::text("Noted: schema, benchmarks, demo."),
        ScriptedResponse::text("Then we are ready to go."),
        ScriptedResponse::text("Launch checklist"),
        // 5. checkpoints: two turns on the first branch, one on the second
        ScriptedResponse::text("Option A: launch on Monday."),
        ScriptedResponse::text("Option A, step two: announce it."),
        ScriptedResponse::text("Option B: launch on Friday instead."),
        // 6. fork
        ScriptedResponse::text("In the fork, we keep the Monday plan."),
        // 7. approval: a write waits for a person; approved, then denied
        calls(vec![(
            "write_file",
            json!({"path": "plan.md", "content": "Launch on Monday.\n"}),
        )]),
        ScriptedResponse::text("Saved the plan to plan.md."),
        calls(vec![("write_file", json!({"path": "notes.md", "content": ""}))]),
        ScriptedResponse::text("You declined, so I left notes.md as it is."),
    ]
}

/// The agent definitions shipped with the demo (`demo/agents/*.md`).
const AGENTS: &[(&str, &str)] = &[
    (
        "researcher.md",
        include_str!("../demo/agents/researcher.md"),
    ),
    ("writer.md", include_str!("../demo/agents/writer.md")),
    ("archivist.md", include_str!("../demo/agents/archivist.md")),
    ("monitor.md", include_str!("../demo/agents/monitor.md")),
];

/// The sub-agents' offline model: its answer depends only on the request
/// (which agent asks, and whether a tool already answered), so concurrent
/// runs stay deterministic.
fn sub_agent_model(request: &ChatRequest) -> ScriptedResponse {
    let system = request
        .messages
        .first()
        .map(|m| m.text())
        .unwrap_or_default();
    let has_tool_result = request.messages.iter().any(|m| m.role == Role::Tool);
    if system.contains("researcher") {
        if has_tool_result {
            ScriptedResponse::text(
                "notes.md lists three steps: freeze the schema at v6, record benchmarks, ship the offline demo first.",
            )
        } else {
            ScriptedResponse::tool_call("read_file", json!({"path": "notes.md"}))
        }
    } else if system.contains("You watch a long job") {
        if has_tool_result {
            ScriptedResponse::text("Benchmark run watched; one disk warning sent.")
        } else {
            ScriptedResponse::tool_call(
                "emit_signal",
                json!({"severity": "warning", "summary": "the benchmark machine's disk is 95% full"}),
            )
        }
    } else if system.contains("writer") {
        ScriptedResponse::text(
            "keel ships its offline demo first: schema frozen, numbers recorded, no API key needed.",
        )
    } else {
        ScriptedResponse::text(
            "Filed: the team ships the offline demo first, with the schema frozen at v6.",
        )
    }
}

/// The sub-agents' provider: [`sub_agent_model`], except that the monitor's
/// calls wait for the root's `sleep` — its first until the sleep started,
/// its second until the sleep ended — so its signal always arrives while
/// the root sleeps, and its result only after the signal woke it.
struct SubAgents {
    model: ScriptedProvider,
    sleep_started: Arc<Notify>,
    sleep_ended: Arc<Notify>,
}

#[async_trait::async_trait]
impl Provider for SubAgents {
    fn name(&self) -> &str {
        self.model.name()
    }

    fn model(&self) -> &str {
        self.model.model()
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: keel_core::CancellationToken,
    ) -> std::result::Result<keel_core::ProviderStream, keel_core::ProviderError> {
        let system = request
            .messages
            .first()
            .map(|m| m.text())
            .unwrap_or_default();
        if system.contains("You watch a long job") {
            let wait = if request.messages.iter().any(|m| m.role == Role::Tool) {
                &self.sleep_ended
            } else {
                &self.sleep_started
            };
            tokio::select! {
                () = wait.notified() => {}
                () = cancel.cancelled() => return Err(keel_core::ProviderError::Cancelled),
            }
        }
        self.model.stream(request, cancel).await
    }
}

/// Signals when a background run (the archivist's, the monitor's) has committed its end.
struct BackgroundDone(Arc<Notify>);

impl RunObserver for BackgroundDone {
    fn on_run_event(&self, _run: keel_core::RunId, agent: &keel_core::AgentId, event: RunEvent) {
        if matches!(agent.as_str(), "archivist" | "monitor")
            && matches!(event, RunEvent::Committed { .. })
        {
            // notify_one stores a permit, so a wake before the wait is kept.
            self.0.notify_one();
        }
    }
}

fn step(n: u32, title: &str) {
    println!("\n{n}. {title}");
}

fn line(text: &str) {
    println!("   {text}");
}

async fn turn(manager: &Arc<SessionManager>, id: keel_core::SessionId, text: &str) -> Result<()> {
    turn_with(manager, id, text, |_| {}).await
}

/// [`turn`], calling `hook` with each event of the turn as it is printed.
async fn turn_with(
    manager: &Arc<SessionManager>,
    id: keel_core::SessionId,
    text: &str,
    mut hook: impl FnMut(&TurnEvent),
) -> Result<()> {
    println!("   you> {text}");
    let mut feed = manager.events().subscribe(id).await?;
    let ticket = manager.send(id, Message::user(text)).await?;
    let mut streaming = false;
    let mut chunks = 0;
    while let Some(event) = turn_event(&mut feed, ticket.turn_id()).await {
        hook(&event);
        match event {
            TurnEvent::Stream(StreamEvent::TextDelta { text }) => {
                if !streaming {
                    print!("   keel> ");
                    streaming = true;
                }
                chunks += 1;
                print!("{text}");
            }
            TurnEvent::ToolStarted { call } => {
                println!("   [tool] {}({})", call.name, call.arguments);
            }
            TurnEvent::ToolFinished { name, output, .. } => {
                let first = output.content.lines().next().unwrap_or_default().to_owned();
                println!(
                    "   [{name} {}] {first} …",
                    if output.is_error { "error" } else { "ok" }
                );
            }
            _ => {}
        }
    }
    if streaming {
        println!("\n   ({chunks} streamed chunks)");
    }
    ticket.outcome().await?;
    Ok(())
}

/// The next event of turn `turn` on `feed`; `None` once the turn ended.
async fn turn_event(feed: &mut SessionSubscription, turn: keel_core::TurnId) -> Option<TurnEvent> {
    loop {
        let event = feed.recv().await.ok()?;
        match event.as_ref() {
            SessionEvent::Turn { turn_id, event, .. } if *turn_id == turn => {
                return Some(event.clone())
            }
            SessionEvent::TurnCommitted { turn_id, .. }
            | SessionEvent::TurnFailed { turn_id, .. }
                if *turn_id == turn =>
            {
                return None
            }
            _ => {}
        }
    }
}

struct Runtime {
    manager: Arc<SessionManager>,
    coordinator: Arc<AgentCoordinator>,
    /// Notified when the root's `sleep` starts and ends (see [`SubAgents`]).
    sleep_started: Arc<Notify>,
    sleep_ended: Arc<Notify>,
}

async fn build(
    store: Store,
    provider: &ScriptedProvider,
    workspace: &Path,
    agents_dir: &Path,
) -> Result<Runtime> {
    let mut tools_config = BuiltinToolsConfig::new(workspace);
    tools_config.enable_write = true;
    let builtin = Arc::new(builtin_registry(&tools_config)?);
    let mut inputs = CatalogInputs::new(["default"], builtin.clone());
    inputs.root_delegates = ["researcher", "writer", "archivist", "monitor"]
        .iter()
        .filter_map(|a| keel_core::AgentId::parse(a).ok())
        .collect();
    let catalog = AgentCatalog::load(agents_dir, &inputs, 1).map_err(AppError::Catalog)?;
    let (sleep_started, sleep_ended) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let sub_agents = SubAgents {
        model: ScriptedProvider::new(Vec::new())
            .with_model("keel-demo-sub")
            .with_fallback(Arc::new(sub_agent_model)),
        sleep_started: sleep_started.clone(),
        sleep_ended: sleep_ended.clone(),
    };
    let gate = Arc::new(ExecutionGate::new(GateLimits::default()));
    // Activation recovers what an earlier runtime left unfinished.
    let activation = store
        .activate_runtime(describe_process("keel demo"), keel_core::time::now_ms())
        .await?;
    let coordinator = AgentCoordinator::new(
        store.clone(),
        Arc::new(catalog),
        Arc::new(ProfileProviders::new().with("default", Arc::new(sub_agents))),
        builtin.clone(),
        gate.clone(),
        CoordinatorConfig {
            runtime_generation: activation.generation,
            ..CoordinatorConfig::default()
        },
    );
    let mut tools = (*builtin).clone();
    for tool in coordinator.root_tools() {
        tools
            .register(tool)
            .map_err(keel_engine::EngineError::from)?;
    }
    let root = AgentProfile {
        name: keel_core::AgentId::root(),
        system_prompt: ROOT_PROMPT.to_owned(),
        provider: Arc::new(provider.clone()),
        tools: Arc::new(tools),
        max_iterations: 8,
        max_output_tokens: None,
        context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
        // As `keel serve` and `keel chat` do: a write waits for a person.
        approval: keel_engine::ApprovalPolicy::tools(["write_file"]),
        prices: None,
    };
    let config = SessionManagerConfig {
        auto_title_after: 3,
        ..Default::default()
    };
    let bundle = RuntimeBundle::new(root)
        .with_loop(AgentLoop::new(gate))
        .with_coordinator(coordinator.clone());
    Ok(Runtime {
        manager: SessionManager::new(store, bundle, config),
        coordinator,
        sleep_started,
        sleep_ended,
    })
}

/// Runs the tour; `data_dir` keeps the database, else a temporary directory is used.
pub async fn run(data_dir: Option<PathBuf>) -> Result<ExitCode> {
    let started = Instant::now();
    let dirs = DemoDirs::prepare(data_dir)?;
    let db = database_path(&dirs.data_dir);
    println!("keel demo — an offline tour (scripted model, no network, no API key)");
    println!("database: {}", db.display());

    let provider = ScriptedProvider::new(script()).with_model("keel-demo");
    // Held for the whole tour (both runtimes below live in this process).
    let _lock = RuntimeLock::acquire(&db, &describe_process("keel demo"))?;
    let store =
        Store::open(&db, StoreOptions::default()).map_err(crate::error::database_err(&db))?;
    let runtime = build(store, &provider, &dirs.workspace, &dirs.agents_dir).await?;
    let (manager, coordinator) = (runtime.manager.clone(), runtime.coordinator.clone());
    let background_done = Arc::new(Notify::new());
    coordinator.set_observer(Arc::new(BackgroundDone(background_done.clone())));
    let chat = format!("demo-{}", short(keel_core::SessionId::new()));
    // A user-given title: auto-titling applies only to dialogs that still
    // have their default title (the second dialog shows it).
    let first = manager
        .create(NewSessionSpec {
            address: DialogAddress::new("demo", &chat, "intro")?,
            title: Some("Getting started".into()),
            agent: None,
        })
        .await?;

    streaming_and_tools(&manager, first).await?;
    sub_agents(&manager, first, &background_done).await?;
    signals(&runtime, first, &background_done).await?;
    drop(runtime);
    dialogs(&manager, &chat).await?;
    let mark = checkpoints(&manager, first).await?;
    fork(&manager, first, mark.turn_index + 2).await?;
    approvals(&manager, first, &dirs.workspace).await?;

    step(8, "Restart: drop everything, reopen the database, recover");
    let (before_state, before_history) = {
        let s = manager.session(first).await?;
        let g = s.lock().await;
        (g.state().clone(), g.history().to_vec())
    };
    manager.shutdown();
    drop(manager);
    coordinator.shutdown();
    drop(coordinator);
    let store =
        Store::open(&db, StoreOptions::default()).map_err(crate::error::database_err(&db))?;
    let Runtime { manager, .. } =
        build(store, &provider, &dirs.workspace, &dirs.agents_dir).await?;
    let s = manager.load(first).await?;
    let g = s.lock().await;
    let same = g.state() == &before_state && g.history() == before_history.as_slice();
    line(&format!(
        "recovered \"{}\": {} messages, turn {}, {} tokens — identical to before the restart: {}",
        g.record().title,
        g.history().len(),
        g.turn_index(),
        g.state().cost.total_tokens(),
        if same { "yes" } else { "NO" }
    ));
    drop(g);
    if !same {
        return Ok(ExitCode::FAILURE);
    }
    let kept_note = if dirs.kept {
        format!("every step above is kept in {}", db.display())
    } else {
        "the database was temporary; pass --data-dir DIR to keep it".to_owned()
    };
    println!(
        "\ndone in {} ms; {kept_note}",
        started.elapsed().as_millis()
    );
    Ok(ExitCode::SUCCESS)
}

/// Steps 1 and 2: a streamed answer, then a parallel tool batch.
async fn streaming_and_tools(
    manager: &Arc<SessionManager>,
    first: keel_core::SessionId,
) -> Result<()> {
    step(
        1,
        "Streaming: the answer arrives chunk by chunk and is committed when the turn ends",
    );
    turn(manager, first, "Hello keel!").await?;
    step(
        2,
        "Tools: one model call asks for two tools; they run concurrently, then the model answers",
    );
    turn(manager, first, "What is in my notes?").await
}

/// Step 3: a foreground batch of two sub-agents and a background run, and
/// the run tree read back from the database.
async fn sub_agents(
    manager: &Arc<SessionManager>,
    first: keel_core::SessionId,
    background_done: &Notify,
) -> Result<()> {
    step(
        3,
        "Sub-agents: a foreground batch of two, background runs answered while idle, a signal that steers a turn",
    );
    line("agents (demo/agents/*.md): researcher, writer, archivist, monitor");
    // Subscribed before the turn: the continuation that follows it is on
    // this feed too.
    let mut feed = manager.events().subscribe(first).await?;
    turn(manager, first, "Prepare the launch with your team.").await?;
    background_done.notified().await;
    line("the background run is done; its result waits in the inbox, and the idle dialog answers it:");
    continuation(&mut feed).await
}

/// Step 3, continued: a background monitor's signal steers the running
/// turn, its result is answered by a continuation, and the signals and the
/// inbox are read back from the database.
async fn signals(
    runtime: &Runtime,
    first: keel_core::SessionId,
    background_done: &Notify,
) -> Result<()> {
    let manager = &runtime.manager;
    line("signals: a background monitor (demo/agents/monitor.md, signal delivery steer) warns while the root waits in sleep:");
    let mut feed = manager.events().subscribe(first).await?;
    turn_with(
        manager,
        first,
        "Start the benchmark and have it watched.",
        |event| match event {
            TurnEvent::ToolStarted { call } if call.name == "sleep" => {
                runtime.sleep_started.notify_one()
            }
            TurnEvent::ToolFinished { name, .. } if name == "sleep" => {
                runtime.sleep_ended.notify_one()
            }
            _ => {}
        },
    )
    .await?;
    line(
        "the signal woke the sleep and was read by the very next model call, inside the same turn.",
    );
    background_done.notified().await;
    line("the monitor is done; the idle dialog answers its result:");
    continuation(&mut feed).await?;
    for s in manager.signals(first, 10).await? {
        line(&format!(
            "signal of run {} ({}, {}): \"{}\" — {} via {}",
            s.run_id.map(short).unwrap_or_default(),
            s.agent_id,
            s.severity,
            s.summary,
            s.status.as_str(),
            s.delivery.as_str()
        ));
    }
    line("the run tree and the inbox, read back from the database:");
    let runs = manager.store().list_runs(first, None, 20).await?.items;
    for l in run_tree(&runs) {
        line(&format!("  {l}"));
    }
    for e in manager.store().list_inbox_events(first).await? {
        line(&format!(
            "inbox: {} of run {} — {} after {} failed attempt(s)",
            e.event_type.as_str(),
            e.run_id.map(short).unwrap_or_default(),
            e.status.as_str(),
            e.attempt_count
        ));
    }
    Ok(())
}

/// Prints the next continuation turn on `feed` (the hidden trigger is not
/// shown; its answer streams like any turn).
async fn continuation(feed: &mut SessionSubscription) -> Result<()> {
    let turn = loop {
        let event = feed
            .recv()
            .await
            .map_err(|e| AppError::Demo(format!("waiting for the continuation: {e}")))?;
        if let SessionEvent::TurnStarted {
            turn_id,
            origin: TurnOrigin::AgentContinuation,
        } = event.as_ref()
        {
            break *turn_id;
        }
    };
    println!("   [continuation turn: the agent reads the results in a hidden message]");
    print!("   keel> ");
    while let Some(event) = turn_event(feed, turn).await {
        if let TurnEvent::Stream(StreamEvent::TextDelta { text }) = event {
            print!("{text}");
        }
    }
    println!();
    Ok(())
}

/// Step 4: a second dialog, titled by the model after three user messages.
async fn dialogs(manager: &Arc<SessionManager>, chat: &str) -> Result<()> {
    step(
        4,
        "Dialogs: a second dialog is titled by the model once it has 3 user messages",
    );
    let second = manager.create_dialog("demo", chat, None, None).await?;
    let before = manager.record(second).await?.title;
    line(&format!("new dialog titled \"{before}\""));
    for text in [
        "Let's write a launch checklist.",
        "Schema, benchmarks, demo.",
        "Anything else?",
    ] {
        turn(manager, second, text).await?;
    }
    // The title is generated off the turn path, after the third turn.
    manager.housekeeping_settled(second).await;
    line(&format!(
        "title is now \"{}\"",
        manager.record(second).await?.title
    ));
    let page = manager.list_dialogs("demo", chat, 10, None).await?;
    for r in &page.items {
        line(&format!(
            "dialog {}  \"{}\"  {} user messages",
            r.dialog_id, r.title, r.message_count
        ));
    }
    Ok(())
}

/// Step 5: a checkpoint, two turns, a rollback and another branch; returns
/// the checkpoint.
async fn checkpoints(
    manager: &Arc<SessionManager>,
    first: keel_core::SessionId,
) -> Result<keel_store::CheckpointRecord> {
    step(
        5,
        "Checkpoints: checkpoint, two turns, roll back, take another branch",
    );
    let mark = manager.create_checkpoint(first).await?;
    line(&format!(
        "checkpoint {} at turn {}",
        short(mark.id),
        mark.turn_index
    ));
    turn(manager, first, "Plan A?").await?;
    turn(manager, first, "And then?").await?;
    manager.rollback(first, mark.id).await?;
    line(&format!(
        "rolled back to {}: the last two turns are off the current branch",
        short(mark.id)
    ));
    turn(manager, first, "Plan B?").await?;
    line("checkpoints, newest first (the abandoned branch is still listed):");
    for c in manager.list_checkpoints(first).await? {
        let parent = c.parent_id.map(short).unwrap_or_else(|| "-".into());
        line(&format!(
            "  {}  turn {}  {:<8} parent {}",
            short(c.id),
            c.turn_index,
            c.source.as_str(),
            parent
        ));
    }
    Ok(mark)
}

/// Step 6: a new dialog forked from the abandoned branch's checkpoint at turn `tip`.
async fn fork(manager: &Arc<SessionManager>, first: keel_core::SessionId, tip: u64) -> Result<()> {
    step(
        6,
        "Fork: a new dialog starts from a checkpoint on the abandoned branch; nothing is copied",
    );
    let abandoned = manager
        .list_checkpoints(first)
        .await?
        .into_iter()
        .find(|c| c.turn_index == tip)
        .ok_or_else(|| AppError::Demo(format!("no checkpoint at turn {tip}")))?;
    let fork = manager.fork(abandoned.id, None).await?;
    let fork_record = manager.record(fork).await?;
    line(&format!(
        "forked {} into dialog {} \"{}\"",
        short(abandoned.id),
        fork_record.dialog_id,
        fork_record.title
    ));
    turn(manager, fork, "Which plan do we keep here?").await
}

/// Step 7: a write waits for a person's approval; the demo approves it
/// (the file is written), then denies a second one (the model says so).
async fn approvals(
    manager: &Arc<SessionManager>,
    first: keel_core::SessionId,
    workspace: &Path,
) -> Result<()> {
    step(
        7,
        "Approval: write_file waits for a person; the decision is committed, then the turn resumes",
    );
    let mut feed = manager.events().subscribe(first).await?;
    for (text, decision, reason) in [
        (
            "Save the plan to plan.md.",
            keel_store::Decision::Approve,
            None,
        ),
        (
            "Now empty notes.md.",
            keel_store::Decision::Deny,
            Some("keep the notes".to_owned()),
        ),
    ] {
        turn(manager, first, text).await?;
        let pending = manager.approvals(first, true).await?;
        let asked = pending
            .first()
            .ok_or_else(|| AppError::Demo("the write did not wait for approval".into()))?;
        line(&format!(
            "[approval {}] {}({}) waits; nothing ran yet",
            short(asked.id),
            asked.tool_name,
            asked.arguments
        ));
        let decided = manager
            .decide_approval(asked.id, Some(first), decision, reason)
            .await?;
        line(&format!(
            "the demo decides: {}{}",
            decided.status,
            decided
                .reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        ));
        resumed(&mut feed).await?;
    }
    let plan = std::fs::read_to_string(workspace.join("plan.md"))
        .map_err(|e| AppError::Demo(format!("plan.md was not written: {e}")))?;
    let notes = std::fs::read_to_string(workspace.join("notes.md"))
        .map_err(|e| AppError::Demo(format!("notes.md is gone: {e}")))?;
    line(&format!(
        "plan.md exists ({} bytes); notes.md is untouched: {}",
        plan.len(),
        if notes == NOTES { "yes" } else { "NO" }
    ));
    Ok(())
}

/// Prints the turn that resumes after a decision, to its end.
async fn resumed(feed: &mut SessionSubscription) -> Result<()> {
    let turn = loop {
        let event = feed
            .recv()
            .await
            .map_err(|e| AppError::Demo(format!("waiting for the resumed turn: {e}")))?;
        if let SessionEvent::TurnStarted {
            turn_id,
            origin: TurnOrigin::AgentContinuation,
        } = event.as_ref()
        {
            break *turn_id;
        }
    };
    print!("   [the turn resumes] keel> ");
    while let Some(event) = turn_event(feed, turn).await {
        if let TurnEvent::Stream(StreamEvent::TextDelta { text }) = event {
            print!("{text}");
        }
    }
    println!();
    Ok(())
}

/// The demo's directories: a temporary one (removed on drop) holding the
/// workspace, the agent definitions and, without `--data-dir`, the data.
struct DemoDirs {
    data_dir: PathBuf,
    workspace: PathBuf,
    agents_dir: PathBuf,
    /// The data directory was given and outlives the demo.
    kept: bool,
    _temp: TempGuard,
}

impl DemoDirs {
    fn prepare(data_dir: Option<PathBuf>) -> Result<Self> {
        let temp = TempGuard(tempdir()?);
        let kept = data_dir.is_some();
        let data_dir = data_dir.unwrap_or_else(|| temp.0.join("data"));
        let workspace = temp.0.join("workspace");
        let agents_dir = temp.0.join("agents");
        crate::app::create_data_dir(&data_dir)?;
        for dir in [&workspace, &agents_dir] {
            std::fs::create_dir_all(dir)
                .map_err(io_err(format!("cannot create {}", dir.display())))?;
        }
        std::fs::write(workspace.join("notes.md"), NOTES)
            .map_err(io_err("cannot write the demo workspace"))?;
        for (name, text) in AGENTS {
            std::fs::write(agents_dir.join(name), text)
                .map_err(io_err("cannot write the demo agents"))?;
        }
        Ok(Self {
            data_dir,
            workspace,
            agents_dir,
            kept,
            _temp: temp,
        })
    }
}

fn tempdir() -> Result<PathBuf> {
    let dir =
        std::env::temp_dir().join(format!("keel-demo-{}", short(keel_core::SessionId::new())));
    std::fs::create_dir_all(&dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    Ok(dir)
}

/// Removes the demo's temporary workspace when dropped.
struct TempGuard(PathBuf);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::debug!(dir = %self.0.display(), error = %e, "demo temp dir not removed");
        }
    }
}
