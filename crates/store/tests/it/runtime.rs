//! One process owns a database: the runtime lock refuses a second holder by
//! name, activation bumps the generation past every older one and recovers
//! in the same transaction, a superseded generation can write nothing, and a
//! turn commit refuses a history that moved since the turn started.

use keel_core::{ExecutionMode, RunStatus};
use keel_store::{AcceptRun, RuntimeLock, SessionHead, Store, StoreError, TurnCommit};

use crate::common::*;

#[test]
fn a_second_lock_holder_is_refused_with_the_first_ones_name() {
    let dir = tempfile::tempdir().unwrap();
    let db = db_path(&dir);
    let first = RuntimeLock::acquire(&db, "keel chat (pid 1 on alpha)").unwrap();
    assert!(first.path().ends_with("keel.db.lock"));
    let err = RuntimeLock::acquire(&db, "keel chat (pid 2 on beta)").unwrap_err();
    assert!(matches!(err, StoreError::InUse { .. }));
    let shown = err.to_string().replace(&db.display().to_string(), "<db>");
    insta::assert_snapshot!(shown, @"<db> is in use by another keel process (keel chat (pid 1 on alpha)); stop it first, or use another data directory");
    drop(first);
    // Released with the handle: the next process takes it and names itself.
    let second = RuntimeLock::acquire(&db, "keel chat (pid 3 on gamma)").unwrap();
    let err = RuntimeLock::acquire(&db, "x").unwrap_err();
    assert!(err.to_string().contains("pid 3 on gamma"), "{err}");
    drop(second);
}

/// Two paths to one database (here two directories whose keel.db link one
/// file, not created yet) take one lock, beside the real file.
#[cfg(unix)]
#[test]
fn paths_linking_one_database_share_its_lock() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real.db");
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for link in [&a, &b] {
        std::fs::create_dir(link).unwrap();
        std::os::unix::fs::symlink(&real, link.join("keel.db")).unwrap();
    }
    let first = RuntimeLock::acquire(&a.join("keel.db"), "keel serve (pid 1 on alpha)").unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    assert_eq!(first.path(), root.join("real.db.lock"));
    let err = RuntimeLock::acquire(&b.join("keel.db"), "keel serve (pid 2 on beta)").unwrap_err();
    assert!(matches!(err, StoreError::InUse { .. }), "{err}");
    let shown = err
        .to_string()
        .replace(&root.display().to_string(), "<dir>")
        .replace(&dir.path().display().to_string(), "<dir>");
    insta::assert_snapshot!(shown, @"<dir>/b/keel.db (the file <dir>/real.db) is in use by another keel process (keel serve (pid 1 on alpha)); stop it first, or use another data directory");
}

/// A database with a second name (a hard link, in another directory) is
/// refused through either name: each would get its own lock and its own
/// write-ahead log, so two processes could own one file and lose commits.
#[cfg(unix)]
#[test]
fn a_database_with_two_hard_links_is_refused_through_either() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a/keel.db");
    let b = dir.path().join("b/keel.db");
    std::fs::create_dir_all(a.parent().unwrap()).unwrap();
    std::fs::create_dir_all(b.parent().unwrap()).unwrap();
    drop(Store::open(&a, fast_options()).unwrap());
    std::fs::hard_link(&a, &b).unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    for name in [&a, &b] {
        let err = Store::open(name, fast_options()).unwrap_err();
        assert!(matches!(err, StoreError::Conflict(_)), "{err}");
        let shown = err
            .to_string()
            .replace(&root.display().to_string(), "<dir>");
        assert!(shown.contains("has 2 names (hard links)"), "{shown}");
    }
    let err = Store::open(&b, fast_options()).unwrap_err().to_string();
    insta::assert_snapshot!(err.replace(&root.display().to_string(), "<dir>"), @"conflict: <dir>/b/keel.db has 2 names (hard links); keel keeps its write-ahead log and lock beside a database's name, so each name would be another owner and another log: keep one name (`find / -samefile <dir>/b/keel.db` lists them) or copy the file");
    // With one name again, it opens.
    std::fs::remove_file(&b).unwrap();
    drop(Store::open(&a, fast_options()).unwrap());
}

#[tokio::test]
async fn activation_bumps_past_stamped_runs_and_recovers_them_in_one_step() {
    let (_dir, store) = temp_store();
    assert_eq!(store.runtime_generation().await.unwrap(), None);
    let root = keel_core::SessionId::new();
    // A run stamped by a build that used wall-clock generations.
    let mut old = new_run(root, ExecutionMode::Background);
    old.runtime_generation = 1_700_000_000_000;
    store
        .accept_run(AcceptRun {
            run: old.clone(),
            inbox_capacity: 10,
            now_ms: 1,
        })
        .await
        .unwrap();
    let first = store.activate_runtime("first".into(), 10).await.unwrap();
    assert_eq!(first.generation, 1_700_000_000_001);
    assert_eq!(first.previous_holder, None);
    assert_eq!(first.recovery.interrupted_runs, [old.id]);
    assert_eq!(first.recovery.sessions_with_inbox_work, [root]);
    let run = store.get_run(old.id).await.unwrap().unwrap();
    assert_eq!(run.status, RunStatus::Interrupted);
    let second = store.activate_runtime("second".into(), 20).await.unwrap();
    assert_eq!(second.generation, first.generation + 1);
    assert_eq!(second.previous_holder.as_deref(), Some("first"));
    assert_eq!(
        store.runtime_generation().await.unwrap(),
        Some((second.generation, "second".to_owned()))
    );
}

#[tokio::test]
async fn a_superseded_generation_writes_nothing() {
    let (dir, older) = temp_store();
    older.activate_runtime("older".into(), 1).await.unwrap();
    let session = older.create_session(new_session("a", 1)).await.unwrap();
    // A second process activates on the same file (its lock file was
    // deleted, say): from now on the first one is fenced off.
    let newer = Store::open(db_path(&dir), fast_options()).unwrap();
    let activation = newer.activate_runtime("newer".into(), 2).await.unwrap();
    let err = older
        .append_message(session.id, user("late"), 3)
        .await
        .unwrap_err();
    assert_eq!(
        err,
        StoreError::Fenced {
            ours: activation.generation - 1,
            current: activation.generation,
            holder: "newer".into()
        }
    );
    assert!(older
        .create_session(new_session("b", 3))
        .await
        .unwrap_err()
        .to_string()
        .contains("superseded by generation"));
    // The newer process writes; reads of the older still work.
    newer
        .append_message(session.id, user("fresh"), 4)
        .await
        .unwrap();
    assert_eq!(older.last_seq(session.id).await.unwrap(), 1);
}

fn turn(session: keel_core::SessionId, head: Option<SessionHead>) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![user("q"), assistant("a")],
        state: b"{}".to_vec(),
        checkpoint: None,
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: head,
        now_ms: 5,
    }
}

#[tokio::test]
async fn a_turn_commit_refuses_a_history_that_moved() {
    let (_dir, store) = temp_store();
    let session = store.create_session(new_session("a", 1)).await.unwrap();
    let head = |last_seq| SessionHead {
        timeline: session.head_timeline_id.clone(),
        last_seq,
    };
    store
        .commit_turn(turn(session.id, Some(head(0))))
        .await
        .unwrap();
    // A second writer that started from the same (empty) history loses.
    let err = store
        .commit_turn(turn(session.id, Some(head(0))))
        .await
        .unwrap_err();
    insta::assert_snapshot!(
        err.to_string().replace(&session.id.to_string(), "<session>"),
        @"conflict: session <session> changed since the turn started (its history ended at seq 0 and now ends at seq 2); the turn was not saved"
    );
    assert_eq!(store.last_seq(session.id).await.unwrap(), 2);
    store
        .commit_turn(turn(session.id, Some(head(2))))
        .await
        .unwrap();
    assert_eq!(store.last_seq(session.id).await.unwrap(), 4);
}

/// The lock says the earlier process is gone: its leases are released at
/// activation even before they expire, so its events are delivered again.
#[tokio::test]
async fn activation_releases_the_leases_of_the_process_before_it() {
    let (_dir, store) = temp_store();
    let root = store.create_session(new_session("a", 1)).await.unwrap().id;
    let run = new_run(root, ExecutionMode::Background);
    store
        .accept_run(AcceptRun {
            run: run.clone(),
            inbox_capacity: 10,
            now_ms: 1,
        })
        .await
        .unwrap();
    store
        .commit_terminal(
            run.id,
            run.execution_id.clone(),
            keel_store::TerminalOutcome::Failed {
                error: "x".into(),
                usage: None,
            },
            keel_store::CompletionHandling::Deliver,
            2,
        )
        .await
        .unwrap();
    let lease = store
        .claim_inbox_batch(keel_store::ClaimRequest {
            root_session_id: root,
            now_ms: 3,
            lease_ms: 3_600_000,
            max_events: 8,
            max_bytes: 1 << 20,
            delivery: None,
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease.events.len(), 1);
    let activation = store.activate_runtime("next".into(), 4).await.unwrap();
    assert_eq!(activation.recovery.leases_expired, 1);
    assert_eq!(activation.recovery.sessions_with_inbox_work, [root]);
    let events = store.list_inbox_events(root).await.unwrap();
    assert_eq!(events[0].status, keel_store::EventStatus::Pending);
}

/// A process killed while its turns waited for the model left their inputs
/// `open`; the next process's activation marks every one unanswered, in its
/// recovery transaction, before any turn of its own can start.
#[tokio::test]
async fn activation_closes_the_inputs_a_dead_process_left_open() {
    let (dir, store) = temp_store();
    store.activate_runtime("dead".into(), 1).await.unwrap();
    let mut sessions = Vec::new();
    for dialog in ["a", "b"] {
        let s = store.create_session(new_session(dialog, 1)).await.unwrap();
        store
            .open_turn(keel_store::OpenTurn {
                session_id: s.id,
                messages: vec![user("typed before the crash")],
                expected_head: None,
                queued: None,
                now_ms: 2,
            })
            .await
            .unwrap();
        sessions.push(s.id);
    }
    drop(store);
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let activation = store.activate_runtime("next".into(), 3).await.unwrap();
    assert_eq!(activation.recovery.unanswered_inputs, 2);
    for id in sessions {
        let messages = store.load_messages(id, Default::default()).await.unwrap();
        assert_eq!(messages.len(), 1, "the user's words survived");
        assert_eq!(
            messages[0].input_state,
            Some(keel_store::InputState::Unanswered)
        );
    }
    let again = store.activate_runtime("after".into(), 4).await.unwrap();
    assert_eq!(again.recovery.unanswered_inputs, 0);
}
