//! The invariant checker on SQLite itself: each invariant reported (with
//! whether the safe repair fixes it) when a row is broken behind the
//! store's back, the file checked without a store, and a missing file not
//! created. (The checks the store's API reaches are in the conformance
//! suite, `keel_store::conformance::check`, whose fixtures these use.)

use keel_core::{Message, ToolCall};
use keel_store::conformance::check::{busy_store, details, mask_ids, summary};
use keel_store::{check_database, CheckOptions, Invariant, NewMessage, Store};
use rusqlite::Connection;

use crate::common::*;

/// [`busy_store`] in a temporary directory.
async fn busy() -> (tempfile::TempDir, Store, keel_core::SessionId) {
    let (dir, store) = temp_store();
    let session = busy_store(&store).await;
    (dir, store, session)
}

fn raw(dir: &tempfile::TempDir) -> Connection {
    Connection::open(db_path(dir)).unwrap()
}

#[tokio::test]
async fn each_broken_invariant_is_reported_with_its_repair() {
    let (dir, store, session) = busy().await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    let conn = raw(&dir);
    // Counters drift from the rows (repairable).
    conn.execute(
        "UPDATE agent_session_state SET pending_event_count = pending_event_count + 3",
        [],
    )
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
    conn.execute(
        "UPDATE state_blobs SET bytes = X'00' WHERE hash = \
         (SELECT state_hash FROM checkpoints ORDER BY rowid LIMIT 1)",
        [],
    )
    .unwrap();
    // A completion superseded (only signals may be).
    conn.execute(
        "UPDATE agent_inbox_events SET status = 'superseded', superseded_at = 70 \
         WHERE event_type = 'completion' AND rowid = (SELECT min(rowid) FROM agent_inbox_events)",
        [],
    )
    .unwrap();
    // An interrupted background run whose completion vanished.
    conn.execute_batch(
        "PRAGMA foreign_keys = OFF; \
         DELETE FROM agent_inbox_events WHERE rowid = (SELECT max(rowid) FROM agent_inbox_events);",
    )
    .unwrap();
    drop(conn);
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    let details = details(&report);
    insta::assert_yaml_snapshot!(details);

    // The safe repair (what a start runs) fixes the counters and nothing else.
    store.activate_runtime("third".into(), 80).await.unwrap();
    let after = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(after.findings.iter().all(|f| !f.repairable), "{after:#?}");
    assert_eq!(after.findings.len(), report.findings.len() - 1);
}

#[tokio::test]
async fn a_message_count_that_drifted_is_found_and_the_recount_fixes_it() {
    let (dir, store, session) = busy().await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    assert_eq!(store.recount_message_counts().await.unwrap(), 0);
    // What builds that did not carry the count through a fork left.
    raw(&dir)
        .execute("UPDATE sessions SET message_count = 0", [])
        .unwrap();
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert_eq!(summary(&report), [(Invariant::MessageCounts, true)]);
    assert_eq!(
        mask_ids(&report.findings[0].detail),
        "session <id>: message count 0 stored, 2 visible user messages in its history"
    );
    assert_eq!(store.recount_message_counts().await.unwrap(), 1);
    let record = store.get_session(session).await.unwrap().unwrap();
    assert_eq!(record.message_count, 2);
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:#?}");
}

#[test]
fn a_missing_database_is_not_created_by_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(&dir);
    let err = check_database(&path, &CheckOptions::default()).unwrap_err();
    assert!(err.to_string().contains("not found"), "{err}");
    assert!(!path.exists());
}

/// A queued input waiting for its turn is clean; one of a deleted or missing
/// dialog, or of a turn that already ran, is a finding no repair touches.
#[tokio::test]
async fn queued_inputs_of_gone_dialogs_or_started_turns_are_found() {
    let (dir, store, session) = busy().await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    let other = store.create_session(new_session("e", 1)).await.unwrap().id;
    let queue = |session, text: &str| keel_store::QueuedInput {
        session_id: session,
        turn_id: keel_core::TurnId::new(),
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
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:#?}");
    // Deleting a dialog withdraws what was queued for it.
    let deleted = store.create_session(new_session("f", 1)).await.unwrap().id;
    store
        .queue_input(queue(deleted, "never mind"))
        .await
        .unwrap();
    assert!(store.soft_delete_session(deleted, 65).await.unwrap());
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:#?}");
    let conn = raw(&dir);
    let queued: i64 = conn
        .query_row("SELECT count(*) FROM queued_inputs", [], |r| r.get(0))
        .unwrap();
    assert_eq!(queued, 3);
    // Behind the store's back: the turn of `ran` started a run; the dialog
    // of `orphaned` is deleted with its input still queued.
    conn.execute(
        "UPDATE agent_runs SET root_turn_id = ?1 WHERE rowid = (SELECT min(rowid) FROM agent_runs)",
        [ran.turn_id.to_string()],
    )
    .unwrap();
    conn.execute(
        "UPDATE sessions SET deleted_at = 70 WHERE id = ?1",
        [other.to_string()],
    )
    .unwrap();
    conn.execute_batch(&format!(
        "PRAGMA foreign_keys = OFF; \
         INSERT INTO queued_inputs (turn_id, session_id, message, queued_at) \
         VALUES ('{}', '{}', '{{}}', 80);",
        keel_core::TurnId::new(),
        keel_core::SessionId::new()
    ))
    .unwrap();
    drop(conn);
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    let details = details(&report);
    insta::assert_yaml_snapshot!(details);
    store.activate_runtime("third".into(), 90).await.unwrap();
    let after = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert_eq!(
        after.findings, report.findings,
        "recovery leaves them alone"
    );
}
