//! Hot backup and restore: a consistent, checked copy taken while writers
//! commit, holding every turn acknowledged before it began; no overwrite;
//! a restore that replaces a database in one rename and keeps the old one.

use std::sync::{Arc, Condvar, Mutex};

use keel_core::{CheckpointId, Message, SessionId};
use keel_store::{
    backup_database, describe_process, restore_database, CheckOptions, CheckpointSource,
    MessageFilter, NewCheckpoint, NewMessage, RuntimeLock, Store, StoreError, TurnCommit,
};

use crate::common::*;

const WRITERS: usize = 8;
/// Turns each writer commits before the backup: about 1200 pages.
const PREFILL: u64 = 100;

fn turn(session: SessionId, n: u64, text: &str) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![
            NewMessage::new(Message::user(format!("q{n} {text}"))),
            NewMessage::new(Message::assistant(format!("a{n}"))),
        ],
        state: format!("{{\"turn\":{n}}}").into_bytes(),
        checkpoint: Some(NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: n,
            source: CheckpointSource::Turn,
        }),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 10,
    }
}

/// Turns acknowledged per writer, and a signal on every change.
#[derive(Default)]
struct Acks {
    counts: Mutex<Vec<u64>>,
    changed: Condvar,
}

impl Acks {
    fn snapshot(&self) -> Vec<u64> {
        self.counts.lock().unwrap().clone()
    }

    /// Blocks until every writer has acknowledged `more` turns past `from`.
    fn wait_past(&self, from: &[u64], more: u64) {
        let mut counts = self.counts.lock().unwrap();
        while counts
            .iter()
            .zip(from)
            .any(|(now, then)| *now < then + more)
        {
            counts = self.changed.wait(counts).unwrap();
        }
    }
}

/// `len` characters that do not compress (a linear congruential sequence).
fn incompressible(len: usize, seed: u64) -> String {
    let mut x = seed.wrapping_add(1);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b'a' + u8::try_from(x >> 59).unwrap())
        })
        .collect()
}

async fn history_len(store: &Store, session: SessionId) -> usize {
    store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap()
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backup_under_eight_writers_is_clean_and_holds_every_turn_acknowledged_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let mut sessions = Vec::new();
    for i in 0..WRITERS {
        let s = store
            .create_session(new_session(&format!("w{i}"), 1))
            .await
            .unwrap();
        // Enough to need many bounded steps (a step copies 256 pages).
        for n in 1..=PREFILL {
            // 5 bits of entropy per byte: ~6 KB a turn once compressed.
            let filler = incompressible(10_000, (i as u64) << 32 | n);
            store.commit_turn(turn(s.id, n, &filler)).await.unwrap();
        }
        sessions.push(s.id);
    }
    let acks = Arc::new(Acks {
        counts: Mutex::new(vec![PREFILL; WRITERS]),
        changed: Condvar::new(),
    });
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = sessions
        .iter()
        .enumerate()
        .map(|(i, &session)| {
            let (store, acks, stop) = (store.clone(), acks.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = PREFILL;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    n += 1;
                    store.commit_turn(turn(session, n, "live")).await.unwrap();
                    acks.counts.lock().unwrap()[i] = n;
                    acks.changed.notify_all();
                }
            })
        })
        .collect();

    let before = acks.snapshot();
    let dest = dir.path().join("copy.db");
    let (source, to, waiter, from) = (db_path(&dir), dest.clone(), acks.clone(), before.clone());
    let (report, steps, at_first_step) = tokio::task::spawn_blocking(move || {
        let (mut steps, mut at_first_step) = (0, Vec::new());
        let report = backup_database(&source, &to, &CheckOptions::default(), &mut |p| {
            steps += 1;
            assert!(p.copied_pages <= p.total_pages);
            // The writers keep committing while the copy holds its snapshot.
            if steps == 1 {
                at_first_step = waiter.snapshot();
                waiter.wait_past(&from, 3);
            }
        })
        .unwrap();
        (report, steps, at_first_step)
    })
    .await
    .unwrap();
    let after = acks.snapshot();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }

    assert!(report.check.is_clean(), "{:?}", report.check.findings);
    assert!(steps > 3, "copied in bounded steps, not one: {steps}");
    assert!(report.pages > 500 && report.bytes >= report.pages * 8192 / 2);
    let copy = Store::open(&dest, fast_options()).unwrap();
    for (i, &session) in sessions.iter().enumerate() {
        let held = history_len(&copy, session).await;
        let acked_before = usize::try_from(before[i]).unwrap() * 2;
        assert!(held >= acked_before, "writer {i}: {held} < {acked_before}");
        assert_eq!(held % 2, 0, "writer {i}: only whole turns");
        // One snapshot, taken before the first step: none of the turns
        // committed while the copy ran (each writer has at most one
        // commit acknowledged but not yet counted).
        let at_start = usize::try_from(at_first_step[i]).unwrap();
        assert!(
            held <= (at_start + 1) * 2,
            "writer {i}: {held} > {at_start} turns"
        );
        assert!(after[i] >= before[i] + 3);
    }
    let report = keel_store::check_database(&dest, &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dest).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".new-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn a_backup_refuses_an_existing_destination_and_a_source_that_is_not_keel() {
    let (dir, store) = temp_store();
    store.create_session(new_session("d", 1)).await.unwrap();
    let dest = dir.path().join("copy.db");
    std::fs::write(&dest, "mine").unwrap();
    let err =
        backup_database(&db_path(&dir), &dest, &CheckOptions::default(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err}");
    insta::assert_snapshot!(
        err.to_string().replace(&dir.path().display().to_string(), "<dir>"),
        @"conflict: <dir>/copy.db already exists; a backup never overwrites a file: name a new one"
    );
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), "mine");

    let foreign = dir.path().join("other.db");
    rusqlite::Connection::open(&foreign)
        .unwrap()
        .execute_batch("CREATE TABLE t(x)")
        .unwrap();
    let fresh = dir.path().join("fresh.db");
    let err = backup_database(&foreign, &fresh, &CheckOptions::default(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, StoreError::NotKeel(_)), "{err}");
    let missing = dir.path().join("missing.db");
    let err = backup_database(&missing, &fresh, &CheckOptions::default(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, StoreError::NotFound(_)), "{err}");
    assert!(!fresh.exists());
}

#[tokio::test]
async fn a_restore_replaces_the_database_in_place_and_keeps_the_one_it_replaced() {
    let source_dir = tempfile::tempdir().unwrap();
    let source = Store::open(db_path(&source_dir), fast_options()).unwrap();
    let kept = source.create_session(new_session("kept", 1)).await.unwrap();
    source
        .commit_turn(turn(kept.id, 1, "from the backup"))
        .await
        .unwrap();
    let backup = source_dir.path().join("backup.db");
    backup_database(
        &db_path(&source_dir),
        &backup,
        &CheckOptions::default(),
        &mut |_| {},
    )
    .unwrap();

    let (dir, target) = temp_store();
    let replaced = target.create_session(new_session("old", 1)).await.unwrap();
    drop(target);
    // A WAL left with commits (the files as a crash leaves them, copied
    // while a connection holds them) must not be applied to the restored
    // file, and its commits belong to the database kept aside.
    let raw = rusqlite::Connection::open(db_path(&dir)).unwrap();
    raw.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
    raw.execute("UPDATE sessions SET title = 'in the wal'", [])
        .unwrap();
    let crashed = tempfile::tempdir().unwrap();
    for name in ["keel.db", "keel.db-wal"] {
        std::fs::copy(dir.path().join(name), crashed.path().join(name)).unwrap();
    }
    drop(raw);
    let db = db_path(&crashed);
    assert!(
        std::fs::metadata(crashed.path().join("keel.db-wal"))
            .unwrap()
            .len()
            > 0
    );

    let lock = RuntimeLock::acquire(&db, &describe_process("test")).unwrap();
    let report =
        restore_database(&backup, &db, &lock, &CheckOptions::default(), &mut |_| {}).unwrap();
    drop(lock);
    assert!(report.copy.check.is_clean());
    let previous = report.previous.expect("the old database is kept");

    let restored = Store::open(&db, fast_options()).unwrap();
    assert_eq!(history_len(&restored, kept.id).await, 2);
    assert!(restored.get_session(replaced.id).await.unwrap().is_none());
    let old = Store::open(&previous, fast_options()).unwrap();
    let title = old.get_session(replaced.id).await.unwrap().unwrap().title;
    assert_eq!(
        title, "in the wal",
        "the replaced database kept its WAL's commits"
    );
}

#[tokio::test]
async fn a_restore_refuses_a_source_that_fails_the_check_and_leaves_the_target_alone() {
    let (dir, target) = temp_store();
    let mine = target.create_session(new_session("mine", 1)).await.unwrap();
    drop(target);
    let source_dir = tempfile::tempdir().unwrap();
    let broken = Store::open(db_path(&source_dir), fast_options()).unwrap();
    let s = broken.create_session(new_session("b", 1)).await.unwrap();
    broken.commit_turn(turn(s.id, 1, "x")).await.unwrap();
    drop(broken);
    rusqlite::Connection::open(db_path(&source_dir))
        .unwrap()
        .execute("DELETE FROM messages WHERE seq = 1", [])
        .unwrap();

    let db = db_path(&dir);
    let lock = RuntimeLock::acquire(&db, &describe_process("test")).unwrap();
    let err = restore_database(
        &db_path(&source_dir),
        &db,
        &lock,
        &CheckOptions::default(),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(err, StoreError::Corruption(_)), "{err}");
    assert!(err.to_string().contains("fails the check"), "{err}");
    drop(lock);
    let target = Store::open(&db, fast_options()).unwrap();
    assert!(target.get_session(mine.id).await.unwrap().is_some());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".new-") || n.contains("before-restore"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
}
