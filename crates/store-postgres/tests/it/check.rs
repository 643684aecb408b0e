//! The invariant checker on PostgreSQL itself: rows broken behind the
//! store's back are reported exactly as on SQLite — the same findings, the
//! same words: these tests share keel-store's snapshots — and the
//! integrity pass finds what a server can still get wrong (an invalid
//! index, a dangling reference a restore without triggers let in, a row
//! breaking a CHECK added NOT VALID).

use keel_core::{Message, SessionId, ToolCall, TurnId};
use keel_store::conformance::check::{busy_store, details, mask_ids, summary};
use keel_store::conformance::fixtures::new_session;
use keel_store::{CheckOptions, Invariant, InvariantReport, NewMessage, QueuedInput, Store};
use keel_store_postgres::testing::TestDb;
use keel_store_postgres::tokio_postgres::error::SqlState;
use keel_store_postgres::{require_postgres, PgOptions, PgStore};

async fn store_on(db: &TestDb) -> Store {
    let (store, _) = PgStore::connect(&db.conninfo, PgOptions::default())
        .await
        .expect("connect to the test database");
    Store::new(store)
}

/// A check as `keel doctor` runs it while no keel runs on the database.
async fn check(store: &Store) -> InvariantReport {
    store
        .check_invariants(CheckOptions::default())
        .await
        .expect("check")
}

/// Asserts `details` equals keel-store's snapshot of the same test on SQLite.
macro_rules! assert_same_as_sqlite {
    ($details:expr) => {
        insta::with_settings!({ snapshot_path => "../../../store/tests/it/snapshots" }, {
            insta::assert_yaml_snapshot!($details);
        })
    };
}

#[tokio::test]
async fn each_broken_invariant_is_reported_with_its_repair() {
    let db = require_postgres!();
    let store = store_on(&db).await;
    let session = busy_store(&store).await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    let raw = db.connect().await;
    // Counters drift from the rows (repairable).
    raw.batch_execute(
        "UPDATE agent_session_state SET pending_event_count = pending_event_count + 3",
    )
    .await
    .unwrap();
    // A tool call with no result at the end of the history: a half turn.
    store
        .append_messages(
            session,
            vec![NewMessage::new(Message::assistant_with_tools(
                "",
                vec![ToolCall {
                    id: "call-9".into(),
                    name: "read_file".into(),
                    arguments: serde_json::json!({}),
                }],
            ))],
            60,
        )
        .await
        .unwrap();
    // A state blob whose bytes no longer match their hash.
    raw.batch_execute(
        "UPDATE state_blobs SET bytes = '\\x00'::bytea WHERE hash = \
           (SELECT state_hash FROM checkpoints ORDER BY row_order LIMIT 1)",
    )
    .await
    .unwrap();
    // A completion superseded (only signals may be): the first one.
    raw.batch_execute(
        "UPDATE agent_inbox_events SET status = 'superseded', superseded_at = 70 \
         WHERE event_type = 'completion' \
           AND created_at = (SELECT min(created_at) FROM agent_inbox_events)",
    )
    .await
    .unwrap();
    // An interrupted background run whose completion vanished.
    raw.batch_execute(
        "DELETE FROM agent_inbox_events \
         WHERE created_at = (SELECT max(created_at) FROM agent_inbox_events)",
    )
    .await
    .unwrap();
    let report = check(&store).await;
    let details = details(&report);
    assert_same_as_sqlite!(details);

    // The safe repair (what a start runs) fixes the counters and nothing else.
    store.activate_runtime("third".into(), 80).await.unwrap();
    let after = check(&store).await;
    assert!(after.findings.iter().all(|f| !f.repairable), "{after:#?}");
    assert_eq!(after.findings.len(), report.findings.len() - 1);
}

#[tokio::test]
async fn a_message_count_that_drifted_is_found_and_the_recount_fixes_it() {
    let db = require_postgres!();
    let store = store_on(&db).await;
    let session = busy_store(&store).await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    assert_eq!(store.recount_message_counts().await.unwrap(), 0);
    // What builds that did not carry the count through a fork left.
    db.connect()
        .await
        .batch_execute("UPDATE sessions SET message_count = 0")
        .await
        .unwrap();
    let report = check(&store).await;
    assert_eq!(summary(&report), [(Invariant::MessageCounts, true)]);
    assert_eq!(
        mask_ids(&report.findings[0].detail),
        "session <id>: message count 0 stored, 2 visible user messages in its history"
    );
    assert_eq!(store.recount_message_counts().await.unwrap(), 1);
    let record = store.get_session(session).await.unwrap().unwrap();
    assert_eq!(record.message_count, 2);
    assert!(check(&store).await.is_clean());
}

/// A queued input waiting for its turn is clean; one of a deleted or missing
/// dialog, or of a turn that already ran, is a finding no repair touches
/// (the missing dialog's row got in with the server's reference triggers
/// off, as a restore with triggers disabled would let it).
#[tokio::test]
async fn queued_inputs_of_gone_dialogs_or_started_turns_are_found() {
    let db = require_postgres!();
    let store = store_on(&db).await;
    let session = busy_store(&store).await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    let other = store.create_session(new_session("e", 1)).await.unwrap().id;
    let queue = |session, text: &str| QueuedInput {
        session_id: session,
        turn_id: TurnId::new(),
        message: Message::user(text),
        queued_at_ms: 60,
        webhook: None,
    };
    let waiting = queue(session, "later");
    let ran = queue(session, "ran already");
    let orphaned = queue(other, "to a deleted dialog");
    for input in [&waiting, &ran, &orphaned] {
        store.queue_input(input.clone()).await.unwrap();
    }
    assert!(check(&store).await.is_clean());
    // Deleting a dialog withdraws what was queued for it.
    let deleted = store.create_session(new_session("f", 1)).await.unwrap().id;
    store
        .queue_input(queue(deleted, "never mind"))
        .await
        .unwrap();
    assert!(store.soft_delete_session(deleted, 65).await.unwrap());
    let report = check(&store).await;
    assert!(report.is_clean(), "{report:#?}");
    let raw = db.connect().await;
    let queued: i64 = raw
        .query_one("SELECT count(*) FROM queued_inputs", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(queued, 3);
    // Behind the store's back: the turn of `ran` started a run; the dialog
    // of `orphaned` is deleted with its input still queued.
    raw.execute(
        "UPDATE agent_runs SET root_turn_id = $1 \
         WHERE row_order = (SELECT min(row_order) FROM agent_runs)",
        &[&ran.turn_id.to_string()],
    )
    .await
    .unwrap();
    raw.execute(
        "UPDATE sessions SET deleted_at = 70 WHERE id = $1",
        &[&other.to_string()],
    )
    .await
    .unwrap();
    raw.batch_execute(&format!(
        "SET session_replication_role = replica; \
         INSERT INTO queued_inputs (turn_id, session_id, message, queued_at) \
         VALUES ('{}', '{}', '{{}}', 80); \
         RESET session_replication_role;",
        TurnId::new(),
        SessionId::new()
    ))
    .await
    .unwrap();
    let report = check(&store).await;
    let details = details(&report);
    assert_same_as_sqlite!(details);
    store.activate_runtime("third".into(), 90).await.unwrap();
    let after = check(&store).await;
    assert_eq!(
        after.findings, report.findings,
        "recovery leaves them alone"
    );
}

#[tokio::test]
async fn the_integrity_pass_finds_invalid_indexes_dangling_references_and_unvalidated_checks() {
    let db = require_postgres!();
    let store = store_on(&db).await;
    busy_store(&store).await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    let raw = db.connect().await;
    // With amcheck installed every B-tree of keel's tables is verified: intact.
    raw.batch_execute("CREATE EXTENSION IF NOT EXISTS amcheck")
        .await
        .unwrap();
    let report = check(&store).await;
    assert!(report.is_clean(), "{report:#?}");
    // A unique index built concurrently over duplicates fails and stays, invalid.
    let err = raw
        .batch_execute("CREATE UNIQUE INDEX CONCURRENTLY messages_one_role ON messages(role)")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::UNIQUE_VIOLATION), "{err:?}");
    // A checkpoint whose parent is gone, let in with the triggers off, and
    // a CHECK every title breaks, added without validating the rows.
    raw.batch_execute(
        "SET session_replication_role = replica; \
         UPDATE checkpoints SET parent_checkpoint_id = 'gone' \
         WHERE row_order = (SELECT max(row_order) FROM checkpoints); \
         RESET session_replication_role; \
         ALTER TABLE sessions ADD CONSTRAINT short_titles CHECK (length(title) < 1) NOT VALID;",
    )
    .await
    .unwrap();
    let report = check(&store).await;
    insta::assert_yaml_snapshot!(details(&report));
}
