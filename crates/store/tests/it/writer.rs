//! The write path: transient failures retried then surfaced as a typed
//! error, group commit with per-request savepoints, reads during writes.

use std::time::Duration;

use keel_core::{CheckpointId, Message};
use keel_store::{
    CheckpointSource, MessageFilter, NewCheckpoint, NewMessage, Store, StoreError, StoreOptions,
    Synchronous, TurnCommit,
};
use rusqlite::Connection;

use crate::common::*;

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
        calls: None,
        session_id: b.id,
        messages: vec![NewMessage::new(Message::user("written, then undone"))],
        state: b"s2".to_vec(),
        checkpoint: Some(manual(taken)),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_writers_all_commit_in_order_per_session() {
    for synchronous in [Synchronous::Normal, Synchronous::Full] {
        let (_dir, store) = temp_store_with(StoreOptions {
            synchronous,
            ..fast_options()
        });
        let sessions = [
            store.create_session(new_session("a", 1)).await.unwrap().id,
            store.create_session(new_session("b", 1)).await.unwrap().id,
        ];
        let seqs = append_concurrently(64, |i| (store.clone(), sessions[i % 2])).await;
        let expected: Vec<i64> = (1..=32).flat_map(|s| [s, s]).collect();
        assert_eq!(seqs, expected, "{synchronous:?}");
        for s in sessions {
            assert_eq!(store.last_seq(s).await.unwrap(), 32);
            let texts: Vec<String> = store
                .load_messages(s, MessageFilter::default())
                .await
                .unwrap()
                .iter()
                .map(|m| m.message.text())
                .collect();
            assert_eq!(texts.len(), 32, "{synchronous:?}");
        }
    }
}

#[tokio::test]
async fn an_uncontended_write_commits_on_the_callers_thread_only_with_normal() {
    for (synchronous, on_caller) in [(Synchronous::Normal, 3), (Synchronous::Full, 0)] {
        let (_dir, store) = temp_store_with(StoreOptions {
            synchronous,
            ..fast_options()
        });
        let before = store.commit_stats();
        let s = store.create_session(new_session("d", 1)).await.unwrap();
        store.append_message(s.id, user("one"), 2).await.unwrap();
        store.touch_session(s.id, 3).await.unwrap();
        let after = store.commit_stats();
        assert_eq!(after.requests - before.requests, 3);
        assert_eq!(after.transactions - before.transactions, 3);
        // FULL commits wait for an fsync: never on an async runtime's thread.
        assert_eq!(
            after.on_caller - before.on_caller,
            on_caller,
            "{synchronous:?}"
        );
    }
}

/// A write that meets another connection's lock does not wait for it on the
/// caller's thread (which may be an async runtime's only thread): it moves to
/// the writer thread, which waits and commits once the lock is gone.
#[tokio::test]
async fn a_lock_held_elsewhere_never_blocks_the_callers_thread() {
    let dir = tempfile::tempdir().unwrap();
    let busy_timeout = Duration::from_secs(30);
    let store = Store::open(
        db_path(&dir),
        StoreOptions {
            busy_timeout,
            ..fast_options()
        },
    )
    .unwrap();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let blocker = Connection::open(db_path(&dir)).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();

    let before = store.commit_stats();
    let start = std::time::Instant::now();
    // This runtime has one thread: the rollback below can only run if the
    // write did not block it.
    let (seq, ()) = tokio::join!(biased; store.append_message(s.id, user("late"), 2), async {
        blocker.execute_batch("ROLLBACK").unwrap();
    });
    assert_eq!(seq.unwrap(), 1);
    assert!(
        start.elapsed() < busy_timeout / 2,
        "the caller waited on the lock: {:?}",
        start.elapsed()
    );
    let after = store.commit_stats();
    assert_eq!(
        after.on_caller, before.on_caller,
        "committed by the writer thread"
    );
}
