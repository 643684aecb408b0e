//! keel as an MCP server: `/mcp` driven by rmcp's own client over real
//! HTTP on loopback — the agents as tools, a call as a dialog turn, the
//! token and origin checks, progress, cancellation, reloads.

use std::sync::Arc;
use std::time::Duration;

use keel_core::{ScriptedResponse, ScriptedToolCall};
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock, ProgressNotificationParam};
use rmcp::service::{NotificationContext, RoleClient, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientHandler, ServiceError, ServiceExt};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

use super::{scripted, GatedProvider, Setup, TestServer};

const TOKEN: &str = "mcp-s3cret";

/// An MCP client that hands every progress notification to the test.
struct Probe {
    progress: mpsc::UnboundedSender<ProgressNotificationParam>,
    tools_changed: Arc<tokio::sync::Notify>,
}

impl ClientHandler for Probe {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tools_changed.notify_one();
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        let _ = self.progress.send(params);
    }
}

type Client = RunningService<RoleClient, Probe>;

/// A client of `t`'s `/mcp` presenting `token`, and its progress notifications.
async fn connect(
    t: &TestServer,
    token: Option<&str>,
) -> Result<(Client, mpsc::UnboundedReceiver<ProgressNotificationParam>), String> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", t.base));
    if let Some(token) = token {
        config = config.auth_header(token);
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let client = Probe {
        progress: tx,
        tools_changed: Arc::default(),
    }
    .serve(StreamableHttpClientTransport::from_config(config))
    .await
    .map_err(|e| e.to_string())?;
    Ok((client, rx))
}

fn call(tool: &str, arguments: Value) -> CallToolRequestParams {
    let Value::Object(arguments) = arguments else {
        panic!("arguments are an object")
    };
    CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments)
}

/// The text blocks of a result.
fn texts(result: &CallToolResult) -> Vec<String> {
    result
        .content
        .iter()
        .filter_map(|c| match c {
            ContentBlock::Text(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect()
}

/// Progress messages up to and including the first that starts with `prefix`.
async fn progress_until(
    rx: &mut mpsc::UnboundedReceiver<ProgressNotificationParam>,
    prefix: &str,
) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        let p = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no progress {prefix:?} within 30 s; saw {seen:?}"))
            .expect("the client is open");
        let message = p.message.clone().unwrap_or_default();
        if let Some(last) = seen.last().map(|(n, _)| *n) {
            assert!(p.progress > last, "progress goes up: {seen:?} then {p:?}");
        }
        seen.push((p.progress, message.clone()));
        if message.starts_with(prefix) {
            return seen.into_iter().map(|(_, m)| m).collect();
        }
    }
}

/// The dialog id in a result's structured content.
fn dialog_of(result: &CallToolResult) -> String {
    result.structured_content.as_ref().unwrap()["dialog"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn agents_are_tools_and_a_call_is_a_committed_turn_whose_answer_is_the_result() {
    let t = TestServer::start(Setup {
        token: Some(TOKEN),
        agents: true,
        provider: scripted(vec![
            ScriptedResponse::text("the draft"),
            ScriptedResponse::text("the second draft"),
        ]),
        ..Setup::default()
    })
    .await;
    let (client, _progress) = connect(&t, Some(TOKEN)).await.unwrap();
    let info = client.peer_info().unwrap();
    assert_eq!(info.server_info.as_ref().unwrap().name, "keel");

    let tools = client.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "ask_root",
            "ask_archivist",
            "ask_monitor",
            "ask_researcher",
            "ask_writer"
        ]
    );
    let writer = tools.iter().find(|t| t.name == "ask_writer").unwrap();
    let definition = std::fs::read_to_string(t.dir.path().join("agents/writer.md")).unwrap();
    let description = writer.description.as_deref().unwrap();
    assert!(
        definition.contains(&format!("description: {description}")),
        "{description}"
    );
    assert_eq!(writer.input_schema["required"], json!(["task"]));

    // A new dialog with the writer: the task is its user message, the
    // answer the result.
    let result = client
        .call_tool(call("ask_writer", json!({"task": "draft it"})))
        .await
        .unwrap();
    assert_eq!(result.is_error, Some(false));
    let dialog = dialog_of(&result);
    assert_eq!(texts(&result)[0], "the draft");
    assert!(texts(&result)[1].contains(&dialog));
    let record = t.json(&format!("/api/dialogs/{dialog}")).await;
    assert_eq!(
        (&record["agent"], &record["channel"], &record["chat_id"]),
        (&json!("writer"), &json!("mcp"), &json!("rmcp"))
    );

    // The same dialog again: the conversation goes on there.
    let again = client
        .call_tool(call(
            "ask_writer",
            json!({"task": "once more", "dialog": dialog}),
        ))
        .await
        .unwrap();
    assert_eq!(texts(&again)[0], "the second draft");
    assert_eq!(dialog_of(&again), dialog);
    let messages = t.json(&format!("/api/dialogs/{dialog}/messages")).await;
    let said: Vec<(&str, &str)> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["role"].as_str().unwrap(), m["text"].as_str().unwrap()))
        .collect();
    assert_eq!(
        said,
        [
            ("user", "draft it"),
            ("assistant", "the draft"),
            ("user", "once more"),
            ("assistant", "the second draft")
        ]
    );

    // Errors: a dialog of another agent, bad arguments (isError results
    // that change nothing), an unknown agent (a protocol error).
    let wrong = client
        .call_tool(call("ask_root", json!({"task": "x", "dialog": dialog})))
        .await
        .unwrap();
    assert_eq!(wrong.is_error, Some(true));
    assert!(texts(&wrong)[0].contains("runs agent writer"), "{wrong:?}");
    let missing = client
        .call_tool(call("ask_writer", json!({"dialog": dialog})))
        .await
        .unwrap();
    assert_eq!(missing.is_error, Some(true));
    assert!(texts(&missing)[0].contains("`task`"), "{missing:?}");
    let gone = client
        .call_tool(call(
            "ask_writer",
            json!({"task": "x", "dialog": uuid::Uuid::now_v7().to_string()}),
        ))
        .await
        .unwrap();
    assert_eq!(gone.is_error, Some(true));
    assert!(texts(&gone)[0].contains("not found"), "{gone:?}");
    let messages = t.json(&format!("/api/dialogs/{dialog}/messages")).await;
    assert_eq!(messages["items"].as_array().unwrap().len(), 4);
    match client
        .call_tool(call("ask_nobody", json!({"task": "x"})))
        .await
    {
        Err(ServiceError::McpError(e)) => {
            assert_eq!(e.code, rmcp::model::ErrorCode::INVALID_PARAMS);
            assert!(e.message.contains("ask_nobody"), "{e:?}");
        }
        other => panic!("an unknown tool is a protocol error, got {other:?}"),
    }
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn mcp_needs_the_token_and_refuses_foreign_origins() {
    let t = TestServer::start(Setup {
        token: Some(TOKEN),
        ..Setup::default()
    })
    .await;
    assert!(connect(&t, None).await.is_err());
    assert!(connect(&t, Some("wrong")).await.is_err());
    let initialize = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "curl", "version": "1"}},
    });
    let post = |token: Option<&str>, origin: Option<&str>| {
        let mut rb = t
            .http
            .post(format!("{}/mcp", t.base))
            .header("accept", "application/json, text/event-stream")
            .json(&initialize);
        if let Some(token) = token {
            rb = rb.bearer_auth(token);
        }
        if let Some(origin) = origin {
            rb = rb.header("origin", origin);
        }
        rb.send()
    };
    for (token, origin, status) in [
        (None, None, 401),
        (Some("wrong"), None, 401),
        (Some(TOKEN), Some("http://evil.example"), 403),
        (Some(TOKEN), Some("null"), 403),
        (Some(TOKEN), None, 200),
    ] {
        let r = post(token, origin).await.unwrap();
        assert_eq!(r.status(), status, "token {token:?}, origin {origin:?}");
        if status != 200 {
            assert_eq!(
                r.headers()["content-type"],
                "application/problem+json",
                "refused like /api"
            );
        }
    }
}

#[tokio::test]
async fn a_long_call_reports_progress_of_its_tools_runs_and_text() {
    let t = TestServer::start(Setup {
        agents: true,
        provider: scripted(vec![
            ScriptedResponse {
                tool_calls: vec![ScriptedToolCall {
                    id: None,
                    name: "delegate".into(),
                    arguments: json!({"mode": "foreground",
                        "tasks": [{"agent": "researcher", "task": "look it up"}]}),
                }],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("found"),
            ScriptedResponse::text("the researcher found it"),
        ]),
        ..Setup::default()
    })
    .await;
    let (client, mut progress) = connect(&t, None).await.unwrap();
    let result = client
        .call_tool(call("ask_root", json!({"task": "research"})))
        .await
        .unwrap();
    assert_eq!(texts(&result)[0], "the researcher found it");
    let dialog = dialog_of(&result);
    // The run's changes are published apart from the turn (and at the
    // latest before its end), so they may come after the tool's end.
    let seen = progress_until(&mut progress, "sub-agent researcher run").await;
    assert!(seen[0].starts_with("turn "), "{seen:?}");
    assert!(seen[0].ends_with(&format!("started in dialog {dialog}")));
    let at = |prefix: &str| {
        seen.iter()
            .position(|m| m.starts_with(prefix))
            .unwrap_or_else(|| panic!("no progress {prefix:?} in {seen:?}"))
    };
    let started = at("calling tool delegate");
    assert!(started < at("sub-agent researcher run"), "{seen:?}");
    if let Some(finished) = seen.iter().position(|m| m == "tool delegate finished") {
        assert!(started < finished, "{seen:?}");
    }
    // The answer's text is reported too (maybe before the run's change).
    let rest = if seen.iter().any(|m| m == "writing") {
        Vec::new()
    } else {
        progress_until(&mut progress, "writing").await
    };
    let all: Vec<&String> = seen.iter().chain(&rest).collect();
    assert!(
        all.contains(&&"tool delegate finished".to_owned()),
        "{all:?}"
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_cancelled_call_stops_its_turn_and_saves_none_of_its_answer() {
    let gate = Arc::new(Semaphore::new(0));
    let mut t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let (client, mut progress) = connect(&t, None).await.unwrap();
    // The model writes "partial " and then waits on the gate, which only
    // opens after the cancellation.
    let mut call_future = Box::pin(client.call_tool(call("ask_root", json!({"task": "work"}))));
    let seen = tokio::select! {
        r = &mut call_future => panic!("the call ended before it was cancelled: {r:?}"),
        seen = progress_until(&mut progress, "writing") => seen,
    };
    let dialog = seen[0].rsplit(' ').next().unwrap().to_owned();
    // Dropping the call sends notifications/cancelled.
    drop(call_future);
    // A second call on the dialog waits for the dialog until the first
    // turn ended, which only the cancellation can end: the gate opens only
    // once the second turn started.
    let mut next =
        Box::pin(client.call_tool(call("ask_root", json!({"task": "again", "dialog": dialog}))));
    tokio::select! {
        r = &mut next => panic!("the second call ended before its turn started: {r:?}"),
        _ = progress_until(&mut progress, "turn ") => {}
    }
    gate.add_permits(1);
    let next = tokio::time::timeout(Duration::from_secs(30), next)
        .await
        .expect("the second call ends")
        .unwrap();
    assert_eq!(texts(&next)[0], "partial done.");
    let messages = t.json(&format!("/api/dialogs/{dialog}/messages")).await;
    let said: Vec<(&str, &str, bool)> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap(),
                m["text"].as_str().unwrap(),
                m["unanswered"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        said,
        [
            ("user", "work", true),
            ("user", "again", false),
            ("assistant", "partial done.", false)
        ]
    );
    client.cancel().await.unwrap();
    // Open MCP sessions do not hold a shutdown up.
    let report = tokio::time::timeout(Duration::from_secs(30), t.shutdown())
        .await
        .expect("the server shuts down");
    assert_eq!(report.cancelled, 0);
}

#[tokio::test]
async fn the_tool_list_follows_a_catalog_reload() {
    let t = TestServer::start(Setup {
        agents: true,
        ..Setup::default()
    })
    .await;
    let (client, _progress) = connect(&t, None).await.unwrap();
    let names = |tools: Vec<rmcp::model::Tool>| -> Vec<String> {
        tools.into_iter().map(|t| t.name.to_string()).collect()
    };
    let before = names(client.list_all_tools().await.unwrap());
    assert!(!before.contains(&"ask_critic".to_owned()));
    std::fs::write(
        t.dir.path().join("agents/critic.md"),
        "---\nid: critic\ndescription: Finds the weak points of a draft.\nllm_profile: default\n---\nYou criticise.\n",
    )
    .unwrap();
    std::fs::remove_file(t.dir.path().join("agents/monitor.md")).unwrap();
    let r = t.post("/api/admin/reload", json!({})).await;
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    // The session is told, on its standalone stream.
    tokio::time::timeout(
        Duration::from_secs(30),
        client.service().tools_changed.notified(),
    )
    .await
    .expect("notifications/tools/list_changed after the reload");
    let tools = client.list_all_tools().await.unwrap();
    let critic = tools.iter().find(|t| t.name == "ask_critic").cloned();
    assert_eq!(
        critic.and_then(|t| t.description).as_deref(),
        Some("Finds the weak points of a draft.")
    );
    let after = names(tools);
    assert!(!after.contains(&"ask_monitor".to_owned()), "{after:?}");
    assert_eq!(after.len(), before.len());
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_call_whose_turn_waits_for_approval_says_so_and_runs_nothing() {
    let ws_dir = tempfile::tempdir().unwrap();
    let workspace = ws_dir.path().canonicalize().unwrap();
    let t = TestServer::start(Setup {
        config: format!(
            "workspace_root = {:?}\n[tools]\nenable_write = true\n",
            workspace.display().to_string()
        ),
        provider: scripted(vec![ScriptedResponse::tool_call(
            "write_file",
            json!({"path": "note.txt", "content": "hi"}),
        )]),
        ..Setup::default()
    })
    .await;
    let (client, _progress) = connect(&t, None).await.unwrap();
    let result = client
        .call_tool(call("ask_root", json!({"task": "write a note"})))
        .await
        .unwrap();
    assert_eq!(result.is_error, Some(false));
    let dialog = dialog_of(&result);
    let structured = result.structured_content.as_ref().unwrap();
    assert_eq!(structured["waiting_for_approval"], json!(["write_file"]));
    assert!(
        texts(&result)[2].contains("wait for a person's approval"),
        "{result:?}"
    );
    assert!(
        !workspace.join("note.txt").exists(),
        "nothing runs undecided"
    );
    let pending = t.json(&format!("/api/dialogs/{dialog}/approvals")).await;
    assert_eq!(pending["items"].as_array().unwrap().len(), 1);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_call_cancelled_while_it_waits_for_its_dialog_writes_nothing() {
    let gate = Arc::new(Semaphore::new(0));
    let t = TestServer::start(Setup {
        provider: Arc::new(GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let (client, mut progress) = connect(&t, None).await.unwrap();
    // The first call holds the dialog: its model waits on the gate.
    let mut first = Box::pin(client.call_tool(call("ask_root", json!({"task": "work"}))));
    let seen = tokio::select! {
        r = &mut first => panic!("the first call ended early: {r:?}"),
        seen = progress_until(&mut progress, "writing") => seen,
    };
    let dialog = seen[0].rsplit(' ').next().unwrap().to_owned();
    // The second call on the dialog says it waits, and is cancelled there.
    let mut second =
        Box::pin(client.call_tool(call("ask_root", json!({"task": "never", "dialog": dialog}))));
    tokio::select! {
        r = &mut first => panic!("the first call ended early: {r:?}"),
        r = &mut second => panic!("the second call ended early: {r:?}"),
        _ = progress_until(&mut progress, "waiting for dialog") => {}
    }
    drop(second);
    // A request after the cancellation: the server has read it by then.
    client.list_all_tools().await.unwrap();
    gate.add_permits(1);
    let first = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the first call ends")
        .unwrap();
    assert_eq!(texts(&first)[0], "partial done.");
    // The next call on the dialog is answered (the gate opens once more):
    // the cancelled one never took its place.
    gate.add_permits(1);
    let next = client
        .call_tool(call("ask_root", json!({"task": "again", "dialog": dialog})))
        .await
        .unwrap();
    assert_eq!(texts(&next)[0], "partial done.");
    let messages = t.json(&format!("/api/dialogs/{dialog}/messages")).await;
    let said: Vec<&str> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["text"].as_str().unwrap())
        .collect();
    assert_eq!(said, ["work", "partial done.", "again", "partial done."]);
    // Nor is it left queued for the next start of keel.
    assert!(t.store.queued_inputs().await.unwrap().is_empty());
    client.cancel().await.unwrap();
}
