//! The write path: transient failures retried then surfaced as a typed
//! error, group commit with per-request savepoints, reads during writes.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

mod common;

use std::time::Duration;

use keel_core::{CheckpointId, Message};
use keel_store::{
    CheckpointSource, MessageFilter, NewCheckpoint, NewMessage, Store, StoreError, StoreOptions,
    TurnCommit,
};
use rusqlite::Connection;

use common::*;

#[tokio::test]
async fn a_held_write_lock_surfaces_as_busy_after_the_retries() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        db_path(&dir),
        StoreOptions {
            busy_timeout: Duration::from_millis(5),
            retry_delays: vec![Duration::from_millis(1); 3],
            readers: 1,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let blocker = Connection::open(db_path(&dir)).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();

    let before = store.commit_stats();
    let err = store.touch_session(s.id, 2).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Busy { attempts: 4, .. }),
        "3 retries after the first attempt: {err}"
    );
    assert!(err.is_retryable());
    assert_eq!(store.commit_stats().requests - before.requests, 1);
    // Reads are not blocked by a writer in WAL mode.
    assert!(store.get_session(s.id).await.unwrap().is_some());

    blocker.execute_batch("ROLLBACK").unwrap();
    store.touch_session(s.id, 3).await.unwrap();
    assert_eq!(
        store
            .get_session(s.id)
            .await
            .unwrap()
            .unwrap()
            .last_active_at_ms,
        3
    );
}

#[tokio::test]
async fn group_commit_batches_waiting_requests_and_isolates_failures() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let a = store.create_session(new_session("a", 1)).await.unwrap();
    let b = store.create_session(new_session("b", 1)).await.unwrap();

    // A turn whose checkpoint id is taken fails after its messages were
    // inserted: the request's savepoint must undo them.
    let taken = CheckpointId::new();
    store
        .create_checkpoint(b.id, manual(taken), b"s".to_vec(), 2)
        .await
        .unwrap();
    let bad = TurnCommit {
        session_id: b.id,
        messages: vec![NewMessage::new(Message::user("written, then undone"))],
        state: b"s2".to_vec(),
        checkpoint: Some(manual(taken)),
        visible_user_inputs: 1,
        now_ms: 7,
    };

    // Hold the write lock so the requests below pile up behind the first one.
    let blocker = Connection::open(db_path(&dir)).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let before = store.commit_stats();
    let (r1, r2, r3, r4, ()) = tokio::join!(
        biased;
        store.touch_session(a.id, 5),
        store.append_message(a.id, user("one"), 6),
        store.commit_turn(bad.clone()),
        store.append_message(b.id, user("two"), 8),
        async {
            // join! polled every request above once, so each is in the writer's queue.
            blocker.execute_batch("ROLLBACK").unwrap();
        }
    );
    r1.unwrap();
    assert_eq!(r2.unwrap(), 1);
    assert!(matches!(r3, Err(StoreError::Constraint(_))), "{r3:?}");
    assert_eq!(
        r4.unwrap(),
        1,
        "the failed neighbour's insert was rolled back"
    );
    let after = store.commit_stats();
    assert_eq!(after.requests - before.requests, 4);
    assert!(
        after.transactions - before.transactions <= 2,
        "requests waiting behind the lock share a transaction: {before:?} -> {after:?}"
    );
    let b_msgs = store
        .load_messages(b.id, MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(b_msgs.len(), 1);
    assert_eq!(b_msgs[0].message.text(), "two");
    assert_eq!(
        store
            .get_session(b.id)
            .await
            .unwrap()
            .unwrap()
            .message_count,
        0
    );

    // Alone in its transaction, the failing request is rolled back the same way.
    let err = store.commit_turn(bad).await.unwrap_err();
    assert!(matches!(err, StoreError::Constraint(_)), "{err}");
    assert_eq!(store.last_seq(b.id).await.unwrap(), 1);
}

fn manual(id: CheckpointId) -> NewCheckpoint {
    NewCheckpoint {
        id,
        turn_index: 0,
        source: CheckpointSource::Manual,
    }
}

#[tokio::test]
async fn many_concurrent_writers_all_commit_in_order_per_session() {
    let (_dir, store) = temp_store();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..64 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .append_message(s.id, user(&format!("m{i}")), 10)
                .await
                .unwrap()
        }));
    }
    let mut seqs = Vec::new();
    for t in tasks {
        seqs.push(t.await.unwrap());
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=64).collect::<Vec<i64>>());
    assert_eq!(store.last_seq(s.id).await.unwrap(), 64);
}
