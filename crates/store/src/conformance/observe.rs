//! The operator's reads: the inbox gauges `/metrics` reports, the run
//! trees of traces (a run and everything below it; every run of a turn),
//! and the call spans committed with a turn or a run.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{ExecutionMode, RunId, SessionId, TurnId};

use crate::{
    AcceptRun, CallKind, CompletionHandling, InboxGauges, NewRun, TerminalOutcome, TurnCalls,
    TurnCommit, MAX_CALL_SPANS,
};

use super::fixtures::*;
use super::TestDb;

fn accept(run: NewRun, now_ms: i64) -> AcceptRun {
    AcceptRun {
        run,
        inbox_capacity: 4,
        now_ms,
    }
}

fn of_turn(root: SessionId, turn: TurnId, parent: Option<&NewRun>, mode: ExecutionMode) -> NewRun {
    let mut run = new_run(root, mode);
    run.root_turn_id = Some(turn);
    if let Some(p) = parent {
        run.parent_run_id = Some(p.id);
        run.depth = p.depth + 1;
    }
    run
}

fn call(kind: CallKind, name: &str, at: i64) -> crate::CallSpan {
    crate::CallSpan {
        kind,
        name: name.into(),
        call_id: (kind == CallKind::Tool).then(|| format!("call-{at}")),
        started_at_ms: at,
        ended_at_ms: at + 5,
        input_tokens: (kind == CallKind::Model).then_some(7),
        output_tokens: (kind == CallKind::Model).then_some(3),
        status: "ok".into(),
    }
}

fn turn_with(root: SessionId, turn: TurnId, spans: Vec<crate::CallSpan>) -> TurnCommit {
    TurnCommit {
        session_id: root,
        messages: vec![user("hi")],
        state: b"s".to_vec(),
        checkpoint: None,
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 10,
        calls: Some(TurnCalls {
            turn_id: turn,
            spans,
        }),
    }
}

pub async fn a_run_tree_holds_the_run_and_its_descendants_and_a_turn_every_run_it_started(
    db: TestDb,
) {
    let store = db.store.clone();
    let root = SessionId::new();
    let turn = TurnId::new();
    let a = of_turn(root, turn, None, ExecutionMode::Foreground);
    let b = of_turn(root, turn, Some(&a), ExecutionMode::Foreground);
    let c = of_turn(root, turn, None, ExecutionMode::Foreground);
    let elsewhere = of_turn(root, TurnId::new(), None, ExecutionMode::Foreground);
    for (i, run) in [&a, &b, &c, &elsewhere].into_iter().enumerate() {
        store
            .accept_run(accept(run.clone(), 100 + i as i64))
            .await
            .unwrap();
    }
    let ids =
        |runs: Vec<crate::RunRecord>| -> Vec<RunId> { runs.iter().map(|r| r.spec.id).collect() };
    assert_eq!(ids(store.run_tree(a.id).await.unwrap()), [a.id, b.id]);
    assert_eq!(ids(store.run_tree(b.id).await.unwrap()), [b.id]);
    assert!(store.run_tree(RunId::new()).await.unwrap().is_empty());
    let of_dialog = ids(store.turn_runs(Some(root), turn).await.unwrap());
    assert_eq!(of_dialog, [a.id, b.id, c.id]);
    assert_eq!(ids(store.turn_runs(None, turn).await.unwrap()), of_dialog);
    // Another dialog's turn of the same id has none of them.
    assert!(store
        .turn_runs(Some(SessionId::new()), turn)
        .await
        .unwrap()
        .is_empty());
}

pub async fn the_inbox_gauges_count_waiting_and_dead_lettered_events(db: TestDb) {
    let store = db.store.clone();
    assert_eq!(store.inbox_gauges().await.unwrap(), InboxGauges::default());
    let root = SessionId::new();
    let mut ends = Vec::new();
    for at in [200, 300] {
        let run = new_run(root, ExecutionMode::Background);
        store
            .accept_run(accept(run.clone(), at - 50))
            .await
            .unwrap();
        let end = store
            .commit_terminal(
                run.id,
                run.execution_id.clone(),
                TerminalOutcome::Completed {
                    result: "done".into(),
                    usage: keel_core::Usage::new(1, 1),
                    cost: None,
                    tool_calls: 0,
                    iterations: 1,
                },
                CompletionHandling::Deliver,
                at,
            )
            .await
            .unwrap();
        ends.push(end.event_id.unwrap());
    }
    let gauges = store.inbox_gauges().await.unwrap();
    assert_eq!(gauges.pending, 2);
    assert_eq!(gauges.oldest_pending_at_ms, Some(200));
    assert_eq!(gauges.dead_lettered, 0);
    store
        .dead_letter_events(vec![ends[0]], "gave up".into(), 400)
        .await
        .unwrap();
    assert_eq!(
        store.inbox_gauges().await.unwrap(),
        InboxGauges {
            pending: 1,
            oldest_pending_at_ms: Some(300),
            dead_lettered: 1,
        }
    );
}

pub async fn a_turns_calls_are_committed_with_it_in_order_and_capped(db: TestDb) {
    let store = db.store.clone();
    let root = store.create_session(new_session("d", 1)).await.unwrap().id;
    let turn = TurnId::new();
    let spans = vec![
        call(CallKind::Model, "mock/m", 10),
        call(CallKind::Tool, "<b>shell</b>", 20),
        call(CallKind::Model, "mock/m", 30),
    ];
    store
        .commit_turn(turn_with(root, turn, spans.clone()))
        .await
        .unwrap();
    assert_eq!(store.turn_calls(None, turn).await.unwrap(), spans);
    assert_eq!(store.turn_calls(Some(root), turn).await.unwrap(), spans);
    assert!(store
        .turn_calls(Some(SessionId::new()), turn)
        .await
        .unwrap()
        .is_empty());
    assert!(store
        .turn_calls(None, TurnId::new())
        .await
        .unwrap()
        .is_empty());
    // More than the cap: the first MAX_CALL_SPANS are kept.
    let many: Vec<_> = (0..MAX_CALL_SPANS as i64 + 10)
        .map(|i| call(CallKind::Tool, "t", 100 + i))
        .collect();
    let capped = TurnId::new();
    store
        .commit_turn(turn_with(root, capped, many.clone()))
        .await
        .unwrap();
    assert_eq!(
        store.turn_calls(None, capped).await.unwrap(),
        many[..MAX_CALL_SPANS]
    );
    // A span that ends before it starts is refused, and with it the turn.
    let mut bad = call(CallKind::Model, "mock/m", 50);
    bad.ended_at_ms = 40;
    let err = store
        .commit_turn(turn_with(root, TurnId::new(), vec![bad]))
        .await
        .unwrap_err();
    assert!(matches!(err, crate::StoreError::InvalidInput(_)), "{err}");
    assert_eq!(
        store
            .load_messages(root, crate::MessageFilter::default())
            .await
            .unwrap()
            .len(),
        2,
        "the refused turn committed nothing"
    );
}

pub async fn a_runs_calls_are_stored_by_the_winning_terminal_commit_only(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let run = of_turn(root, TurnId::new(), None, ExecutionMode::Foreground);
    store.accept_run(accept(run.clone(), 100)).await.unwrap();
    let spans = vec![
        call(CallKind::Model, "mock/m", 110),
        call(CallKind::Tool, "t", 120),
    ];
    let outcome = || TerminalOutcome::Failed {
        error: "boom".into(),
        usage: None,
    };
    let won = store
        .commit_run_end(
            run.id,
            run.execution_id.clone(),
            outcome(),
            CompletionHandling::Deliver,
            130,
            spans.clone(),
        )
        .await
        .unwrap();
    assert!(won.won);
    // A late second commit wins nothing and stores no calls.
    let late = store
        .commit_run_end(
            run.id,
            run.execution_id.clone(),
            outcome(),
            CompletionHandling::Deliver,
            140,
            vec![call(CallKind::Model, "late/m", 135)],
        )
        .await
        .unwrap();
    assert!(!late.won);
    let other = RunId::new();
    let calls = store.runs_calls(vec![run.id, other]).await.unwrap();
    assert_eq!(calls.get(&run.id), Some(&spans));
    assert!(!calls.contains_key(&other));
}
