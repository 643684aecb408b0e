//! `/ag-ui`: runs as AG-UI event streams, the thread's history, bad input,
//! and the encoding of turns (and continuation turns) into runs.

use keel_core::{ScriptedResponse, ScriptedToolCall, SessionId};
use keel_gateway::serve::api::{TokenUsage, TurnOrigin};
use keel_gateway::serve::frames::ServerFrame;
use keel_gateway::serve::interop::agui::{AgUiEvent, KeelRef, RunEncoder, ThreadFollower};
use serde_json::{json, Value};
use uuid::Uuid;

use super::{
    check_agui_order, check_agui_run, dialogs, messages, post_raw, redacted, sse_data, BadCase,
};
use crate::serve::{background_filing, scripted, Setup, TestServer};

/// Runs `input` on `path`; returns the status and the events (or the error body).
async fn run(t: &TestServer, path: &str, input: Value) -> (u16, Vec<Value>) {
    run_after(t, path, input, &[]).await
}

/// [`run`] for a run that may answer the tool calls `earlier` of the run
/// it continues.
async fn run_after(
    t: &TestServer,
    path: &str,
    input: Value,
    earlier: &[String],
) -> (u16, Vec<Value>) {
    let (status, _, text) = post_raw(
        t,
        path,
        input.to_string(),
        &[("accept", "text/event-stream")],
    )
    .await;
    if status != 200 {
        return (status, vec![serde_json::from_str(&text).unwrap()]);
    }
    let events: Vec<Value> = sse_data(&text)
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    check_agui_run(&events, earlier);
    // Every event reads back as a keel AG-UI event and writes the same JSON.
    for e in &events {
        let typed: AgUiEvent = serde_json::from_value(e.clone()).unwrap();
        assert_eq!(&serde_json::to_value(&typed).unwrap(), e);
    }
    (status, events)
}

fn input(thread: &str, run: &str, messages: Value) -> Value {
    json!({"threadId": thread, "runId": run, "messages": messages, "state": {}, "tools": [], "context": []})
}

/// The events' types, and for text the deltas, one line each.
fn shape(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let kind = e["type"].as_str().unwrap();
            match kind {
                "TEXT_MESSAGE_CONTENT" => format!("{kind} {}", e["delta"]),
                "TOOL_CALL_START" => format!("{kind} {}", e["toolCallName"].as_str().unwrap()),
                "TOOL_CALL_ARGS" => format!("{kind} {}", e["delta"].as_str().unwrap()),
                "STEP_STARTED" | "STEP_FINISHED" => {
                    format!("{kind} {}", e["stepName"].as_str().unwrap())
                }
                "ACTIVITY_SNAPSHOT" => format!(
                    "{kind} {} {}",
                    e["content"]["agent"].as_str().unwrap(),
                    e["content"]["status"].as_str().unwrap()
                ),
                _ => kind.to_owned(),
            }
        })
        .collect()
}

#[tokio::test]
async fn a_run_streams_steps_text_and_keels_own_tool_calls() {
    let t = TestServer::start(Setup {
        token: Some("sekret"),
        provider: scripted(vec![
            ScriptedResponse {
                text: Some("Let me look.".into()),
                tool_calls: vec![ScriptedToolCall {
                    id: Some("call_9".into()),
                    name: "current_time".into(),
                    arguments: json!({}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("It is now."),
        ]),
        ..Setup::default()
    })
    .await;
    let messages_in = json!([{"id": "m1", "role": "user", "content": "time?"}]);
    let (status, events) = run(&t, "/ag-ui", input("thread-1", "run-1", messages_in)).await;
    assert_eq!(status, 200);
    insta::assert_yaml_snapshot!(shape(&events), @r#"
    - RUN_STARTED
    - STEP_STARTED model_call_1
    - TEXT_MESSAGE_START
    - "TEXT_MESSAGE_CONTENT \"Let \""
    - "TEXT_MESSAGE_CONTENT \"me \""
    - "TEXT_MESSAGE_CONTENT \"look.\""
    - TEXT_MESSAGE_END
    - STEP_FINISHED model_call_1
    - TOOL_CALL_START current_time
    - "TOOL_CALL_ARGS {}"
    - TOOL_CALL_END
    - TOOL_CALL_RESULT
    - STEP_STARTED model_call_2
    - TEXT_MESSAGE_START
    - "TEXT_MESSAGE_CONTENT \"It \""
    - "TEXT_MESSAGE_CONTENT \"is \""
    - "TEXT_MESSAGE_CONTENT \"now.\""
    - TEXT_MESSAGE_END
    - STEP_FINISHED model_call_2
    - RUN_FINISHED
    "#);
    let first = redacted(&events[0]);
    insta::assert_json_snapshot!(first, @r#"
    {
      "metadata": {
        "keel": {
          "dialogId": "[uuid]",
          "turnId": "[uuid]",
          "turnOrigin": "user"
        }
      },
      "protocolVersion": "1.0",
      "runId": "run-1",
      "threadId": "thread-1",
      "type": "RUN_STARTED"
    }
    "#);
    let call = events
        .iter()
        .find(|e| e["type"] == "TOOL_CALL_START")
        .unwrap();
    assert_eq!(call["toolCallId"], "call_9");
    assert_eq!(call["parentMessageId"], events[2]["messageId"]);
    let last = redacted(events.last().unwrap());
    assert_eq!(last["type"], "RUN_FINISHED");
    assert_eq!(last["runId"], "run-1");
    assert_eq!(last["outcome"], json!({"type": "success"}));
    assert_eq!(
        last["usage"][0]["totalTokens"],
        last["usage"][0]["inputTokens"].as_u64().unwrap()
            + last["usage"][0]["outputTokens"].as_u64().unwrap()
    );
    assert_eq!(last["metadata"]["keel"]["checkpointId"], "[uuid]");
    // The thread lives in a dialog of channel ag-ui, chat thread-1.
    let dialog = events[0]["metadata"]["keel"]["dialogId"].as_str().unwrap();
    assert_eq!(dialogs(&t, "ag-ui", "thread-1").await, [dialog]);
}

#[tokio::test]
async fn a_thread_resending_its_messages_continues_its_dialog() {
    let t = TestServer::start(Setup {
        provider: scripted(vec![
            ScriptedResponse {
                tool_calls: vec![ScriptedToolCall {
                    id: Some("call_1".into()),
                    name: "current_time".into(),
                    arguments: json!({}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("Noon."),
        ]),
        ..Setup::default()
    })
    .await;
    let first = json!([{"id": "m1", "role": "user", "content": "time?"}]);
    let (_, events) = run(&t, "/ag-ui", input("t", "r1", first)).await;
    let dialog = events[0]["metadata"]["keel"]["dialogId"].clone();
    // What an AG-UI client holds after that run: the tool call on an
    // assistant message, its result, the answer — and a system message.
    let second = json!([
        {"id": "s", "role": "system", "content": "Be brief."},
        {"id": "m1", "role": "user", "content": [{"type": "text", "text": "time?"}]},
        {"id": "a1", "role": "assistant", "toolCalls": [{"id": "call_1", "type": "function", "function": {"name": "current_time", "arguments": "{}"}}]},
        {"id": "t1", "role": "tool", "toolCallId": "call_1", "content": "12:00"},
        {"id": "a2", "role": "assistant", "content": "Noon."},
        {"id": "m2", "role": "user", "content": "thanks"}
    ]);
    let (status, events) = run(&t, "/ag-ui", input("t", "r2", second)).await;
    assert_eq!(status, 200);
    assert_eq!(events[0]["metadata"]["keel"]["dialogId"], dialog);
    assert_eq!(events[0]["runId"], "r2");
    let kept = messages(&t, dialog.as_str().unwrap()).await;
    assert_eq!(
        kept.iter().filter(|m| m.starts_with("user: ")).count(),
        2,
        "{kept:#?}"
    );
}

#[tokio::test]
async fn sub_agent_runs_are_activity_snapshots_inside_the_run() {
    let t = TestServer::start(Setup {
        agents: true,
        provider: scripted(vec![
            ScriptedResponse {
                tool_calls: vec![ScriptedToolCall {
                    id: None,
                    name: "delegate".into(),
                    arguments: json!({"mode": "foreground", "tasks": [{"agent": "researcher", "task": "dig"}]}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("found it"),
            ScriptedResponse::text("The researcher found it."),
        ]),
        ..Setup::default()
    })
    .await;
    let messages_in = json!([{"id": "m1", "role": "user", "content": "research"}]);
    let (_, events) = run(&t, "/ag-ui", input("t", "r", messages_in)).await;
    let shape = shape(&events);
    let activities: Vec<&String> = shape
        .iter()
        .filter(|s| s.starts_with("ACTIVITY_SNAPSHOT"))
        .collect();
    assert!(!activities.is_empty(), "{shape:#?}");
    assert_eq!(
        activities.last().unwrap().as_str(),
        "ACTIVITY_SNAPSHOT researcher completed"
    );
    let snapshot = events
        .iter()
        .find(|e| e["type"] == "ACTIVITY_SNAPSHOT")
        .unwrap();
    assert_eq!(snapshot["activityType"], "keel.agent_run");
    assert_eq!(snapshot["replace"], true);
    assert_eq!(
        snapshot["messageId"].as_str().unwrap(),
        format!("run-{}", snapshot["content"]["id"].as_str().unwrap())
    );
}

#[tokio::test]
async fn a_run_for_a_named_agent_runs_that_agent() {
    let t = TestServer::start(Setup {
        agents: true,
        ..Setup::default()
    })
    .await;
    let messages_in = json!([{"id": "m1", "role": "user", "content": "draft"}]);
    let (status, events) = run(&t, "/ag-ui/writer", input("w", "r", messages_in.clone())).await;
    assert_eq!(status, 200);
    let dialog = events[0]["metadata"]["keel"]["dialogId"].as_str().unwrap();
    assert_eq!(
        t.json(&format!("/api/dialogs/{dialog}")).await["agent"],
        "writer"
    );
    let (status, body) = run(&t, "/ag-ui/nobody", input("w", "r", messages_in)).await;
    assert_eq!(status, 404);
    assert_eq!(body[0]["type"], "RUN_ERROR");
}

#[tokio::test]
async fn bad_input_is_a_run_error_body_and_changes_nothing() {
    let t = TestServer::start(Setup {
        token: Some("sekret"),
        ..Setup::default()
    })
    .await;
    let good = input(
        "t",
        "r",
        json!([{"id": "1", "role": "user", "content": "hi"}]),
    );
    let with = |key: &str, value: Value| {
        let mut b = good.clone();
        b[key] = value;
        b.to_string()
    };
    let cases: Vec<BadCase> = vec![
        ("not json", "{".into(), vec![]),
        (
            "no thread",
            json!({"runId": "r", "messages": []}).to_string(),
            vec![],
        ),
        (
            "thread with a colon",
            with("threadId", json!("a:b")),
            vec![],
        ),
        ("no run id", with("runId", json!("")), vec![]),
        ("messages not a list", with("messages", json!({})), vec![]),
        ("no input", with("messages", json!([])), vec![]),
        (
            "last is the assistant",
            with(
                "messages",
                json!([{"id": "1", "role": "user", "content": "a"}, {"id": "2", "role": "assistant", "content": "b"}]),
            ),
            vec![],
        ),
        (
            "unknown role",
            with(
                "messages",
                json!([{"id": "1", "role": "wizard", "content": "a"}]),
            ),
            vec![],
        ),
        ("state not an object", with("state", json!([1])), vec![]),
        (
            "resume without a decision",
            with(
                "resume",
                json!([{"interruptId": "i", "status": "resolved"}]),
            ),
            vec![],
        ),
        (
            "resume of an unknown status",
            with("resume", json!([{"interruptId": "i", "status": "later"}])),
            vec![],
        ),
        (
            "resume answering one twice",
            with(
                "resume",
                json!([{"interruptId": "i", "status": "cancelled"}, {"interruptId": "i", "status": "cancelled"}]),
            ),
            vec![],
        ),
        (
            "resume naming nothing",
            with(
                "resume",
                json!([{"interruptId": "i", "status": "cancelled"}]),
            ),
            vec![],
        ),
        (
            "wrong token",
            good.to_string(),
            vec![("authorization", "Bearer nope")],
        ),
        (
            "another site's page",
            good.to_string(),
            vec![("origin", "https://attacker.example")],
        ),
        (
            "another site's host name",
            good.to_string(),
            vec![("host", "attacker.example")],
        ),
    ];
    let mut seen = Vec::new();
    for (name, body, headers) in cases {
        let (status, _, text) = post_raw(&t, "/ag-ui", body, &headers).await;
        let text = text.replace(&t.base, "http://[server]");
        let body: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{name}: {text}"));
        assert_eq!(body["type"], "RUN_ERROR", "{name}");
        seen.push(json!({"case": name, "status": status, "body": body}));
    }
    insta::assert_json_snapshot!(seen);
    assert!(dialogs(&t, "ag-ui", "t").await.is_empty());
}

fn turn_frames(session: Uuid, turn: Uuid, origin: TurnOrigin) -> Vec<ServerFrame> {
    vec![
        ServerFrame::TurnStarted {
            event_id: None,
            session_id: session,
            turn_id: turn,
            turn_origin: origin,
        },
        ServerFrame::TextDelta {
            event_id: None,
            session_id: session,
            turn_id: turn,
            text: "Results are in.".into(),
        },
        ServerFrame::ModelCallFinished {
            event_id: None,
            session_id: session,
            turn_id: turn,
            finish_reason: "stop".into(),
        },
        ServerFrame::TurnCommitted {
            event_id: None,
            session_id: session,
            turn_id: turn,
            turn_origin: origin,
            checkpoint_id: None,
            usage: TokenUsage {
                prompt_tokens: 10,
                completion_tokens: 3,
            },
        },
    ]
}

fn keel(dialog: Uuid, turn: Uuid) -> KeelRef {
    KeelRef {
        dialog_id: dialog,
        turn_id: turn,
        checkpoint_id: None,
        forked_from: None,
        turn_origin: TurnOrigin::User,
    }
}

fn values(events: &[AgUiEvent]) -> Vec<Value> {
    events
        .iter()
        .map(|e| serde_json::to_value(e).unwrap())
        .collect()
}

#[test]
fn a_stopped_turn_closes_what_it_opened_and_finishes_cancelled() {
    let (dialog, turn) = (Uuid::now_v7(), Uuid::now_v7());
    let mut encoder = RunEncoder::new("t", "r", keel(dialog, turn));
    let mut events = vec![encoder.start()];
    let frames = turn_frames(dialog, turn, TurnOrigin::User);
    events.extend(encoder.encode(&frames[0]));
    events.extend(encoder.encode(&frames[1]));
    events.extend(encoder.encode(&ServerFrame::TurnFailed {
        event_id: None,
        session_id: dialog,
        turn_id: turn,
        turn_origin: TurnOrigin::User,
        cancelled: true,
        timed_out: false,
        budget_exhausted: false,
        input_kept: false,
        message: "the turn was stopped; nothing of it was saved".into(),
    }));
    let events = values(&events);
    check_agui_order(&events);
    insta::assert_yaml_snapshot!(shape(&events), @r#"
    - RUN_STARTED
    - STEP_STARTED model_call_1
    - TEXT_MESSAGE_START
    - "TEXT_MESSAGE_CONTENT \"Results are in.\""
    - TEXT_MESSAGE_END
    - STEP_FINISHED model_call_1
    - RUN_FINISHED
    "#);
    assert_eq!(
        events.last().unwrap()["outcome"],
        json!({"type": "cancelled"})
    );
    assert!(
        encoder.encode(&frames[3]).is_empty(),
        "nothing after the end"
    );
}

#[test]
fn a_failed_or_lost_turn_is_one_run_error() {
    let (dialog, turn) = (Uuid::now_v7(), Uuid::now_v7());
    let frames = turn_frames(dialog, turn, TurnOrigin::User);
    let mut failed = RunEncoder::new("t", "r", keel(dialog, turn));
    let mut events = vec![failed.start()];
    events.extend(failed.encode(&frames[1]));
    events.extend(failed.encode(&ServerFrame::TurnFailed {
        event_id: None,
        session_id: dialog,
        turn_id: turn,
        turn_origin: TurnOrigin::User,
        cancelled: false,
        timed_out: false,
        budget_exhausted: false,
        input_kept: false,
        message: "the turn failed and was not saved: provider refused".into(),
    }));
    events.extend(failed.abandon(true));
    let events = values(&events);
    check_agui_order(&events);
    insta::assert_json_snapshot!(events.last().unwrap(), @r#"
    {
      "code": "turn_failed",
      "message": "the turn failed and was not saved: provider refused",
      "type": "RUN_ERROR"
    }
    "#);
    let mut lost = RunEncoder::new("t", "r", keel(dialog, turn));
    let mut events = vec![lost.start()];
    events.extend(lost.encode(&frames[1]));
    events.extend(lost.abandon(true));
    events.extend(lost.abandon(false));
    let events = values(&events);
    check_agui_order(&events);
    assert_eq!(events.last().unwrap()["code"], "lagged");
}

#[test]
fn a_thread_stream_makes_each_continuation_turn_a_run_of_its_own() {
    let dialog = SessionId::new();
    let d = dialog.as_uuid();
    let mut follower = ThreadFollower::new("thread-1", dialog);
    let run = keel_gateway::serve::api::AgentRun {
        id: Uuid::now_v7(),
        session_id: d,
        parent_run_id: None,
        group_id: None,
        agent: "archivist".into(),
        mode: keel_gateway::serve::api::RunMode::Background,
        status: keel_gateway::serve::api::RunStatus::Completed,
        depth: 1,
        task: "file it".into(),
        result_bytes: Some(5),
        result_preview: Some("filed".into()),
        result: None,
        error: None,
        usage: None,
        cost_usd: None,
        tool_calls: 0,
        iterations: 1,
        model: "default/scripted".into(),
        revision: 3,
        created_at: keel_gateway::serve::api::Timestamp(0),
        started_at: None,
        finished_at: None,
        deadline_at: keel_gateway::serve::api::Timestamp(0),
    };
    let mut events = Vec::new();
    // The background run completing between runs waits for the next one.
    events.extend(follower.encode(&ServerFrame::AgentRunUpdated {
        session_id: d,
        revision: 3,
        run,
    }));
    assert!(events.is_empty());
    // A user turn (a client's own run, streamed to it) is not repeated here.
    for frame in turn_frames(d, Uuid::now_v7(), TurnOrigin::User) {
        events.extend(follower.encode(&frame));
    }
    assert!(events.is_empty());
    let continuation = Uuid::now_v7();
    for frame in turn_frames(d, continuation, TurnOrigin::AgentContinuation) {
        events.extend(follower.encode(&frame));
    }
    assert!(!follower.in_run());
    let events = values(&events);
    check_agui_order(&events);
    insta::assert_yaml_snapshot!(shape(&events), @r#"
    - RUN_STARTED
    - ACTIVITY_SNAPSHOT archivist completed
    - STEP_STARTED model_call_1
    - TEXT_MESSAGE_START
    - "TEXT_MESSAGE_CONTENT \"Results are in.\""
    - TEXT_MESSAGE_END
    - STEP_FINISHED model_call_1
    - RUN_FINISHED
    "#);
    assert_eq!(events[0]["runId"], continuation.to_string());
    assert_eq!(events[0]["threadId"], "thread-1");
    assert_eq!(
        events[0]["metadata"]["keel"]["turnOrigin"],
        "agent_continuation"
    );
}

/// A client following a thread while a background delegation completes
/// sees the continuation turn that answers it as a run of its own, after
/// the run that delegated, and only that turn (its own runs it already has).
#[tokio::test]
async fn a_continuation_answering_a_background_result_is_its_own_run_on_the_thread() {
    use futures::StreamExt;
    let t = TestServer::start(Setup {
        agents: true,
        provider: scripted(
            [ScriptedResponse::text("Hello.")]
                .into_iter()
                .chain(background_filing("The archivist filed it."))
                .collect(),
        ),
        ..Setup::default()
    })
    .await;
    let first = json!([{"id": "u1", "role": "user", "content": "hi"}]);
    let (_, events) = run(&t, "/ag-ui", input("bg", "r1", first)).await;
    let dialog = events[0]["metadata"]["keel"]["dialogId"].clone();
    let followed = t.get("/ag-ui/threads/bg").await;
    assert_eq!(followed.status(), 200);
    let mut body = followed.bytes_stream();
    let second = json!([
        {"id": "u1", "role": "user", "content": "hi"},
        {"id": "a1", "role": "assistant", "content": "Hello."},
        {"id": "u2", "role": "user", "content": "file it in the background"}
    ]);
    let (_, delegated) = run(&t, "/ag-ui", input("bg", "r2", second)).await;
    assert_eq!(delegated[0]["metadata"]["keel"]["dialogId"], dialog);
    let mut text = String::new();
    let mut seen: Vec<Value> = Vec::new();
    while !seen.iter().any(|e| e["type"] == "RUN_FINISHED") {
        // A guard against a hang, not a wait: the run arrives or the test fails.
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(10), body.next())
            .await
            .unwrap_or_else(|_| panic!("no continuation run on the thread stream: {seen:?}"))
            .expect("the thread stream ended")
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        let complete = text.rfind("\n\n").map_or(0, |i| i + 2);
        seen.extend(
            sse_data(&text[..complete])
                .iter()
                .map(|d| serde_json::from_str::<Value>(d).unwrap()),
        );
        text.drain(..complete);
    }
    check_agui_order(&seen);
    let start = &seen[0];
    assert_eq!(start["threadId"], "bg");
    assert_eq!(start["metadata"]["keel"]["dialogId"], dialog);
    assert_eq!(
        start["metadata"]["keel"]["turnOrigin"],
        "agent_continuation"
    );
    assert_ne!(start["runId"], "r2");
    // The archivist's end is published before the continuation that
    // answers it starts, so the run shows it before any of its text.
    let shapes = shape(&seen);
    let ended = shapes
        .iter()
        .position(|s| s == "ACTIVITY_SNAPSHOT archivist completed")
        .unwrap_or_else(|| panic!("the archivist's end is not in the run: {shapes:#?}"));
    let first_text = shapes
        .iter()
        .position(|s| s.starts_with("TEXT_MESSAGE_CONTENT"))
        .unwrap();
    assert!(ended < first_text, "{shapes:#?}");
    let said: String = seen
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(said, "The archivist filed it.");
    let finished = seen.last().unwrap();
    assert_eq!(finished["runId"], start["runId"]);
    // The continuation's own model call, counted by the turn that made it.
    assert!(
        finished["usage"][0]["totalTokens"].as_u64().unwrap() > 0,
        "{finished}"
    );
}

/// A resume entry answering interrupt `id`.
fn answer(id: &Value, status: &str, payload: Value) -> Value {
    json!({"interruptId": id, "status": status, "payload": payload})
}

fn resume_input(thread: &str, run: &str, resume: Value) -> Value {
    let mut body = input(thread, run, json!([]));
    body["resume"] = resume;
    body
}

#[tokio::test]
async fn a_gated_call_ends_the_run_with_an_interrupt_and_a_resume_decides_it() {
    let ws_dir = tempfile::tempdir().unwrap();
    let workspace = ws_dir.path().canonicalize().unwrap();
    let t = TestServer::start(Setup {
        config: format!(
            "workspace_root = {:?}\n[tools]\nenable_write = true\n",
            workspace.display().to_string()
        ),
        provider: scripted(vec![
            ScriptedResponse {
                text: Some("Writing.".into()),
                tool_calls: vec![ScriptedToolCall {
                    id: Some("call_w".into()),
                    name: "write_file".into(),
                    arguments: json!({"path": "note.txt", "content": "hi"}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("I wrote note.txt."),
            ScriptedResponse {
                tool_calls: vec![
                    ScriptedToolCall {
                        id: Some("call_x".into()),
                        name: "write_file".into(),
                        arguments: json!({"path": "other.txt", "content": "no"}),
                    },
                    ScriptedToolCall {
                        id: Some("call_y".into()),
                        name: "write_file".into(),
                        arguments: json!({"path": "third.txt", "content": "no"}),
                    },
                ],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("I did not write other.txt."),
            ScriptedResponse {
                tool_calls: vec![ScriptedToolCall {
                    id: Some("call_z".into()),
                    name: "write_file".into(),
                    arguments: json!({"path": "last.txt", "content": "no"}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("Decided elsewhere."),
        ]),
        ..Setup::default()
    })
    .await;
    let first = json!([{"id": "m1", "role": "user", "content": "write a note"}]);
    let (status, events) = run(&t, "/ag-ui", input("hitl", "run-1", first)).await;
    assert_eq!(status, 200);
    insta::assert_yaml_snapshot!(shape(&events), @r#"
    - RUN_STARTED
    - STEP_STARTED model_call_1
    - TEXT_MESSAGE_START
    - "TEXT_MESSAGE_CONTENT \"Writing.\""
    - TEXT_MESSAGE_END
    - STEP_FINISHED model_call_1
    - TOOL_CALL_START write_file
    - "TOOL_CALL_ARGS {\"content\":\"hi\",\"path\":\"note.txt\"}"
    - TOOL_CALL_END
    - RUN_FINISHED
    "#);
    let finished = events.last().unwrap();
    let start = events
        .iter()
        .find(|e| e["type"] == "TOOL_CALL_START")
        .unwrap();
    assert_eq!(start["parentMessageId"], events[2]["messageId"]);
    let interrupt = &finished["outcome"]["interrupts"][0];
    let id = interrupt["id"].clone();
    let mut shown = redacted(finished);
    shown["outcome"]["interrupts"][0]["expiresAt"] = json!("[time]");
    shown["usage"] = json!("[usage]");
    insta::assert_json_snapshot!("agui_interrupt_outcome", shown);
    assert!(
        !workspace.join("note.txt").exists(),
        "nothing runs undecided"
    );
    let dialog = events[0]["metadata"]["keel"]["dialogId"]
        .as_str()
        .unwrap()
        .to_owned();
    let pending = t.json(&format!("/api/dialogs/{dialog}/approvals")).await;
    assert_eq!(pending["items"][0]["id"], id);
    assert_eq!(pending["items"][0]["tool_call_id"], "call_w");
    // A client following the thread: resumed continuations are the resume
    // requests' runs, not the stream's.
    let followed = t.get("/ag-ui/threads/hitl").await;
    assert_eq!(followed.status(), 200);
    let mut thread = followed.bytes_stream();

    // Refused before anything is decided: an answer of another thread, an
    // answer naming nothing, a payload that is no decision.
    let refusals = [
        (
            "another thread",
            resume_input(
                "elsewhere",
                "r",
                json!([answer(&id, "resolved", json!({"decision": "approve"}))]),
            ),
        ),
        (
            "nothing named",
            resume_input(
                "hitl",
                "r",
                json!([answer(
                    &json!("nope"),
                    "resolved",
                    json!({"decision": "approve"})
                )]),
            ),
        ),
        (
            "not a decision",
            resume_input(
                "hitl",
                "r",
                json!([answer(&id, "resolved", json!({"decision": "maybe"}))]),
            ),
        ),
    ];
    let mut seen = Vec::new();
    for (name, body) in refusals {
        let (status, body) = run(&t, "/ag-ui", body).await;
        seen.push(json!({"case": name, "status": status, "body": redacted(&body[0])}));
    }
    insta::assert_json_snapshot!("agui_resume_refusals", seen);
    let pending = t.json(&format!("/api/dialogs/{dialog}/approvals")).await;
    assert_eq!(pending["items"][0]["status"], "pending");

    // Approved: the run is the continuation, with the call's result first.
    let earlier = ["call_w".to_owned()];
    let approve = resume_input(
        "hitl",
        "run-2",
        json!([answer(&id, "resolved", json!({"decision": "approve"}))]),
    );
    let (status, events) = run_after(&t, "/ag-ui", approve.clone(), &earlier).await;
    assert_eq!(status, 200, "{events:?}");
    insta::assert_yaml_snapshot!(shape(&events), @r#"
    - RUN_STARTED
    - TOOL_CALL_RESULT
    - STEP_STARTED model_call_1
    - TEXT_MESSAGE_START
    - "TEXT_MESSAGE_CONTENT \"I \""
    - "TEXT_MESSAGE_CONTENT \"wrote \""
    - "TEXT_MESSAGE_CONTENT \"note.txt.\""
    - TEXT_MESSAGE_END
    - STEP_FINISHED model_call_1
    - RUN_FINISHED
    "#);
    assert_eq!(events[0]["runId"], "run-2");
    assert_eq!(events[0]["metadata"]["keel"]["dialogId"], dialog.as_str());
    assert_eq!(
        events[0]["metadata"]["keel"]["turnOrigin"],
        "agent_continuation"
    );
    assert_eq!(events[1]["toolCallId"], "call_w");
    assert!(
        events[1]["content"]
            .as_str()
            .unwrap()
            .contains("wrote 2 bytes"),
        "{}",
        events[1]
    );
    assert_eq!(
        events.last().unwrap()["outcome"],
        json!({"type": "success"})
    );
    assert_eq!(
        std::fs::read_to_string(workspace.join("note.txt")).unwrap(),
        "hi"
    );
    // Answering it again runs nothing twice.
    let (status, again) = run(&t, "/ag-ui", approve).await;
    assert_eq!(status, 409, "{again:?}");
    let approvals = t
        .json(&format!("/api/dialogs/{dialog}/approvals?status=all"))
        .await;
    assert_eq!(approvals["items"][0]["status"], "approved");

    // Abandoned: a denial the model reads, and the call does not run.
    let next = json!([
        {"id": "m1", "role": "user", "content": "write a note"},
        {"id": "a1", "role": "assistant", "content": "Writing."},
        {"id": "a2", "role": "assistant", "content": "I wrote note.txt."},
        {"id": "m2", "role": "user", "content": "and another"}
    ]);
    let (_, events) = run(&t, "/ag-ui", input("hitl", "run-3", next)).await;
    assert_eq!(events[0]["metadata"]["keel"]["dialogId"], dialog.as_str());
    let interrupts = &events.last().unwrap()["outcome"]["interrupts"];
    let (x, y) = (interrupts[0]["id"].clone(), interrupts[1]["id"].clone());
    // Every interrupt of the run needs an answer; omission is no abandonment.
    let partial = resume_input("hitl", "r", json!([answer(&x, "cancelled", Value::Null)]));
    let (status, body) = run(&t, "/ag-ui", partial).await;
    assert_eq!(status, 400);
    let message = body[0]["message"].as_str().unwrap();
    assert!(
        message.contains("must answer every interrupt") && message.contains(y.as_str().unwrap()),
        "{message}"
    );
    let both = resume_input(
        "hitl",
        "run-4",
        json!([
            answer(&x, "cancelled", Value::Null),
            answer(
                &y,
                "resolved",
                json!({"decision": "deny", "reason": "not now"})
            )
        ]),
    );
    let calls = ["call_x".to_owned(), "call_y".to_owned()];
    let (status, events) = run_after(&t, "/ag-ui", both, &calls).await;
    assert_eq!(status, 200, "{events:?}");
    let results: Vec<(&str, &str)> = events
        .iter()
        .filter(|e| e["type"] == "TOOL_CALL_RESULT")
        .map(|e| {
            (
                e["toolCallId"].as_str().unwrap(),
                e["content"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0].0, "call_x");
    assert!(results[0].1.contains("the client abandoned the interrupt"));
    assert_eq!(results[1].0, "call_y");
    assert!(results[1].1.contains("(reason: not now)"), "{results:?}");
    assert!(!workspace.join("other.txt").exists());
    assert!(!workspace.join("third.txt").exists());
    let approvals = t
        .json(&format!("/api/dialogs/{dialog}/approvals?status=all"))
        .await;
    assert_eq!(approvals["items"][1]["status"], "denied");
    assert_eq!(approvals["items"][2]["status"], "denied");

    // Decided elsewhere (REST): the continuation is a run of the thread stream,
    // and the first one there: the resumed ones above were left out.
    let last = json!([
        {"id": "m1", "role": "user", "content": "write a note"},
        {"id": "a1", "role": "assistant", "content": "Writing."},
        {"id": "a2", "role": "assistant", "content": "I wrote note.txt."},
        {"id": "m2", "role": "user", "content": "and another"},
        {"id": "a3", "role": "assistant", "content": "I did not write other.txt."},
        {"id": "m3", "role": "user", "content": "one more"}
    ]);
    let (_, events) = run(&t, "/ag-ui", input("hitl", "run-5", last)).await;
    assert_eq!(events[0]["metadata"]["keel"]["dialogId"], dialog.as_str());
    let z = events.last().unwrap()["outcome"]["interrupts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = t
        .post(&format!("/api/approvals/{z}"), json!({"decision": "deny"}))
        .await;
    assert_eq!(r.status(), 200);
    let seen = read_run(&mut thread).await;
    let said: String = seen
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(said, "Decided elsewhere.", "{seen:?}");
    assert_eq!(
        seen[0]["metadata"]["keel"]["turnOrigin"],
        "agent_continuation"
    );
}

/// Reads a thread stream up to the end of its next run.
async fn read_run(
    body: &mut (impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
) -> Vec<Value> {
    use futures::StreamExt;
    let mut text = String::new();
    let mut seen: Vec<Value> = Vec::new();
    while !seen.iter().any(|e| e["type"] == "RUN_FINISHED") {
        // A guard against a hang, not a wait: the run arrives or the test fails.
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(10), body.next())
            .await
            .unwrap_or_else(|_| panic!("no run on the thread stream: {seen:?}"))
            .expect("the thread stream ended")
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        let complete = text.rfind("\n\n").map_or(0, |i| i + 2);
        seen.extend(
            sse_data(&text[..complete])
                .iter()
                .map(|d| serde_json::from_str::<Value>(d).unwrap()),
        );
        text.drain(..complete);
    }
    seen
}
