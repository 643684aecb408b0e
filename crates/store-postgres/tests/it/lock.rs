//! The one-process lock on PostgreSQL: a second holder is refused with the
//! first one's name, and the lock is free again once the first is dropped.
//! The name is what PostgreSQL keeps of it (printable ASCII, 63 bytes).

use keel_store::StoreError;
use keel_store_postgres::{require_postgres, PgRuntimeLock};

#[tokio::test]
async fn a_second_process_is_refused_naming_the_holder_until_the_first_lets_go() {
    let db = require_postgres!();
    let first = PgRuntimeLock::acquire(&db.conninfo, "keel serve (pid 1 on a)")
        .await
        .expect("the first takes it");
    let err = PgRuntimeLock::acquire(&db.conninfo, "keel serve (pid 2 on b)")
        .await
        .expect_err("the second is refused");
    match &err {
        StoreError::InUse { holder, .. } => assert_eq!(holder, "keel serve (pid 1 on a)"),
        other => panic!("expected InUse, got {other}"),
    }
    drop(first);
    // The server frees it when the holder's connection ends; the drop only
    // starts that, so the next holder may have to ask more than once.
    let mut attempts = 0;
    let second = loop {
        attempts += 1;
        match PgRuntimeLock::acquire(&db.conninfo, "keel serve (pid 2 on b)").await {
            Ok(lock) => break lock,
            Err(StoreError::InUse { .. }) if attempts < 200 => tokio::task::yield_now().await,
            Err(e) => panic!("after {attempts} attempts: {e}"),
        }
    };
    drop(second);
}

#[tokio::test]
async fn a_holder_name_is_kept_as_printable_ascii_of_at_most_63_bytes() {
    let db = require_postgres!();
    let name = format!("keel serve (pid 7 on {})", "é".repeat(60));
    let _first = PgRuntimeLock::acquire(&db.conninfo, &name)
        .await
        .expect("taken");
    match PgRuntimeLock::acquire(&db.conninfo, "other").await {
        Err(StoreError::InUse { holder, .. }) => {
            assert_eq!(holder, format!("keel serve (pid 7 on {}", "?".repeat(42)));
        }
        other => panic!("expected InUse, got {other:?}"),
    }
}
