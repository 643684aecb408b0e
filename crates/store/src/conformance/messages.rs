//! Messages: turn commits and their seqs, replay against visible loads,
//! slots, reading what followed a known head, durable turn inputs (open,
//! answered, unanswered) and queued input.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{CheckpointId, Message, SessionId, TurnOrigin};

use crate::{
    CheckpointSource, InputState, MessageFilter, NewCheckpoint, NewMessage, OpenTurn, Store,
    StoreError, TurnCommit,
};

use super::fixtures::*;
use super::TestDb;

fn query_of_chat() -> crate::DialogQuery {
    crate::DialogQuery {
        channel: "cli_chat".into(),
        chat_id: "chat-1".into(),
        include_deleted: false,
        limit: 10,
        cursor: None,
    }
}

async fn states(store: &Store, session: SessionId) -> Vec<(String, Option<InputState>)> {
    store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|m| (m.message.text(), m.input_state))
        .collect()
}

fn open(session: SessionId, text: &str) -> OpenTurn {
    OpenTurn {
        session_id: session,
        messages: vec![user(text)],
        expected_head: None,
        queued: None,
        now_ms: 2000,
    }
}

fn answer(session: SessionId, seqs: Vec<i64>, text: &str) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![assistant(text)],
        state: b"{}".to_vec(),
        checkpoint: Some(NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: 1,
            source: CheckpointSource::Turn,
        }),
        visible_user_inputs: 0,
        answers: seqs,
        expected_head: None,
        now_ms: 2001,
    }
}

pub async fn commit_turn_assigns_seqs_and_counts_visible_inputs(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let c1 = store
        .commit_turn(turn(s.id, 1, "{\"t\":1}", true))
        .await
        .unwrap();
    assert_eq!(c1.seqs, [1, 2]);
    let cp = c1.checkpoint.unwrap();
    assert_eq!((cp.seq, cp.turn_index, cp.parent_id), (2, 1, None));
    let c2 = store
        .commit_turn(turn(s.id, 2, "{\"t\":2}", true))
        .await
        .unwrap();
    assert_eq!(c2.seqs, [3, 4]);
    assert_eq!(c2.checkpoint.unwrap().parent_id, Some(cp.id));
    let rec = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(rec.message_count, 2);
    assert_eq!(rec.last_active_at_ms, 1002);
    assert_eq!(rec.state_hash.as_deref(), Some(c2.state_hash.as_str()));
    assert_eq!(
        store.get_state_blob(c2.state_hash).await.unwrap().unwrap(),
        b"{\"t\":2}"
    );
    assert_eq!(store.last_seq(s.id).await.unwrap(), 4);
    // Single appends continue the sequence.
    assert_eq!(
        store.append_message(s.id, user("x"), 2000).await.unwrap(),
        5
    );
    assert!(matches!(
        store.append_message(SessionId::new(), user("x"), 1).await,
        Err(StoreError::NotFound(_))
    ));
}

pub async fn replay_sees_hidden_messages_clients_do_not(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let trigger = Message::user("[background results]")
        .hidden()
        .with_origin(TurnOrigin::AgentContinuation);
    let msgs = vec![
        user("hi"),
        NewMessage::new(trigger),
        NewMessage::new(Message::assistant("done").with_origin(TurnOrigin::AgentContinuation)),
        NewMessage::in_slot("research", Message::assistant("slot note")),
    ];
    store.append_messages(s.id, msgs, 5).await.unwrap();
    let replay = store
        .load_messages(s.id, MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(replay.len(), 4);
    assert_eq!(replay[1].message.origin, TurnOrigin::AgentContinuation);
    let visible = store
        .load_messages(
            s.id,
            MessageFilter {
                visible_only: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(visible.iter().map(|m| m.seq).collect::<Vec<_>>(), [1, 3, 4]);
    let from = store
        .load_messages(
            s.id,
            MessageFilter {
                from_seq: Some(3),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(from.iter().map(|m| m.seq).collect::<Vec<_>>(), [3, 4]);
    let slot = store
        .load_messages(
            s.id,
            MessageFilter {
                slot: Some("research".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(slot.len(), 1);
    assert_eq!(slot[0].slot, "research");
    assert_eq!(slot[0].seq, 4);
}

pub async fn history_after_a_known_head_reads_only_what_follows_it_on_that_timeline(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let first = store.commit_turn(turn(s.id, 1, "s1", true)).await.unwrap();
    let all = |known| store.history_after(s.id, known, MessageFilter::default());
    let whole = all(None).await.unwrap();
    assert!(whole.whole);
    assert_eq!((whole.messages.len(), whole.head.last_seq), (2, 2));
    store.commit_turn(turn(s.id, 2, "s2", false)).await.unwrap();
    let delta = all(Some(whole.head.clone())).await.unwrap();
    assert!(!delta.whole);
    let seqs: Vec<i64> = delta.messages.iter().map(|m| m.seq).collect();
    assert_eq!((seqs, delta.head.last_seq), (vec![3, 4], 4));
    // After a rollback and a turn the history is as long as before, but
    // not the one the old head ended: it is read whole.
    store
        .rollback(
            s.id,
            first.checkpoint.unwrap().id,
            CheckpointId::new(),
            2000,
        )
        .await
        .unwrap();
    store.commit_turn(turn(s.id, 3, "s3", false)).await.unwrap();
    let again = all(Some(delta.head)).await.unwrap();
    assert!(again.whole);
    let texts: Vec<String> = again.messages.iter().map(|m| m.message.text()).collect();
    assert_eq!(texts, ["q1", "a1", "q3", "a3"]);
}

pub async fn a_chats_dialogs_are_read_with_what_each_gained_since_a_known_head(db: TestDb) {
    let store = db.store.clone();
    let a = store.create_session(new_session("a", 1)).await.unwrap();
    let b = store.create_session(new_session("b", 2)).await.unwrap();
    let c = store.create_session(new_session("c", 3)).await.unwrap();
    for s in [a.id, b.id, c.id] {
        store.commit_turn(turn(s, 1, "s1", false)).await.unwrap();
    }
    let known = store
        .history_after(a.id, None, MessageFilter::default())
        .await
        .unwrap()
        .head;
    store.commit_turn(turn(a.id, 2, "s2", false)).await.unwrap();
    store.soft_delete_session(c.id, 10).await.unwrap();
    let read = store
        .dialogs_with_history_after(
            query_of_chat(),
            Box::new(|_| true),
            std::collections::HashMap::from([(a.id, known)]),
            MessageFilter::default(),
        )
        .await
        .unwrap();
    let seen: Vec<_> = read
        .iter()
        .map(|(r, d)| {
            (
                r.dialog_id.as_str(),
                d.whole,
                d.messages.len(),
                d.head.last_seq,
            )
        })
        .collect();
    // Newest first; the deleted one left out; a from its known head on.
    assert_eq!(seen, [("b", true, 2, 2), ("a", false, 2, 4)]);
    let only_a = store
        .dialogs_with_history_after(
            query_of_chat(),
            Box::new(|r| r.dialog_id == "a"),
            std::collections::HashMap::new(),
            MessageFilter::default(),
        )
        .await
        .unwrap();
    assert_eq!(only_a.len(), 1);
    assert!(only_a[0].1.whole);
}

/// A turn's input commits on its own (visible, counted, `open`), and the
/// turn's commit appends after it and marks it answered.
pub async fn a_turn_input_commits_first_and_its_answer_closes_it(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let seqs = store.open_turn(open(s.id, "hi")).await.unwrap();
    assert_eq!(seqs, [1]);
    assert_eq!(
        states(&store, s.id).await,
        [("hi".into(), Some(InputState::Open))]
    );
    let record = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!((record.message_count, record.last_active_at_ms), (1, 2000));
    let committed = store
        .commit_turn(answer(s.id, seqs, "hello"))
        .await
        .unwrap();
    assert_eq!(committed.seqs, [2]);
    assert_eq!(
        committed.checkpoint.unwrap().seq,
        2,
        "the checkpoint sees the whole turn"
    );
    assert_eq!(
        states(&store, s.id).await,
        [
            ("hi".into(), Some(InputState::Answered)),
            ("hello".into(), None)
        ]
    );
    let record = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(record.message_count, 1, "the input is counted once");
}

/// A failed turn's input is marked unanswered; one the turn left open (a
/// dropped turn) is closed by the session's next input; an input that is
/// not open can never be answered after the fact, and that commit changes
/// nothing.
pub async fn unanswered_inputs_stay_and_are_never_answered_later(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let first = store.open_turn(open(s.id, "one")).await.unwrap();
    assert_eq!(store.mark_unanswered(s.id, first.clone()).await.unwrap(), 1);
    assert_eq!(
        store.mark_unanswered(s.id, first.clone()).await.unwrap(),
        0,
        "already closed"
    );
    store.open_turn(open(s.id, "two")).await.unwrap();
    let third = store.open_turn(open(s.id, "three")).await.unwrap();
    assert_eq!(
        states(&store, s.id).await,
        [
            ("one".into(), Some(InputState::Unanswered)),
            ("two".into(), Some(InputState::Unanswered)),
            ("three".into(), Some(InputState::Open)),
        ]
    );
    let err = store
        .commit_turn(answer(s.id, first, "late"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Stale(_)), "{err}");
    assert_eq!(
        texts(&store, s.id).await,
        ["one", "two", "three"],
        "nothing appended"
    );
    assert!(store.list_checkpoints(s.id).await.unwrap().is_empty());
    store.commit_turn(answer(s.id, third, "ok")).await.unwrap();
    let record = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(record.message_count, 3);
}

/// An input commit checks the head like a turn commit: a history that moved
/// since the writer read it refuses the input.
pub async fn an_input_commit_checks_the_head_it_started_from(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    store
        .append_message(s.id, user("elsewhere"), 5)
        .await
        .unwrap();
    let mut stale = open(s.id, "late");
    stale.expected_head = Some(crate::SessionHead {
        timeline: s.head_timeline_id.clone(),
        last_seq: 0,
    });
    let err = store.open_turn(stale).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err}");
    assert_eq!(texts(&store, s.id).await, ["elsewhere"]);
}

/// Rows are shared by timelines: a checkpoint ends with an answered turn,
/// a rollback to it drops the unanswered input after it from the current
/// branch, and a fork from it opens and closes inputs on its own.
pub async fn rollback_and_fork_never_show_a_half_turn(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let seqs = store.open_turn(open(s.id, "q1")).await.unwrap();
    let cp = store
        .commit_turn(answer(s.id, seqs, "a1"))
        .await
        .unwrap()
        .checkpoint
        .unwrap();
    let failed = store.open_turn(open(s.id, "q2")).await.unwrap();
    store.mark_unanswered(s.id, failed).await.unwrap();
    store
        .rollback(s.id, cp.id, CheckpointId::new(), 3000)
        .await
        .unwrap();
    assert_eq!(
        states(&store, s.id).await,
        [
            ("q1".into(), Some(InputState::Answered)),
            ("a1".into(), None)
        ]
    );
    // The abandoned branch keeps its unanswered input.
    let old = store
        .load_messages_at_checkpoint(cp.id, MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(old.len(), 2, "the checkpoint ends with its turn");
    // A fork at the checkpoint starts from the answered turn, and its own
    // inputs open and close on its own timeline.
    let (fork, _) = store
        .fork(cp.id, new_session("fork", 4000), CheckpointId::new())
        .await
        .unwrap();
    let seqs = store.open_turn(open(fork.id, "q3")).await.unwrap();
    store.mark_unanswered(fork.id, seqs).await.unwrap();
    assert_eq!(
        states(&store, fork.id).await,
        [
            ("q1".into(), Some(InputState::Answered)),
            ("a1".into(), None),
            ("q3".into(), Some(InputState::Unanswered)),
        ]
    );
    assert_eq!(
        states(&store, s.id).await.len(),
        2,
        "the source is untouched"
    );
}

/// A queued input is durable but no history until its turn opens: opening
/// takes it off the queue in the same transaction, at the head (after what
/// committed meanwhile), and only once.
pub async fn a_queued_input_enters_the_history_when_its_turn_opens_and_only_then(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("q", 1)).await.unwrap();
    let other = store.create_session(new_session("gone", 1)).await.unwrap();
    let queued = |session, text: &str| crate::QueuedInput {
        session_id: session,
        turn_id: keel_core::TurnId::new(),
        message: Message::user(text),
        queued_at_ms: 5,
        webhook: None,
    };
    let first = queued(s.id, "sent while a turn ran");
    let second = queued(s.id, "and another");
    let elsewhere = queued(other.id, "to a dialog deleted later");
    for q in [&first, &second, &elsewhere] {
        store.queue_input(q.clone()).await.unwrap();
    }
    assert_eq!(
        store.queued_inputs().await.unwrap(),
        [first.clone(), second.clone(), elsewhere.clone()]
    );
    assert!(texts(&store, s.id).await.is_empty(), "no history yet");
    store.commit_turn(turn(s.id, 1, "{}", false)).await.unwrap();
    let opened = OpenTurn {
        messages: vec![user("sent while a turn ran")],
        queued: Some(first.turn_id),
        ..open(s.id, "")
    };
    store.open_turn(opened.clone()).await.unwrap();
    assert_eq!(
        texts(&store, s.id).await,
        ["q1", "a1", "sent while a turn ran"]
    );
    // Taken once: a second open of the same queued input commits nothing.
    let err = store.open_turn(opened).await.unwrap_err();
    assert!(matches!(err, StoreError::Stale(_)), "{err}");
    assert_eq!(texts(&store, s.id).await.len(), 3);
    // Withdrawn, and a deleted dialog's inputs are not listed.
    assert!(store.discard_queued_input(second.turn_id).await.unwrap());
    assert!(!store.discard_queued_input(second.turn_id).await.unwrap());
    store.soft_delete_session(other.id, 9).await.unwrap();
    assert!(store.queued_inputs().await.unwrap().is_empty());
    let err = store
        .queue_input(queued(other.id, "late"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err}");
}

/// Appends racing on the same sessions each get their own seq: none is
/// lost, none reused, every session's history has no gap.
pub async fn concurrent_appends_get_consecutive_seqs_per_session(db: TestDb) {
    let store = db.store.clone();
    let sessions = [
        store.create_session(new_session("a", 1)).await.unwrap().id,
        store.create_session(new_session("b", 1)).await.unwrap().id,
    ];
    let seqs = append_concurrently(64, |i| (store.clone(), sessions[i % 2])).await;
    let expected: Vec<i64> = (1..=32).flat_map(|s| [s, s]).collect();
    assert_eq!(seqs, expected);
    for s in sessions {
        assert_eq!(store.last_seq(s).await.unwrap(), 32);
        let seqs: Vec<i64> = store
            .load_messages(s, MessageFilter::default())
            .await
            .unwrap()
            .iter()
            .map(|m| m.seq)
            .collect();
        assert_eq!(seqs, (1..=32).collect::<Vec<_>>());
    }
}
