//! Spend on SQLite itself: a v9 database's runs, children and inbox events
//! survive the v11 rebuild of `agent_runs`, with foreign keys enforced
//! after it (the behaviour of spend is the conformance suite's).

use keel_core::SessionId;
use keel_store::testing::migrate_to;
use keel_store::Store;
use rusqlite::{params, Connection};

use crate::common::*;

#[tokio::test]
async fn runs_children_and_their_events_survive_the_v11_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let root = SessionId::new();
    let (parent, child) = (keel_core::RunId::new(), keel_core::RunId::new());
    {
        let mut conn = Connection::open(db_path(&dir)).unwrap();
        migrate_to(&mut conn, 9).unwrap();
        conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
        for (id, up, exec) in [(parent, None, "e1"), (child, Some(parent), "e2")] {
            conn.execute(
                "INSERT INTO agent_runs (id, root_session_id, parent_run_id, caller_agent_id, \
                 caller_scope_id, agent_id, definition_hash, provider_profile, provider_name, \
                 model_id, mode, depth, execution_id, task, budget_json, status, \
                 runtime_generation, deadline_at, revision, created_at, updated_at) \
                 VALUES (?1, ?2, ?3, 'root', 'scope', 'a', 'h', 'default', 'scripted', 'm', \
                 'background', 1, ?4, 'task', '{}', 'failed', 1, 100, 1, 17, 17)",
                params![
                    id.to_string(),
                    root.to_string(),
                    up.map(|r| r.to_string()),
                    exec
                ],
            )
            .unwrap();
        }
        conn.execute(
            "INSERT INTO agent_inbox_events (id, root_session_id, scope_kind, scope_id, run_id, \
             event_type, event_key, delivery, status, payload_json, revision, created_at) \
             VALUES ('ev', ?1, 'run', ?2, ?2, 'completion', 'completion', 'queue', \
             'pending', '{}', 1, 17)",
            params![root.to_string(), child.to_string()],
        )
        .unwrap();
    }
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let runs = store.list_runs(root, None, 10).await.unwrap();
    assert_eq!(runs.items.len(), 2);
    let stored_child = store.get_run(child).await.unwrap().unwrap();
    assert_eq!(stored_child.spec.parent_run_id, Some(parent));
    drop(store);
    let conn = Connection::open(db_path(&dir)).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    let events: i64 = conn
        .query_row(
            "SELECT count(*) FROM agent_inbox_events WHERE run_id = ?1",
            [child.to_string()],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(events, 1);
    // The new status is allowed, an unknown one still is not, and the
    // references still hold.
    conn.execute(
        "UPDATE agent_runs SET status = 'budget_exhausted' WHERE id = ?1",
        [parent.to_string()],
    )
    .unwrap();
    assert!(conn
        .execute(
            "UPDATE agent_runs SET status = 'spent' WHERE id = ?1",
            [parent.to_string()]
        )
        .is_err());
    assert!(conn
        .execute("DELETE FROM agent_runs WHERE id = ?1", [parent.to_string()])
        .is_err());
}
