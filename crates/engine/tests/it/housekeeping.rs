//! Titles and summaries run after a turn's commit, in a task of their own:
//! they never delay a reply or the next turn, go through the gate's
//! provider permits, and stop with `/stop`, dialog deletion and shutdown.

use std::sync::Arc;

use keel_core::{AgentId, ScriptedProvider, ScriptedResponse, ToolRegistry};
use keel_engine::{
    AgentLoop, ExecutionGate, GateLimits, RuntimeBundle, SessionManager, SessionManagerConfig,
};
use tokio::sync::Semaphore;

use crate::common::*;

/// Adds a permit to its semaphore when dropped.
struct Ended<'a>(&'a Semaphore);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.add_permits(1);
    }
}

/// Answers like `inner`, except title requests: those wait until cancelled.
struct StalledTitles {
    inner: ScriptedProvider,
    title_started: Semaphore,
    title_cancelled: Semaphore,
}

#[async_trait::async_trait]
impl keel_core::Provider for StalledTitles {
    fn name(&self) -> &str {
        "stalled-titles"
    }
    fn model(&self) -> &str {
        "stalled-titles"
    }
    async fn stream(
        &self,
        request: &keel_core::ChatRequest,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<keel_core::ProviderStream, keel_core::ProviderError> {
        if request.messages[0]
            .text()
            .starts_with("Given the conversation history")
        {
            self.title_started.add_permits(1);
            // Told when the call ends: cancelled, or dropped by its caller.
            let _ended = Ended(&self.title_cancelled);
            cancel.cancelled().await;
            return Err(keel_core::ProviderError::Cancelled);
        }
        self.inner.stream(request, cancel).await
    }
}

async fn take(s: &Semaphore) {
    s.acquire().await.unwrap().forget();
}

fn stalled_manager(
    dir: &std::path::Path,
    replies_: &[&str],
) -> (Arc<StalledTitles>, Arc<ExecutionGate>, Arc<SessionManager>) {
    let inner = ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    replies(&inner, replies_);
    let provider = Arc::new(StalledTitles {
        inner,
        title_started: Semaphore::new(0),
        title_cancelled: Semaphore::new(0),
    });
    let gate = Arc::new(ExecutionGate::new(GateLimits::uniform(2)));
    let mut root = profile(
        "root",
        &ScriptedProvider::new(Vec::<ScriptedResponse>::new()),
        ToolRegistry::new(),
    );
    root.provider = provider.clone();
    assert_eq!(root.name, AgentId::root());
    let bundle = RuntimeBundle::new(root).with_loop(AgentLoop::new(gate.clone()));
    let manager = SessionManager::new(
        open_store(dir),
        bundle,
        SessionManagerConfig {
            auto_title_after: 1,
            ..Default::default()
        },
    );
    (provider, gate, manager)
}

#[tokio::test]
async fn a_title_model_that_never_answers_delays_neither_the_reply_nor_the_next_turn() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gate, manager) = stalled_manager(dir.path(), &["r1", "r2", "r3"]);
    let id = manager.create(spec("d1")).await.unwrap();
    let report = manager.submit_turn(id, "hello").await.unwrap();
    assert_eq!(report.output.final_text(), "r1");
    // The title call is in flight, holding a provider permit of the gate.
    take(&provider.title_started).await;
    assert_eq!(gate.snapshot().provider_steps_in_use, 1);
    let report = manager.submit_turn(id, "again").await.unwrap();
    assert_eq!(report.output.final_text(), "r2");
    assert_eq!(
        visible_texts(&manager, id).await,
        ["hello", "r1", "again", "r2"]
    );
    // /stop cancels it: no title, the permit is back.
    manager.stop(id).await.unwrap();
    take(&provider.title_cancelled).await;
    manager.housekeeping_settled(id).await;
    assert_eq!(gate.snapshot().provider_steps_in_use, 0);
    assert_eq!(manager.record(id).await.unwrap().title, "Dialog d1");
    // The next turn tries again; deleting the dialog cancels that attempt.
    manager.submit_turn(id, "third").await.unwrap();
    take(&provider.title_started).await;
    manager.delete_dialog(id).await.unwrap();
    take(&provider.title_cancelled).await;
}

#[tokio::test]
async fn shutdown_cancels_housekeeping_and_starts_no_more() {
    let dir = tempfile::tempdir().unwrap();
    let (provider, gate, manager) = stalled_manager(dir.path(), &["r1", "r2"]);
    let id = manager.create(spec("d1")).await.unwrap();
    manager.submit_turn(id, "hello").await.unwrap();
    take(&provider.title_started).await;
    manager.shutdown();
    take(&provider.title_cancelled).await;
    manager.housekeeping_settled(id).await;
    // Turns still run to their end; no title call follows them.
    manager.submit_turn(id, "again").await.unwrap();
    manager.housekeeping_settled(id).await;
    assert_eq!(provider.title_started.available_permits(), 0);
    assert_eq!(gate.snapshot().provider_steps_in_use, 0);
}
