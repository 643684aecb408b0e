//! Crash safety of the real binary: `kill -9` in the middle of a turn loses
//! nothing committed and leaves nothing half-written.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Stdio;

fn chat(data: &Path, script: &Path) -> std::process::Child {
    crate::keel()
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

#[test]
fn kill_9_with_a_background_run_in_flight_interrupts_it_with_its_completion_on_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    crate::data_dir_with_agent(&data, "slow", "Takes its time.", true);
    // The root delegates in the background; every later answer (the root's
    // and the run's) takes an hour, so the process dies with the run live.
    let script = dir.path().join("slow.yaml");
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
    // The tool result is printed after the run was accepted (committed).
    loop {
        let line = lines.next().unwrap().unwrap();
        if line.contains("[delegate ok] accepted in the background") {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let echo = dir.path().join("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let mut child = chat(&data, &echo);
    child.stdin.take().unwrap().write_all(b"/runs\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let out = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.lines()
            .any(|l| l.contains("slow  background  interrupted")),
        "the run of the dead process is interrupted:\n{out}"
    );
    // Its reserved completion became a durable inbox event.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = keel_store::Store::open(data.join("keel.db"), Default::default()).unwrap();
        let dialog = store
            .latest_active_dialog("cli", "erin")
            .await
            .unwrap()
            .unwrap();
        let events = store.list_inbox_events(dialog.id).await.unwrap();
        assert_eq!(events.len(), 1, "{events:?}");
        let counters = store.inbox_usage(dialog.id).await.unwrap();
        assert_eq!(
            (
                counters.pending_event_count,
                counters.reserved_completion_slots
            ),
            (1, 0)
        );
    });
}

/// One process owns a data directory: a second `keel chat` on it is refused
/// before it touches anything, with an error naming the first one.
#[test]
fn a_second_chat_on_the_same_data_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let echo = dir.path().join("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let mut first = chat(&data, &echo);
    let mut stdin = first.stdin.take().unwrap();
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    // The banner is printed once the runtime is activated (lock held).
    assert!(lines
        .next()
        .unwrap()
        .unwrap()
        .starts_with("keel chat — dialog"));

    let second = crate::keel()
        .args(["chat", "--chat", "erin", "--data-dir"])
        .arg(&data)
        .arg("--script")
        .arg(&echo)
        .env("KEEL_LOG", "error")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8(second.stderr).unwrap();
    let holder = format!("keel chat (pid {} on ", first.id());
    assert!(
        err.contains("is in use by another keel process") && err.contains(&holder),
        "{err}"
    );
    assert!(second.stdout.is_empty(), "nothing ran");

    // The first chat is unaffected and still answers.
    stdin.write_all(b"still here?\n").unwrap();
    loop {
        let line = lines.next().unwrap().unwrap();
        if line.contains("still here?") && line.starts_with("keel>") {
            break;
        }
    }
    drop(stdin);
    assert!(first.wait().unwrap().success());
}
