//! The inbox: signals (dedupe, capacity, limits), claims with a lease
//! token, continuation commits that consume what they claimed, release
//! with backoff and dead-lettering, and the notice that tells of a dead
//! letter once.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{Delivery, EventId, ExecutionMode, Message, SessionId, TurnId, TurnOrigin};

use crate::{
    ClaimRequest, CompletionHandling, ContinuationCommit, EventStatus, LeasedEvents, NewMessage,
    NewSignal, NoticeCommit, ReleaseRequest, SignalCommit, SignalLimits, StoreError,
    TerminalOutcome, TurnCommit,
};

use super::fixtures::*;
use super::TestDb;

const LIMITS: SignalLimits = SignalLimits {
    max_signals: 3,
    burst: 2,
    min_interval_ms: 1000,
    dedupe_window_ms: 60_000,
};

/// A time to live no test event reaches.
const NO_TTL: i64 = i64::MAX / 4;

pub async fn signals_are_deduplicated_capacity_checked_and_need_a_live_execution(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let run = new_run(root, ExecutionMode::Background);
    store.accept_run(accept(run.clone(), 2)).await.unwrap();
    let signal = |key: &str| NewSignal {
        run_id: run.id,
        execution_id: run.execution_id.clone(),
        dedupe_key: Some(key.into()),
        delivery: Delivery::Queue,
        severity: Some("info".into()),
        payload_json: r#"{"summary":"halfway"}"#.into(),
        inbox_capacity: 2,
        limits: LIMITS,
        now_ms: 200,
    };
    // Queued runs cannot signal yet.
    assert!(matches!(
        store.insert_signal(signal("s1")).await,
        Err(StoreError::Stale(_))
    ));
    store
        .mark_run_running(run.id, run.execution_id.clone(), 110)
        .await
        .unwrap();
    let SignalCommit::Accepted { event_id: first } =
        store.insert_signal(signal("s1")).await.unwrap()
    else {
        panic!("the first signal is accepted");
    };
    assert_eq!(
        store.insert_signal(signal("s1")).await.unwrap(),
        SignalCommit::Deduplicated { event_id: first }
    );
    // Capacity 2 = 1 reserved completion + 1 signal: the next signal does not fit.
    assert!(matches!(
        store.insert_signal(signal("s2")).await,
        Err(StoreError::InboxFull { .. })
    ));
    assert_eq!(slots(&store, root).await, counters(1, 1));
    // Cancelling the run supersedes its open signals; the completion stays a fact.
    assert_eq!(store.supersede_run_signals(run.id, 300).await.unwrap(), 1);
    assert_eq!(slots(&store, root).await, counters(0, 1));
    let mut foreign = signal("s3");
    foreign.execution_id = "other".into();
    assert!(matches!(
        store.insert_signal(foreign).await,
        Err(StoreError::Stale(_))
    ));
}

/// Dedupe is a cooldown window, the burst refills one signal per interval,
/// the count per run is a hard cap, and a cancelled run's pending signals
/// are superseded by its terminal commit.
pub async fn signal_limits_are_a_window_a_refilling_burst_and_a_cap(db: TestDb) {
    let store = db.store.clone();
    let root = SessionId::new();
    let run = new_run(root, ExecutionMode::Background);
    store.accept_run(accept(run.clone(), 64)).await.unwrap();
    store
        .mark_run_running(run.id, run.execution_id.clone(), 110)
        .await
        .unwrap();
    let at = |key: Option<&str>, now_ms: i64| NewSignal {
        run_id: run.id,
        execution_id: run.execution_id.clone(),
        dedupe_key: key.map(Into::into),
        delivery: Delivery::Steer,
        severity: Some("warning".into()),
        payload_json: r#"{"summary":"disk almost full"}"#.into(),
        inbox_capacity: 64,
        limits: LIMITS,
        now_ms,
    };
    let accepted = |c: SignalCommit| match c {
        SignalCommit::Accepted { event_id } => event_id,
        other => panic!("expected acceptance, got {other:?}"),
    };
    let a = accepted(store.insert_signal(at(Some("disk"), 1_000)).await.unwrap());
    // Within the window the key returns the first signal; it costs nothing.
    assert_eq!(
        store.insert_signal(at(Some("disk"), 30_000)).await.unwrap(),
        SignalCommit::Deduplicated { event_id: a }
    );
    // Past the window the same key is news again.
    let b = accepted(store.insert_signal(at(Some("disk"), 61_000)).await.unwrap());
    assert_ne!(a, b);
    // b spent the refilled allowance with a: burst 2 back to back, so one
    // more at once is too soon, by the refill time of one signal.
    let mut soon = at(None, 61_000);
    soon.limits.max_signals = 10;
    soon.limits.burst = 1;
    assert_eq!(
        store.insert_signal(soon).await.unwrap(),
        SignalCommit::TooSoon {
            retry_after_ms: 1000
        }
    );
    accepted(store.insert_signal(at(None, 61_000)).await.unwrap());
    // Three signals emitted: the cap of 3 refuses a fourth, however late.
    assert_eq!(
        store.insert_signal(at(None, 500_000)).await.unwrap(),
        SignalCommit::TooMany { max_signals: 3 }
    );
    assert_eq!(slots(&store, root).await, counters(3, 1));
    // One of them is held by a turn; the cancelled run's terminal commit
    // supersedes only the pending ones.
    let lease = store.claim_inbox_batch(ClaimRequest {
        max_events: 1,
        ..claim(root, 600_000)
    });
    let lease = lease.await.unwrap().unwrap();
    store
        .commit_terminal(
            run.id,
            run.execution_id.clone(),
            TerminalOutcome::Cancelled {
                reason: "stop".into(),
            },
            CompletionHandling::Quiet,
            700_000,
        )
        .await
        .unwrap();
    let statuses: Vec<(EventId, EventStatus)> = store
        .list_signals(root, 10)
        .await
        .unwrap()
        .iter()
        .map(|e| (e.id, e.status))
        .collect();
    assert_eq!(statuses.len(), 3, "newest first: {statuses:?}");
    let leased = lease.events[0].id;
    for (id, status) in statuses {
        let expected = if id == leased {
            EventStatus::Leased
        } else {
            EventStatus::Superseded
        };
        assert_eq!(status, expected, "{id}");
    }
    // The held signal still counts until its turn ends; the quiet
    // completion released the reservation.
    assert_eq!(slots(&store, root).await, counters(1, 0));
}

pub async fn session_events_page_newest_first_and_new_ones_come_before_the_first_page(db: TestDb) {
    let store = db.store.clone();
    let (root, mut ids) = root_with_events(&store, 7).await;
    let other = store.create_session(new_session("other", 1)).await.unwrap();
    add_completions(&store, other.id, 0..2).await;
    let mut seen = Vec::new();
    let mut cursor = None;
    let mut more = 100..100;
    loop {
        let page = store.query_session_events(root, cursor, 3).await.unwrap();
        assert!(page.items.len() <= 3);
        seen.extend(page.items.iter().map(|e| e.id));
        // Events arriving between pages sort before the first one.
        more = more.end..more.end + 2;
        add_completions(&store, root, more.clone()).await;
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    ids.reverse();
    assert_eq!(
        seen, ids,
        "no event repeated, skipped, or from another dialog"
    );
    assert!(matches!(
        store.query_session_events(root, None, 0).await,
        Err(StoreError::InvalidInput(_))
    ));
}

pub async fn claim_then_continuation_consumes_events_with_the_turn(db: TestDb) {
    let store = db.store.clone();
    let (root, ids) = root_with_events(&store, 3).await;
    let mut req = claim(root, 1000);
    req.max_events = 2;
    let lease = store.claim_inbox_batch(req).await.unwrap().unwrap();
    assert_eq!(
        lease.events.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids[..2]
    );
    assert!(lease.events.iter().all(|e| e.status == EventStatus::Leased));
    // Leased events are not claimed twice.
    let second = store
        .claim_inbox_batch(claim(root, 1000))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.events.len(), 1);

    let trigger = Message::user("[results]")
        .hidden()
        .with_origin(TurnOrigin::AgentContinuation);
    let answer = Message::assistant("summary").with_origin(TurnOrigin::AgentContinuation);
    let commit = ContinuationCommit {
        turn: TurnCommit {
            calls: None,
            session_id: root,
            messages: vec![NewMessage::new(trigger), NewMessage::new(answer)],
            state: b"{}".to_vec(),
            checkpoint: None,
            visible_user_inputs: 0,
            answers: Vec::new(),
            expected_head: None,
            now_ms: 1100,
        },
        consumed: vec![LeasedEvents {
            lease_token: lease.token.clone(),
            event_ids: ids[..2].to_vec(),
        }],
    };
    let done = store
        .commit_continuation_turn(commit.clone())
        .await
        .unwrap();
    assert_eq!(done.consumed, 2);
    assert_eq!(done.turn.seqs, [1, 2]);
    assert_eq!(slots(&store, root).await, counters(1, 0));
    // Replaying the same commit (lease gone) commits nothing.
    let err = store.commit_continuation_turn(commit).await.unwrap_err();
    assert!(matches!(err, StoreError::Stale(_)), "{err}");
    assert_eq!(store.last_seq(root).await.unwrap(), 2);
    let rec = store.get_session(root).await.unwrap().unwrap();
    assert_eq!(rec.message_count, 0, "hidden triggers are not user input");
}

pub async fn release_backs_off_and_dead_letters_after_max_attempts(db: TestDb) {
    let store = db.store.clone();
    let (root, ids) = root_with_events(&store, 1).await;
    let release = |token: String, now| ReleaseRequest {
        event_ids: ids.clone(),
        lease_token: token,
        now_ms: now,
        backoff_ms: 500,
        max_attempts: 2,
        count_attempt: true,
        error: Some("provider down".into()),
    };
    let lease = store
        .claim_inbox_batch(claim(root, 1000))
        .await
        .unwrap()
        .unwrap();
    // Steer admission, then the turn fails.
    assert_eq!(
        store
            .admit_inbox_events(ids.clone(), lease.token.clone(), TurnId::new(), 1001)
            .await
            .unwrap(),
        1
    );
    let r = store
        .release_inbox_lease(release(lease.token.clone(), 1010))
        .await
        .unwrap();
    assert_eq!((r.released, r.dead_lettered), (1, 0));
    // Backoff: not due before 1510.
    assert!(store
        .claim_inbox_batch(claim(root, 1500))
        .await
        .unwrap()
        .is_none());
    // A stale token cannot release again.
    assert!(matches!(
        store.release_inbox_lease(release(lease.token, 1600)).await,
        Err(StoreError::Stale(_))
    ));
    let lease = store
        .claim_inbox_batch(claim(root, 1510))
        .await
        .unwrap()
        .unwrap();
    let r = store
        .release_inbox_lease(release(lease.token, 1520))
        .await
        .unwrap();
    assert_eq!((r.released, r.dead_lettered), (0, 1));
    let events = store.list_inbox_events(root).await.unwrap();
    assert_eq!(events[0].status, EventStatus::DeadLetter);
    assert_eq!(events[0].attempt_count, 2);
    assert_eq!(slots(&store, root).await, counters(0, 0));
}

pub async fn one_turn_consumes_the_events_of_several_leases_of_its_own_session_only(db: TestDb) {
    let store = db.store.clone();
    let (root, ids) = root_with_events(&store, 3).await;
    let mut req = claim(root, 1000);
    req.max_events = 2;
    let a = store.claim_inbox_batch(req).await.unwrap().unwrap();
    let b = store
        .claim_inbox_batch(claim(root, 1000))
        .await
        .unwrap()
        .unwrap();
    let leases = vec![
        LeasedEvents {
            lease_token: a.token.clone(),
            event_ids: ids[..2].to_vec(),
        },
        LeasedEvents {
            lease_token: b.token.clone(),
            event_ids: ids[2..].to_vec(),
        },
    ];
    // The turn of another session may not consume them.
    let other = store.create_session(new_session("other", 1)).await.unwrap();
    let err = store
        .commit_continuation_turn(ContinuationCommit {
            turn: turn_of(other.id, 1100),
            consumed: leases.clone(),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidInput(_)), "{err}");
    assert_eq!(store.last_seq(other.id).await.unwrap(), 0);
    let done = store
        .commit_continuation_turn(ContinuationCommit {
            turn: turn_of(root, 1100),
            consumed: leases,
        })
        .await
        .unwrap();
    assert_eq!(done.consumed, 3);
    assert_eq!(slots(&store, root).await, counters(0, 0));
}

pub async fn a_release_that_is_no_failed_delivery_keeps_attempts_and_backoff(db: TestDb) {
    let store = db.store.clone();
    let (root, ids) = root_with_events(&store, 1).await;
    let lease = store
        .claim_inbox_batch(claim(root, 1000))
        .await
        .unwrap()
        .unwrap();
    let r = store
        .release_inbox_lease(ReleaseRequest {
            event_ids: ids.clone(),
            lease_token: lease.token,
            now_ms: 1001,
            backoff_ms: 60_000,
            max_attempts: 1,
            count_attempt: false,
            error: None,
        })
        .await
        .unwrap();
    assert_eq!((r.released, r.dead_lettered), (1, 0));
    let events = store.list_inbox_events(root).await.unwrap();
    assert_eq!(
        (events[0].status, events[0].attempt_count),
        (EventStatus::Pending, 0)
    );
    let schedule = store.inbox_schedule(root, 1001, NO_TTL).await.unwrap();
    assert_eq!(schedule.oldest_due_at_ms, Some(events[0].created_at_ms));
    assert!(store
        .claim_inbox_batch(claim(root, 1001))
        .await
        .unwrap()
        .is_some());
}

pub async fn an_event_backing_off_past_its_time_to_live_is_due_for_dead_lettering(db: TestDb) {
    let store = db.store.clone();
    // Two events created at 200 and 201 ms; both fail and back off 10 s.
    let (root, ids) = root_with_events(&store, 2).await;
    let lease = store
        .claim_inbox_batch(claim(root, 1000))
        .await
        .unwrap()
        .unwrap();
    store
        .release_inbox_lease(ReleaseRequest {
            event_ids: ids.clone(),
            lease_token: lease.token,
            now_ms: 1000,
            backoff_ms: 10_000,
            max_attempts: 5,
            count_attempt: true,
            error: Some("model down".into()),
        })
        .await
        .unwrap();
    // Their time to live (5 s: expiry at 5200 and 5201) ends before the retry.
    let schedule = store.inbox_schedule(root, 1000, 5_000).await.unwrap();
    assert_eq!(
        (
            schedule.oldest_due_at_ms,
            schedule.next_due_at_ms,
            schedule.expired
        ),
        (None, Some(5200), 0),
        "the worker wakes at the first expiry, not at the retry"
    );
    let schedule = store.inbox_schedule(root, 5200, 5_000).await.unwrap();
    assert_eq!(
        (
            schedule.oldest_due_at_ms,
            schedule.next_due_at_ms,
            schedule.expired
        ),
        (None, Some(5201), 1)
    );
    let moved = store
        .dead_letter_expired_events(root, 200, "expired".into(), 5200)
        .await
        .unwrap();
    assert_eq!(moved, 1);
    let untold = store.unnotified_dead_letters(root).await.unwrap();
    assert_eq!(untold.iter().map(|e| e.id).collect::<Vec<_>>(), [ids[0]]);
    assert_eq!(untold[0].last_error.as_deref(), Some("expired"));
    let schedule = store.inbox_schedule(root, 5200, 5_000).await.unwrap();
    assert_eq!(
        (
            schedule.next_due_at_ms,
            schedule.expired,
            schedule.untold_dead_letters
        ),
        (Some(5201), 0, 1)
    );
    // Without a time to live that ends first, the retry time is next.
    let schedule = store.inbox_schedule(root, 1000, NO_TTL).await.unwrap();
    assert_eq!(schedule.next_due_at_ms, Some(11_000));
    // A time to live past what a creation time can be added to (a duration
    // the caller saturated to i64::MAX ms) never ends either.
    let schedule = store.inbox_schedule(root, 1000, i64::MAX).await.unwrap();
    assert_eq!(
        (schedule.next_due_at_ms, schedule.expired),
        (Some(11_000), 0)
    );
    let counts = store.inbox_counts(root).await.unwrap();
    assert_eq!(counts.pending, 1, "{counts:?}");
}

pub async fn a_dead_letter_is_told_once_by_a_notice_in_the_sessions_history(db: TestDb) {
    let store = db.store.clone();
    let (root, ids) = root_with_events(&store, 2).await;
    let lease = store
        .claim_inbox_batch(claim(root, 1000))
        .await
        .unwrap()
        .unwrap();
    store
        .release_inbox_lease(ReleaseRequest {
            event_ids: vec![ids[0]],
            lease_token: lease.token.clone(),
            now_ms: 1001,
            backoff_ms: 500,
            max_attempts: 1,
            count_attempt: true,
            error: Some("model down".into()),
        })
        .await
        .unwrap();
    store
        .release_inbox_lease(ReleaseRequest {
            event_ids: vec![ids[1]],
            lease_token: lease.token,
            now_ms: 1001,
            backoff_ms: 500,
            max_attempts: 5,
            count_attempt: true,
            error: Some("model down".into()),
        })
        .await
        .unwrap();
    let schedule = store.inbox_schedule(root, 1001, NO_TTL).await.unwrap();
    assert_eq!(
        (schedule.oldest_due_at_ms, schedule.next_due_at_ms),
        (None, Some(1501)),
        "the other event backs off"
    );
    assert_eq!(schedule.untold_dead_letters, 1);
    let untold = store.unnotified_dead_letters(root).await.unwrap();
    assert_eq!(untold.iter().map(|e| e.id).collect::<Vec<_>>(), [ids[0]]);
    assert_eq!(untold[0].last_error.as_deref(), Some("model down"));
    let notice = |now| NoticeCommit {
        turn: TurnCommit {
            calls: None,
            session_id: root,
            messages: vec![NewMessage::new(
                Message::system("a result could not be delivered").with_origin(TurnOrigin::System),
            )],
            state: b"{}".to_vec(),
            checkpoint: None,
            visible_user_inputs: 0,
            answers: Vec::new(),
            expected_head: None,
            now_ms: now,
        },
        event_ids: vec![ids[0]],
    };
    store.commit_dead_letter_notice(notice(1002)).await.unwrap();
    assert!(store
        .unnotified_dead_letters(root)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store
            .inbox_schedule(root, 1002, NO_TTL)
            .await
            .unwrap()
            .untold_dead_letters,
        0
    );
    // Told once: a second notice of the same event commits nothing.
    let err = store
        .commit_dead_letter_notice(notice(1003))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Stale(_)), "{err}");
    assert_eq!(store.last_seq(root).await.unwrap(), 1);
    // Events dead-lettered because the session was deleted are never told.
    store
        .cancel_session(root, "session deleted".into(), 1004)
        .await
        .unwrap();
    assert!(store
        .unnotified_dead_letters(root)
        .await
        .unwrap()
        .is_empty());
}

pub async fn racing_claimers_lease_every_event_to_exactly_one_of_them(db: TestDb) {
    let store = db.store.clone();
    let (root, ids) = root_with_events(&store, 12).await;
    // Two claimers on this store and one on each of two more stores on the
    // database (other processes' connections) drain the inbox at once, two
    // events a claim.
    let stores = [
        store.clone(),
        store.clone(),
        db.reopen().await,
        db.reopen().await,
    ];
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(stores.len()));
    let tasks: Vec<_> = stores
        .into_iter()
        .map(|s| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let mut leases = Vec::new();
                let request = ClaimRequest {
                    max_events: 2,
                    ..claim(root, 1000)
                };
                while let Some(lease) = s.claim_inbox_batch(request.clone()).await.unwrap() {
                    leases.push(lease);
                }
                leases
            })
        })
        .collect();
    let mut held = std::collections::HashMap::new();
    for t in tasks {
        for lease in t.await.unwrap() {
            assert!((1..=2).contains(&lease.events.len()));
            for e in lease.events {
                let earlier = held.insert(e.id, lease.token.clone());
                assert_eq!(earlier, None, "event {} leased twice", e.id);
            }
        }
    }
    let mut leased: Vec<EventId> = held.keys().copied().collect();
    leased.sort_unstable();
    let mut all = ids;
    all.sort_unstable();
    assert_eq!(leased, all, "every event leased once");
    // The stored events agree: each is leased under the token of the one
    // claim that returned it.
    for e in store.list_inbox_events(root).await.unwrap() {
        assert_eq!(e.status, EventStatus::Leased);
        assert_eq!(e.lease_token.as_ref(), held.get(&e.id));
    }
}
