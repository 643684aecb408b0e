//! Orchestration transactions: acceptance with completion
//! reservations, execution-id conditional transitions, terminal commits,
//! signals, inbox claims, continuation commits, cancellation and recovery.

use keel_core::{ExecutionMode, RunStatus, SessionId};
use keel_store::{EventStatus, InboxCounts};
use rusqlite::Connection;

use crate::common::*;

#[tokio::test]
async fn inbox_counts_group_events_by_delivery_state_of_one_dialog() {
    let (dir, store) = temp_store();
    let fresh = store.create_session(new_session("fresh", 1)).await.unwrap();
    assert_eq!(
        store.inbox_counts(fresh.id).await.unwrap(),
        InboxCounts::default()
    );
    let (root, ids) = root_with_events(&store, 6).await;
    let other = store.create_session(new_session("other", 1)).await.unwrap();
    add_completions(&store, other.id, 0..2).await;
    {
        let conn = Connection::open(db_path(&dir)).unwrap();
        for (id, status) in ids[1..].iter().zip([
            "leased",
            "admitted",
            "consumed",
            "dead_letter",
            "superseded",
        ]) {
            // A lease goes with the in-flight states only.
            let leased = matches!(status, "leased" | "admitted");
            conn.execute(
                "UPDATE agent_inbox_events SET status = ?1, \
                 lease_token = iif(?3, 'lease', NULL), lease_until = iif(?3, 5000, NULL) \
                 WHERE id = ?2",
                rusqlite::params![status, id.to_string(), leased],
            )
            .unwrap();
        }
    }
    let revision = store.inbox_usage(root).await.unwrap().revision;
    assert!(revision > 0);
    assert_eq!(
        store.inbox_counts(root).await.unwrap(),
        InboxCounts {
            revision,
            pending: 3,
            delivered: 1,
            dead_lettered: 1,
            superseded: 1,
        }
    );
    assert_eq!(store.inbox_counts(other.id).await.unwrap().pending, 2);
}

#[tokio::test]
async fn recover_interrupts_old_generations_expires_leases_and_repairs_counters() {
    let (dir, store) = temp_store();
    let (root, ids) = root_with_events(&store, 1).await;
    let old = new_run(root, ExecutionMode::Background);
    store.accept_run(accept(old.clone(), 100)).await.unwrap();
    let mut current = new_run(root, ExecutionMode::Background);
    current.runtime_generation = 2;
    store
        .accept_run(accept(current.clone(), 100))
        .await
        .unwrap();
    let lease = store
        .claim_inbox_batch(claim(root, 1000))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.events[0].id, ids[0]);

    // Corrupt the counters behind the store's back.
    {
        let conn = Connection::open(db_path(&dir)).unwrap();
        conn.execute(
            "UPDATE agent_session_state SET pending_event_count = 7, reserved_completion_slots = 9",
            [],
        )
        .unwrap();
    }
    let revision_before = store.inbox_usage(root).await.unwrap().revision;
    let report = store.recover_older_generations(2, 1_000_000).await.unwrap();
    assert_eq!(
        report.counters_repaired[0].after.revision,
        revision_before + 1,
        "recovery allocates one revision per root session"
    );
    assert_eq!(report.interrupted_runs, [old.id]);
    assert_eq!(report.completion_events, 1);
    assert_eq!(report.leases_expired, 1);
    assert_eq!(report.counters_repaired.len(), 1);
    let repair = &report.counters_repaired[0];
    assert_eq!(repair.root_session_id, root);
    // Before recomputation: the corrupted 7/9 moved by this transaction's own
    // conversion of the old run's reservation (+1 pending, -1 reserved).
    assert_eq!(
        (
            repair.before.pending_event_count,
            repair.before.reserved_completion_slots
        ),
        (8, 8)
    );
    assert_eq!(
        (
            repair.after.pending_event_count,
            repair.after.reserved_completion_slots
        ),
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
    assert_eq!(slots(&store, root).await, counters(2, 1));
}

#[tokio::test]
async fn unknown_enum_text_on_disk_is_corruption() {
    let (dir, store) = temp_store();
    let root = SessionId::new();
    let run = new_run(root, ExecutionMode::Foreground);
    store.accept_run(accept(run.clone(), 10)).await.unwrap();
    {
        let conn = Connection::open(db_path(&dir)).unwrap();
        conn.execute_batch("PRAGMA ignore_check_constraints = ON")
            .unwrap();
        conn.execute("UPDATE agent_runs SET status = 'finished'", [])
            .unwrap();
    }
    let err = store.get_run(run.id).await.unwrap_err();
    insta::assert_snapshot!(err, @r#"corrupt data: agent_runs.status: unknown run status "finished""#);
}
