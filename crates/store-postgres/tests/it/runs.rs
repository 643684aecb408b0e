//! Runs on PostgreSQL itself (what the conformance suite cannot reach
//! through the store): recovery repairs counters changed behind the store's
//! back, and a status this build does not know is corruption.

use keel_core::{ExecutionMode, RunStatus, SessionId, Usage};
use keel_store::conformance::fixtures::{new_run, new_session};
use keel_store::{
    AcceptRun, ClaimRequest, CompletionHandling, EventStatus, NewRun, Store, StoreError,
    TerminalOutcome,
};
use keel_store_postgres::{require_postgres, PgOptions, PgStore};

async fn store_on(db: &keel_store_postgres::testing::TestDb) -> Store {
    let (store, _) = PgStore::connect(&db.conninfo, PgOptions::default())
        .await
        .expect("connect to the test database");
    Store::new(store)
}

fn accept(run: NewRun) -> AcceptRun {
    AcceptRun {
        run,
        inbox_capacity: 100,
        now_ms: 100,
    }
}

#[tokio::test]
async fn recover_interrupts_old_generations_expires_leases_and_repairs_counters() {
    let db = require_postgres!();
    let store = store_on(&db).await;
    let root = store
        .create_session(new_session("root", 1))
        .await
        .unwrap()
        .id;
    // One pending completion, from a run that ended.
    let done = new_run(root, ExecutionMode::Background);
    store.accept_run(accept(done.clone())).await.unwrap();
    store
        .commit_terminal(
            done.id,
            done.execution_id.clone(),
            TerminalOutcome::Completed {
                result: "r0".into(),
                usage: Usage::new(10, 5),
                tool_calls: 2,
                iterations: 3,
                cost: None,
            },
            CompletionHandling::Deliver,
            200,
        )
        .await
        .unwrap();
    let old = new_run(root, ExecutionMode::Background);
    store.accept_run(accept(old.clone())).await.unwrap();
    let mut current = new_run(root, ExecutionMode::Background);
    current.runtime_generation = 2;
    store.accept_run(accept(current.clone())).await.unwrap();
    let lease = store
        .claim_inbox_batch(ClaimRequest {
            root_session_id: root,
            now_ms: 1000,
            lease_ms: 60_000,
            max_events: 8,
            max_bytes: 32 * 1024,
            delivery: None,
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.events.len(), 1);

    // Corrupt the counters behind the store's back.
    db.connect()
        .await
        .execute(
            "UPDATE agent_session_state SET pending_event_count = 7, reserved_completion_slots = 9",
            &[],
        )
        .await
        .unwrap();
    let revision_before = store.inbox_usage(root).await.unwrap().revision;
    let report = store.recover_older_generations(2, 1_000_000).await.unwrap();
    assert_eq!(report.interrupted_runs, [old.id]);
    assert_eq!(report.completion_events, 1);
    assert_eq!(report.leases_expired, 1);
    assert_eq!(report.counters_repaired.len(), 1);
    let repair = &report.counters_repaired[0];
    assert_eq!(repair.root_session_id, root);
    assert_eq!(
        repair.after.revision,
        revision_before + 1,
        "recovery allocates one revision per root session"
    );
    // Before recomputation: the corrupted 7/9 moved by this transaction's own
    // conversion of the old run's reservation (+1 pending, -1 reserved).
    let pair = |u: keel_store::InboxUsage| (u.pending_event_count, u.reserved_completion_slots);
    assert_eq!(pair(repair.before), (8, 8));
    assert_eq!(
        pair(repair.after),
        (2, 1),
        "two open completions, one live reservation"
    );
    assert_eq!(report.sessions_with_inbox_work, [root]);
    let interrupted = store.get_run(old.id).await.unwrap().unwrap();
    assert_eq!(interrupted.status, RunStatus::Interrupted);
    let events = store.list_inbox_events(root).await.unwrap();
    assert_eq!(events[0].status, EventStatus::Pending);
    assert_eq!(events[0].attempt_count, 1);
    // Running recovery again finds nothing to do.
    let again = store.recover_older_generations(2, 1_000_001).await.unwrap();
    assert!(again.interrupted_runs.is_empty() && again.counters_repaired.is_empty());
    assert_eq!(pair(store.inbox_usage(root).await.unwrap()), (2, 1));
}

#[tokio::test]
async fn unknown_enum_text_on_disk_is_corruption() {
    let db = require_postgres!();
    let store = store_on(&db).await;
    let run = new_run(SessionId::new(), ExecutionMode::Foreground);
    store.accept_run(accept(run.clone())).await.unwrap();
    db.connect()
        .await
        .batch_execute(
            "ALTER TABLE agent_runs DROP CONSTRAINT agent_runs_status_check; \
             UPDATE agent_runs SET status = 'finished'",
        )
        .await
        .unwrap();
    let err = store.get_run(run.id).await.unwrap_err();
    assert!(matches!(err, StoreError::Corruption(_)), "{err}");
    assert_eq!(
        err.to_string(),
        r#"corrupt data: agent_runs.status: unknown run status "finished""#
    );
}
