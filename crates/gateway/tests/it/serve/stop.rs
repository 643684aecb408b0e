//! Ending work: `stop` ends a dialog's running turn (over REST and the
//! WebSocket), saves nothing of its answer and answers without waiting for
//! the message queued behind it, which runs; a sub-agent run is listed, read
//! and cancelled through `/api/agent-runs`.

use std::sync::Arc;

use async_trait::async_trait;
use keel_core::provider::{ChatRequest, ProviderError, ProviderStream};
use keel_core::{
    CancellationToken, Provider, ScriptedProvider, ScriptedResponse, ScriptedToolCall,
};
use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use keel_store::MessageFilter;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::{GatedProvider, Setup, TestServer, Ws};

/// Sends `text` and waits until the turn streams its first words.
async fn start_turn(ws: &mut Ws, session_id: Uuid) {
    ws.send(&ClientFrame::Send {
        id: None,
        session_id,
        text: Some("work".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    ws.until(|f| matches!(f, ServerFrame::TextDelta { .. }))
        .await;
}

/// Whether `frames` hold a cancelled `turn_failed`.
fn cancelled(frames: &[ServerFrame]) -> bool {
    frames.iter().any(|f| {
        matches!(
            f,
            ServerFrame::TurnFailed {
                cancelled: true,
                ..
            }
        )
    })
}

#[tokio::test]
async fn stop_answers_at_once_while_the_message_queued_behind_the_stopped_turn_runs() {
    // Every model call waits for a permit the test gives only after /stop
    // answered: a stop that waited for the queued turn would never answer.
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let id: Uuid = t.dialog("Queued").await.parse().unwrap();
    let mut ws = t.ws().await;
    let messages = format!("/api/dialogs/{id}/messages");
    for stop_over_ws in [false, true] {
        start_turn(&mut ws, id).await;
        let queued = t.post(&messages, json!({"text": "next"})).await;
        assert_eq!(queued.status(), 202);
        let queued: Uuid = queued.json::<Value>().await.unwrap()["turn_id"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let answered = async {
            if stop_over_ws {
                ws.send(&ClientFrame::Stop {
                    id: Some("s".into()),
                    session_id: id,
                })
                .await;
                ws.until(|f| matches!(f, ServerFrame::Stopped { stopped: true, .. }))
                    .await;
            } else {
                let r = t.post(&format!("/api/dialogs/{id}/stop"), json!({})).await;
                assert_eq!(r.json::<Value>().await.unwrap(), json!({"stopped": true}));
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(30), answered)
            .await
            .expect("stop answers before the queued turn ends");
        // The queued message is kept and runs to its end once released.
        gate.add_permits(1);
        let frames = ws
            .until(
                |f| matches!(f, ServerFrame::TurnCommitted { turn_id, .. } if *turn_id == queued),
            )
            .await;
        assert!(!frames.is_empty());
    }
}

#[tokio::test]
async fn stop_ends_the_running_turn_over_rest_and_the_websocket_and_saves_none_of_it() {
    // The gate never opens: only a stop ends a turn.
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider {
            gate: Arc::new(Semaphore::new(0)),
        }),
        ..Setup::default()
    })
    .await;
    let id: Uuid = t.dialog("Stopped").await.parse().unwrap();
    let stop_path = format!("/api/dialogs/{id}/stop");
    let mut ws = t.ws().await;

    start_turn(&mut ws, id).await;
    let r = t.post(&stop_path, json!({})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"stopped": true}));
    let end = ws.until(ServerFrame::ends_turn).await;
    assert!(cancelled(&end), "{end:?}");

    start_turn(&mut ws, id).await;
    ws.send(&ClientFrame::Stop {
        id: Some("s1".into()),
        session_id: id,
    })
    .await;
    // The answer and the turn's end, in either order.
    let mut seen = Vec::new();
    while !(cancelled(&seen)
        && seen
            .iter()
            .any(|f| matches!(f, ServerFrame::Stopped { .. })))
    {
        seen.push(ws.frame().await);
    }
    assert!(seen.contains(&ServerFrame::Stopped {
        id: Some("s1".into()),
        session_id: id,
        stopped: true,
    }));

    // With nothing running, both say so.
    let r = t.post(&stop_path, json!({})).await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"stopped": false}));
    ws.send(&ClientFrame::Stop {
        id: Some("s2".into()),
        session_id: id,
    })
    .await;
    let answer = ws.until(|f| matches!(f, ServerFrame::Stopped { .. })).await;
    assert_eq!(
        answer.last(),
        Some(&ServerFrame::Stopped {
            id: Some("s2".into()),
            session_id: id,
            stopped: false,
        })
    );
    let saved = t
        .store
        .load_messages(id.into(), MessageFilter::default())
        .await
        .unwrap();
    // Nothing of either answer is saved; the user's two messages stay,
    // marked unanswered.
    let kept: Vec<String> = saved
        .iter()
        .map(|m| format!("{:?} {:?}", m.message.role, m.input_state))
        .collect();
    assert_eq!(kept, ["User Some(Unanswered)", "User Some(Unanswered)"]);
    let r = t
        .post(
            "/api/dialogs/01a22c8d-cb40-7766-a28d-a872408af176/stop",
            json!({}),
        )
        .await;
    assert_eq!(r.status(), 404);
}

/// The root agent (the only caller offered `delegate`) answers from its
/// script: a background delegation, then a text. The sub-agent works until
/// cancelled.
struct DelegatesThenWaits {
    root: ScriptedProvider,
}

impl DelegatesThenWaits {
    fn new() -> Self {
        let root = ScriptedProvider::offline();
        root.push(vec![
            ScriptedResponse {
                tool_calls: vec![ScriptedToolCall {
                    id: None,
                    name: "delegate".into(),
                    arguments: json!({"mode": "background", "tasks": [{"agent": "archivist", "task": "file it"}]}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("filing in the background"),
        ]);
        Self { root }
    }
}

#[async_trait]
impl Provider for DelegatesThenWaits {
    fn name(&self) -> &str {
        "delegates-then-waits"
    }

    fn model(&self) -> &str {
        "delegates-then-waits"
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        if request.tools.iter().any(|t| t.name == "delegate") {
            return self.root.stream(request, cancel).await;
        }
        cancel.cancelled().await;
        Err(ProviderError::Cancelled)
    }
}

#[tokio::test]
async fn a_run_is_listed_read_and_cancelled() {
    let t = TestServer::start(Setup {
        agents: true,
        provider: Arc::new(DelegatesThenWaits::new()),
        ..Setup::default()
    })
    .await;
    let id: Uuid = t.dialog("Runs").await.parse().unwrap();
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Subscribe {
        id: None,
        session_id: id,
        since_revision: None,
        resume_from: None,
        join: false,
    })
    .await;
    // Frames of one connection are handled concurrently: subscribed first.
    ws.until(|f| matches!(f, ServerFrame::Subscribed { .. }))
        .await;
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: id,
        text: Some("file today's decisions".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let status = |f: &ServerFrame| match f {
        ServerFrame::AgentRunUpdated { run, .. } => Some(format!("{:?}", run.status)),
        _ => None,
    };
    let mut seen = Vec::new();
    while !(seen.iter().any(ServerFrame::ends_turn)
        && seen.iter().any(|f| status(f).as_deref() == Some("Running")))
    {
        seen.push(ws.frame().await);
    }
    assert!(
        seen.iter()
            .any(|f| matches!(f, ServerFrame::TurnCommitted { .. })),
        "{seen:?}"
    );

    let page = t.json(&format!("/api/agent-runs?session_id={id}")).await;
    let items = page["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{page:#}");
    let run_id = items[0]["id"].as_str().unwrap().to_owned();
    let run = t.json(&format!("/api/agent-runs/{run_id}")).await;
    assert_eq!(
        (&run["agent"], &run["mode"], &run["status"], &run["task"]),
        (
            &json!("archivist"),
            &json!("background"),
            &json!("running"),
            &json!("file it")
        )
    );
    let events = t.json(&format!("/api/agent-runs/{run_id}/events")).await;
    assert_eq!(events["items"], json!([]));
    ws.send(&ClientFrame::GetAgentRuns {
        id: Some("g1".into()),
        session_id: id,
        cursor: None,
        limit: None,
    })
    .await;
    let answer = ws
        .until(|f| matches!(f, ServerFrame::AgentRuns { .. }))
        .await;
    let Some(ServerFrame::AgentRuns {
        id: req,
        runs,
        next_cursor,
        ..
    }) = answer.last()
    else {
        unreachable!()
    };
    assert_eq!(req.as_deref(), Some("g1"));
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].id.to_string(), run_id);
    assert_eq!(next_cursor, &None);

    let cancel = format!("/api/agent-runs/{run_id}/cancel");
    let r = t.post(&cancel, json!({})).await;
    assert_eq!(r.status(), 200);
    let ended: Value = r.json().await.unwrap();
    assert_eq!(ended["status"], "cancelled", "{ended:#}");
    ws.until(|f| status(f).as_deref() == Some("Cancelled"))
        .await;
    // Cancelling an ended run returns it as it is.
    let again: Value = t.post(&cancel, json!({})).await.json().await.unwrap();
    assert_eq!(again["status"], "cancelled");
    let r = t
        .post(
            "/api/agent-runs/01a22c8d-cb40-7766-a28d-a872408af176/cancel",
            json!({}),
        )
        .await;
    assert_eq!(r.status(), 404);
}
