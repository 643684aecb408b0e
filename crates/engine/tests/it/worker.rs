//! The session worker and the session feed: turns queue and run one at a
//! time, a steer reaches the very next model call, `/stop` ends the running
//! turn, a root turn's `sleep` wakes early for what waits for it, and the
//! feed streams every turn. Synchronized through feed events and paused
//! time, never a sleep.
use std::sync::Arc;

use crate::common::*;
use keel_core::{Message, Role, ScriptedProvider, ScriptedResponse};
use keel_engine::{
    builtin_registry, BuiltinToolsConfig, EngineError, RuntimeBundle, SessionEvent, SessionManager,
    SessionManagerConfig, SteerOutcome, TurnEvent,
};
use serde_json::json;

/// A manager whose root agent has the built-in tools (sleep among them).
fn with_tools(dir: &std::path::Path, provider: &ScriptedProvider) -> Arc<SessionManager> {
    let tools = builtin_registry(&BuiltinToolsConfig::new(dir)).unwrap();
    let bundle = RuntimeBundle::new(profile("root", provider, tools));
    SessionManager::new(open_store(dir), bundle, SessionManagerConfig::default())
}

fn sleep_call(ms: u64) -> ScriptedResponse {
    ScriptedResponse::tool_call("sleep", json!({ "ms": ms }))
}

/// Texts of the messages the model saw in request `n`.
fn request_texts(provider: &ScriptedProvider, n: usize) -> Vec<(Role, String)> {
    provider.requests()[n]
        .messages
        .iter()
        .map(|m| (m.role, m.text()))
        .collect()
}

#[tokio::test]
async fn queued_turns_run_in_order_one_at_a_time_and_the_worker_leaves_when_idle() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["one", "two", "three"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let mut feed = h.manager.events().subscribe(id).await.unwrap();
    let tickets = [
        h.manager.send(id, Message::user("a")).await.unwrap(),
        h.manager.send(id, Message::user("b")).await.unwrap(),
        h.manager.send(id, Message::user("c")).await.unwrap(),
    ];
    let ids: Vec<_> = tickets.iter().map(|t| t.turn_id()).collect();
    let mut answers = Vec::new();
    for t in tickets {
        answers.push(t.outcome().await.unwrap().output.final_text());
    }
    assert_eq!(answers, ["one", "two", "three"]);
    // The feed shows each turn start, stream and commit before the next starts.
    let mut order = Vec::new();
    while let Some(e) = feed.try_recv().unwrap() {
        match e.as_ref() {
            SessionEvent::TurnStarted { turn_id, .. } => order.push(("start", *turn_id)),
            SessionEvent::TurnCommitted { turn_id, .. } => order.push(("commit", *turn_id)),
            _ => {}
        }
    }
    let expected: Vec<_> = ids
        .iter()
        .flat_map(|t| [("start", *t), ("commit", *t)])
        .collect();
    assert_eq!(order, expected);
    assert_eq!(visible_texts(&h.manager, id).await.len(), 6);
    assert_eq!(h.manager.active_workers(), 0, "no work, no worker");
}

#[tokio::test]
async fn a_full_queue_is_refused_and_unknown_sessions_fail_at_once() {
    let h = harness(SessionManagerConfig {
        user_queue: 1,
        ..SessionManagerConfig::default()
    });
    h.provider
        .push([ScriptedResponse::text("slow").delayed(3_600_000)]);
    replies(&h.provider, &["b"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let first = h.manager.send(id, Message::user("a")).await.unwrap();
    // Let the worker take `a` off the queue and start it.
    while h.manager.running_turn(id).is_none() {
        tokio::task::yield_now().await;
    }
    let second = h.manager.send(id, Message::user("b")).await.unwrap();
    let err = h.manager.send(id, Message::user("c")).await.unwrap_err();
    assert!(
        matches!(err, EngineError::SessionBusy { queued: 1 }) && err.is_retryable(),
        "{err}"
    );
    h.manager.stop(id).await.unwrap();
    assert!(first.outcome().await.unwrap_err().is_cancelled());
    assert_eq!(second.outcome().await.unwrap().output.final_text(), "b");
    let missing = keel_core::SessionId::new();
    assert!(matches!(
        h.manager.send(missing, Message::user("x")).await,
        Err(EngineError::SessionNotFound(_))
    ));
    assert!(matches!(
        h.manager.send(id, Message::assistant("x")).await,
        Err(EngineError::InvalidInput(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn a_steer_admitted_mid_turn_reaches_the_very_next_model_call() {
    let dir = tempfile::tempdir().unwrap();
    let provider = ScriptedProvider::new([sleep_call(3_600_000), ScriptedResponse::text("done")]);
    let manager = with_tools(dir.path(), &provider);
    let id = manager.create(spec("d1")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    assert_eq!(
        manager.steer(id, "too early").unwrap(),
        SteerOutcome::NoRunningTurn
    );
    let ticket = manager.send(id, Message::user("wait")).await.unwrap();
    turn_event(&mut feed, |e| matches!(e, TurnEvent::ToolStarted { .. })).await;
    assert_eq!(
        manager.steer(id, "also check the notes").unwrap(),
        SteerOutcome::Steered {
            turn_id: ticket.turn_id()
        }
    );
    let report = ticket.outcome().await.unwrap();
    assert_eq!(report.output.final_text(), "done");
    // The second model call saw the (early-ended) sleep and then the steer.
    let seen = request_texts(&provider, 1);
    let n = seen.len();
    assert_eq!(seen[n - 1], (Role::User, "also check the notes".into()));
    assert_eq!(seen[n - 2].0, Role::Tool);
    assert!(
        seen[n - 2]
            .1
            .starts_with("woke after 0 of 3600000 ms: the user sent a message for you"),
        "{}",
        seen[n - 2].1
    );
    // The steer is part of the committed turn.
    assert_eq!(
        visible_texts(&manager, id).await,
        ["wait", "", "woke after 0 of 3600000 ms: the user sent a message for you; you will read it after this tool result", "also check the notes", "done"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_steer_during_the_final_answer_gets_its_own_answer_in_the_same_turn() {
    let h = harness(SessionManagerConfig::default());
    h.provider
        .push([ScriptedResponse::text("first answer").delayed(1_000)]);
    replies(&h.provider, &["answer to the steer"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let ticket = h.manager.send(id, Message::user("q")).await.unwrap();
    while h.provider.requests().is_empty() {
        tokio::task::yield_now().await;
    }
    h.manager.steer(id, "and one more thing").unwrap();
    let report = ticket.outcome().await.unwrap();
    assert_eq!(report.output.iterations, 2);
    assert_eq!(
        visible_texts(&h.manager, id).await,
        [
            "q",
            "first answer",
            "and one more thing",
            "answer to the steer"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn sleep_wakes_for_queued_input_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    let provider = ScriptedProvider::new([
        sleep_call(60_000),
        ScriptedResponse::text("stopping here"),
        ScriptedResponse::text("answer to b"),
    ]);
    let manager = with_tools(dir.path(), &provider);
    let id = manager.create(spec("d1")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let first = manager.send(id, Message::user("a")).await.unwrap();
    turn_event(&mut feed, |e| matches!(e, TurnEvent::ToolStarted { .. })).await;
    let started = tokio::time::Instant::now();
    let second = manager.send(id, Message::user("secret b")).await.unwrap();
    let woke = turn_event(&mut feed, |e| matches!(e, TurnEvent::ToolFinished { .. })).await;
    let TurnEvent::ToolFinished { output, .. } = woke else {
        unreachable!()
    };
    assert_eq!(started.elapsed(), std::time::Duration::ZERO);
    assert!(
        output.content.ends_with(
            "the user is waiting with 1 new message(s) for after this turn; finish your answer"
        ),
        "{}",
        output.content
    );
    assert!(
        !output.content.contains("secret"),
        "queued input is counted, not shown"
    );
    first.outcome().await.unwrap();
    assert_eq!(
        second.outcome().await.unwrap().output.final_text(),
        "answer to b"
    );
}

#[tokio::test(start_paused = true)]
async fn sleep_without_a_wake_runs_its_time_and_stop_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let provider = ScriptedProvider::new([
        sleep_call(5_000),
        ScriptedResponse::text("rested"),
        sleep_call(3_600_000),
    ]);
    let manager = with_tools(dir.path(), &provider);
    let id = manager.create(spec("d1")).await.unwrap();
    let started = tokio::time::Instant::now();
    let report = manager.submit_turn(id, "rest").await.unwrap();
    assert_eq!(report.output.final_text(), "rested");
    assert_eq!(started.elapsed(), std::time::Duration::from_millis(5_000));
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let ticket = manager.send(id, Message::user("rest long")).await.unwrap();
    turn_event(&mut feed, |e| matches!(e, TurnEvent::ToolStarted { .. })).await;
    let stop = manager.stop(id).await.unwrap();
    assert_eq!(stop.turn, Some(ticket.turn_id()));
    assert!(ticket.outcome().await.unwrap_err().is_cancelled());
    loop {
        if let SessionEvent::TurnFailed {
            cancelled, message, ..
        } = feed.recv().await.unwrap().as_ref()
        {
            assert!(cancelled, "{message}");
            break;
        }
    }
    assert_eq!(manager.stop(id).await.unwrap().turn, None, "nothing runs");
}

#[tokio::test]
async fn a_feed_nobody_reads_fast_enough_reports_the_lag() {
    let h = harness(SessionManagerConfig {
        event_capacity: 2,
        ..SessionManagerConfig::default()
    });
    replies(&h.provider, &["a long answer of many words"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let mut feed = h.manager.events().subscribe(id).await.unwrap();
    h.manager.submit_turn(id, "q").await.unwrap();
    let err = feed.recv().await.unwrap_err();
    assert!(
        matches!(err, keel_engine::SubscriptionError::Lagged { skipped } if skipped > 0),
        "{err}"
    );
    // After the lag the newest events are still delivered.
    let last = feed.recv().await.unwrap();
    assert!(
        matches!(
            last.as_ref(),
            SessionEvent::Turn { .. } | SessionEvent::TurnCommitted { .. }
        ),
        "{last:?}"
    );
    drop(feed);
    assert!(!h.manager.events().has_subscribers(id));
}

#[tokio::test]
async fn stop_answers_before_the_turn_queued_behind_the_stopped_one_ends() {
    let dir = tempfile::tempdir().unwrap();
    let provider = HeldProvider::new(ScriptedProvider::new([ScriptedResponse::text("b done")]));
    let manager = manager_with(
        open_store(dir.path()),
        provider.clone(),
        SessionManagerConfig::default(),
    );
    let id = manager.create(spec("d1")).await.unwrap();
    let running = manager.send(id, Message::user("a")).await.unwrap();
    provider.wait_started().await;
    let queued = manager.send(id, Message::user("b")).await.unwrap();
    // The queued turn's model call is held until after /stop returned: a
    // stop that waited for it would never return.
    let report = tokio::time::timeout(std::time::Duration::from_secs(30), manager.stop(id))
        .await
        .expect("stop answers while the queued turn still runs")
        .unwrap();
    assert_eq!(report.turn, Some(running.turn_id()));
    assert!(running.outcome().await.unwrap_err().is_cancelled());
    provider.wait_started().await;
    assert_eq!(
        manager.running_turn(id),
        Some(queued.turn_id()),
        "the queued turn runs"
    );
    provider.release.add_permits(1);
    assert_eq!(
        queued.outcome().await.unwrap().output.final_text(),
        "b done"
    );
    assert_eq!(unanswered(&manager, id).await, ["a"]);
}

#[tokio::test]
async fn a_message_queued_behind_a_running_turn_is_committed_before_it_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let provider = HeldProvider::new(ScriptedProvider::new([
        ScriptedResponse::text("answer a"),
        ScriptedResponse::text("answer b"),
    ]));
    let store = open_store(dir.path());
    let manager = manager_with(
        store.clone(),
        provider.clone(),
        SessionManagerConfig::default(),
    );
    let id = manager.create(spec("d1")).await.unwrap();
    let a = manager.send(id, Message::user("a")).await.unwrap();
    provider.wait_started().await;
    let b = manager.send(id, Message::user("b")).await.unwrap();
    // Acknowledged means committed: `b` is in the store's queue, not yet history.
    let queued = store.queued_inputs().await.unwrap();
    assert_eq!(
        queued
            .iter()
            .map(|q| (q.turn_id, q.message.text()))
            .collect::<Vec<_>>(),
        [(b.turn_id(), "b".to_owned())]
    );
    let history = store
        .load_messages(id, keel_store::MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(
        history.iter().map(|m| m.message.text()).collect::<Vec<_>>(),
        ["a"]
    );
    provider.release.add_permits(2);
    a.outcome().await.unwrap();
    b.outcome().await.unwrap();
    // It takes its place after the answer of the turn it waited for.
    assert_eq!(
        visible_texts(&manager, id).await,
        ["a", "answer a", "b", "answer b"]
    );
    assert!(store.queued_inputs().await.unwrap().is_empty());
}

#[tokio::test]
async fn inputs_a_dead_process_acknowledged_run_in_order_on_resume() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["one", "two"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let mut feed = h.manager.events().subscribe(id).await.unwrap();
    // What an earlier process acknowledged and never started.
    let store = h.manager.store();
    let mut queued = Vec::new();
    for text in ["first", "second"] {
        let turn_id = keel_core::TurnId::new();
        store
            .queue_input(keel_store::QueuedInput {
                session_id: id,
                turn_id,
                message: Message::user(text),
                queued_at_ms: 1,
                webhook: None,
            })
            .await
            .unwrap();
        queued.push(turn_id);
    }
    // Each resumed turn is announced before it is queued, under its own id.
    let mut adopted = Vec::new();
    let resumed = h.manager.resume_queued(|_, turn| adopted.push(turn)).await;
    assert_eq!(resumed.unwrap(), 2);
    assert_eq!(adopted, queued);
    let mut committed = Vec::new();
    while committed.len() < 2 {
        if let SessionEvent::TurnCommitted { turn_id, .. } = feed.recv().await.unwrap().as_ref() {
            committed.push(*turn_id);
        }
    }
    assert_eq!(committed, queued);
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["first", "one", "second", "two"]
    );
    assert!(store.queued_inputs().await.unwrap().is_empty());
    assert_eq!(
        h.manager.resume_queued(|_, _| {}).await.unwrap(),
        0,
        "run once"
    );
}

#[tokio::test]
async fn a_turn_cancelled_before_it_started_keeps_its_input_queued_for_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let provider = HeldProvider::new(ScriptedProvider::new([ScriptedResponse::text("a done")]));
    let store = open_store(dir.path());
    let manager = manager_with(
        store.clone(),
        provider.clone(),
        SessionManagerConfig::default(),
    );
    let id = manager.create(spec("d1")).await.unwrap();
    let a = manager.send(id, Message::user("a")).await.unwrap();
    provider.wait_started().await;
    let b = manager.send(id, Message::user("b")).await.unwrap();
    // As a shutdown does with every turn still waiting.
    b.cancellation().cancel();
    provider.release.add_permits(1);
    a.outcome().await.unwrap();
    assert!(b.outcome().await.unwrap_err().is_cancelled());
    let queued = store.queued_inputs().await.unwrap();
    assert_eq!(
        queued.iter().map(|q| q.message.text()).collect::<Vec<_>>(),
        ["b"]
    );
    assert_eq!(visible_texts(&manager, id).await, ["a", "a done"]);
}

/// A turn whose model never answers ends at its deadline, typed `TimedOut`:
/// its input stays in the history, unanswered, the turn queued behind it
/// runs, and so does the next one.
#[tokio::test(start_paused = true)]
async fn a_turn_past_its_deadline_times_out_keeping_its_input_and_the_queue_runs_on() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let provider = HeldProvider::new(ScriptedProvider::new([
        ScriptedResponse::text("b done"),
        ScriptedResponse::text("c done"),
    ]));
    let manager = manager_with(
        open_store(dir.path()),
        provider.clone(),
        SessionManagerConfig {
            turn_timeout: Some(Duration::from_secs(60)),
            ..SessionManagerConfig::default()
        },
    );
    let id = manager.create(spec("d1")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let begun = tokio::time::Instant::now();
    let a = manager.send(id, Message::user("a")).await.unwrap();
    let b = manager.send(id, Message::user("b")).await.unwrap();
    provider.wait_started().await;
    let err = tokio::time::timeout(Duration::from_secs(3600), a.outcome())
        .await
        .expect("the deadline ends the turn")
        .unwrap_err();
    let elapsed = begun.elapsed();
    // The later turns read and record their spend in the store: with the
    // clock paused, waiting on a store thread would let it jump to their
    // deadlines. Real time from here on.
    tokio::time::resume();
    assert_eq!(err, EngineError::TimedOut { secs: 60 });
    assert!(!err.is_cancelled() && !err.is_retryable() && !err.is_internal());
    assert_eq!(elapsed, Duration::from_secs(60));
    loop {
        if let SessionEvent::TurnFailed {
            cancelled,
            timed_out,
            input_kept,
            message,
            ..
        } = feed.recv().await.unwrap().as_ref()
        {
            assert_eq!((*cancelled, *timed_out, *input_kept), (false, true, true));
            assert_eq!(
                message,
                "the turn ran past its deadline of 60 s and was stopped; nothing of its answer was saved"
            );
            break;
        }
    }
    provider.release.add_permits(2);
    assert_eq!(b.outcome().await.unwrap().output.final_text(), "b done");
    let c = manager.submit_turn(id, "c").await.unwrap();
    assert_eq!(c.output.final_text(), "c done");
    assert_eq!(
        visible_texts(&manager, id).await,
        ["a", "b", "b done", "c", "c done"]
    );
    assert_eq!(unanswered(&manager, id).await, ["a"]);
    assert!(manager.store().queued_inputs().await.unwrap().is_empty());
}
