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

/// `kill -9` while the model answers: the committed turn and the user's
/// words of the unfinished one survive (the latter marked unanswered and
/// replayed by the next turn); nothing of the unfinished answer, and no
/// checkpoint of it.
#[test]
fn kill_9_during_a_model_call_keeps_the_users_message_and_no_half_turn() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let slow = dir.path().join("slow.yaml");
    std::fs::write(
        &slow,
        "- text: first answer\n- {text: never arrives, chunk_delay_ms: 3600000}\n",
    )
    .unwrap();
    let mut child = chat(&data, &slow);
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    stdin
        .write_all(b"first question\nsecond question\n")
        .unwrap();
    // "keel> first answer" is printed after its turn committed; "> second
    // question" right before the second turn starts, and its first word
    // once the model answers (so the question was committed before).
    let mut seen_first = false;
    loop {
        let mut line = String::new();
        assert_ne!(out.read_line(&mut line).unwrap(), 0, "EOF");
        seen_first |= line == "keel> first answer\n";
        if line == "> second question\n" {
            break;
        }
    }
    assert!(seen_first);
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("keel> never ") {
        assert_ne!(out.read_until(b' ', &mut seen).unwrap(), 0, "EOF");
    }
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
        out.contains("(2 messages)."),
        "both user messages survived:\n{out}"
    );
    assert!(
        out.contains("[unanswered] second question"),
        "the interrupted one is shown unanswered:\n{out}"
    );
    assert!(out.contains("messages 2 (1 unanswered) · turns 1"), "{out}");
    assert!(!out.contains("never arrives"), "no half answer:\n{out}");
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
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    stdin.write_all(b"/runs\n").unwrap();
    let mut out = Vec::new();
    // Its reserved completion became an inbox event, and the start-up wake
    // delivers it: a continuation answers while the chat is idle.
    // The /runs listing and the continuation print in either order.
    let seen = |out: &[String], what: &str| out.iter().any(|l| l.contains(what));
    while !(seen(&out, "slow  background  interrupted")
        && out
            .iter()
            .skip_while(|l| *l != "[background results arrived]")
            .any(|l| l.starts_with("keel> ")))
    {
        out.push(lines.next().unwrap().unwrap());
    }
    drop(stdin);
    assert!(child.wait().unwrap().success());
    let out = out.join("\n");
    assert!(
        out.lines()
            .any(|l| l.contains("slow  background  interrupted")),
        "the run of the dead process is interrupted:\n{out}"
    );
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
        assert_eq!(events[0].status, keel_store::EventStatus::Consumed);
        let counters = store.inbox_usage(dialog.id).await.unwrap();
        assert_eq!(
            (
                counters.pending_event_count,
                counters.reserved_completion_slots
            ),
            (0, 0)
        );
    });
}

/// Killed after a continuation claimed its event and before it committed:
/// the next start releases the lease and delivers the event exactly once.
#[test]
fn kill_9_between_claim_and_commit_delivers_the_result_exactly_once_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    crate::data_dir_with_agent(&data, "quick", "Answers at once.", true);
    // One script serves the root and the run; answers 2 and 3 are the same
    // so their order does not matter. The continuation (answer 4) hangs.
    let script = dir.path().join("hang.yaml");
    std::fs::write(
        &script,
        "- tool_calls: [{name: delegate, arguments: {mode: background, tasks: [{agent: quick, task: count}]}}]\n\
         - text: ok\n\
         - text: ok\n\
         - {text: never, delay_ms: 3600000}\n",
    )
    .unwrap();
    let mut child = chat(&data, &script);
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    stdin.write_all(b"count for me\n").unwrap();
    // Printed when the continuation turn starts: its event is leased.
    loop {
        if lines.next().unwrap().unwrap() == "[background results arrived]" {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let echo = dir.path().join("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let mut child = chat(&data, &echo);
    let stdin2 = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut delivered = false;
    loop {
        let line = lines.next().unwrap().unwrap();
        if line == "[background results arrived]" {
            delivered = true;
        } else if delivered && line.starts_with("keel> ") {
            break;
        }
    }
    drop(stdin2);
    assert!(child.wait().unwrap().success());
    drop(stdin);
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
        assert_eq!(
            (events[0].status, events[0].attempt_count),
            (keel_store::EventStatus::Consumed, 1),
            "consumed once; the lease of the killed process counted as one attempt"
        );
        let history = store
            .load_messages(dialog.id, keel_store::MessageFilter::default())
            .await
            .unwrap();
        let triggers = history
            .iter()
            .filter(|m| m.message.text().starts_with("[Background results"))
            .count();
        assert_eq!(triggers, 1, "exactly one continuation was committed");
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

/// `kill -9` while a gated call waits for approval: after the restart the
/// approval is still pending, `/approve` runs the call once, and the turn
/// goes on.
#[test]
fn kill_9_with_a_pending_approval_then_approve_runs_the_call_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(
        data.join("keel.toml"),
        "workspace_root = \"..\"\n[tools]\nenable_write = true\n",
    )
    .unwrap();
    let first = dir.path().join("first.yaml");
    std::fs::write(
        &first,
        "- tool_calls:\n    - {name: write_file, arguments: {path: a.txt, content: once}}\n- text: never used\n",
    )
    .unwrap();
    let mut child = chat(&data, &first);
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(b"write a.txt\n").unwrap();
    // The question is printed once the pause is committed.
    let id = loop {
        let mut line = String::new();
        assert_ne!(out.read_line(&mut line).unwrap(), 0, "EOF");
        if line.contains("— allow? [y]es / [n]o / [a]lways") {
            let id = line
                .split("[approval ")
                .nth(1)
                .and_then(|rest| rest.split(']').next())
                .unwrap()
                .to_owned();
            break id;
        }
    };
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!dir.path().join("a.txt").exists(), "nothing ran undecided");

    let second = dir.path().join("second.yaml");
    std::fs::write(&second, "- text: written after the restart\n").unwrap();
    let mut child = chat(&data, &second);
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("/approvals\n/approve {id}\n/approvals\n").as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(
        text.contains(&format!("{id}  root")),
        "still pending:\n{text}"
    );
    assert!(text.contains("keel> written after the restart"), "{text}");
    assert!(text.contains("no tool call waits for a decision"), "{text}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("a.txt")).unwrap(),
        "once"
    );
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
        let approvals = store.list_approvals(dialog.id, false).await.unwrap();
        assert_eq!(approvals.len(), 1);
        assert_eq!(approvals[0].status, keel_store::ApprovalStatus::Approved);
        assert!(approvals[0].settled_at_ms.is_some());
        let history = store
            .load_messages(dialog.id, keel_store::MessageFilter::default())
            .await
            .unwrap();
        let results = history
            .iter()
            .filter(|m| m.message.tool_name.as_deref() == Some("write_file"))
            .count();
        assert_eq!(results, 1, "the call ran and answered exactly once");
    });
}
