//! The PostgreSQL schema against keel-store's SQLite schema, and the
//! migrations' bookkeeping, on a real server (see `keel_store_postgres::testing`).

use keel_store_postgres::{
    migrate, migrate_with, require_postgres, schema_definitions, schema_outline, schema_version,
    PgStoreError, MIGRATIONS, SCHEMA_VERSION,
};

/// The outline of a fresh SQLite store, migrated by keel-store itself.
async fn sqlite_outline() -> Vec<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("keel.db");
    let store = keel_store::Store::open(&path, keel_store::StoreOptions::default())
        .expect("open a SQLite store");
    drop(store);
    keel_store::testing::schema_outline(&path).expect("the SQLite outline")
}

#[tokio::test]
async fn the_postgres_schema_matches_sqlite_table_by_table() {
    let db = require_postgres!();
    let client = db.connect().await;
    migrate(&client).await.expect("migrate");
    let pg = schema_outline(&client)
        .await
        .expect("the PostgreSQL outline");
    let sqlite = sqlite_outline().await;
    assert_eq!(keel_store::SCHEMA_VERSION, SCHEMA_VERSION);
    let only_pg: Vec<_> = pg.iter().filter(|l| !sqlite.contains(l)).collect();
    let only_sqlite: Vec<_> = sqlite.iter().filter(|l| !pg.contains(l)).collect();
    assert!(
        only_pg.is_empty() && only_sqlite.is_empty(),
        "only on PostgreSQL: {only_pg:#?}\nonly on SQLite: {only_sqlite:#?}"
    );
    insta::assert_snapshot!("outline", pg.join("\n"));
    let defs = schema_definitions(&client).await.expect("definitions");
    insta::assert_snapshot!("definitions", defs.join("\n"));
}

#[tokio::test]
async fn migrating_twice_applies_nothing_the_second_time() {
    let db = require_postgres!();
    let client = db.connect().await;
    let first = migrate(&client).await.expect("first migrate");
    assert_eq!(first.from, 0);
    assert_eq!(first.applied, (1..=SCHEMA_VERSION).collect::<Vec<_>>());
    assert_eq!(first.to, SCHEMA_VERSION);
    let second = migrate(&client).await.expect("second migrate");
    assert_eq!(second.from, SCHEMA_VERSION);
    assert!(second.applied.is_empty(), "{second:?}");
    assert_eq!(second.to, SCHEMA_VERSION);
}

#[tokio::test]
async fn a_partial_migration_continues_where_it_stopped() {
    let db = require_postgres!();
    let client = db.connect().await;
    let r = migrate_with(&client, &MIGRATIONS[..7])
        .await
        .expect("to v7");
    assert_eq!(r.applied, (1..=7).collect::<Vec<_>>());
    assert_eq!(schema_version(&client).await.expect("version"), 7);
    let r = migrate(&client).await.expect("to the end");
    assert_eq!(
        (r.from, r.applied.first(), r.to),
        (7, Some(&8), SCHEMA_VERSION)
    );
}

#[tokio::test]
async fn a_newer_database_is_refused_untouched() {
    let db = require_postgres!();
    let client = db.connect().await;
    migrate(&client).await.expect("migrate");
    client
        .batch_execute("UPDATE schema_version SET version = 20")
        .await
        .expect("pretend a newer keel migrated");
    let err = migrate(&client).await.expect_err("a newer schema");
    assert!(
        matches!(
            err,
            PgStoreError::NewerSchema {
                found: 20,
                supported: 19
            }
        ),
        "{err:?}"
    );
    insta::assert_snapshot!(err.to_string(), @"the database is at schema version 20, newer than this keel's 19; upgrade keel");
    assert_eq!(schema_version(&client).await.expect("version"), 20);
}

#[tokio::test]
async fn a_failing_step_is_rolled_back_and_reported_with_its_version() {
    let db = require_postgres!();
    let client = db.connect().await;
    let steps = [MIGRATIONS[0], "CREATE TABLE t2 (x BIGINT); SELECT 1/0;"];
    let err = migrate_with(&client, &steps)
        .await
        .expect_err("division by zero");
    assert!(
        matches!(&err, PgStoreError::Migration { version: 2, message } if message == "division by zero"),
        "{err:?}"
    );
    assert_eq!(schema_version(&client).await.expect("version"), 1);
    let t2: bool = client
        .query_one("SELECT to_regclass('t2') IS NOT NULL", &[])
        .await
        .expect("query")
        .get(0);
    assert!(!t2, "the failed step's table was rolled back");
}

#[tokio::test]
async fn two_migrators_at_once_apply_each_step_exactly_once() {
    let db = require_postgres!();
    let (a, b) = (db.connect().await, db.connect().await);
    let (ra, rb) = tokio::join!(migrate(&a), migrate(&b));
    let (ra, rb) = (ra.expect("first migrator"), rb.expect("second migrator"));
    let mut applied: Vec<u32> = ra.applied.iter().chain(&rb.applied).copied().collect();
    applied.sort_unstable();
    assert_eq!(
        applied,
        (1..=SCHEMA_VERSION).collect::<Vec<_>>(),
        "{ra:?} {rb:?}"
    );
    assert_eq!((ra.to, rb.to), (SCHEMA_VERSION, SCHEMA_VERSION));
}
