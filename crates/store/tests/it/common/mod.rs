//! Helpers shared by the keel-store integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use keel_core::{AgentId, Delivery, ExecutionMode, Message, RunId, SessionId};
use keel_store::{NewMessage, NewRun, NewSession, Store, StoreOptions};
use tempfile::TempDir;

/// A store in a fresh temporary directory (kept alive by the returned guard).
pub fn temp_store() -> (TempDir, Store) {
    temp_store_with(fast_options())
}

/// Like [`temp_store`] with the given options.
pub fn temp_store_with(options: StoreOptions) -> (TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), options).unwrap();
    (dir, store)
}

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

/// Options with short retry delays so failing tests fail fast.
pub fn fast_options() -> StoreOptions {
    StoreOptions {
        retry_delays: vec![Duration::from_millis(5); 3],
        readers: 2,
        ..StoreOptions::default()
    }
}

pub fn db_path(dir: &TempDir) -> PathBuf {
    dir.path().join("keel.db")
}

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

pub fn user(text: &str) -> NewMessage {
    NewMessage::new(Message::user(text))
}

pub fn assistant(text: &str) -> NewMessage {
    NewMessage::new(Message::assistant(text))
}

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
