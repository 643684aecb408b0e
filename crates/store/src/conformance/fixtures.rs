//! Rows the conformance tests (and keel-store's own tests) build.

use keel_core::{
    AgentId, CheckpointId, Delivery, EventId, ExecutionMode, Message, RunId, SessionId, TurnOrigin,
    Usage,
};

use crate::{
    AcceptRun, CheckpointSource, ClaimRequest, CompletionHandling, InboxUsage, MessageFilter,
    NewCheckpoint, NewMessage, NewRun, NewSession, Store, TerminalOutcome, TurnCommit,
};

/// Appends `n` messages from as many tasks at once, the i-th through
/// `target(i)`; returns their seqs, sorted.
pub async fn append_concurrently(
    n: usize,
    target: impl Fn(usize) -> (Store, SessionId),
) -> Vec<i64> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (store, session) = target(i);
            tokio::spawn(async move {
                store
                    .append_message(session, user(&format!("m{i}")), 10)
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut seqs = Vec::new();
    for t in tasks {
        seqs.push(t.await.unwrap());
    }
    seqs.sort_unstable();
    seqs
}

/// A dialog of chat `chat-1` on channel `cli_chat`, created at `now_ms`.
pub fn new_session(dialog: &str, now_ms: i64) -> NewSession {
    NewSession {
        id: SessionId::new(),
        channel: "cli_chat".into(),
        chat_id: "chat-1".into(),
        dialog_id: dialog.into(),
        title: format!("Dialog {dialog}"),
        agent_id: None,
        parent_id: None,
        delivery_context: None,
        now_ms,
    }
}

/// A user message.
pub fn user(text: &str) -> NewMessage {
    NewMessage::new(Message::user(text))
}

/// An assistant message.
pub fn assistant(text: &str) -> NewMessage {
    NewMessage::new(Message::assistant(text))
}

/// A run of agent `researcher` called by `root`, delegated in `mode`.
pub fn new_run(root: SessionId, mode: ExecutionMode) -> NewRun {
    let id = RunId::new();
    NewRun {
        id,
        root_session_id: root,
        root_turn_id: None,
        parent_run_id: None,
        caller_agent_id: AgentId::parse("root").unwrap(),
        caller_scope_id: "root-turn".into(),
        idempotency_key: None,
        agent_id: AgentId::parse("researcher").unwrap(),
        definition_hash: "d".repeat(64),
        provider_profile: "default".into(),
        provider_name: "scripted".into(),
        model_id: "scripted-1".into(),
        mode,
        depth: 1,
        plan_item_id: None,
        execution_id: format!("exec-{id}"),
        task: "look things up".into(),
        context_json: None,
        budget_json: "{}".into(),
        signal_contract_json: None,
        signal_delivery: Some(Delivery::Queue),
        completion_delivery: Some(Delivery::Queue),
        failure_delivery: Some(Delivery::Queue),
        runtime_generation: 1,
        deadline_at_ms: 1_000_000,
    }
}

/// The acceptance of `run` into an inbox of `capacity`, at 100 ms.
pub fn accept(run: NewRun, capacity: u32) -> AcceptRun {
    AcceptRun {
        run,
        inbox_capacity: capacity,
        now_ms: 100,
    }
}

/// A run's success with `text` as its result.
pub fn completed(text: &str) -> TerminalOutcome {
    TerminalOutcome::Completed {
        result: text.into(),
        usage: Usage::new(10, 5),
        tool_calls: 2,
        iterations: 3,
        cost: None,
    }
}

/// A claim of up to 8 events (32 KiB) of `root`'s inbox at `now_ms`, leased for a minute.
pub fn claim(root: SessionId, now_ms: i64) -> ClaimRequest {
    ClaimRequest {
        root_session_id: root,
        now_ms,
        lease_ms: 60_000,
        max_events: 8,
        max_bytes: 32 * 1024,
        delivery: None,
    }
}

/// (pending events, reserved completion slots), as [`slots`] reads them.
pub fn counters(pending: u64, reserved: u64) -> (u64, u64) {
    (pending, reserved)
}

/// `root`'s (pending events, reserved completion slots).
pub async fn slots(store: &Store, root: SessionId) -> (u64, u64) {
    let c: InboxUsage = store.inbox_usage(root).await.unwrap();
    (c.pending_event_count, c.reserved_completion_slots)
}

/// A dialog with `n` pending completions of background runs.
pub async fn root_with_events(store: &Store, n: usize) -> (SessionId, Vec<EventId>) {
    let session = store.create_session(new_session("root", 1)).await.unwrap();
    let root = session.id;
    let ids = add_completions(store, root, 0..n).await;
    (root, ids)
}

/// Completions of background runs `numbers` of `root`, created at 200 + n ms.
pub async fn add_completions(
    store: &Store,
    root: SessionId,
    numbers: std::ops::Range<usize>,
) -> Vec<EventId> {
    let mut ids = Vec::new();
    for i in numbers {
        let run = new_run(root, ExecutionMode::Background);
        store.accept_run(accept(run.clone(), 100)).await.unwrap();
        let c = store
            .commit_terminal(
                run.id,
                run.execution_id,
                completed(&format!("r{i}")),
                CompletionHandling::Deliver,
                200 + i as i64,
            )
            .await
            .unwrap();
        ids.push(c.event_id.unwrap());
    }
    ids
}

/// A continuation turn of `root` at `now_ms`: its hidden trigger only.
pub fn turn_of(root: SessionId, now_ms: i64) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: root,
        messages: vec![NewMessage::new(
            Message::user("[results]")
                .hidden()
                .with_origin(TurnOrigin::AgentContinuation),
        )],
        state: b"{}".to_vec(),
        checkpoint: None,
        visible_user_inputs: 0,
        answers: Vec::new(),
        expected_head: None,
        now_ms,
    }
}

/// Turn `n` of `session`: question `q{n}`, answer `a{n}`, state `state`,
/// a turn checkpoint when `checkpoint`, at 1000 + n ms.
pub fn turn(session: SessionId, n: u64, state: &str, checkpoint: bool) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![user(&format!("q{n}")), assistant(&format!("a{n}"))],
        state: state.as_bytes().to_vec(),
        checkpoint: checkpoint.then(|| NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: n,
            source: CheckpointSource::Turn,
        }),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 1000 + i64::try_from(n).unwrap(),
    }
}

/// The texts of `session`'s current history (hidden messages included).
pub async fn texts(store: &Store, session: SessionId) -> Vec<String> {
    store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.message.text())
        .collect()
}
