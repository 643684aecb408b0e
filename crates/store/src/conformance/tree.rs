//! A dialog's whole history tree: read for an export with every branch a
//! rollback left, the history a fork inherited and each checkpoint's state;
//! imported back as a new dialog that reads the same, or refused whole.
#![allow(missing_docs)] // a test's name is its documentation

use std::collections::HashMap;

use keel_core::{CheckpointId, SessionId};

use super::fixtures::*;
use super::TestDb;
use crate::{
    CheckpointSource, DialogTree, ImportCheckpoint, ImportTimeline, ImportTree, MessageFilter,
    NewCheckpoint, NewMessage, Store, StoreError, TurnCommit,
};

fn turn(session: SessionId, n: u64) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![user(&format!("q{n}")), assistant(&format!("a{n}"))],
        state: format!("state{n}").into_bytes(),
        checkpoint: Some(NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: n,
            source: CheckpointSource::Turn,
        }),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 1000 + i64::try_from(n).unwrap(),
    }
}

/// (seq, text) of each message.
fn numbered(messages: &[crate::StoredMessage]) -> Vec<(i64, String)> {
    messages.iter().map(|m| (m.seq, m.message.text())).collect()
}

async fn texts(store: &Store, session: SessionId) -> Vec<String> {
    store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.message.text())
        .collect()
}

async fn live_state(store: &Store, session: SessionId) -> Option<Vec<u8>> {
    let hash = store
        .get_session(session)
        .await
        .unwrap()
        .unwrap()
        .state_hash?;
    store.get_state_blob(hash).await.unwrap()
}

/// The import an export of `tree` becomes: the same keys, new checkpoint ids.
fn import_of(tree: &DialogTree, state: Vec<u8>) -> ImportTree {
    let new_ids: HashMap<CheckpointId, CheckpointId> = tree
        .checkpoints
        .iter()
        .map(|(c, _)| (c.id, CheckpointId::new()))
        .collect();
    ImportTree {
        timelines: tree
            .timelines
            .iter()
            .map(|t| ImportTimeline {
                key: t.id.clone(),
                parent: t.parent.clone(),
                fork_seq: t.fork_seq,
                messages: t
                    .messages
                    .iter()
                    .map(|m| {
                        let mut new = NewMessage::in_slot(&m.slot, m.message.clone());
                        new.input_state = m.input_state;
                        (m.seq, new)
                    })
                    .collect(),
            })
            .collect(),
        checkpoints: tree
            .checkpoints
            .iter()
            .map(|(c, bytes)| ImportCheckpoint {
                id: new_ids[&c.id],
                parent: c.parent_id.and_then(|p| new_ids.get(&p).copied()),
                timeline: c.timeline_id.as_str().to_owned(),
                seq: c.seq,
                turn_index: c.turn_index,
                source: c.source,
                state: bytes.clone(),
                created_at_ms: c.created_at_ms,
            })
            .collect(),
        head: tree.head.clone(),
        state,
    }
}

/// The tree without its ids: each timeline as (parent's index, fork seq,
/// messages), each checkpoint as (timeline's index, seq, parent's index,
/// turn index, source, state, time), the head's index.
#[allow(clippy::type_complexity)]
fn shape(
    tree: &DialogTree,
) -> (
    Vec<(Option<usize>, Option<i64>, Vec<(i64, String)>)>,
    Vec<(
        usize,
        i64,
        Option<usize>,
        u64,
        CheckpointSource,
        Vec<u8>,
        i64,
    )>,
    usize,
) {
    let timeline = |id: &str| tree.timelines.iter().position(|t| t.id == id).unwrap();
    let checkpoint = |id: CheckpointId| tree.checkpoints.iter().position(|(c, _)| c.id == id);
    (
        tree.timelines
            .iter()
            .map(|t| {
                (
                    t.parent.as_deref().map(timeline),
                    t.fork_seq,
                    numbered(&t.messages),
                )
            })
            .collect(),
        tree.checkpoints
            .iter()
            .map(|(c, state)| {
                (
                    timeline(c.timeline_id.as_str()),
                    c.seq,
                    c.parent_id.and_then(checkpoint),
                    c.turn_index,
                    c.source,
                    state.clone(),
                    c.created_at_ms,
                )
            })
            .collect(),
        timeline(&tree.head),
    )
}

pub async fn a_dialogs_tree_holds_every_branch_and_imports_as_a_dialog_that_reads_the_same(
    db: TestDb,
) {
    let store = db.store.clone();
    let s = store
        .create_session(new_session("source", 1))
        .await
        .unwrap();
    let mut cps = Vec::new();
    for n in 1..=3 {
        let c = store.commit_turn(turn(s.id, n)).await.unwrap();
        cps.push(c.checkpoint.unwrap());
    }
    // Back to turn 1, and on from there: turns 2-3 stay on the old branch.
    store
        .rollback(s.id, cps[0].id, CheckpointId::new(), 2000)
        .await
        .unwrap();
    store.commit_turn(turn(s.id, 9)).await.unwrap();

    let tree = store.dialog_tree(s.id).await.unwrap();
    let record = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(tree.head, record.head_timeline_id.as_str());
    assert_eq!(tree.timelines.len(), 2, "the first one and the rollback's");
    let (first, branch) = (&tree.timelines[0], &tree.timelines[1]);
    assert_eq!((first.parent.as_deref(), first.fork_seq), (None, None));
    assert_eq!(
        numbered(&first.messages),
        (1..)
            .zip(["q1", "a1", "q2", "a2", "q3", "a3"].map(String::from))
            .collect::<Vec<_>>()
    );
    assert_eq!(branch.id, tree.head);
    assert_eq!(
        (branch.parent.as_deref(), branch.fork_seq),
        (Some(first.id.as_str()), Some(2))
    );
    assert_eq!(
        numbered(&branch.messages),
        [(3, "q9".to_owned()), (4, "a9".to_owned())],
        "a branch holds only what it added"
    );
    let sources: Vec<_> = tree.checkpoints.iter().map(|(c, _)| c.source).collect();
    assert_eq!(
        sources,
        [
            CheckpointSource::Turn,
            CheckpointSource::Turn,
            CheckpointSource::Turn,
            CheckpointSource::Rollback,
            CheckpointSource::Turn,
        ],
        "oldest first"
    );
    let states: Vec<_> = tree.checkpoints.iter().map(|(_, b)| b.clone()).collect();
    assert_eq!(
        states,
        ["state1", "state2", "state3", "state1", "state9"].map(|s| s.as_bytes().to_vec())
    );

    // Imported as a new dialog: the same tree under new ids.
    let state = live_state(&store, s.id).await.unwrap();
    let copy = store
        .import_session_tree(
            new_session("copy", 50),
            import_of(&tree, state.clone()),
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(copy.message_count, record.message_count);
    assert_eq!(texts(&store, copy.id).await, ["q1", "a1", "q9", "a9"]);
    assert_eq!(live_state(&store, copy.id).await, Some(state));
    let copied = store.dialog_tree(copy.id).await.unwrap();
    assert_eq!(shape(&copied), shape(&tree));
    assert!(copied
        .timelines
        .iter()
        .all(|t| !tree.timelines.iter().any(|o| o.id == t.id)));
    assert_eq!(
        store.latest_checkpoint(copy.id).await.unwrap().unwrap().id,
        copied.checkpoints[4].0.id
    );

    // The copy's old branch is live history: a rollback there shows it.
    let old_turn3 = copied.checkpoints[2].0.id;
    store
        .rollback(copy.id, old_turn3, CheckpointId::new(), 3000)
        .await
        .unwrap();
    assert_eq!(
        texts(&store, copy.id).await,
        ["q1", "a1", "q2", "a2", "q3", "a3"]
    );
    assert_eq!(
        texts(&store, s.id).await,
        ["q1", "a1", "q9", "a9"],
        "the source is untouched"
    );
}

pub async fn a_forks_tree_starts_with_the_history_it_inherited(db: TestDb) {
    let store = db.store.clone();
    let s = store
        .create_session(new_session("source", 1))
        .await
        .unwrap();
    let mut cps = Vec::new();
    for n in 1..=3 {
        let c = store.commit_turn(turn(s.id, n)).await.unwrap();
        cps.push(c.checkpoint.unwrap());
    }
    let (fork, _) = store
        .fork(cps[1].id, new_session("fork", 2), CheckpointId::new())
        .await
        .unwrap();
    store.commit_turn(turn(fork.id, 7)).await.unwrap();

    let tree = store.dialog_tree(fork.id).await.unwrap();
    assert_eq!(tree.timelines.len(), 1);
    let only = &tree.timelines[0];
    assert_eq!(
        (only.parent.as_deref(), only.fork_seq),
        (None, None),
        "its parent is another dialog's"
    );
    assert_eq!(
        numbered(&only.messages)
            .into_iter()
            .map(|(_, t)| t)
            .collect::<Vec<_>>(),
        ["q1", "a1", "q2", "a2", "q7", "a7"]
    );
    assert_eq!(tree.head, only.id);
    let sources: Vec<_> = tree.checkpoints.iter().map(|(c, _)| c.source).collect();
    assert_eq!(sources, [CheckpointSource::Fork, CheckpointSource::Turn]);
    assert_eq!(
        tree.checkpoints[0].0.parent_id,
        Some(cps[1].id),
        "the fork's checkpoint names its source"
    );
    let missing = store.dialog_tree(SessionId::new()).await.unwrap_err();
    assert!(matches!(missing, StoreError::NotFound(_)), "{missing}");
}

pub async fn an_import_that_does_not_fit_together_is_refused_whole(db: TestDb) {
    let store = db.store.clone();
    let s = store
        .create_session(new_session("source", 1))
        .await
        .unwrap();
    let first = store.commit_turn(turn(s.id, 1)).await.unwrap();
    store.commit_turn(turn(s.id, 2)).await.unwrap();
    store
        .rollback(
            s.id,
            first.checkpoint.unwrap().id,
            CheckpointId::new(),
            2000,
        )
        .await
        .unwrap();
    store.commit_turn(turn(s.id, 3)).await.unwrap();
    let tree = store.dialog_tree(s.id).await.unwrap();
    let good = import_of(&tree, b"live".to_vec());

    let mut past_the_end = good.clone();
    past_the_end.checkpoints[1].seq = 99;
    let mut gap = good.clone();
    gap.timelines[1].messages[1].0 += 1;
    let mut orphan = good.clone();
    orphan.timelines[1].parent = Some("nowhere".into());
    let mut no_head = good.clone();
    no_head.head = "nowhere".into();
    let mut two_roots = good.clone();
    two_roots.timelines[1].parent = None;
    let mut twice = good.clone();
    twice.timelines[1].key = twice.timelines[0].key.clone();
    let session = new_session("copy", 50);
    for (what, bad) in [
        ("a checkpoint past its timeline's end", past_the_end),
        ("messages that skip a seq", gap),
        ("a timeline after an unknown one", orphan),
        ("a head that is no timeline", no_head),
        ("two timelines without a parent", two_roots),
        ("two timelines of one key", twice),
    ] {
        let err = store
            .import_session_tree(session.clone(), bad, Vec::new())
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::InvalidInput(_)), "{what}: {err}");
        assert!(
            store.get_session(session.id).await.unwrap().is_none(),
            "{what}: nothing written"
        );
    }
    // The same dialog imports once the file fits together.
    let copy = store
        .import_session_tree(session, good, Vec::new())
        .await
        .unwrap();
    assert_eq!(texts(&store, copy.id).await, ["q1", "a1", "q3", "a3"]);
}
