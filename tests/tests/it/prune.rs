//! `keel prune`: retention on demand against a real data directory, killed
//! (SIGKILL, as `kill -9`) at several of its commits — while it purges a
//! dialog deleted long ago and while it prunes checkpoints: what is left is
//! consistent, every checkpoint still listed restores exactly, and the next
//! prune finishes the work and says what it removed.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Output;

use keel_core::{CheckpointId, Message, SessionId};
use keel_store::{
    CheckOptions, CheckpointSource, MessageFilter, NewCheckpoint, NewMessage, NewSession, Store,
    TurnCommit,
};

fn prune(data: &Path, failpoints: Option<&str>) -> Output {
    let mut cmd = crate::keel();
    cmd.args(["prune", "--data-dir"])
        .arg(data)
        .env("KEEL_LOG", "error");
    if let Some(f) = failpoints {
        cmd.env("FAILPOINTS", f);
    }
    cmd.output().unwrap()
}

fn session(dialog: &str) -> NewSession {
    NewSession {
        id: SessionId::new(),
        channel: "cli_chat".into(),
        chat_id: "chat-1".into(),
        dialog_id: dialog.into(),
        title: dialog.into(),
        agent_id: None,
        parent_id: None,
        delivery_context: None,
        now_ms: 1,
    }
}

/// Commits `n` turns with checkpoints; returns their checkpoint ids in order.
async fn turns(store: &Store, id: SessionId, n: u64) -> Vec<CheckpointId> {
    let mut out = Vec::new();
    for i in 0..n {
        let cp = CheckpointId::new();
        store
            .commit_turn(TurnCommit {
                calls: None,
                session_id: id,
                messages: vec![
                    NewMessage::new(Message::user(format!("q{id}-{i}").as_str())),
                    NewMessage::new(Message::assistant("a".repeat(2000).as_str())),
                ],
                state: format!("state {id} {i}").into_bytes(),
                checkpoint: Some(NewCheckpoint {
                    id: cp,
                    turn_index: i + 1,
                    source: CheckpointSource::Turn,
                }),
                visible_user_inputs: 1,
                answers: Vec::new(),
                expected_head: None,
                now_ms: 10 + i64::try_from(i).unwrap(),
            })
            .await
            .unwrap();
        out.push(cp);
    }
    out
}

/// Three dialogs: one with 35 turns and a rollback, one forked from it with
/// 10 turns, one with 20 turns; retention keeps 2 turn checkpoints each.
/// Then two deleted dialogs of 20 turns: one deleted long ago (purged, as
/// `purge_deleted_after_days` is 30 by default), one just now (kept).
/// Returns the three live dialogs and the two deleted ones.
fn seed_all(data: &Path, rt: &tokio::runtime::Runtime) -> (Vec<SessionId>, [SessionId; 2]) {
    let live = seed(data, rt);
    let deleted = rt.block_on(async {
        let store = Store::open(data.join("keel.db"), Default::default()).unwrap();
        let old = store.create_session(session("old")).await.unwrap().id;
        turns(&store, old, 20).await;
        assert!(store.soft_delete_session(old, 50).await.unwrap());
        let recent = store.create_session(session("recent")).await.unwrap().id;
        turns(&store, recent, 20).await;
        let now = keel_core::time::now_ms();
        assert!(store.soft_delete_session(recent, now).await.unwrap());
        [old, recent]
    });
    (live, deleted)
}

fn seed(data: &Path, rt: &tokio::runtime::Runtime) -> Vec<SessionId> {
    std::fs::create_dir_all(data).unwrap();
    std::fs::write(
        data.join("keel.toml"),
        "[session.retention]\nkeep_checkpoints = 2\n",
    )
    .unwrap();
    rt.block_on(async {
        let store = Store::open(data.join("keel.db"), Default::default()).unwrap();
        let a = store.create_session(session("a")).await.unwrap().id;
        let a_cps = turns(&store, a, 30).await;
        store
            .rollback(a, a_cps[9], CheckpointId::new(), 100)
            .await
            .unwrap();
        turns(&store, a, 5).await;
        let (b, _) = store
            .fork(a_cps[4], session("b"), CheckpointId::new())
            .await
            .unwrap();
        turns(&store, b.id, 10).await;
        let c = store.create_session(session("c")).await.unwrap().id;
        turns(&store, c, 20).await;
        vec![a, b.id, c]
    })
}

/// What every listed checkpoint restores (message texts and state hash).
fn restores(
    data: &Path,
    ids: &[SessionId],
    rt: &tokio::runtime::Runtime,
) -> BTreeMap<CheckpointId, (Vec<String>, String)> {
    rt.block_on(async {
        let store = Store::open(data.join("keel.db"), Default::default()).unwrap();
        let report = store
            .check_invariants(CheckOptions::default())
            .await
            .unwrap();
        assert!(report.is_clean(), "{report:#?}");
        let mut out = BTreeMap::new();
        for id in ids {
            for cp in store.list_checkpoints(*id).await.unwrap() {
                let texts = store
                    .load_messages_at_checkpoint(cp.id, MessageFilter::default())
                    .await
                    .unwrap()
                    .iter()
                    .map(|m| m.message.text())
                    .collect();
                let state = store.get_state_blob(cp.state_hash.clone()).await.unwrap();
                assert!(state.is_some(), "state of checkpoint {}", cp.id);
                out.insert(cp.id, (texts, cp.state_hash));
            }
        }
        out
    })
}

#[test]
fn a_prune_killed_at_any_commit_leaves_a_consistent_database_the_next_one_finishes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The purge of the old deleted dialog commits first (queued inputs,
    // runs, checkpoints, messages, its row), then the checkpoint pruning.
    for kill_at in [0, 2, 3, 5] {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let (ids, [old, recent]) = seed_all(&data, &rt);
        let before = restores(&data, &ids, &rt);
        assert_eq!(before.len(), 30 + 1 + 5 + 1 + 10 + 20);

        let point = "store::writer::before_commit";
        let out = prune(&data, Some(&format!("{point}={kill_at}*off->return")));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.signal(), Some(9), "not killed: {stderr}");
        assert!(
            stderr.contains(&format!("failpoint {point} fired")),
            "{stderr}"
        );
        let interrupted = restores(&data, &ids, &rt);
        for (cp, restored) in &interrupted {
            assert_eq!(
                Some(restored),
                before.get(cp),
                "checkpoint {cp} after kill {kill_at}"
            );
        }

        let out = prune(&data, None);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("to their newest 2 turn checkpoints"),
            "{stdout}"
        );
        let after = restores(&data, &ids, &rt);
        for (cp, restored) in &after {
            assert_eq!(Some(restored), before.get(cp), "checkpoint {cp}");
        }
        let per_session: Vec<usize> = rt.block_on(async {
            let store = Store::open(data.join("keel.db"), Default::default()).unwrap();
            assert!(store.get_session(old).await.unwrap().is_none(), "purged");
            assert!(store.get_session(recent).await.unwrap().is_some(), "kept");
            let mut n = Vec::new();
            for id in &ids {
                n.push(store.list_checkpoints(*id).await.unwrap().len());
            }
            n
        });
        // a: 2 newest turns, the rollback, its target, the fork's source;
        // b: 2 newest turns and its fork checkpoint; c: 2 newest turns.
        assert_eq!(per_session, [5, 3, 2], "after kill at {kill_at}");
    }
}

#[test]
fn prune_reports_what_it_removed_and_a_second_run_removes_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    seed_all(&data, &rt);
    let first = prune(&data, None);
    assert!(first.status.success());
    let second = prune(&data, None);
    assert!(second.status.success());
    insta::assert_snapshot!(format!(
        "{}{}",
        String::from_utf8_lossy(&first.stdout),
        String::from_utf8_lossy(&second.stdout)
    ));
}

#[test]
fn prune_is_refused_while_a_keel_runs_on_the_directory() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let echo = dir.path().join("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let mut running = crate::keel()
        .args(["chat", "--chat", "gus", "--data-dir"])
        .arg(&data)
        .arg("--script")
        .arg(&echo)
        .env("KEEL_LOG", "error")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = running.stdin.take().unwrap();
    let mut lines = BufReader::new(running.stdout.take().unwrap()).lines();
    stdin.write_all(b"hello\n").unwrap();
    while !lines.next().unwrap().unwrap().contains("\"hello\"") {}

    let out = prune(&data, None);
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is in use by another keel process"), "{err}");
    drop(stdin);
    assert!(running.wait().unwrap().success());
}
