//! The root agent's memory tools: their changes commit with the turn's
//! answer (and survive a restart), a failed turn keeps none of them, and
//! the bounds reach the model as tool errors.

use keel_core::{
    ScriptedErrorKind, ScriptedProvider, ScriptedResponse, ScriptedToolCall, ToolRegistry,
};
use keel_engine::{register_memory_tools, RuntimeBundle, SessionManager, SessionManagerConfig};
use serde_json::json;

use crate::common::*;

fn call(name: &str, arguments: serde_json::Value) -> ScriptedResponse {
    ScriptedResponse {
        tool_calls: vec![ScriptedToolCall {
            id: None,
            name: name.into(),
            arguments,
        }],
        ..ScriptedResponse::default()
    }
}

fn memory_manager(
    dir: &std::path::Path,
    provider: &ScriptedProvider,
) -> std::sync::Arc<SessionManager> {
    let mut tools = ToolRegistry::new();
    register_memory_tools(&mut tools).unwrap();
    SessionManager::new(
        open_store(dir),
        RuntimeBundle::new(profile("root", provider, tools)),
        SessionManagerConfig::default(),
    )
}

async fn memory_of(m: &SessionManager, id: keel_core::SessionId) -> Vec<(String, String)> {
    let s = m.session(id).await.unwrap();
    let g = s.lock().await;
    g.state()
        .memory
        .iter()
        .map(|(k, e)| (k.clone(), e.value.clone()))
        .collect()
}

#[tokio::test]
async fn memory_changes_commit_with_the_turn_and_a_failed_turn_keeps_none() {
    let dir = tempfile::tempdir().unwrap();
    let provider = ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    provider.push([
        call("remember", json!({"key": "goal", "value": "ship keel"})),
        ScriptedResponse::text("noted"),
        // A turn that remembers, then fails: none of it stays.
        call("remember", json!({"key": "mood", "value": "tired"})),
        ScriptedResponse::error(ScriptedErrorKind::Auth, "bad key"),
        // Over the bounds: the model reads why.
        call(
            "remember",
            json!({"key": "big", "value": "x".repeat(16 * 1024 + 1)}),
        ),
        call("recall", json!({"key": "goal"})),
        call("forget", json!({"key": "nothing"})),
        ScriptedResponse::text("done"),
    ]);
    let id = {
        let m = memory_manager(dir.path(), &provider);
        let id = m.create(spec("d1")).await.unwrap();
        m.submit_turn(id, "remember the goal").await.unwrap();
        assert_eq!(
            memory_of(&m, id).await,
            [("goal".to_owned(), "ship keel".to_owned())]
        );
        m.submit_turn(id, "and my mood").await.unwrap_err();
        assert_eq!(
            memory_of(&m, id).await.len(),
            1,
            "the failed turn kept nothing"
        );
        let report = m.submit_turn(id, "try more").await.unwrap();
        let results: Vec<String> = report
            .output
            .messages
            .iter()
            .filter(|m| m.role == keel_core::Role::Tool)
            .map(|m| m.text())
            .collect();
        assert_eq!(results.len(), 3);
        assert!(
            results[0].contains("over the 16384-byte limit"),
            "{results:?}"
        );
        assert_eq!(results[1], "ship keel");
        assert_eq!(results[2], "no entry \"nothing\"");
        id
    };
    // The memory is part of the committed state: a new process sees it.
    let m = memory_manager(dir.path(), &provider);
    assert_eq!(
        memory_of(&m, id).await,
        [("goal".to_owned(), "ship keel".to_owned())]
    );
}
