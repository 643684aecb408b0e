//! The pool reaches the test server and hands out working connections.

use keel_store_postgres::{migrate, pool, require_postgres, schema_version, PgStoreError};

#[tokio::test]
async fn pooled_connections_migrate_and_read_the_same_database() {
    let db = require_postgres!();
    let pool = pool(&db.conninfo, 2).expect("a pool");
    let first = pool.get().await.expect("a connection");
    let report = migrate(&first).await.expect("migrate");
    assert_eq!(report.to, keel_store_postgres::SCHEMA_VERSION);
    let second = pool.get().await.expect("a second connection");
    assert_eq!(
        schema_version(&second).await.expect("version"),
        keel_store_postgres::SCHEMA_VERSION
    );
    assert_eq!(pool.status().size, 2);
}

#[test]
fn a_connection_string_that_cannot_parse_is_a_config_error() {
    let err = pool("host=/tmp port=notaport", 1).expect_err("bad port");
    assert!(matches!(err, PgStoreError::Config(_)), "{err:?}");
    insta::assert_snapshot!(err.to_string(), @"PostgreSQL configuration: invalid connection string: invalid value for option `port`");
}
