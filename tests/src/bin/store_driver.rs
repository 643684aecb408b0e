//! `keel-store-driver DATA_DIR`: drives every commit path of keel-store in
//! order — open (migrations), activation, a turn, a background run with a
//! signal, claim, steer admission, release, terminal commit, a
//! continuation turn, then turns until the WAL is checkpointed — printing
//! `ack <step>` after each returns. With `FAILPOINTS` set, the process dies
//! at that point; the crash tests then recover the database and check that
//! everything acknowledged is there and every invariant holds. It exists for
//! the store paths no `keel` command reaches alone yet (signals, claims,
//! admission, release, continuation).
#![allow(clippy::unwrap_used)] // a test driver: any failure is the test's failure

use std::time::Duration;

use keel_core::{
    AgentId, CheckpointId, Delivery, ExecutionMode, Message, RunId, SessionId, ToolCall, TurnId,
};
use keel_store::{
    AcceptRun, CheckpointSource, ClaimRequest, CompletionHandling, ContinuationCommit,
    LeasedEvents, NewCheckpoint, NewMessage, NewRun, NewSession, NewSignal, OpenTurn,
    ReleaseRequest, SignalCommit, SignalLimits, Store, StoreOptions, TerminalOutcome, TurnCommit,
};

fn main() {
    keel_store::failpoints::configure_from_env().unwrap();
    let data = std::env::args_os()
        .nth(1)
        .expect("usage: keel-store-driver DATA_DIR");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(drive(std::path::Path::new(&data)));
}

fn ack(step: &str) {
    println!("ack {step}");
}

fn now() -> i64 {
    keel_core::time::now_ms()
}

fn turn(session: SessionId, messages: Vec<Message>, turn_index: u64) -> TurnCommit {
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
        now_ms: now(),
    }
}

async fn drive(data: &std::path::Path) {
    std::fs::create_dir_all(data).unwrap();
    let options = StoreOptions {
        // A checkpoint every few pages, so the run reaches one.
        wal_autocheckpoint_pages: 4,
        retry_delays: vec![Duration::from_millis(5)],
        readers: 1,
        ..StoreOptions::default()
    };
    let store = Store::open(data.join("keel.db"), options).unwrap();
    ack("open");
    let generation = store
        .activate_runtime("keel-store-driver".into(), now())
        .await
        .unwrap()
        .generation;
    ack("activate");
    let session = SessionId::new();
    store
        .create_session(NewSession {
            id: session,
            channel: "driver".into(),
            chat_id: "driver".into(),
            dialog_id: "default".into(),
            title: "Dialog default".into(),
            agent_id: None,
            parent_id: None,
            delivery_context: None,
            now_ms: now(),
        })
        .await
        .unwrap();
    println!("ack session {session}");
    let call = ToolCall {
        id: "call-1".into(),
        name: "read_file".into(),
        arguments: serde_json::json!({"path": "notes.txt"}),
    };
    // A user turn: its input commits first, then the answer.
    let answers = store
        .open_turn(OpenTurn {
            session_id: session,
            messages: vec![NewMessage::new(Message::user("user message 1"))],
            expected_head: None,
            queued: None,
            now_ms: now(),
        })
        .await
        .unwrap();
    ack("turn user message 1");
    let mut first = turn(
        session,
        vec![
            Message::assistant_with_tools("", vec![call.clone()]),
            Message::tool_result("call-1", "read_file", "notes"),
            Message::assistant("answer 1"),
        ],
        1,
    );
    first.visible_user_inputs = 0;
    first.answers = answers;
    store.commit_turn(first).await.unwrap();
    ack("turn answer 1");

    let run = RunId::new();
    let execution = format!("exec-{run}");
    store
        .accept_run(AcceptRun {
            run: NewRun {
                id: run,
                root_session_id: session,
                root_turn_id: None,
                parent_run_id: None,
                caller_agent_id: AgentId::root(),
                caller_scope_id: "turn-1".into(),
                idempotency_key: None,
                agent_id: AgentId::parse("helper").unwrap(),
                definition_hash: "d".repeat(64),
                provider_profile: "default".into(),
                provider_name: "scripted".into(),
                model_id: "scripted".into(),
                mode: ExecutionMode::Background,
                depth: 1,
                plan_item_id: None,
                execution_id: execution.clone(),
                task: "work".into(),
                context_json: None,
                budget_json: "{}".into(),
                signal_contract_json: Some("{}".into()),
                signal_delivery: Some(Delivery::Steer),
                completion_delivery: Some(Delivery::Queue),
                failure_delivery: Some(Delivery::Queue),
                runtime_generation: generation,
                deadline_at_ms: now() + 3_600_000,
            },
            inbox_capacity: 8,
            now_ms: now(),
        })
        .await
        .unwrap();
    assert!(store
        .mark_run_running(run, execution.clone(), now())
        .await
        .unwrap());
    println!("ack run {run}");
    let signal = store
        .insert_signal(NewSignal {
            run_id: run,
            execution_id: execution.clone(),
            dedupe_key: Some("progress-1".into()),
            delivery: Delivery::Steer,
            severity: Some("info".into()),
            payload_json: r#"{"progress":50}"#.into(),
            inbox_capacity: 8,
            limits: SignalLimits {
                max_signals: 16,
                burst: 3,
                min_interval_ms: 1000,
                dedupe_window_ms: 60_000,
            },
            now_ms: now(),
        })
        .await
        .unwrap();
    let SignalCommit::Accepted { event_id } = signal else {
        panic!("the first signal is accepted: {signal:?}");
    };
    println!("ack signal {event_id}");

    // Steer admission: claim, admit into a turn, then give it back.
    let claim = |delivery| ClaimRequest {
        root_session_id: session,
        now_ms: now(),
        lease_ms: 60_000,
        max_events: 8,
        max_bytes: 64 * 1024,
        delivery,
    };
    let lease = store
        .claim_inbox_batch(claim(Some(Delivery::Steer)))
        .await
        .unwrap()
        .unwrap();
    ack("claim");
    let ids: Vec<_> = lease.events.iter().map(|e| e.id).collect();
    store
        .admit_inbox_events(ids.clone(), lease.token.clone(), TurnId::new(), now())
        .await
        .unwrap();
    ack("admit");
    store
        .release_inbox_lease(ReleaseRequest {
            event_ids: ids,
            lease_token: lease.token,
            now_ms: now(),
            backoff_ms: 0,
            max_attempts: 5,
            count_attempt: true,
            error: Some("turn ended".into()),
        })
        .await
        .unwrap();
    ack("release");

    let terminal = store
        .commit_terminal(
            run,
            execution,
            TerminalOutcome::Completed {
                result: "done".into(),
                usage: Default::default(),
                tool_calls: 0,
                iterations: 1,
                cost: None,
            },
            CompletionHandling::Deliver,
            now(),
        )
        .await
        .unwrap();
    println!("ack terminal {}", terminal.event_id.unwrap());

    // A continuation turn consumes the signal and the completion.
    let lease = store.claim_inbox_batch(claim(None)).await.unwrap().unwrap();
    assert_eq!(lease.events.len(), 2);
    let ids: Vec<_> = lease.events.iter().map(|e| e.id).collect();
    store
        .commit_continuation_turn(ContinuationCommit {
            turn: TurnCommit {
                calls: None,
                // Its trigger is hidden: no user input to count.
                visible_user_inputs: 0,
                ..turn(
                    session,
                    vec![
                        Message::user("[background results]").hidden(),
                        Message::assistant("continuation answer"),
                    ],
                    2,
                )
            },
            consumed: vec![LeasedEvents {
                lease_token: lease.token,
                event_ids: ids,
            }],
        })
        .await
        .unwrap();
    ack("continuation");

    // Enough turns for the writer thread to checkpoint the WAL.
    let mut index = 3;
    while store.commit_stats().checkpoints < 2 || index < 6 {
        store
            .commit_turn(turn(
                session,
                vec![
                    Message::user(format!("user message {index}")),
                    Message::assistant("x".repeat(8192)),
                ],
                index,
            ))
            .await
            .unwrap();
        println!("ack turn user message {index}");
        index += 1;
        assert!(index < 10_000, "the WAL was never checkpointed");
    }
    ack("done");
}
