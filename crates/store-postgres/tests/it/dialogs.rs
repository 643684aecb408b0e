//! A dialog's writes on PostgreSQL run at `READ COMMITTED` behind a lock on
//! the dialog's sessions row: one dialog's writes wait for each other,
//! other dialogs' never wait for them.

use std::time::{Duration, Instant};

use keel_store::conformance::fixtures::{new_session, turn, user};
use keel_store::{SessionHead, Store, StoreError};
use keel_store_postgres::testing::TestDb;
use keel_store_postgres::{require_postgres, PgOptions, PgStore};

/// A runtime on `db` with `connections` pooled connections.
async fn runtime(db: &TestDb, connections: usize) -> Store {
    let options = PgOptions {
        max_connections: connections,
        ..PgOptions::default()
    };
    let (store, _) = PgStore::connect(&db.conninfo, options)
        .await
        .expect("connect to the test database");
    let store = Store::new(store);
    store
        .activate_runtime("keel serve".into(), 1)
        .await
        .expect("activate");
    store
}

/// Waits until `n` backends of the server wait for a lock.
async fn until_waiting_for_locks(db: &TestDb, n: i64) {
    // Row locks are waited for on the holder's transaction id, which
    // pg_locks files under no database: the waiting session says it waits.
    let client = db.connect().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND datname = current_database()",
                &[],
            )
            .await
            .expect("read pg_locks")
            .get(0);
        if waiting >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no write waited for the dialog's lock"
        );
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_dialogs_write_waits_for_its_lock_while_other_dialogs_go_on() {
    let db = require_postgres!();
    let store = runtime(&db, 4).await;
    let held = store.create_session(new_session("held", 1)).await.unwrap();
    let other = store.create_session(new_session("other", 1)).await.unwrap();
    // Another transaction holds the first dialog's lock.
    let holder = db.connect().await;
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM sessions WHERE id = '{}' FOR NO KEY UPDATE",
            held.id
        ))
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let store = store.clone();
        async move { store.append_message(held.id, user("waits"), 2).await }
    });
    until_waiting_for_locks(&db, 1).await;
    // The other dialog's writes do not wait.
    assert_eq!(
        store
            .append_message(other.id, user("goes on"), 2)
            .await
            .unwrap(),
        1
    );
    assert!(
        !waiting.is_finished(),
        "the held dialog's write did not wait"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), 1);
}

#[tokio::test]
async fn concurrent_appends_to_one_dialog_each_get_the_next_seq() {
    let db = require_postgres!();
    let store = runtime(&db, 8).await;
    let session = store.create_session(new_session("d", 1)).await.unwrap();
    let writes: Vec<_> = (0..24)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .append_message(session.id, user(&format!("m{i}")), 2 + i)
                    .await
            })
        })
        .collect();
    let mut seqs = Vec::new();
    for write in writes {
        // At READ COMMITTED without the dialog's lock, two of these would
        // read the same last seq and one would fail on the primary key.
        seqs.push(write.await.unwrap().expect("an append is never refused"));
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=24).collect::<Vec<i64>>());
    assert_eq!(store.last_seq(session.id).await.unwrap(), 24);
}

#[tokio::test]
async fn a_write_given_up_mid_transaction_leaves_nothing_and_its_connection_is_not_reused() {
    let db = require_postgres!();
    // One pooled connection: a write after the abandoned one would get it
    // back, still inside the abandoned transaction, if the pool took it.
    let store = runtime(&db, 1).await;
    let session = store.create_session(new_session("d", 1)).await.unwrap();
    // Every message insert waits, once its row is written, for a lock
    // another connection holds.
    let holder = db.connect().await;
    holder
        .batch_execute(
            "CREATE FUNCTION wait_for_test() RETURNS trigger LANGUAGE plpgsql AS \
               'BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END'; \
             CREATE TRIGGER wait_for_test AFTER INSERT ON messages \
               FOR EACH ROW EXECUTE FUNCTION wait_for_test(); \
             BEGIN; SELECT pg_advisory_xact_lock(4242)",
        )
        .await
        .unwrap();
    let abandoned = tokio::spawn({
        let store = store.clone();
        async move { store.append_message(session.id, user("abandoned"), 2).await }
    });
    until_waiting_for_locks(&db, 1).await;
    abandoned.abort();
    assert!(abandoned.await.unwrap_err().is_cancelled());
    // The abandoned transaction's backend ends once its insert is through;
    // a transaction still open on a pooled connection would keep the
    // trigger from being dropped.
    holder
        .batch_execute("COMMIT; SET lock_timeout = '20s'; DROP TRIGGER wait_for_test ON messages")
        .await
        .expect("no transaction is left open on the abandoned connection");

    assert_eq!(
        store
            .append_message(session.id, user("kept"), 3)
            .await
            .expect("the next write gets a connection of its own"),
        1,
        "the abandoned message was never committed"
    );
    let texts: Vec<String> = store
        .load_messages(session.id, Default::default())
        .await
        .unwrap()
        .iter()
        .map(|m| m.message.text())
        .collect();
    assert_eq!(texts, ["kept"]);
}

#[tokio::test]
async fn turns_committing_at_once_from_one_head_save_one_and_refuse_the_rest() {
    let db = require_postgres!();
    let store = runtime(&db, 8).await;
    let session = store.create_session(new_session("d", 1)).await.unwrap();
    let head = SessionHead {
        timeline: session.head_timeline_id.clone(),
        last_seq: 0,
    };
    let commits: Vec<_> = (0..12)
        .map(|i| {
            let mut commit = turn(session.id, i, &format!("state {i}"), true);
            commit.expected_head = Some(head.clone());
            let store = store.clone();
            tokio::spawn(async move { store.commit_turn(commit).await })
        })
        .collect();
    let mut saved = 0;
    for commit in commits {
        match commit.await.unwrap() {
            Ok(committed) => {
                saved += 1;
                assert_eq!(committed.seqs, [1, 2]);
            }
            // The history's end is read once the dialog's lock is held: a
            // turn that waited sees the saved one and is refused, never
            // writing over its seqs.
            Err(e) => assert!(matches!(e, StoreError::Conflict(_)), "{e}"),
        }
    }
    assert_eq!(saved, 1);
    assert_eq!(store.last_seq(session.id).await.unwrap(), 2);
}
