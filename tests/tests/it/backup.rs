//! `keel backup` while `keel serve` answers turns: the copy is checked and
//! holds every turn acknowledged before the backup began; `keel restore`
//! is refused while serve runs and over a database without `--force`, and
//! a restored data directory is clean and serves the backed-up dialogs.

use std::path::Path;
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::StreamExt;

use crate::keel;
use crate::serve::{runtime, Served};

/// Sends `text` to dialog `id` and returns once the turn is committed.
pub(crate) async fn acknowledged_turn(http: &reqwest::Client, base: &str, id: &str, text: &str) {
    let response = http
        .post(format!("{base}/api/dialogs/{id}/messages"))
        .header("accept", "text/event-stream")
        .json(&serde_json::json!({ "text": text }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("event: turn_committed") {
        let chunk = stream.next().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
}

pub(crate) async fn new_dialog(http: &reqwest::Client, served: &Served, title: &str) -> String {
    let dialog: serde_json::Value = http
        .post(served.url("/api/dialogs"))
        .json(&serde_json::json!({ "title": title }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    dialog["id"].as_str().unwrap().to_owned()
}

pub(crate) fn run(args: &[&str], paths: &[&Path]) -> Output {
    let mut cmd = keel();
    cmd.args(args).env("KEEL_LOG", "error");
    for p in paths {
        cmd.arg(p);
    }
    cmd.output().unwrap()
}

/// Stdout and stderr with `dir` masked, and the pid and host of a holder.
pub(crate) fn shown(out: &Output, dir: &Path) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
    .replace(&dir.display().to_string(), "<dir>");
    match text.find("(pid ") {
        Some(start) => {
            let end = start + text[start..].find(')').unwrap();
            format!("{}(pid <pid>){}", &text[..start], &text[end + 1..])
        }
        None => text,
    }
}

#[test]
fn a_backup_while_serve_answers_turns_restores_into_a_clean_directory_that_serves_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("echo.yaml"), "when_exhausted: echo\n").unwrap();
    std::fs::write(
        data.join("keel.toml"),
        "[providers.default]\nkind = \"scripted\"\nscript = \"echo.yaml\"\n",
    )
    .unwrap();
    let served = Served::start(&data);
    let backup = dir.path().join("backup.db");
    let rt = runtime();
    let http = reqwest::Client::new();
    // Acknowledged before the backup begins: 3 dialogs of 2 turns.
    let dialogs: Vec<String> = rt.block_on(async {
        let mut ids = Vec::new();
        for d in 0..3 {
            let id = new_dialog(&http, &served, &format!("Dialog {d}")).await;
            for t in 0..2 {
                acknowledged_turn(&http, &served.url(""), &id, &format!("d{d} t{t}")).await;
            }
            ids.push(id);
        }
        ids
    });
    // Turns keep being answered while the backup runs.
    let stop = Arc::new(AtomicBool::new(false));
    let out = rt.block_on(async {
        let busy = {
            let (http, stop, id) = (http.clone(), stop.clone(), dialogs[0].clone());
            let url = served.url("");
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    acknowledged_turn(&http, &url, &id, &format!("during {n}")).await;
                    n += 1;
                }
            })
        };
        let (data, backup) = (data.clone(), backup.clone());
        let out =
            tokio::task::spawn_blocking(move || run(&["backup", "--data-dir"], &[&data, &backup]))
                .await
                .unwrap();
        stop.store(true, Ordering::SeqCst);
        busy.await.unwrap();
        out
    });
    let text = shown(&out, dir.path());
    assert!(out.status.success(), "{text}");
    assert!(text.contains("every invariant holds"), "{text}");
    // A new turn still commits after the backup.
    rt.block_on(acknowledged_turn(
        &http,
        &served.url(""),
        &dialogs[1],
        "after",
    ));

    let refused = run(&["restore", "--force", "--data-dir"], &[&data, &backup]);
    assert_eq!(refused.status.code(), Some(1));
    insta::assert_snapshot!(
        "restore_refused_while_serve_runs",
        shown(&refused, dir.path())
    );
    served.signal("TERM");
    served.stderr_until("stopped");

    let fresh = dir.path().join("fresh");
    let restored = run(&["restore", "--data-dir"], &[&fresh, &backup]);
    let text = shown(&restored, dir.path());
    assert!(restored.status.success(), "{text}");
    assert!(text.contains("restored <dir>/fresh/keel.db ("), "{text}");
    let again = run(&["restore", "--data-dir"], &[&fresh, &backup]);
    assert_eq!(again.status.code(), Some(1));
    insta::assert_snapshot!("restore_refused_over_a_database", shown(&again, dir.path()));
    let doctor = run(&["doctor", "--data-dir"], &[&fresh]);
    let text = shown(&doctor, dir.path());
    assert!(doctor.status.success(), "{text}");

    let served = Served::start(&fresh);
    rt.block_on(async {
        for (d, id) in dialogs.iter().enumerate() {
            let messages: serde_json::Value = http
                .get(served.url(&format!("/api/dialogs/{id}/messages?order=asc")))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let texts: Vec<String> = messages["items"]
                .as_array()
                .unwrap_or_else(|| panic!("{messages}"))
                .iter()
                .map(|m| m["text"].as_str().unwrap_or_default().to_owned())
                .collect();
            for t in 0..2 {
                let asked = format!("d{d} t{t}");
                assert!(texts.contains(&asked), "{asked} not in {texts:?}");
            }
        }
    });
    served.signal("TERM");
    served.stderr_until("stopped");
}

#[test]
fn restore_refuses_a_file_that_is_not_a_keel_database() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "not a database").unwrap();
    let fresh = dir.path().join("fresh");
    let out = run(&["restore", "--data-dir"], &[&fresh, &notes]);
    assert_eq!(out.status.code(), Some(1));
    insta::assert_snapshot!(shown(&out, dir.path()));
    assert!(!fresh.join("keel.db").exists());
}
