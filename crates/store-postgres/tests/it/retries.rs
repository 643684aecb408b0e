//! A transaction whose connection the server closed before `COMMIT` was
//! sent is run again on another connection; nothing of it was kept. A
//! one-statement read (no transaction around it) is retried the same way.

use keel_store::conformance::fixtures::new_session;
use keel_store::Store;
use keel_store_postgres::{require_postgres, PgOptions, PgStore};

/// A store with one pooled connection.
async fn one_connection(db: &keel_store_postgres::testing::TestDb) -> Store {
    let options = PgOptions {
        max_connections: 1,
        ..PgOptions::default()
    };
    let (store, _) = PgStore::connect(&db.conninfo, options)
        .await
        .expect("connect");
    Store::new(store)
}

/// The server ends every other backend of `db`: the pool's one idle
/// connection is dead, and the pool does not know it yet.
async fn drop_connections(db: &keel_store_postgres::testing::TestDb) {
    let admin = db.connect().await;
    let killed: i64 = admin
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()) t",
            &[],
        )
        .await
        .expect("terminate")
        .get(0);
    assert_eq!(killed, 1, "the pool held one connection");
}

#[tokio::test]
async fn a_one_statement_read_on_a_connection_the_server_dropped_is_retried() {
    let db = require_postgres!();
    let store = one_connection(&db).await;
    let session = store
        .create_session(new_session("d", 1))
        .await
        .expect("a first write opens the pooled connection");
    drop_connections(&db).await;
    assert_eq!(
        store
            .get_session(session.id)
            .await
            .expect("the read is retried on a fresh connection")
            .map(|s| s.id),
        Some(session.id)
    );
}

#[tokio::test]
async fn a_write_on_a_connection_the_server_dropped_is_retried_on_a_new_one() {
    let db = require_postgres!();
    let store = one_connection(&db).await;
    store
        .create_session(new_session("before", 1))
        .await
        .expect("a first write opens the pooled connection");
    drop_connections(&db).await;
    let after = store
        .create_session(new_session("after", 2))
        .await
        .expect("the write is retried on a fresh connection");
    assert_eq!(
        store
            .get_session(after.id)
            .await
            .expect("read")
            .map(|s| s.id),
        Some(after.id)
    );
    assert_eq!(
        store
            .list_dialogs(keel_store::DialogQuery {
                channel: "cli_chat".into(),
                chat_id: "chat-1".into(),
                include_deleted: false,
                limit: 10,
                cursor: None,
            })
            .await
            .expect("list")
            .items
            .len(),
        2,
        "each dialog once"
    );
}

#[tokio::test]
async fn a_one_statement_write_on_a_connection_the_server_dropped_is_retried() {
    let db = require_postgres!();
    let store = one_connection(&db).await;
    let session = store
        .create_session(new_session("d", 1))
        .await
        .expect("a first write opens the pooled connection");
    drop_connections(&db).await;
    let input = keel_store::QueuedInput {
        session_id: session.id,
        turn_id: keel_core::TurnId::new(),
        message: keel_core::Message::user("after"),
        queued_at_ms: 2,
        webhook: None,
    };
    store
        .queue_input(input)
        .await
        .expect("the write is retried on a fresh connection");
    let queued: i64 = db
        .connect()
        .await
        .query_one("SELECT count(*) FROM queued_inputs", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(queued, 1);
}
