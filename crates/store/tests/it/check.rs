//! The invariant checker: clean on what the commit paths write, and each
//! invariant reported (with whether the safe repair fixes it) when a row is
//! broken behind the store's back.

use keel_core::{CheckpointId, ExecutionMode, Message, ToolCall};
use keel_store::{
    check_database, CheckOptions, CheckpointSource, CompletionHandling, Invariant, NewCheckpoint,
    NewMessage, Store, TerminalOutcome, TurnCommit,
};
use rusqlite::Connection;

use crate::common::*;

fn turn(session: keel_core::SessionId, messages: Vec<Message>, turn_index: u64) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: messages.into_iter().map(NewMessage::new).collect(),
        state: format!("{{\"turn\":{turn_index}}}").into_bytes(),
        checkpoint: Some(NewCheckpoint {
            id: CheckpointId::new(),
            turn_index,
            source: CheckpointSource::Turn,
        }),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 10,
    }
}

fn tool_turn(call: &str) -> Vec<Message> {
    vec![
        Message::user("look it up"),
        Message::assistant_with_tools(
            "",
            vec![ToolCall {
                id: call.into(),
                name: "read_file".into(),
                arguments: serde_json::json!({"path": "a"}),
            }],
        ),
        Message::tool_result(call, "read_file", "contents"),
        Message::assistant("done"),
    ]
}

/// A database with what every commit path writes: turns with tool calls
/// and checkpoints, a rollback, a background run that completed, one that
/// was interrupted by recovery, and a foreground one.
async fn busy_store() -> (tempfile::TempDir, Store, keel_core::SessionId) {
    let (dir, store) = temp_store();
    let session = store.create_session(new_session("d", 1)).await.unwrap();
    let first = store
        .commit_turn(turn(session.id, tool_turn("call-1"), 1))
        .await
        .unwrap();
    store
        .commit_turn(turn(session.id, tool_turn("call-1"), 2))
        .await
        .unwrap();
    store
        .rollback(
            session.id,
            first.checkpoint.unwrap().id,
            CheckpointId::new(),
            20,
        )
        .await
        .unwrap();
    store
        .commit_turn(turn(session.id, tool_turn("call-2"), 2))
        .await
        .unwrap();
    store.activate_runtime("first".into(), 30).await.unwrap();
    let done = new_run(session.id, ExecutionMode::Background);
    store
        .accept_run(keel_store::AcceptRun {
            run: done.clone(),
            inbox_capacity: 8,
            now_ms: 30,
        })
        .await
        .unwrap();
    store
        .commit_terminal(
            done.id,
            done.execution_id.clone(),
            TerminalOutcome::Failed {
                error: "no".into(),
                usage: None,
            },
            CompletionHandling::Deliver,
            40,
        )
        .await
        .unwrap();
    for mode in [ExecutionMode::Background, ExecutionMode::Foreground] {
        store
            .accept_run(keel_store::AcceptRun {
                run: new_run(session.id, mode),
                inbox_capacity: 8,
                now_ms: 30,
            })
            .await
            .unwrap();
    }
    (dir, store, session.id)
}

fn raw(dir: &tempfile::TempDir) -> Connection {
    Connection::open(db_path(dir)).unwrap()
}

/// Findings as (invariant, repairable) pairs, plus their text with ids masked.
fn summary(report: &keel_store::InvariantReport) -> Vec<(Invariant, bool)> {
    report
        .findings
        .iter()
        .map(|f| (f.invariant, f.repairable))
        .collect()
}

#[tokio::test]
async fn what_the_commit_paths_write_is_clean_and_abandoned_runs_are_recovery_work() {
    let (dir, store, _) = busy_store().await;
    // The process that accepted the two open runs still owns them.
    let live = CheckOptions {
        owner_alive: true,
        ..CheckOptions::default()
    };
    let report = store.check_invariants(live.clone()).await.unwrap();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(
        (
            report.checked.sessions,
            report.checked.checkpoints,
            report.checked.runs,
            report.checked.events
        ),
        (1, 4, 3, 1)
    );
    // Once it is gone, its open runs are abandoned until recovery runs.
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert_eq!(
        summary(&report),
        [(Invariant::Runs, true), (Invariant::Runs, true)]
    );
    assert!(
        report.findings[0].detail.contains("whose process stopped"),
        "{report:#?}"
    );
    // Recovery (the next start) interrupts them; the background one with its completion.
    store.activate_runtime("second".into(), 50).await.unwrap();
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.checked.events, 2);
}

#[tokio::test]
async fn each_broken_invariant_is_reported_with_its_repair() {
    let (dir, store, session) = busy_store().await;
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
    let details: Vec<String> = report
        .findings
        .iter()
        .map(|f| {
            format!(
                "{} ({}): {}",
                f.invariant.name(),
                if f.repairable { "repairable" } else { "manual" },
                mask_ids(&f.detail)
            )
        })
        .collect();
    insta::assert_yaml_snapshot!(details);

    // The safe repair (what a start runs) fixes the counters and nothing else.
    store.activate_runtime("third".into(), 80).await.unwrap();
    let after = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(after.findings.iter().all(|f| !f.repairable), "{after:#?}");
    assert_eq!(after.findings.len(), report.findings.len() - 1);
}

#[tokio::test]
async fn a_message_count_that_drifted_is_found_and_the_recount_fixes_it() {
    let (dir, store, session) = busy_store().await;
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

#[tokio::test]
async fn a_decoder_that_rejects_a_state_is_a_checkpoint_finding() {
    let (dir, _store, _) = busy_store().await;
    let options = CheckOptions {
        owner_alive: true,
        state_decoder: Some(std::sync::Arc::new(|bytes: &[u8]| {
            if bytes.starts_with(b"{\"turn\":2") {
                Err("turn 2 is not a state".into())
            } else {
                Ok(())
            }
        })),
    };
    let report = check_database(&db_path(&dir), &options).unwrap();
    // Two checkpoints at turn 2 (one per branch) and the head of the session.
    assert_eq!(
        summary(&report),
        [(Invariant::Checkpoints, false); 3],
        "{report:#?}"
    );
}

#[test]
fn a_missing_database_is_not_created_by_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let path = db_path(&dir);
    let err = check_database(&path, &CheckOptions::default()).unwrap_err();
    assert!(err.to_string().contains("not found"), "{err}");
    assert!(!path.exists());
}

/// Replaces UUIDs (36 characters with dashes) with `<id>`.
fn mask_ids(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some((i, _)) = rest.char_indices().find(|(i, _)| is_uuid(&rest[*i..])) {
        out.push_str(&rest[..i]);
        out.push_str("<id>");
        rest = &rest[i + 36..];
    }
    out.push_str(rest);
    out
}

fn is_uuid(s: &str) -> bool {
    s.len() >= 36
        && s.as_bytes()[..36].iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// A queued input waiting for its turn is clean; one of a deleted or missing
/// dialog, or of a turn that already ran, is a finding no repair touches.
#[tokio::test]
async fn queued_inputs_of_gone_dialogs_or_started_turns_are_found() {
    let (dir, store, session) = busy_store().await;
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
    let details: Vec<String> = report
        .findings
        .iter()
        .map(|f| {
            format!(
                "{} ({}): {}",
                f.invariant.name(),
                if f.repairable { "repairable" } else { "manual" },
                mask_ids(&f.detail)
            )
        })
        .collect();
    insta::assert_yaml_snapshot!(details);
    store.activate_runtime("third".into(), 90).await.unwrap();
    let after = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert_eq!(
        after.findings, report.findings,
        "recovery leaves them alone"
    );
}

#[tokio::test]
async fn an_image_reference_without_its_image_is_reported() {
    let (dir, store) = temp_store();
    let session = store.create_session(new_session("d", 1)).await.unwrap();
    let stored = store
        .put_image(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec())
        .await
        .unwrap();
    let with_image = |hash: &str| {
        let mut m = Message::user("look");
        m.content.push(keel_core::ContentPart::ImageRef {
            uri: keel_core::image_uri(hash),
            mime_type: Some("image/png".into()),
        });
        vec![m, Message::assistant("a png")]
    };
    store
        .commit_turn(turn(session.id, with_image(&stored.sha256), 1))
        .await
        .unwrap();
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
    let missing = "0".repeat(64);
    store
        .commit_turn(turn(session.id, with_image(&missing), 2))
        .await
        .unwrap();
    let report = check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    let details: Vec<_> = report
        .findings
        .iter()
        .map(|f| (f.invariant, f.detail.contains(&missing)))
        .collect();
    assert_eq!(
        details,
        vec![(Invariant::History, true)],
        "{:?}",
        report.findings
    );
}
