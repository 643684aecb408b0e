//! Spend: a dialog's spend adds up call by call and survives reopening the
//! database; a run a budget stopped is stored `budget_exhausted` with what
//! it spent.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{ExecutionMode, RunStatus, SessionId, Usage, Usd};

use crate::{AcceptRun, CompletionHandling, DialogSpend, TerminalOutcome};

use super::fixtures::*;
use super::TestDb;

fn usd(v: f64) -> Usd {
    Usd::new(v).unwrap()
}

pub async fn dialog_spend_adds_up_and_survives_reopening(db: TestDb) {
    let store = db.store.clone();
    let session = store.create_session(new_session("d", 10)).await.unwrap();
    assert_eq!(
        store.dialog_spend(session.id).await.unwrap(),
        DialogSpend::default()
    );
    store
        .add_dialog_spend(session.id, Usage::new(100, 20), usd(0.5), 11)
        .await
        .unwrap();
    let after = store
        .add_dialog_spend(session.id, Usage::new(1, 2), usd(0.25), 12)
        .await
        .unwrap();
    assert_eq!(after.usage, Usage::new(101, 22));
    assert_eq!(after.cost, usd(0.75));
    assert_eq!(after.model_calls, 2);
    // Another dialog's spend is its own.
    let other = store.create_session(new_session("e", 10)).await.unwrap();
    assert_eq!(store.dialog_spend(other.id).await.unwrap().model_calls, 0);
    drop(store);
    let store = db.reopen().await;
    assert_eq!(store.dialog_spend(session.id).await.unwrap(), after);
    // A dialog that does not exist has no spend to add to.
    assert!(store
        .add_dialog_spend(SessionId::new(), Usage::new(1, 1), Usd::ZERO, 13)
        .await
        .is_err());
}

pub async fn a_budget_exhausted_run_records_what_it_spent(db: TestDb) {
    let store = db.store.clone();
    let run = new_run(SessionId::new(), ExecutionMode::Background);
    let exec = run.execution_id.clone();
    store
        .accept_run(AcceptRun {
            run: run.clone(),
            inbox_capacity: 4,
            now_ms: 100,
        })
        .await
        .unwrap();
    store
        .mark_run_running(run.id, exec.clone(), 110)
        .await
        .unwrap();
    let commit = store
        .commit_terminal(
            run.id,
            exec,
            TerminalOutcome::BudgetExhausted {
                error: "budget exhausted".into(),
                usage: Usage::new(70, 30),
                cost: Some(usd(0.01)),
            },
            CompletionHandling::Deliver,
            120,
        )
        .await
        .unwrap();
    assert!(commit.won);
    assert_eq!(commit.run.status, RunStatus::BudgetExhausted);
    assert!(commit.run.status.is_terminal());
    assert_eq!(commit.run.usage, Some(Usage::new(70, 30)));
    assert_eq!(commit.run.cost, Some(0.01));
    assert_eq!(commit.run.error.as_deref(), Some("budget exhausted"));
    // The background run's completion tells the root agent it failed.
    assert!(commit.event_id.is_some());
}
