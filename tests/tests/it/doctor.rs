//! `keel doctor`: what a user sees for a clean data directory, for one a
//! crash left behind (findings, what they mean, whether `--repair` fixes
//! them), after `--repair`, and while another keel owns the directory.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Output, Stdio};

fn doctor(data: &Path, repair: bool) -> Output {
    let mut cmd = crate::keel();
    cmd.args(["doctor", "--data-dir"])
        .arg(data)
        .env("KEEL_LOG", "error");
    if repair {
        cmd.arg("--repair");
    }
    cmd.output().unwrap()
}

/// The output with the data directory and ids masked, and the state of
/// the run killed just after its acceptance (it may not have started).
fn shown(out: &Output, data: &Path) -> String {
    let text = String::from_utf8_lossy(&out.stdout)
        .replace(&data.display().to_string(), "<data>")
        .replace("is queued:", "is queued or running:")
        .replace("is running:", "is queued or running:");
    mask_uuids(&text)
}

fn mask_uuids(text: &str) -> String {
    let bytes = text.as_bytes();
    let is_uuid = |i: usize| {
        bytes.len() >= i + 36
            && bytes[i..i + 36].iter().enumerate().all(|(k, b)| match k {
                8 | 13 | 18 | 23 => *b == b'-',
                _ => b.is_ascii_hexdigit(),
            })
    };
    let mut out = String::new();
    let mut i = 0;
    while i < text.len() {
        if is_uuid(i) {
            out.push_str("<id>");
            i += 36;
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn chat(data: &Path, script: &Path) -> std::process::Child {
    crate::keel()
        .args(["chat", "--chat", "gus", "--data-dir"])
        .arg(data)
        .arg("--script")
        .arg(script)
        .env("KEEL_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// A data directory whose chat was killed with a background run in
/// flight, and whose inbox counters were then damaged by hand.
fn crashed_data_dir(dir: &Path) -> std::path::PathBuf {
    let data = dir.join("data");
    crate::data_dir_with_agent(&data, "slow", "Takes its time.", true);
    let script = dir.join("slow.yaml");
    std::fs::write(
        &script,
        "- tool_calls: [{name: delegate, arguments: {mode: background, tasks: [{agent: slow, task: wait}]}}]\n\
         - {text: never, delay_ms: 3600000}\n\
         - {text: never, delay_ms: 3600000}\n",
    )
    .unwrap();
    let mut child = chat(&data, &script);
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    stdin.write_all(b"start the slow job\n").unwrap();
    while !lines
        .next()
        .unwrap()
        .unwrap()
        .contains("[delegate ok] accepted in the background")
    {}
    child.kill().unwrap();
    child.wait().unwrap();
    let conn = rusqlite::Connection::open(data.join("keel.db")).unwrap();
    conn.execute("UPDATE agent_session_state SET pending_event_count = 7", [])
        .unwrap();
    data
}

#[test]
fn doctor_reports_a_crashed_directory_repairs_what_is_safe_and_is_then_clean() {
    let dir = tempfile::tempdir().unwrap();
    let data = crashed_data_dir(dir.path());
    let out = doctor(&data, false);
    assert_eq!(out.status.code(), Some(1), "findings exit 1");
    insta::assert_snapshot!("doctor_findings", shown(&out, &data));

    let out = doctor(&data, true);
    assert_eq!(out.status.code(), Some(0), "{}", shown(&out, &data));
    insta::assert_snapshot!("doctor_repair", shown(&out, &data));

    let out = doctor(&data, false);
    assert_eq!(out.status.code(), Some(0));
    assert!(shown(&out, &data).ends_with("clean: every invariant holds\n"));
}

#[test]
fn doctor_checks_a_running_keels_directory_read_only_and_refuses_to_repair_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let echo = dir.path().join("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let mut running = chat(&data, &echo);
    let mut stdin = running.stdin.take().unwrap();
    let mut lines = BufReader::new(running.stdout.take().unwrap()).lines();
    stdin.write_all(b"hello\n").unwrap();
    while !lines.next().unwrap().unwrap().contains("\"hello\"") {}

    let out = doctor(&data, false);
    let text = shown(&out, &data);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.starts_with("<data>/keel.db is in use by keel chat (pid "),
        "{text}"
    );
    let out = doctor(&data, true);
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is in use by another keel process"), "{err}");
    drop(stdin);
    assert!(running.wait().unwrap().success());
}

#[test]
fn doctor_without_a_database_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = doctor(dir.path(), false);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no keel database at"), "{err}");
    assert!(!dir.path().join("keel.db").exists(), "nothing created");
}
