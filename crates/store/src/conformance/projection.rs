//! What clients read: message pages in both directions across a rollback,
//! the current branch, filtered run pages, checkpoint and run event pages,
//! and changes after a revision.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{AgentId, CheckpointId, Delivery, ExecutionMode, RunStatus, SessionId, Usage};

use crate::{
    CheckpointRecord, CheckpointSource, CompletionHandling, MessagePage, NewCheckpoint, NewSignal,
    Page, RunQuery, SignalLimits, Store, TerminalOutcome, TurnCommit,
};

use super::fixtures::*;
use super::TestDb;

/// Turn `n` of `session`: a visible question and its answer, with a checkpoint.
fn turn(session: SessionId, n: u64) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![user(&format!("q{n}")), assistant(&format!("a{n}"))],
        state: format!("s{n}").into_bytes(),
        checkpoint: Some(NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: n,
            source: CheckpointSource::Turn,
        }),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 1000,
    }
}

/// A page of three visible messages of `s`, as "seq:text".
async fn page(store: &Store, s: SessionId, newest_first: bool, cursor: Option<i64>) -> Vec<String> {
    store
        .load_message_page(
            s,
            MessagePage {
                visible_only: true,
                newest_first,
                cursor,
                limit: 3,
            },
        )
        .await
        .unwrap()
        .iter()
        .map(|m| format!("{}:{}", m.seq, m.message.text()))
        .collect()
}

/// Walks a listing one `limit` at a time; `between` runs after each page.
async fn walk<T, C, F, Fut>(mut page: F, mut between: impl AsyncFnMut()) -> Vec<T>
where
    F: FnMut(Option<C>) -> Fut,
    Fut: std::future::Future<Output = crate::Result<Page<T, C>>>,
{
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let p = page(cursor).await.unwrap();
        seen.extend(p.items);
        between().await;
        match p.next_cursor {
            Some(c) => cursor = Some(c),
            None => return seen,
        }
    }
}

pub async fn message_pages_walk_the_current_branch_both_ways(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    let mut cps = Vec::new();
    for n in 1..=3 {
        cps.push(
            store
                .commit_turn(turn(s.id, n))
                .await
                .unwrap()
                .checkpoint
                .unwrap(),
        );
    }
    // Back to turn 2, then a new turn: the history is q1 a1 q2 a2 q9 a9,
    // the last two on a new timeline.
    store
        .rollback(s.id, cps[1].id, CheckpointId::new(), 2000)
        .await
        .unwrap();
    store.commit_turn(turn(s.id, 9)).await.unwrap();
    assert_eq!(
        page(&store, s.id, false, None).await,
        ["1:q1", "2:a1", "3:q2"]
    );
    assert_eq!(
        page(&store, s.id, false, Some(3)).await,
        ["4:a2", "5:q9", "6:a9"]
    );
    assert!(page(&store, s.id, false, Some(6)).await.is_empty());
    assert_eq!(
        page(&store, s.id, true, None).await,
        ["6:a9", "5:q9", "4:a2"]
    );
    assert_eq!(
        page(&store, s.id, true, Some(4)).await,
        ["3:q2", "2:a1", "1:q1"]
    );
    let bad = store
        .load_message_page(
            s.id,
            MessagePage {
                visible_only: true,
                newest_first: false,
                cursor: None,
                limit: 0,
            },
        )
        .await;
    assert!(bad.is_err());
    // Turn 3's checkpoint is off the current branch; turn 2's is on it.
    let ranges = store.history_ranges(s.id).await.unwrap();
    let on = |c: &CheckpointRecord| {
        ranges
            .iter()
            .any(|(t, upto)| *t == c.timeline_id && c.seq <= *upto)
    };
    assert!(on(&cps[0]) && on(&cps[1]) && !on(&cps[2]));
}

pub async fn runs_filter_and_changes_come_after_a_revision(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let other = SessionId::new();
    let bg = new_run(root, ExecutionMode::Background);
    let mut fg = new_run(root, ExecutionMode::Foreground);
    fg.agent_id = AgentId::parse("writer").unwrap();
    let elsewhere = new_run(other, ExecutionMode::Foreground);
    for run in [&bg, &fg, &elsewhere] {
        store.accept_run(accept(run.clone(), 8)).await.unwrap();
    }
    let before = store.inbox_usage(root).await.unwrap().revision;
    store
        .commit_terminal(
            bg.id,
            bg.execution_id.clone(),
            TerminalOutcome::Completed {
                result: "done".into(),
                usage: Usage::new(1, 1),
                tool_calls: 0,
                iterations: 1,
                cost: None,
            },
            CompletionHandling::Deliver,
            200,
        )
        .await
        .unwrap();

    let ids = |q: RunQuery| {
        let store = store.clone();
        async move {
            let page = store.query_runs(q).await.unwrap();
            page.items.iter().map(|r| r.spec.id).collect::<Vec<_>>()
        }
    };
    let all = RunQuery {
        limit: 10,
        ..RunQuery::default()
    };
    assert_eq!(ids(all.clone()).await.len(), 3);
    let of_root = RunQuery {
        root_session_id: Some(root),
        ..all.clone()
    };
    assert_eq!(ids(of_root.clone()).await.len(), 2);
    let done = RunQuery {
        statuses: vec![RunStatus::Completed],
        ..of_root.clone()
    };
    assert_eq!(ids(done).await, [bg.id]);
    let writer = RunQuery {
        agent_id: Some(AgentId::parse("writer").unwrap()),
        ..of_root.clone()
    };
    assert_eq!(ids(writer).await, [fg.id]);
    // One item per page: the cursor walks them all, newest first.
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = store
            .query_runs(RunQuery {
                limit: 1,
                cursor,
                ..all.clone()
            })
            .await
            .unwrap();
        seen.extend(page.items.iter().map(|r| r.spec.id));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, ids(all).await);

    // The terminal commit changed the run and made its completion event,
    // both at one revision after `before`.
    let changes = store.agent_changes_since(root, before, 100).await.unwrap();
    assert_eq!(changes.revision, before + 1);
    assert_eq!(
        changes.runs.iter().map(|r| r.spec.id).collect::<Vec<_>>(),
        [bg.id]
    );
    assert_eq!(changes.events.len(), 1);
    assert_eq!(changes.events[0].revision, before + 1);
    let none = store
        .agent_changes_since(root, before + 1, 100)
        .await
        .unwrap();
    assert!(none.runs.is_empty() && none.events.is_empty());
    let events = store.run_events(bg.id, None, 10).await.unwrap();
    assert_eq!(events.items.len(), 1);
    assert_eq!(events.next_cursor, None);
}

pub async fn checkpoint_and_run_event_pages_give_every_item_once(db: TestDb) {
    let store = db.store.clone();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    for n in 1..=5 {
        store.commit_turn(turn(s.id, n)).await.unwrap();
    }
    let all = store.list_checkpoints(s.id).await.unwrap();
    assert_eq!(all.len(), 5);
    // Checkpoints taken while a client pages sort before its cursor: the
    // walk sees the five it started with, each once, newest first.
    let mut n = 10;
    let seen = walk(
        |cursor| store.checkpoint_page(s.id, cursor, 2),
        async || {
            n += 1;
            let mut later = turn(s.id, n);
            later.now_ms = 5000 + i64::try_from(n).unwrap();
            store.commit_turn(later).await.unwrap();
        },
    )
    .await;
    let ids = |cps: &[CheckpointRecord]| cps.iter().map(|c| c.id).collect::<Vec<_>>();
    assert_eq!(ids(&seen), ids(&all));
    assert!(store.checkpoint_page(s.id, None, 0).await.is_err());
    assert!(store.checkpoint_page(s.id, None, 1001).await.is_err());

    // A run's signals and completion, oldest first, one page at a time.
    let run = new_run(s.id, ExecutionMode::Background);
    store.accept_run(accept(run.clone(), 8)).await.unwrap();
    store
        .mark_run_running(run.id, run.execution_id.clone(), 110)
        .await
        .unwrap();
    for (i, key) in ["a", "b", "c"].into_iter().enumerate() {
        let signal = NewSignal {
            run_id: run.id,
            execution_id: run.execution_id.clone(),
            dedupe_key: Some(key.into()),
            delivery: Delivery::Queue,
            severity: None,
            payload_json: format!(r#"{{"summary":"{key}"}}"#),
            inbox_capacity: 8,
            limits: SignalLimits {
                max_signals: 10,
                burst: 10,
                min_interval_ms: 0,
                dedupe_window_ms: 0,
            },
            now_ms: 200 + i64::try_from(i).unwrap(),
        };
        store.insert_signal(signal).await.unwrap();
    }
    store
        .commit_terminal(
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
            300,
        )
        .await
        .unwrap();
    let whole = store.run_events(run.id, None, 100).await.unwrap().items;
    assert_eq!(whole.len(), 4);
    assert!(whole
        .windows(2)
        .all(|w| (w[0].created_at_ms, w[0].id) < (w[1].created_at_ms, w[1].id)));
    for limit in [1, 3] {
        let seen = walk(
            |cursor| store.run_events(run.id, cursor, limit),
            async || {},
        )
        .await;
        let ids: Vec<_> = seen.iter().map(|e| e.id).collect();
        assert_eq!(
            ids,
            whole.iter().map(|e| e.id).collect::<Vec<_>>(),
            "limit {limit}"
        );
    }
    assert!(store.run_events(run.id, None, 0).await.is_err());
}
