//! Rows the conformance tests (and keel-store's own tests) build.

use keel_core::{AgentId, Delivery, ExecutionMode, Message, RunId, SessionId};

use crate::{NewMessage, NewRun, NewSession, Store};

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
