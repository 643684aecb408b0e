//! The OpenAI and AG-UI endpoints of `keel serve`, in-process: the mapping
//! of resent histories onto dialogs (continue, fork, start), the wire
//! shapes (snapshots of answers, chunks, events and error bodies) and the
//! AG-UI ordering rules. The same endpoints are driven by the official
//! Python clients in `tests/interop` (run by `cargo xtask ci`).

mod agui;
mod openai;
mod transcript;

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use crate::serve::TestServer;

/// A bad request: its name, its body and extra headers.
pub type BadCase = (&'static str, String, Vec<(&'static str, &'static str)>);

/// The `data:` payloads of a server-sent event stream.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// POSTs `body` to `path` with the server's token (if any); returns the
/// status, the `x-keel-dialog` header and the body text.
pub async fn post_raw(
    t: &TestServer,
    path: &str,
    body: String,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, String) {
    let mut rb = t
        .http
        .post(format!("{}{path}", t.base))
        .header("content-type", "application/json")
        .body(body);
    if let Some(token) = t
        .token
        .filter(|_| !headers.iter().any(|(k, _)| *k == "authorization"))
    {
        rb = rb.bearer_auth(token);
    }
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    let dialog = r
        .headers()
        .get("x-keel-dialog")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, dialog, r.text().await.unwrap())
}

/// The visible messages of a dialog, as `role: text` lines.
pub async fn messages(t: &TestServer, dialog: &str) -> Vec<String> {
    let page = t
        .json(&format!("/api/dialogs/{dialog}/messages?limit=200"))
        .await;
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            format!(
                "{}: {}",
                m["role"].as_str().unwrap(),
                m["text"].as_str().unwrap()
            )
        })
        .collect()
}

/// The ids of a chat's dialogs.
pub async fn dialogs(t: &TestServer, channel: &str, chat: &str) -> Vec<String> {
    let page = t
        .json(&format!("/api/dialogs?channel={channel}&chat_id={chat}"))
        .await;
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Checks AG-UI's ordering rules on one stream of events: it opens with
/// `RUN_STARTED`; each message is started before its content and ended
/// once; each tool call is started, given arguments and ended in that
/// order, and answered at most once after that; steps open and close in
/// pairs; everything is closed before `RUN_FINISHED`; exactly one
/// `RUN_FINISHED` or `RUN_ERROR` ends the run, and it comes last.
pub fn check_agui_order(events: &[Value]) {
    check_agui_run(events, &[]);
}

/// [`check_agui_order`] for a run that continues an interrupted one: the
/// tool calls `earlier` were started and ended by that run, and may be
/// answered in this one.
pub fn check_agui_run(events: &[Value], earlier: &[String]) {
    let kind = |e: &Value| e["type"].as_str().unwrap().to_owned();
    assert_eq!(events.first().map(kind).as_deref(), Some("RUN_STARTED"));
    let terminal: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(kind(e).as_str(), "RUN_FINISHED" | "RUN_ERROR"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(terminal, [events.len() - 1], "one terminal event, last");
    let mut messages: HashMap<String, &str> = HashMap::new();
    let mut calls: HashMap<String, &str> = earlier.iter().map(|c| (c.clone(), "ended")).collect();
    let mut steps: HashSet<String> = HashSet::new();
    for e in events {
        let id = |k: &str| e[k].as_str().unwrap().to_owned();
        match kind(e).as_str() {
            "TEXT_MESSAGE_START" => {
                assert!(messages.insert(id("messageId"), "open").is_none(), "{e}");
            }
            "TEXT_MESSAGE_CONTENT" => {
                assert_eq!(messages.get(&id("messageId")), Some(&"open"), "{e}");
            }
            "TEXT_MESSAGE_END" => {
                assert_eq!(
                    messages.insert(id("messageId"), "closed"),
                    Some("open"),
                    "{e}"
                );
            }
            "TOOL_CALL_START" => {
                assert!(calls.insert(id("toolCallId"), "started").is_none(), "{e}");
            }
            "TOOL_CALL_ARGS" => {
                assert_eq!(calls.get(&id("toolCallId")), Some(&"started"), "{e}");
            }
            "TOOL_CALL_END" => {
                assert_eq!(
                    calls.insert(id("toolCallId"), "ended"),
                    Some("started"),
                    "{e}"
                );
            }
            "TOOL_CALL_RESULT" => {
                assert_eq!(
                    calls.insert(id("toolCallId"), "answered"),
                    Some("ended"),
                    "{e}"
                );
            }
            "STEP_STARTED" => assert!(steps.insert(id("stepName")), "{e}"),
            "STEP_FINISHED" => assert!(steps.remove(&id("stepName")), "{e}"),
            "RUN_FINISHED" => {
                assert!(steps.is_empty(), "open steps at the end: {steps:?}");
                assert!(messages.values().all(|s| *s == "closed"), "{messages:?}");
                assert!(
                    calls.values().all(|s| *s != "started"),
                    "a tool call left open: {calls:?}"
                );
            }
            _ => {}
        }
    }
}

/// `value` with every UUID (and the 32-hex turn id of a completion id)
/// written `[uuid]`, and `created` times (checked to be recent Unix
/// seconds) written `[created]`.
pub fn redacted(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = if k == "created" {
                        let secs = v.as_i64().expect("created is a number");
                        let now = keel_core::time::now_ms() / 1000;
                        assert!((now - 86_400..=now).contains(&secs), "created {secs}");
                        Value::String("[created]".into())
                    } else {
                        redacted(v)
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(redacted).collect()),
        Value::String(s) => Value::String(redact_ids(s)),
        other => other.clone(),
    }
}

fn redact_ids(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while !rest.is_empty() {
        if rest.len() >= 36
            && rest.is_char_boundary(36)
            && uuid::Uuid::parse_str(&rest[..36]).is_ok()
        {
            out.push_str("[uuid]");
            rest = &rest[36..];
        } else if let Some(after) = rest.strip_prefix("chatcmpl-") {
            let hex = after
                .get(..32)
                .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()));
            assert!(
                hex.is_some(),
                "a completion id is chatcmpl- and 32 hex digits: {s}"
            );
            out.push_str("chatcmpl-[uuid]");
            rest = &after[32..];
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}
