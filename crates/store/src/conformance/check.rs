//! The invariant checker: clean on what the commit paths write, abandoned
//! runs reported as recovery work until a start recovers them, a decoder's
//! refusal and a missing image reported. (Findings of rows broken behind
//! the store's back need each backend's own SQL: keel-store's
//! `tests/it/check.rs` and keel-store-postgres's `tests/it/check.rs`,
//! which build on the fixtures here.)
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{CheckpointId, ExecutionMode, Message, SessionId, ToolCall};

use super::fixtures::*;
use super::TestDb;
use crate::{
    AcceptRun, CheckOptions, CheckpointSource, CompletionHandling, Invariant, InvariantReport,
    NewCheckpoint, NewMessage, Store, TerminalOutcome, TurnCommit,
};

/// A turn of `messages` with a checkpoint at `turn_index` and a state
/// naming it.
pub fn turn(session: SessionId, messages: Vec<Message>, turn_index: u64) -> TurnCommit {
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

/// A user's question answered through one tool call.
pub fn tool_turn(call: &str) -> Vec<Message> {
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

/// Writes what every commit path writes: turns with tool calls and
/// checkpoints, a rollback, a background run that completed, one that
/// stays open (recovery interrupts it), and a foreground one. Returns the
/// session.
pub async fn busy_store(store: &Store) -> SessionId {
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
        .accept_run(AcceptRun {
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
            .accept_run(AcceptRun {
                run: new_run(session.id, mode),
                inbox_capacity: 8,
                now_ms: 30,
            })
            .await
            .unwrap();
    }
    session.id
}

/// Findings as (invariant, repairable) pairs.
pub fn summary(report: &InvariantReport) -> Vec<(Invariant, bool)> {
    report
        .findings
        .iter()
        .map(|f| (f.invariant, f.repairable))
        .collect()
}

/// Findings as `keel doctor` words them, ids masked: what snapshots hold.
pub fn details(report: &InvariantReport) -> Vec<String> {
    report
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
        .collect()
}

/// Replaces UUIDs (36 characters with dashes) with `<id>`.
pub fn mask_ids(text: &str) -> String {
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

/// The options of a check while no process owns the database.
fn nobody_running() -> CheckOptions {
    CheckOptions::default()
}

pub async fn what_the_commit_paths_write_is_clean_and_abandoned_runs_are_recovery_work(db: TestDb) {
    let store = db.store.clone();
    busy_store(&store).await;
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
    let report = store.check_invariants(nobody_running()).await.unwrap();
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
    let report = db
        .reopen()
        .await
        .check_invariants(nobody_running())
        .await
        .unwrap();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.checked.events, 2);
}

pub async fn a_message_count_is_recounted_only_where_it_drifted(db: TestDb) {
    let store = db.store.clone();
    let session = busy_store(&store).await;
    store.activate_runtime("second".into(), 50).await.unwrap();
    assert_eq!(store.recount_message_counts().await.unwrap(), 0);
    let record = store.get_session(session).await.unwrap().unwrap();
    assert_eq!(record.message_count, 2);
}

pub async fn a_decoder_that_rejects_a_state_is_a_checkpoint_finding(db: TestDb) {
    let store = db.store.clone();
    busy_store(&store).await;
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
    let report = store.check_invariants(options).await.unwrap();
    // Two checkpoints at turn 2 (one per branch) and the head of the session.
    assert_eq!(
        summary(&report),
        [(Invariant::Checkpoints, false); 3],
        "{report:#?}"
    );
}

pub async fn an_image_reference_without_its_image_is_reported(db: TestDb) {
    let store = db.store.clone();
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
    let report = store.check_invariants(nobody_running()).await.unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
    let missing = "0".repeat(64);
    store
        .commit_turn(turn(session.id, with_image(&missing), 2))
        .await
        .unwrap();
    let report = store.check_invariants(nobody_running()).await.unwrap();
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

/// A turn paused for approval commits (with its checkpoint) a history that
/// ends in calls without results: its approval rows will answer them, so
/// it is waiting, not half done — while decided too, until the results
/// settle the rows. A call no approval waits for stays a finding.
pub async fn a_turn_paused_for_approval_is_waiting_not_half_done(db: TestDb) {
    let store = db.store.clone();
    let session = store.create_session(new_session("d", 1)).await.unwrap().id;
    let calls = vec![
        ToolCall {
            id: "call-a".into(),
            name: "shell".into(),
            arguments: serde_json::json!({}),
        },
        ToolCall {
            id: "call-b".into(),
            name: "shell".into(),
            arguments: serde_json::json!({}),
        },
    ];
    let approvals: Vec<crate::NewApproval> = calls
        .iter()
        .map(|c| crate::NewApproval {
            id: keel_core::ApprovalId::new(),
            agent_id: keel_core::AgentId::parse("root").unwrap(),
            call: c.clone(),
            expires_at_ms: 1_000_000,
        })
        .collect();
    let first = approvals[0].id;
    store
        .commit_paused_turn(crate::PausedTurnCommit {
            turn: turn(
                session,
                vec![
                    Message::user("do things"),
                    Message::assistant_with_tools("", calls),
                ],
                1,
            ),
            turn_id: keel_core::TurnId::new(),
            approvals,
            consumed: Vec::new(),
        })
        .await
        .unwrap();
    let report = store.check_invariants(nobody_running()).await.unwrap();
    assert!(report.is_clean(), "{report:#?}");
    store
        .decide_approval(crate::DecideApproval {
            id: first,
            session_id: Some(session),
            decision: crate::Decision::Approve,
            reason: None,
            now_ms: 20,
        })
        .await
        .unwrap();
    let report = store.check_invariants(nobody_running()).await.unwrap();
    assert!(report.is_clean(), "{report:#?}");
    // Another dialog's approvals answer nothing here.
    let other = store.create_session(new_session("e", 1)).await.unwrap().id;
    store
        .append_messages(
            other,
            vec![NewMessage::new(Message::assistant_with_tools(
                "",
                vec![ToolCall {
                    id: "call-a".into(),
                    name: "shell".into(),
                    arguments: serde_json::json!({}),
                }],
            ))],
            30,
        )
        .await
        .unwrap();
    let report = store.check_invariants(nobody_running()).await.unwrap();
    assert_eq!(
        details(&report),
        [
            "history (manual): session <id>'s history ends inside a turn: tool call(s) call-a \
          have no result"
        ]
    );
}
