//! The runtime generation: activation bumps it past every older one and
//! recovers in the same transaction (runs, leases, open inputs), a
//! superseded generation can write nothing, and a turn commit refuses a
//! history that moved since the turn started.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{ExecutionMode, RunStatus};

use crate::{AcceptRun, SessionHead, StoreError, TurnCommit};

use super::fixtures::*;
use super::TestDb;

pub async fn activation_bumps_past_stamped_runs_and_recovers_them_in_one_step(db: TestDb) {
    let store = db.store.clone();
    assert_eq!(store.runtime_generation().await.unwrap(), None);
    let root = keel_core::SessionId::new();
    // A run stamped by a build that used wall-clock generations.
    let mut old = new_run(root, ExecutionMode::Background);
    old.runtime_generation = 1_700_000_000_000;
    store
        .accept_run(AcceptRun {
            run: old.clone(),
            inbox_capacity: 10,
            now_ms: 1,
        })
        .await
        .unwrap();
    let first = store.activate_runtime("first".into(), 10).await.unwrap();
    assert_eq!(first.generation, 1_700_000_000_001);
    assert_eq!(first.previous_holder, None);
    assert_eq!(first.recovery.interrupted_runs, [old.id]);
    assert_eq!(first.recovery.sessions_with_inbox_work, [root]);
    let run = store.get_run(old.id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Interrupted);
    let second = store.activate_runtime("second".into(), 20).await.unwrap();
    assert_eq!(second.generation, first.generation + 1);
    assert_eq!(second.previous_holder.as_deref(), Some("first"));
    assert_eq!(
        store.runtime_generation().await.unwrap(),
        Some((second.generation, "second".to_owned()))
    );
}

pub async fn a_superseded_generation_writes_nothing(db: TestDb) {
    let older = db.store.clone();
    older.activate_runtime("older".into(), 1).await.unwrap();
    let session = older.create_session(new_session("a", 1)).await.unwrap();
    // A second process activates on the same database (its lock was
    // lost, say): from now on the first one is fenced off.
    let newer = db.reopen().await;
    let activation = newer.activate_runtime("newer".into(), 2).await.unwrap();
    let mut kept = 0;
    if older.shared() {
        // Processes share this database: the first one writes on until its
        // registration expires and another process takes its work over.
        older
            .append_message(session.id, user("still served"), 3)
            .await
            .unwrap();
        kept += 1;
        let expired = db
            .scalar(&format!(
                "WITH e AS (UPDATE runtime_processes SET expires_at = 0 \
                 WHERE generation = {} RETURNING 1) SELECT count(*) FROM e",
                activation.generation - 1
            ))
            .await;
        assert_eq!(expired, 1);
        let recovered = newer.recover_expired_runtimes(3).await.unwrap().unwrap();
        assert_eq!(
            recovered.processes,
            [(activation.generation - 1, "older".to_owned())]
        );
        assert_eq!(newer.recover_expired_runtimes(3).await.unwrap(), None);
    }
    let err = older
        .append_message(session.id, user("late"), 3)
        .await
        .unwrap_err();
    let gone = if older.shared() {
        StoreError::TakenOver {
            generation: activation.generation - 1,
        }
    } else {
        StoreError::Fenced {
            ours: activation.generation - 1,
            current: activation.generation,
            holder: "newer".into(),
        }
    };
    assert_eq!(err, gone);
    assert!(err.is_fenced());
    assert_eq!(
        older
            .create_session(new_session("b", 3))
            .await
            .unwrap_err()
            .to_string(),
        gone.to_string()
    );
    // The newer process writes; reads of the older still work.
    newer
        .append_message(session.id, user("fresh"), 4)
        .await
        .unwrap();
    assert_eq!(older.last_seq(session.id).await.unwrap(), kept + 1);
}

fn turn(session: keel_core::SessionId, head: Option<SessionHead>) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![user("q"), assistant("a")],
        state: b"{}".to_vec(),
        checkpoint: None,
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: head,
        now_ms: 5,
    }
}

pub async fn a_turn_commit_refuses_a_history_that_moved(db: TestDb) {
    let store = db.store.clone();
    let session = store.create_session(new_session("a", 1)).await.unwrap();
    let head = |last_seq| SessionHead {
        timeline: session.head_timeline_id.clone(),
        last_seq,
    };
    store
        .commit_turn(turn(session.id, Some(head(0))))
        .await
        .unwrap();
    // A second writer that started from the same (empty) history loses.
    let err = store
        .commit_turn(turn(session.id, Some(head(0))))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string()
            .replace(&session.id.to_string(), "<session>"),
        "conflict: session <session> changed since the turn started (its history ended at seq 0 \
         and now ends at seq 2); the turn was not saved"
    );
    assert_eq!(store.last_seq(session.id).await.unwrap(), 2);
    store
        .commit_turn(turn(session.id, Some(head(2))))
        .await
        .unwrap();
    assert_eq!(store.last_seq(session.id).await.unwrap(), 4);
}

/// The lock says the earlier process is gone: its leases are released at
/// activation even before they expire, so its events are delivered again.
pub async fn activation_releases_the_leases_of_the_process_before_it(db: TestDb) {
    let store = db.store.clone();
    let root = store.create_session(new_session("a", 1)).await.unwrap().id;
    let run = new_run(root, ExecutionMode::Background);
    store
        .accept_run(AcceptRun {
            run: run.clone(),
            inbox_capacity: 10,
            now_ms: 1,
        })
        .await
        .unwrap();
    store
        .commit_terminal(
            run.id,
            run.execution_id.clone(),
            crate::TerminalOutcome::Failed {
                error: "x".into(),
                usage: None,
            },
            crate::CompletionHandling::Deliver,
            2,
        )
        .await
        .unwrap();
    let lease = store
        .claim_inbox_batch(crate::ClaimRequest {
            root_session_id: root,
            now_ms: 3,
            lease_ms: 3_600_000,
            max_events: 8,
            max_bytes: 1 << 20,
            delivery: None,
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.events.len(), 1);
    let activation = store.activate_runtime("next".into(), 4).await.unwrap();
    assert_eq!(activation.recovery.leases_expired, 1);
    assert_eq!(activation.recovery.sessions_with_inbox_work, [root]);
    let events = store.list_inbox_events(root).await.unwrap();
    assert_eq!(events[0].status, crate::EventStatus::Pending);
}

/// A process killed while its turns waited for the model left their inputs
/// `open`; the next process's activation marks every one unanswered, in its
/// recovery transaction, before any turn of its own can start.
pub async fn activation_closes_the_inputs_a_dead_process_left_open(db: TestDb) {
    let store = db.store.clone();
    store.activate_runtime("dead".into(), 1).await.unwrap();
    let mut sessions = Vec::new();
    for dialog in ["a", "b"] {
        let s = store.create_session(new_session(dialog, 1)).await.unwrap();
        store
            .open_turn(crate::OpenTurn {
                session_id: s.id,
                messages: vec![user("typed before the crash")],
                expected_head: None,
                queued: None,
                now_ms: 2,
            })
            .await
            .unwrap();
        sessions.push(s.id);
    }
    if store.shared() {
        // Processes share this database: the first one is gone once its
        // registration is (its store lives on in this test).
        let gone = db
            .scalar(
                "WITH e AS (UPDATE runtime_processes SET expires_at = 0 RETURNING 1) \
                 SELECT count(*) FROM e",
            )
            .await;
        assert_eq!(gone, 1);
    }
    drop(store);
    let store = db.reopen().await;
    let activation = store.activate_runtime("next".into(), 3).await.unwrap();
    assert_eq!(activation.recovery.unanswered_inputs, 2);
    for id in sessions {
        let messages = store.load_messages(id, Default::default()).await.unwrap();
        assert_eq!(messages.len(), 1, "the user's words survived");
        assert_eq!(messages[0].input_state, Some(crate::InputState::Unanswered));
    }
    let again = store.activate_runtime("after".into(), 4).await.unwrap();
    assert_eq!(again.recovery.unanswered_inputs, 0);
}
