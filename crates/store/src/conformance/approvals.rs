//! Tool approvals: a paused turn commits its history with one pending row
//! per gated call; a decision (or expiry) is committed exactly once, even
//! when several race; an approved call starts once; its result, or a new
//! input superseding it, settles the row; a deleted dialog waits for none.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{AgentId, ApprovalId, Message, SessionId, ToolCall, TurnId};

use crate::{
    ApprovalRecord, ApprovalResultCommit, ApprovalSchedule, ApprovalStatus, DecideApproval,
    DecideOutcome, Decision, NewApproval, NewMessage, PausedTurnCommit, Store, StoreError,
    TurnCommit,
};

use super::fixtures::*;
use super::TestDb;

fn call(id: &str, tool: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: tool.into(),
        arguments: serde_json::json!({ "command": id }),
    }
}

fn turn(session: SessionId, messages: Vec<NewMessage>, now_ms: i64) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages,
        state: b"{}".to_vec(),
        checkpoint: None,
        visible_user_inputs: 0,
        answers: Vec::new(),
        expected_head: None,
        now_ms,
    }
}

/// Pauses a turn of `session` on `calls` (tool names), each expiring at
/// `expires_at_ms`; returns the turn and its approval ids, in call order.
async fn pause(
    store: &Store,
    session: SessionId,
    calls: &[&str],
    expires_at_ms: i64,
) -> (TurnId, Vec<ApprovalId>) {
    let calls: Vec<ToolCall> = calls
        .iter()
        .enumerate()
        .map(|(i, tool)| call(&format!("call-{i}"), tool))
        .collect();
    let turn_id = TurnId::new();
    let approvals: Vec<NewApproval> = calls
        .iter()
        .map(|c| NewApproval {
            id: ApprovalId::new(),
            agent_id: AgentId::parse("root").unwrap(),
            call: c.clone(),
            expires_at_ms,
        })
        .collect();
    let ids = approvals.iter().map(|a| a.id).collect();
    let messages = vec![
        user("do things"),
        NewMessage::new(Message::assistant_with_tools("", calls)),
    ];
    store
        .commit_paused_turn(PausedTurnCommit {
            turn: turn(session, messages, 10),
            turn_id,
            approvals,
            consumed: Vec::new(),
        })
        .await
        .unwrap();
    (turn_id, ids)
}

fn decide(id: ApprovalId, decision: Decision, now_ms: i64) -> DecideApproval {
    DecideApproval {
        id,
        session_id: None,
        decision,
        reason: None,
        now_ms,
    }
}

/// Settles `ids` with one tool result each (`supersede`: as superseded).
fn results(
    session: SessionId,
    ids: &[ApprovalId],
    supersede: Option<&str>,
    now_ms: i64,
) -> ApprovalResultCommit {
    let messages = (0..ids.len())
        .map(|i| NewMessage::new(Message::tool_result(format!("call-{i}"), "shell", "ok")))
        .collect();
    ApprovalResultCommit {
        turn: turn(session, messages, now_ms),
        settle: ids.to_vec(),
        supersede: supersede.map(str::to_owned),
    }
}

fn ids(records: &[ApprovalRecord]) -> Vec<ApprovalId> {
    records.iter().map(|a| a.id).collect()
}

pub async fn a_paused_turn_commits_its_history_with_one_pending_row_per_gated_call(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let empty = store
        .commit_paused_turn(PausedTurnCommit {
            turn: turn(s.id, vec![user("hi")], 5),
            turn_id: TurnId::new(),
            approvals: Vec::new(),
            consumed: Vec::new(),
        })
        .await;
    assert!(
        matches!(empty, Err(StoreError::InvalidInput(_))),
        "{empty:?}"
    );
    assert!(store
        .load_messages(s.id, Default::default())
        .await
        .unwrap()
        .is_empty());

    let (turn_id, asked) = pause(&store, s.id, &["shell", "fetch"], 1_000).await;
    assert_eq!(
        store
            .load_messages(s.id, Default::default())
            .await
            .unwrap()
            .len(),
        2,
        "the turn's history is committed with its approvals"
    );
    let pending = store.list_approvals(s.id, true).await.unwrap();
    // Asked at the same time: listed by id, which orders them as asked.
    assert_eq!(ids(&pending), asked);
    let first = &pending[0];
    assert_eq!(
        (first.session_id, first.turn_id, first.run_id),
        (s.id, turn_id, None)
    );
    assert_eq!(
        (first.tool_call_id.as_str(), first.tool_name.as_str()),
        ("call-0", "shell")
    );
    let args: serde_json::Value = serde_json::from_str(&first.arguments).unwrap();
    assert_eq!(args, serde_json::json!({ "command": "call-0" }));
    assert_eq!(first.status, ApprovalStatus::Pending);
    assert!(!first.always);
    assert_eq!((first.created_at_ms, first.expires_at_ms), (10, 1_000));
    assert_eq!(
        (
            first.decided_at_ms,
            first.executing_at_ms,
            first.settled_at_ms
        ),
        (None, None, None)
    );
    assert_eq!(
        pending[1].revision, first.revision,
        "one revision for the commit"
    );
    assert_eq!(
        store.get_approval(asked[1]).await.unwrap().as_ref(),
        pending.get(1)
    );
    assert_eq!(store.get_approval(ApprovalId::new()).await.unwrap(), None);
    assert_eq!(
        store.unsettled_approvals(s.id, turn_id).await.unwrap(),
        pending
    );
    assert_eq!(
        store.approval_schedule(s.id, 20).await.unwrap(),
        ApprovalSchedule {
            pending: 2,
            expired: 0,
            next_expiry_at_ms: Some(1_000),
            resumable: None,
            resumable_runs: Vec::new(),
        }
    );
    // Read together with the inbox's, the same answers.
    assert_eq!(
        store.schedules(s.id, 20, 1_000).await.unwrap(),
        (
            store.approval_schedule(s.id, 20).await.unwrap(),
            store.inbox_schedule(s.id, 20, 1_000).await.unwrap()
        )
    );
    assert!(matches!(
        store.schedules(SessionId::new(), 20, 1_000).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(store.sessions_with_open_approvals().await.unwrap(), [s.id]);
    assert!(matches!(
        store.list_approvals(SessionId::new(), false).await,
        Err(StoreError::NotFound(_))
    ));
}

pub async fn a_decision_commits_once_and_approve_always_grants_the_tool(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let other = store.create_session(new_session("b", 1)).await.unwrap();
    let (turn_id, asked) = pause(&store, s.id, &["shell", "fetch", "shell"], 1_000).await;
    let before = store.get_approval(asked[0]).await.unwrap().unwrap();

    // Another dialog's decision, or an unknown approval: not found.
    let mut foreign = decide(asked[0], Decision::Approve, 20);
    foreign.session_id = Some(other.id);
    assert!(matches!(
        store.decide_approval(foreign).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store
            .decide_approval(decide(ApprovalId::new(), Decision::Approve, 20))
            .await,
        Err(StoreError::NotFound(_))
    ));

    let mut always = decide(asked[0], Decision::ApproveAlways, 20);
    always.session_id = Some(s.id);
    let DecideOutcome::Decided(a) = store.decide_approval(always).await.unwrap() else {
        panic!("the first decision commits");
    };
    assert_eq!(
        (a.status, a.always, a.decided_at_ms),
        (ApprovalStatus::Approved, true, Some(20))
    );
    assert!(a.revision > before.revision);
    assert_eq!(store.approval_grants(s.id).await.unwrap(), ["shell"]);
    // A second decision changes nothing.
    let again = store
        .decide_approval(decide(asked[0], Decision::Deny, 30))
        .await
        .unwrap();
    assert_eq!(again, DecideOutcome::AlreadyDecided(a.clone()));

    let mut deny = decide(asked[1], Decision::Deny, 40);
    deny.reason = Some("not now".into());
    let DecideOutcome::Decided(denied) = store.decide_approval(deny).await.unwrap() else {
        panic!("the denial commits");
    };
    assert_eq!(
        (denied.status, denied.always, denied.reason.as_deref()),
        (ApprovalStatus::Denied, false, Some("not now"))
    );
    assert_eq!(
        store.approval_schedule(s.id, 50).await.unwrap().resumable,
        None
    );
    let DecideOutcome::Decided(once) = store
        .decide_approval(decide(asked[2], Decision::Approve, 50))
        .await
        .unwrap()
    else {
        panic!("the last decision commits");
    };
    assert!(!once.always);
    // The grant stays the first "always" one.
    assert_eq!(store.approval_grants(s.id).await.unwrap(), ["shell"]);
    assert!(store.list_approvals(s.id, true).await.unwrap().is_empty());
    assert_eq!(store.list_approvals(s.id, false).await.unwrap().len(), 3);
    let schedule = store.approval_schedule(s.id, 60).await.unwrap();
    assert_eq!(
        (
            schedule.pending,
            schedule.next_expiry_at_ms,
            schedule.resumable
        ),
        (0, None, Some(turn_id)),
        "every row decided: the turn resumes"
    );
    assert!(store.approval_grants(other.id).await.unwrap().is_empty());
}

pub async fn racing_decisions_commit_exactly_one(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let (_, asked) = pause(&store, s.id, &["shell"], 1_000).await;
    let id = asked[0];
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let store = db.store.clone();
            let decision = if i % 2 == 0 {
                Decision::Approve
            } else {
                Decision::Deny
            };
            tokio::spawn(async move {
                store
                    .decide_approval(decide(id, decision, 20 + i))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut decided = Vec::new();
    let mut already = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            DecideOutcome::Decided(a) => decided.push(a),
            DecideOutcome::AlreadyDecided(a) => already.push(a),
            DecideOutcome::Expired(a) => panic!("not expired: {a:?}"),
        }
    }
    assert_eq!(decided.len(), 1, "{decided:?}");
    let winner = &decided[0];
    assert!(
        already.iter().all(|a| a == winner),
        "every other saw the winner"
    );
    assert_eq!(
        store.get_approval(asked[0]).await.unwrap().as_ref(),
        Some(winner)
    );
}

pub async fn an_approval_past_its_expiry_is_recorded_expired_once(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let (turn_id, early) = pause(&store, s.id, &["shell", "fetch"], 100).await;
    let (_, late) = pause(&store, s.id, &["shell"], 500).await;
    assert!(store.expire_approvals(s.id, 99).await.unwrap().is_empty());
    let schedule = store.approval_schedule(s.id, 150).await.unwrap();
    assert_eq!(
        (
            schedule.pending,
            schedule.expired,
            schedule.next_expiry_at_ms
        ),
        (3, 2, Some(100))
    );

    // Deciding an expired approval records the expiry of every due one.
    let outcome = store
        .decide_approval(decide(early[1], Decision::Approve, 150))
        .await
        .unwrap();
    let DecideOutcome::Expired(a) = outcome else {
        panic!("expired: {outcome:?}");
    };
    assert_eq!(
        (a.status, a.decided_at_ms, a.reason.as_deref()),
        (
            ApprovalStatus::Expired,
            Some(150),
            Some("nobody decided in time")
        )
    );
    let first = store.get_approval(early[0]).await.unwrap().unwrap();
    assert_eq!(
        (first.status, first.revision),
        (ApprovalStatus::Expired, a.revision)
    );
    assert!(store.expire_approvals(s.id, 200).await.unwrap().is_empty());
    assert_eq!(
        store.approval_schedule(s.id, 200).await.unwrap().resumable,
        Some(turn_id),
        "an expiry is a denial: the turn resumes"
    );

    let expired = store.expire_approvals(s.id, 500).await.unwrap();
    assert_eq!(ids(&expired), late);
    assert_eq!(expired[0].status, ApprovalStatus::Expired);
    assert!(store.expire_approvals(s.id, 600).await.unwrap().is_empty());
    assert!(matches!(
        store
            .decide_approval(decide(late[0], Decision::Approve, 600))
            .await
            .unwrap(),
        DecideOutcome::AlreadyDecided(_)
    ));
}

pub async fn an_approved_call_starts_once_and_its_result_settles_the_rows(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let (turn_id, asked) = pause(&store, s.id, &["shell", "shell"], 1_000).await;
    // A pending call may not start.
    assert!(matches!(
        store.begin_approved_execution(asked[0], 15).await,
        Err(StoreError::Stale(_))
    ));
    store
        .decide_approval(decide(asked[0], Decision::Approve, 20))
        .await
        .unwrap();
    store
        .decide_approval(decide(asked[1], Decision::Deny, 20))
        .await
        .unwrap();
    assert!(store.begin_approved_execution(asked[0], 30).await.unwrap());
    assert!(
        !store.begin_approved_execution(asked[0], 31).await.unwrap(),
        "it started already"
    );
    assert_eq!(
        store
            .get_approval(asked[0])
            .await
            .unwrap()
            .unwrap()
            .executing_at_ms,
        Some(30)
    );
    assert!(matches!(
        store.begin_approved_execution(asked[1], 30).await,
        Err(StoreError::Stale(_))
    ));
    assert!(matches!(
        store.begin_approved_execution(ApprovalId::new(), 30).await,
        Err(StoreError::Stale(_))
    ));

    let committed = store
        .commit_approval_results(results(s.id, &asked, None, 40))
        .await
        .unwrap();
    assert_eq!(committed.seqs, [3, 4]);
    assert!(store
        .unsettled_approvals(s.id, turn_id)
        .await
        .unwrap()
        .is_empty());
    let settled = store.list_approvals(s.id, false).await.unwrap();
    assert!(settled.iter().all(|a| a.settled_at_ms == Some(40)));
    assert_eq!(
        settled[1].status,
        ApprovalStatus::Denied,
        "settling keeps the decision"
    );
    assert!(store
        .sessions_with_open_approvals()
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.approval_schedule(s.id, 50).await.unwrap(),
        ApprovalSchedule::default()
    );
    // A settled call never starts, and is never settled twice (nothing is written).
    assert!(matches!(
        store.begin_approved_execution(asked[0], 50).await,
        Err(StoreError::Stale(_))
    ));
    assert!(matches!(
        store
            .commit_approval_results(results(s.id, &asked[..1], None, 60))
            .await,
        Err(StoreError::Stale(_))
    ));
    assert_eq!(
        store
            .load_messages(s.id, Default::default())
            .await
            .unwrap()
            .len(),
        4
    );
}

pub async fn new_input_supersedes_pending_approvals_and_only_those(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let (turn_id, asked) = pause(&store, s.id, &["shell", "fetch"], 1_000).await;
    store
        .decide_approval(decide(asked[0], Decision::Approve, 20))
        .await
        .unwrap();
    // One of them is decided: superseding both is refused as a whole.
    assert!(matches!(
        store
            .commit_approval_results(results(s.id, &asked, Some("the user moved on"), 30))
            .await,
        Err(StoreError::Stale(_))
    ));
    assert_eq!(
        store
            .load_messages(s.id, Default::default())
            .await
            .unwrap()
            .len(),
        2,
        "the refused commit wrote nothing"
    );
    // Settling a pending one as decided is refused too.
    assert!(matches!(
        store
            .commit_approval_results(results(s.id, &asked[1..], None, 30))
            .await,
        Err(StoreError::Stale(_))
    ));
    store
        .commit_approval_results(results(s.id, &asked[1..], Some("the user moved on"), 30))
        .await
        .unwrap();
    let superseded = store.get_approval(asked[1]).await.unwrap().unwrap();
    assert_eq!(
        (
            superseded.status,
            superseded.reason.as_deref(),
            superseded.decided_at_ms,
            superseded.settled_at_ms
        ),
        (
            ApprovalStatus::Superseded,
            Some("the user moved on"),
            Some(30),
            Some(30)
        )
    );
    let open = store.unsettled_approvals(s.id, turn_id).await.unwrap();
    assert_eq!(ids(&open), asked[..1]);
    // Another dialog's approval is not this dialog's to settle.
    let other = store.create_session(new_session("b", 1)).await.unwrap();
    assert!(matches!(
        store
            .commit_approval_results(results(other.id, &asked[..1], None, 40))
            .await,
        Err(StoreError::Stale(_))
    ));
}

pub async fn a_deleted_dialogs_approvals_wait_for_nothing(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let kept = store.create_session(new_session("b", 1)).await.unwrap();
    let (_, asked) = pause(&store, s.id, &["shell"], 100).await;
    pause(&store, kept.id, &["shell"], 100).await;
    let mut open = vec![s.id, kept.id];
    open.sort_by_key(ToString::to_string);
    assert_eq!(store.sessions_with_open_approvals().await.unwrap(), open);
    assert!(store.soft_delete_session(s.id, 50).await.unwrap());
    assert_eq!(
        store.sessions_with_open_approvals().await.unwrap(),
        [kept.id]
    );
    assert_eq!(
        store.approval_schedule(s.id, 200).await.unwrap(),
        ApprovalSchedule::default()
    );
    assert!(matches!(
        store
            .decide_approval(decide(asked[0], Decision::Approve, 60))
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(
        store.get_approval(asked[0]).await.unwrap().unwrap().status,
        ApprovalStatus::Pending
    );
}

pub async fn a_run_waiting_for_approval_is_resumable_once_its_approvals_are_decided(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("a", 1)).await.unwrap();
    let (turn_id, _) = pause(&store, s.id, &["shell"], 900).await;
    let mut run = new_run(s.id, keel_core::ExecutionMode::Background);
    run.root_turn_id = Some(turn_id);
    store
        .accept_run(crate::AcceptRun {
            run: run.clone(),
            inbox_capacity: 4,
            now_ms: 20,
        })
        .await
        .unwrap();
    assert!(store
        .mark_run_running(run.id, run.execution_id.clone(), 21)
        .await
        .unwrap());
    let asked = ApprovalId::new();
    let paused = store
        .commit_paused_run(crate::PausedRunCommit {
            run_id: run.id,
            execution_id: run.execution_id.clone(),
            turn_id,
            messages: vec![Message::user("look things up")],
            usage: keel_core::Usage::new(1, 1),
            iterations: 1,
            tool_calls: 0,
            remaining_ms: 60_000,
            approvals: vec![NewApproval {
                id: asked,
                agent_id: AgentId::parse("researcher").unwrap(),
                call: call("run-call", "fetch"),
                expires_at_ms: 500,
            }],
            calls: Vec::new(),
            now_ms: 30,
        })
        .await
        .unwrap();
    assert!(paused);
    let a = store.get_approval(asked).await.unwrap().unwrap();
    assert_eq!((a.run_id, a.turn_id), (Some(run.id), turn_id));
    // The run's approval is not the root turn's: it neither counts as the
    // turn's pending nor is among its unsettled ones, but it expires.
    let schedule = store.approval_schedule(s.id, 600).await.unwrap();
    assert_eq!(
        (
            schedule.pending,
            schedule.expired,
            schedule.next_expiry_at_ms,
            schedule.resumable_runs.len()
        ),
        (1, 1, Some(500), 0)
    );
    assert_eq!(
        store
            .unsettled_approvals(s.id, turn_id)
            .await
            .unwrap()
            .len(),
        1
    );
    store
        .decide_approval(decide(asked, Decision::Approve, 40))
        .await
        .unwrap();
    let schedule = store.approval_schedule(s.id, 50).await.unwrap();
    assert_eq!(schedule.resumable_runs, [run.id]);
    assert_eq!(schedule.resumable, None, "the root turn still waits");
}
