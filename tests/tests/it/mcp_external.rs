//! keel's MCP client against MCP servers nobody here wrote: the reference
//! server `@modelcontextprotocol/server-everything` (npm) over stdio and
//! over Streamable HTTP, and a server written with the official Python SDK
//! (PyPI `mcp`, tests/mcp/python_server.py) over stdio, each confined by
//! the real sandbox launcher.
//!
//! The packages are installed (pinned) by `.ci/mcp-servers` into
//! `target/mcp-servers` (or `$KEEL_MCP_SERVERS`); `.ci/run` runs it. A
//! missing install fails these tests, unless `KEEL_SKIP_EXTERNAL_MCP=1`
//! says to leave them out (CI never sets it).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_core::{ToolError, ToolExecutionContext};
use serde_json::json;

use crate::mcp::{
    call, connect_toml, dirs, kill, quoted, store, toml_reading, tool, wait_for, Dirs,
};

/// Where `.ci/mcp-servers` installed the servers; `None` when the tests
/// are left out on purpose. Panics, saying what to do, when they are missing.
fn installed() -> Option<PathBuf> {
    if std::env::var("KEEL_SKIP_EXTERNAL_MCP").as_deref() == Ok("1") {
        eprintln!("KEEL_SKIP_EXTERNAL_MCP=1: the external MCP server tests are left out");
        return None;
    }
    let dir = std::env::var_os("KEEL_MCP_SERVERS").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/mcp-servers"),
        PathBuf::from,
    );
    let ready = everything(&dir).is_file() && python(&dir).is_file();
    assert!(
        ready,
        "the external MCP servers are not installed in {}: run .ci/mcp-servers (needs npm and \
         python3; .ci/run does it), point KEEL_MCP_SERVERS at an install, or set \
         KEEL_SKIP_EXTERNAL_MCP=1 to leave these tests out",
        dir.display()
    );
    Some(dir.canonicalize().unwrap())
}

fn everything(dir: &Path) -> PathBuf {
    dir.join("npm/node_modules/@modelcontextprotocol/server-everything/dist/index.js")
}

fn python(dir: &Path) -> PathBuf {
    dir.join("venv/bin/python")
}

fn python_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("mcp/python_server.py")
        .canonicalize()
        .unwrap()
}

/// What the confined servers must read: the install, the script, and the
/// Python installation the virtual environment points at.
fn reads(dir: &Path) -> Vec<PathBuf> {
    let out = std::process::Command::new(python(dir))
        .args(["-c", "import sys; print(sys.base_prefix)"])
        .output()
        .unwrap();
    let base = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    vec![
        dir.to_path_buf(),
        python_script().parent().unwrap().to_path_buf(),
        PathBuf::from(base),
    ]
}

/// The next line the server wrote to the FIFO (at most 20 s).
async fn next_line(events: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> Option<String> {
    tokio::time::timeout(Duration::from_secs(20), events.recv())
        .await
        .expect("a line from the server")
}

fn keel_toml(d: &Dirs, dir: &Path, servers: &str) -> String {
    let reads = reads(dir);
    let reads: Vec<&Path> = reads.iter().map(PathBuf::as_path).collect();
    toml_reading(d, &reads, servers)
}

fn everything_stdio(dir: &Path, name: &str, extra: &str) -> String {
    format!(
        "[mcp.{name}]\ncommand = \"node\"\nargs = [{}, \"stdio\"]\n{extra}",
        quoted(&everything(dir))
    )
}

fn python_stdio(dir: &Path, name: &str, args: &[&str], extra: &str) -> String {
    let mut argv = vec![quoted(&python_script())];
    argv.extend(args.iter().map(|a| format!("{a:?}")));
    format!(
        "[mcp.{name}]\ncommand = {}\nargs = [{}]\n{extra}",
        quoted(&python(dir)),
        argv.join(", ")
    )
}

/// The everything server's echo, add, long-running and error tools through
/// `setup`'s server `name` (bounded to 2 s: `slow` calls time out).
async fn exercise_everything(setup: &keel_gateway::mcp::McpSetup, name: &str) {
    let names: Vec<&str> = setup.tools.iter().map(|t| t.name()).collect();
    for expected in ["echo", "get-sum", "trigger-long-running-operation"] {
        let registered = format!("mcp__{name}__{expected}");
        assert!(names.contains(&registered.as_str()), "{names:?}");
    }
    let echo = tool(setup, &format!("mcp__{name}__echo"));
    // The server's own input schema reaches the model unchanged.
    assert_eq!(echo.parameters()["required"], json!(["message"]));
    let out = call(&echo, json!({"message": "hi from keel"}))
        .await
        .unwrap();
    assert_eq!(
        (out.content.as_str(), out.is_error),
        ("Echo: hi from keel", false)
    );
    let sum = tool(setup, &format!("mcp__{name}__get-sum"));
    let out = call(&sum, json!({"a": 40, "b": 2})).await.unwrap();
    assert!(out.content.contains("42"), "{}", out.content);
    let long = tool(
        setup,
        &format!("mcp__{name}__trigger-long-running-operation"),
    );
    let out = call(&long, json!({"duration": 0.2, "steps": 2}))
        .await
        .unwrap();
    assert!(
        out.content.starts_with("Long running operation completed."),
        "{}",
        out.content
    );
    // Past the timeout (2 s) the call is cancelled; the server still answers.
    let err = call(&long, json!({"duration": 30, "steps": 3}))
        .await
        .unwrap_err();
    assert_eq!(err, ToolError::TimedOut(2000));
    // Arguments the server rejects come back as an error the model reads.
    let out = call(&sum, json!({"a": "forty"})).await;
    let is_error = match &out {
        Ok(o) => o.is_error,
        Err(ToolError::Failed(m)) => m.contains(&format!("MCP server {name} refused the call")),
        Err(_) => false,
    };
    assert!(is_error, "{out:?}");
    assert!(call(&echo, json!({"message": "still here"})).await.is_ok());
}

#[tokio::test]
async fn the_reference_server_over_stdio_is_listed_and_called() {
    let Some(dir) = installed() else { return };
    let d = dirs();
    let store = store(&d);
    let setup = connect_toml(
        &store,
        &keel_toml(
            &d,
            &dir,
            &everything_stdio(&dir, "every", "timeout_secs = 2\n"),
        ),
    )
    .await;
    assert!(setup.notices.is_empty(), "{:?}", setup.notices);
    exercise_everything(&setup, "every").await;
}

#[tokio::test]
async fn the_reference_server_over_streamable_http_is_listed_and_called() {
    let Some(dir) = installed() else { return };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut server = std::process::Command::new("node")
        .arg(everything(&dir))
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It says on stderr when it listens.
    let mut stderr = std::io::BufReader::new(server.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening on port") {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "the server exited"
        );
    }
    let d = dirs();
    let store = store(&d);
    let setup = connect_toml(
        &store,
        &keel_toml(
            &d,
            &dir,
            &format!("[mcp.web]\nurl = \"http://127.0.0.1:{port}/mcp\"\ntimeout_secs = 2\n"),
        ),
    )
    .await;
    assert!(setup.notices.is_empty(), "{:?}", setup.notices);
    exercise_everything(&setup, "web").await;
    drop(setup);
    server.kill().unwrap();
    server.wait().unwrap();
}

#[tokio::test]
async fn a_python_sdk_server_is_listed_called_capped_cancelled_and_restarted() {
    let Some(dir) = installed() else { return };
    let d = dirs();
    let store = store(&d);
    let text = keel_toml(
        &d,
        &dir,
        &python_stdio(
            &dir,
            "py",
            &[],
            "timeout_secs = 30\nmax_output_bytes = 256\n",
        ),
    );
    let setup = connect_toml(&store, &text).await;
    assert!(setup.notices.is_empty(), "{:?}", setup.notices);
    let mut names: Vec<&str> = setup.tools.iter().map(|t| t.name()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "mcp__py__big",
            "mcp__py__crash",
            "mcp__py__fail",
            "mcp__py__greet",
            "mcp__py__pick",
            "mcp__py__pid",
            "mcp__py__wait"
        ]
    );
    // The schema pydantic generated is passed through as it is.
    let pick = tool(&setup, "mcp__py__pick");
    assert_eq!(
        pick.parameters()["properties"],
        json!({
            "color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
            "count": {"default": 1, "description": "How many", "maximum": 5, "minimum": 1,
                      "title": "Count", "type": "integer"}
        })
    );
    assert_eq!(pick.description(), "Picks COUNT things of COLOR.");
    let out = call(&pick, json!({"color": "red", "count": 3}))
        .await
        .unwrap();
    assert_eq!(out.content, "3 red");
    let out = call(
        &tool(&setup, "mcp__py__greet"),
        json!({"name": "keel", "times": 2}),
    )
    .await
    .unwrap();
    assert_eq!(
        (out.content.as_str(), out.is_error),
        ("hello keel hello keel", false)
    );
    // A raised exception is an error result naming its reason.
    let out = call(&tool(&setup, "mcp__py__fail"), json!({"reason": "no luck"}))
        .await
        .unwrap();
    assert!(out.is_error && out.content.contains("no luck"), "{out:?}");
    // The output cap.
    let out = call(&tool(&setup, "mcp__py__big"), json!({"n": 5000}))
        .await
        .unwrap();
    assert!(out.content.starts_with(&"y".repeat(256)), "{}", out.content);
    assert!(
        out.content.ends_with("[truncated 4744 bytes]"),
        "{}",
        out.content
    );
    let wait = tool(&setup, "mcp__py__wait");

    // A turn stopped mid-call: the server's task is cancelled (it says so
    // through a FIFO in the workspace, which it may write).
    let fifo = d.ws.join("events");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let reader_path = fifo.clone();
    std::thread::spawn(move || {
        let file = std::fs::File::open(reader_path).unwrap();
        for line in std::io::BufReader::new(file).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let ctx = ToolExecutionContext::default();
    let token = ctx.cancellation.clone();
    let waiting = wait.clone();
    let args = json!({"seconds": 600, "fifo": fifo});
    let running = tokio::spawn(async move { waiting.execute(args, &ctx).await });
    assert_eq!(next_line(&mut events).await.as_deref(), Some("started"));
    token.cancel();
    assert_eq!(running.await.unwrap().unwrap_err(), ToolError::Cancelled);
    assert_eq!(next_line(&mut events).await.as_deref(), Some("cancelled"));

    // A crash: the call fails naming the server, keel restarts it, the
    // next call reaches the new process.
    let pid = tool(&setup, "mcp__py__pid");
    let first = call(&pid, json!({})).await.unwrap().content;
    let err = call(&tool(&setup, "mcp__py__crash"), json!({}))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("MCP server py failed to answer"),
        "{err}"
    );
    let server = setup.servers["py"].connection.clone();
    wait_for(&server, |s| s.state == "up" && s.restarts == 1).await;
    let second = call(&pid, json!({})).await.unwrap().content;
    assert_ne!(first, second);
    // And a kill, the same.
    kill(&second);
    wait_for(&server, |s| s.state != "up" || s.restarts > 1).await;
    let third = call(&pid, json!({})).await.unwrap().content;
    assert_ne!(second, third);
}

/// A tool that disappears from the server's manifest: the next start
/// commits the new manifest and a definition naming the tool no longer
/// validates (`keel agents check`, offline), with its location.
#[tokio::test]
async fn a_tool_gone_from_the_python_servers_manifest_fails_the_definitions_naming_it() {
    let Some(dir) = installed() else { return };
    let d = dirs();
    let store = store(&d);
    std::fs::create_dir_all(d.data.join("agents")).unwrap();
    std::fs::write(
        d.data.join("agents/helper.md"),
        "---\nid: helper\ndescription: Helps.\nllm_profile: default\ntools: [mcp:py/greet]\n---\nYou help.\n",
    )
    .unwrap();
    let check = || {
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
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    for (args, expected) in [(&[][..], true), (&["--without", "greet"][..], false)] {
        let text = keel_toml(
            &d,
            &dir,
            &python_stdio(&dir, "py", args, "timeout_secs = 30\n"),
        );
        std::fs::write(d.data.join("keel.toml"), &text).unwrap();
        let setup = connect_toml(&store, &text).await;
        assert_eq!(
            setup.tools.iter().any(|t| t.name() == "mcp__py__greet"),
            expected,
            "{:?}",
            setup.notices
        );
        drop(setup);
        let (ok, stdout) = check();
        assert_eq!(ok, expected, "{stdout}");
        if !expected {
            assert!(
                stdout.contains("helper.md:5:9: tools[0]: MCP server \"py\" has no tool \"greet\" in its last manifest"),
                "{stdout}"
            );
        }
    }
}
