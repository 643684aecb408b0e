//! `/v1/chat/completions` and `/v1/models`.

use keel_core::{ScriptedErrorKind, ScriptedResponse, ScriptedToolCall};
use serde_json::{json, Value};

use super::{dialogs, messages, post_raw, redacted, sse_data, BadCase};
use crate::serve::{scripted, Setup, TestServer};

/// One non-streamed completion: (status, the dialog header, the body).
async fn complete(t: &TestServer, body: Value) -> (u16, Option<String>, Value) {
    complete_with(t, body, &[]).await
}

async fn complete_with(
    t: &TestServer,
    body: Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, Value) {
    let (status, dialog, text) =
        post_raw(t, "/v1/chat/completions", body.to_string(), headers).await;
    (status, dialog, serde_json::from_str(&text).unwrap())
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn assistant(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

/// Sends `history` + `input` as `user`; returns the answer's text and the dialog.
async fn turn(t: &TestServer, history: &mut Vec<Value>, input: &str) -> (String, Value) {
    history.push(user(input));
    let (status, header, body) = complete(
        t,
        json!({"model": "keel:root", "messages": history, "user": "alice"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(header.as_deref(), body["keel"]["dialog_id"].as_str());
    history.push(assistant(&text));
    (text, body["keel"].clone())
}

#[tokio::test]
async fn three_turns_resending_the_history_leave_six_messages() {
    let t = TestServer::start(Setup {
        token: Some("sekret"),
        ..Setup::default()
    })
    .await;
    let mut history = vec![json!({"role": "system", "content": "Be brief."})];
    let mut dialog = None;
    for input in ["one", "two", "three"] {
        let (_, keel) = turn(&t, &mut history, input).await;
        assert_eq!(keel["forked_from"], Value::Null);
        let id = keel["dialog_id"].as_str().unwrap().to_owned();
        assert_eq!(*dialog.get_or_insert(id.clone()), id, "one dialog");
    }
    let dialog = dialog.unwrap();
    let kept = messages(&t, &dialog).await;
    assert_eq!(kept.len(), 6, "{kept:#?}");
    assert_eq!(kept.iter().filter(|m| m.starts_with("user: ")).count(), 3);
    assert_eq!(
        dialogs(&t, "openai", "alice").await,
        std::slice::from_ref(&dialog)
    );
    let checkpoints = t.json(&format!("/api/dialogs/{dialog}/checkpoints")).await;
    assert_eq!(checkpoints["items"].as_array().unwrap().len(), 3);
}

#[tokio::test]
async fn a_completion_carries_usage_finish_reason_and_where_keel_keeps_it() {
    let t = TestServer::start(Setup {
        provider: scripted(vec![ScriptedResponse {
            text: Some("Four.".into()),
            usage: Some(keel_core::Usage::new(21, 2)),
            ..ScriptedResponse::default()
        }]),
        ..Setup::default()
    })
    .await;
    let (status, _, body) = complete(
        &t,
        json!({"model": "keel:root", "messages": [user("2+2?")], "temperature": 0.2}),
    )
    .await;
    assert_eq!(status, 200);
    insta::assert_json_snapshot!(redacted(&body), @r#"
    {
      "choices": [
        {
          "finish_reason": "stop",
          "index": 0,
          "logprobs": null,
          "message": {
            "content": "Four.",
            "refusal": null,
            "role": "assistant"
          }
        }
      ],
      "created": "[created]",
      "id": "chatcmpl-[uuid]",
      "keel": {
        "dialog_id": "[uuid]",
        "forked_from": null,
        "turn_id": "[uuid]"
      },
      "model": "keel:root",
      "object": "chat.completion",
      "usage": {
        "completion_tokens": 2,
        "prompt_tokens": 21,
        "total_tokens": 23
      }
    }
    "#);
    assert_eq!(
        body["id"].as_str().unwrap(),
        format!(
            "chatcmpl-{}",
            body["keel"]["turn_id"].as_str().unwrap().replace('-', "")
        )
    );
    // Without `user` the conversation lives in the chat `default`.
    assert_eq!(
        dialogs(&t, "openai", "default").await,
        [body["keel"]["dialog_id"].as_str().unwrap()]
    );
}

#[tokio::test]
async fn a_stream_carries_the_answer_then_its_finish_then_usage() {
    let t = TestServer::start(Setup {
        provider: scripted(vec![ScriptedResponse {
            text: Some("It is late.".into()),
            usage: Some(keel_core::Usage::new(30, 4)),
            ..ScriptedResponse::default()
        }]),
        ..Setup::default()
    })
    .await;
    let body = json!({
        "model": "keel:root",
        "messages": [user("time?")],
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (status, header, text) = post_raw(&t, "/v1/chat/completions", body.to_string(), &[]).await;
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let ids: std::collections::HashSet<&str> =
        chunks.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 1, "every chunk has the completion's id");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(header.as_deref(), finish["keel"]["dialog_id"].as_str());
    insta::assert_json_snapshot!(redacted(&Value::Array(chunks)), @r#"
    [
      {
        "choices": [
          {
            "delta": {
              "content": "",
              "role": "assistant"
            },
            "finish_reason": null,
            "index": 0,
            "logprobs": null
          }
        ],
        "created": "[created]",
        "id": "chatcmpl-[uuid]",
        "model": "keel:root",
        "object": "chat.completion.chunk"
      },
      {
        "choices": [
          {
            "delta": {
              "content": "It "
            },
            "finish_reason": null,
            "index": 0,
            "logprobs": null
          }
        ],
        "created": "[created]",
        "id": "chatcmpl-[uuid]",
        "model": "keel:root",
        "object": "chat.completion.chunk"
      },
      {
        "choices": [
          {
            "delta": {
              "content": "is "
            },
            "finish_reason": null,
            "index": 0,
            "logprobs": null
          }
        ],
        "created": "[created]",
        "id": "chatcmpl-[uuid]",
        "model": "keel:root",
        "object": "chat.completion.chunk"
      },
      {
        "choices": [
          {
            "delta": {
              "content": "late."
            },
            "finish_reason": null,
            "index": 0,
            "logprobs": null
          }
        ],
        "created": "[created]",
        "id": "chatcmpl-[uuid]",
        "model": "keel:root",
        "object": "chat.completion.chunk"
      },
      {
        "choices": [
          {
            "delta": {},
            "finish_reason": "stop",
            "index": 0,
            "logprobs": null
          }
        ],
        "created": "[created]",
        "id": "chatcmpl-[uuid]",
        "keel": {
          "dialog_id": "[uuid]",
          "forked_from": null,
          "turn_id": "[uuid]"
        },
        "model": "keel:root",
        "object": "chat.completion.chunk"
      },
      {
        "choices": [],
        "created": "[created]",
        "id": "chatcmpl-[uuid]",
        "model": "keel:root",
        "object": "chat.completion.chunk",
        "usage": {
          "completion_tokens": 4,
          "prompt_tokens": 30,
          "total_tokens": 34
        }
      }
    ]
    "#);
}

#[tokio::test]
async fn tools_run_inside_keel_and_the_client_sees_the_answer() {
    let t = TestServer::start(Setup {
        provider: scripted(vec![
            ScriptedResponse {
                text: Some("Checking. ".into()),
                tool_calls: vec![ScriptedToolCall {
                    id: None,
                    name: "current_time".into(),
                    arguments: json!({}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("Done."),
        ]),
        ..Setup::default()
    })
    .await;
    let mut history = Vec::new();
    let (answer, keel) = turn(&t, &mut history, "what time is it?").await;
    // The text of both model calls, as a client streaming it would read it.
    assert_eq!(answer, "Checking. Done.");
    let dialog = keel["dialog_id"].as_str().unwrap();
    let kept = messages(&t, dialog).await;
    assert!(kept.iter().any(|m| m.starts_with("tool: ")), "{kept:#?}");
    // Resending that history continues the dialog: keel's tool messages
    // are not part of what the client holds, and need not be.
    let (_, keel) = turn(&t, &mut history, "thanks").await;
    assert_eq!(keel["dialog_id"].as_str(), Some(dialog));
    assert_eq!(keel["forked_from"], Value::Null);
}

#[tokio::test]
async fn an_edited_history_forks_from_the_last_matching_checkpoint() {
    let t = TestServer::start(Setup::default()).await;
    let mut history = Vec::new();
    for input in ["one", "two", "three"] {
        turn(&t, &mut history, input).await;
    }
    let original = dialogs(&t, "openai", "alice").await;
    assert_eq!(original.len(), 1);
    let original = &original[0];
    let before = messages(&t, original).await;

    // The second answer edited: the dialog is forked after the first
    // turn, the client's second exchange imported, then the new input runs.
    let mut edited = history[..3].to_vec();
    edited.push(assistant("an answer the user wrote"));
    let (_, keel) = turn(&t, &mut edited, "four").await;
    let fork = keel["dialog_id"].as_str().unwrap().to_owned();
    assert_ne!(&fork, original);
    assert_eq!(keel["forked_from"].as_str(), Some(original.as_str()));
    let forked = messages(&t, &fork).await;
    assert_eq!(forked[..2], before[..2]);
    assert_eq!(
        forked[2..5],
        [
            "user: two".to_owned(),
            "assistant: an answer the user wrote".to_owned(),
            "user: four".to_owned()
        ]
    );
    assert_eq!(forked.len(), 6);
    // The old dialog is untouched.
    assert_eq!(messages(&t, original).await, before);

    // Continuing the fork's history continues the fork.
    let (_, keel) = turn(&t, &mut edited, "five").await;
    assert_eq!(keel["dialog_id"].as_str(), Some(fork.as_str()));
    assert_eq!(keel["forked_from"], Value::Null);

    // The last user message edited (a regenerate): a fork at the
    // checkpoint after the second turn, nothing imported.
    let mut regenerate = history[..4].to_vec();
    let (_, keel) = turn(&t, &mut regenerate, "three, again").await;
    assert_eq!(keel["forked_from"].as_str(), Some(original.as_str()));
    let again = messages(&t, keel["dialog_id"].as_str().unwrap()).await;
    assert_eq!(again[..4], before[..4]);
    assert_eq!(again[4], "user: three, again");

    // The first answer edited: no checkpoint holds a matching prefix, so
    // a new dialog starts with the client's history imported.
    let mut rewritten = vec![user("one"), assistant("not what keel said")];
    let (_, keel) = turn(&t, &mut rewritten, "two").await;
    assert_eq!(keel["forked_from"], Value::Null);
    let started = messages(&t, keel["dialog_id"].as_str().unwrap()).await;
    assert_eq!(
        started[..3],
        ["user: one", "assistant: not what keel said", "user: two"]
    );
    assert_eq!(dialogs(&t, "openai", "alice").await.len(), 4);
    assert_eq!(messages(&t, original).await, before);
}

#[tokio::test]
async fn a_dialog_is_matched_as_it_is_now_after_a_rollback_or_a_turn_elsewhere() {
    let t = TestServer::start(Setup::default()).await;
    let mut history = Vec::new();
    for input in ["one", "two", "three"] {
        turn(&t, &mut history, input).await;
    }
    let original = dialogs(&t, "openai", "alice").await.remove(0);
    // Rolled back to its first turn through keel's own API, then a turn
    // there: as long as before, but another history.
    let checkpoints = t
        .json(&format!("/api/dialogs/{original}/checkpoints"))
        .await;
    let first = checkpoints["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["turn_index"] == 1)
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = t
        .post(
            &format!("/api/dialogs/{original}/checkpoints/{first}/rollback"),
            json!({}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let events = t.send_streamed(&original, "elsewhere").await;
    assert!(events.ends_with("turn_committed"), "{events}");
    let (_, keel) = turn(&t, &mut history, "four").await;
    assert_eq!(keel["forked_from"].as_str(), Some(original.as_str()));
    let fork = keel["dialog_id"].as_str().unwrap().to_owned();
    let kept = messages(&t, &fork).await;
    assert_eq!(kept.len(), 8, "{kept:#?}");
    assert_eq!(kept[2], "user: two", "the fork is at the first turn");
    // The fork continues; then a turn sent to it through keel's own API,
    // which the client's copy lacks: its next request forks again.
    let (_, keel) = turn(&t, &mut history, "five").await;
    assert_eq!(keel["dialog_id"].as_str(), Some(fork.as_str()));
    let events = t.send_streamed(&fork, "aside").await;
    assert!(events.ends_with("turn_committed"), "{events}");
    let (_, keel) = turn(&t, &mut history, "six").await;
    assert_eq!(keel["forked_from"].as_str(), Some(fork.as_str()));
    assert_eq!(messages(&t, &fork).await.len(), 12, "untouched");
}

#[tokio::test]
async fn two_requests_resending_one_history_never_both_append() {
    let t = TestServer::start(Setup::default()).await;
    let mut history = Vec::new();
    turn(&t, &mut history, "one").await;
    let original = dialogs(&t, "openai", "alice").await.remove(0);
    history.push(user("two"));
    let body = json!({"model": "keel:root", "messages": history, "user": "alice"});
    let (a, b) = tokio::join!(complete(&t, body.clone()), complete(&t, body));
    assert_eq!((a.0, b.0), (200, 200));
    let mut forked: Vec<Value> = [a.2, b.2]
        .iter()
        .map(|r| r["keel"]["forked_from"].clone())
        .collect();
    forked.sort_by_key(|v| v.is_null());
    // One continued the dialog; the other found its turn there and forked.
    assert_eq!(forked, [json!(original), Value::Null]);
    let kept = messages(&t, &original).await;
    assert_eq!(kept.len(), 4, "{kept:#?}");
}

#[tokio::test]
async fn x_keel_dialog_names_the_dialog_a_request_continues() {
    let t = TestServer::start(Setup::default()).await;
    let id = t.dialog("Pinned").await;
    let pinned = [("x-keel-dialog", id.as_str())];
    // Only the new input: keel holds the history, the input goes there.
    for input in ["hello", "more"] {
        let body = json!({"model": "keel:root", "messages": [user(input)]});
        let (status, dialog, answer) = complete_with(&t, body, &pinned).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(dialog.as_deref(), Some(id.as_str()));
    }
    let kept = messages(&t, &id).await;
    assert_eq!(kept.len(), 4);
    // The whole history resent continues it too.
    let mut history: Vec<Value> = kept
        .iter()
        .map(|m| match m.split_once(": ").unwrap() {
            ("user", text) => user(text),
            (_, text) => assistant(text),
        })
        .collect();
    history.push(user("again"));
    let body = json!({"model": "keel:root", "messages": history});
    let (_, dialog, _) = complete_with(&t, body, &pinned).await;
    assert_eq!(dialog.as_deref(), Some(id.as_str()));
    // An edited one forks beside it, and the answer names the fork.
    let body =
        json!({"model": "keel:root", "messages": [user("hello"), assistant("edited"), user("x")]});
    let (_, dialog, answer) = complete_with(&t, body, &pinned).await;
    let fork = dialog.unwrap();
    assert_ne!(fork, id);
    assert_eq!(answer["keel"]["dialog_id"].as_str(), Some(fork.as_str()));
    assert_eq!(messages(&t, &id).await.len(), 6);
    // Another agent's model cannot continue it.
    let body = json!({"model": "keel:nobody", "messages": [user("x")]});
    let (status, _, _) = complete_with(&t, body, &pinned).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn models_are_the_agents_keel_can_run() {
    let t = TestServer::start(Setup {
        agents: true,
        ..Setup::default()
    })
    .await;
    let list = t.json("/v1/models").await;
    let mut listed = redacted(&list);
    listed["data"] = Value::Array(
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].clone())
            .collect(),
    );
    insta::assert_json_snapshot!(listed, @r#"
    {
      "data": [
        "keel:root",
        "keel:archivist",
        "keel:monitor",
        "keel:researcher",
        "keel:writer"
      ],
      "object": "list"
    }
    "#);
    let one = t.json("/v1/models/keel:writer").await;
    assert_eq!(one, list["data"][4]);
    insta::assert_json_snapshot!(redacted(&one), @r#"
    {
      "created": "[created]",
      "id": "keel:writer",
      "object": "model",
      "owned_by": "keel"
    }
    "#);
    // A model's conversation runs that agent.
    let (status, dialog, _) = complete(
        &t,
        json!({"model": "keel:writer", "messages": [user("draft it")]}),
    )
    .await;
    assert_eq!(status, 200);
    let record = t.json(&format!("/api/dialogs/{}", dialog.unwrap())).await;
    assert_eq!(record["agent"], "writer");
}

#[tokio::test]
async fn a_turn_that_fails_is_a_server_error_and_keeps_only_the_input() {
    let failing = || ScriptedResponse::error(ScriptedErrorKind::BadRequest, "the model refused");
    let t = TestServer::start(Setup {
        provider: scripted(vec![failing(), failing()]),
        ..Setup::default()
    })
    .await;
    let (status, dialog, body) =
        complete(&t, json!({"model": "keel:root", "messages": [user("hi")]})).await;
    assert_eq!(status, 500);
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(body["error"]["code"], "turn_failed");
    assert!(dialog.is_none());
    let [first]: [String; 1] = dialogs(&t, "openai", "default").await.try_into().unwrap();
    // The user's message is kept, unanswered; nothing of the answer is.
    let kept = t
        .json(&format!("/api/dialogs/{first}/messages?limit=10"))
        .await;
    assert_eq!(kept["items"].as_array().unwrap().len(), 1, "{kept}");
    assert_eq!(kept["items"][0]["unanswered"], true, "{kept}");
    // Resending the same history never appends a second copy to that dialog.
    let streamed = json!({"model": "keel:root", "messages": [user("hi")], "stream": true});
    let (status, _, text) = post_raw(&t, "/v1/chat/completions", streamed.to_string(), &[]).await;
    assert_eq!(status, 200);
    let last: Value = serde_json::from_str(sse_data(&text).last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "turn_failed", "{text}");
    assert_eq!(messages(&t, &first).await, ["user: hi"]);
}

#[tokio::test]
async fn bad_requests_are_openai_errors_and_change_nothing() {
    let t = TestServer::start(Setup {
        token: Some("sekret"),
        ..Setup::default()
    })
    .await;
    let ok = json!({"model": "keel:root", "messages": [user("hi")]});
    let with = |key: &str, value: Value| {
        let mut b = ok.clone();
        b[key] = value;
        b.to_string()
    };
    let cases: Vec<BadCase> = vec![
        ("not json", "{".into(), vec![]),
        ("not an object", "[]".into(), vec![]),
        (
            "no model",
            json!({"messages": [user("hi")]}).to_string(),
            vec![],
        ),
        ("unknown model", with("model", json!("gpt-4o")), vec![]),
        ("unknown agent", with("model", json!("keel:nobody")), vec![]),
        ("no messages", with("messages", json!([])), vec![]),
        (
            "last is not user",
            with("messages", json!([user("a"), assistant("b")])),
            vec![],
        ),
        ("blank input", with("messages", json!([user("  ")])), vec![]),
        (
            "unknown role",
            with("messages", json!([{"role": "oracle", "content": "x"}])),
            vec![],
        ),
        (
            "image part without text",
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x"}}]}]),
            ),
            vec![],
        ),
        (
            "image over plain http",
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x"}}]}]),
            ),
            vec![],
        ),
        (
            "image that is not one",
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,PHN2Zz4="}}]}]),
            ),
            vec![],
        ),
        (
            "client tool calls",
            with(
                "messages",
                json!([user("a"), {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, user("b")]),
            ),
            vec![],
        ),
        (
            "client tools",
            with(
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            vec![],
        ),
        ("two choices", with("n", json!(2)), vec![]),
        (
            "json mode",
            with("response_format", json!({"type": "json_object"})),
            vec![],
        ),
        ("unknown field", with("frobnicate", json!(true)), vec![]),
        ("stream not a bool", with("stream", json!("yes")), vec![]),
        (
            "user with a colon",
            with("user", json!("org:alice")),
            vec![],
        ),
        (
            "bad dialog header",
            ok.to_string(),
            vec![("x-keel-dialog", "nope")],
        ),
        (
            "unknown dialog",
            ok.to_string(),
            vec![("x-keel-dialog", "01a22c8d-cb40-7766-a28d-a872408af176")],
        ),
        (
            "wrong key",
            ok.to_string(),
            vec![("authorization", "Bearer wrong")],
        ),
        (
            "another site's page",
            ok.to_string(),
            vec![("origin", "https://attacker.example")],
        ),
        (
            "another site's host name",
            ok.to_string(),
            vec![("host", "attacker.example")],
        ),
    ];
    let mut seen = Vec::new();
    for (name, body, headers) in cases {
        let (status, dialog, text) = post_raw(&t, "/v1/chat/completions", body, &headers).await;
        let text = text.replace(&t.base, "http://[server]");
        assert!(dialog.is_none());
        let body: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{name}: {text}"));
        seen.push(json!({"case": name, "status": status, "body": body}));
    }
    let r = t
        .http
        .get(format!("{}/v1/models", t.base))
        .send()
        .await
        .unwrap();
    seen.push(json!({"case": "no key", "status": r.status().as_u16(), "body": r.json::<Value>().await.unwrap()}));
    let r = t.get("/v1/nothing").await;
    seen.push(json!({"case": "unknown route", "status": r.status().as_u16(), "body": r.json::<Value>().await.unwrap()}));
    insta::assert_json_snapshot!(seen);
    for chat in ["default", "alice"] {
        assert!(dialogs(&t, "openai", chat).await.is_empty());
    }
}

#[tokio::test]
async fn a_turn_that_paused_for_approval_names_the_call_that_waits() {
    let ws_dir = tempfile::tempdir().unwrap();
    let workspace = ws_dir.path().canonicalize().unwrap();
    let write = |path: &str| ScriptedResponse {
        text: Some("On it.".into()),
        tool_calls: vec![ScriptedToolCall {
            id: None,
            name: "write_file".into(),
            arguments: json!({"path": path, "content": "hi"}),
        }],
        ..ScriptedResponse::default()
    };
    let t = TestServer::start(Setup {
        config: format!(
            "workspace_root = {:?}\n[tools]\nenable_write = true\n",
            workspace.display().to_string()
        ),
        provider: scripted(vec![
            write("a.txt"),
            ScriptedResponse::text("Wrote a.txt."),
            write("b.txt"),
        ]),
        ..Setup::default()
    })
    .await;
    let (status, _, body) = complete(
        &t,
        json!({"model": "keel:root", "messages": [user("write a")], "user": "hitl"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "On it.");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let mut keel = redacted(&body["keel"]);
    keel["awaiting_approval"][0]["expires_at"] = json!("[time]");
    insta::assert_json_snapshot!(keel, @r#"
    {
      "awaiting_approval": [
        {
          "arguments": {
            "content": "hi",
            "path": "a.txt"
          },
          "expires_at": "[time]",
          "id": "[uuid]",
          "tool": "write_file"
        }
      ],
      "dialog_id": "[uuid]",
      "forked_from": null,
      "turn_id": "[uuid]"
    }
    "#);
    assert!(!workspace.join("a.txt").exists(), "nothing runs undecided");
    let id = body["keel"]["awaiting_approval"][0]["id"].as_str().unwrap();
    let dialog = body["keel"]["dialog_id"].as_str().unwrap();
    let pending = t.json(&format!("/api/dialogs/{dialog}/approvals")).await;
    assert_eq!(pending["items"][0]["id"], id);
    let r = t
        .post(
            &format!("/api/approvals/{id}"),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(r.status(), 200);

    // Streamed: the finish chunk names it.
    let history = json!([user("write a"), assistant("On it."), user("write b")]);
    let (status, _, text) = post_raw(
        &t,
        "/v1/chat/completions",
        json!({"model": "keel:root", "messages": history, "user": "hitl", "stream": true})
            .to_string(),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let chunks: Vec<Value> = sse_data(&text)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let finish = chunks
        .iter()
        .find(|c| c["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert_eq!(finish["keel"]["awaiting_approval"][0]["tool"], "write_file");
    assert_eq!(
        finish["keel"]["awaiting_approval"][0]["arguments"]["path"],
        "b.txt"
    );
    assert!(chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_null())
        .all(|c| c.get("keel").is_none()));
}
