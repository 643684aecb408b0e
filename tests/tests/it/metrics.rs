//! `GET /metrics` and the traces of a real `keel serve` after a scripted
//! dialog: a turn that delegates a foreground batch of two and calls a
//! tool nobody registered, then a turn that delegates in the background,
//! whose continuation the model fails, so the completion is dead-lettered.
//! The metrics text is parsed by the official `prometheus-client` package
//! (`tests/metrics/parse.py`; the test fails, saying so, without it), every
//! metric of docs/OPERATIONS.md must be there with the values the dialog
//! implies, and `keel trace` prints the turn's tree (a snapshot).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};

use crate::serve::{runtime, Served};

const TOKEN: &str = "metrics-token-7420";

fn write_data_dir(data: &Path) {
    std::fs::create_dir_all(data.join("agents")).unwrap();
    let files = [
        (
            "keel.toml",
            "agents_dir = \"agents\"\nroot_delegates = [\"helper\", \"bg\"]\ndefault_profile = \"root\"\n\
             [orchestration]\nmax_inbox_delivery_attempts = 1\nmax_concurrent_runs = 1\nmax_concurrent_runs_per_session = 1\n\
             [providers.root]\nkind = \"scripted\"\nscript = \"root.yaml\"\n\
             [providers.sub]\nkind = \"scripted\"\nscript = \"sub.yaml\"\n",
        ),
        (
            "agents/helper.md",
            "---\nid: helper\ndescription: Helps.\nllm_profile: sub\n---\nYou are helper.\n",
        ),
        (
            "agents/bg.md",
            "---\nid: bg\ndescription: Works in the background.\nllm_profile: sub\n---\nYou are bg.\n",
        ),
        // The root's calls in order: turn 1 (delegate a batch of two, then
        // an unknown tool whose name is HTML, then the answer), turn 2
        // (delegate in the background, answer), the continuation (fails),
        // turn 3 (an answer).
        (
            "root.yaml",
            "responses:\n\
             \x20 - tool_calls: [{name: delegate, arguments: {tasks: [{agent: helper, task: one}, {agent: helper, task: two}]}}]\n\
             \x20   usage: {prompt_tokens: 10, completion_tokens: 2}\n\
             \x20 - tool_calls: [{name: \"<img src=x onerror=alert(1)>\", arguments: {q: \"<b>bold</b>\"}}]\n\
             \x20   usage: {prompt_tokens: 10, completion_tokens: 2}\n\
             \x20 - text: both helped\n\
             \x20   usage: {prompt_tokens: 10, completion_tokens: 2}\n\
             \x20 - tool_calls: [{name: delegate, arguments: {mode: background, tasks: [{agent: bg, task: later}]}}]\n\
             \x20   usage: {prompt_tokens: 10, completion_tokens: 2}\n\
             \x20 - text: started\n\
             \x20   usage: {prompt_tokens: 10, completion_tokens: 2}\n\
             \x20 - error: {kind: server, message: the model is down}\n\
             \x20 - text: nothing new\n\
             \x20   usage: {prompt_tokens: 10, completion_tokens: 2}\n",
        ),
        (
            // The first helper holds the one run permit while its answer is
            // slow, so the second waits for it.
            "sub.yaml",
            "responses:\n\
             \x20 - text: done\n\
             \x20   delay_ms: 300\n\
             \x20   usage: {prompt_tokens: 5, completion_tokens: 1}\n\
             \x20 - text: done\n\
             \x20   usage: {prompt_tokens: 5, completion_tokens: 1}\n\
             \x20 - text: done later\n\
             \x20   usage: {prompt_tokens: 5, completion_tokens: 1}\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(data.join(name), text).unwrap();
    }
}

/// Sends `text` as a streamed turn and returns its frames, once it ended.
async fn streamed_turn(
    http: &reqwest::Client,
    served: &Served,
    dialog: &str,
    text: &str,
) -> Vec<Value> {
    let body = http
        .post(served.url(&format!("/api/dialogs/{dialog}/messages")))
        .bearer_auth(TOKEN)
        .header("accept", "text/event-stream")
        .json(&json!({ "text": text }))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The metrics text parsed by prometheus-client: family → its JSON.
fn parse(text: &str) -> serde_json::Map<String, Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("metrics/parse.py");
    let mut child = std::process::Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs the metrics parser");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the prometheus-client parser failed ({}): {}\n(install it as .ci/run does: pip install prometheus-client==0.26.0)",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    match serde_json::from_slice(&out.stdout).unwrap() {
        Value::Object(families) => families,
        other => panic!("the parser printed {other}"),
    }
}

/// The value of the sample `name` with exactly `labels` (and no others).
fn value(
    families: &serde_json::Map<String, Value>,
    family: &str,
    name: &str,
    labels: Value,
) -> f64 {
    let f = families
        .get(family)
        .unwrap_or_else(|| panic!("no metric family {family}"));
    f["samples"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name && s["labels"] == labels)
        .unwrap_or_else(|| panic!("no sample {name} {labels} in {family}: {}", f["samples"]))
        ["value"]
        .as_f64()
        .unwrap()
}

/// The metric names docs/OPERATIONS.md documents: its table's first column.
fn documented() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/OPERATIONS.md"),
    )
    .unwrap();
    doc.lines()
        .filter_map(|l| l.strip_prefix("| `keel_"))
        .map(|rest| format!("keel_{}", rest.split('`').next().unwrap()))
        .collect()
}

#[test]
fn the_operations_doc_lists_exactly_the_metrics_keel_exposes() {
    let exposed: BTreeSet<String> = keel_gateway::metrics::METRICS
        .iter()
        .map(|m| m.name.to_owned())
        .collect();
    assert_eq!(documented(), exposed);
}

#[test]
fn metrics_after_a_scripted_dialog_hold_what_it_did_and_keel_trace_prints_its_tree() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    write_data_dir(&data);
    let served = Served::start_with(&data, &[("KEEL_TOKEN", TOKEN)]);
    let (text, turn_one) = runtime().block_on(async {
        let http = reqwest::Client::new();
        // The token is required.
        let refused = http.get(served.url("/metrics")).send().await.unwrap();
        assert_eq!(refused.status(), 401);
        let dialog: Value = http
            .post(served.url("/api/dialogs"))
            .bearer_auth(TOKEN)
            .json(&json!({"title": "Metrics"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let dialog = dialog["id"].as_str().unwrap().to_owned();
        // A WebSocket subscribed to the dialog sees the dead letter.
        let (mut ws, _) = tokio_tungstenite::connect_async(
            served
                .url(&format!("/api/ws?access_token={TOKEN}"))
                .replace("http://", "ws://"),
        )
        .await
        .unwrap();
        ws.send(tokio_tungstenite::tungstenite::Message::text(
            json!({"type": "subscribe", "session_id": dialog}).to_string(),
        ))
        .await
        .unwrap();
        let first = streamed_turn(&http, &served, &dialog, "ask both helpers").await;
        assert_eq!(first.last().unwrap()["type"], "turn_committed", "{first:?}");
        let turn_one = first[0]["turn_id"].as_str().unwrap().to_owned();
        let second = streamed_turn(&http, &served, &dialog, "work in the background").await;
        assert_eq!(
            second.last().unwrap()["type"],
            "turn_committed",
            "{second:?}"
        );
        // The continuation answering the background run fails.
        let mut seen = Vec::new();
        let failed = async {
            loop {
                let frame = match ws.next().await.unwrap().unwrap() {
                    tokio_tungstenite::tungstenite::Message::Text(t) => t,
                    _ => continue,
                };
                let frame: Value = serde_json::from_str(&frame).unwrap();
                if frame["type"] == "turn_failed" {
                    return frame;
                }
                seen.push(frame["type"].clone());
            }
        };
        let failed = tokio::time::timeout(std::time::Duration::from_secs(60), failed)
            .await
            .unwrap_or_else(|_| panic!("no failed continuation within a minute after {seen:?}"));
        assert_eq!(failed["turn_origin"], "agent_continuation", "{failed}");
        // The dialog's worker dead-letters the completion (one attempt
        // allowed) and tells the user before it starts the next turn.
        let third = streamed_turn(&http, &served, &dialog, "anything new?").await;
        assert_eq!(third.last().unwrap()["type"], "turn_committed", "{third:?}");
        let inbox: Value = http
            .get(served.url(&format!("/api/dialogs/{dialog}/inbox")))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(inbox["dead_lettered"], 1, "{inbox}");
        // The API's traces of the same tree.
        let trace: Value = http
            .get(served.url(&format!("/api/dialogs/{dialog}/turns/{turn_one}/trace")))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(trace["runs"], 2, "{trace}");
        assert_eq!(trace["root"]["kind"], "turn");
        assert_eq!(trace["root"]["id"], turn_one.as_str());
        insta::assert_json_snapshot!("turn_trace", redacted(trace.clone()));
        // The turn's own calls are children too; the first run is a helper.
        let child = trace["root"]["children"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["kind"] == "run")
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let run: Value = http
            .get(served.url(&format!("/api/agent-runs/{child}/trace")))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(run["root"]["name"], "helper", "{run}");
        assert_eq!(
            run["root"]["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 1})
        );
        // The run's one model call, with the tokens stored on the run.
        assert_eq!(run["calls"], 1, "{run}");
        assert_eq!(run["root"]["children"][0]["kind"], "model", "{run}");
        assert_eq!(run["root"]["children"][0]["usage"], run["root"]["usage"]);
        // A turn that started no run has a trace of its own calls.
        let turn_three = third[0]["turn_id"].as_str().unwrap();
        let plain: Value = http
            .get(served.url(&format!("/api/dialogs/{dialog}/turns/{turn_three}/trace")))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(plain["runs"], 0, "{plain}");
        assert_eq!(plain["root"]["kind"], "turn", "{plain}");
        assert!(
            plain["root"]["model_calls"].as_u64().unwrap() >= 1,
            "{plain}"
        );
        assert_eq!(plain["root"]["children"][0]["kind"], "model", "{plain}");
        let metrics = http
            .get(served.url("/metrics"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(metrics.status(), 200);
        assert!(metrics.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4"));
        let text = metrics.text().await.unwrap();
        drop(ws);
        (text, turn_one)
    });
    let families = parse(&text);
    // Every documented metric is there, with its type; nothing else is.
    let mut expected = BTreeSet::new();
    for m in keel_gateway::metrics::METRICS {
        // prometheus-client names a counter's family without `_total`.
        let family = m.name.strip_suffix("_total").unwrap_or(m.name);
        let f = families
            .get(family)
            .unwrap_or_else(|| panic!("{} is missing from /metrics:\n{text}", m.name));
        assert_eq!(f["type"], m.kind.as_str(), "{}", m.name);
        assert_eq!(f["help"], m.help, "{}", m.name);
        expected.insert(family.to_owned());
    }
    let exposed: BTreeSet<String> = families.keys().cloned().collect();
    assert_eq!(exposed, expected);

    let v = |family: &str, name: &str, labels: Value| value(&families, family, name, labels);
    let turns = "keel_turns";
    assert_eq!(
        v(
            turns,
            "keel_turns_total",
            json!({"origin": "user", "outcome": "committed"})
        ),
        3.0
    );
    assert_eq!(
        v(
            turns,
            "keel_turns_total",
            json!({"origin": "agent_continuation", "outcome": "failed"})
        ),
        1.0
    );
    assert_eq!(
        v(
            "keel_turn_duration_seconds",
            "keel_turn_duration_seconds_count",
            json!({"origin": "user"})
        ),
        3.0
    );
    let tools = "keel_tool_calls";
    assert_eq!(
        v(
            tools,
            "keel_tool_calls_total",
            json!({"tool": "delegate", "outcome": "ok"})
        ),
        2.0
    );
    assert_eq!(
        v(
            tools,
            "keel_tool_calls_total",
            json!({"tool": "unknown", "outcome": "error"})
        ),
        1.0
    );
    let runs = "keel_runs";
    assert_eq!(
        v(
            runs,
            "keel_runs_total",
            json!({"agent": "helper", "status": "completed"})
        ),
        2.0
    );
    assert_eq!(
        v(
            runs,
            "keel_runs_total",
            json!({"agent": "bg", "status": "completed"})
        ),
        1.0
    );
    let calls = "keel_model_calls";
    assert_eq!(
        v(
            calls,
            "keel_model_calls_total",
            json!({"profile": "root", "outcome": "ok"})
        ),
        6.0
    );
    assert_eq!(
        v(
            calls,
            "keel_model_calls_total",
            json!({"profile": "root", "outcome": "error"})
        ),
        1.0
    );
    assert_eq!(
        v(
            calls,
            "keel_model_calls_total",
            json!({"profile": "sub", "outcome": "ok"})
        ),
        3.0
    );
    let tokens = "keel_model_tokens";
    assert_eq!(
        v(
            tokens,
            "keel_model_tokens_total",
            json!({"profile": "root", "type": "input"})
        ),
        60.0
    );
    assert_eq!(
        v(
            tokens,
            "keel_model_tokens_total",
            json!({"profile": "root", "type": "output"})
        ),
        12.0
    );
    assert_eq!(
        v(
            tokens,
            "keel_model_tokens_total",
            json!({"profile": "sub", "type": "input"})
        ),
        15.0
    );
    assert_eq!(
        v(
            "keel_model_time_to_first_token_seconds",
            "keel_model_time_to_first_token_seconds_count",
            json!({"profile": "sub"})
        ),
        3.0
    );
    assert_eq!(
        v(
            "keel_inbox_dead_letter_events",
            "keel_inbox_dead_letter_events",
            json!({})
        ),
        1.0
    );
    // No exporter runs: nothing was dropped.
    assert_eq!(
        v(
            "keel_telemetry_dropped_spans",
            "keel_telemetry_dropped_spans_total",
            json!({})
        ),
        0.0
    );
    assert_eq!(
        v(
            "keel_inbox_pending_events",
            "keel_inbox_pending_events",
            json!({})
        ),
        0.0
    );
    assert_eq!(
        v(
            "keel_inbox_oldest_pending_age_seconds",
            "keel_inbox_oldest_pending_age_seconds",
            json!({})
        ),
        0.0
    );
    for pool in ["runs", "provider", "tool"] {
        assert_eq!(
            v(
                "keel_gate_permits_in_use",
                "keel_gate_permits_in_use",
                json!({"pool": pool})
            ),
            0.0
        );
    }
    // One run permit: the second helper of the batch waited for the first.
    assert_eq!(
        v(
            "keel_gate_waits",
            "keel_gate_waits_total",
            json!({"pool": "runs"})
        ),
        1.0
    );
    assert_eq!(
        v(
            "keel_gate_waits",
            "keel_gate_waits_total",
            json!({"pool": "provider"})
        ),
        0.0
    );
    assert_eq!(
        v(
            "keel_gate_wait_seconds",
            "keel_gate_wait_seconds_count",
            json!({"pool": "runs"})
        ),
        1.0
    );
    assert_eq!(
        v(
            "keel_websocket_clients",
            "keel_websocket_clients",
            json!({})
        ),
        1.0
    );
    assert_eq!(v("keel_sse_clients", "keel_sse_clients", json!({})), 0.0);
    assert!(
        v(
            "keel_store_commit_batch_size",
            "keel_store_commit_batch_size_count",
            json!({})
        ) > 0.0
    );

    // `keel trace` prints the first turn's tree while the server runs.
    let out = crate::keel()
        .args(["trace", &turn_one, "--data-dir"])
        .arg(&data)
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    served.signal("TERM");
    let printed = String::from_utf8(out.stdout).unwrap();
    insta::assert_snapshot!("keel_trace", redact_text(&printed));
}

/// `trace` with its ids, times and durations replaced by their shape
/// (checked first: a UUID, an RFC 3339 time, a count).
fn redacted(mut trace: Value) -> Value {
    fn walk(span: &mut Value) {
        for key in ["id", "turn_id"] {
            let id = span[key].as_str().unwrap();
            assert!(uuid::Uuid::parse_str(id).is_ok(), "{key} {id}");
            span[key] = "<id>".into();
        }
        for key in ["created_at", "started_at", "finished_at"] {
            if let Some(t) = span[key].as_str() {
                assert!(t.ends_with('Z') && t.len() == 24, "{key} {t}");
                span[key] = "<time>".into();
            }
        }
        if span["duration_ms"].is_u64() {
            span["duration_ms"] = "<ms>".into();
        }
        for child in span["children"].as_array_mut().unwrap() {
            walk(child);
        }
    }
    walk(&mut trace["root"]);
    trace
}

/// `text` with every UUID as `<id>` and every millisecond count as `N`.
fn redact_text(text: &str) -> String {
    let mut out = String::new();
    for word in text.split_inclusive([' ', '\n', ',']) {
        let core = word.trim_end_matches([' ', '\n', ',']);
        let tail = &word[core.len()..];
        if uuid::Uuid::parse_str(core).is_ok() {
            out.push_str("<id>");
        } else if core.starts_with('+') && core[1..].chars().all(|c| c.is_ascii_digit()) {
            out.push_str("+N");
        } else {
            out.push_str(core);
        }
        out.push_str(tail);
    }
    // Durations: "N ms" after the offset.
    out.split('\n')
        .map(|line| {
            let mut words: Vec<String> = line.split(' ').map(str::to_owned).collect();
            for i in 1..words.len() {
                if words[i].starts_with("ms")
                    && words[i - 1].chars().all(|c| c.is_ascii_digit())
                    && !words[i - 1].is_empty()
                {
                    words[i - 1] = "N".to_owned();
                }
            }
            words.join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}
