//! The CHECK constraints of keel-store's schema hold on PostgreSQL too:
//! one valid row per table goes in, then each bad value is refused with
//! SQLSTATE 23514 (check_violation), and the values later steps allowed
//! (the wider agent_runs status of v11 and v13) are accepted.

use keel_store_postgres::tokio_postgres::error::SqlState;
use keel_store_postgres::tokio_postgres::Client;
use keel_store_postgres::{migrate, require_postgres};

const ROWS: &str = "
INSERT INTO sessions (id, channel, chat_id, dialog_id, title, created_at, last_active_at)
    VALUES ('s1', 'web', 'c', 'd', 't', 0, 0);
INSERT INTO timelines (id, session_id, created_at) VALUES ('s1', 's1', 0);
INSERT INTO messages (timeline_id, seq, session_id, role, content, created_at)
    VALUES ('s1', 1, 's1', 'user', 'hi', 0);
INSERT INTO state_blobs (hash, bytes) VALUES (repeat('a', 64), '\\x00');
INSERT INTO checkpoints (id, session_id, timeline_id, seq, turn_index, state_hash, source, created_at)
    VALUES ('k1', 's1', 's1', 0, 0, repeat('a', 64), 'turn', 0);
INSERT INTO agent_run_groups (id, root_session_id, caller_scope_id, mode, completion_policy,
        expected_runs, deadline_at, status, runtime_generation, revision, created_at, updated_at)
    VALUES ('g1', 's1', 'scope', 'background', 'all', 1, 0, 'running', 1, 0, 0, 0);
INSERT INTO agent_runs (id, root_session_id, caller_agent_id, caller_scope_id, agent_id,
        definition_hash, provider_profile, provider_name, model_id, mode, depth, execution_id,
        task, budget_json, status, runtime_generation, deadline_at, revision, created_at, updated_at)
    VALUES ('r1', 's1', 'a', 'scope', 'a', 'h', 'p', 'p', 'm', 'background', 1, 'e1',
        'task', '{}', 'running', 1, 0, 0, 0, 0);
INSERT INTO agent_inbox_events (id, root_session_id, scope_kind, scope_id, run_id, event_type,
        event_key, delivery, payload_json, status, revision, created_at)
    VALUES ('i1', 's1', 'run', 'r1', 'r1', 'completion', 'k', 'queue', '{}', 'pending', 0, 0);
INSERT INTO tool_approvals (id, session_id, turn_id, agent_id, tool_call_id, tool_name,
        arguments, status, revision, created_at, expires_at)
    VALUES ('ap1', 's1', 't1', 'a', 'call1', 'shell', '{}', 'pending', 0, 0, 1);
INSERT INTO call_spans (session_id, turn_id, seq, kind, name, started_at, ended_at, status)
    VALUES ('s1', 't1', 0, 'model', 'p/m', 0, 1, 'ok');
INSERT INTO mcp_manifests (server, hash, manifest, committed_at)
    VALUES ('fs', repeat('b', 64), '{\"tools\": []}', 0);
";

/// Each update sets one bad value on the one row of its table.
const BAD: &[&str] = &[
    "UPDATE sessions SET channel = ''",
    "UPDATE sessions SET message_count = -1",
    "UPDATE messages SET role = 'robot'",
    "UPDATE messages SET client_visibility = 'shown'",
    "UPDATE messages SET turn_origin = 'bot'",
    "UPDATE messages SET input_state = 'closed'",
    "UPDATE messages SET seq = 0",
    "UPDATE timelines SET fork_seq = 3",
    "UPDATE state_blobs SET codec = 2",
    "UPDATE state_blobs SET hash = 'short'",
    "UPDATE checkpoints SET source = 'auto'",
    "UPDATE agent_run_groups SET status = 'done'",
    "UPDATE agent_run_groups SET mode = 'both'",
    "UPDATE agent_run_groups SET completion_policy = 'some'",
    "UPDATE agent_run_groups SET terminal_runs = 2",
    "UPDATE agent_runs SET status = 'done'",
    "UPDATE agent_runs SET mode = 'sideways'",
    "UPDATE agent_runs SET depth = 0",
    "UPDATE agent_runs SET completion_slot_reserved = 2",
    "UPDATE agent_runs SET completion_delivery = 'mail'",
    "UPDATE agent_inbox_events SET status = 'gone'",
    "UPDATE agent_inbox_events SET event_type = 'ping'",
    "UPDATE agent_inbox_events SET delivery = 'mail'",
    "UPDATE agent_inbox_events SET scope_kind = 'group'",
    "UPDATE agent_inbox_events SET status = 'leased'",
    "UPDATE tool_approvals SET status = 'maybe'",
    "UPDATE tool_approvals SET decided_at = 5",
    "UPDATE tool_approvals SET executing_at = 5",
    "UPDATE call_spans SET kind = 'db'",
    "UPDATE call_spans SET run_id = 'r1'",
    "UPDATE call_spans SET ended_at = -1",
    "UPDATE mcp_manifests SET manifest = '{not json'",
    "UPDATE mcp_manifests SET server = ''",
    "INSERT INTO runtime_state (id, generation, holder, activated_at) VALUES (2, 1, 'h', 0)",
    "INSERT INTO zstd_dictionaries (id, bytes, created_at) VALUES (4294967296, '\\x00', 0)",
];

async fn seeded(client: &Client) {
    migrate(client).await.expect("migrate");
    client
        .batch_execute(ROWS)
        .await
        .expect("the valid rows go in");
}

#[tokio::test]
async fn every_bad_enum_or_range_value_is_a_check_violation() {
    let db = require_postgres!();
    let client = db.connect().await;
    seeded(&client).await;
    let mut accepted = Vec::new();
    for sql in BAD {
        match client.batch_execute(sql).await {
            Ok(()) => accepted.push(*sql),
            Err(e) => assert_eq!(e.code(), Some(&SqlState::CHECK_VIOLATION), "{sql}: {e}"),
        }
    }
    assert!(accepted.is_empty(), "accepted: {accepted:#?}");
}

#[tokio::test]
async fn the_statuses_later_steps_added_are_accepted() {
    let db = require_postgres!();
    let client = db.connect().await;
    seeded(&client).await;
    for status in ["budget_exhausted", "waiting_approval", "waiting_children"] {
        client
            .execute("UPDATE agent_runs SET status = $1", &[&status])
            .await
            .unwrap_or_else(|e| panic!("{status}: {e}"));
    }
    // A run's approval may repeat a root turn's call id (unique per turn and run).
    client
        .batch_execute(
            "INSERT INTO tool_approvals (id, session_id, turn_id, run_id, agent_id, tool_call_id, \
                 tool_name, arguments, status, revision, created_at, expires_at) \
             VALUES ('ap2', 's1', 't1', 'r1', 'a', 'call1', 'shell', '{}', 'pending', 0, 0, 1)",
        )
        .await
        .expect("same call id, other run");
    let dup = client
        .batch_execute(
            "INSERT INTO tool_approvals (id, session_id, turn_id, agent_id, tool_call_id, \
                 tool_name, arguments, status, revision, created_at, expires_at) \
             VALUES ('ap3', 's1', 't1', 'a', 'call1', 'shell', '{}', 'pending', 0, 0, 1)",
        )
        .await
        .expect_err("same call id, same root turn");
    assert_eq!(dup.code(), Some(&SqlState::UNIQUE_VIOLATION), "{dup}");
}

#[tokio::test]
async fn queued_inputs_number_themselves_and_keep_copied_numbers() {
    let db = require_postgres!();
    let client = db.connect().await;
    seeded(&client).await;
    let seq: i64 = client
        .query_one(
            "INSERT INTO queued_inputs (turn_id, session_id, message, queued_at) \
             VALUES ('q1', 's1', 'm', 0) RETURNING seq",
            &[],
        )
        .await
        .expect("insert")
        .get(0);
    assert_eq!(seq, 1);
    client
        .batch_execute(
            "INSERT INTO queued_inputs (seq, turn_id, session_id, message, queued_at) \
             VALUES (40, 'q2', 's1', 'm', 0)",
        )
        .await
        .expect("an explicit number, as a copy writes it");
}
