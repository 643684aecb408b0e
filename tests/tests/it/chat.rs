//! Transcript tests of `keel chat`: the real binary, a real data directory,
//! stdin scripts, the ScriptedProvider via --script. Ids and the temp path
//! are redacted after their shape is checked.

use std::io::Write;
use std::path::Path;
use std::process::Stdio;

/// Runs `keel chat` with `args`, feeding `stdin`; returns stdout, stderr
/// and the exit code.
fn run_chat(args: &[&std::ffi::OsStr], stdin: &str) -> (String, String, Option<i32>) {
    let mut child = crate::keel()
        .arg("chat")
        .args(args)
        .env("KEEL_LOG", "error")
        .env_remove("KEEL_DATA_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
        out.status.code(),
    )
}

/// `keel chat --chat CHAT --data-dir DIR --script SCRIPT`.
fn keel(data_dir: &Path, script: &Path, chat: &str, stdin: &str) -> (String, String, bool) {
    let args = [
        "--chat".as_ref(),
        chat.as_ref(),
        "--data-dir".as_ref(),
        data_dir.as_os_str(),
        "--script".as_ref(),
        script.as_os_str(),
    ];
    let (out, err, code) = run_chat(&args, stdin);
    (out, err, code == Some(0))
}

/// Replaces the byte count of `/info`'s "stored N bytes" line (it moves
/// with every change of the stored formats; the store's tests check it)
/// with `<n>`, after checking it is a positive number.
fn redact_stored_bytes(text: &str) -> String {
    text.lines()
        .map(|line| match line.trim_start().strip_prefix("stored ") {
            Some(rest) => {
                let n = rest.strip_suffix(" bytes").expect(line);
                assert!(n.parse::<u64>().unwrap() > 0, "{line}");
                line.replace(n, "<n>")
            }
            None => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + if text.ends_with('\n') { "\n" } else { "" }
}

/// Replaces 8-hex-digit short ids with stable placeholders (first seen = #1 …),
/// and `/info`'s stored bytes with `<n>`.
fn redact(text: &str) -> String {
    let text = redact_stored_bytes(text);
    let text = text.as_str();
    let mut seen: Vec<String> = Vec::new();
    let mut out = String::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let is_hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
        let boundary_before = i == 0 || !chars[i - 1].is_ascii_alphanumeric();
        if boundary_before
            && i + 8 <= chars.len()
            && chars[i..i + 8].iter().all(|c| is_hex(*c))
            && (i + 8 == chars.len() || !chars[i + 8].is_ascii_alphanumeric())
            && chars[i..i + 8]
                .iter()
                .any(|c| c.is_ascii_alphabetic() || *c != '0')
        {
            let token: String = chars[i..i + 8].iter().collect();
            // Keep pure numbers that are not ids (none of our output has 8-digit numbers).
            let n = match seen.iter().position(|s| *s == token) {
                Some(p) => p + 1,
                None => {
                    seen.push(token);
                    seen.len()
                }
            };
            out.push_str(&format!("<id{n}>"));
            i += 8;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

fn script(dir: &Path, yaml: &str) -> std::path::PathBuf {
    let p = dir.join("script.yaml");
    std::fs::write(&p, yaml).unwrap();
    p
}

#[test]
fn every_slash_command_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(
        dir.path(),
        r#"
responses:
  - text: "Hello, I am scripted."
  - tool_calls: [{name: sleep, arguments: {ms: 1}}]
  - tool_calls: [{name: read_file, arguments: {path: /etc/hostname}}]
  - text: "Slept; the file is outside the workspace."
  - text: "Second dialog reply."
  - text: "A short summary."
when_exhausted: echo
"#,
    );
    let input = "\
hi
wait a moment and read /etc/hostname
/info
/new Plans
/sessions
hello second
/rename Better plans
/rename Better\u{202e}snalp
/new zero\u{200b}width
/compact
/compact
/checkpoints
/switch default
/sessions
/frobnicate
/switch
/rollback zzzzzzzz
/stop
/delete
/sessions
/help
/exit
";
    let (out, err, ok) = keel(&dir.path().join("data"), &s, "alice", input);
    assert!(ok, "stderr: {err}");
    insta::assert_snapshot!(redact(&out));
}

#[test]
fn restart_continues_the_last_dialog_and_rollback_branches_show_in_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let s = script(dir.path(), "when_exhausted: echo\n");
    let (out1, err, ok) = keel(&data, &s, "bob", "first\nsecond\n/checkpoints\n");
    assert!(ok, "{err}");
    // The first turn's checkpoint is the oldest line.
    let first_ckpt = out1
        .lines()
        .rfind(|l| l.contains("turn   1"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_owned();
    assert_eq!(first_ckpt.len(), 8);
    let input = format!("/info\n/rollback {first_ckpt}\nthird\n/checkpoints\n");
    let (out2, err, ok) = keel(&data, &s, "bob", &input);
    assert!(ok, "{err}");
    assert!(
        out2.contains("(2 messages)"),
        "continued the same dialog:\n{out2}"
    );
    // Both branches are listed: turn 2 of the old branch and turn 2 of the new one.
    let turn2 = out2.lines().filter(|l| l.contains("turn   2")).count();
    assert_eq!(turn2, 2, "{out2}");
    insta::assert_snapshot!(redact(&format!("{out1}---- restart ----\n{out2}")));
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_the_running_turn_not_the_program() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    // The first answer's second word takes an hour: only Ctrl-C can end that turn.
    let s = script(
        dir.path(),
        "responses:\n  - {text: thinking forever, chunk_delay_ms: 3600000}\n  - text: done\n",
    );
    let mut child = crate::keel()
        .args(["chat", "--chat", "carol", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--script")
        .arg(&s)
        .env("KEEL_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(b"slow question\n").unwrap();
    // Interrupt only once the answer is streaming: the model call has begun
    // (an earlier Ctrl-C would stop the turn before it asked the model, and
    // leave the hour-long answer to the next question).
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("keel> thinking ") {
        assert_ne!(out.read_until(b' ', &mut seen).unwrap(), 0, "EOF");
    }
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    stdin.write_all(b"second\n/info\n/exit\n").unwrap();
    drop(stdin);
    let rest: Vec<String> = out.lines().map(|l| l.unwrap()).collect();
    assert!(
        child.wait().unwrap().success(),
        "the program kept running after Ctrl-C"
    );
    insta::assert_snapshot!(redact_stored_bytes(&rest.join("\n")));
}

#[test]
fn delegation_through_keel_toml_agents_and_the_runs_command() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    crate::data_dir_with_agent(&data, "helper", "Answers small questions.", true);
    // One script serves the root and the helper, in the order they ask.
    let s = script(
        dir.path(),
        r#"
- tool_calls: [{name: delegate, arguments: {tasks: [{agent: helper, task: "Say hi"}]}}]
- text: "hi from the helper"
- text: "The helper said hi."
- tool_calls: [{name: delegate, arguments: {tasks: [{agent: stranger, task: "x"}]}}]
- text: "I cannot reach that agent."
"#,
    );
    let (out, err, ok) = keel(&data, &s, "dave", "ask the helper\nask a stranger\n/runs\n");
    assert!(ok, "{err}");
    assert!(out.contains("[delegate ok]"), "{out}");
    assert!(out.contains("[delegate error]"), "{out}");
    let runs: Vec<&str> = out
        .lines()
        .skip_while(|l| *l != "> /runs")
        .skip(1)
        .collect();
    assert_eq!(runs.len(), 1, "{out}");
    assert!(
        runs[0].contains("helper  foreground  completed"),
        "{}",
        runs[0]
    );
}

/// `keel chat --data-dir DIR` with whatever keel.toml the directory has.
fn keel_plain(data_dir: &Path, stdin: &str) -> (String, String, Option<i32>) {
    run_chat(&["--data-dir".as_ref(), data_dir.as_os_str()], stdin)
}

#[test]
fn without_a_provider_the_offline_model_answers_and_says_so_once() {
    let dir = tempfile::tempdir().unwrap();
    let (out, err, code) = keel_plain(dir.path(), "hello there\n");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        err.lines().filter(|l| l.contains("offline")).count(),
        1,
        "{err}"
    );
    assert!(
        out.contains("(offline)") && out.contains("\"hello there\""),
        "{out}"
    );
}

#[test]
fn an_invalid_keel_toml_stops_start_up_naming_the_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("keel.toml"),
        "[orchestration]\nmax_concurrent_runs = 0\n[sesion]\nttl_hours = 1\n",
    )
    .unwrap();
    let (_, err, code) = keel_plain(dir.path(), "");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("keel.toml"), "{err}");
    assert!(err.contains("sesion"), "{err}");
}

#[test]
fn chat_with_a_defined_agent_directly() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    crate::data_dir_with_agent(&data, "helper", "Answers small questions.", false);
    let s = script(dir.path(), "when_exhausted: echo\n");
    let args = [
        "--chat".as_ref(),
        "frank".as_ref(),
        "--agent".as_ref(),
        "helper".as_ref(),
        "--data-dir".as_ref(),
        data.as_os_str(),
        "--script".as_ref(),
        s.as_os_str(),
    ];
    let (stdout, stderr, code) = run_chat(&args, "hi\n/info\n");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("agent helper (scripted / scripted)"),
        "{stdout}"
    );
    // An unknown agent is a clear start-up error.
    let out = crate::keel()
        .args(["chat", "--chat", "frank2", "--agent", "ghost", "--data-dir"])
        .arg(&data)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown agent \"ghost\""));
}

#[test]
fn escape_sequences_from_the_model_and_tools_are_shown_inert() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(data.join("keel.toml"), "workspace_root = \"../ws\"\n").unwrap();
    // A file that clears the screen and rings the bell when printed raw.
    std::fs::write(ws.join("evil.txt"), "\u{1b}[2J\u{7}gotcha\r\n").unwrap();
    // OSC 52 sets the clipboard; CSI 8-bit (U+009B) and a lone CR hide text.
    let s = script(
        dir.path(),
        r#"
responses:
  - tool_calls: [{name: "read_file\e[31m", arguments: {path: evil.txt}}]
  - tool_calls: [{name: read_file, arguments: {path: evil.txt}}]
  - text: "copy \e]52;c;cm0gLXJmIH4=\a done\u009b1A\rhidden\tend\nnext line"
"#,
    );
    let (out, err, ok) = keel(&data, &s, "eve", "show me the file\n");
    assert!(ok, "{err}");
    for c in out.chars() {
        assert!(
            !c.is_control() || c == '\n' || c == '\t',
            "raw control {c:?} in:\n{out}"
        );
    }
    insta::assert_snapshot!(out, @r#"
    keel chat — dialog default "Dialog default" (0 messages). /help lists commands.
    > show me the file
      [tool] read_file\u{1b}[31m({"path":"evil.txt"})
      [read_file\u{1b}[31m error] error: unknown tool "read_file\u{1b}[31m"
      [tool] read_file({"path":"evil.txt"})
      [read_file ok] \u{1b}[2J\u{7}gotcha
    keel> copy \u{1b}]52;c;cm0gLXJmIH4=\u{7} done\u{9b}1A\u{d}hidden	end
    next line
    "#);
}

#[test]
fn rollback_with_an_empty_or_ambiguous_checkpoint_lists_the_candidates() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let s = script(dir.path(), "when_exhausted: echo\n");
    let input = "one\n/rollback -\ntwo\n/rollback -\n/rollback  --\n/rollback x-y\n/info\n";
    let (out, err, ok) = keel(&data, &s, "gina", input);
    assert!(ok, "{err}");
    assert!(!out.contains("rolled back"), "{out}");
    assert!(out.contains("turns 2"), "nothing was rolled back:\n{out}");
    insta::assert_snapshot!(redact(&out), @r#"
    keel chat — dialog default "Dialog default" (0 messages). /help lists commands.
    > one
    keel> (offline) I am keel's built-in offline model, so I can only acknowledge: "one". Configure a provider in keel.toml to talk to a real LLM.
    > /rollback -
    error: invalid input: "-" is not a checkpoint id; give the hex digits of one of: <id1>
    > two
    keel> (offline) I am keel's built-in offline model, so I can only acknowledge: "two". Configure a provider in keel.toml to talk to a real LLM.
    > /rollback -
    error: invalid input: "-" is not a checkpoint id; give the hex digits of one of: <id2>, <id1>
    > /rollback  --
    error: invalid input: "--" is not a checkpoint id; give the hex digits of one of: <id2>, <id1>
    > /rollback x-y
    error: invalid input: "x-y" is not a checkpoint id; give the hex digits of one of: <id2>, <id1>
    > /info
    dialog default "Dialog default"
    agent root (scripted / scripted)
    messages 2 · turns 2 · slot default · checkpoints 2
    stored <n> bytes
    tokens 137 in / 68 out over 2 model calls
    spent 137 in / 68 out over 2 model calls, runs included
    "#);
}

#[cfg(unix)]
#[test]
fn a_new_data_directory_is_private_to_the_owner() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("new/data");
    let s = script(dir.path(), "when_exhausted: echo\n");
    let (_, err, ok) = keel(&data, &s, "hal", "hi\n");
    assert!(ok, "{err}");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&data.join("keel.db")), 0o600);
}

#[test]
fn tools_cannot_read_or_rewrite_keels_own_files_in_the_workspace() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("agents")).unwrap();
    let toml =
        "workspace_root = \"..\"\n[tools]\nenable_write = true\napproval_default = \"never\"\n";
    std::fs::write(data.join("keel.toml"), toml).unwrap();
    // The model tries to turn the shell on for the next start, and to plant an agent.
    let s = script(
        dir.path(),
        r#"
responses:
  - tool_calls:
      - {name: read_file, arguments: {path: data/keel.toml}}
      - {name: write_file, arguments: {path: data/keel.toml, content: "[tools]\nenable_shell = true\n"}}
      - {name: write_file, arguments: {path: data/agents/evil.md, content: "x"}}
      - {name: list_dir, arguments: {path: data}}
      - {name: write_file, arguments: {path: notes.txt, content: "fine"}}
  - text: "done"
"#,
    );
    let (out, err, ok) = keel(&data, &s, "ivy", "go\n");
    assert!(ok, "{err}");
    assert_eq!(
        out.matches("error] error: denied: data").count(),
        4,
        "{out}"
    );
    assert!(
        out.contains("[write_file ok] wrote 4 bytes to notes.txt"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("keel.toml")).unwrap(),
        toml
    );
    assert!(!data.join("agents/evil.md").exists());
}

/// A turn that fails keeps the user's message, marked unanswered: the chat
/// says so, the next turn answers with it in view, `/info` counts it and
/// switching back to the dialog lists it.
#[test]
fn a_failed_turn_keeps_the_message_marked_unanswered() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(
        dir.path(),
        "responses:\n  - error: {kind: auth, message: bad key}\n  - text: Now I see both questions.\n",
    );
    let input = "first question\nsecond question\n/info\n/switch default\n";
    let (out, err, ok) = keel(&dir.path().join("data"), &s, "dora", input);
    assert!(ok, "stderr: {err}");
    insta::assert_snapshot!(redact(&out));
}

/// A turn past `session.turn_timeout_secs` is stopped: the chat says it
/// timed out and that the message is kept; the next turn answers normally.
#[test]
fn a_turn_past_its_deadline_says_it_timed_out() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("keel.toml"), "[session]\nturn_timeout_secs = 1\n").unwrap();
    let s = script(
        dir.path(),
        "responses:\n  - {text: never, delay_ms: 3600000}\n  - text: Answered now.\n",
    );
    let (out, err, ok) = keel(&data, &s, "tim", "first question\nsecond question\n");
    assert!(ok, "stderr: {err}");
    insta::assert_snapshot!(redact(&out));
}

/// The model's memory tools commit with their turn and `/memory` lists what
/// is kept; `/compact` summarizes the context now, says when nothing new is
/// left to summarize, and the next turn is answered from the summary.
#[test]
fn memory_and_compact_in_a_transcript() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(
        dir.path(),
        r#"
responses:
  - tool_calls: [{name: remember, arguments: {key: deadline, value: "Launch on Friday"}}]
  - text: "Noted."
  - tool_calls: [{name: remember, arguments: {key: owner, value: "Dora runs the launch"}}]
  - tool_calls: [{name: forget, arguments: {key: deadline}}]
  - text: "Updated."
  - text: "The user set up the launch: Dora owns it."
  - text: "Dora, as agreed."
"#,
    );
    let input = "\
/memory
remember the deadline
/memory
Dora owns it; forget the date
/memory
/compact
/compact
who owns the launch?
/info
";
    let (out, err, ok) = keel(&dir.path().join("data"), &s, "erin", input);
    assert!(ok, "stderr: {err}");
    insta::assert_snapshot!(redact(&out));
}

/// A background run's signal is printed by `keel chat` as it arrives, and
/// `/runs` lists it with its delivery status.
#[cfg(unix)]
#[test]
fn a_signal_from_a_background_run_is_printed_and_listed() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // The root and the watcher each have their own scripted model.
    std::fs::create_dir_all(data.join("agents")).unwrap();
    let files = [
        (
            "keel.toml",
            "agents_dir = \"agents\"\nroot_delegates = [\"watcher\"]\ndefault_profile = \"root\"\n\
             [providers.root]\nkind = \"scripted\"\nscript = \"root.yaml\"\n\
             [providers.watch]\nkind = \"scripted\"\nscript = \"watcher.yaml\"\n",
        ),
        (
            "agents/watcher.md",
            "---\nid: watcher\ndescription: Watches the disk.\nllm_profile: watch\n\
             signal:\n  delivery: queue\n---\nYou are watcher.\n",
        ),
        (
            "root.yaml",
            "responses:\n  - tool_calls: [{name: delegate, arguments: {mode: background, \
             tasks: [{agent: watcher, task: watch}]}}]\n  - text: watching\nwhen_exhausted: echo\n",
        ),
        (
            "watcher.yaml",
            "responses:\n  - tool_calls: [{name: emit_signal, arguments: \
             {severity: warning, summary: disk almost full}}]\n  - text: watched\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(data.join(name), text).unwrap();
    }
    let mut child = crate::keel()
        .args(["chat", "--chat", "sam", "--data-dir"])
        .arg(&data)
        .env("KEEL_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // Lines arrive on a channel, so a missing one fails the test after a
    // while instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    let mut out: Vec<String> = Vec::new();
    let until = |out: &mut Vec<String>, done: &dyn Fn(&[String]) -> bool| {
        while !done(out) {
            match rx.recv_timeout(std::time::Duration::from_secs(30)) {
                Ok(line) => out.push(line),
                Err(e) => panic!("{e}: the chat printed only:\n{}", out.join("\n")),
            }
        }
    };
    let seen = |out: &[String], what: &str| out.iter().any(|l| l.contains(what));
    stdin.write_all(b"watch the disk\n").unwrap();
    until(&mut out, &|o| {
        seen(o, "[signal warning] watcher (run ") && seen(o, "[background results arrived]")
    });
    let line = out.iter().find(|l| l.contains("[signal warning]")).unwrap();
    assert!(line.ends_with("): disk almost full"), "{line}");
    // /runs lists it too, with its delivery status.
    stdin.write_all(b"/runs\n").unwrap();
    until(&mut out, &|o| {
        o.iter()
            .skip_while(|l| !l.contains("signals (newest first):"))
            .nth(1)
            .is_some()
    });
    let listed = out
        .iter()
        .skip_while(|l| !l.contains("signals (newest first):"))
        .nth(1)
        .unwrap()
        .clone();
    drop(stdin);
    assert!(child.wait().unwrap().success());
    assert!(
        listed.contains("[signal warning] watcher (run ") && listed.contains("disk almost full"),
        "{listed}\n{}",
        out.join("\n")
    );
}

#[test]
fn slash_agent_switches_the_dialog_across_a_restart_and_a_removed_agent_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    crate::data_dir_with_agent(&data, "helper", "Answers small questions.", false);
    let s = script(dir.path(), "when_exhausted: echo\n");
    let input = "hi\n/agent\n/agent ghost\n/agent Bad_Name!\n/agent helper\n/agent\n";
    let (out1, err, ok) = keel(&data, &s, "gina", input);
    assert!(ok, "{err}");
    // The switch is stored: after a restart the same dialog runs helper.
    let (out2, err, ok) = keel(&data, &s, "gina", "/info\nagain\n");
    assert!(ok, "{err}");
    assert!(
        out2.contains("agent helper (scripted / scripted)"),
        "{out2}"
    );
    assert!(out2.contains("messages 1 · turns 1"), "{out2}");
    // A reload-removed agent: the dialog says so and how to switch.
    std::fs::remove_file(data.join("agents/helper.md")).unwrap();
    let (out3, err, ok) = keel(&data, &s, "gina", "still there?\n/agent root\nnow?\n");
    assert!(ok, "{err}");
    insta::assert_snapshot!(redact(&format!(
        "{out1}---- restart ----\n{out2}---- helper removed ----\n{out3}"
    )));
}

/// A gated `write_file` call is asked inline: `y` runs it once and the
/// model goes on; a second one is listed by `/approvals` and `n` refuses
/// it; a third is superseded by the next message.
#[test]
fn the_chat_asks_before_a_write_and_takes_approve_deny_and_new_input() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("agents")).unwrap();
    std::fs::write(
        data.join("keel.toml"),
        "workspace_root = \"..\"\n[tools]\nenable_write = true\n",
    )
    .unwrap();
    let s = script(
        dir.path(),
        r#"
responses:
  - tool_calls:
      - {name: write_file, arguments: {path: a.txt, content: "one"}}
  - text: "wrote a.txt"
  - tool_calls:
      - {name: write_file, arguments: {path: b.txt, content: "two"}}
  - text: "you said no"
  - tool_calls:
      - {name: write_file, arguments: {path: c.txt, content: "three"}}
  - text: "fine, something else"
"#,
    );
    let (out, err, ok) = keel(
        &data,
        &s,
        "ann",
        "write a\ny\nwrite b\n/approvals\n/deny nope not b\nn\nwrite c\nsomething else\n",
    );
    assert!(ok, "{err}");
    assert_eq!(
        out.matches("— allow? [y]es / [n]o / [a]lways").count(),
        3,
        "{out}"
    );
    assert!(
        out.contains("write_file({\"content\":\"one\",\"path\":\"a.txt\"})"),
        "{out}"
    );
    assert!(out.contains("keel> wrote a.txt"), "{out}");
    // The turn after a decision says so, not that background results came.
    assert_eq!(out.matches("[approval decided]").count(), 2, "{out}");
    assert!(!out.contains("[background results arrived]"), "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("a.txt")).unwrap(),
        "one"
    );
    // `/deny ID` takes the short id `/approvals` lists.
    assert!(
        out.contains("error: no tool call waits for a decision as nope"),
        "{out}"
    );
    assert!(out.contains("write_file denied"), "{out}");
    assert!(out.contains("keel> you said no"), "{out}");
    assert!(!dir.path().join("b.txt").exists());
    assert!(!dir.path().join("c.txt").exists());
    assert!(
        out.contains("write_file superseded (superseded by new input)"),
        "{out}"
    );
    assert!(out.contains("keel> fine, something else"), "{out}");
}
