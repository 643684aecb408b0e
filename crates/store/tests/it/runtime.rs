//! One process owns a SQLite database: the runtime lock (a file beside it)
//! refuses a second holder by name, through every path to the file. The
//! generation and recovery tests are in the conformance suite (`runtime`).

use keel_store::{RuntimeLock, Store, StoreError};

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
