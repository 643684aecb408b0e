//! The WebSocket: several clients on one dialog, revisions of agent
//! updates, resync of a lagging client, replay on reconnect, bad frames.

use std::collections::HashMap;
use std::sync::Arc;

use keel_core::ScriptedResponse;
use keel_core::ScriptedToolCall;
use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use keel_gateway::serve::Limits;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use uuid::Uuid;

use super::{background_filing, scripted, GatedProvider, Setup, TestServer};

fn uuid(id: &str) -> Uuid {
    id.parse().unwrap()
}

/// The turn frames of a sequence, with ids left out and adjacent text
/// deltas joined (the server may merge them).
fn shape(frames: &[ServerFrame]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for f in frames.iter().filter(|f| f.turn_id().is_some()) {
        let line = match f {
            ServerFrame::TextDelta { text, .. } => {
                if let Some(last) = out.last_mut().filter(|l| l.starts_with("text ")) {
                    last.push_str(text);
                    continue;
                }
                format!("text {text}")
            }
            ServerFrame::TurnCommitted { turn_origin, .. } => {
                format!("turn_committed {turn_origin:?}")
            }
            other => other.kind().to_owned(),
        };
        out.push(line);
    }
    out
}

#[tokio::test]
async fn two_clients_on_one_dialog_see_the_same_turn() {
    let t = TestServer::start(Setup {
        provider: scripted(vec![ScriptedResponse::text("one two three")]),
        ..Setup::default()
    })
    .await;
    let id = uuid(&t.dialog("Shared").await);
    let mut a = t.ws().await;
    let mut b = t.ws().await;
    b.send(&ClientFrame::Subscribe {
        id: Some("b1".into()),
        session_id: id,
        since_revision: None,
        resume_from: None,
        join: false,
    })
    .await;
    assert!(
        matches!(b.frame().await, ServerFrame::Subscribed { id: Some(ref i), .. } if i == "b1")
    );
    a.send(&ClientFrame::Send {
        id: Some("a1".into()),
        session_id: id,
        text: Some("hello".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let seen_a = a.until(ServerFrame::ends_turn).await;
    let seen_b = b.until(ServerFrame::ends_turn).await;
    let accepted = seen_a
        .iter()
        .find_map(|f| match f {
            ServerFrame::TurnAccepted { id, turn_id, .. } => Some((id.clone(), *turn_id)),
            _ => None,
        })
        .expect("the send is answered");
    assert_eq!(accepted.0.as_deref(), Some("a1"));
    assert!(seen_b
        .iter()
        .all(|f| f.turn_id().is_none_or(|t| t == accepted.1)));
    assert_eq!(shape(&seen_a), shape(&seen_b));
    assert_eq!(
        shape(&seen_b),
        [
            "turn_started",
            "text one two three",
            "model_call_finished",
            "turn_committed User"
        ]
    );
}

/// A background and a foreground delegation: the dialog's subscribers see
/// every run and the completion event with revisions that never go back
/// (and go up for each run), and a reconnecting client gets them replayed.
#[tokio::test]
async fn agent_updates_carry_increasing_revisions_and_replay_on_reconnect() {
    let call = |mode: &str, agent: &str| ScriptedResponse {
        tool_calls: vec![ScriptedToolCall {
            id: None,
            name: "delegate".into(),
            arguments: json!({"mode": mode, "tasks": [{"agent": agent, "task": "work"}]}),
        }],
        ..ScriptedResponse::default()
    };
    let t = TestServer::start(Setup {
        agents: true,
        // The foreground run answers before the root goes on; the background
        // run and the root's answer take the two last texts in either order.
        provider: scripted(vec![
            call("foreground", "researcher"),
            ScriptedResponse::text("researched"),
            ScriptedResponse::text("the researcher answered"),
            call("background", "archivist"),
            ScriptedResponse::text("one text"),
            ScriptedResponse::text("another text"),
        ]),
        ..Setup::default()
    })
    .await;
    let id = uuid(&t.dialog("Runs").await);
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Subscribe {
        id: None,
        session_id: id,
        since_revision: None,
        resume_from: None,
        join: false,
    })
    .await;
    let ServerFrame::Subscribed {
        revision: start, ..
    } = ws.frame().await
    else {
        panic!("subscribed first");
    };
    assert_eq!(start, 0);
    // Until both turns ended, both runs completed and the background
    // completion is an event.
    let mut runs: HashMap<Uuid, Vec<u64>> = HashMap::new();
    let mut statuses: HashMap<Uuid, String> = HashMap::new();
    let mut revisions = Vec::new();
    let mut completion_event = false;
    let mut turns_ended = 0;
    let mut to_send = vec!["in the background", "in the foreground"];
    while !(turns_ended == 2
        && completion_event
        && statuses.len() == 2
        && statuses.values().all(|s| s == "Completed"))
    {
        if turns_ended + to_send.len() == 2 {
            if let Some(text) = to_send.pop() {
                ws.send(&ClientFrame::Send {
                    id: None,
                    session_id: id,
                    text: Some(text.into()),
                    parts: Vec::new(),
                    if_busy: None,
                    webhook: None,
                })
                .await;
            }
        }
        match ws.frame().await {
            ServerFrame::AgentRunUpdated { revision, run, .. } => {
                revisions.push(revision);
                runs.entry(run.id).or_default().push(revision);
                statuses.insert(run.id, format!("{:?}", run.status));
                assert_eq!(run.revision, revision);
            }
            ServerFrame::AgentEventUpdated {
                revision, event, ..
            } => {
                revisions.push(revision);
                completion_event |= format!("{:?}", event.event_type) == "Completion";
            }
            // The continuation that answers the background completion is
            // a turn too; only the two user turns are counted.
            ServerFrame::TurnCommitted { turn_origin, .. }
            | ServerFrame::TurnFailed { turn_origin, .. }
                if format!("{turn_origin:?}") == "User" =>
            {
                turns_ended += 1
            }
            _ => {}
        }
    }
    assert!(revisions.windows(2).all(|w| w[0] <= w[1]), "{revisions:?}");
    for (run, seen) in &runs {
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "run {run}: {seen:?}");
    }
    let last = *revisions.last().unwrap();
    // The REST listing agrees, and names the revision to resume from.
    let page = t.json(&format!("/api/agent-runs?session_id={id}")).await;
    assert_eq!(page["items"].as_array().unwrap().len(), 2);
    assert!(page["revision"].as_u64().unwrap() >= last);
    // So does the dialog's event listing: the background run's completion.
    let events = t.json(&format!("/api/dialogs/{id}/agent-events")).await;
    let items = events["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{events:#}");
    assert_eq!(items[0]["type"], "completion");
    assert_eq!(items[0]["session_id"], id.to_string());
    assert!(events["revision"].as_u64().unwrap() >= last);
    assert_eq!(events["next_cursor"], Value::Null);
    // The inbox counts it, pending or (once a continuation took it) delivered.
    let inbox = t.json(&format!("/api/dialogs/{id}/inbox")).await;
    let waiting_or_taken =
        inbox["pending"].as_u64().unwrap() + inbox["delivered"].as_u64().unwrap();
    assert_eq!(waiting_or_taken, 1, "{inbox:#}");
    assert_eq!(
        (
            inbox["dead_lettered"].as_u64(),
            inbox["superseded"].as_u64()
        ),
        (Some(0), Some(0))
    );
    assert!(inbox["revision"].as_u64().unwrap() >= last);

    // A client that saw revision 1 reconnects: everything from 1 on is replayed.
    let mut again = t.ws().await;
    again
        .send(&ClientFrame::Subscribe {
            id: None,
            session_id: id,
            since_revision: Some(1),
            resume_from: None,
            join: false,
        })
        .await;
    let ServerFrame::Subscribed { revision: now, .. } = again.frame().await else {
        panic!("subscribed first");
    };
    assert!(now >= last);
    let mut replayed = Vec::new();
    while replayed.len() < 3 {
        match again.frame().await {
            f @ (ServerFrame::AgentRunUpdated { .. } | ServerFrame::AgentEventUpdated { .. }) => {
                replayed.push(f.revision().unwrap())
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        replayed.iter().all(|r| *r >= 1 && *r <= now),
        "{replayed:?}"
    );
    // A revision from the future cannot be replayed: resync.
    again
        .send(&ClientFrame::Subscribe {
            id: None,
            session_id: id,
            since_revision: Some(now + 100),
            resume_from: None,
            join: false,
        })
        .await;
    let frames = again
        .until(|f| matches!(f, ServerFrame::Resync { .. }))
        .await;
    assert!(matches!(frames[0], ServerFrame::Subscribed { .. }));
}

#[tokio::test]
async fn a_client_that_reads_too_slowly_gets_a_resync_and_memory_stays_bounded() {
    // One answer of 20,000 words of 500 bytes: ~10 MB of frames, far more
    // than the socket buffers, the dialog's 8 frames and the connection's 2.
    let word = "x".repeat(499);
    let text: Vec<String> = (0..20_000).map(|_| word.clone()).collect();
    let t = TestServer::start(Setup {
        provider: scripted(vec![ScriptedResponse::text(text.join(" "))]),
        limits: Limits {
            hub_capacity: 8,
            connection_queue: 2,
            ..Limits::default()
        },
        ..Setup::default()
    })
    .await;
    let id = uuid(&t.dialog("Flood").await);
    let mut slow = t.ws().await;
    slow.send(&ClientFrame::Subscribe {
        id: None,
        session_id: id,
        since_revision: None,
        resume_from: None,
        join: false,
    })
    .await;
    assert!(matches!(slow.frame().await, ServerFrame::Subscribed { .. }));
    // The sender reads (through SSE) to the end while `slow` reads nothing.
    let events = t.send_streamed(&id.to_string(), "flood").await;
    assert!(events.ends_with("turn_committed"));
    let frames = slow.until(ServerFrame::ends_turn).await;
    let received: usize = frames
        .iter()
        .map(|f| match f {
            ServerFrame::TextDelta { text, .. } => text.len(),
            _ => 0,
        })
        .sum();
    assert!(
        frames
            .iter()
            .any(|f| matches!(f, ServerFrame::Resync { .. })),
        "a resync among {} frames",
        frames.len()
    );
    assert!(
        received < 20_000 * 500,
        "{received} bytes of text: some were dropped"
    );
    assert!(matches!(
        frames.last(),
        Some(ServerFrame::TurnCommitted { .. })
    ));
}

#[tokio::test]
async fn bad_frames_get_an_error_or_a_close_with_a_reason() {
    let t = TestServer::start(Setup {
        limits: Limits {
            max_frame_bytes: 4096,
            ..Limits::default()
        },
        ..Setup::default()
    })
    .await;
    let mut ws = t.ws().await;
    let mut errors = Vec::new();
    for raw in [
        "not json",
        r#"{"type":"launch"}"#,
        r#"{"type":"send","session_id":"x","text":"a"}"#,
        r#"{"id":"r1","type":"send","session_id":"01a22c8d-cb40-7766-a28d-a872408af176","text":"a"}"#,
        r#"{"id":"r2","type":"stop","session_id":"01a22c8d-cb40-7766-a28d-a872408af176","extra":1}"#,
    ] {
        ws.send_raw(WsMessage::text(raw)).await;
        match ws.frame().await {
            ServerFrame::Error {
                id,
                status,
                code,
                detail,
            } => errors.push(format!("{id:?} {status} {code}: {detail}")),
            other => panic!("{raw}: {other:?}"),
        }
    }
    insta::assert_snapshot!(errors.join("\n"));
    // Too big: closed with 1009 and the reason.
    ws.send_raw(WsMessage::text("x".repeat(10_000))).await;
    match ws.next_message().await {
        Some(WsMessage::Close(Some(frame))) => {
            assert_eq!(frame.code, CloseCode::Size);
            assert!(!frame.reason.is_empty());
        }
        other => panic!("expected a close, got {other:?}"),
    }
    // Binary: closed with 1003.
    let mut ws = t.ws().await;
    ws.send_raw(WsMessage::binary(vec![1, 2, 3])).await;
    match ws.next_message().await {
        Some(WsMessage::Close(Some(frame))) => assert_eq!(frame.code, CloseCode::Unsupported),
        other => panic!("expected a close, got {other:?}"),
    }
    // The server is fine.
    assert_eq!(t.get("/api/health").await.status(), 200);
}

/// Subscribers see the dialog change: after a committed turn (its message
/// count and, here, its usage), and when it is renamed. Its usage counts
/// committed turns only.
#[tokio::test]
async fn a_dialog_change_is_published_and_its_usage_counts_committed_turns() {
    let t = TestServer::start(Setup {
        provider: scripted(vec![ScriptedResponse {
            usage: Some(keel_core::Usage::new(120, 18)),
            ..ScriptedResponse::text("hello")
        }]),
        ..Setup::default()
    })
    .await;
    let id = t.dialog("Before").await;
    let usage = t.json(&format!("/api/dialogs/{id}/usage")).await;
    assert_eq!(
        usage,
        json!({"prompt_tokens": 0, "completion_tokens": 0, "model_calls": 0,
            "spend": {"prompt_tokens": 0, "completion_tokens": 0, "model_calls": 0, "cost_usd": 0.0},
            "max_cost_usd": null, "runs": []})
    );
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: uuid(&id),
        text: Some("hi".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let frames = ws
        .until(|f| matches!(f, ServerFrame::DialogUpdated { .. }))
        .await;
    let ends: Vec<&str> = frames.iter().rev().take(2).map(|f| f.kind()).collect();
    assert_eq!(ends, ["dialog_updated", "turn_committed"]);
    let Some(ServerFrame::DialogUpdated { dialog, .. }) = frames.last() else {
        unreachable!()
    };
    assert_eq!((dialog.title.as_str(), dialog.message_count), ("Before", 1));
    // What the turn's commit left, as stored.
    let mut stored = t.json(&format!("/api/dialogs/{id}")).await;
    stored.as_object_mut().unwrap().remove("storage");
    assert_eq!(serde_json::to_value(dialog).unwrap(), stored);
    let usage = t.json(&format!("/api/dialogs/{id}/usage")).await;
    assert_eq!(
        usage,
        json!({"prompt_tokens": 120, "completion_tokens": 18, "model_calls": 1,
            "spend": {"prompt_tokens": 120, "completion_tokens": 18, "model_calls": 1, "cost_usd": 0.0},
            "max_cost_usd": null, "runs": []})
    );

    let r = t
        .http
        .patch(format!("{}/api/dialogs/{id}", t.base))
        .json(&json!({"title": "After"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    match ws.frame().await {
        ServerFrame::DialogUpdated { session_id, dialog } => {
            assert_eq!(session_id, uuid(&id));
            assert_eq!(dialog.title, "After");
        }
        other => panic!("expected dialog_updated, got {other:?}"),
    }
    let r = t
        .get("/api/dialogs/01a22c8d-cb40-7766-a28d-a872408af176/usage")
        .await;
    assert_eq!(r.status(), 404);
}

/// Steer reaches the running turn (over the WebSocket and REST); with no
/// running turn nothing is done and the answer says so.
#[tokio::test]
async fn steer_reaches_the_running_turn_and_says_when_none_runs() {
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let id = uuid(&t.dialog("Steered").await);
    let idle = t.dialog("Idle").await;
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: id,
        text: Some("work".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let frames = ws
        .until(|f| matches!(f, ServerFrame::TextDelta { .. }))
        .await;
    let turn = frames.iter().find_map(ServerFrame::turn_id).unwrap();
    ws.send(&ClientFrame::Steer {
        id: Some("t1".into()),
        session_id: id,
        text: "focus on the schema".into(),
    })
    .await;
    let answer = ws
        .until(|f| matches!(f, ServerFrame::Steered { .. } | ServerFrame::Error { .. }))
        .await;
    assert_eq!(
        answer.last(),
        Some(&ServerFrame::Steered {
            id: Some("t1".into()),
            session_id: id,
            steered: true,
            turn_id: Some(turn),
        })
    );
    let r = t
        .post(
            &format!("/api/dialogs/{id}/steer"),
            json!({"text": "and the benchmarks"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"steered": true, "turn_id": turn.to_string()})
    );
    let r = t
        .post(&format!("/api/dialogs/{id}/steer"), json!({"text": " "}))
        .await;
    assert_eq!(r.status(), 400);
    let r = t
        .post(
            &format!("/api/dialogs/{idle}/steer"),
            json!({"text": "hello?"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"steered": false, "turn_id": null})
    );
    // The model reads the steer at its next call: the turn goes on past
    // its first answer, one call for the steer, then commits.
    gate.add_permits(2);
    let end = ws.until(ServerFrame::ends_turn).await;
    assert!(
        matches!(end.last(), Some(ServerFrame::TurnCommitted { turn_id, .. }) if *turn_id == turn)
    );
    // (Adjacent deltas may arrive merged: compare the text.)
    let text: String = end
        .iter()
        .filter_map(|f| match f {
            ServerFrame::TextDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "done.partial done.", "{end:?}");
}

/// A background run that completes while the dialog is idle is answered by
/// a continuation turn, and a client watching the dialog sees that turn —
/// started by no client — with its continuation origin.
#[tokio::test]
async fn a_subscriber_sees_the_continuation_that_answers_a_background_result() {
    let t = TestServer::start(Setup {
        agents: true,
        provider: scripted(background_filing("the archivist filed it")),
        ..Setup::default()
    })
    .await;
    let id = uuid(&t.dialog("Background").await);
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: id,
        text: Some("file it in the background".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let frames = ws
        .until(|f| {
            matches!(f, ServerFrame::TurnCommitted { turn_origin, .. }
                if format!("{turn_origin:?}") == "AgentContinuation")
        })
        .await;
    let turns: Vec<String> = shape(&frames)
        .into_iter()
        .filter(|l| l.starts_with("turn_committed"))
        .collect();
    assert_eq!(
        turns,
        ["turn_committed User", "turn_committed AgentContinuation"]
    );
    let continuation = frames
        .iter()
        .rev()
        .find_map(|f| f.turn_id())
        .expect("the continuation has a turn id");
    let started = frames.iter().any(|f| {
        matches!(f, ServerFrame::TurnStarted { turn_id, turn_origin, .. }
            if *turn_id == continuation && format!("{turn_origin:?}") == "AgentContinuation")
    });
    assert!(started, "{frames:?}");
    // The completion was consumed: nothing is left to deliver.
    let events = t
        .store
        .list_inbox_events(keel_core::SessionId::from(id))
        .await
        .unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(format!("{:?}", events[0].status), "Consumed", "{events:?}");
}

/// A stopped turn keeps the user's message: its `turn_failed` says so and
/// the listing marks the message unanswered; the next turn answers a new
/// message and leaves the old mark.
#[tokio::test]
async fn a_stopped_turn_keeps_the_message_listed_as_unanswered() {
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let id = uuid(&t.dialog("Stopped").await);
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: id,
        text: Some("work".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    ws.until(|f| matches!(f, ServerFrame::TextDelta { .. }))
        .await;
    let r = t.post(&format!("/api/dialogs/{id}/stop"), json!({})).await;
    assert_eq!(r.status(), 200);
    let end = ws.until(ServerFrame::ends_turn).await;
    match end.last() {
        Some(ServerFrame::TurnFailed {
            cancelled,
            input_kept,
            ..
        }) => assert!(*cancelled && *input_kept, "{end:?}"),
        other => panic!("expected turn_failed, got {other:?}"),
    }
    let listed = |messages: Value| -> Vec<(String, String, bool)> {
        messages["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["role"].as_str().unwrap().to_owned(),
                    m["text"].as_str().unwrap().to_owned(),
                    m["unanswered"].as_bool().unwrap(),
                )
            })
            .collect()
    };
    let messages = t.json(&format!("/api/dialogs/{id}/messages")).await;
    assert_eq!(
        listed(messages),
        [("user".to_owned(), "work".to_owned(), true)]
    );
    gate.add_permits(1);
    let events = t.send_streamed(&id.to_string(), "again").await;
    assert!(events.ends_with("turn_committed"), "{events}");
    let messages = listed(t.json(&format!("/api/dialogs/{id}/messages")).await);
    let marks: Vec<(&str, bool)> = messages
        .iter()
        .map(|(role, _, unanswered)| (role.as_str(), *unanswered))
        .collect();
    assert_eq!(
        marks,
        [("user", true), ("user", false), ("assistant", false)]
    );
}

/// A turn past `session.turn_timeout_secs` fails `timed_out`, the user's
/// message kept and listed unanswered; the turn queued behind it runs.
#[tokio::test]
async fn a_turn_past_its_deadline_fails_timed_out_and_the_queued_turn_runs() {
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        config: "[session]\nturn_timeout_secs = 1\n".into(),
        ..Setup::default()
    })
    .await;
    let id = uuid(&t.dialog("Slow").await);
    let mut ws = t.ws().await;
    for text in ["work", "next"] {
        ws.send(&ClientFrame::Send {
            id: None,
            session_id: id,
            text: Some(text.into()),
            parts: Vec::new(),
            if_busy: None,
            webhook: None,
        })
        .await;
    }
    let end = ws.until(ServerFrame::ends_turn).await;
    let failed = end.last().cloned().unwrap();
    assert!(
        matches!(&failed, ServerFrame::TurnFailed { session_id, .. } if *session_id == id),
        "{end:?}"
    );
    insta::assert_json_snapshot!(failed, {
        ".session_id" => "[dialog]",
        ".event_id" => "[event]",
        ".turn_id" => "[turn]",
    });
    // The queued turn waits for the model like the first; now it answers.
    gate.add_permits(1);
    let end = ws.until(ServerFrame::ends_turn).await;
    assert!(
        matches!(end.last(), Some(ServerFrame::TurnCommitted { .. })),
        "{end:?}"
    );
    let messages = t.json(&format!("/api/dialogs/{id}/messages")).await;
    let listed: Vec<(&str, &str, bool)> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap(),
                m["text"].as_str().unwrap(),
                m["unanswered"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("user", "work", true),
            ("user", "next", false),
            ("assistant", "partial done.", false)
        ]
    );
}

/// Messages an earlier process acknowledged run after a restart with no
/// connection of their own: a client watching the dialog sees each resumed
/// turn from `turn_started` to `turn_committed` exactly once, and a turn it
/// starts itself exactly once too.
#[tokio::test]
async fn a_watching_client_sees_turns_resumed_after_a_restart_exactly_once() {
    let mut first = TestServer::start(Setup::default()).await;
    let id = uuid(&first.dialog("Resumed").await);
    first.shutdown().await;
    let TestServer { dir, store, .. } = first;
    // What the dead process acknowledged but never started.
    let mut resumed = Vec::new();
    for text in ["one", "two"] {
        let turn_id = keel_core::TurnId::new();
        store
            .queue_input(keel_store::QueuedInput {
                session_id: keel_core::SessionId::from(id),
                turn_id,
                message: keel_core::Message::user(text),
                queued_at_ms: 1,
                webhook: None,
            })
            .await
            .unwrap();
        resumed.push(turn_id.as_uuid());
    }
    drop(store);
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start_in(
        dir,
        Setup {
            provider: Arc::new(GatedProvider { gate: gate.clone() }),
            ..Setup::default()
        },
    )
    .await;
    // "one" waits for the model; "two" waits behind it.
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
    gate.add_permits(2);
    let mut frames = Vec::new();
    let commits = |frames: &[ServerFrame]| {
        frames
            .iter()
            .filter(|f| matches!(f, ServerFrame::TurnCommitted { .. }))
            .count()
    };
    while commits(&frames) < 2 {
        frames.push(ws.frame().await);
    }
    gate.add_permits(1);
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: id,
        text: Some("three".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    while commits(&frames) < 3 {
        frames.push(ws.frame().await);
    }
    let own = frames
        .iter()
        .rev()
        .find_map(|f| match f {
            ServerFrame::TurnCommitted { turn_id, .. } => Some(*turn_id),
            _ => None,
        })
        .unwrap();
    // A turn's frames: its kinds, with adjacent text deltas (which may
    // arrive merged) as one, and its text.
    let of_turn = |turn: Uuid| -> (Vec<&'static str>, String) {
        let mut kinds: Vec<&'static str> = Vec::new();
        let mut text = String::new();
        for f in frames.iter().filter(|f| f.turn_id() == Some(turn)) {
            if let ServerFrame::TextDelta { text: t, .. } = f {
                text.push_str(t);
            }
            if kinds.last() != Some(&f.kind()) || f.kind() != "text_delta" {
                kinds.push(f.kind());
            }
        }
        (kinds, text)
    };
    // The second resumed turn and the client's own, whole and once each.
    let whole = (
        vec![
            "turn_started",
            "text_delta",
            "model_call_finished",
            "turn_committed",
        ],
        "partial done.".to_owned(),
    );
    assert_eq!(of_turn(resumed[1]), whole, "{frames:?}");
    assert_eq!(of_turn(own), whole, "{frames:?}");
    // The first one, watched from the middle, ends once.
    let (first_end, _) = of_turn(resumed[0]);
    assert_eq!(first_end.last(), Some(&"turn_committed"), "{frames:?}");
    assert_eq!(
        first_end.iter().filter(|k| **k == "turn_committed").count(),
        1
    );
}

/// A dialog budget the next call would pass ends the turn `budget_exhausted`
/// before the model is called, and `GET /api/dialogs/{id}/usage` shows what
/// the dialog spent against it.
#[tokio::test]
async fn a_turn_past_the_dialog_budget_fails_budget_exhausted_and_usage_shows_the_spend() {
    let t = TestServer::start(Setup {
        provider: scripted(vec![ScriptedResponse {
            usage: Some(keel_core::Usage::new(10_000, 0)),
            ..ScriptedResponse::text("first")
        }]),
        // $0.0001 a token: the first call costs $1, and any request of the
        // root agent (its prompt and tools) is estimated above $0.05.
        config: "[providers.default]\nkind = \"scripted\"\nprice_input_per_mtok = 100\n\
                 price_output_per_mtok = 100\n[session]\nmax_cost_usd_per_dialog = 1.05\n"
            .into(),
        ..Setup::default()
    })
    .await;
    let id = t.dialog("Budget").await;
    let mut ws = t.ws().await;
    let send = |text: &str| ClientFrame::Send {
        id: None,
        session_id: uuid(&id),
        text: Some(text.into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    };
    ws.send(&send("one")).await;
    ws.until(|f| matches!(f, ServerFrame::TurnCommitted { .. }))
        .await;
    ws.send(&send("two")).await;
    let frames = ws
        .until(|f| matches!(f, ServerFrame::TurnFailed { .. }))
        .await;
    let Some(ServerFrame::TurnFailed {
        budget_exhausted,
        timed_out,
        cancelled,
        input_kept,
        message,
        ..
    }) = frames.last()
    else {
        unreachable!()
    };
    assert_eq!(
        (*budget_exhausted, *timed_out, *cancelled, *input_kept),
        (true, false, false, true)
    );
    assert!(
        message.contains(
            "the budget session.max_cost_usd_per_dialog is exhausted ($1.000000 of $1.050000 spent"
        ),
        "{message}"
    );
    let usage = t.json(&format!("/api/dialogs/{id}/usage")).await;
    assert_eq!(usage["spend"]["model_calls"], 1, "{usage}");
    assert_eq!(usage["spend"]["prompt_tokens"], 10_000);
    assert_eq!(usage["spend"]["cost_usd"], 1.0);
    assert_eq!(usage["max_cost_usd"], 1.05);
}
