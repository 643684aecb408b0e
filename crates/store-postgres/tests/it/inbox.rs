//! The inbox on PostgreSQL itself (what the conformance suite cannot reach
//! through the store): counts of events put in every state behind the
//! store's back.

use keel_store::conformance::fixtures::{add_completions, new_session, root_with_events};
use keel_store::{InboxCounts, Store};
use keel_store_postgres::{require_postgres, PgOptions, PgStore};

async fn store_on(db: &keel_store_postgres::testing::TestDb) -> Store {
    let (store, _) = PgStore::connect(&db.conninfo, PgOptions::default())
        .await
        .expect("connect to the test database");
    Store::new(store)
}

#[tokio::test]
async fn inbox_counts_group_events_by_delivery_state_of_one_dialog() {
    let db = require_postgres!();
    let store = store_on(&db).await;
    let fresh = store.create_session(new_session("fresh", 1)).await.unwrap();
    assert_eq!(
        store.inbox_counts(fresh.id).await.unwrap(),
        InboxCounts::default()
    );
    let (root, ids) = root_with_events(&store, 6).await;
    let other = store.create_session(new_session("other", 1)).await.unwrap();
    add_completions(&store, other.id, 0..2).await;
    let client = db.connect().await;
    for (id, status) in ids[1..].iter().zip([
        "leased",
        "admitted",
        "consumed",
        "dead_letter",
        "superseded",
    ]) {
        // A lease goes with the in-flight states only.
        let leased = matches!(status, "leased" | "admitted");
        client
            .execute(
                "UPDATE agent_inbox_events SET status = $1, \
                 lease_token = CASE WHEN $3 THEN 'lease' END, \
                 lease_until = CASE WHEN $3 THEN 5000::bigint END \
                 WHERE id = $2",
                &[&status, &id.to_string(), &leased],
            )
            .await
            .unwrap();
    }
    let revision = store.inbox_usage(root).await.unwrap().revision;
    assert!(revision > 0);
    assert_eq!(
        store.inbox_counts(root).await.unwrap(),
        InboxCounts {
            revision,
            pending: 3,
            delivered: 1,
            dead_lettered: 1,
            superseded: 1,
        }
    );
    assert_eq!(store.inbox_counts(other.id).await.unwrap().pending, 2);
}
