//! Using keel-engine as a library: a few turns with the ScriptedProvider,
//! a checkpoint, a rollback and a fork, on a real SQLite file.
//!
//! `cargo run -p keel-engine --example sessions`

use std::sync::Arc;

use keel_core::{AgentId, ScriptedProvider, ScriptedResponse, ToolRegistry};
use keel_engine::AgentProfile;
use keel_engine::DialogAddress;
use keel_engine::{NewSessionSpec, RuntimeBundle, SessionManager, SessionManagerConfig};
use keel_store::{Store, StoreOptions};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("keel-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store = Store::open(dir.join("keel.db"), StoreOptions::default())?;
    let provider = ScriptedProvider::new(
        ["Hi!", "Plan A.", "Plan A, part two.", "Plan B.", "A fork."].map(ScriptedResponse::text),
    );
    let root = AgentProfile {
        name: AgentId::parse("root")?,
        system_prompt: "You are a helpful assistant.".into(),
        provider: Arc::new(provider),
        tools: Arc::new(ToolRegistry::new()),
        max_iterations: 4,
        max_output_tokens: None,
        context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
        approval: keel_engine::ApprovalPolicy::none(),
        prices: None,
    };
    let manager = SessionManager::new(
        store,
        RuntimeBundle::new(root),
        SessionManagerConfig::default(),
    );
    let id = manager
        .create(NewSessionSpec {
            address: DialogAddress::new("example", "me", "main")?,
            title: None,
            agent: None,
        })
        .await?;

    let r = manager.submit_turn(id, "Hello").await?;
    println!(
        "turn 1 -> {:?} (checkpoint {:?})",
        r.output.final_text(),
        r.checkpoint
    );
    let mark = manager.create_checkpoint(id).await?;
    manager.submit_turn(id, "Plan?").await?;
    manager.submit_turn(id, "Next?").await?;
    manager.rollback(id, mark.id).await?;
    manager.submit_turn(id, "Another plan?").await?;
    println!("after rollback and a new turn:");
    for m in manager.session(id).await?.lock().await.visible_messages()? {
        println!("  {:>9}: {}", m.message.role.as_str(), m.message.text());
    }
    println!("checkpoints (newest first):");
    let checkpoints = manager.list_checkpoints(id).await?;
    for c in &checkpoints {
        println!(
            "  turn {} {:?} parent {:?}",
            c.turn_index,
            c.source,
            c.parent_id.is_some()
        );
    }
    let abandoned = checkpoints
        .iter()
        .find(|c| c.turn_index == 3)
        .ok_or("no turn-3 checkpoint")?;
    let fork = manager.fork(abandoned.id, Some("Fork".into())).await?;
    let r = manager.submit_turn(fork, "In the fork?").await?;
    println!("fork answered {:?}", r.output.final_text());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
