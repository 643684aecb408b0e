//! The operator's reads: the inbox gauges `/metrics` reports, and the run
//! trees of traces (a run and everything below it; every run of a turn).

use keel_core::{ExecutionMode, RunId, SessionId, TurnId};
use keel_store::{AcceptRun, CompletionHandling, InboxGauges, NewRun, TerminalOutcome};

use crate::common::*;

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

#[tokio::test]
async fn a_run_tree_holds_the_run_and_its_descendants_and_a_turn_every_run_it_started() {
    let (_dir, store) = temp_store();
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
    let ids = |runs: Vec<keel_store::RunRecord>| -> Vec<RunId> {
        runs.iter().map(|r| r.spec.id).collect()
    };
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

#[tokio::test]
async fn the_inbox_gauges_count_waiting_and_dead_lettered_events() {
    let (_dir, store) = temp_store();
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
