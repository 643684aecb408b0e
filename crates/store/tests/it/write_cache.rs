//! The writer's cache of per-session head state (head timeline, last seq):
//! every append must get the seq it would get without the cache, whatever
//! happened in between (rollback, fork, failed requests, retried batches,
//! other connections writing the same file).

use std::time::Duration;

use keel_core::{CheckpointId, Message, SessionId};
use keel_store::{
    CheckpointSource, MessageFilter, NewCheckpoint, NewMessage, Store, StoreError, StoreOptions,
    TurnCommit,
};
use rusqlite::{params, Connection};

use crate::common::*;

fn manual(id: CheckpointId) -> NewCheckpoint {
    NewCheckpoint {
        id,
        turn_index: 0,
        source: CheckpointSource::Manual,
    }
}

fn turn(session_id: SessionId, text: &str, checkpoint: Option<CheckpointId>) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id,
        messages: vec![user(text), assistant(text)],
        state: text.as_bytes().to_vec(),
        checkpoint: checkpoint.map(manual),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 5,
    }
}

/// Seqs of the session's history as loaded (asserted contiguous from 1).
async fn history(store: &Store, s: SessionId) -> Vec<String> {
    let msgs = store
        .load_messages(s, MessageFilter::default())
        .await
        .unwrap();
    let seqs: Vec<i64> = msgs.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, (1..=msgs.len() as i64).collect::<Vec<_>>());
    msgs.iter().map(|m| m.message.text().to_owned()).collect()
}

/// Holds the write lock of the file so that the requests started next pile
/// up in the writer's queue and share one transaction.
fn blocker(dir: &tempfile::TempDir) -> Connection {
    let c = Connection::open(db_path(dir)).unwrap();
    c.execute_batch("BEGIN IMMEDIATE").unwrap();
    c
}

#[tokio::test]
async fn append_after_rollback_and_fork_continues_the_new_head() {
    let (_dir, store) = temp_store();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let cp = CheckpointId::new();
    let t = store.commit_turn(turn(s.id, "a", Some(cp))).await.unwrap();
    assert_eq!(t.seqs, [1, 2]);
    assert_eq!(store.append_message(s.id, user("b"), 6).await.unwrap(), 3);
    assert_eq!(store.append_message(s.id, user("c"), 6).await.unwrap(), 4);

    store
        .rollback(s.id, cp, CheckpointId::new(), 7)
        .await
        .unwrap();
    assert_eq!(store.append_message(s.id, user("d"), 8).await.unwrap(), 3);
    assert_eq!(
        store.commit_turn(turn(s.id, "e", None)).await.unwrap().seqs,
        [4, 5]
    );
    assert_eq!(history(&store, s.id).await, ["a", "a", "d", "e", "e"]);

    let (child, _) = store
        .fork(cp, new_session("fork", 9), CheckpointId::new())
        .await
        .unwrap();
    assert_eq!(
        store.append_message(child.id, user("f"), 9).await.unwrap(),
        3
    );
    assert_eq!(store.append_message(s.id, user("g"), 9).await.unwrap(), 6);
    assert_eq!(history(&store, child.id).await, ["a", "a", "f"]);
    assert_eq!(store.last_seq(s.id).await.unwrap(), 6);
}

#[tokio::test]
async fn rollback_between_appends_of_one_batch() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let cp = CheckpointId::new();
    store.commit_turn(turn(s.id, "a", Some(cp))).await.unwrap();
    store.append_message(s.id, user("b"), 2).await.unwrap();

    let lock = blocker(&dir);
    let before = store.commit_stats();
    let (r1, r2, r3, ()) = tokio::join!(
        biased;
        store.append_message(s.id, user("c"), 3),
        store.rollback(s.id, cp, CheckpointId::new(), 4),
        store.append_message(s.id, user("d"), 5),
        async { lock.execute_batch("ROLLBACK").unwrap() }
    );
    let after = store.commit_stats();
    assert_eq!(r1.unwrap(), 4);
    r2.unwrap();
    assert_eq!(
        r3.unwrap(),
        3,
        "appended after the rollback, on the new head"
    );
    assert!(after.transactions - before.transactions <= 2);
    assert_eq!(history(&store, s.id).await, ["a", "a", "d"]);
    assert_eq!(store.append_message(s.id, user("e"), 6).await.unwrap(), 4);
}

#[tokio::test]
async fn a_failed_request_in_a_batch_leaves_no_seq_behind() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let taken = CheckpointId::new();
    store
        .create_checkpoint(s.id, manual(taken), b"s".to_vec(), 2)
        .await
        .unwrap();
    assert_eq!(store.append_message(s.id, user("a"), 2).await.unwrap(), 1);

    // The bad turn inserts two messages, then fails on its checkpoint id.
    let bad = turn(s.id, "bad", Some(taken));
    let lock = blocker(&dir);
    let (r1, r2, r3, ()) = tokio::join!(
        biased;
        store.append_message(s.id, user("b"), 3),
        store.commit_turn(bad.clone()),
        store.append_message(s.id, user("c"), 4),
        async { lock.execute_batch("ROLLBACK").unwrap() }
    );
    assert_eq!(r1.unwrap(), 2);
    assert!(matches!(r2, Err(StoreError::Constraint(_))), "{r2:?}");
    assert_eq!(r3.unwrap(), 3, "the failed neighbour's seqs were not kept");
    // The next batch continues after what was committed.
    assert_eq!(store.append_message(s.id, user("d"), 5).await.unwrap(), 4);

    // Alone in its transaction (rolled back instead of committed), same thing.
    assert!(store.commit_turn(bad).await.is_err());
    assert_eq!(store.append_message(s.id, user("e"), 6).await.unwrap(), 5);
    assert_eq!(history(&store, s.id).await, ["a", "b", "c", "d", "e"]);
}

#[tokio::test]
async fn a_batch_that_never_committed_leaves_no_seq_behind() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(
        db_path(&dir),
        StoreOptions {
            busy_timeout: Duration::from_millis(5),
            retry_delays: vec![Duration::from_millis(1); 2],
            readers: 1,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    assert_eq!(store.append_message(s.id, user("a"), 2).await.unwrap(), 1);

    // Somebody else holds the lock through every retry: the append fails.
    let lock = blocker(&dir);
    let err = store
        .append_message(s.id, user("lost"), 3)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Busy { .. }), "{err}");
    lock.execute_batch("ROLLBACK").unwrap();

    assert_eq!(store.append_message(s.id, user("b"), 4).await.unwrap(), 2);
    assert_eq!(history(&store, s.id).await, ["a", "b"]);
}

#[tokio::test]
async fn two_handles_on_one_file_append_to_the_same_session() {
    let dir = tempfile::tempdir().unwrap();
    let one = Store::open(db_path(&dir), fast_options()).unwrap();
    let two = Store::open(db_path(&dir), fast_options()).unwrap();
    let s = one.create_session(new_session("d", 1)).await.unwrap();
    let cp = CheckpointId::new();
    one.commit_turn(turn(s.id, "a", Some(cp))).await.unwrap();

    // Each handle's writer has seen this session; they alternate.
    assert_eq!(one.append_message(s.id, user("b"), 2).await.unwrap(), 3);
    assert_eq!(two.append_message(s.id, user("c"), 2).await.unwrap(), 4);
    assert_eq!(one.append_message(s.id, user("d"), 2).await.unwrap(), 5);
    assert_eq!(
        two.commit_turn(turn(s.id, "e", None)).await.unwrap().seqs,
        [6, 7]
    );
    assert_eq!(
        one.commit_turn(turn(s.id, "f", None)).await.unwrap().seqs,
        [8, 9]
    );

    // A rollback by the other handle moves the head under this one's feet.
    two.rollback(s.id, cp, CheckpointId::new(), 3)
        .await
        .unwrap();
    assert_eq!(one.append_message(s.id, user("g"), 4).await.unwrap(), 3);
    assert_eq!(two.append_message(s.id, user("h"), 4).await.unwrap(), 4);
    assert_eq!(history(&one, s.id).await, ["a", "a", "g", "h"]);

    // Concurrent appends from both handles stay contiguous.
    let seqs = append_concurrently(40, |i| {
        let store = if i % 2 == 0 { &one } else { &two };
        (store.clone(), s.id)
    })
    .await;
    assert_eq!(seqs, (5..45).collect::<Vec<i64>>());
    assert_eq!(history(&two, s.id).await.len(), 44);
}

#[tokio::test]
async fn a_foreign_connection_writing_messages_is_noticed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    assert_eq!(store.append_message(s.id, user("a"), 2).await.unwrap(), 1);

    // Another process appends a row behind the store's back.
    let other = Connection::open(db_path(&dir)).unwrap();
    let head = store
        .get_session(s.id)
        .await
        .unwrap()
        .unwrap()
        .head_timeline_id;
    let content = serde_json::to_string(&Message::user("foreign")).unwrap();
    other
        .execute(
            "INSERT INTO messages (timeline_id, seq, session_id, slot, role, content, created_at) \
             VALUES (?1, 2, ?2, 'default', 'user', ?3, 3)",
            params![head.as_str(), s.id.to_string(), content],
        )
        .unwrap();

    assert_eq!(store.append_message(s.id, user("b"), 4).await.unwrap(), 3);
    assert_eq!(
        store
            .append_messages(
                s.id,
                vec![NewMessage::new(Message::user("c")), user("d")],
                5
            )
            .await
            .unwrap(),
        [4, 5]
    );
    assert_eq!(history(&store, s.id).await, ["a", "foreign", "b", "c", "d"]);
}

#[tokio::test]
async fn appends_to_an_unknown_session_fail_without_poisoning_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let ghost = SessionId::new();
    let lock = blocker(&dir);
    let (r1, r2, r3, ()) = tokio::join!(
        biased;
        store.append_message(s.id, user("a"), 2),
        store.append_message(ghost, user("x"), 2),
        store.append_message(s.id, user("b"), 2),
        async { lock.execute_batch("ROLLBACK").unwrap() }
    );
    assert_eq!(r1.unwrap(), 1);
    assert!(matches!(r2, Err(StoreError::NotFound(_))), "{r2:?}");
    assert_eq!(r3.unwrap(), 2);
    assert!(matches!(
        store.append_message(ghost, user("y"), 3).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(store.append_message(s.id, user("c"), 3).await.unwrap(), 3);
}
