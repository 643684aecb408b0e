//! The webhook outbox: a send's subscription commits with its queued
//! input, the commit answering it creates the delivery in its own
//! transaction (plus one per server-wide URL), attempts move a row to
//! delivered or, after the last one, dead, and a background run's end or an
//! unanswered input is delivered too.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{Message, SessionId, TurnId};

use crate::{AttemptOutcome, DeliveryStatus, OpenTurn, QueuedInput, Store, TurnCommit};

use super::fixtures::*;
use super::TestDb;

fn queued(session: SessionId, url: Option<&str>) -> QueuedInput {
    QueuedInput {
        session_id: session,
        turn_id: TurnId::new(),
        message: Message::user("hello"),
        queued_at_ms: 10,
        webhook: url.map(str::to_owned),
    }
}

/// Completes `run` with `result` (the commit must win).
async fn complete(store: &Store, run: &crate::NewRun, result: &str) {
    let outcome = crate::TerminalOutcome::Completed {
        result: result.into(),
        usage: keel_core::Usage::new(1, 1),
        tool_calls: 0,
        iterations: 1,
        cost: None,
    };
    let commit = store
        .commit_terminal(
            run.id,
            run.execution_id.clone(),
            outcome,
            crate::CompletionHandling::Deliver,
            50,
        )
        .await
        .unwrap();
    assert!(commit.won);
}

/// Opens the queued input's turn and commits its answer.
async fn run_turn(store: &Store, q: &QueuedInput, answer: &str) -> Vec<i64> {
    let seqs = store
        .open_turn(OpenTurn {
            session_id: q.session_id,
            messages: vec![user("hello")],
            expected_head: None,
            queued: Some(q.turn_id),
            now_ms: 20,
        })
        .await
        .unwrap();
    store
        .commit_turn(TurnCommit {
            calls: None,
            session_id: q.session_id,
            messages: vec![assistant(answer)],
            state: b"{}".to_vec(),
            checkpoint: None,
            visible_user_inputs: 0,
            answers: seqs.clone(),
            expected_head: None,
            now_ms: 30,
        })
        .await
        .unwrap();
    seqs
}

/// Opens the queued input's turn without answering it; returns its seqs.
async fn open_only(store: &Store, q: &QueuedInput) -> Vec<i64> {
    store
        .open_turn(OpenTurn {
            session_id: q.session_id,
            messages: vec![user("hello")],
            expected_head: None,
            queued: Some(q.turn_id),
            now_ms: 20,
        })
        .await
        .unwrap()
}

fn statuses(deliveries: &[crate::WebhookDelivery]) -> Vec<(String, String, String)> {
    deliveries
        .iter()
        .map(|d| {
            let body: serde_json::Value = serde_json::from_str(&d.body).unwrap();
            let turn = body["data"]["turn_id"].as_str().unwrap_or("-").to_owned();
            let status = body["data"]["status"].as_str().unwrap().to_owned();
            (d.url.clone(), turn, status)
        })
        .collect()
}

pub async fn the_commit_answering_a_subscribed_input_creates_its_delivery(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("w", 1)).await.unwrap();
    let q = queued(s.id, Some("http://127.0.0.1:9/hook"));
    store.queue_input(q.clone()).await.unwrap();
    // The subscription rides with the queued input (a restart re-runs it).
    assert_eq!(
        store.queued_inputs().await.unwrap(),
        std::slice::from_ref(&q)
    );
    assert!(store
        .due_webhook_deliveries(i64::MAX, 10)
        .await
        .unwrap()
        .is_empty());
    let unhooked = queued(s.id, None);
    store.queue_input(unhooked.clone()).await.unwrap();

    run_turn(&store, &q, "the answer").await;
    // The commit woke the worker (a permit is kept).
    tokio::time::timeout(std::time::Duration::from_secs(5), store.webhook_committed())
        .await
        .unwrap();
    let due = store.due_webhook_deliveries(30, 10).await.unwrap();
    assert_eq!(due.len(), 1, "{due:?}");
    let d = &due[0];
    assert_eq!(d.url, "http://127.0.0.1:9/hook");
    assert_eq!(d.turn_id, Some(q.turn_id));
    assert_eq!(d.status, DeliveryStatus::Pending);
    assert_eq!(d.next_attempt_at_ms, Some(30));
    let body: serde_json::Value = serde_json::from_str(&d.body).unwrap();
    assert_eq!(body["type"], "turn.completed");
    assert_eq!(body["data"]["turn_id"], q.turn_id.to_string());
    assert_eq!(body["data"]["dialog_id"], s.id.to_string());
    assert_eq!(body["data"]["answer"], "the answer");
    assert_eq!(body["data"]["status"], "committed");
    // Not due before its time.
    assert!(store
        .due_webhook_deliveries(29, 10)
        .await
        .unwrap()
        .is_empty());

    // A turn without a subscription and no server-wide URL: nothing.
    run_turn(&store, &unhooked, "quiet").await;
    assert_eq!(
        store
            .list_webhook_deliveries(None, None, 10)
            .await
            .unwrap()
            .len(),
        1
    );
    assert!(store
        .check_invariants(crate::CheckOptions::default())
        .await
        .unwrap()
        .is_clean());
}

pub async fn server_wide_urls_get_every_answering_commit_and_a_withdrawn_input_none(db: TestDb) {
    let store = db.store.clone();
    store.set_webhook_urls(vec![
        "http://a.example/h".into(),
        "http://b.example/h".into(),
    ]);
    let s = store.create_session(new_session("w", 1)).await.unwrap();
    let q = queued(s.id, Some("http://c.example/h"));
    store.queue_input(q.clone()).await.unwrap();
    run_turn(&store, &q, "one").await;
    let all = store.list_webhook_deliveries(None, None, 10).await.unwrap();
    let mut urls: Vec<_> = all.iter().map(|d| d.url.as_str()).collect();
    urls.sort_unstable();
    assert_eq!(
        urls,
        [
            "http://a.example/h",
            "http://b.example/h",
            "http://c.example/h"
        ]
    );
    let ids: std::collections::HashSet<_> = all.iter().map(|d| d.id.clone()).collect();
    assert_eq!(ids.len(), 3, "each delivery has its own id");
    assert!(all.iter().all(|d| d.turn_id == Some(q.turn_id)));

    // A withdrawn input takes its subscription with it.
    let gone = queued(s.id, Some("http://c.example/h"));
    store.queue_input(gone.clone()).await.unwrap();
    assert!(store.discard_queued_input(gone.turn_id).await.unwrap());
    assert!(store.queued_inputs().await.unwrap().is_empty());
    assert!(store
        .check_invariants(crate::CheckOptions::default())
        .await
        .unwrap()
        .is_clean());
}

pub async fn attempts_retry_then_deliver_or_dead_letter_after_the_last(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("w", 1)).await.unwrap();
    for _ in 0..2 {
        let q = queued(s.id, Some("http://127.0.0.1:9/hook"));
        store.queue_input(q.clone()).await.unwrap();
        run_turn(&store, &q, "a").await;
    }
    let due = store.due_webhook_deliveries(30, 10).await.unwrap();
    let (ok, bad) = (due[0].id.clone(), due[1].id.clone());
    let fail = |at| AttemptOutcome::Failed {
        error: "503".into(),
        retry_at_ms: at,
        max_attempts: 3,
    };
    assert_eq!(
        store
            .record_webhook_attempt(ok.clone(), fail(100), 40)
            .await
            .unwrap(),
        Some(DeliveryStatus::Pending)
    );
    assert_eq!(
        store.next_webhook_due().await.unwrap(),
        Some(30),
        "the other is due"
    );
    assert_eq!(
        store
            .record_webhook_attempt(ok.clone(), AttemptOutcome::Delivered, 100)
            .await
            .unwrap(),
        Some(DeliveryStatus::Delivered)
    );
    // A delivered row takes no further attempt.
    assert_eq!(
        store
            .record_webhook_attempt(ok.clone(), fail(200), 100)
            .await
            .unwrap(),
        None
    );
    for (n, want) in [
        (1, DeliveryStatus::Pending),
        (2, DeliveryStatus::Pending),
        (3, DeliveryStatus::Dead),
    ] {
        assert_eq!(
            store
                .record_webhook_attempt(bad.clone(), fail(100 + n), 50)
                .await
                .unwrap(),
            Some(want),
            "attempt {n}"
        );
    }
    assert_eq!(store.next_webhook_due().await.unwrap(), None);
    let dead = store
        .list_webhook_deliveries(Some(DeliveryStatus::Dead), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].attempts, dead[0].last_error.as_deref()),
        (3, Some("503"))
    );
    let delivered = store
        .list_webhook_deliveries(Some(DeliveryStatus::Delivered), None, 10)
        .await
        .unwrap();
    assert_eq!(
        (delivered[0].attempts, delivered[0].delivered_at_ms),
        (2, Some(100))
    );
    // Paged by seq.
    let first = store.list_webhook_deliveries(None, None, 1).await.unwrap();
    let rest = store
        .list_webhook_deliveries(None, Some(first[0].seq), 10)
        .await
        .unwrap();
    assert_eq!(rest.len(), 1);
    assert_ne!(rest[0].id, first[0].id);
    assert!(store
        .check_invariants(crate::CheckOptions::default())
        .await
        .unwrap()
        .is_clean());
}

pub async fn a_pending_delivery_survives_reopening_the_database(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("w", 1)).await.unwrap();
    let q = queued(s.id, Some("http://127.0.0.1:9/hook"));
    store.queue_input(q.clone()).await.unwrap();
    run_turn(&store, &q, "kept").await;
    drop(store);
    let store = db.reopen().await;
    let due = store.due_webhook_deliveries(i64::MAX, 10).await.unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].turn_id, Some(q.turn_id));
}

pub async fn a_background_run_of_a_hooked_turn_notifies_the_same_url_when_it_ends(db: TestDb) {
    use crate::AcceptRun;
    use keel_core::ExecutionMode;
    let store = db.store.clone();
    let s = store.create_session(new_session("w", 1)).await.unwrap();
    let q = queued(s.id, Some("http://127.0.0.1:9/hook"));
    store.queue_input(q.clone()).await.unwrap();
    run_turn(&store, &q, "started a run").await;
    let accept = |root_turn, mode| {
        let mut run = new_run(s.id, mode);
        run.root_turn_id = root_turn;
        (
            run.clone(),
            AcceptRun {
                run,
                inbox_capacity: 4,
                now_ms: 40,
            },
        )
    };
    let (hooked, a) = accept(Some(q.turn_id), ExecutionMode::Background);
    store.accept_run(a).await.unwrap();
    // A foreground run, and a background run of another turn, notify nothing.
    let (fg, a) = accept(Some(q.turn_id), ExecutionMode::Foreground);
    store.accept_run(a).await.unwrap();
    let (other, a) = accept(Some(TurnId::new()), ExecutionMode::Background);
    store.accept_run(a).await.unwrap();
    for run in [&hooked, &fg, &other] {
        complete(&store, run, "found it").await;
    }
    let runs: Vec<_> = store
        .list_webhook_deliveries(None, None, 10)
        .await
        .unwrap()
        .into_iter()
        .filter(|d| d.event == "run.completed")
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let body: serde_json::Value = serde_json::from_str(&runs[0].body).unwrap();
    assert_eq!(runs[0].url, "http://127.0.0.1:9/hook");
    assert_eq!(body["type"], "run.completed");
    assert_eq!(body["data"]["run_id"], hooked.id.to_string());
    assert_eq!(body["data"]["turn_id"], q.turn_id.to_string());
    assert_eq!(body["data"]["agent"], "researcher");
    assert_eq!(body["data"]["status"], "completed");
    assert_eq!(body["data"]["result"], "found it");
    assert!(store
        .check_invariants(crate::CheckOptions::default())
        .await
        .unwrap()
        .is_clean());
}

pub async fn server_wide_urls_get_every_background_runs_end_completed_or_cancelled(db: TestDb) {
    use crate::AcceptRun;
    use keel_core::ExecutionMode;
    let store = db.store.clone();
    store.set_webhook_urls(vec!["http://127.0.0.1:9/all".into()]);
    let s = store.create_session(new_session("w", 1)).await.unwrap();
    let accept = |mode| {
        let run = new_run(s.id, mode);
        let request = AcceptRun {
            run: run.clone(),
            inbox_capacity: 4,
            now_ms: 40,
        };
        (run, request)
    };
    let (completed, a) = accept(ExecutionMode::Background);
    store.accept_run(a).await.unwrap();
    let (foreground, a) = accept(ExecutionMode::Foreground);
    store.accept_run(a).await.unwrap();
    let (cancelled, a) = accept(ExecutionMode::Background);
    store.accept_run(a).await.unwrap();
    for run in [&completed, &foreground] {
        complete(&store, run, "done").await;
    }
    store
        .cancel_session(s.id, "stopped".into(), 60)
        .await
        .unwrap();
    let ends: Vec<(String, String, String)> = store
        .list_webhook_deliveries(None, None, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|d| {
            let body: serde_json::Value = serde_json::from_str(&d.body).unwrap();
            let run = body["data"]["run_id"].as_str().unwrap().to_owned();
            let status = body["data"]["status"].as_str().unwrap().to_owned();
            (d.url, run, status)
        })
        .collect();
    // The foreground run is part of its turn and notifies nothing of its own.
    assert_eq!(
        ends,
        [
            (
                "http://127.0.0.1:9/all".to_owned(),
                completed.id.to_string(),
                "completed".to_owned()
            ),
            (
                "http://127.0.0.1:9/all".to_owned(),
                cancelled.id.to_string(),
                "cancelled".to_owned()
            ),
        ]
    );
    assert!(store
        .check_invariants(crate::CheckOptions::default())
        .await
        .unwrap()
        .is_clean());
}

pub async fn a_turn_that_fails_or_a_crash_cuts_off_is_delivered_as_unanswered(db: TestDb) {
    let store = db.store.clone();
    store.set_webhook_urls(vec!["http://127.0.0.1:9/all".into()]);
    let s = store.create_session(new_session("w", 1)).await.unwrap();
    // A turn that fails: its input is marked unanswered.
    let failed = queued(s.id, Some("http://127.0.0.1:9/hook"));
    store.queue_input(failed.clone()).await.unwrap();
    let seqs = open_only(&store, &failed).await;
    assert_eq!(store.mark_unanswered(s.id, seqs.clone()).await.unwrap(), 1);
    // Marking it again changes nothing and delivers nothing more.
    assert_eq!(store.mark_unanswered(s.id, seqs).await.unwrap(), 0);
    let hook = failed.turn_id.to_string();
    let expected_failed = [
        (
            "http://127.0.0.1:9/hook".to_owned(),
            hook.clone(),
            "unanswered".to_owned(),
        ),
        (
            "http://127.0.0.1:9/all".to_owned(),
            hook,
            "unanswered".to_owned(),
        ),
    ];
    let listed = store.list_webhook_deliveries(None, None, 10).await.unwrap();
    assert_eq!(statuses(&listed), expected_failed);
    assert!(listed.iter().all(|d| d.event == "turn.completed"));

    // A turn a crash cut off: the next activation closes its input.
    let cut = queued(s.id, Some("http://127.0.0.1:9/hook"));
    store.queue_input(cut.clone()).await.unwrap();
    open_only(&store, &cut).await;
    drop(store);
    let store = db.reopen().await;
    store.set_webhook_urls(vec!["http://127.0.0.1:9/all".into()]);
    let activation = store.activate_runtime("test".into(), 40).await.unwrap();
    assert_eq!(activation.recovery.unanswered_inputs, 1);
    let listed = store.list_webhook_deliveries(None, None, 10).await.unwrap();
    let cut_turn = cut.turn_id.to_string();
    assert_eq!(
        statuses(&listed)[2..],
        [
            (
                "http://127.0.0.1:9/hook".to_owned(),
                cut_turn.clone(),
                "unanswered".to_owned()
            ),
            (
                "http://127.0.0.1:9/all".to_owned(),
                cut_turn,
                "unanswered".to_owned()
            ),
        ]
    );
    assert!(store
        .check_invariants(crate::CheckOptions::default())
        .await
        .unwrap()
        .is_clean());
}
