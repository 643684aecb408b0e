//! Two `keel serve` processes on one PostgreSQL database (in-process
//! servers): a turn one of them runs reaches the other's clients live, over
//! WebSocket and over SSE, with the other server's own event ids.

use std::sync::Arc;

use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use keel_store_postgres::require_postgres;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::resume::SseReader;
use super::{GatedProvider, Setup, TestServer};

/// A server on the database `conninfo`, answering with `provider`.
async fn server_on(conninfo: &str, provider: Arc<dyn keel_core::Provider>) -> TestServer {
    TestServer::start(Setup {
        provider,
        config: format!(
            "[storage]\nurl = {conninfo:?}\nmax_connections = 4\n\
             [session]\nauto_title_after_n_messages = 0\n"
        ),
        ..Setup::default()
    })
    .await
}

/// Two servers on one database, a dialog a WebSocket on the first follows,
/// and a turn of it the second runs, streaming.
struct Watched {
    here: TestServer,
    there: TestServer,
    dialog: String,
    ws: super::Ws,
    /// The running turn's id.
    turn: Value,
    /// The frames the first server's client got so far (up to a delta).
    frames: Vec<ServerFrame>,
}

/// Sends `text` to the second server, whose model stops mid-answer until
/// `gate` opens, while a client of the first follows the dialog.
async fn watched_elsewhere(
    db: &keel_store_postgres::testing::TestDb,
    gate: Arc<Semaphore>,
    text: &str,
) -> Watched {
    let here = server_on(
        &db.conninfo,
        Arc::new(keel_core::ScriptedProvider::offline()),
    )
    .await;
    let there = server_on(&db.conninfo, Arc::new(GatedProvider { gate })).await;
    let dialog = here.dialog("relayed").await;
    let mut ws = here.ws().await;
    ws.send(&ClientFrame::Subscribe {
        id: None,
        session_id: dialog.parse().unwrap(),
        since_revision: None,
        resume_from: None,
        join: false,
    })
    .await;
    assert!(matches!(ws.frame().await, ServerFrame::Subscribed { .. }));
    let r = there
        .post(
            &format!("/api/dialogs/{dialog}/messages"),
            json!({ "text": text }),
        )
        .await;
    assert_eq!(r.status(), 202);
    let turn = r.json::<Value>().await.unwrap()["turn_id"].clone();
    let frames = ws
        .until(|f| matches!(f, ServerFrame::TextDelta { .. }))
        .await;
    Watched {
        here,
        there,
        dialog,
        ws,
        turn,
        frames,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_one_server_runs_streams_live_to_the_other_servers_clients() {
    let db = require_postgres!();
    let gate = Arc::new(Semaphore::new(0));
    // The turn runs on the other server; it waits for the gate mid-answer.
    let Watched {
        here,
        there: _running,
        dialog,
        mut ws,
        turn,
        mut frames,
    } = watched_elsewhere(&db, gate.clone(), "hello from elsewhere").await;
    let turn = turn.as_str().unwrap().to_owned();

    // An SSE follower joining here now gets the running turn so far, then live.
    let response = here.get(&format!("/api/dialogs/{dialog}/stream")).await;
    let mut sse = SseReader::new(response);
    let mut events = Vec::new();
    for _ in 0..2 {
        events.push(sse.next().await.expect("the turn so far"));
    }
    gate.add_permits(1);
    frames.extend(ws.until(ServerFrame::ends_turn).await);
    while let Some(event) = sse.next().await {
        events.push(event);
    }

    // This server's ids, increasing; the same ones over SSE.
    let ids: Vec<u64> = frames.iter().filter_map(ServerFrame::event_id).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    let sse_ids: Vec<u64> = events.iter().filter_map(|e| e.id).collect();
    assert_eq!(sse_ids, ids, "{events:?}");
    for frame in &frames {
        assert_eq!(frame.turn_id().map(|t| t.to_string()), Some(turn.clone()));
    }
    // Adjacent deltas may have been merged on the way: the text is whole.
    let text: String = frames
        .iter()
        .filter_map(|f| match f {
            ServerFrame::TextDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "partial done.");
    insta::assert_json_snapshot!("relayed_ws_frames", frames, {
        "[].session_id" => "[dialog]",
        "[].event_id" => "[event]",
        "[].turn_id" => "[turn]",
        "[].checkpoint_id" => "[checkpoint]",
    });
    let sse: Vec<Value> = events
        .iter()
        .map(|e| json!({"event": e.name, "data": e.data}))
        .collect();
    insta::assert_json_snapshot!("relayed_sse_events", sse, {
        "[].data.session_id" => "[dialog]",
        "[].data.event_id" => "[event]",
        "[].data.turn_id" => "[turn]",
        "[].data.checkpoint_id" => "[checkpoint]",
    });

    // The committed answer is in the shared database, read here.
    let page = here
        .json(&format!(
            "/api/dialogs/{dialog}/messages?order=desc&limit=1"
        ))
        .await;
    assert_eq!(page["items"][0]["text"], "partial done.");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_steer_or_a_stop_sent_to_one_server_reaches_the_turn_another_runs() {
    let db = require_postgres!();
    // The turn runs on the other server, waiting mid-answer for a gate
    // nobody opens; this server learns of it from its relayed frames.
    let gate = Arc::new(Semaphore::new(0));
    let Watched {
        here,
        there,
        dialog,
        mut ws,
        turn,
        ..
    } = watched_elsewhere(&db, gate, "a long task").await;

    // Asked here, the other server's turn takes the text and answers.
    let steered = here
        .post(
            &format!("/api/dialogs/{dialog}/steer"),
            json!({"text": "keep it short"}),
        )
        .await;
    assert_eq!(steered.status(), 200);
    assert_eq!(
        steered.json::<Value>().await.unwrap(),
        json!({"steered": true, "turn_id": turn})
    );

    // Stopped here, it ends there; the answer returns once it has.
    let stopped = here
        .post(&format!("/api/dialogs/{dialog}/stop"), json!({}))
        .await;
    assert_eq!(stopped.status(), 200);
    assert_eq!(
        stopped.json::<Value>().await.unwrap(),
        json!({"stopped": true})
    );
    let end = ws.until(ServerFrame::ends_turn).await;
    let Some(ServerFrame::TurnFailed {
        turn_id, message, ..
    }) = end.last()
    else {
        panic!("the turn should end unsaved: {end:?}");
    };
    assert_eq!(json!(turn_id), turn);
    assert_eq!(message, "the turn was stopped; its answer was not saved");

    // Nothing runs anywhere now: a steer is not taken, on either server.
    for server in [&here, &there] {
        let r = server
            .post(
                &format!("/api/dialogs/{dialog}/steer"),
                json!({"text": "anyone?"}),
            )
            .await;
        assert_eq!(
            r.json::<Value>().await.unwrap(),
            json!({"steered": false, "turn_id": null})
        );
    }
    let page = here
        .json(&format!(
            "/api/dialogs/{dialog}/messages?order=desc&limit=1"
        ))
        .await;
    assert_eq!(page["items"][0]["text"], "a long task", "{page}");
}

/// `dialog`'s lease as the database has it: the generation holding it (if
/// any) and when it was taken.
async fn lease_row(db: &keel_store_postgres::testing::TestDb, dialog: &str) -> (Option<i64>, i64) {
    let row = db
        .connect()
        .await
        .query_one(
            "SELECT generation, acquired_at FROM session_leases WHERE session_id = $1",
            &[&dialog],
        )
        .await
        .expect("the dialog has a lease row");
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dialogs_lease_lingers_where_its_turn_ran_and_goes_back_at_shutdown() {
    let db = require_postgres!();
    let offline = || Arc::new(keel_core::ScriptedProvider::offline());
    // It lingers far longer than this test: only the shutdown gives it back.
    let mut here = TestServer::start(Setup {
        provider: offline(),
        config: format!(
            "[storage]\nurl = {:?}\nmax_connections = 4\nlease_linger_ms = 10000\n\
             [session]\nauto_title_after_n_messages = 0\n",
            db.conninfo
        ),
        ..Setup::default()
    })
    .await;
    let there = server_on(&db.conninfo, offline()).await;
    let dialog = here.dialog("lingering").await;
    let committed = |events: String| events.split(' ').any(|e| e == "turn_committed");
    assert!(committed(here.send_streamed(&dialog, "one").await));
    let kept = lease_row(&db, &dialog).await;
    assert!(kept.0.is_some(), "the lease stays after the turn: {kept:?}");
    // The next turn here takes it back without asking the database.
    assert!(committed(here.send_streamed(&dialog, "two").await));
    assert_eq!(lease_row(&db, &dialog).await, kept);

    here.shutdown().await;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while lease_row(&db, &dialog).await.0.is_some() {
        assert!(
            std::time::Instant::now() < until,
            "the lease is still held 5 s after the shutdown"
        );
        tokio::task::yield_now().await;
    }
    // The other server runs the dialog's next turn at once.
    assert!(committed(there.send_streamed(&dialog, "three").await));
    let page = there
        .json(&format!(
            "/api/dialogs/{dialog}/messages?order=desc&limit=1"
        ))
        .await;
    assert_eq!(page["items"][0]["role"], "assistant");
}
