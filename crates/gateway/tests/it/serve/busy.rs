//! The busy policy of a send (`if_busy`): each policy with a turn of the
//! dialog running and with none. The model is held by a semaphore, so a
//! turn runs exactly as long as the test wants.

use std::sync::Arc;

use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::{GatedProvider, Setup, TestServer, Ws};

/// Waits until turn `turn` streams its first words.
async fn running(ws: &mut Ws, turn: Uuid) {
    ws.until(|f| matches!(f, ServerFrame::TextDelta { turn_id, .. } if *turn_id == turn))
        .await;
}

/// Waits until turn `turn` committed.
async fn committed(ws: &mut Ws, turn: Uuid) {
    ws.until(|f| matches!(f, ServerFrame::TurnCommitted { turn_id, .. } if *turn_id == turn))
        .await;
}

#[tokio::test]
async fn each_busy_policy_with_a_turn_running_and_with_none() {
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let id: Uuid = t.dialog("Busy").await.parse().unwrap();
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Subscribe {
        id: None,
        session_id: id,
        since_revision: None,
        resume_from: None,
        join: false,
    })
    .await;
    ws.until(|f| matches!(f, ServerFrame::Subscribed { .. }))
        .await;
    let messages = format!("/api/dialogs/{id}/messages");
    let send =
        |text: &str, if_busy: &str| t.post(&messages, json!({"text": text, "if_busy": if_busy}));
    let accepted = |body: Value| -> (Uuid, bool) {
        (
            body["turn_id"].as_str().unwrap().parse().unwrap(),
            body["steered"].as_bool().unwrap(),
        )
    };

    // With no turn running, every policy starts a turn.
    for policy in ["enqueue", "reject", "interrupt", "steer"] {
        let r = send(policy, policy).await;
        assert_eq!(r.status(), 202, "{policy}");
        let (turn, steered) = accepted(r.json().await.unwrap());
        assert!(!steered, "{policy}");
        running(&mut ws, turn).await;
        gate.add_permits(1);
        committed(&mut ws, turn).await;
    }

    let r = send("first", "enqueue").await;
    let (first, _) = accepted(r.json().await.unwrap());
    running(&mut ws, first).await;

    // reject: 409 naming the running turn, and nothing stored.
    let queued_before = t.store.queued_inputs().await.unwrap().len();
    let r = send("rejected", "reject").await;
    assert_eq!(r.status(), 409);
    let problem: Value = r.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains(&first.to_string()), "{detail}");
    assert_eq!(t.store.queued_inputs().await.unwrap().len(), queued_before);

    // interrupt: the running turn is stopped (its message kept, unanswered)
    // and the new one starts.
    let r = send("interrupting", "interrupt").await;
    assert_eq!(r.status(), 202);
    let (second, steered) = accepted(r.json().await.unwrap());
    assert!(!steered && second != first);
    let frames = ws
        .until(|f| matches!(f, ServerFrame::TextDelta { turn_id, .. } if *turn_id == second))
        .await;
    assert!(frames.iter().any(|f| matches!(f,
        ServerFrame::TurnFailed { turn_id, cancelled: true, .. } if *turn_id == first)));

    // steer: into the running turn; no turn starts.
    let r = send("steered", "steer").await;
    assert_eq!(r.status(), 202);
    assert_eq!(accepted(r.json().await.unwrap()), (second, true));
    // The steer makes the model answer once more within the same turn.
    gate.add_permits(2);
    committed(&mut ws, second).await;

    let page = t.json(&format!("{messages}?limit=100")).await;
    let users: Vec<(String, bool)> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| {
            (
                m["text"].as_str().unwrap().to_owned(),
                m["unanswered"].as_bool().unwrap(),
            )
        })
        .collect();
    let expected: Vec<(String, bool)> = [
        ("enqueue", false),
        ("reject", false),
        ("interrupt", false),
        ("steer", false),
        ("first", true),
        ("interrupting", false),
        ("steered", false),
    ]
    .iter()
    .map(|(t, u)| (t.to_string(), *u))
    .collect();
    assert_eq!(users, expected);
}

#[tokio::test]
async fn the_websocket_send_frame_carries_the_busy_policy() {
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let id: Uuid = t.dialog("Busy").await.parse().unwrap();
    let mut ws = t.ws().await;
    let send = |text: &str, if_busy| ClientFrame::Send {
        id: Some(text.to_owned()),
        session_id: id,
        text: Some(text.to_owned()),
        parts: Vec::new(),
        if_busy,
        webhook: None,
    };
    ws.send(&send("one", None)).await;
    let frames = ws
        .until(|f| matches!(f, ServerFrame::TextDelta { .. }))
        .await;
    let Some(first) = frames.iter().find_map(|f| match f {
        ServerFrame::TurnAccepted {
            turn_id,
            steered: false,
            ..
        } => Some(*turn_id),
        _ => None,
    }) else {
        panic!("no turn_accepted in {frames:?}");
    };
    ws.send(&send("two", Some(keel_gateway::serve::api::IfBusy::Reject)))
        .await;
    let frames = ws.until(|f| matches!(f, ServerFrame::Error { .. })).await;
    let error = serde_json::to_value(frames.last().unwrap()).unwrap();
    assert_eq!(error["status"], 409, "{error}");
    assert!(error["detail"]
        .as_str()
        .unwrap()
        .contains(&first.to_string()));
    ws.send(&send(
        "three",
        Some(keel_gateway::serve::api::IfBusy::Steer),
    ))
    .await;
    let frames = ws
        .until(|f| matches!(f, ServerFrame::TurnAccepted { .. }))
        .await;
    assert!(matches!(frames.last(),
        Some(ServerFrame::TurnAccepted { turn_id, steered: true, .. }) if *turn_id == first));
    gate.add_permits(2);
    committed(&mut ws, first).await;
}
