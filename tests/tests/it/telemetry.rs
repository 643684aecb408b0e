//! `keel serve` exporting traces to a real OTLP/HTTP receiver on loopback
//! (`tests/telemetry/otlp_receiver.py`, which decodes the protobuf with the
//! official `opentelemetry-proto` package): a root turn that delegates a
//! foreground batch of two runs and one background run, whose result a
//! continuation turn answers, is one trace with correct parents, the
//! continuation links to the background run, every span carries its GenAI
//! attributes, and the token counts are those keel stored.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::serve::{runtime, Served};

/// The receiver, started with its stdout piped; `listening PORT` read.
struct Receiver {
    child: Child,
    port: u16,
}

impl Receiver {
    fn start() -> Receiver {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("telemetry/otlp_receiver.py");
        let mut child = Command::new("python3")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the telemetry test needs python3");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        if !line.starts_with("listening ") {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            let status = child.wait().unwrap();
            panic!("the OTLP receiver did not start ({status}): {err}");
        }
        let port = line["listening ".len()..].trim().parse().unwrap();
        Receiver { child, port }
    }

    /// Closes its stdin (it stops) and returns every span it printed.
    fn spans(mut self) -> Vec<Value> {
        drop(self.child.stdin.take());
        let mut out = String::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        assert!(self.child.wait().unwrap().success());
        out.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

fn write_agent(data: &Path, id: &str, profile: &str) {
    std::fs::write(
        data.join(format!("agents/{id}.md")),
        format!(
            "---\nid: {id}\ndescription: Agent {id}.\nllm_profile: {profile}\n---\nYou are {id}.\n"
        ),
    )
    .unwrap();
}

/// A data directory whose root agent (script `root.yaml`) delegates to `a`
/// and `b` (one script, `sub.yaml`) and `c` (`bg.yaml`), exporting to `port`.
fn data_dir(data: &Path, port: u16, record_content: bool) {
    std::fs::create_dir_all(data.join("agents")).unwrap();
    write_agent(data, "a", "sub");
    write_agent(data, "b", "sub");
    write_agent(data, "c", "bg");
    std::fs::write(
        data.join("root.yaml"),
        "- tool_calls: [{name: delegate, arguments: {tasks: [{agent: a, task: one}, {agent: b, task: two}]}}]\n  \
           usage: {prompt_tokens: 100, completion_tokens: 10}\n\
         - tool_calls: [{name: delegate, arguments: {mode: background, tasks: [{agent: c, task: three}]}}]\n  \
           usage: {prompt_tokens: 120, completion_tokens: 12}\n\
         - text: started\n  usage: {prompt_tokens: 130, completion_tokens: 5}\n\
         - text: c is done\n  usage: {prompt_tokens: 140, completion_tokens: 6}\n",
    )
    .unwrap();
    std::fs::write(
        data.join("sub.yaml"),
        "- text: done\n  usage: {prompt_tokens: 20, completion_tokens: 2}\n\
         - text: done\n  usage: {prompt_tokens: 20, completion_tokens: 2}\n",
    )
    .unwrap();
    std::fs::write(
        data.join("bg.yaml"),
        "- text: three done\n  usage: {prompt_tokens: 30, completion_tokens: 3}\n",
    )
    .unwrap();
    std::fs::write(
        data.join("keel.toml"),
        format!(
            "agents_dir = \"agents\"\nroot_delegates = [\"a\", \"b\", \"c\"]\ndefault_profile = \"default\"\n\n\
             [providers.default]\nkind = \"scripted\"\nscript = \"root.yaml\"\n\n\
             [providers.sub]\nkind = \"scripted\"\nscript = \"sub.yaml\"\n\n\
             [providers.bg]\nkind = \"scripted\"\nscript = \"bg.yaml\"\n\n\
             [telemetry]\notlp_endpoint = \"http://127.0.0.1:{port}\"\n\
             headers_env = \"KEEL_TEST_OTLP_HEADERS\"\nservice_name = \"keel-e2e\"\n\
             record_content = {record_content}\n"
        ),
    )
    .unwrap();
}

/// What the run left behind: the committed turns' (origin, usage) and the
/// runs as `GET /api/agent-runs` lists them.
struct Stored {
    turns: Vec<(String, String, Value)>,
    runs: Vec<Value>,
}

/// Sends "go" over the WebSocket and waits for the user turn's and the
/// continuation's `turn_committed` frames.
fn drive(served: &Served) -> Stored {
    runtime().block_on(async {
        let http = reqwest::Client::new();
        let dialog: Value = http
            .post(served.url("/api/dialogs"))
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = dialog["id"].as_str().unwrap().to_owned();
        let ws_url = served.url("/api/ws").replacen("http://", "ws://", 1);
        let (mut ws, _) = tokio_tungstenite::connect_async(ws_url).await.unwrap();
        let send = json!({"type": "send", "id": "m1", "session_id": id, "text": "go"});
        ws.send(WsMessage::text(send.to_string())).await.unwrap();
        let mut turns = Vec::new();
        while turns.len() < 2 {
            let frame = tokio::time::timeout(std::time::Duration::from_secs(60), ws.next())
                .await
                .expect("no turn_committed within 60 s")
                .unwrap()
                .unwrap();
            let WsMessage::Text(text) = frame else {
                continue;
            };
            let frame: Value = serde_json::from_str(&text).unwrap();
            match frame["type"].as_str() {
                Some("turn_committed") => turns.push((
                    frame["turn_origin"].as_str().unwrap().to_owned(),
                    frame["turn_id"].as_str().unwrap().to_owned(),
                    frame["usage"].clone(),
                )),
                Some("turn_failed") => panic!("a turn failed: {frame}"),
                _ => {}
            }
        }
        let runs: Value = http
            .get(served.url(&format!("/api/agent-runs?session_id={id}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        Stored {
            turns,
            runs: runs["items"].as_array().unwrap().clone(),
        }
    })
}

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    &span["attributes"][key]
}

fn int(span: &Value, key: &str) -> u64 {
    attr(span, key)
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or_else(|| panic!("{key} missing on {span}"))
}

fn usage_of(v: &Value) -> (u64, u64) {
    (
        v["prompt_tokens"].as_u64().unwrap(),
        v["completion_tokens"].as_u64().unwrap(),
    )
}

fn span_usage(span: &Value) -> (u64, u64) {
    (
        int(span, "gen_ai.usage.input_tokens"),
        int(span, "gen_ai.usage.output_tokens"),
    )
}

/// Runs the scenario against a fresh receiver and returns (spans, stored).
fn scenario(record_content: bool) -> (Vec<Value>, Stored) {
    let receiver = Receiver::start();
    let data = tempfile::tempdir().unwrap();
    data_dir(data.path(), receiver.port, record_content);
    let mut served = Served::start_with(
        data.path(),
        &[("KEEL_TEST_OTLP_HEADERS", "x-keel-test=yes")],
    );
    let stored = drive(&served);
    // Exit exports what is left: once it returned, the receiver printed it.
    served.signal("TERM");
    assert!(served.child.wait().unwrap().success());
    (receiver.spans(), stored)
}

#[test]
fn a_delegation_tree_with_a_background_run_and_its_continuation_is_one_linked_trace() {
    let (spans, stored) = scenario(false);
    let by_id: HashMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap(), s))
        .collect();
    let named =
        |name: &str| -> Vec<&Value> { spans.iter().filter(|s| s["name"] == name).collect() };
    for s in &spans {
        assert_eq!(s["service"], "keel-e2e", "{s}");
        assert_eq!(s["header"], "yes", "headers_env reaches the collector");
    }

    // Two root turns: the user's and the continuation, each a trace root.
    let turns: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "invoke_agent root")
        .collect();
    assert_eq!(turns.len(), 2, "{spans:#?}");
    let turn_of = |origin: &str| {
        *turns
            .iter()
            .find(|t| attr(t, "keel.turn.origin") == origin)
            .unwrap()
    };
    let (user, continuation) = (turn_of("user"), turn_of("agent_continuation"));
    for t in [user, continuation] {
        assert_eq!(t["parent_span_id"], "", "a turn is a root span");
        assert_eq!(attr(t, "gen_ai.operation.name"), "invoke_agent");
        assert_eq!(attr(t, "gen_ai.agent.name"), "root");
        assert!(attr(t, "gen_ai.conversation.id").is_string());
    }
    // Token counts are those of the committed turns.
    for (origin, turn_id, usage) in &stored.turns {
        let t = turn_of(origin);
        assert_eq!(attr(t, "keel.turn.id"), turn_id.as_str());
        assert_eq!(span_usage(t), usage_of(usage), "{origin}");
    }

    // Runs: a and b in the foreground, children of the user's delegate call.
    let run_span = |agent: &str| *named(&format!("invoke_agent {agent}")).first().unwrap();
    let trace = user["trace_id"].as_str().unwrap();
    let delegates: Vec<&Value> = named("execute_tool delegate")
        .into_iter()
        .filter(|s| s["trace_id"] == trace)
        .collect();
    assert_eq!(delegates.len(), 2, "two delegate calls in the user's turn");
    for agent in ["a", "b"] {
        let run = run_span(agent);
        assert_eq!(run["trace_id"], trace, "{agent} is in the turn's trace");
        let parent = by_id[run["parent_span_id"].as_str().unwrap()];
        assert_eq!(parent["name"], "execute_tool delegate", "{agent}");
        assert_eq!(attr(parent, "gen_ai.tool.name"), "delegate");
        assert!(attr(parent, "gen_ai.tool.call.id").is_string());
        assert_eq!(attr(run, "keel.run.mode"), "foreground");
    }
    // c runs in the background: a trace of its own, linked to its delegate call.
    let c = run_span("c");
    assert_ne!(c["trace_id"], trace);
    assert_eq!(c["parent_span_id"], "");
    assert_eq!(attr(c, "keel.run.mode"), "background");
    let c_link = &c["links"][0];
    let started_by = by_id[c_link["span_id"].as_str().unwrap()];
    assert_eq!(started_by["name"], "execute_tool delegate");
    assert_eq!(c_link["trace_id"], trace);
    // The continuation links to c's run.
    let links = continuation["links"].as_array().unwrap();
    assert!(
        links
            .iter()
            .any(|l| l["span_id"] == c["span_id"] && l["trace_id"] == c["trace_id"]),
        "{continuation}"
    );
    // Runs' token counts are those stored with them.
    for run in &stored.runs {
        let agent = run["agent"].as_str().unwrap();
        let span = run_span(agent);
        assert_eq!(attr(span, "keel.run.id"), &run["id"]);
        assert_eq!(attr(span, "gen_ai.agent.name"), agent);
        assert_eq!(span_usage(span), usage_of(&run["usage"]), "{agent}");
    }
    assert_eq!(stored.runs.len(), 3);

    // Every model call is a child of its turn or run, with usage and a finish reason.
    let chats = named("chat scripted");
    assert_eq!(chats.len(), 4 + 2 + 1, "root 4, a and b, c");
    for chat in &chats {
        let parent = by_id[chat["parent_span_id"].as_str().unwrap()];
        assert!(
            parent["name"]
                .as_str()
                .unwrap()
                .starts_with("invoke_agent "),
            "{chat}"
        );
        assert_eq!(chat["trace_id"], parent["trace_id"]);
        assert_eq!(attr(chat, "gen_ai.operation.name"), "chat");
        assert_eq!(attr(chat, "gen_ai.request.model"), "scripted");
        assert!(attr(chat, "gen_ai.response.finish_reasons").is_string());
        span_usage(chat);
        assert!(attr(chat, "keel.time_to_first_token_ms").is_i64(), "{chat}");
    }
    // The turns' usage is the sum of their own model calls.
    for t in [user, continuation] {
        let own = chats
            .iter()
            .filter(|c| c["parent_span_id"] == t["span_id"])
            .map(|c| span_usage(c))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        assert_eq!(own, span_usage(t));
    }
    // Tool calls carry their outcome; store commits their rows.
    for tool in spans
        .iter()
        .filter(|s| attr(s, "gen_ai.operation.name") == "execute_tool")
    {
        assert_eq!(attr(tool, "keel.tool.outcome"), "ok", "{tool}");
    }
    let commits: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"].as_str().unwrap().starts_with("keel.store "))
        .collect();
    let commit_turns = commits
        .iter()
        .filter(|s| s["name"] == "keel.store commit_turn")
        .count();
    assert_eq!(commit_turns, 2);
    assert_eq!(
        commits
            .iter()
            .filter(|s| s["name"] == "keel.store commit_terminal")
            .count(),
        3
    );
    for commit in &commits {
        let parent = by_id[commit["parent_span_id"].as_str().unwrap()];
        assert!(parent["name"]
            .as_str()
            .unwrap()
            .starts_with("invoke_agent "));
        int(commit, "keel.store.rows");
    }
    // No content by default.
    for s in &spans {
        for key in [
            "gen_ai.input.messages",
            "gen_ai.output.messages",
            "gen_ai.tool.call.arguments",
            "gen_ai.tool.call.result",
        ] {
            assert!(attr(s, key).is_null(), "{key} recorded on {s}");
        }
    }
}

#[test]
fn record_content_puts_inputs_answers_and_tool_arguments_on_the_spans() {
    let (spans, _) = scenario(true);
    let user = spans
        .iter()
        .find(|s| s["name"] == "invoke_agent root" && attr(s, "keel.turn.origin") == "user")
        .unwrap();
    assert_eq!(attr(user, "gen_ai.input.messages"), "go");
    let answers: Vec<&str> = spans
        .iter()
        .filter_map(|s| attr(s, "gen_ai.output.messages").as_str())
        .collect();
    assert!(
        answers.contains(&"started") && answers.contains(&"three done"),
        "{answers:?}"
    );
    let delegate = spans
        .iter()
        .find(|s| s["name"] == "execute_tool delegate")
        .unwrap();
    let args: Value = serde_json::from_str(
        attr(delegate, "gen_ai.tool.call.arguments")
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(args["tasks"].is_array());
    assert!(attr(delegate, "gen_ai.tool.call.result").is_string());
}

#[test]
fn an_unreachable_collector_fails_no_turn_and_the_lost_spans_are_counted() {
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let data = tempfile::tempdir().unwrap();
    data_dir(data.path(), port, false);
    let mut served = Served::start_with(
        data.path(),
        &[("KEEL_TEST_OTLP_HEADERS", "x-keel-test=yes")],
    );
    let stored = drive(&served);
    assert_eq!(stored.turns.len(), 2);
    served.signal("TERM");
    let lines = served.stderr_until("span(s) were not exported");
    let line = lines.last().unwrap();
    let n: u64 = line
        .split("telemetry: ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(n >= 7, "every span of the run is counted: {line}");
    assert!(served.child.wait().unwrap().success());
}

#[test]
fn serve_refuses_to_start_when_the_headers_variable_is_not_set() {
    let data = tempfile::tempdir().unwrap();
    data_dir(data.path(), 9, false);
    let out = crate::keel()
        .args(["serve", "--data-dir"])
        .arg(data.path())
        .env_remove("KEEL_TEST_OTLP_HEADERS")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("telemetry.headers_env names $KEEL_TEST_OTLP_HEADERS, which is not set"),
        "{stderr}"
    );
}
