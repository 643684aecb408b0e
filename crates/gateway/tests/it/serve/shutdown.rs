//! Graceful shutdown: running turns finish within the grace period; past
//! it they are cancelled and nothing of them is saved; WebSockets close
//! with "going away".

use std::sync::Arc;
use std::time::Duration;

use keel_core::SessionId;
use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use keel_store::MessageFilter;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use super::{GatedProvider, Setup, TestServer, Ws};

/// A server whose turns wait at `gate`, a dialog, and a client whose turn
/// has streamed its first words.
async fn turn_in_flight(grace: Duration) -> (TestServer, Arc<Semaphore>, SessionId, Ws) {
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        grace,
        ..Setup::default()
    })
    .await;
    let id: SessionId = t.dialog("Busy").await.parse().unwrap();
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: id.as_uuid(),
        text: Some("work".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    ws.until(|f| matches!(f, ServerFrame::TextDelta { .. }))
        .await;
    (t, gate, id, ws)
}

async fn expect_going_away(ws: &mut Ws) {
    loop {
        match ws.next_message().await {
            Some(WsMessage::Close(Some(frame))) => {
                assert_eq!(frame.code, CloseCode::Away);
                return;
            }
            Some(WsMessage::Text(_)) => continue,
            other => panic!("expected a going-away close, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn past_the_grace_period_a_running_turn_is_cancelled_and_nothing_of_its_answer_is_saved() {
    let (mut t, _gate, id, mut ws) = turn_in_flight(Duration::ZERO).await;
    let report = t.shutdown().await;
    assert_eq!((report.finished, report.cancelled), (0, 1));
    let frames = ws.until(ServerFrame::ends_turn).await;
    match frames.last() {
        Some(ServerFrame::TurnFailed {
            cancelled,
            input_kept,
            ..
        }) => assert!(*cancelled && *input_kept),
        other => panic!("expected turn_failed, got {other:?}"),
    }
    expect_going_away(&mut ws).await;
    let saved = t
        .store
        .load_messages(id, MessageFilter::default())
        .await
        .unwrap();
    // The user's message was committed before the model was called: it
    // stays, unanswered; nothing of the answer and no checkpoint.
    assert_eq!(saved.len(), 1, "{saved:?}");
    assert_eq!(saved[0].message.text(), "work");
    assert_eq!(
        saved[0].input_state,
        Some(keel_store::InputState::Unanswered)
    );
    assert!(t.store.list_checkpoints(id).await.unwrap().is_empty());
    assert_eq!(
        t.store
            .get_session(id)
            .await
            .unwrap()
            .unwrap()
            .message_count,
        1
    );
}

#[tokio::test]
async fn a_turn_running_at_shutdown_finishes_and_commits_within_the_grace_period() {
    let (mut t, gate, id, mut ws) = turn_in_flight(Duration::from_secs(600)).await;
    t.server().begin_shutdown();
    // New turns are refused from now on; the running one goes on.
    ws.send(&ClientFrame::Send {
        id: Some("late".into()),
        session_id: id.as_uuid(),
        text: Some("more".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let refused = ws.until(|f| matches!(f, ServerFrame::Error { .. })).await;
    assert!(matches!(
        refused.last(),
        Some(ServerFrame::Error { status: 503, .. })
    ));
    gate.add_permits(1);
    let report = t.shutdown().await;
    assert_eq!((report.finished, report.cancelled), (1, 0));
    let frames = ws.until(ServerFrame::ends_turn).await;
    assert!(matches!(
        frames.last(),
        Some(ServerFrame::TurnCommitted { .. })
    ));
    expect_going_away(&mut ws).await;
    let saved = t
        .store
        .load_messages(id, MessageFilter::default())
        .await
        .unwrap();
    let texts: Vec<String> = saved.iter().map(|m| m.message.text()).collect();
    assert_eq!(texts, ["work", "partial done."]);
    assert_eq!(t.store.list_checkpoints(id).await.unwrap().len(), 1);
}
