//! What only SQLite shows: a corrupt message row, and the pages retention
//! gives back (the rest of the history tests are in the conformance suite).

use keel_store::{MessageFilter, PrunePolicy, StoreError};
use rusqlite::Connection;

use crate::common::*;

#[tokio::test]
async fn corrupt_message_json_is_a_corruption_error() {
    let (dir, store) = temp_store();
    let s = store.create_session(new_session("d", 1)).await.unwrap();
    store.append_message(s.id, user("x"), 2).await.unwrap();
    let conn = Connection::open(db_path(&dir)).unwrap();
    conn.execute("UPDATE messages SET content = '{\"role\":\"wizard\"}'", [])
        .unwrap();
    let err = store
        .load_messages(s.id, MessageFilter::default())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Corruption(_)), "{err}");
}

#[tokio::test]
async fn retention_finds_sessions_over_the_limit_and_gives_pages_back() {
    let (dir, store) = temp_store();
    let busy = store.create_session(new_session("busy", 1)).await.unwrap();
    let quiet = store.create_session(new_session("quiet", 1)).await.unwrap();
    for n in 1..=40 {
        // A large, distinct state per turn that does not compress (32 KiB
        // of pseudo-random hex, ~16 KiB stored), so pruned checkpoints free
        // whole pages.
        let mut x: u64 = n;
        let state: String = (0..4096)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                format!("{:08x}", x >> 32)
            })
            .collect();
        store
            .commit_turn(turn(busy.id, n, &state, true))
            .await
            .unwrap();
    }
    store
        .commit_turn(turn(quiet.id, 1, "s", true))
        .await
        .unwrap();
    assert_eq!(
        store.sessions_over_turn_checkpoints(2).await.unwrap(),
        [busy.id]
    );
    assert!(store
        .sessions_over_turn_checkpoints(40)
        .await
        .unwrap()
        .is_empty());
    let conn = Connection::open(db_path(&dir)).unwrap();
    let mode: i64 = conn
        .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, 2, "a new database is incremental");
    let pages = |conn: &Connection| -> i64 {
        conn.query_row("PRAGMA page_count", [], |r| r.get(0))
            .unwrap()
    };
    let before = pages(&conn);
    let report = store
        .prune_checkpoints(
            busy.id,
            PrunePolicy {
                keep_latest: Some(2),
                older_than_ms: None,
            },
        )
        .await
        .unwrap();
    assert_eq!((report.checkpoints_deleted, report.blobs_deleted), (38, 38));
    // Bounded steps until nothing is left to give back.
    let mut reclaimed = store.reclaim_pages(16).await.unwrap();
    assert_eq!(reclaimed, 16, "one step gives back up to its bound");
    loop {
        let n = store.reclaim_pages(16).await.unwrap();
        assert!(n <= 16);
        if n == 0 {
            break;
        }
        reclaimed += n;
    }
    assert!(
        reclaimed > 38,
        "each ~16 KiB stored state held pages: {reclaimed}"
    );
    assert!(
        pages(&conn) <= before - i64::try_from(reclaimed).unwrap(),
        "the database shrank by what was reclaimed"
    );
    assert!(store
        .sessions_over_turn_checkpoints(2)
        .await
        .unwrap()
        .is_empty());
}
