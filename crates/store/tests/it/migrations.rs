//! Schema tests: the current schema's snapshot, upgrades of fixtures at every older
//! version, failed-migration rollback, newer-version refusal, CHECK constraints.

use keel_core::{Message, SessionId};
use keel_store::testing::{migrate_to, migrate_with, user_version, MIGRATIONS};
use keel_store::{MessageFilter, Store, StoreError, SCHEMA_VERSION};
use rusqlite::{params, Connection};

use crate::common::*;

/// The line of a step that only PostgreSQL's schema needs.
const POSTGRES_ONLY: &str = "\n-- keel: no change on SQLite";

fn schema_text(conn: &Connection) -> String {
    let mut stmt = conn
        .prepare("SELECT type, name, sql FROM sqlite_master ORDER BY type, name")
        .unwrap();
    let rows = stmt
        .query_map([], |r| {
            Ok(format!(
                "{} {}\n{}\n",
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?.unwrap_or_default()
            ))
        })
        .unwrap();
    rows.map(|r| r.unwrap()).collect::<Vec<_>>().join("\n")
}

#[test]
fn fresh_database_gets_the_current_schema() {
    let (dir, store) = temp_store();
    drop(store);
    let conn = Connection::open(db_path(&dir)).unwrap();
    assert_eq!(user_version(&conn).unwrap(), SCHEMA_VERSION);
    insta::assert_snapshot!("schema", schema_text(&conn));
}

#[test]
fn every_step_is_a_real_step_and_applies_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut conn = Connection::open(db_path(&dir)).unwrap();
    let mut previous = schema_text(&conn);
    for k in 1..=SCHEMA_VERSION {
        assert_eq!(migrate_to(&mut conn, k).unwrap(), k - 1);
        assert_eq!(user_version(&conn).unwrap(), k);
        let now = schema_text(&conn);
        // A step only PostgreSQL's schema needs says so; every other one
        // changes something here too.
        let postgres_only = MIGRATIONS[k as usize - 1].contains(POSTGRES_ONLY);
        assert_eq!(now == previous, postgres_only, "migration {k}");
        previous = now;
    }
    // Re-running is a no-op.
    assert_eq!(
        migrate_to(&mut conn, SCHEMA_VERSION).unwrap(),
        SCHEMA_VERSION
    );
    assert_eq!(schema_text(&conn), previous);
}

fn message_json(text: &str) -> String {
    serde_json::to_string(&Message::user(text)).unwrap()
}

/// Writes a session with two messages (and what the version has beyond that) using that version's schema.
fn seed_fixture(conn: &Connection, version: u32, session: &SessionId) {
    let id = session.to_string();
    conn.execute(
        "INSERT INTO sessions (id, channel, chat_id, dialog_id, title, created_at, last_active_at, message_count) \
         VALUES (?1, 'cli_chat', 'chat-1', 'default', 'Old dialog', 10, 20, 2)",
        [&id],
    )
    .unwrap();
    if version >= 2 {
        conn.execute(
            "INSERT INTO state_blobs (hash, bytes) VALUES (?1, x'7b7d')",
            ["a".repeat(64)],
        )
        .unwrap();
        conn.execute(
            "UPDATE sessions SET state_hash = ?1, agent_id = 'root' WHERE id = ?2",
            params!["a".repeat(64), id],
        )
        .unwrap();
    }
    if version < 3 {
        for (seq, text) in [(1, "hello"), (2, "again")] {
            conn.execute(
                "INSERT INTO messages (session_id, seq, slot, role, content, created_at) \
                 VALUES (?1, ?2, 'default', 'user', ?3, 15)",
                params![id, seq, message_json(text)],
            )
            .unwrap();
        }
        return;
    }
    let timeline = "tl-root";
    conn.execute(
        "INSERT INTO timelines (id, session_id, created_at) VALUES (?1, ?2, 10)",
        params![timeline, id],
    )
    .unwrap();
    conn.execute(
        "UPDATE sessions SET head_timeline_id = ?1 WHERE id = ?2",
        params![timeline, id],
    )
    .unwrap();
    for (seq, text) in [(1, "hello"), (2, "again")] {
        conn.execute(
            "INSERT INTO messages (timeline_id, seq, session_id, slot, role, content, created_at) \
             VALUES (?1, ?2, ?3, 'default', 'user', ?4, 15)",
            params![timeline, seq, id, message_json(text)],
        )
        .unwrap();
    }
    conn.execute(
        "INSERT INTO checkpoints (id, session_id, timeline_id, seq, turn_index, state_hash, source, created_at) \
         VALUES (?1, ?2, ?3, 2, 1, ?4, 'turn', 16)",
        params![keel_core::CheckpointId::new().to_string(), id, timeline, "a".repeat(64)],
    )
    .unwrap();
    if version >= 5 {
        conn.execute(
            "INSERT INTO agent_runs (id, root_session_id, caller_agent_id, caller_scope_id, agent_id, \
             definition_hash, provider_profile, provider_name, model_id, mode, depth, execution_id, task, \
             budget_json, status, runtime_generation, deadline_at, revision, created_at, updated_at) \
             VALUES (?1, ?2, 'root', 'scope', 'researcher', 'h', 'default', 'scripted', 'm', \
             'foreground', 1, 'exec-1', 'task', '{}', 'completed', 1, 100, 1, 17, 17)",
            params![keel_core::RunId::new().to_string(), id],
        )
        .unwrap();
    }
}

#[tokio::test]
async fn fixtures_of_every_older_version_upgrade_with_rows_intact() {
    for version in 1..SCHEMA_VERSION {
        let dir = tempfile::tempdir().unwrap();
        let session = SessionId::new();
        {
            let mut conn = Connection::open(db_path(&dir)).unwrap();
            migrate_to(&mut conn, version).unwrap();
            seed_fixture(&conn, version, &session);
        }
        let store = Store::open(db_path(&dir), fast_options()).unwrap();
        let record = store.get_session(session).await.unwrap().unwrap();
        assert_eq!(record.title, "Old dialog", "v{version}");
        assert_eq!(record.message_count, 2, "v{version}");
        assert_eq!(record.last_active_at_ms, 20, "v{version}");
        let texts: Vec<String> = store
            .load_messages(session, MessageFilter::default())
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.message.text())
            .collect();
        assert_eq!(texts, ["hello", "again"], "v{version}");
        let loaded = store
            .load_messages(session, MessageFilter::default())
            .await
            .unwrap();
        assert!(
            loaded.iter().all(|m| m.input_state.is_none()),
            "old inputs committed with their answer: no marker (v{version})"
        );
        let visible = store
            .load_messages(
                session,
                MessageFilter {
                    visible_only: true,
                    ..MessageFilter::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(
            visible.len(),
            2,
            "old messages default to visible (v{version})"
        );
        if version >= 2 {
            assert_eq!(record.state_hash.as_deref(), Some("a".repeat(64).as_str()));
            assert_eq!(record.agent_id.as_ref().map(|a| a.as_str()), Some("root"));
        }
        if version >= 3 {
            let cps = store.list_checkpoints(session).await.unwrap();
            assert_eq!(cps.len(), 1, "v{version}");
            assert_eq!(cps[0].seq, 2);
        }
        if version >= 5 {
            let runs = store.list_runs(session, None, 10).await.unwrap();
            assert_eq!(runs.items.len(), 1);
        }
        // The upgraded session keeps working: appends continue after the old seqs.
        let seq = store
            .append_message(session, user("after upgrade"), 30)
            .await
            .unwrap();
        assert_eq!(seq, 3, "v{version}");
        drop(store);
        let conn = Connection::open(db_path(&dir)).unwrap();
        assert_eq!(user_version(&conn).unwrap(), SCHEMA_VERSION);
    }
}

#[test]
fn a_failing_migration_rolls_back_to_the_previous_version() {
    let dir = tempfile::tempdir().unwrap();
    let mut conn = Connection::open(db_path(&dir)).unwrap();
    migrate_to(&mut conn, 5).unwrap();
    let before = schema_text(&conn);
    let broken = "CREATE TABLE agent_session_state (root_session_id TEXT PRIMARY KEY);\n\
                  CREATE TABLE half_done (x INTEGER);\n\
                  INSERT INTO no_such_table VALUES (1);";
    let mut steps: Vec<&str> = MIGRATIONS[..5].to_vec();
    steps.push(broken);
    let err = migrate_with(&mut conn, &steps).unwrap_err();
    assert!(
        matches!(err, StoreError::Migration { version: 6, .. }),
        "{err}"
    );
    assert_eq!(user_version(&conn).unwrap(), 5);
    assert_eq!(
        schema_text(&conn),
        before,
        "no table of the failed step survives"
    );
    // The real step still applies afterwards.
    drop(conn);
    Store::open(db_path(&dir), fast_options()).unwrap();
}

#[test]
fn a_newer_database_is_refused_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    {
        let conn = Connection::open(db_path(&dir)).unwrap();
        // A newer keel's database: keel's application id ("keel"), a later version.
        conn.execute_batch(
            "CREATE TABLE future (x); PRAGMA user_version = 20; PRAGMA application_id = 1801807212;",
        )
        .unwrap();
    }
    let bytes_before = std::fs::read(db_path(&dir)).unwrap();
    let err = Store::open(db_path(&dir), fast_options()).unwrap_err();
    assert_eq!(
        err,
        StoreError::NewerSchema {
            found: 20,
            supported: 19
        }
    );
    insta::assert_snapshot!(err, @"database schema version 20 is newer than this build supports (19); refusing to open it");
    assert_eq!(std::fs::read(db_path(&dir)).unwrap(), bytes_before);
    assert!(!dir.path().join("keel.db-wal").exists());
}

/// Runs `insert` in a rolled-back transaction; returns SQLite's error if any.
fn try_insert(conn: &Connection, sql: &str) -> Result<(), String> {
    conn.execute_batch("SAVEPOINT t").unwrap();
    let r = conn.execute_batch(sql).map_err(|e| e.to_string());
    conn.execute_batch("ROLLBACK TO t; RELEASE t").unwrap();
    r
}

/// Asserts the base row inserts and that each (column, bad literal) makes a CHECK reject it.
fn check_table(conn: &Connection, table: &str, base: &[(&str, &str)], bad: &[(&str, &str)]) {
    let build = |over: Option<(&str, &str)>| {
        let cols: Vec<&str> = base.iter().map(|(c, _)| *c).collect();
        let vals: Vec<&str> = base
            .iter()
            .map(|(c, v)| match over {
                Some((oc, ov)) if oc == *c => ov,
                _ => v,
            })
            .collect();
        format!(
            "INSERT INTO {table} ({}) VALUES ({})",
            cols.join(", "),
            vals.join(", ")
        )
    };
    try_insert(conn, &build(None)).unwrap_or_else(|e| panic!("{table} base row: {e}"));
    for (col, val) in bad {
        let err = try_insert(conn, &build(Some((col, val))))
            .expect_err(&format!("{table}.{col} = {val} was accepted"));
        assert!(
            err.contains("CHECK constraint failed"),
            "{table}.{col} = {val}: {err}"
        );
    }
}

#[test]
fn every_check_constraint_rejects_a_bad_row() {
    let (dir, store) = temp_store();
    drop(store);
    let conn = Connection::open(db_path(&dir)).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    conn.execute_batch(&format!(
        "INSERT INTO sessions (id, channel, chat_id, dialog_id, title, created_at, last_active_at) \
           VALUES ('s1', 'c', 'k', 'd', 't', 1, 1);
         INSERT INTO timelines (id, session_id, created_at) VALUES ('t1', 's1', 1);
         INSERT INTO state_blobs (hash, bytes) VALUES ('{h}', x'00');
         INSERT INTO agent_run_groups (id, root_session_id, caller_scope_id, mode, completion_policy, \
           expected_runs, deadline_at, status, runtime_generation, revision, created_at, updated_at) \
           VALUES ('g1', 's1', 'sc', 'background', 'all', 2, 9, 'queued', 1, 1, 1, 1);
         INSERT INTO agent_runs (id, root_session_id, caller_agent_id, caller_scope_id, agent_id, \
           definition_hash, provider_profile, provider_name, model_id, mode, depth, execution_id, task, \
           budget_json, status, runtime_generation, deadline_at, revision, created_at, updated_at) \
           VALUES ('r1', 's1', 'root', 'sc', 'a', 'h', 'p', 'n', 'm', 'background', 1, 'e1', 't', '{{}}', \
           'running', 1, 9, 1, 1, 1);",
        h = "b".repeat(64)
    ))
    .unwrap();

    check_table(
        &conn,
        "sessions",
        &[
            ("id", "'s2'"),
            ("channel", "'c'"),
            ("chat_id", "'k'"),
            ("dialog_id", "'d2'"),
            ("title", "'t'"),
            ("created_at", "1"),
            ("last_active_at", "1"),
            ("message_count", "0"),
        ],
        &[
            ("channel", "''"),
            ("chat_id", "''"),
            ("dialog_id", "''"),
            ("message_count", "-1"),
        ],
    );
    check_table(
        &conn,
        "messages",
        &[
            ("timeline_id", "'t1'"),
            ("seq", "1"),
            ("session_id", "'s1'"),
            ("slot", "'default'"),
            ("role", "'user'"),
            ("content", "'{}'"),
            ("created_at", "1"),
            ("client_visibility", "'hidden'"),
            ("turn_origin", "'agent_continuation'"),
            ("input_state", "'open'"),
        ],
        &[
            ("seq", "0"),
            ("slot", "''"),
            ("role", "'robot'"),
            ("client_visibility", "'secret'"),
            ("turn_origin", "'cron'"),
            ("input_state", "'maybe'"),
        ],
    );
    check_table(
        &conn,
        "timelines",
        &[
            ("id", "'t2'"),
            ("session_id", "'s1'"),
            ("parent_timeline_id", "'t1'"),
            ("fork_seq", "0"),
            ("created_at", "1"),
        ],
        &[("fork_seq", "NULL"), ("fork_seq", "-1")],
    );
    check_table(
        &conn,
        "state_blobs",
        &[
            ("hash", &format!("'{}'", "c".repeat(64))),
            ("bytes", "x'00'"),
        ],
        &[("hash", "'short'")],
    );
    let h = format!("'{}'", "b".repeat(64));
    check_table(
        &conn,
        "checkpoints",
        &[
            ("id", "'c1'"),
            ("session_id", "'s1'"),
            ("timeline_id", "'t1'"),
            ("seq", "0"),
            ("turn_index", "0"),
            ("state_hash", &h),
            ("source", "'manual'"),
            ("created_at", "1"),
        ],
        &[("seq", "-1"), ("turn_index", "-1"), ("source", "'magic'")],
    );
    check_table(
        &conn,
        "agent_session_state",
        &[
            ("root_session_id", "'s1'"),
            ("revision", "0"),
            ("pending_event_count", "0"),
            ("reserved_completion_slots", "0"),
            ("updated_at", "1"),
        ],
        &[
            ("revision", "-1"),
            ("pending_event_count", "-1"),
            ("reserved_completion_slots", "-1"),
        ],
    );
    check_table(
        &conn,
        "agent_run_groups",
        &[
            ("id", "'g2'"),
            ("root_session_id", "'s1'"),
            ("caller_scope_id", "'sc'"),
            ("mode", "'foreground'"),
            ("completion_policy", "'each'"),
            ("expected_runs", "2"),
            ("terminal_runs", "1"),
            ("abnormal_runs", "1"),
            ("completion_slot_reserved", "1"),
            ("completion_delivery", "'queue'"),
            ("failure_delivery", "'steer'"),
            ("deadline_at", "9"),
            ("status", "'running'"),
            ("runtime_generation", "1"),
            ("revision", "1"),
            ("created_at", "1"),
            ("updated_at", "1"),
        ],
        &[
            ("mode", "'sideways'"),
            ("completion_policy", "'some'"),
            ("status", "'finished'"),
            ("expected_runs", "0"),
            ("terminal_runs", "3"),
            ("terminal_runs", "-1"),
            ("abnormal_runs", "2"),
            ("completion_slot_reserved", "2"),
            ("completion_delivery", "'mail'"),
            ("failure_delivery", "'mail'"),
        ],
    );
    check_table(
        &conn,
        "agent_runs",
        &[
            ("id", "'r2'"),
            ("group_id", "'g1'"),
            ("root_session_id", "'s1'"),
            ("parent_run_id", "'r1'"),
            ("caller_agent_id", "'root'"),
            ("caller_scope_id", "'sc'"),
            ("agent_id", "'a'"),
            ("definition_hash", "'h'"),
            ("provider_profile", "'p'"),
            ("provider_name", "'n'"),
            ("model_id", "'m'"),
            ("mode", "'foreground'"),
            ("depth", "2"),
            ("execution_id", "'e2'"),
            ("task", "'t'"),
            ("budget_json", "'{}'"),
            ("signal_delivery", "'steer'"),
            ("completion_delivery", "'queue'"),
            ("failure_delivery", "'queue'"),
            ("status", "'waiting_children'"),
            ("runtime_generation", "1"),
            ("completion_slot_reserved", "0"),
            ("deadline_at", "9"),
            ("revision", "1"),
            ("created_at", "1"),
            ("updated_at", "1"),
        ],
        &[
            ("mode", "'sideways'"),
            ("status", "'finished'"),
            ("depth", "0"),
            ("completion_slot_reserved", "2"),
            ("signal_delivery", "'mail'"),
            ("completion_delivery", "'mail'"),
            ("failure_delivery", "'mail'"),
        ],
    );
    check_table(
        &conn,
        "agent_inbox_events",
        &[
            ("id", "'e1'"),
            ("root_session_id", "'s1'"),
            ("scope_kind", "'run'"),
            ("scope_id", "'r1'"),
            ("run_id", "'r1'"),
            ("group_id", "NULL"),
            ("event_type", "'signal'"),
            ("event_key", "'k'"),
            ("delivery", "'queue'"),
            ("requires_continuation", "1"),
            ("payload_json", "'{}'"),
            ("status", "'leased'"),
            ("lease_token", "'tok'"),
            ("lease_until", "5"),
            ("attempt_count", "0"),
            ("revision", "1"),
            ("created_at", "1"),
        ],
        &[
            ("scope_kind", "'group'"),
            ("scope_kind", "'tree'"),
            ("scope_id", "'r9'"),
            ("group_id", "'g1'"),
            ("event_type", "'gossip'"),
            ("delivery", "'mail'"),
            ("requires_continuation", "2"),
            ("status", "'lost'"),
            ("lease_token", "NULL"),
            ("lease_until", "NULL"),
            ("attempt_count", "-1"),
        ],
    );
}

/// Storage class and codec of what a v14 store wrote (raw SQL: what readers cannot see).
fn stored_forms(conn: &Connection, session: &SessionId, seq: i64, hash: &str) -> (String, i64) {
    let class: String = conn
        .query_row(
            "SELECT typeof(content) FROM messages WHERE session_id = ?1 AND seq = ?2",
            params![session.to_string(), seq],
            |r| r.get(0),
        )
        .unwrap();
    let codec: i64 = conn
        .query_row(
            "SELECT codec FROM state_blobs WHERE hash = ?1",
            [hash],
            |r| r.get(0),
        )
        .unwrap();
    (class, codec)
}

/// A v13 database (before state blobs could be compressed) holding long
/// rows stored as text / raw bytes: a message at seq 3, a run's result and
/// the state blob `"b" * 64`. Returns (long text, the state's bytes, its hash).
fn seed_uncompressed_v13(dir: &tempfile::TempDir, session: &SessionId) -> (String, String, String) {
    let long = "keel keeps every message durable and reads old rows as they were. ".repeat(40);
    let old_state = format!(r#"{{"memory":"{}"}}"#, "remember this. ".repeat(40));
    let old_hash = "b".repeat(64);
    let mut conn = Connection::open(db_path(dir)).unwrap();
    migrate_to(&mut conn, 13).unwrap();
    seed_fixture(&conn, 13, session);
    conn.execute(
        "INSERT INTO messages (timeline_id, seq, session_id, slot, role, content, created_at) \
         VALUES ('tl-root', 3, ?1, 'default', 'user', ?2, 15)",
        params![session.to_string(), message_json(&long)],
    )
    .unwrap();
    conn.execute(
        "UPDATE sessions SET message_count = 3 WHERE id = ?1",
        [session.to_string()],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO state_blobs (hash, bytes) VALUES (?1, ?2)",
        params![old_hash, old_state.as_bytes()],
    )
    .unwrap();
    conn.execute(
        "UPDATE agent_runs SET result = ?1 WHERE root_session_id = ?2",
        params![long, session.to_string()],
    )
    .unwrap();
    (long, old_state, old_hash)
}

/// The long rows [`seed_uncompressed_v13`] wrote, as the store reads them.
async fn read_long_rows(
    store: &Store,
    session: SessionId,
    hash: &str,
) -> (Vec<String>, Option<Vec<u8>>, Option<String>) {
    let texts = store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.message.text())
        .collect();
    let state = store.get_state_blob(hash.to_owned()).await.unwrap();
    let runs = store.list_runs(session, None, 10).await.unwrap();
    (texts, state, runs.items[0].result.clone())
}

#[tokio::test]
async fn compact_storage_compresses_old_rows_in_batches_and_they_read_identically() {
    let dir = tempfile::tempdir().unwrap();
    let session = SessionId::new();
    let (long, state, hash) = seed_uncompressed_v13(&dir, &session);
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let before = read_long_rows(&store, session, &hash).await;
    assert_eq!(before.0[2], long);
    drop(store);
    let lock = keel_store::RuntimeLock::acquire(&db_path(&dir), "test").unwrap();
    // A batch of one row: every batch is its own transaction.
    let report = keel_store::compact_database(&db_path(&dir), &lock, 1).unwrap();
    assert_eq!(
        (report.messages, report.run_results, report.state_blobs),
        (1, 1, 1),
        "the short rows stay as they are: {report:?}"
    );
    assert_eq!(report.page_size_after, 8192);
    drop(lock);
    {
        let conn = Connection::open(db_path(&dir)).unwrap();
        assert_eq!(
            stored_forms(&conn, &session, 3, &hash),
            ("blob".to_owned(), 1)
        );
        let mode: String = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
    }
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    assert_eq!(read_long_rows(&store, session, &hash).await, before);
    assert_eq!(before.1, Some(state.into_bytes()));
    // A second run finds nothing left to compress.
    drop(store);
    let lock = keel_store::RuntimeLock::acquire(&db_path(&dir), "test").unwrap();
    let again = keel_store::compact_database(&db_path(&dir), &lock, 1).unwrap();
    assert_eq!(
        (again.messages, again.run_results, again.state_blobs),
        (0, 0, 0)
    );
}

#[tokio::test]
async fn an_uncompressed_v13_database_upgrades_without_a_rewrite_and_reads_identically() {
    let dir = tempfile::tempdir().unwrap();
    let session = SessionId::new();
    let (long, old_state, old_hash) = seed_uncompressed_v13(&dir, &session);
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let texts: Vec<String> = store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.message.text())
        .collect();
    assert_eq!(texts, ["hello", "again", long.as_str()]);
    assert_eq!(
        store.get_state_blob(old_hash.clone()).await.unwrap(),
        Some(old_state.clone().into_bytes())
    );
    let runs = store.list_runs(session, None, 10).await.unwrap();
    assert_eq!(runs.items[0].result.as_deref(), Some(long.as_str()));
    {
        let conn = Connection::open(db_path(&dir)).unwrap();
        assert_eq!(
            stored_forms(&conn, &session, 3, &old_hash),
            ("text".to_owned(), 0),
            "nothing is rewritten on upgrade"
        );
    }

    // What the upgraded store writes is compressed and reads back the same.
    let turn = keel_store::TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![user(&long)],
        state: old_state.replace("remember", "recall").into_bytes(),
        checkpoint: None,
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 40,
    };
    let new_state = turn.state.clone();
    let committed = store.commit_turn(turn).await.unwrap();
    assert_eq!(committed.seqs, [4]);
    let loaded = store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(loaded[3].message.text(), long);
    assert_eq!(
        store
            .get_state_blob(committed.state_hash.clone())
            .await
            .unwrap(),
        Some(new_state)
    );
    let conn = Connection::open(db_path(&dir)).unwrap();
    assert_eq!(
        stored_forms(&conn, &session, 4, &committed.state_hash),
        ("blob".to_owned(), 1)
    );

    // A compressed state whose frame is damaged is corruption, never other bytes.
    conn.execute(
        "UPDATE state_blobs SET bytes = substr(bytes, 1, length(bytes) - 5) WHERE hash = ?1",
        [&committed.state_hash],
    )
    .unwrap();
    let err = store
        .get_state_blob(committed.state_hash.clone())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Corruption { .. }), "{err}");
    drop((conn, store));
    let report =
        keel_store::check_database(&db_path(&dir), &keel_store::CheckOptions::default()).unwrap();
    let details: Vec<&str> = report.findings.iter().map(|f| f.detail.as_str()).collect();
    assert!(
        details
            .iter()
            .any(|d| d.contains("current state does not restore") && d.contains("compressed")),
        "the checker names the damaged frame: {details:?}"
    );
}
