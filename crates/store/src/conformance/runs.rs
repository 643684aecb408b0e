//! Runs: acceptance with completion reservations (capacity, idempotency),
//! execution-id conditional transitions, the terminal commit that converts a
//! reservation into exactly one event, groups, cancellation and listings.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{
    CompletionPolicy, Delivery, EventId, ExecutionMode, GroupId, RunStatus, SessionId, Usage,
};

use crate::{
    AcceptGroup, AcceptRun, ClaimRequest, CompletionHandling, EventStatus, EventType, GroupStatus,
    InboxUsage, NewGroup, NewRun, RunCursor, Store, StoreError, TerminalOutcome,
};

use super::fixtures::*;
use super::TestDb;

fn accept(run: NewRun, capacity: u32) -> AcceptRun {
    AcceptRun {
        run,
        inbox_capacity: capacity,
        now_ms: 100,
    }
}

fn completed(text: &str) -> TerminalOutcome {
    TerminalOutcome::Completed {
        result: text.into(),
        usage: Usage::new(10, 5),
        tool_calls: 2,
        iterations: 3,
        cost: None,
    }
}

fn group(root: SessionId, policy: CompletionPolicy) -> NewGroup {
    NewGroup {
        id: GroupId::new(),
        root_session_id: root,
        caller_run_id: None,
        caller_scope_id: "root-turn".into(),
        idempotency_key: Some("batch-1".into()),
        mode: ExecutionMode::Background,
        completion_policy: policy,
        completion_delivery: Some(Delivery::Queue),
        failure_delivery: Some(Delivery::Steer),
        deadline_at_ms: 1_000_000,
        runtime_generation: 1,
    }
}

fn claim(root: SessionId, now_ms: i64) -> ClaimRequest {
    ClaimRequest {
        root_session_id: root,
        now_ms,
        lease_ms: 60_000,
        max_events: 8,
        max_bytes: 32 * 1024,
        delivery: None,
    }
}

fn counters(pending: u64, reserved: u64) -> (u64, u64) {
    (pending, reserved)
}

async fn slots(store: &Store, root: SessionId) -> (u64, u64) {
    let c: InboxUsage = store.inbox_usage(root).await.unwrap();
    (c.pending_event_count, c.reserved_completion_slots)
}

/// A dialog with `n` pending completions of background runs.
async fn root_with_events(store: &Store, n: usize) -> (SessionId, Vec<EventId>) {
    let session = store.create_session(new_session("root", 1)).await.unwrap();
    let root = session.id;
    let mut ids = Vec::new();
    for i in 0..n {
        let run = new_run(root, ExecutionMode::Background);
        store.accept_run(accept(run.clone(), 100)).await.unwrap();
        let c = store
            .commit_terminal(
                run.id,
                run.execution_id,
                completed(&format!("r{i}")),
                CompletionHandling::Deliver,
                200 + i as i64,
            )
            .await
            .unwrap();
        ids.push(c.event_id.unwrap());
    }
    (root, ids)
}

/// A provider may report usage no SQLite integer holds; the terminal commit
/// stores it saturated instead of failing (which would leave the run stuck).
pub async fn usage_above_i64_saturates(db: TestDb) {
    let store = db.store.clone();
    let run = new_run(SessionId::new(), ExecutionMode::Foreground);
    let exec = run.execution_id.clone();
    store.accept_run(accept(run.clone(), 4)).await.unwrap();
    assert!(store
        .mark_run_running(run.id, exec.clone(), 110)
        .await
        .unwrap());
    let outcome = TerminalOutcome::Completed {
        result: "ok".into(),
        usage: Usage::new(u64::MAX, u64::MAX - 1),
        tool_calls: 0,
        iterations: 1,
        cost: None,
    };
    let commit = store
        .commit_terminal(run.id, exec, outcome, CompletionHandling::Deliver, 140)
        .await
        .unwrap();
    let max = i64::MAX as u64;
    assert_eq!(commit.run.usage, Some(Usage::new(max, max)));
}

pub async fn background_run_lifecycle_reserves_then_delivers_one_completion(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let run = new_run(root, ExecutionMode::Background);
    let exec = run.execution_id.clone();
    let accepted = store.accept_run(accept(run.clone(), 4)).await.unwrap();
    assert!(!accepted.existing);
    assert_eq!(accepted.run.status, RunStatus::Queued);
    assert!(accepted.run.completion_slot_reserved);
    assert_eq!(slots(&store, root).await, counters(0, 1));

    assert!(store
        .mark_run_running(run.id, exec.clone(), 110)
        .await
        .unwrap());
    assert!(store
        .mark_run_waiting_children(run.id, exec.clone(), 120)
        .await
        .unwrap());
    assert!(store
        .mark_run_running(run.id, exec.clone(), 130)
        .await
        .unwrap());

    let commit = store
        .commit_terminal(
            run.id,
            exec.clone(),
            completed("42"),
            CompletionHandling::Deliver,
            140,
        )
        .await
        .unwrap();
    assert!(commit.won);
    assert_eq!(commit.run.status, RunStatus::Completed);
    assert_eq!(commit.run.result.as_deref(), Some("42"));
    assert_eq!(commit.run.usage, Some(Usage::new(10, 5)));
    assert_eq!(commit.run.started_at_ms, Some(110));
    assert!(!commit.run.completion_slot_reserved);
    assert_eq!(
        slots(&store, root).await,
        counters(1, 0),
        "reservation became an event"
    );

    // A late duplicate is dropped and changes nothing.
    let late = store
        .commit_terminal(
            run.id,
            exec,
            completed("late"),
            CompletionHandling::Deliver,
            150,
        )
        .await
        .unwrap();
    assert!(!late.won);
    assert_eq!(late.run.result.as_deref(), Some("42"));
    let events = store.list_inbox_events(root).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].event_type, EventType::Completion);
    assert_eq!(Some(events[0].id), commit.event_id);
    let payload: serde_json::Value = serde_json::from_str(&events[0].payload_json).unwrap();
    assert_eq!(payload["result"], "42");
}

pub async fn execution_id_mismatch_updates_zero_rows(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let run = new_run(root, ExecutionMode::Foreground);
    store.accept_run(accept(run.clone(), 4)).await.unwrap();
    let before = store.get_run(run.id).await.unwrap().unwrap();
    let wrong = "exec-from-a-previous-life".to_string();
    assert!(!store
        .mark_run_running(run.id, wrong.clone(), 110)
        .await
        .unwrap());
    assert!(!store
        .mark_run_waiting_children(run.id, wrong.clone(), 110)
        .await
        .unwrap());
    let t = store
        .commit_terminal(
            run.id,
            wrong,
            completed("stolen"),
            CompletionHandling::Deliver,
            120,
        )
        .await
        .unwrap();
    assert!(!t.won);
    let after = store.get_run(run.id).await.unwrap().unwrap();
    assert_eq!(after, before, "not a single column changed");
    // Wrong state transition is refused too.
    assert!(!store
        .mark_run_waiting_children(run.id, run.execution_id.clone(), 130)
        .await
        .unwrap());
    // Foreground runs reserve nothing and produce no event.
    let t = store
        .commit_terminal(
            run.id,
            run.execution_id.clone(),
            completed("ok"),
            CompletionHandling::Deliver,
            140,
        )
        .await
        .unwrap();
    assert!(t.won && t.event_id.is_none());
    assert_eq!(slots(&store, root).await, counters(0, 0));
}

pub async fn two_acceptances_for_the_last_slot_exactly_one_wins(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    // Fill capacity 3 up to 2.
    for _ in 0..2 {
        store
            .accept_run(accept(new_run(root, ExecutionMode::Background), 3))
            .await
            .unwrap();
    }
    // Same store (group-committed together) and a second store on the same
    // database (another process's connections) race for the last slot.
    let other = db.reopen().await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(3));
    let mut tasks = Vec::new();
    for s in [store.clone(), store.clone(), other.clone()] {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            s.accept_run(accept(new_run(root, ExecutionMode::Background), 3))
                .await
        }));
    }
    let mut won = 0;
    let mut full = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => won += 1,
            Err(StoreError::InboxFull { capacity: 3, .. }) => full += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert_eq!((won, full), (1, 2));
    assert_eq!(slots(&store, root).await, counters(0, 3));
    let runs = store.list_runs(root, None, 100).await.unwrap();
    assert_eq!(runs.items.len(), 3, "losers left no row");
}

pub async fn idempotency_key_returns_the_existing_run_and_group(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let mut run = new_run(root, ExecutionMode::Background);
    run.idempotency_key = Some("k1".into());
    let first = store.accept_run(accept(run.clone(), 4)).await.unwrap();
    let mut retry = new_run(root, ExecutionMode::Background);
    retry.idempotency_key = Some("k1".into());
    let second = store.accept_run(accept(retry, 4)).await.unwrap();
    assert!(second.existing);
    assert_eq!(second.run.spec.id, first.run.spec.id);
    assert_eq!(
        slots(&store, root).await,
        counters(0, 1),
        "no second reservation"
    );

    let g = group(root, CompletionPolicy::All);
    let req = AcceptGroup {
        group: g.clone(),
        runs: vec![
            new_run(root, ExecutionMode::Background),
            new_run(root, ExecutionMode::Background),
        ],
        inbox_capacity: 4,
        now_ms: 100,
    };
    let a = store.accept_agent_group(req.clone()).await.unwrap();
    assert_eq!(a.runs.len(), 2);
    assert!(a
        .runs
        .iter()
        .all(|r| r.spec.idempotency_key.is_none() && r.group_id == Some(g.id)));
    let mut again = req;
    again.group.id = GroupId::new();
    let b = store.accept_agent_group(again).await.unwrap();
    assert!(b.existing);
    assert_eq!(b.group.spec.id, g.id);
    assert_eq!(slots(&store, root).await, counters(0, 2));
}

pub async fn group_all_yields_one_group_completion_after_the_last_run(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let g = group(root, CompletionPolicy::All);
    let runs = vec![
        new_run(root, ExecutionMode::Background),
        new_run(root, ExecutionMode::Background),
    ];
    let accepted = store
        .accept_agent_group(AcceptGroup {
            group: g.clone(),
            runs: runs.clone(),
            inbox_capacity: 4,
            now_ms: 100,
        })
        .await
        .unwrap();
    assert!(accepted.group.completion_slot_reserved);
    assert!(accepted.runs.iter().all(|r| !r.completion_slot_reserved));
    assert_eq!(slots(&store, root).await, counters(0, 1));

    store
        .mark_run_running(runs[0].id, runs[0].execution_id.clone(), 110)
        .await
        .unwrap();
    assert_eq!(
        store.get_group(g.id).await.unwrap().unwrap().status,
        GroupStatus::Running
    );
    let first = store
        .commit_terminal(
            runs[0].id,
            runs[0].execution_id.clone(),
            completed("a"),
            CompletionHandling::Deliver,
            120,
        )
        .await
        .unwrap();
    assert!(first.won && first.event_id.is_none() && first.finished_group.is_none());
    let last = store
        .commit_terminal(
            runs[1].id,
            runs[1].execution_id.clone(),
            TerminalOutcome::Failed {
                error: "boom".into(),
                usage: None,
            },
            CompletionHandling::Deliver,
            130,
        )
        .await
        .unwrap();
    let finished = last.finished_group.unwrap();
    assert_eq!(finished.status, GroupStatus::Partial);
    assert_eq!((finished.terminal_runs, finished.abnormal_runs), (2, 1));
    let events = store.list_inbox_events(root).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].event_type, EventType::GroupCompletion);
    assert_eq!(events[0].delivery, Delivery::Steer, "failure delivery");
    assert_eq!(slots(&store, root).await, counters(1, 0));
}

pub async fn cancel_session_cancels_runs_releases_slots_and_dead_letters_events(db: TestDb) {
    let store = db.store.clone();
    let (root, _ids) = root_with_events(&store, 2).await;
    let live = new_run(root, ExecutionMode::Background);
    store.accept_run(accept(live.clone(), 100)).await.unwrap();
    store
        .accept_agent_group(AcceptGroup {
            group: group(root, CompletionPolicy::All),
            runs: vec![new_run(root, ExecutionMode::Background)],
            inbox_capacity: 100,
            now_ms: 100,
        })
        .await
        .unwrap();
    assert_eq!(slots(&store, root).await, counters(2, 2));
    let revision_before = store.inbox_usage(root).await.unwrap().revision;
    let report = store
        .cancel_session(root, "session_deleted".into(), 500)
        .await
        .unwrap();
    // One transaction, one new client revision, stamped on every row it changed.
    let revision = store.inbox_usage(root).await.unwrap().revision;
    assert_eq!(revision, revision_before + 1);
    for id in &report.runs_cancelled {
        assert_eq!(
            store.get_run(*id).await.unwrap().unwrap().revision,
            revision
        );
    }
    let events = store.list_inbox_events(root).await.unwrap();
    assert!(events
        .iter()
        .all(|e| e.status == EventStatus::DeadLetter && e.revision == revision));
    assert_eq!(report.runs_cancelled.len(), 2);
    assert_eq!(report.reservations_released, 2);
    assert_eq!(report.events_dead_lettered, 2);
    assert_eq!(report.groups_cancelled, 1);
    assert_eq!(slots(&store, root).await, counters(0, 0));
    let run = store.get_run(live.id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Cancelled);
    // A runner finishing afterwards loses.
    let late = store
        .commit_terminal(
            live.id,
            live.execution_id,
            completed("x"),
            CompletionHandling::Deliver,
            600,
        )
        .await
        .unwrap();
    assert!(!late.won);
    assert!(store
        .claim_inbox_batch(claim(root, 700))
        .await
        .unwrap()
        .is_none());
}

pub async fn run_listing_paginates_newest_first_and_finds_children(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let parent = new_run(root, ExecutionMode::Foreground);
    store.accept_run(accept(parent.clone(), 10)).await.unwrap();
    let mut all = vec![parent.id];
    for _ in 0..6 {
        let mut child = new_run(root, ExecutionMode::Foreground);
        child.parent_run_id = Some(parent.id);
        child.depth = 2;
        store.accept_run(accept(child.clone(), 10)).await.unwrap();
        all.push(child.id);
    }
    let kids = store.child_runs(parent.id).await.unwrap();
    assert_eq!(kids.len(), 6);
    let mut seen = Vec::new();
    let mut cursor: Option<RunCursor> = None;
    loop {
        let page = store.list_runs(root, cursor, 3).await.unwrap();
        seen.extend(page.items.iter().map(|r| r.spec.id));
        // Inserts between pages do not disturb later pages.
        store
            .accept_run(AcceptRun {
                run: new_run(root, ExecutionMode::Foreground),
                inbox_capacity: 10,
                now_ms: 100,
            })
            .await
            .unwrap();
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    all.reverse();
    assert_eq!(seen, all);
}
