//! Spend: a dialog's spend adds up call by call and survives reopening the
//! database; a run a budget stopped is stored `budget_exhausted` with what
//! it spent; a v9 database's runs, children and inbox events survive the
//! v11 rebuild of `agent_runs`, with foreign keys enforced after it.

use keel_core::{ExecutionMode, RunStatus, SessionId, Usage, Usd};
use keel_store::testing::migrate_to;
use keel_store::{AcceptRun, CompletionHandling, DialogSpend, Store, TerminalOutcome};
use rusqlite::{params, Connection};

use crate::common::*;

fn usd(v: f64) -> Usd {
    Usd::new(v).unwrap()
}

#[tokio::test]
async fn dialog_spend_adds_up_and_survives_reopening() {
    let (dir, store) = temp_store();
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
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    assert_eq!(store.dialog_spend(session.id).await.unwrap(), after);
    // A dialog that does not exist has no spend to add to.
    assert!(store
        .add_dialog_spend(SessionId::new(), Usage::new(1, 1), Usd::ZERO, 13)
        .await
        .is_err());
}

#[tokio::test]
async fn a_budget_exhausted_run_records_what_it_spent() {
    let (_dir, store) = temp_store();
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

#[tokio::test]
async fn runs_children_and_their_events_survive_the_v11_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let root = SessionId::new();
    let (parent, child) = (keel_core::RunId::new(), keel_core::RunId::new());
    {
        let mut conn = Connection::open(db_path(&dir)).unwrap();
        migrate_to(&mut conn, 9).unwrap();
        conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
        for (id, up, exec) in [(parent, None, "e1"), (child, Some(parent), "e2")] {
            conn.execute(
                "INSERT INTO agent_runs (id, root_session_id, parent_run_id, caller_agent_id, \
                 caller_scope_id, agent_id, definition_hash, provider_profile, provider_name, \
                 model_id, mode, depth, execution_id, task, budget_json, status, \
                 runtime_generation, deadline_at, revision, created_at, updated_at) \
                 VALUES (?1, ?2, ?3, 'root', 'scope', 'a', 'h', 'default', 'scripted', 'm', \
                 'background', 1, ?4, 'task', '{}', 'failed', 1, 100, 1, 17, 17)",
                params![
                    id.to_string(),
                    root.to_string(),
                    up.map(|r| r.to_string()),
                    exec
                ],
            )
            .unwrap();
        }
        conn.execute(
            "INSERT INTO agent_inbox_events (id, root_session_id, scope_kind, scope_id, run_id, \
             event_type, event_key, delivery, status, payload_json, revision, created_at) \
             VALUES ('ev', ?1, 'run', ?2, ?2, 'completion', 'completion', 'queue', \
             'pending', '{}', 1, 17)",
            params![root.to_string(), child.to_string()],
        )
        .unwrap();
    }
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let runs = store.list_runs(root, None, 10).await.unwrap();
    assert_eq!(runs.items.len(), 2);
    let stored_child = store.get_run(child).await.unwrap().unwrap();
    assert_eq!(stored_child.spec.parent_run_id, Some(parent));
    drop(store);
    let conn = Connection::open(db_path(&dir)).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    let events: i64 = conn
        .query_row(
            "SELECT count(*) FROM agent_inbox_events WHERE run_id = ?1",
            [child.to_string()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(events, 1);
    // The new status is allowed, an unknown one still is not, and the
    // references still hold.
    conn.execute(
        "UPDATE agent_runs SET status = 'budget_exhausted' WHERE id = ?1",
        [parent.to_string()],
    )
    .unwrap();
    assert!(conn
        .execute(
            "UPDATE agent_runs SET status = 'spent' WHERE id = ?1",
            [parent.to_string()]
        )
        .is_err());
    assert!(conn
        .execute("DELETE FROM agent_runs WHERE id = ?1", [parent.to_string()])
        .is_err());
}
