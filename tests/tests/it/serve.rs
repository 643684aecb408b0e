//! `keel serve` as a user runs it: the address it prints, the refusal of
//! an exposed address without a token, a token that never reaches the log,
//! SIGTERM in the middle of a turn (nothing of its answer saved), SIGHUP
//! reloads that keep the catalog in force when the definitions are broken,
//! a reload (REST and SIGHUP) that the next request sees everywhere, and
//! SIGINT stopping it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::mpsc;

use futures::StreamExt;
use keel_store::{MessageFilter, Store, StoreOptions};

use crate::{data_dir_with_agent, keel};

/// A running `keel serve`: its address and its stderr, line by line.
pub(crate) struct Served {
    pub(crate) child: Child,
    addr: String,
    stderr: mpsc::Receiver<String>,
}

impl Served {
    pub(crate) fn start(data: &Path) -> Served {
        Self::start_with(data, &[])
    }

    /// Starts it with `env` set (and `KEEL_TOKEN` only if `env` sets it).
    pub(crate) fn start_with(data: &Path, env: &[(&str, &str)]) -> Served {
        let mut child = keel()
            .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
            .arg(data)
            .env_remove("KEEL_TOKEN")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("keel serve: listening on http://127.0.0.1:"),
            "{line}"
        );
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap()
            .to_owned();
        let (tx, stderr) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Served {
            child,
            addr,
            stderr,
        }
    }

    pub(crate) fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Stderr lines up to the first that contains `needle`.
    pub(crate) fn stderr_until(&self, needle: &str) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            let line = self
                .stderr
                .recv_timeout(std::time::Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no {needle:?} on stderr after {lines:?}"));
            let done = line.contains(needle);
            lines.push(line);
            if done {
                return lines;
            }
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn an_exposed_address_without_a_token_is_refused_at_start() {
    let data = tempfile::tempdir().unwrap();
    let out = keel()
        .args(["serve", "--bind", "0.0.0.0:0", "--data-dir"])
        .arg(data.path())
        .env_remove("KEEL_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let refusal = stderr
        .lines()
        .last()
        .unwrap()
        .replace(&data.path().display().to_string(), "<data>");
    insta::assert_snapshot!(refusal);
}

#[test]
fn the_token_is_required_and_never_reaches_the_log() {
    const SECRET: &str = "s3cret-token-7420";
    let data = tempfile::tempdir().unwrap();
    let served = Served::start_with(
        data.path(),
        &[("KEEL_TOKEN", SECRET), ("KEEL_LOG", "trace")],
    );
    runtime().block_on(async {
        let http = reqwest::Client::new();
        let dialogs = served.url("/api/dialogs");
        let status = |rb: reqwest::RequestBuilder| async move { rb.send().await.unwrap().status() };
        assert_eq!(status(http.get(&dialogs)).await, 401);
        assert_eq!(
            status(http.get(&dialogs).bearer_auth(format!("{SECRET}x"))).await,
            401
        );
        assert_eq!(status(http.get(&dialogs).bearer_auth(SECRET)).await, 200);
        let created = http
            .post(&dialogs)
            .bearer_auth(SECRET)
            .json(&serde_json::json!({"title": "Logged"}))
            .send()
            .await
            .unwrap();
        assert_eq!(created.status(), 201);
        // The WebSocket's query parameter too.
        let ws = http
            .get(served.url(&format!("/api/ws?access_token={SECRET}")))
            .send()
            .await
            .unwrap();
        assert_eq!(ws.status(), 400, "a plain GET is no WebSocket upgrade");
        // A refused request is logged, so the log is on.
        let refused = http
            .post(&dialogs)
            .bearer_auth(SECRET)
            .header("origin", "https://attacker.example")
            .json(&serde_json::json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), 403);
    });
    served.signal("TERM");
    let lines = served.stderr_until("stopped");
    assert!(
        lines.iter().any(|l| l.contains("request refused")),
        "{lines:?}"
    );
    let leaked: Vec<&String> = lines.iter().filter(|l| l.contains(SECRET)).collect();
    assert!(leaked.is_empty(), "{leaked:?}");
}

#[test]
fn sigterm_in_the_middle_of_a_turn_keeps_the_message_and_saves_nothing_of_the_answer() {
    let data = tempfile::tempdir().unwrap();
    // The answer's second word never comes in time: the turn is mid-stream
    // when SIGTERM arrives, and no grace period lets it finish.
    std::fs::write(
        data.path().join("script.yaml"),
        "- text: \"first second\"\n  chunk_delay_ms: 600000\n",
    )
    .unwrap();
    std::fs::write(
        data.path().join("keel.toml"),
        "[providers.default]\nkind = \"scripted\"\nscript = \"script.yaml\"\n\n\
         [server]\nshutdown_grace_secs = 0\n",
    )
    .unwrap();
    let mut served = Served::start(data.path());
    let session = runtime().block_on(async {
        let http = reqwest::Client::new();
        let dialog: serde_json::Value = http
            .post(served.url("/api/dialogs"))
            .json(&serde_json::json!({"title": "Busy"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = dialog["id"].as_str().unwrap().to_owned();
        let response = http
            .post(served.url(&format!("/api/dialogs/{id}/messages")))
            .header("accept", "text/event-stream")
            .json(&serde_json::json!({"text": "start"}))
            .send()
            .await
            .unwrap();
        let mut stream = response.bytes_stream();
        let mut seen = String::new();
        while !seen.contains("event: text_delta") {
            let chunk = stream.next().await.unwrap().unwrap();
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        served.signal("TERM");
        // The stream ends with the turn's failure, marked cancelled.
        while let Some(chunk) = stream.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
        assert!(seen.contains("event: turn_failed"), "{seen}");
        assert!(seen.contains("\"cancelled\":true"), "{seen}");
        assert!(seen.contains("\"input_kept\":true"), "{seen}");
        id
    });
    let lines = served.stderr_until("stopped");
    assert!(
        lines
            .last()
            .unwrap()
            .contains("0 turn(s) finished, 1 cancelled"),
        "{lines:?}"
    );
    // server.shutdown_grace_secs = 0 was read: no wait for the turn.
    assert!(
        lines.iter().any(|l| l.contains("running turns get 0 s")),
        "{lines:?}"
    );
    assert!(served.child.wait().unwrap().success());

    let store = Store::open(data.path().join("keel.db"), StoreOptions::default()).unwrap();
    let id = session.parse().unwrap();
    runtime().block_on(async {
        let saved = store
            .load_messages(id, MessageFilter::default())
            .await
            .unwrap();
        // The user's message was stored before the model was called: it
        // stays, unanswered; nothing of the answer, no checkpoint.
        let kept: Vec<_> = saved
            .iter()
            .map(|m| (m.message.text(), m.input_state))
            .collect();
        assert_eq!(
            kept,
            [("start".to_owned(), Some(keel_store::InputState::Unanswered))]
        );
        assert!(store.list_checkpoints(id).await.unwrap().is_empty());
    });
}

#[test]
fn sighup_reloads_the_agents_and_keeps_the_catalog_when_they_are_broken() {
    let data = tempfile::tempdir().unwrap();
    data_dir_with_agent(data.path(), "scout", "Looks around.", false);
    let mut served = Served::start(data.path());
    let generation = |served: &Served| {
        runtime().block_on(async {
            let ready: serde_json::Value = reqwest::get(served.url("/api/ready"))
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            ready["catalog_generation"].as_u64().unwrap()
        })
    };
    assert_eq!(generation(&served), 1);
    let broken = data.path().join("agents/broken.md");
    std::fs::write(&broken, "---\nid: broken\n---\n").unwrap();
    served.signal("HUP");
    let refused = served.stderr_until("reload refused");
    assert!(
        refused
            .last()
            .unwrap()
            .contains("generation 1 stays in force"),
        "{refused:?}"
    );
    assert!(served.stderr_until("broken.md").len() == 1);
    assert_eq!(generation(&served), 1);

    std::fs::remove_file(&broken).unwrap();
    served.signal("HUP");
    let reloaded = served.stderr_until("reloaded");
    assert!(
        reloaded
            .last()
            .unwrap()
            .contains("generation 2, 1 agent(s)"),
        "{reloaded:?}"
    );
    assert_eq!(generation(&served), 2);
    // Ctrl-C (SIGINT) stops it as SIGTERM does.
    served.signal("INT");
    served.stderr_until("stopped");
    assert!(served.child.wait().unwrap().success());
}

/// Writes `agents/{id}.md` under `data`, delegating to `delegates`.
fn write_agent(data: &Path, id: &str, delegates: &[&str]) {
    std::fs::write(
        data.join(format!("agents/{id}.md")),
        format!(
            "---\nid: {id}\ndescription: Agent {id}.\nllm_profile: default\ndelegates: [{}]\n---\nYou are {id}.\n",
            delegates.join(", ")
        ),
    )
    .unwrap();
}

#[test]
fn a_reload_is_seen_by_the_next_request_everywhere() {
    let data = tempfile::tempdir().unwrap();
    let dir = data.path();
    std::fs::create_dir_all(dir.join("agents")).unwrap();
    // The root delegates to a; after the reload a delegates to the new c.
    std::fs::write(
        dir.join("script.yaml"),
        "- tool_calls: [{name: delegate, arguments: {tasks: [{agent: a, task: ask c}]}}]\n\
         - tool_calls: [{name: delegate, arguments: {tasks: [{agent: c, task: say hi}]}}]\n\
         - text: hi from c\n\
         - text: c said hi\n\
         - text: done\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("keel.toml"),
        "agents_dir = \"agents\"\nroot_delegates = [\"a\"]\n\n\
         [providers.default]\nkind = \"scripted\"\nscript = \"script.yaml\"\n",
    )
    .unwrap();
    write_agent(dir, "a", &["b"]);
    write_agent(dir, "b", &[]);
    let mut served = Served::start(dir);
    runtime().block_on(async {
        let http = reqwest::Client::new();
        let post =
            |path: &str, body: serde_json::Value| http.post(served.url(path)).json(&body).send();
        let models = || async {
            let list: serde_json::Value = http
                .get(served.url("/v1/models"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            list["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        let of_b: serde_json::Value = post("/api/dialogs", serde_json::json!({"agent": "b"}))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let of_b = of_b["id"].as_str().unwrap().to_owned();

        // c added, b removed, a now delegates to c; reloaded over REST.
        write_agent(dir, "c", &[]);
        write_agent(dir, "a", &["c"]);
        std::fs::remove_file(dir.join("agents/b.md")).unwrap();
        let reload = post("/api/admin/reload", serde_json::json!({}))
            .await
            .unwrap();
        assert_eq!(reload.status(), 200);
        let report: serde_json::Value = reload.json().await.unwrap();
        assert_eq!(report["agents"], serde_json::json!(["a", "c"]));

        let created = post("/api/dialogs", serde_json::json!({"agent": "c"}))
            .await
            .unwrap();
        assert_eq!(created.status(), 201);
        let refused = post("/api/dialogs", serde_json::json!({"agent": "b"}))
            .await
            .unwrap();
        assert_eq!(refused.status(), 400);
        let problem: serde_json::Value = refused.json().await.unwrap();
        assert_eq!(problem["detail"], "unknown agent \"b\"");
        assert_eq!(models().await, ["keel:root", "keel:a", "keel:c"]);

        // The dialog of the removed agent is still there, but refuses a turn.
        let send = post(
            &format!("/api/dialogs/{of_b}/messages"),
            serde_json::json!({"text": "hello?"}),
        )
        .await
        .unwrap();
        assert_eq!(send.status(), 409);
        let problem: serde_json::Value = send.json().await.unwrap();
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .starts_with("agent \"b\" of this dialog is no longer defined"),
            "{problem}"
        );
        let listed = http
            .get(served.url(&format!("/api/dialogs/{of_b}/messages")))
            .send()
            .await
            .unwrap();
        assert_eq!(listed.status(), 200);

        // The root reaches c through a's new delegate edge.
        let root: serde_json::Value = post("/api/dialogs", serde_json::json!({}))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let root = root["id"].as_str().unwrap().to_owned();
        let turn = http
            .post(served.url(&format!("/api/dialogs/{root}/messages")))
            .header("accept", "text/event-stream")
            .json(&serde_json::json!({"text": "ask a"}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(turn.contains("event: turn_committed"), "{turn}");
        let runs: serde_json::Value = http
            .get(served.url("/api/agent-runs"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let done: Vec<(&str, &str, &str)> = runs["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["agent"].as_str().unwrap(),
                    r["status"].as_str().unwrap(),
                    r["result_preview"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert!(done.contains(&("c", "completed", "hi from c")), "{done:?}");
        assert!(done.contains(&("a", "completed", "c said hi")), "{done:?}");

        // SIGHUP reloads the same way: d appears at once.
        write_agent(dir, "d", &[]);
        served.signal("HUP");
        let reloaded = served.stderr_until("keel serve: agent catalog reloaded");
        assert!(
            reloaded
                .last()
                .unwrap()
                .contains("generation 3, 3 agent(s)"),
            "{reloaded:?}"
        );
        let created = post("/api/dialogs", serde_json::json!({"agent": "d"}))
            .await
            .unwrap();
        assert_eq!(created.status(), 201);
        assert_eq!(models().await, ["keel:root", "keel:a", "keel:c", "keel:d"]);
    });
    served.signal("TERM");
    served.stderr_until("stopped");
    assert!(served.child.wait().unwrap().success());
}

/// The visible messages of dialog `id`: (role, text, unanswered).
async fn history(http: &reqwest::Client, url: &str) -> Vec<(String, String, bool)> {
    let page: serde_json::Value = http.get(url).send().await.unwrap().json().await.unwrap();
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["text"].as_str().unwrap().to_owned(),
                m["unanswered"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[test]
fn kill_9_with_messages_queued_behind_a_running_turn_runs_every_acknowledged_one_after_restart() {
    const QUEUED: usize = 12;
    let data = tempfile::tempdir().unwrap();
    // The first turn's answer never finishes: every later message queues.
    std::fs::write(
        data.path().join("script.yaml"),
        "- text: \"first second\"\n  chunk_delay_ms: 600000\n",
    )
    .unwrap();
    std::fs::write(
        data.path().join("keel.toml"),
        "[providers.default]\nkind = \"scripted\"\nscript = \"script.yaml\"\n",
    )
    .unwrap();
    let mut served = Served::start(data.path());
    let rt = runtime();
    let http = reqwest::Client::new();
    let (id, accepted) = rt.block_on(async {
        let dialog: serde_json::Value = http
            .post(served.url("/api/dialogs"))
            .json(&serde_json::json!({"title": "Queued"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = dialog["id"].as_str().unwrap().to_owned();
        let messages = served.url(&format!("/api/dialogs/{id}/messages"));
        let response = http
            .post(&messages)
            .header("accept", "text/event-stream")
            .json(&serde_json::json!({"text": "start"}))
            .send()
            .await
            .unwrap();
        let mut stream = response.bytes_stream();
        let mut seen = String::new();
        while !seen.contains("event: text_delta") {
            let chunk = stream.next().await.unwrap().unwrap();
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        let mut accepted = Vec::new();
        for n in 0..QUEUED {
            let response = http
                .post(&messages)
                .json(&serde_json::json!({"text": format!("queued {n}")}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 202);
            accepted.push(format!("queued {n}"));
        }
        (id, accepted)
    });
    served.signal("KILL");
    served.child.wait().unwrap();
    // The next process answers at once.
    std::fs::write(
        data.path().join("script.yaml"),
        "- text: \"answered\"\n".repeat(QUEUED + 1),
    )
    .unwrap();
    let served = Served::start(data.path());
    let url = served.url(&format!("/api/dialogs/{id}/messages?order=asc"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let saved = rt.block_on(async {
        loop {
            let saved = history(&http, &url).await;
            let answers = saved
                .iter()
                .filter(|(role, ..)| role == "assistant")
                .count();
            // The history tells when every turn ran; nothing else can.
            if answers == QUEUED || std::time::Instant::now() > deadline {
                return saved;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    });
    // The running turn's message stays, unanswered; every queued one ran, in
    // the order it was acknowledged, each followed by its answer.
    let mut expected = vec![("user".to_owned(), "start".to_owned(), true)];
    for text in accepted {
        expected.push(("user".to_owned(), text, false));
        expected.push(("assistant".to_owned(), "answered".to_owned(), false));
    }
    assert_eq!(saved, expected);
    served.signal("TERM");
}

/// (status, attempt_count) of the inbox events in `data`'s database, read
/// through SQLite while keel runs.
fn inbox_events(data: &Path) -> Vec<(String, i64)> {
    let conn = rusqlite::Connection::open_with_flags(
        data.join("keel.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let mut stmt = conn
        .prepare("SELECT status, attempt_count FROM agent_inbox_events ORDER BY created_at")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// Polls `data`'s inbox until `done` holds (60 s at most): only the
/// database can tell when keel retried or delivered an event.
fn wait_inbox(data: &Path, done: impl Fn(&[(String, i64)]) -> bool) -> Vec<(String, i64)> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let events = inbox_events(data);
        if done(&events) || std::time::Instant::now() > deadline {
            return events;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_restart_delivers_an_event_that_was_backing_off_at_its_retry_time_without_traffic() {
    let data = tempfile::tempdir().unwrap();
    data_dir_with_agent(data.path(), "helper", "Helps in the background.", true);
    std::fs::write(
        data.path().join("keel.toml"),
        "agents_dir = \"agents\"\nroot_delegates = [\"helper\"]\n\n\
         [providers.default]\nkind = \"scripted\"\nscript = \"script.yaml\"\n",
    )
    .unwrap();
    // The root delegates in the background and answers "ok"; every
    // continuation fails, so the result backs off (2 s, then 4 s).
    std::fs::write(
        data.path().join("script.yaml"),
        format!(
            "- tool_calls: [{{name: delegate, arguments: {{mode: background, tasks: [{{agent: helper, task: help}}]}}}}]\n\
             - text: ok\n{}",
            "- error: {kind: auth, message: bad key}\n".repeat(6)
        ),
    )
    .unwrap();
    let mut served = Served::start(data.path());
    runtime().block_on(async {
        let http = reqwest::Client::new();
        let dialog: serde_json::Value = http
            .post(served.url("/api/dialogs"))
            .json(&serde_json::json!({"title": "Background"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = dialog["id"].as_str().unwrap();
        let sent = http
            .post(served.url(&format!("/api/dialogs/{id}/messages")))
            .json(&serde_json::json!({"text": "go"}))
            .send()
            .await
            .unwrap();
        assert_eq!(sent.status(), 202);
    });
    // Killed right after the second failed delivery: the retry is 4 s away.
    let events = wait_inbox(data.path(), |e| {
        e.len() == 1 && e[0] == ("pending".into(), 2)
    });
    served.signal("KILL");
    served.child.wait().unwrap();
    assert_eq!(events, [("pending".to_owned(), 2)]);
    std::fs::write(data.path().join("script.yaml"), "when_exhausted: echo\n").unwrap();
    // Nobody sends anything: the next process delivers it at its retry time.
    let served = Served::start(data.path());
    let events = wait_inbox(data.path(), |e| e.iter().all(|(s, _)| s == "consumed"));
    assert_eq!(events, [("consumed".to_owned(), 2)]);
    served.signal("TERM");
}
