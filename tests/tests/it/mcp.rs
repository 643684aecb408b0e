//! The MCP client against real MCP servers written with rmcp's server side
//! (`keel_e2e::mcp_server`): the stdio one as a child process confined by
//! the real sandbox launcher, the Streamable HTTP one on loopback. What is
//! committed at activation, what the model's calls reach, their bounds,
//! cancellation, a server down at start-up, and the offline catalog check.
//! They need a kernel with Landlock, as the shell sandbox tests do.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_core::{Tool, ToolError, ToolExecutionContext};
use keel_gateway::config::{Config, ToolsConfig};
use keel_gateway::mcp::{connect_all, McpSetup};
use keel_store::{Store, StoreOptions};
use serde_json::json;

const SERVER: &str = env!("CARGO_BIN_EXE_keel-mcp-test-server");
const LAUNCHER: &str = env!("CARGO_BIN_EXE_keel-e2e");

pub(crate) struct Dirs {
    _dirs: [tempfile::TempDir; 2],
    pub(crate) ws: PathBuf,
    pub(crate) data: PathBuf,
}

pub(crate) fn dirs() -> Dirs {
    let dirs = [(); 2].map(|()| tempfile::tempdir().unwrap());
    let [ws, data] = [0, 1].map(|i| dirs[i].path().canonicalize().unwrap());
    Dirs {
        _dirs: dirs,
        ws,
        data,
    }
}

pub(crate) fn quoted(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

/// A keel.toml with the workspace, read paths that include the test
/// server's directory, and `servers`.
pub(crate) fn toml(d: &Dirs, servers: &str) -> String {
    toml_reading(d, &[], servers)
}

/// [`toml`] with `reads` added to the read paths.
pub(crate) fn toml_reading(d: &Dirs, reads: &[&Path], servers: &str) -> String {
    let mut read: Vec<String> = ToolsConfig::default()
        .shell_read_paths
        .iter()
        .map(|p| quoted(p))
        .collect();
    read.push(quoted(Path::new(SERVER).parent().unwrap()));
    read.extend(reads.iter().map(|p| quoted(p)));
    format!(
        "data_dir = {}\nworkspace_root = {}\n[tools]\nshell_read_paths = [{}]\n{servers}",
        quoted(&d.data),
        quoted(&d.ws),
        read.join(", ")
    )
}

pub(crate) fn stdio(name: &str, extra: &str) -> String {
    format!("[mcp.{name}]\ncommand = {:?}\n{extra}", SERVER)
}

pub(crate) fn config(text: &str) -> Config {
    Config::from_toml_str_with_env(text, "keel.toml", &|k| std::env::var(k).ok()).unwrap()
}

pub(crate) fn store(d: &Dirs) -> Store {
    Store::open(d.data.join("keel.db"), StoreOptions::default()).unwrap()
}

pub(crate) async fn connect(d: &Dirs, store: &Store, servers: &str) -> McpSetup {
    connect_toml(store, &toml(d, servers)).await
}

/// Connects the servers of the keel.toml `text`.
pub(crate) async fn connect_toml(store: &Store, text: &str) -> McpSetup {
    connect_all(&config(text), store, Some(PathBuf::from(LAUNCHER)))
        .await
        .unwrap()
}

pub(crate) fn tool(setup: &McpSetup, name: &str) -> Arc<dyn Tool> {
    setup
        .tools
        .iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("no tool {name}; notices: {:?}", setup.notices))
        .clone()
}

/// A tool error's text without its error id (a fresh UUID each time).
pub(crate) fn without_error_id(err: &ToolError) -> String {
    let text = err.to_string();
    match text.split_once(" (error id ") {
        Some((head, _)) => head.to_owned(),
        None => text,
    }
}

/// Sends SIGKILL to `pid` (a server's process).
pub(crate) fn kill(pid: &str) {
    let status = std::process::Command::new("kill")
        .args(["-KILL", pid])
        .status()
        .unwrap();
    assert!(status.success(), "kill -KILL {pid}");
}

/// Waits (at most 20 s) until `server`'s status satisfies `pred`.
pub(crate) async fn wait_for(
    server: &keel_gateway::mcp::ServerConnection,
    pred: impl Fn(&keel_gateway::mcp::StatusReport) -> bool,
) {
    tokio::time::timeout(Duration::from_secs(20), server.wait_for(pred))
        .await
        .unwrap_or_else(|_| panic!("server status stayed {:?}", server.status()));
}

pub(crate) async fn call(
    tool: &Arc<dyn Tool>,
    args: serde_json::Value,
) -> Result<keel_core::ToolOutput, ToolError> {
    tool.execute(args, &ToolExecutionContext::default()).await
}

#[tokio::test]
async fn a_stdio_server_is_listed_committed_and_called() {
    let d = dirs();
    let store = store(&d);
    let setup = connect(&d, &store, &stdio("srv", "")).await;
    assert!(setup.notices.is_empty(), "{:?}", setup.notices);
    let mut names: Vec<&str> = setup.tools.iter().map(|t| t.name()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "mcp__srv__add",
            "mcp__srv__big",
            "mcp__srv__connect",
            "mcp__srv__echo",
            "mcp__srv__fail",
            "mcp__srv__image",
            "mcp__srv__pid",
            "mcp__srv__read",
            "mcp__srv__sleep",
            "mcp__srv__write"
        ]
    );
    // The manifest is committed with its hash, the schema passed through.
    let records = store.mcp_manifests().await.unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].server, "srv");
    assert_eq!(records[0].hash.len(), 64);
    let echo = tool(&setup, "mcp__srv__echo");
    assert_eq!(echo.description(), "Returns its text.");
    assert_eq!(echo.parameters()["required"], json!(["text"]));
    assert_eq!(
        echo.delegation_policy(),
        keel_core::DelegationPolicy::RootOnly
    );
    // Calls reach the server; results map to what the model reads.
    let out = call(&echo, json!({"text": "hello"})).await.unwrap();
    assert_eq!((out.content.as_str(), out.is_error), ("hello", false));
    let out = call(&tool(&setup, "mcp__srv__add"), json!({"a": 2, "b": 3}))
        .await
        .unwrap();
    assert_eq!(out.content, "5");
    let out = call(&tool(&setup, "mcp__srv__fail"), json!({}))
        .await
        .unwrap();
    assert_eq!((out.content.as_str(), out.is_error), ("it failed", true));
    let out = call(&tool(&setup, "mcp__srv__image"), json!({}))
        .await
        .unwrap();
    assert_eq!(
        out.content,
        "[image image/png, 12 bytes of base64 not shown]"
    );
    let err = call(&echo, json!([1])).await.unwrap_err();
    assert!(matches!(err, ToolError::InvalidArguments(_)), "{err:?}");
}

#[tokio::test]
async fn the_allow_list_and_delegatable_decide_what_is_registered() {
    let d = dirs();
    let store = store(&d);
    let setup = connect(
        &d,
        &store,
        &stdio("srv", "tools = [\"echo\"]\ndelegatable = true\n"),
    )
    .await;
    let names: Vec<&str> = setup.tools.iter().map(|t| t.name()).collect();
    assert_eq!(names, ["mcp__srv__echo"]);
    assert_eq!(
        setup.tools[0].delegation_policy(),
        keel_core::DelegationPolicy::Delegatable
    );
    let srv = &setup.catalog["srv"];
    assert!(srv.delegatable);
    assert_eq!(
        srv.tools.as_ref().unwrap().keys().collect::<Vec<_>>(),
        ["echo"]
    );
    // Its calls wait for a person unless the server says `never`.
    assert_eq!(setup.gated, ["mcp__srv__echo"]);
    let unasked = connect(
        &d,
        &store,
        &stdio("srv", "tools = [\"echo\"]\napproval = \"never\"\n"),
    )
    .await;
    assert_eq!(unasked.tools.len(), 1);
    assert!(unasked.gated.is_empty());
}

#[tokio::test]
async fn a_call_is_bounded_by_the_timeout_and_the_output_cap() {
    let d = dirs();
    let store = store(&d);
    let setup = connect(
        &d,
        &store,
        &stdio("srv", "timeout_secs = 1\nmax_output_bytes = 256\n"),
    )
    .await;
    let err = call(&tool(&setup, "mcp__srv__sleep"), json!({"ms": 30_000}))
        .await
        .unwrap_err();
    assert_eq!(err, ToolError::TimedOut(1000));
    // The server still answers after a timed-out call.
    let out = call(&tool(&setup, "mcp__srv__big"), json!({"bytes": 10_000}))
        .await
        .unwrap();
    assert!(out.content.starts_with(&"x".repeat(256)), "{}", out.content);
    assert!(out.content.len() < 300, "{}", out.content.len());
    assert!(
        out.content.ends_with("[truncated 9744 bytes]"),
        "{}",
        out.content
    );
}

#[tokio::test]
async fn a_server_down_at_start_keeps_its_last_manifest_and_its_calls_name_it() {
    let d = dirs();
    let store = store(&d);
    let first = connect(&d, &store, &stdio("srv", "")).await;
    assert!(first.notices.is_empty(), "{:?}", first.notices);
    drop(first);
    // A call's timeout (1 s) ends before the next attempt (2 s after the
    // failed one): it fails at once.
    let down = "[mcp.srv]\ncommand = \"/nonexistent/keel-mcp-server\"\ntimeout_secs = 1\n\
                [mcp.ghost]\ncommand = \"/nonexistent/keel-mcp-ghost\"\n";
    let setup = connect(&d, &store, down).await;
    assert_eq!(setup.notices.len(), 2, "{:?}", setup.notices);
    assert!(
        setup.notices[1].contains("MCP server srv is unavailable"),
        "{:?}",
        setup.notices
    );
    assert!(setup.notices[0].contains("ghost") && setup.notices[0].contains("never reached"));
    // srv's tools are still there, from the committed manifest…
    assert_eq!(setup.tools.len(), 10);
    assert_eq!(setup.catalog["srv"].tools.as_ref().unwrap().len(), 10);
    // …and fail at call time naming the server; ghost was never seen.
    assert_eq!(setup.catalog["ghost"].tools, None);
    let err = call(&tool(&setup, "mcp__srv__echo"), json!({"text": "x"}))
        .await
        .unwrap_err();
    insta::assert_snapshot!(without_error_id(&err), @"failed: MCP server srv is unavailable: it stopped or could not be started, and keel tries again in 2 s");
    // Its status says why, as the start-up notice did.
    let status = setup.servers["srv"].connection.status();
    assert_eq!(status.state, "unavailable");
    let reason = status.reason.unwrap();
    assert!(setup.notices[1].contains(&reason), "{reason}");
    assert_eq!(store.mcp_manifests().await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_changed_manifest_replaces_the_committed_one() {
    let d = dirs();
    let store = store(&d);
    let setup = connect(
        &d,
        &store,
        &stdio("srv", "args = [\"--tools\", \"echo,add\"]\n"),
    )
    .await;
    assert_eq!(setup.tools.len(), 2);
    let before = store.mcp_manifests().await.unwrap();
    drop(setup);
    let setup = connect(
        &d,
        &store,
        &stdio("srv", "args = [\"--tools\", \"echo\"]\n"),
    )
    .await;
    let after = store.mcp_manifests().await.unwrap();
    assert_ne!(before[0].hash, after[0].hash);
    assert!(
        !after[0].manifest.contains("\"add\""),
        "{}",
        after[0].manifest
    );
    assert_eq!(
        setup.catalog["srv"]
            .tools
            .as_ref()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["echo"]
    );
}

#[tokio::test]
async fn a_confined_stdio_server_writes_only_in_the_workspace() {
    let d = dirs();
    let store = store(&d);
    let setup = connect(&d, &store, &stdio("srv", "")).await;
    let write = tool(&setup, "mcp__srv__write");
    let inside = d.ws.join("inside.txt");
    let out = call(&write, json!({"path": inside})).await.unwrap();
    assert_eq!((out.content.as_str(), out.is_error), ("written", false));
    assert_eq!(std::fs::read_to_string(&inside).unwrap(), "written");
    // The data directory (and everything else outside the workspace) is not writable.
    let outside = d.data.join("outside.txt");
    let out = call(&write, json!({"path": outside})).await.unwrap();
    assert!(out.is_error, "{}", out.content);
    assert!(out.content.contains("Permission denied"), "{}", out.content);
    assert!(!outside.exists());
}

#[tokio::test]
async fn a_confined_stdio_server_opens_no_tcp_connection_unless_network_is_allowed() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    for (network, expected) in [(false, false), (true, true)] {
        let d = dirs();
        let store = store(&d);
        let setup = connect(&d, &store, &stdio("srv", &format!("network = {network}\n"))).await;
        let out = call(&tool(&setup, "mcp__srv__connect"), json!({"addr": addr}))
            .await
            .unwrap();
        assert_eq!(
            out.content == "connected",
            expected,
            "network = {network}: {}",
            out.content
        );
        assert_eq!(out.is_error, !expected, "{}", out.content);
    }
}

#[tokio::test]
async fn a_streamable_http_server_is_called_and_a_cancelled_turn_cancels_the_call() {
    let started = Arc::new(tokio::sync::Notify::new());
    let cancelled = Arc::new(tokio::sync::Notify::new());
    let server =
        keel_e2e::mcp_server::TestServer::new(None).notifying(started.clone(), cancelled.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(tokio::sync::Notify::new());
    let serving = tokio::spawn(keel_e2e::mcp_server::serve_http(server, listener, {
        let stop = stop.clone();
        async move { stop.notified().await }
    }));
    let d = dirs();
    let store = store(&d);
    let setup = connect(
        &d,
        &store,
        &format!("[mcp.web]\nurl = \"http://{addr}/mcp\"\n"),
    )
    .await;
    assert!(setup.notices.is_empty(), "{:?}", setup.notices);
    let out = call(&tool(&setup, "mcp__web__add"), json!({"a": 40, "b": 2}))
        .await
        .unwrap();
    assert_eq!(out.content, "42");
    // A turn stopped mid-call: the tool returns Cancelled and the server
    // hears MCP's cancellation.
    let sleep = tool(&setup, "mcp__web__sleep");
    let ctx = ToolExecutionContext::default();
    let token = ctx.cancellation.clone();
    let running = tokio::spawn(async move { sleep.execute(json!({"ms": 60_000}), &ctx).await });
    started.notified().await;
    token.cancel();
    assert_eq!(running.await.unwrap().unwrap_err(), ToolError::Cancelled);
    tokio::time::timeout(Duration::from_secs(10), cancelled.notified())
        .await
        .expect("the server was told the call was cancelled");
    drop(setup);
    stop.notify_one();
    serving.await.unwrap().unwrap();
}

/// The binary: `keel chat` with a stdio server configured, the scripted
/// model calling its tool; then `keel agents check` with the server gone,
/// from the committed manifest.
#[test]
fn a_scripted_turn_calls_an_mcp_tool_and_agents_check_validates_offline() {
    let d = dirs();
    std::fs::create_dir_all(d.data.join("agents")).unwrap();
    let def = |tools: &str| {
        format!("---\nid: helper\ndescription: Helps.\nllm_profile: default\ntools: {tools}\n---\nYou help.\n")
    };
    std::fs::write(d.data.join("agents/helper.md"), def("[mcp:srv/*]")).unwrap();
    std::fs::write(d.data.join("keel.toml"), toml(&d, &stdio("srv", ""))).unwrap();
    let script = d.data.join("script.yaml");
    std::fs::write(
        &script,
        "responses:\n  - tool_calls: [{name: mcp__srv__echo, arguments: {text: hello from mcp}}]\n  - text: \"The server said hello.\"\n",
    )
    .unwrap();
    let out = crate::keel()
        .args(["chat", "--data-dir"])
        .arg(&d.data)
        .arg("--script")
        .arg(&script)
        .env("KEEL_LOG", "error")
        .env_remove("KEEL_DATA_DIR")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"say hello\ny\n/exit\n")?;
            child.wait_with_output()
        })
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // MCP tools wait for a person by default: the chat asks, `y` approves.
    assert!(
        stdout.contains(
            "mcp__srv__echo({\"text\":\"hello from mcp\"}) — allow? [y]es / [n]o / [a]lways"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("The server said hello."), "{stdout}");
    // The server's answer is the tool message the model read next.
    let tool_result = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(async {
            let store =
                keel_store::Store::open(d.data.join("keel.db"), Default::default()).unwrap();
            let dialog = store
                .latest_active_dialog("cli", "local")
                .await
                .unwrap()
                .expect("the chat's dialog");
            let messages = store
                .load_messages(dialog.id, keel_store::MessageFilter::default())
                .await
                .unwrap();
            messages
                .iter()
                .find(|m| m.message.role == keel_core::Role::Tool)
                .map(|m| m.message.text())
                .unwrap()
        });
    assert!(tool_result.contains("hello from mcp"), "{tool_result}");

    // Offline: the server cannot start any more, the manifest decides.
    let gone = toml(
        &d,
        "[mcp.srv]\ncommand = \"/nonexistent/keel-mcp-server\"\n",
    );
    std::fs::write(d.data.join("keel.toml"), gone).unwrap();
    let check = |tools: &str| {
        std::fs::write(d.data.join("agents/helper.md"), def(tools)).unwrap();
        let out = crate::keel()
            .args(["agents", "check"])
            .arg(d.data.join("agents"))
            .arg("--config")
            .arg(d.data.join("keel.toml"))
            .env("KEEL_LOG", "error")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, stdout) = check("[mcp:srv/echo]");
    assert!(ok, "{stdout}");
    assert!(stdout.contains("mcp__srv__echo"), "{stdout}");
    let (ok, stdout) = check("[mcp:srv/ehco]");
    assert!(!ok, "{stdout}");
    assert!(
        stdout.contains("helper.md:5:9: tools[0]: MCP server \"srv\" has no tool \"ehco\" in its last manifest; did you mean \"echo\"?"),
        "{stdout}"
    );
}

#[tokio::test]
async fn a_killed_stdio_server_is_restarted_and_a_call_during_the_restart_waits_for_it() {
    let d = dirs();
    let store = store(&d);
    let setup = connect(&d, &store, &stdio("srv", "")).await;
    let server = setup.servers["srv"].connection.clone();
    assert_eq!(server.status().state, "up");
    let pid = tool(&setup, "mcp__srv__pid");
    let first = call(&pid, json!({})).await.unwrap().content;
    kill(&first);
    // Once keel has seen it die (or already restarted it), the next call
    // waits for the new process and reaches it.
    wait_for(&server, |s| s.state != "up" || s.restarts > 0).await;
    let second = call(&pid, json!({})).await.unwrap().content;
    assert_ne!(first, second);
    let status = server.status();
    assert_eq!((status.state, status.restarts), ("up", 1));
    assert!(
        status.reason.unwrap().contains("session ended"),
        "{:?}",
        server.status()
    );
    let out = call(&tool(&setup, "mcp__srv__echo"), json!({"text": "back"}))
        .await
        .unwrap();
    assert_eq!(out.content, "back");
}

#[tokio::test]
async fn a_server_that_keeps_dying_is_restarted_with_backoff_and_calls_meanwhile_name_it() {
    let d = dirs();
    let store = store(&d);
    let setup = connect(
        &d,
        &store,
        &stdio(
            "srv",
            "timeout_secs = 1
",
        ),
    )
    .await;
    let server = setup.servers["srv"].connection.clone();
    let pid = tool(&setup, "mcp__srv__pid");
    // The first death is restarted at once…
    kill(&call(&pid, json!({})).await.unwrap().content);
    wait_for(&server, |s| s.state == "up" && s.restarts == 1).await;
    // …the second soon after waits 2 s, longer than a call's timeout (1 s):
    // a call fails at once, naming the server.
    kill(&call(&pid, json!({})).await.unwrap().content);
    wait_for(&server, |s| s.state == "unavailable").await;
    let err = call(&pid, json!({})).await.unwrap_err();
    insta::assert_snapshot!(without_error_id(&err), @"failed: MCP server srv is unavailable: it stopped or could not be started, and keel tries again in 2 s");
    // After the wait it is back.
    wait_for(&server, |s| s.state == "up" && s.restarts == 2).await;
    assert!(call(&pid, json!({})).await.is_ok());
}

#[tokio::test]
async fn a_confined_stdio_server_cannot_read_a_home_outside_the_workspace() {
    let d = dirs();
    let home = tempfile::tempdir().unwrap();
    let ssh = home.path().join(".ssh");
    std::fs::create_dir(&ssh).unwrap();
    std::fs::write(ssh.join("id_ed25519"), "PRIVATE KEY").unwrap();
    std::fs::write(d.ws.join("notes.txt"), "public").unwrap();
    let store = store(&d);
    let setup = connect(&d, &store, &stdio("srv", "")).await;
    let read = tool(&setup, "mcp__srv__read");
    let out = call(&read, json!({"path": d.ws.join("notes.txt")}))
        .await
        .unwrap();
    assert_eq!((out.content.as_str(), out.is_error), ("public", false));
    let out = call(&read, json!({"path": ssh.join("id_ed25519")}))
        .await
        .unwrap();
    assert!(out.is_error, "{}", out.content);
    assert!(out.content.contains("Permission denied"), "{}", out.content);
}

/// Runs `keel ARGS --data-dir DATA`; (success, stdout, stderr).
pub(crate) fn keel_in(data: &Path, args: &[&str]) -> (bool, String, String) {
    let out = crate::keel()
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .env("KEEL_LOG", "error")
        .env_remove("KEEL_DATA_DIR")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The binary: `keel mcp list` and `keel mcp call` before anything is
/// committed and while `keel serve` runs, and `GET /api/mcp`.
#[test]
fn keel_mcp_list_and_call_and_the_api_show_the_servers() {
    let d = dirs();
    let servers = format!(
        "{}tools = [\"echo\", \"fail\"]\napproval = \"never\"\n\
         [mcp.ghost]\ncommand = \"/nonexistent/keel-mcp-ghost\"\ntimeout_secs = 1\n",
        stdio("srv", "")
    );
    std::fs::write(d.data.join("keel.toml"), toml(&d, &servers)).unwrap();

    let (ok, stdout, stderr) = keel_in(&d.data, &["mcp", "list"]);
    assert!(ok, "{stdout}{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].starts_with("ghost (stdio): unavailable: "),
        "{stdout}"
    );
    assert_eq!(lines[1], "  manifest: none committed (keel serve or keel chat commits it when they reach the server)");
    assert_eq!(lines[2], "  tools: none (from the committed manifest)");
    assert_eq!(
        &lines[3..],
        [
            "srv (stdio): up",
            "  manifest: none committed (keel serve or keel chat commits it when they reach the server)",
            "  tools (2, listed now):",
            "    echo  (mcp__srv__echo)  Returns its text.",
            "    fail  (mcp__srv__fail)  Always fails.",
        ]
    );
    // `list` committed nothing.
    assert!(!d.data.join("keel.db").exists());

    let (ok, stdout, stderr) = keel_in(
        &d.data,
        &["mcp", "call", "srv", "echo", r#"{"text": "hi"}"#],
    );
    assert!(ok, "{stderr}");
    assert_eq!(stdout, "hi\n");
    let (ok, stdout, stderr) = keel_in(&d.data, &["mcp", "call", "srv", "fail"]);
    assert!(!ok);
    assert_eq!(stdout, "it failed\n");
    assert_eq!(stderr, "keel: the server answered with an error result\n");
    let (ok, _, stderr) = keel_in(
        &d.data,
        &["mcp", "call", "srv", "add", r#"{"a": 1, "b": 2}"#],
    );
    assert!(!ok);
    assert!(
        stderr
            .contains("MCP server srv has no tool add that agents may use (its tools: echo, fail)"),
        "{stderr}"
    );
    let (ok, _, stderr) = keel_in(&d.data, &["mcp", "call", "nope", "echo"]);
    assert!(!ok);
    assert!(
        stderr.contains("no MCP server nope is configured (configured: ghost, srv)"),
        "{stderr}"
    );
    let (ok, _, stderr) = keel_in(&d.data, &["mcp", "call", "srv", "echo", "[1]"]);
    assert!(!ok);
    assert!(
        stderr.contains("the arguments must be a JSON object"),
        "{stderr}"
    );
    let (ok, _, stderr) = keel_in(&d.data, &["mcp", "call", "ghost", "echo"]);
    assert!(!ok);
    assert!(
        stderr.contains("MCP server ghost is unavailable: "),
        "{stderr}"
    );

    // keel serve commits srv's manifest and reports both servers.
    let mut served = crate::serve::Served::start(&d.data);
    let body: serde_json::Value = crate::serve::runtime().block_on(async {
        reqwest::get(served.url("/api/mcp"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    let servers = body["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 2, "{body}");
    assert_eq!(
        servers[0],
        json!({"name": "ghost", "transport": "stdio", "status": "unavailable", "restarts": 0,
               "delegatable": false, "manifest": null, "tools": []})
    );
    let srv = &servers[1];
    assert_eq!(
        (srv["name"].as_str(), srv["status"].as_str()),
        (Some("srv"), Some("up"))
    );
    assert_eq!(srv["manifest"]["hash"].as_str().unwrap().len(), 64, "{srv}");
    assert_eq!(
        srv["tools"],
        json!([
            {"name": "echo", "registered_name": "mcp__srv__echo", "description": "Returns its text."},
            {"name": "fail", "registered_name": "mcp__srv__fail", "description": "Always fails."},
        ])
    );
    // While it runs, `keel mcp list` reads the committed manifest.
    let (ok, stdout, _) = keel_in(&d.data, &["mcp", "list"]);
    assert!(ok);
    let hash = &srv["manifest"]["hash"].as_str().unwrap()[..12];
    assert!(stdout.contains(&format!("ago, sha256 {hash}")), "{stdout}");
    served.signal("TERM");
    assert!(served.child.wait().unwrap().success());
}

/// The binary: a reload (`POST /api/admin/reload`) while the server lists
/// fewer tools than at start-up fails for a definition naming the one that
/// disappeared, and the catalog in force stays.
#[test]
fn a_reload_fails_for_a_definition_naming_a_tool_the_server_no_longer_lists() {
    let d = dirs();
    std::fs::create_dir_all(d.data.join("agents")).unwrap();
    std::fs::write(
        d.data.join("agents/helper.md"),
        "---\nid: helper\ndescription: Helps.\nllm_profile: default\ntools: [mcp:srv/echo]\n---\nYou help.\n",
    )
    .unwrap();
    let listed = d.ws.join("tools.txt");
    std::fs::write(&listed, "echo,add").unwrap();
    let server = stdio(
        "srv",
        &format!("args = [\"--tools-file\", {}]\n", quoted(&listed)),
    );
    std::fs::write(d.data.join("keel.toml"), toml(&d, &server)).unwrap();
    let mut served = crate::serve::Served::start(&d.data);
    crate::serve::runtime().block_on(async {
        let http = reqwest::Client::new();
        let reload = || async {
            let r = http
                .post(served.url("/api/admin/reload"))
                .json(&json!({}))
                .send()
                .await
                .unwrap();
            (
                r.status().as_u16(),
                r.json::<serde_json::Value>().await.unwrap(),
            )
        };
        let (status, report) = reload().await;
        assert_eq!(status, 200, "{report}");
        let generation = report["generation"].clone();
        // The server stops listing echo.
        std::fs::write(&listed, "add").unwrap();
        let (status, problem) = reload().await;
        assert_eq!(status, 422, "{problem}");
        let errors = problem["errors"].to_string();
        assert!(
            errors.contains(
                "helper.md:5:9: tools[0]: MCP server \\\"srv\\\" has no tool \\\"echo\\\""
            ),
            "{problem}"
        );
        let ready: serde_json::Value = http
            .get(served.url("/api/ready"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(ready["catalog_generation"], generation);
        // Listed again: the reload passes.
        std::fs::write(&listed, "echo,add").unwrap();
        assert_eq!(reload().await.0, 200);
    });
    served.signal("TERM");
    assert!(served.child.wait().unwrap().success());
}
