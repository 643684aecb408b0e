//! The relay between processes on one database (`LISTEN`/`NOTIFY`): what
//! one process publishes reaches the others in order and never itself; a
//! payload too long for a notification arrives as `Oversized`; a broken
//! listening connection is opened again and says `Lost`.

use std::time::Duration;

use keel_core::SessionId;
use keel_store::{Relayed, Store, RELAY_MAX_BYTES};
use keel_store_postgres::testing::TestDb;
use keel_store_postgres::{require_postgres, PgOptions, PgStore};
use tokio::sync::broadcast::Receiver;

async fn process(db: &TestDb, name: &str) -> Store {
    let options = PgOptions {
        max_connections: 4,
        ..PgOptions::default()
    };
    let (store, _) = PgStore::connect(&db.conninfo, options)
        .await
        .expect("connect");
    let store = Store::new(store);
    assert!(store.relay().is_none(), "no relay before activation");
    store
        .activate_runtime(name.into(), 1)
        .await
        .expect("activate");
    store
}

async fn next(receiver: &mut Receiver<Relayed>) -> Relayed {
    tokio::time::timeout(Duration::from_secs(30), receiver.recv())
        .await
        .expect("a message within 30 s")
        .expect("the relay is open")
}

fn message(session: SessionId, payload: &str) -> Relayed {
    Relayed::Message {
        session,
        payload: payload.to_owned(),
    }
}

#[tokio::test]
async fn a_message_reaches_the_other_process_in_order_and_not_its_sender() {
    let db = require_postgres!();
    let (a, b) = (process(&db, "a").await, process(&db, "b").await);
    let (relay_a, relay_b) = (a.relay().expect("ok"), b.relay().expect("ok"));
    let (mut at_a, mut at_b) = (relay_a.subscribe(), relay_b.subscribe());
    let session = SessionId::new();
    relay_a
        .publish(vec![(session, "one".into())])
        .await
        .expect("ok");
    relay_a
        .publish(vec![(session, "x".repeat(RELAY_MAX_BYTES + 1))])
        .await
        .expect("ok");
    let widest = "é".repeat(RELAY_MAX_BYTES / 2);
    relay_a
        .publish(vec![(session, widest.clone())])
        .await
        .expect("ok");
    assert_eq!(next(&mut at_b).await, message(session, "one"));
    assert_eq!(next(&mut at_b).await, Relayed::Oversized { session });
    assert_eq!(next(&mut at_b).await, message(session, &widest));
    // A batch goes out in order, each note once, repeated ones too.
    relay_a
        .publish(vec![
            (session, "same".into()),
            (session, "same".into()),
            (SessionId::new(), "last".into()),
        ])
        .await
        .expect("ok");
    assert_eq!(next(&mut at_b).await, message(session, "same"));
    assert_eq!(next(&mut at_b).await, message(session, "same"));
    assert!(matches!(next(&mut at_b).await, Relayed::Message { payload, .. } if payload == "last"));
    // A's listener saw its own first: the first it delivers is B's.
    let other = SessionId::new();
    relay_b
        .publish(vec![(other, "from b".into())])
        .await
        .expect("ok");
    assert_eq!(next(&mut at_a).await, message(other, "from b"));
    assert!(at_b.try_recv().is_err(), "B does not hear itself");
}

#[tokio::test]
async fn a_broken_listening_connection_is_opened_again_and_says_messages_were_lost() {
    let db = require_postgres!();
    let (a, b) = (process(&db, "a").await, process(&db, "b").await);
    let (relay_a, relay_b) = (a.relay().expect("ok"), b.relay().expect("ok"));
    let mut at_b = relay_b.subscribe();
    let admin = db.connect().await;
    let killed = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND query = 'LISTEN keel_frames'",
            &[],
        )
        .await
        .expect("ok");
    assert_eq!(killed.len(), 2, "each process listens on one connection");
    assert_eq!(next(&mut at_b).await, Relayed::Lost);
    // Listening again: what A sends now arrives.
    let session = SessionId::new();
    relay_a
        .publish(vec![(session, "after".into())])
        .await
        .expect("ok");
    assert_eq!(next(&mut at_b).await, message(session, "after"));
}
