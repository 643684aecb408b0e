//! Crash safety of the real binary: `kill -9` in the middle of a turn loses
//! nothing committed and leaves nothing half-written.
#![allow(clippy::unwrap_used)]
#![cfg(unix)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

fn chat(data: &Path, script: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["chat", "--chat", "erin", "--data-dir"])
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

#[test]
fn kill_9_mid_turn_keeps_committed_turns_and_drops_the_unfinished_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let slow = dir.path().join("slow.yaml");
    std::fs::write(
        &slow,
        "- text: first answer\n- {text: never arrives, delay_ms: 3600000}\n",
    )
    .unwrap();
    let mut child = chat(&data, &slow);
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    stdin
        .write_all(b"first question\nsecond question\n")
        .unwrap();
    // "keel> first answer" is printed after its turn committed; "> second
    // question" right before the second turn starts.
    let mut seen_first = false;
    loop {
        let line = lines.next().unwrap().unwrap();
        seen_first |= line == "keel> first answer";
        if line == "> second question" {
            break;
        }
    }
    assert!(seen_first);
    child.kill().unwrap(); // SIGKILL: no destructor, no flush, no goodbye
    child.wait().unwrap();

    let echo = dir.path().join("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let mut child = chat(&data, &echo);
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"/info\nthird question\n/checkpoints\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let out = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.contains("(1 messages)"),
        "one committed user message:\n{out}"
    );
    assert!(out.contains("messages 1 · turns 1"), "{out}");
    assert!(
        out.contains("\"third question\""),
        "the session works after the crash:\n{out}"
    );
    let checkpoints = out.lines().filter(|l| l.contains("  turn ")).count();
    assert_eq!(
        checkpoints, 2,
        "turns 1 and 2 (the new one), no half checkpoint:\n{out}"
    );
}
