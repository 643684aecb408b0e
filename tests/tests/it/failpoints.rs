//! Every failpoint kills a real process there (SIGKILL, as `kill -9`);
//! the next start recovers, every invariant holds (`keel doctor` exits 0),
//! and everything acknowledged before the kill is present, once.
//!
//! `keel chat` reaches the points of migrations, activation, the writer,
//! the turn commit and the terminal commit of a delegated run; the
//! keel-store driver (`src/bin/store_driver.rs`) reaches every point,
//! signals, claims, steer admission, release and continuation included.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use keel_store::failpoints::FAILPOINTS;
use keel_store::{CheckOptions, MessageFilter, Store};

/// Asserts the process was killed by its failpoint (SIGKILL), not that it
/// ended any other way.
fn assert_killed(out: &Output, point: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        Some(9),
        "{point} did not kill the process ({:?}):\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains(&format!("failpoint {point} fired")),
        "{stderr}"
    );
}

fn driver(data: &Path, failpoints: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keel-store-driver"));
    cmd.arg(data).env("KEEL_LOG", "error");
    if let Some(f) = failpoints {
        cmd.env("FAILPOINTS", f);
    }
    cmd.output().unwrap()
}

/// Recovers the database as the next start would and checks it; returns
/// the store for the caller's own checks.
fn recover(data: &Path, rt: &tokio::runtime::Runtime) -> Store {
    rt.block_on(async {
        let store = Store::open(data.join("keel.db"), Default::default()).unwrap();
        store
            .activate_runtime("failpoint test".into(), keel_core::time::now_ms())
            .await
            .unwrap();
        let report = store
            .check_invariants(CheckOptions {
                owner_alive: true,
                ..CheckOptions::default()
            })
            .await
            .unwrap();
        assert!(report.is_clean(), "{report:#?}");
        store
    })
}

/// What the driver acknowledged is in the recovered database, once.
fn assert_acknowledged_present(store: &Store, acks: &[String], rt: &tokio::runtime::Runtime) {
    let Some(session) = acks
        .iter()
        .find_map(|a| a.strip_prefix("ack session "))
        .map(|s| s.parse().unwrap())
    else {
        return;
    };
    rt.block_on(async {
        let texts: Vec<String> = store
            .load_messages(session, MessageFilter::default())
            .await
            .unwrap()
            .iter()
            .map(|m| m.message.text())
            .collect();
        for ack in acks {
            if let Some(text) = ack.strip_prefix("ack turn ") {
                let n = texts.iter().filter(|t| *t == text).count();
                assert_eq!(n, 1, "{text:?} appears {n} times after recovery");
            }
            if ack == "ack continuation" {
                assert!(texts.iter().any(|t| t == "continuation answer"));
                let events = store.list_inbox_events(session).await.unwrap();
                assert!(
                    events
                        .iter()
                        .all(|e| e.status == keel_store::EventStatus::Consumed),
                    "{events:?}"
                );
            }
            if let Some(id) = ack
                .strip_prefix("ack signal ")
                .or(ack.strip_prefix("ack terminal "))
            {
                let events = store.list_inbox_events(session).await.unwrap();
                assert!(
                    events.iter().any(|e| e.id.to_string() == id),
                    "event {id} lost: {events:?}"
                );
            }
            if let Some(run) = ack.strip_prefix("ack run ") {
                let run = store.get_run(run.parse().unwrap()).await.unwrap();
                assert!(run.is_some_and(|r| r.status.is_terminal()), "run {ack}");
            }
        }
    });
}

fn acks(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Where the driver dies for each point: the first hit, except where a
/// later one is the interesting one.
fn driver_actions(point: &str) -> &'static str {
    match point {
        // Step 4 of a fresh database's migrations.
        "store::migration::before_commit" => "3*off->return",
        "store::migration::after_commit" => "2*off->return",
        // A batch after the run and signal were committed.
        "store::writer::before_commit" => "9*off->return",
        // The second WAL checkpoint, with turns committed before it.
        "store::wal_checkpoint::before" | "store::wal_checkpoint::after" => "1*off->return",
        // The turn after the continuation.
        "store::commit_turn::after_commit" => "2*off->return",
        _ => "return",
    }
}

#[test]
fn the_store_driver_dies_at_every_failpoint_and_recovers_clean() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // Unconfigured, the driver runs every step.
    let dir = tempfile::tempdir().unwrap();
    let out = driver(dir.path(), None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all = acks(&out);
    assert_eq!(all.last().map(String::as_str), Some("ack done"));
    assert_acknowledged_present(&recover(dir.path(), &rt), &all, &rt);

    for (point, _) in FAILPOINTS {
        // A new database is migrated before it is linked into place; an
        // existing one (a version-1 fixture) is migrated where it is.
        let from_v1 = point.starts_with("store::migration::");
        for fixture in [false, from_v1] {
            let dir = tempfile::tempdir().unwrap();
            if fixture {
                let mut conn = rusqlite::Connection::open(dir.path().join("keel.db")).unwrap();
                keel_store::testing::migrate_to(&mut conn, 1).unwrap();
            }
            let out = driver(
                dir.path(),
                Some(&format!("{point}={}", driver_actions(point))),
            );
            assert_killed(&out, point);
            let acks = acks(&out);
            assert!(!acks.contains(&"ack done".to_owned()), "{point}: {acks:?}");
            if fixture {
                let conn = rusqlite::Connection::open(dir.path().join("keel.db")).unwrap();
                let version = keel_store::testing::user_version(&conn).unwrap();
                assert!(
                    (2..keel_store::SCHEMA_VERSION).contains(&version),
                    "{point}: v{version}"
                );
            }
            let store = recover(dir.path(), &rt);
            assert_acknowledged_present(&store, &acks, &rt);
        }
    }
}

fn chat(data: &Path, script: &Path, failpoints: Option<&str>) -> Command {
    let mut cmd = crate::keel();
    cmd.args(["chat", "--chat", "fran", "--data-dir"])
        .arg(data)
        .arg("--script")
        .arg(script)
        .env("KEEL_LOG", "error")
        .env_remove("FAILPOINTS");
    if let Some(f) = failpoints {
        cmd.env("FAILPOINTS", f);
    }
    cmd
}

/// Runs `keel chat` on `stdin`, returning its output.
fn run_chat(data: &Path, script: &Path, failpoints: Option<&str>, stdin: &str) -> Output {
    let mut child = chat(data, script, failpoints)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A process that refuses to start may close its stdin first.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    child.wait_with_output().unwrap()
}

/// `keel doctor` on the data directory: exit 0 and a clean report.
fn assert_doctor_clean(data: &Path) -> String {
    let out = crate::keel()
        .args(["doctor", "--data-dir"])
        .arg(data)
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("clean: every invariant holds"), "{stdout}");
    stdout
}

struct ChatCase {
    point: &'static str,
    actions: &'static str,
    /// The scenario reaches the point through a foreground delegation.
    delegates: bool,
}

const CHAT_CASES: &[ChatCase] = &[
    ChatCase {
        point: "store::migration::before_commit",
        actions: "5*off->return",
        delegates: false,
    },
    ChatCase {
        point: "store::migration::after_commit",
        actions: "return",
        delegates: false,
    },
    ChatCase {
        point: "store::activate::before_commit",
        actions: "return",
        delegates: false,
    },
    ChatCase {
        point: "store::writer::before_commit",
        // Past the batches where a queued message's commit meets the first
        // turn's, so a turn was acknowledged before the kill.
        actions: "8*off->return",
        delegates: false,
    },
    ChatCase {
        point: "store::open_turn::before_commit",
        actions: "1*off->return",
        delegates: false,
    },
    ChatCase {
        point: "store::open_turn::after_commit",
        actions: "1*off->return",
        delegates: false,
    },
    ChatCase {
        point: "store::commit_turn::before_commit",
        actions: "1*off->return",
        delegates: false,
    },
    ChatCase {
        point: "store::commit_turn::after_commit",
        actions: "1*off->return",
        delegates: false,
    },
    ChatCase {
        point: "store::commit_terminal::before_commit",
        actions: "return",
        delegates: true,
    },
    ChatCase {
        point: "store::commit_terminal::after_commit",
        actions: "return",
        delegates: true,
    },
];

/// The real `keel` binary dies at each point it reaches; the restart
/// recovers, answers, and keeps every acknowledged user message once.
#[test]
fn keel_chat_dies_at_its_failpoints_and_the_next_start_recovers_clean() {
    for case in CHAT_CASES {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let script = dir.path().join("script.yaml");
        if case.delegates {
            crate::data_dir_with_agent(&data, "helper", "Answers small questions.", true);
            std::fs::write(
                &script,
                "- text: first answer\n\
                 - tool_calls: [{name: delegate, arguments: {tasks: [{agent: helper, task: \"Say hi\"}]}}]\n\
                 - text: hi from the helper\n\
                 - text: the helper said hi\n",
            )
            .unwrap();
        } else {
            std::fs::write(&script, "when_exhausted: echo\n").unwrap();
        }
        let out = run_chat(
            &data,
            &script,
            Some(&format!("{}={}", case.point, case.actions)),
            "first question\nsecond question\nthird question\n",
        );
        assert_killed(&out, case.point);
        let stdout = String::from_utf8_lossy(&out.stdout);
        // The answer streams as it comes; its line ends when the turn
        // committed. A user message is acknowledged by that line break.
        let ended: Vec<&str> = stdout
            .split_inclusive('\n')
            .filter(|l| l.ends_with('\n') && l.starts_with("keel>"))
            .collect();
        let acknowledged: BTreeSet<&str> = ["first", "second", "third"]
            .into_iter()
            .filter(|q| {
                ended
                    .iter()
                    .any(|l| l.contains(&format!("\"{q} question\"")))
                    || (case.delegates && *q == "first" && ended.contains(&"keel> first answer\n"))
            })
            .collect();
        assert!(
            case.point.contains("migration")
                || case.point.contains("activate")
                || !acknowledged.is_empty(),
            "{}: nothing acknowledged before the kill:\n{stdout}",
            case.point
        );

        let echo = dir.path().join("echo.yaml");
        std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
        let out = run_chat(&data, &echo, None, "after the crash\n");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("\"after the crash\""),
            "{}: the restart does not answer:\n{stdout}{}",
            case.point,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_doctor_clean(&data);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = Store::open(data.join("keel.db"), Default::default()).unwrap();
            let dialog = store
                .latest_active_dialog("cli", "fran")
                .await
                .unwrap()
                .unwrap();
            let texts: Vec<String> = store
                .load_messages(dialog.id, MessageFilter::default())
                .await
                .unwrap()
                .iter()
                .filter(|m| m.message.role == keel_core::Role::User)
                .map(|m| m.message.text())
                .collect();
            for q in &acknowledged {
                let text = format!("{q} question");
                let n = texts.iter().filter(|t| **t == text).count();
                assert_eq!(
                    n, 1,
                    "{}: {text:?} appears {n} times: {texts:?}",
                    case.point
                );
            }
            if matches!(
                case.point,
                "store::open_turn::after_commit" | "store::commit_turn::after_commit"
            ) {
                // Committed (the input, or the whole turn), never
                // acknowledged: still durable.
                assert!(texts.contains(&"second question".to_owned()), "{texts:?}");
            }
            if case.delegates {
                let runs = store.list_runs(dialog.id, None, 10).await.unwrap();
                assert!(
                    runs.items.iter().all(|r| r.status.is_terminal()),
                    "{:?}",
                    runs.items
                );
            }
        });
    }
}

/// Every failpoint is exercised above; a new one without a case fails here.
#[test]
fn every_failpoint_has_a_crash_test() {
    let listed: BTreeSet<&str> = FAILPOINTS.iter().map(|(n, _)| *n).collect();
    // The driver reaches every one (asserted by the kill in its test).
    assert_eq!(listed.len(), FAILPOINTS.len(), "duplicate failpoint names");
    let chat: BTreeSet<&str> = CHAT_CASES.iter().map(|c| c.point).collect();
    assert!(chat.is_subset(&listed), "{chat:?}");
}

/// The `keel` built by `cargo build --release` (the gateway's own bin,
/// without keel-e2e's `failpoints` feature) ignores FAILPOINTS; this copy
/// refuses a name that is no failpoint, so a typo cannot pass silently.
#[test]
fn an_unknown_failpoint_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let echo = dir.path().join("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let out = run_chat(
        &dir.path().join("data"),
        &echo,
        Some("store::no_such_point=return"),
        "hi\n",
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("which is no failpoint"), "{stderr}");
}

/// The continuation's points, reached by `keel chat` answering a
/// background result while idle: killed after the claim or before the
/// commit, the next start delivers the result once; killed after the
/// commit (the answer durable, never shown), it is never delivered again.
#[test]
fn keel_chat_dies_in_a_continuation_and_the_result_is_answered_exactly_once() {
    for point in [
        "store::claim_inbox::after_commit",
        "store::commit_continuation::before_commit",
        "store::commit_continuation::after_commit",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        crate::data_dir_with_agent(&data, "quick", "Answers at once.", true);
        // One script serves the root and the run: answers 2 and 3 are the
        // same so their order does not matter; answer 4 is the continuation's.
        let script = dir.path().join("script.yaml");
        std::fs::write(
            &script,
            "- tool_calls: [{name: delegate, arguments: {mode: background, tasks: [{agent: quick, task: count}]}}]\n\
             - text: ok\n\
             - text: ok\n\
             - text: the count is in\n",
        )
        .unwrap();
        let mut child = chat(&data, &script, Some(&format!("{point}=return")))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Stdin stays open: the chat is idle, not ending, when the result arrives.
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"count for me\n").unwrap();
        let out = child.wait_with_output().unwrap();
        drop(stdin);
        assert_killed(&out, point);

        let echo = dir.path().join("echo.yaml");
        std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
        let mut child = chat(&data, &echo, None)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let committed = point.ends_with("after_commit") && point.contains("continuation");
        if committed {
            stdin.write_all(b"after the crash\n").unwrap();
        }
        // Redelivered: the continuation's answer; committed: the echo.
        let mut seen = Vec::new();
        let mut delivered = false;
        loop {
            let line = lines.next().unwrap().unwrap();
            delivered |= line == "[background results arrived]";
            let done =
                line.starts_with("keel> ") && (delivered || line.contains("after the crash"));
            seen.push(line);
            if done {
                break;
            }
        }
        drop(stdin);
        assert!(child.wait().unwrap().success(), "{point}: {seen:?}");
        assert_eq!(delivered, !committed, "{point}: {seen:?}");
        assert_doctor_clean(&data);

        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = Store::open(data.join("keel.db"), Default::default()).unwrap();
            let dialog = store
                .latest_active_dialog("cli", "fran")
                .await
                .unwrap()
                .unwrap();
            let events = store.list_inbox_events(dialog.id).await.unwrap();
            assert_eq!(events.len(), 1, "{point}: {events:?}");
            assert_eq!(
                events[0].status,
                keel_store::EventStatus::Consumed,
                "{point}"
            );
            let triggers = store
                .load_messages(dialog.id, MessageFilter::default())
                .await
                .unwrap()
                .iter()
                .filter(|m| m.message.text().starts_with("[Background results"))
                .count();
            assert_eq!(triggers, 1, "{point}: exactly one continuation committed");
        });
    }
}
