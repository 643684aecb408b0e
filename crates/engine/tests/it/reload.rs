//! A session manager whose agents follow the agent catalog through its
//! reloads: a turn keeps the definition it started with, the next turn and
//! the next session see the new catalog, and a session whose agent was
//! removed refuses turns before anything is committed.

use std::path::Path;
use std::sync::Arc;

use keel_catalog::{AgentCatalog, CatalogHandle, CatalogInputs};
use keel_core::{AgentId, Message, ScriptedProvider, ScriptedResponse, ToolRegistry};
use keel_engine::{
    AgentProfile, AgentSet, EngineError, NewSessionSpec, RuntimeBundle, SessionManager,
    SessionManagerConfig,
};

use crate::common::{address, open_store, profile, visible_texts, HeldProvider};

fn write_agent(dir: &Path, id: &str, prompt: &str) {
    std::fs::write(
        dir.join(format!("{id}.md")),
        format!("---\nid: {id}\ndescription: The {id}.\nllm_profile: default\n---\n{prompt}\n"),
    )
    .unwrap();
}

fn agent(id: &str) -> AgentId {
    AgentId::parse(id).unwrap()
}

#[tokio::test]
async fn a_turn_keeps_its_definition_and_the_next_one_sees_the_reload() {
    let dir = tempfile::tempdir().unwrap();
    let defs = tempfile::tempdir().unwrap();
    write_agent(defs.path(), "helper", "You are helper v1.");
    let inputs = CatalogInputs::new(["default"], Arc::new(ToolRegistry::new()));
    let handle = Arc::new(CatalogHandle::load(defs.path(), &inputs).unwrap());
    let scripted =
        ScriptedProvider::new([ScriptedResponse::text("one"), ScriptedResponse::text("two")]);
    let held = HeldProvider::new(scripted.clone());
    let provider: Arc<dyn keel_core::Provider> = held.clone();
    let root = profile("root", &scripted, ToolRegistry::new());
    let build = move |catalog: &AgentCatalog| {
        let agents = catalog
            .iter()
            .map(|d| AgentProfile {
                name: d.id.clone(),
                system_prompt: d.body.clone(),
                provider: provider.clone(),
                tools: Arc::new(ToolRegistry::new()),
                max_iterations: 4,
                max_output_tokens: None,
                context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
                approval: keel_engine::ApprovalPolicy::none(),
                prices: None,
            })
            .collect();
        Ok(AgentSet {
            root: AgentProfile {
                name: AgentId::root(),
                system_prompt: root.system_prompt.clone(),
                provider: root.provider.clone(),
                tools: root.tools.clone(),
                max_iterations: root.max_iterations,
                max_output_tokens: root.max_output_tokens,
                context_window_tokens: root.context_window_tokens,
                approval: keel_engine::ApprovalPolicy::none(),
                prices: None,
            },
            agents,
        })
    };
    let bundle = RuntimeBundle::from_catalog(handle.clone(), Arc::new(build)).unwrap();
    let manager = SessionManager::new(
        open_store(dir.path()),
        bundle,
        SessionManagerConfig {
            auto_title_after: 0,
            summary: None,
            // Nothing evicts but the test's own evict_idle.
            idle_ttl: std::time::Duration::ZERO,
            ..SessionManagerConfig::default()
        },
    );
    let spec = |dialog: &str, id: &str| NewSessionSpec {
        address: address(dialog),
        title: None,
        agent: Some(agent(id)),
    };
    let id = manager.create(spec("d1", "helper")).await.unwrap();
    assert_eq!(
        manager.agent_ids().unwrap(),
        [AgentId::root(), agent("helper")]
    );

    // The definition changes and critic appears while helper's turn runs.
    let first = manager.send(id, Message::user("first")).await.unwrap();
    held.wait_started().await;
    write_agent(defs.path(), "helper", "You are helper v2.");
    write_agent(defs.path(), "critic", "You criticize.");
    assert_eq!(handle.reload(&inputs).unwrap(), 2);
    assert!(manager.runs_agent(&agent("critic")).unwrap());
    manager.create(spec("d2", "critic")).await.unwrap();
    held.release.add_permits(1);
    first.outcome().await.unwrap();
    let second = manager.send(id, Message::user("second")).await.unwrap();
    held.release.add_permits(1);
    second.outcome().await.unwrap();
    let prompts: Vec<String> = scripted
        .requests()
        .iter()
        .map(|r| r.messages[0].text())
        .collect();
    assert_eq!(prompts, ["You are helper v1.", "You are helper v2."]);

    // helper is removed: its session is still readable, its turns are
    // refused before the input is stored, and no new session may run it.
    std::fs::remove_file(defs.path().join("helper.md")).unwrap();
    handle.reload(&inputs).unwrap();
    assert_eq!(
        manager.send(id, Message::user("third")).await.unwrap_err(),
        EngineError::AgentRemoved("helper".into())
    );
    assert_eq!(
        manager.create(spec("d3", "helper")).await.unwrap_err(),
        EngineError::UnknownAgent("helper".into())
    );
    assert_eq!(
        visible_texts(&manager, id).await,
        ["first", "one", "second", "two"]
    );
    // Loaded again from storage, it is still readable and still refuses.
    assert!(manager.evict_idle() >= 1);
    assert_eq!(
        visible_texts(&manager, id).await,
        ["first", "one", "second", "two"]
    );
    assert_eq!(
        manager.send(id, Message::user("fourth")).await.unwrap_err(),
        EngineError::AgentRemoved("helper".into())
    );
    assert_eq!(
        manager.agent_ids().unwrap(),
        [AgentId::root(), agent("critic")]
    );
    assert!(!manager.runs_agent(&agent("helper")).unwrap());
}
