//! Checkpoints: copy-on-write rollback and fork that keep the old
//! branches, the inputs a history counts, content-addressed states, and
//! pruning that keeps what heads and the remaining checkpoints need.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{CheckpointId, Message};

use crate::{CheckpointSource, MessageFilter, NewCheckpoint, NewMessage, PrunePolicy, StoreError};

use super::fixtures::*;
use super::TestDb;

async fn count(db: &TestDb, table: &str) -> i64 {
    db.scalar(&format!("SELECT count(*) FROM {table}")).await
}

pub async fn rollback_and_fork_are_copy_on_write_and_keep_old_branches(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let mut cps = Vec::new();
    for n in 1..=3 {
        let c = store
            .commit_turn(turn(s.id, n, &format!("state{n}"), true))
            .await
            .unwrap();
        cps.push(c.checkpoint.unwrap());
    }
    let messages_before = count(&db, "messages").await;

    // Roll back to turn 1: O(1) rows, history is the prefix, state is turn 1's.
    let rb_id = CheckpointId::new();
    let rb = store.rollback(s.id, cps[0].id, rb_id, 2000).await.unwrap();
    assert_eq!(rb.source, CheckpointSource::Rollback);
    assert_eq!(rb.parent_id, Some(cps[0].id));
    assert_eq!(rb.seq, 2);
    assert_eq!(
        count(&db, "messages").await,
        messages_before,
        "nothing copied"
    );
    assert_eq!(texts(&store, s.id).await, ["q1", "a1"]);
    let rec = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(rec.state_hash, Some(cps[0].state_hash.clone()));

    // New turns continue from seq 3 on the new branch.
    let c = store
        .commit_turn(turn(s.id, 9, "state9", true))
        .await
        .unwrap();
    assert_eq!(c.seqs, [3, 4]);
    assert_eq!(c.checkpoint.as_ref().unwrap().parent_id, Some(rb_id));
    assert_eq!(texts(&store, s.id).await, ["q1", "a1", "q9", "a9"]);

    // The abandoned branch is still listed and restorable.
    let listed = store.list_checkpoints(s.id).await.unwrap();
    assert_eq!(listed.len(), 5);
    let newest = c.checkpoint.unwrap();
    assert_eq!(listed[0].id, newest.id, "newest first");
    assert_eq!(
        store.latest_checkpoint(s.id).await.unwrap().unwrap().id,
        newest.id
    );
    assert_eq!(
        store.get_checkpoint(cps[2].id).await.unwrap().unwrap(),
        cps[2]
    );
    assert!(listed.iter().any(|cp| cp.id == cps[2].id));
    let old: Vec<String> = store
        .load_messages_at_checkpoint(cps[2].id, MessageFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.message.text())
        .collect();
    assert_eq!(old, ["q1", "a1", "q2", "a2", "q3", "a3"]);

    // Fork turn 2 into a new session: no copy, independent future.
    let forked_cp = CheckpointId::new();
    let (fork, fcp) = store
        .fork(cps[1].id, new_session("fork", 3000), forked_cp)
        .await
        .unwrap();
    assert_eq!(fcp.source, CheckpointSource::Fork);
    assert_eq!(fcp.parent_id, Some(cps[1].id));
    assert_eq!(fork.state_hash, Some(cps[1].state_hash.clone()));
    assert_eq!(texts(&store, fork.id).await, ["q1", "a1", "q2", "a2"]);
    let fc = store
        .commit_turn(turn(fork.id, 5, "f", false))
        .await
        .unwrap();
    assert_eq!(fc.seqs, [5, 6]);
    assert_eq!(texts(&store, s.id).await, ["q1", "a1", "q9", "a9"]);
    // Deleting the source session keeps the fork's history.
    store.soft_delete_session(s.id, 4000).await.unwrap();
    assert_eq!(
        texts(&store, fork.id).await,
        ["q1", "a1", "q2", "a2", "q5", "a5"]
    );
    // Rolling back to another session's checkpoint is refused.
    assert!(matches!(
        store
            .rollback(fork.id, cps[0].id, CheckpointId::new(), 5000)
            .await,
        Err(StoreError::InvalidInput(_))
    ));
}

pub async fn a_fork_and_a_rollback_count_the_inputs_of_the_history_they_show(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let mut cps = Vec::new();
    for n in 1..=3 {
        let c = store
            .commit_turn(turn(s.id, n, &format!("state{n}"), true))
            .await
            .unwrap();
        cps.push(c.checkpoint.unwrap());
    }
    // A turn answering a hidden trigger: no visible input.
    let mut hidden = turn(s.id, 4, "state4", true);
    hidden.messages[0] = NewMessage::new(Message::user("trigger").hidden());
    hidden.visible_user_inputs = 0;
    let c = store.commit_turn(hidden).await.unwrap();
    cps.push(c.checkpoint.unwrap());
    let count = |id| {
        let store = store.clone();
        async move { store.get_session(id).await.unwrap().unwrap().message_count }
    };
    assert_eq!(count(s.id).await, 3);

    // A fork shows turns 1-2 (and counts them), or all four turns.
    let (fork, _) = store
        .fork(cps[1].id, new_session("fork", 3000), CheckpointId::new())
        .await
        .unwrap();
    assert_eq!(fork.message_count, 2);
    assert_eq!(count(fork.id).await, 2);
    let (whole, _) = store
        .fork(cps[3].id, new_session("whole", 3001), CheckpointId::new())
        .await
        .unwrap();
    assert_eq!(whole.message_count, 3, "the hidden trigger is not counted");
    // Its own turns add to what it started with.
    store
        .commit_turn(turn(fork.id, 5, "f", true))
        .await
        .unwrap();
    assert_eq!(count(fork.id).await, 3);
    // A fork of the fork counts across both timelines.
    let fork_cp = store.latest_checkpoint(fork.id).await.unwrap().unwrap();
    let (again, _) = store
        .fork(fork_cp.id, new_session("again", 3002), CheckpointId::new())
        .await
        .unwrap();
    assert_eq!(again.message_count, 3);

    // A rollback counts what the history holds again.
    store
        .rollback(s.id, cps[0].id, CheckpointId::new(), 4000)
        .await
        .unwrap();
    assert_eq!(count(s.id).await, 1);
    store
        .commit_turn(turn(s.id, 9, "state9", false))
        .await
        .unwrap();
    assert_eq!(count(s.id).await, 2);
    let report = store
        .check_invariants(crate::CheckOptions::default())
        .await
        .unwrap();
    assert!(report.is_clean(), "{report:#?}");
}

pub async fn unchanged_state_writes_no_blob(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    for n in 1..=5 {
        store
            .commit_turn(turn(s.id, n, "same", true))
            .await
            .unwrap();
    }
    assert_eq!(count(&db, "state_blobs").await, 1);
    store
        .create_checkpoint(
            s.id,
            NewCheckpoint {
                id: CheckpointId::new(),
                turn_index: 5,
                source: CheckpointSource::Manual,
            },
            b"same".to_vec(),
            10,
        )
        .await
        .unwrap();
    assert_eq!(count(&db, "state_blobs").await, 1);
    // A replaced state nobody references is freed by the next prune.
    store
        .commit_turn(turn(s.id, 6, "new", false))
        .await
        .unwrap();
    store
        .commit_turn(turn(s.id, 7, "newer", false))
        .await
        .unwrap();
    assert_eq!(count(&db, "state_blobs").await, 3);
    let report = store
        .prune_checkpoints(
            s.id,
            PrunePolicy {
                keep_latest: Some(100),
                older_than_ms: None,
            },
        )
        .await
        .unwrap();
    assert_eq!((report.checkpoints_deleted, report.blobs_deleted), (0, 1));
    assert_eq!(
        count(&db, "state_blobs").await,
        2,
        "'same' (checkpointed) + 'newer' (live)"
    );
}

pub async fn prune_keeps_what_heads_and_remaining_checkpoints_need(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let mut cps = Vec::new();
    for n in 1..=4 {
        let c = store
            .commit_turn(turn(s.id, n, &format!("s{n}"), true))
            .await
            .unwrap();
        cps.push(c.checkpoint.unwrap());
    }
    // Abandon turns 3-4 by rolling back to turn 2, then add a turn on the new branch.
    store
        .rollback(s.id, cps[1].id, CheckpointId::new(), 2000)
        .await
        .unwrap();
    store.commit_turn(turn(s.id, 5, "s5", true)).await.unwrap();
    assert_eq!(count(&db, "messages").await, 10);

    // Keep the newest turn checkpoint (turn 5): turns 1, 3 and 4 go; the
    // rollback checkpoint and its target (turn 2) are always kept.
    let report = store
        .prune_checkpoints(
            s.id,
            PrunePolicy {
                keep_latest: Some(1),
                older_than_ms: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(report.checkpoints_deleted, 3);
    // The abandoned branch's own messages (turns 3-4) are unreachable now.
    assert_eq!(report.messages_deleted, 4);
    assert_eq!(
        report.timelines_deleted, 0,
        "the root timeline is the head's ancestor"
    );
    assert_eq!(
        texts(&store, s.id).await,
        ["q1", "a1", "q2", "a2", "q5", "a5"]
    );
    let listed = store.list_checkpoints(s.id).await.unwrap();
    let sources: Vec<_> = listed.iter().map(|c| c.source).collect();
    assert_eq!(
        sources,
        [
            CheckpointSource::Turn,
            CheckpointSource::Rollback,
            CheckpointSource::Turn
        ]
    );
    assert_eq!(listed[2].id, cps[1].id, "the rollback target is kept");
    assert_eq!(
        listed[2].parent_id, None,
        "re-parented past the pruned ones"
    );
    assert_eq!(listed[1].parent_id, Some(listed[2].id));
    assert_eq!(listed[0].parent_id, Some(listed[1].id));
    // Blobs of pruned checkpoints are gone unless still referenced.
    assert_eq!(count(&db, "state_blobs").await, 2);

    // Everything older than the future: all that is left is needed.
    let report = store
        .prune_checkpoints(
            s.id,
            PrunePolicy {
                keep_latest: None,
                older_than_ms: Some(i64::MAX),
            },
        )
        .await
        .unwrap();
    assert_eq!(report.checkpoints_deleted, 0);
    let report = store.delete_checkpoints(s.id).await.unwrap();
    assert_eq!(report.checkpoints_deleted, 3);
    assert!(store.list_checkpoints(s.id).await.unwrap().is_empty());
    assert_eq!(
        texts(&store, s.id).await,
        ["q1", "a1", "q2", "a2", "q5", "a5"]
    );
}

pub async fn retention_finds_the_sessions_over_the_limit_and_prunes_past_one_batch(db: TestDb) {
    let store = db.store.clone();
    // More turn checkpoints than one prune transaction handles (256).
    let big = store.create_session(new_session("big", 1)).await.unwrap();
    for n in 1..=260 {
        store
            .commit_turn(turn(big.id, n, &format!("big{n}"), true))
            .await
            .unwrap();
    }
    let small = store.create_session(new_session("small", 1)).await.unwrap();
    for n in 1..=3 {
        store
            .commit_turn(turn(small.id, n, &format!("small{n}"), true))
            .await
            .unwrap();
    }
    // Manual checkpoints are not what retention counts.
    let quiet = store.create_session(new_session("quiet", 1)).await.unwrap();
    store
        .commit_turn(turn(quiet.id, 1, "quiet1", true))
        .await
        .unwrap();
    for n in 2..=4 {
        store
            .create_checkpoint(
                quiet.id,
                NewCheckpoint {
                    id: CheckpointId::new(),
                    turn_index: n,
                    source: CheckpointSource::Manual,
                },
                format!("quiet{n}").into_bytes(),
                2000,
            )
            .await
            .unwrap();
    }

    // In session id order.
    let mut over = vec![big.id, small.id];
    over.sort_by_key(ToString::to_string);
    assert_eq!(store.sessions_over_turn_checkpoints(2).await.unwrap(), over);
    assert_eq!(
        store.sessions_over_turn_checkpoints(3).await.unwrap(),
        [big.id]
    );
    assert!(store
        .sessions_over_turn_checkpoints(260)
        .await
        .unwrap()
        .is_empty());

    let report = store
        .prune_checkpoints(
            big.id,
            PrunePolicy {
                keep_latest: Some(2),
                older_than_ms: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (report.checkpoints_deleted, report.blobs_deleted),
        (258, 258),
        "every batch ran"
    );
    assert_eq!(store.list_checkpoints(big.id).await.unwrap().len(), 2);
    assert_eq!(
        store.sessions_over_turn_checkpoints(2).await.unwrap(),
        [small.id]
    );
    assert_eq!(texts(&store, big.id).await.len(), 520, "the history stays");
    // Space goes back in bounded steps (or, on a backend that reuses it in
    // place, none is reported).
    assert!(store.reclaim_pages(16).await.unwrap() <= 16);

    let report = store.delete_checkpoints(big.id).await.unwrap();
    assert_eq!(report.checkpoints_deleted, 2);
    assert!(store.latest_checkpoint(big.id).await.unwrap().is_none());
}

pub async fn checkpoint_pages_go_newest_first_by_time_then_id_and_give_each_once(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    // Three taken in the same millisecond, their (caller-chosen) ids in
    // the reverse of the order they were written in; two later ones.
    let mut tied: Vec<CheckpointId> = (0..3).map(|_| CheckpointId::new()).collect();
    let written = tied.iter().rev().map(|id| (*id, 100));
    let later = [(CheckpointId::new(), 200), (CheckpointId::new(), 50)];
    for (n, (id, at)) in written.chain(later).enumerate() {
        let cp = NewCheckpoint {
            id,
            turn_index: u64::try_from(n).unwrap(),
            source: CheckpointSource::Manual,
        };
        store
            .create_checkpoint(s.id, cp, format!("s{n}").into_bytes(), at)
            .await
            .unwrap();
    }
    let mut expected: Vec<_> = store
        .list_checkpoints(s.id)
        .await
        .unwrap()
        .into_iter()
        .map(|c| (c.created_at_ms, c.id))
        .collect();
    expected.sort_by(|a, b| b.cmp(a));
    tied.sort_by(|a, b| b.cmp(a));
    assert_eq!(
        expected[1..4].iter().map(|(_, id)| *id).collect::<Vec<_>>(),
        tied,
        "ties in time go by id, newest written or not"
    );

    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = store.checkpoint_page(s.id, cursor, 2).await.unwrap();
        assert!(page.items.len() <= 2);
        seen.extend(page.items.iter().map(|c| (c.created_at_ms, c.id)));
        // One taken while a client pages sorts before its cursor.
        let cp = NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: 9,
            source: CheckpointSource::Manual,
        };
        store
            .create_checkpoint(s.id, cp, b"later".to_vec(), 300)
            .await
            .unwrap();
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, expected);
    for limit in [0, 1001] {
        let err = store.checkpoint_page(s.id, None, limit).await.unwrap_err();
        assert!(matches!(err, StoreError::InvalidInput(_)), "{err}");
    }
}
