//! Purging deleted dialogs: exactly the expired deleted ones go, with every
//! row that belongs to them; live, recently deleted and forked-from
//! histories stay and read as before; the checker passes after.
#![allow(missing_docs)] // a test's name is its documentation

use super::fixtures::*;
use super::TestDb;
use crate::{
    AcceptRun, CheckOptions, CheckpointSource, CompletionHandling, DecideApproval, Decision,
    MessageFilter, NewApproval, NewCheckpoint, PausedTurnCommit, PurgeReport, Store, StoreError,
    TerminalOutcome, TurnCalls, TurnCommit,
};
use keel_core::{
    AgentId, ApprovalId, CheckpointId, ExecutionMode, SessionId, ToolCall, TurnId, Usage,
};

/// A model call of one millisecond at `at`.
fn model_call(at: i64) -> crate::CallSpan {
    crate::CallSpan {
        kind: crate::CallKind::Model,
        name: "mock/m".into(),
        call_id: None,
        started_at_ms: at,
        ended_at_ms: at + 1,
        input_tokens: Some(1),
        output_tokens: Some(1),
        status: "stop".into(),
    }
}

/// Commits `n` turns of `per_turn` messages each, a checkpoint per turn.
async fn turns(store: &Store, id: SessionId, n: u64, per_turn: usize) -> Vec<CheckpointId> {
    let mut out = Vec::new();
    for i in 0..n {
        let cp = CheckpointId::new();
        let mut messages = vec![user(&format!("q{i} of {id}"))];
        messages.extend((1..per_turn).map(|k| assistant(&format!("answer {i}.{k} of {id}"))));
        store
            .commit_turn(TurnCommit {
                calls: Some(TurnCalls {
                    turn_id: TurnId::new(),
                    spans: vec![model_call(10)],
                }),
                session_id: id,
                messages,
                state: format!("state {id} {i}").into_bytes(),
                checkpoint: Some(NewCheckpoint {
                    id: cp,
                    turn_index: i + 1,
                    source: CheckpointSource::Turn,
                }),
                visible_user_inputs: 1,
                answers: Vec::new(),
                expected_head: None,
                now_ms: 10,
            })
            .await
            .unwrap();
        out.push(cp);
    }
    out
}

/// A turn of `id` paused on one gated call, decided "approve always" (an
/// approval row and a sticky grant).
async fn approval(store: &Store, id: SessionId) {
    let call = ToolCall {
        id: "call-1".into(),
        name: "shell".into(),
        arguments: serde_json::json!({"command": "ls"}),
    };
    let approval = ApprovalId::new();
    store
        .commit_paused_turn(PausedTurnCommit {
            turn: TurnCommit {
                calls: None,
                session_id: id,
                messages: vec![
                    user("list the files"),
                    crate::NewMessage::new(keel_core::Message::assistant_with_tools(
                        "",
                        vec![call.clone()],
                    )),
                ],
                state: format!("state {id} paused").into_bytes(),
                checkpoint: None,
                visible_user_inputs: 1,
                answers: Vec::new(),
                expected_head: None,
                now_ms: 10,
            },
            turn_id: TurnId::new(),
            approvals: vec![NewApproval {
                id: approval,
                agent_id: AgentId::parse("root").unwrap(),
                call,
                expires_at_ms: 1_000_000,
            }],
            consumed: Vec::new(),
        })
        .await
        .unwrap();
    store
        .decide_approval(DecideApproval {
            id: approval,
            session_id: Some(id),
            decision: Decision::ApproveAlways,
            reason: None,
            now_ms: 20,
        })
        .await
        .unwrap();
    assert_eq!(store.approval_grants(id).await.unwrap(), ["shell"]);
}

/// A background run of `root` with a child run, both completed, the
/// parent's completion in the inbox.
async fn runs(store: &Store, root: SessionId) {
    let parent = new_run(root, ExecutionMode::Background);
    let mut child = new_run(root, ExecutionMode::Foreground);
    child.parent_run_id = Some(parent.id);
    child.depth = 2;
    for run in [&parent, &child] {
        store
            .accept_run(AcceptRun {
                run: run.clone(),
                inbox_capacity: 8,
                now_ms: 100,
            })
            .await
            .unwrap();
    }
    for run in [&child, &parent] {
        store
            .commit_run_end(
                run.id,
                run.execution_id.clone(),
                TerminalOutcome::Completed {
                    result: "done".into(),
                    usage: Usage::new(1, 1),
                    tool_calls: 0,
                    iterations: 1,
                    cost: None,
                },
                CompletionHandling::Deliver,
                110,
                vec![model_call(105)],
            )
            .await
            .unwrap();
    }
}

/// Rows anywhere that name `id`.
async fn rows_of(db: &TestDb, id: SessionId) -> Vec<(&'static str, i64)> {
    let mut out = Vec::new();
    for (table, sql) in [
        (
            "sessions",
            "SELECT count(*) FROM sessions WHERE id = '{id}'",
        ),
        (
            "messages",
            "SELECT count(*) FROM messages WHERE session_id = '{id}'",
        ),
        (
            "timelines",
            "SELECT count(*) FROM timelines WHERE session_id = '{id}'",
        ),
        (
            "checkpoints",
            "SELECT count(*) FROM checkpoints WHERE session_id = '{id}'",
        ),
        (
            "runs",
            "SELECT count(*) FROM agent_runs WHERE root_session_id = '{id}'",
        ),
        (
            "groups",
            "SELECT count(*) FROM agent_run_groups WHERE root_session_id = '{id}'",
        ),
        (
            "events",
            "SELECT count(*) FROM agent_inbox_events WHERE root_session_id = '{id}'",
        ),
        (
            "counters",
            "SELECT count(*) FROM agent_session_state WHERE root_session_id = '{id}'",
        ),
        (
            "queued",
            "SELECT count(*) FROM queued_inputs WHERE session_id = '{id}'",
        ),
        (
            "call spans",
            "SELECT count(*) FROM call_spans WHERE session_id = '{id}'",
        ),
        (
            "approvals",
            "SELECT count(*) FROM tool_approvals WHERE session_id = '{id}'",
        ),
        (
            "grants",
            "SELECT count(*) FROM tool_approval_grants WHERE session_id = '{id}'",
        ),
    ] {
        let n = db.scalar(&sql.replace("{id}", &id.to_string())).await;
        if n > 0 {
            out.push((table, n));
        }
    }
    out
}

/// What a dialog reads: its history's texts and each checkpoint's.
async fn reads(store: &Store, id: SessionId) -> (Vec<String>, Vec<(CheckpointId, Vec<String>)>) {
    let texts = |m: Vec<crate::StoredMessage>| m.iter().map(|m| m.message.text()).collect();
    let history = texts(
        store
            .load_messages(id, MessageFilter::default())
            .await
            .unwrap(),
    );
    let mut checkpoints = Vec::new();
    for cp in store.list_checkpoints(id).await.unwrap() {
        let at = store
            .load_messages_at_checkpoint(cp.id, MessageFilter::default())
            .await
            .unwrap();
        checkpoints.push((cp.id, texts(at)));
    }
    (history, checkpoints)
}

async fn assert_clean(store: &Store) {
    let report = store
        .check_invariants(CheckOptions::default())
        .await
        .unwrap();
    assert!(report.is_clean(), "{report:#?}");
}

pub async fn a_purge_removes_the_expired_deleted_dialogs_and_every_row_of_theirs(db: TestDb) {
    let store = db.store.clone();
    let live = store
        .create_session(new_session("live", 1))
        .await
        .unwrap()
        .id;
    turns(&store, live, 4, 2).await;
    runs(&store, live).await;
    // Expired: a rollback branch, runs with a completion, and one turn of
    // more messages than a batch removes.
    let old = store
        .create_session(new_session("old", 2))
        .await
        .unwrap()
        .id;
    let cps = turns(&store, old, 6, 2).await;
    store
        .rollback(old, cps[2], CheckpointId::new(), 20)
        .await
        .unwrap();
    turns(&store, old, 1, 5_200).await;
    runs(&store, old).await;
    approval(&store, old).await;
    let recent = store
        .create_session(new_session("recent", 3))
        .await
        .unwrap()
        .id;
    turns(&store, recent, 3, 2).await;
    let before_live = reads(&store, live).await;
    let before_recent = reads(&store, recent).await;

    assert!(store.soft_delete_session(old, 1_000).await.unwrap());
    assert!(store.soft_delete_session(recent, 9_000).await.unwrap());
    assert_eq!(store.deleted_sessions_before(5_000).await.unwrap(), [old]);
    // A dialog that is not deleted is never purged.
    let refused = store.purge_session(live).await.unwrap_err();
    assert!(matches!(refused, StoreError::InvalidInput(_)), "{refused}");

    let report = store.purge_session(old).await.unwrap();
    let blobs = store.sweep_state_blobs().await.unwrap();
    assert_eq!(
        report,
        PurgeReport {
            dialogs: 1,
            dialogs_kept_for_forks: 0,
            // Six turns of two, one of 5,200, the paused one's two.
            messages: 6 * 2 + 5_200 + 2,
            checkpoints: 6 + 1 + 1,
            timelines: 2,
            runs: 2,
            events: 1,
            blobs: 0,
        }
    );
    // Six states (the turn after the rollback repeats the first one) and
    // the paused turn's.
    assert_eq!(blobs, 7, "the states only the purged dialog held");
    assert_eq!(
        rows_of(&db, old).await,
        [],
        "no row of the purged dialog is left"
    );
    assert!(
        rows_of(&db, live)
            .await
            .iter()
            .any(|(t, n)| *t == "call spans" && *n > 0),
        "a live dialog's call spans stay"
    );
    assert!(store.get_session(old).await.unwrap().is_none());
    assert_eq!(reads(&store, live).await, before_live);
    assert_eq!(reads(&store, recent).await, before_recent);
    assert_eq!(
        store.list_runs(live, None, 10).await.unwrap().items.len(),
        2
    );
    assert_eq!(store.list_inbox_events(live).await.unwrap().len(), 1);
    assert_clean(&store).await;
    // A second purge of the same dialog finds nothing.
    let again = store.purge_session(old).await.unwrap_err();
    assert!(matches!(again, StoreError::NotFound(_)), "{again}");
}

pub async fn a_dialog_forked_from_keeps_the_shared_history_until_the_fork_is_purged(db: TestDb) {
    let store = db.store.clone();
    let source = store
        .create_session(new_session("source", 1))
        .await
        .unwrap()
        .id;
    let cps = turns(&store, source, 5, 2).await;
    let (fork, _) = store
        .fork(cps[2], new_session("fork", 2), CheckpointId::new())
        .await
        .unwrap();
    turns(&store, fork.id, 2, 2).await;
    let before_fork = reads(&store, fork.id).await;
    assert!(store.soft_delete_session(source, 100).await.unwrap());

    let report = store.purge_session(source).await.unwrap();
    assert_eq!(report.dialogs, 0);
    assert_eq!(report.dialogs_kept_for_forks, 1);
    assert_eq!(report.checkpoints, 5);
    assert_eq!(report.messages, 0, "the fork shares the source's timeline");
    assert_eq!(reads(&store, fork.id).await.0, before_fork.0);
    store.sweep_state_blobs().await.unwrap();
    assert_clean(&store).await;

    // The fork deleted too: newest created first, the fork goes, then the source.
    assert!(store.soft_delete_session(fork.id, 200).await.unwrap());
    let order = store.deleted_sessions_before(200).await.unwrap();
    assert_eq!(order, [fork.id, source]);
    let mut total = PurgeReport::default();
    for id in order {
        total.add(&store.purge_session(id).await.unwrap());
    }
    assert_eq!(total.dialogs, 2);
    assert_eq!(total.messages, 2 * 2 + 5 * 2);
    store.sweep_state_blobs().await.unwrap();
    assert_eq!(rows_of(&db, source).await, []);
    assert_eq!(rows_of(&db, fork.id).await, []);
    let blobs = db.scalar("SELECT count(*) FROM state_blobs").await;
    assert_eq!(blobs, 0);
    assert_clean(&store).await;
}

pub async fn dialog_usage_counts_its_own_rows_and_checkpoints(db: TestDb) {
    let store = db.store.clone();
    let a = store.create_session(new_session("a", 1)).await.unwrap().id;
    let b = store.create_session(new_session("b", 1)).await.unwrap().id;
    let empty = store.dialog_usage(a).await.unwrap();
    assert_eq!(empty.checkpoints, 0);
    turns(&store, a, 3, 2).await;
    let three = store.dialog_usage(a).await.unwrap();
    assert_eq!(three.checkpoints, 3);
    // Another dialog's rows are not a's.
    turns(&store, b, 5, 2).await;
    runs(&store, b).await;
    assert_eq!(store.dialog_usage(a).await.unwrap(), three);
    assert_eq!(store.dialog_usage(b).await.unwrap().checkpoints, 5);
    // A turn with a 10,000-byte answer adds its stored bytes: about its
    // JSON at most (SQLite stores it compressed, far fewer).
    store
        .commit_turn(TurnCommit {
            calls: None,
            session_id: a,
            messages: vec![user("q"), assistant(&"x".repeat(10_000))],
            state: b"s".to_vec(),
            checkpoint: None,
            visible_user_inputs: 1,
            answers: Vec::new(),
            expected_head: None,
            now_ms: 20,
        })
        .await
        .unwrap();
    let four = store.dialog_usage(a).await.unwrap();
    assert_eq!(four.checkpoints, 3);
    let grown = four.stored_bytes - three.stored_bytes;
    assert!((20..11_000).contains(&grown), "{three:?} -> {four:?}");
}

pub async fn deleted_dialogs_are_listed_newest_created_first_then_last_written_first(db: TestDb) {
    let store = db.store.clone();
    // Ids are the caller's: the one written second sorts first here.
    let (first_id, second_id) = (SessionId::new(), SessionId::new());
    let mut ids = Vec::new();
    for (id, dialog, created) in [
        (second_id, "b", 5),
        (first_id, "a", 5),
        (SessionId::new(), "older", 4),
        (SessionId::new(), "newer", 6),
        (SessionId::new(), "live", 7),
    ] {
        let mut session = new_session(dialog, created);
        session.id = id;
        ids.push(store.create_session(session).await.unwrap().id);
    }
    for (i, id) in ids[..4].iter().enumerate() {
        let deleted_at = 100 + i64::try_from(i).unwrap();
        assert!(store.soft_delete_session(*id, deleted_at).await.unwrap());
    }
    assert_eq!(
        store.deleted_sessions_before(1_000).await.unwrap(),
        [ids[3], first_id, second_id, ids[2]]
    );
    assert_eq!(
        store.deleted_sessions_before(101).await.unwrap(),
        [first_id, second_id],
        "deleted at or before the cutoff"
    );
}
