//! Several processes on one PostgreSQL database: each activation registers
//! a process under its own generation without fencing the others, a
//! session's lease has one live holder at a time, and a process whose
//! registration expired is taken over — its runs, inbox leases, open and
//! queued inputs — by another, after which it writes nothing.

use keel_core::{ExecutionMode, Message, RunStatus, TurnId};
use keel_store::conformance::fixtures::{accept, claim, new_run, new_session, user};
use keel_store::{EventStatus, InputState, OpenTurn, QueuedInput, SessionLease, Store, StoreError};
use keel_store_postgres::testing::TestDb;
use keel_store_postgres::{require_postgres, PgOptions, PgStore};

/// A process on `db`: a store of its own, activated as `holder`.
async fn process(db: &TestDb, holder: &str) -> (Store, u64) {
    let (store, _) = PgStore::connect(&db.conninfo, PgOptions::default())
        .await
        .expect("connect to the test database");
    let store = Store::new(store);
    let activation = store
        .activate_runtime(holder.into(), 1)
        .await
        .expect("activate");
    (store, activation.generation)
}

/// Ends `generation`'s registration now, as if its process stopped renewing.
async fn expire(db: &TestDb, generation: u64) {
    let n = db
        .connect()
        .await
        .execute(
            "UPDATE runtime_processes SET expires_at = 0 WHERE generation = $1",
            &[&i64::try_from(generation).expect("a generation fits an i64")],
        )
        .await
        .expect("expire a registration");
    assert_eq!(n, 1, "generation {generation} is registered");
}

#[tokio::test]
async fn processes_register_side_by_side_and_neither_fences_the_other() {
    let db = require_postgres!();
    let (a, ga) = process(&db, "a").await;
    let session = a.create_session(new_session("d", 1)).await.unwrap();
    let mut run = new_run(session.id, ExecutionMode::Background);
    run.runtime_generation = ga;
    a.accept_run(accept(run.clone(), 10)).await.unwrap();
    let (b, gb) = process(&db, "b").await;
    assert!(gb > ga);
    // A's run is A's: B's activation recovered nothing of it.
    let stored = b.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(stored.status, RunStatus::Queued);
    // Both write; both renew; nothing expired.
    a.append_message(session.id, user("from a"), 2)
        .await
        .unwrap();
    b.append_message(session.id, user("from b"), 3)
        .await
        .unwrap();
    a.renew_runtime().await.unwrap();
    b.renew_runtime().await.unwrap();
    assert_eq!(a.recover_expired_runtimes(4).await.unwrap(), None);
    assert_eq!(a.last_seq(session.id).await.unwrap(), 2);
}

#[tokio::test]
async fn a_session_lease_has_one_live_holder_and_says_when_another_held_it() {
    let db = require_postgres!();
    let (a, _) = process(&db, "keel serve (a)").await;
    let (b, _) = process(&db, "keel serve (b)").await;
    let s = a.create_session(new_session("d", 1)).await.unwrap().id;
    // Never held by anyone: whatever A remembers may be stale.
    assert_eq!(
        a.lease_session(s).await.unwrap(),
        SessionLease::Held { moved: true }
    );
    // Held again by its holder: nothing moved.
    assert_eq!(
        a.lease_session(s).await.unwrap(),
        SessionLease::Held { moved: false }
    );
    assert_eq!(
        b.lease_session(s).await.unwrap(),
        SessionLease::Busy {
            holder: "keel serve (a)".into()
        }
    );
    // B's release of a lease it does not hold changes nothing.
    b.release_session(s).await.unwrap();
    assert!(matches!(
        b.lease_session(s).await.unwrap(),
        SessionLease::Busy { .. }
    ));
    a.release_session(s).await.unwrap();
    assert_eq!(
        b.lease_session(s).await.unwrap(),
        SessionLease::Held { moved: true }
    );
    b.release_session(s).await.unwrap();
    // A held it before B: A must reload.
    assert_eq!(
        a.lease_session(s).await.unwrap(),
        SessionLease::Held { moved: true }
    );
    a.release_session(s).await.unwrap();
    assert_eq!(
        a.lease_session(s).await.unwrap(),
        SessionLease::Held { moved: false }
    );
    // A session that does not exist has nothing to serialize.
    assert_eq!(
        a.lease_session(keel_core::SessionId::new()).await.unwrap(),
        SessionLease::Held { moved: true }
    );
}

#[tokio::test]
async fn an_expired_process_is_taken_over_once_and_then_writes_nothing() {
    let db = require_postgres!();
    let (a, ga) = process(&db, "a").await;
    let (b, gb) = process(&db, "b").await;
    // A runs a turn of dialog `d` (its lease, an open input), holds a
    // background run that completed into d's inbox and a claim of it, and
    // has an acknowledged input of dialog `e` queued.
    let d = a.create_session(new_session("d", 1)).await.unwrap().id;
    let e = a.create_session(new_session("e", 1)).await.unwrap().id;
    let mut done = new_run(d, ExecutionMode::Background);
    done.runtime_generation = ga;
    a.accept_run(accept(done.clone(), 10)).await.unwrap();
    a.commit_terminal(
        done.id,
        done.execution_id.clone(),
        keel_store::conformance::fixtures::completed("r"),
        keel_store::CompletionHandling::Deliver,
        5,
    )
    .await
    .unwrap();
    let mut running = new_run(d, ExecutionMode::Background);
    running.runtime_generation = ga;
    a.accept_run(accept(running.clone(), 10)).await.unwrap();
    assert!(matches!(
        a.lease_session(d).await.unwrap(),
        SessionLease::Held { .. }
    ));
    let lease = a.claim_inbox_batch(claim(d, 6)).await.unwrap().unwrap();
    assert_eq!(lease.events.len(), 1);
    let opened = a
        .open_turn(OpenTurn {
            session_id: d,
            messages: vec![user("q")],
            expected_head: None,
            queued: None,
            now_ms: 7,
        })
        .await
        .unwrap();
    let queued = TurnId::new();
    a.queue_input(QueuedInput {
        session_id: e,
        turn_id: queued,
        message: Message::user("waiting"),
        queued_at_ms: 8,
        webhook: None,
    })
    .await
    .unwrap();
    // B's own queue is B's: nobody takes it while B lives.
    let mine = TurnId::new();
    b.queue_input(QueuedInput {
        session_id: e,
        turn_id: mine,
        message: Message::user("b's"),
        queued_at_ms: 9,
        webhook: None,
    })
    .await
    .unwrap();
    // While A is registered, B takes nothing of it.
    assert_eq!(b.recover_expired_runtimes(10).await.unwrap(), None);
    assert!(b.queued_inputs().await.unwrap().is_empty());
    assert!(matches!(
        b.lease_session(d).await.unwrap(),
        SessionLease::Busy { .. }
    ));

    expire(&db, ga).await;
    let taken = b.recover_expired_runtimes(11).await.unwrap().unwrap();
    assert_eq!(taken.processes, [(ga, "a".to_owned())]);
    assert_eq!(taken.recovery.interrupted_runs, [running.id]);
    assert_eq!(taken.recovery.unanswered_inputs, 1);
    assert_eq!(taken.recovery.leases_expired, 1);
    assert!(taken.recovery.sessions_with_inbox_work.contains(&d));
    assert_eq!(taken.sessions_with_queued_inputs, [e]);
    // Taken over once: a second recovery (or another process's) finds nothing.
    assert_eq!(b.recover_expired_runtimes(12).await.unwrap(), None);

    let run = b.get_run(running.id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Interrupted);
    let events = b.list_inbox_events(d).await.unwrap();
    assert_eq!(events.len(), 2, "{events:#?}");
    assert!(events.iter().all(|e| e.status == EventStatus::Pending));
    let history = b
        .load_messages(d, keel_store::MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].seq, opened[0]);
    assert_eq!(history[0].input_state, Some(InputState::Unanswered));
    // A's queued input is B's to run now, once; B's own is not listed.
    let inputs = b.queued_inputs().await.unwrap();
    assert_eq!(
        inputs.iter().map(|i| i.turn_id).collect::<Vec<_>>(),
        [queued]
    );
    assert!(b.queued_inputs().await.unwrap().is_empty());
    // D's lease is free again; B takes it, knowing A wrote the session.
    assert_eq!(
        b.lease_session(d).await.unwrap(),
        SessionLease::Held { moved: true }
    );

    // A, taken over, writes nothing more and learns why when it renews.
    let fenced = a.renew_runtime().await.unwrap_err();
    assert_eq!(fenced, StoreError::TakenOver { generation: ga });
    assert_eq!(ga, 1);
    insta::assert_snapshot!(fenced, @"this process (runtime generation 1) was taken over by another after its registration lapsed; it writes nothing more");
    assert!(matches!(
        a.append_message(d, user("late"), 13).await.unwrap_err(),
        StoreError::TakenOver { .. }
    ));
    // The writes that are one statement each check the fence themselves.
    let late = QueuedInput {
        session_id: e,
        turn_id: TurnId::new(),
        message: Message::user("late"),
        queued_at_ms: 13,
        webhook: Some("https://example.test/hook".into()),
    };
    assert_eq!(
        a.queue_input(late).await.unwrap_err(),
        StoreError::TakenOver { generation: ga }
    );
    assert_eq!(
        a.lease_session(e).await.unwrap_err(),
        StoreError::TakenOver { generation: ga }
    );
    assert!(b.queued_inputs().await.unwrap().is_empty());
    // So do the transactions that check it in the statement taking their lock.
    assert_eq!(
        a.add_dialog_spend(e, keel_core::Usage::new(1, 1), keel_core::Usd::ZERO, 13)
            .await
            .unwrap_err(),
        StoreError::TakenOver { generation: ga }
    );
    assert_eq!(b.dialog_spend(e).await.unwrap(), Default::default());
    let head = keel_store::SessionHead {
        timeline: b.get_session(d).await.unwrap().unwrap().head_timeline_id,
        last_seq: b.last_seq(d).await.unwrap(),
    };
    assert_eq!(
        a.open_turn(OpenTurn {
            session_id: d,
            messages: vec![user("late")],
            expected_head: Some(head),
            queued: None,
            now_ms: 13,
        })
        .await
        .unwrap_err(),
        StoreError::TakenOver { generation: ga }
    );
    assert_eq!(
        b.load_messages(d, Default::default()).await.unwrap().len(),
        1
    );
    // Its release of the lease it held (unfenced) leaves B's lease alone.
    a.release_session(d).await.unwrap();
    let (c, _) = process(&db, "c").await;
    assert_eq!(
        c.lease_session(d).await.unwrap(),
        SessionLease::Busy { holder: "b".into() }
    );
    assert!(matches!(
        a.commit_terminal(
            running.id,
            running.execution_id,
            keel_store::conformance::fixtures::completed("late"),
            keel_store::CompletionHandling::Deliver,
            14,
        )
        .await
        .unwrap_err(),
        StoreError::TakenOver { .. }
    ));
    // It may start over as a new process.
    let again = a.activate_runtime("a again".into(), 15).await.unwrap();
    assert!(again.generation > gb);
    a.append_message(e, user("back"), 16).await.unwrap();
}

#[tokio::test]
async fn a_process_whose_connection_ended_is_taken_over_without_waiting_for_its_lease() {
    let db = require_postgres!();
    let (a, ga) = process(&db, "a").await;
    let (b, _) = process(&db, "b").await;
    assert_eq!(b.recover_expired_runtimes(2).await.unwrap(), None);
    // The process dies: its connections end (its lease has 10 s to run).
    drop(a);
    // The server frees its presence lock once it has seen the connection
    // close, which it does on its own time: ask until it has.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let taken = loop {
        if let Some(taken) = b.recover_expired_runtimes(3).await.unwrap() {
            break taken;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a dead process's registration was not taken over within 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(taken.processes, [(ga, "a".to_owned())]);
    // B itself is alive: its own presence keeps it registered.
    b.renew_runtime().await.unwrap();
}

#[tokio::test]
async fn a_webhook_delivery_is_handed_to_one_process_at_a_time() {
    let db = require_postgres!();
    let (a, _) = process(&db, "a").await;
    let (b, _) = process(&db, "b").await;
    let s = a.create_session(new_session("w", 1)).await.unwrap().id;
    let q = QueuedInput {
        session_id: s,
        turn_id: TurnId::new(),
        message: Message::user("hello"),
        queued_at_ms: 10,
        webhook: Some("http://127.0.0.1:9/hook".into()),
    };
    a.queue_input(q.clone()).await.unwrap();
    let seqs = a
        .open_turn(OpenTurn {
            session_id: s,
            messages: vec![user("hello")],
            expected_head: None,
            queued: Some(q.turn_id),
            now_ms: 20,
        })
        .await
        .unwrap();
    a.commit_turn(keel_store::TurnCommit {
        calls: None,
        session_id: s,
        messages: vec![keel_store::conformance::fixtures::assistant("done")],
        state: b"{}".to_vec(),
        checkpoint: None,
        visible_user_inputs: 0,
        answers: seqs,
        expected_head: None,
        now_ms: 30,
    })
    .await
    .unwrap();
    // Both workers look at once: one gets it.
    let (x, y) = tokio::join!(
        a.due_webhook_deliveries(30, 10),
        b.due_webhook_deliveries(30, 10)
    );
    let (x, y) = (x.unwrap(), y.unwrap());
    assert_eq!(x.len() + y.len(), 1, "{x:?} {y:?}");
    let delivery = x.into_iter().chain(y).next().unwrap();
    assert_eq!(delivery.next_attempt_at_ms, Some(30));
    // Claimed: nobody else gets it while its attempt may be under way…
    assert!(b
        .due_webhook_deliveries(30 + 59_999, 10)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(a.next_webhook_due().await.unwrap(), Some(30 + 60_000));
    // …and a claimer that died leaves it due again after the claim.
    let again = b.due_webhook_deliveries(30 + 60_000, 10).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].id, delivery.id);
}

#[tokio::test]
async fn two_processes_asking_at_once_for_a_lease_never_both_get_it() {
    let db = require_postgres!();
    let (a, _) = process(&db, "a").await;
    let (b, _) = process(&db, "b").await;
    for n in 0..20 {
        let s = a
            .create_session(new_session(&format!("d{n}"), 1))
            .await
            .unwrap()
            .id;
        let (x, y) = tokio::join!(a.lease_session(s), b.lease_session(s));
        let held = [x.unwrap(), y.unwrap()]
            .iter()
            .filter(|l| matches!(l, SessionLease::Held { .. }))
            .count();
        assert_eq!(held, 1, "dialog {n}");
    }
}
