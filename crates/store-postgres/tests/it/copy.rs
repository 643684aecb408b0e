//! `keel copy`'s library end: a SQLite database holding every kind of row
//! goes to PostgreSQL and back to a new SQLite file with every row equal
//! (insertion order and identity keys included), the checker clean on each
//! target and the copied PostgreSQL database working on (its sequences past
//! the copied keys); a target that holds rows is refused untouched; a copy
//! that fails halfway leaves its target empty.
#![allow(clippy::unwrap_used)] // the fixture helpers outside #[test] fns unwrap too

use std::collections::BTreeMap;
use std::path::Path;

use keel_core::{
    AgentId, ApprovalId, CompletionPolicy, Delivery, ExecutionMode, GroupId, Message, SessionId,
    ToolCall, TurnId, Usage, Usd,
};
use keel_store::conformance::check::{busy_store, turn};
use keel_store::conformance::fixtures::{assistant, completed, new_run, new_session, user};
use keel_store::{
    check_database, read_sqlite_tables, AcceptGroup, AcceptRun, CallKind, CallSpan, Cell,
    CheckOptions, CompletionHandling, DecideApproval, Decision, McpManifestRecord, NewApproval,
    NewGroup, NewMessage, OpenTurn, PausedRunCommit, PausedTurnCommit, QueuedInput, Store,
    StoreError, TurnCalls, TurnCommit, ROW_ORDER,
};
use keel_store_postgres::testing::TestDb;
use keel_store_postgres::{
    copy_database, read_postgres_tables, require_postgres, CopyError, Database, PgOptions, PgStore,
    Side, TableProgress,
};

/// Every row of a database: table → rows as (column, value) pairs sorted
/// by column, rows sorted; the row-ordered tables carry their order.
type Rows = BTreeMap<&'static str, Vec<Vec<(String, Cell)>>>;

fn add_chunk(rows: &mut Rows, chunk: keel_store::TableChunk) {
    let table = rows.entry(chunk.table).or_default();
    for row in chunk.rows {
        let mut pairs: Vec<(String, Cell)> = chunk.columns.iter().cloned().zip(row).collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        table.push(pairs);
    }
}

fn sorted(mut rows: Rows) -> Rows {
    for table in rows.values_mut() {
        table.sort_by_cached_key(|r| format!("{r:?}"));
    }
    rows
}

fn sqlite_rows(path: &Path) -> Rows {
    let mut rows = Rows::new();
    // Small chunks: the reader's chunking is exercised too.
    read_sqlite_tables(path, 7, &mut |chunk| {
        add_chunk(&mut rows, chunk);
        Ok(())
    })
    .unwrap();
    sorted(rows)
}

async fn postgres_rows(url: &str) -> Rows {
    let (sink, mut chunks) = tokio::sync::mpsc::channel(4);
    let url = url.to_owned();
    let reader = async move {
        let read = read_postgres_tables(&url, 7, &sink).await;
        drop(sink);
        read
    };
    let collect = async {
        let mut rows = Rows::new();
        while let Some(chunk) = chunks.recv().await {
            add_chunk(&mut rows, chunk);
        }
        rows
    };
    let (read, rows) = tokio::join!(reader, collect);
    read.unwrap();
    sorted(rows)
}

fn count(rows: &Rows, table: &str) -> usize {
    rows.get(table).map_or(0, Vec::len)
}

async fn pg_store(db: &TestDb) -> Store {
    let (store, _) = PgStore::connect(&db.conninfo, PgOptions::default())
        .await
        .unwrap();
    Store::new(store)
}

fn call(id: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: "shell".into(),
        arguments: serde_json::json!({ "command": id }),
    }
}

fn plain_turn(session: SessionId, messages: Vec<NewMessage>, now_ms: i64) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: session,
        messages,
        state: b"{}".to_vec(),
        checkpoint: None,
        visible_user_inputs: 0,
        answers: Vec::new(),
        expected_head: None,
        now_ms,
    }
}

/// Writes every kind of row keel has through the store: dialogs (one a
/// child) with turns, tool calls, checkpoints and a rollback; runs ended,
/// interrupted and in a group, with their inbox events and counters; a
/// paused turn's approvals and a grant; a queued input and a webhook
/// delivery; an image; spend; call spans; an MCP manifest; and a dialog of
/// 1,500 long messages (compressed on SQLite, several chunks). Ends with a
/// start's recovery, so nothing is left in flight.
async fn populate(store: &Store) {
    let session = busy_store(store).await;
    // A dialog of another (its parent).
    let mut child = new_session("child", 2);
    child.parent_id = Some(session);
    child.agent_id = Some(AgentId::parse("researcher").unwrap());
    store.create_session(child).await.unwrap();
    // A group of two background runs, both ended: one group completion.
    let group = NewGroup {
        id: GroupId::new(),
        root_session_id: session,
        caller_run_id: None,
        caller_scope_id: "root-turn".into(),
        idempotency_key: Some("batch-1".into()),
        mode: ExecutionMode::Background,
        completion_policy: CompletionPolicy::All,
        completion_delivery: Some(Delivery::Queue),
        failure_delivery: Some(Delivery::Steer),
        deadline_at_ms: 1_000_000,
        runtime_generation: 1,
    };
    let runs = vec![
        new_run(session, ExecutionMode::Background),
        new_run(session, ExecutionMode::Background),
    ];
    store
        .accept_agent_group(AcceptGroup {
            group,
            runs: runs.clone(),
            inbox_capacity: 8,
            now_ms: 100,
        })
        .await
        .unwrap();
    for (i, run) in runs.iter().enumerate() {
        store
            .commit_terminal(
                run.id,
                run.execution_id.clone(),
                completed(&format!("result {i}: {}", "words ".repeat(60))),
                CompletionHandling::Deliver,
                200,
            )
            .await
            .unwrap();
    }
    let lone = new_run(session, ExecutionMode::Background);
    store
        .accept_run(AcceptRun {
            run: lone.clone(),
            inbox_capacity: 8,
            now_ms: 100,
        })
        .await
        .unwrap();
    store
        .commit_terminal(
            lone.id,
            lone.execution_id.clone(),
            completed("short"),
            CompletionHandling::Deliver,
            210,
        )
        .await
        .unwrap();
    // A paused turn: two gated calls, one approved for good.
    let gated = store
        .create_session(new_session("gated", 3))
        .await
        .unwrap()
        .id;
    let calls = vec![call("call-a"), call("call-b")];
    let approvals: Vec<NewApproval> = calls
        .iter()
        .map(|c| NewApproval {
            id: ApprovalId::new(),
            agent_id: AgentId::parse("root").unwrap(),
            call: c.clone(),
            expires_at_ms: 10_000_000,
        })
        .collect();
    let first = approvals[0].id;
    let paused_turn = TurnId::new();
    store
        .commit_paused_turn(PausedTurnCommit {
            turn: TurnCommit {
                visible_user_inputs: 1,
                ..plain_turn(
                    gated,
                    vec![
                        user("do things"),
                        NewMessage::new(Message::assistant_with_tools("", calls)),
                    ],
                    10,
                )
            },
            turn_id: paused_turn,
            approvals,
            consumed: Vec::new(),
        })
        .await
        .unwrap();
    // A run of that turn, paused for an approval of its own.
    let mut asking = new_run(gated, ExecutionMode::Background);
    asking.root_turn_id = Some(paused_turn);
    store
        .accept_run(AcceptRun {
            run: asking.clone(),
            inbox_capacity: 8,
            now_ms: 20,
        })
        .await
        .unwrap();
    assert!(store
        .mark_run_running(asking.id, asking.execution_id.clone(), 21)
        .await
        .unwrap());
    assert!(store
        .commit_paused_run(PausedRunCommit {
            run_id: asking.id,
            execution_id: asking.execution_id.clone(),
            turn_id: paused_turn,
            messages: vec![Message::user("look things up")],
            usage: Usage::new(1, 1),
            iterations: 1,
            tool_calls: 0,
            remaining_ms: 60_000,
            approvals: vec![NewApproval {
                id: ApprovalId::new(),
                agent_id: AgentId::parse("researcher").unwrap(),
                call: call("run-call"),
                expires_at_ms: 10_000_000,
            }],
            calls: Vec::new(),
            now_ms: 30,
        })
        .await
        .unwrap());
    store
        .decide_approval(DecideApproval {
            id: first,
            session_id: Some(gated),
            decision: Decision::ApproveAlways,
            reason: None,
            now_ms: 20,
        })
        .await
        .unwrap();
    // A webhook answered (a pending delivery), and one input still queued.
    let hooked = store
        .create_session(new_session("hooked", 4))
        .await
        .unwrap()
        .id;
    let queued = |text: &str| QueuedInput {
        session_id: hooked,
        turn_id: TurnId::new(),
        message: Message::user(text),
        queued_at_ms: 10,
        webhook: Some("https://example.test/hook".into()),
    };
    let answered = queued("hello");
    store.queue_input(answered.clone()).await.unwrap();
    store.queue_input(queued("later")).await.unwrap();
    let seqs = store
        .open_turn(OpenTurn {
            session_id: hooked,
            messages: vec![user("hello")],
            expected_head: None,
            queued: Some(answered.turn_id),
            now_ms: 20,
        })
        .await
        .unwrap();
    store
        .commit_turn(TurnCommit {
            answers: seqs,
            ..plain_turn(hooked, vec![assistant("hi")], 30)
        })
        .await
        .unwrap();
    // An image a message refers to, spend, call spans, a manifest.
    let image = store
        .put_image(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec())
        .await
        .unwrap();
    let mut with_image = Message::user("look");
    with_image.content.push(keel_core::ContentPart::ImageRef {
        uri: keel_core::image_uri(&image.sha256),
        mime_type: Some("image/png".into()),
    });
    let pictures = store
        .create_session(new_session("pictures", 5))
        .await
        .unwrap()
        .id;
    store
        .commit_turn(TurnCommit {
            calls: Some(TurnCalls {
                turn_id: TurnId::new(),
                spans: vec![CallSpan {
                    kind: CallKind::Model,
                    name: "scripted/scripted-1".into(),
                    call_id: None,
                    started_at_ms: 40,
                    ended_at_ms: 45,
                    input_tokens: Some(7),
                    output_tokens: Some(3),
                    status: "ok".into(),
                }],
            }),
            ..turn(pictures, vec![with_image, Message::assistant("a png")], 1)
        })
        .await
        .unwrap();
    store
        .add_dialog_spend(pictures, Usage::new(100, 20), Usd::new(0.5).unwrap(), 50)
        .await
        .unwrap();
    store
        .commit_mcp_manifest(McpManifestRecord {
            server: "files".into(),
            hash: "a".repeat(64),
            manifest: r#"{"tools":[]}"#.into(),
            committed_at_ms: 1,
        })
        .await
        .unwrap();
    // Many long messages: compressed on SQLite, more than one chunk.
    let long = store
        .create_session(new_session("long", 6))
        .await
        .unwrap()
        .id;
    let text = "keel keeps every message durable. ".repeat(20);
    store
        .append_messages(
            long,
            (0..1500)
                .map(|i| assistant(&format!("{i}: {text}")))
                .collect(),
            60,
        )
        .await
        .unwrap();
    // The next start recovers what the first left running.
    store.activate_runtime("second".into(), 70).await.unwrap();
}

fn nobody_running() -> CheckOptions {
    CheckOptions::default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_trip_through_postgres_keeps_every_row_and_each_target_checks_clean() {
    let db = require_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.db");
    let store = Store::open(&source, Default::default()).unwrap();
    populate(&store).await;
    let checkpoints = store
        .list_checkpoints(first_session(&store).await)
        .await
        .unwrap();
    drop(store);
    let report = check_database(&source, &nobody_running()).unwrap();
    assert!(report.is_clean(), "{report:#?}");
    let rows = sqlite_rows(&source);
    for table in keel_store::TABLES
        .iter()
        .filter(|t| keel_store::is_copied(t))
    {
        assert!(count(&rows, table) > 0, "the source has no {table} row");
    }

    // SQLite → PostgreSQL.
    let mut heard: Vec<TableProgress> = Vec::new();
    let summary = copy_database(
        &Database::Sqlite(source.clone()),
        &Database::Postgres(db.conninfo.clone()),
        &mut |p| heard.push(p),
    )
    .await
    .unwrap();
    for (table, n) in &summary.tables {
        assert_eq!(*n as usize, count(&rows, table), "{table}");
    }
    assert!(
        heard.iter().filter(|p| p.table == "messages").count() > 1,
        "the messages came in chunks"
    );
    assert_eq!(heard.last().map(|p| p.table), Some("runtime_state"));
    assert_eq!(postgres_rows(&db.conninfo).await, rows);
    let pg = pg_store(&db).await;
    let report = pg.check_invariants(nobody_running()).await.unwrap();
    assert!(report.is_clean(), "{report:#?}");
    // Listings that follow insertion order read the same.
    assert_eq!(
        pg.list_checkpoints(first_session(&pg).await).await.unwrap(),
        checkpoints
    );

    // PostgreSQL → a new SQLite file.
    let back = dir.path().join("back.db");
    let again = copy_database(
        &Database::Postgres(db.conninfo.clone()),
        &Database::Sqlite(back.clone()),
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(again, summary);
    assert_eq!(sqlite_rows(&back), rows);
    let report = check_database(&back, &nobody_running()).unwrap();
    assert!(report.is_clean(), "{report:#?}");

    // The copied PostgreSQL database works on: new rows take keys past the
    // copied ones (identity sequences moved), new checkpoints list first.
    let session = first_session(&pg).await;
    pg.queue_input(QueuedInput {
        session_id: session,
        turn_id: TurnId::new(),
        message: Message::user("after the copy"),
        queued_at_ms: 80,
        webhook: None,
    })
    .await
    .unwrap();
    let committed = pg
        .commit_turn(turn(session, vec![Message::user("more")], 9))
        .await
        .unwrap();
    let newest = pg.list_checkpoints(session).await.unwrap();
    assert_eq!(
        newest.first().map(|c| c.id),
        committed.checkpoint.map(|c| c.id)
    );
    let after = postgres_rows(&db.conninfo).await;
    let orders = |rows: &Rows, table: &str| -> Vec<i64> {
        let mut v: Vec<i64> = rows[table]
            .iter()
            .filter_map(
                |r| match r.iter().find(|(c, _)| c == ROW_ORDER || c == "seq") {
                    Some((_, Cell::Integer(i))) => Some(*i),
                    _ => None,
                },
            )
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    assert_eq!(
        orders(&after, "queued_inputs").len(),
        count(&rows, "queued_inputs") + 1
    );
    assert_eq!(
        orders(&after, "checkpoints").len(),
        count(&rows, "checkpoints") + 1
    );
}

/// The first dialog created (`busy_store`'s).
async fn first_session(store: &Store) -> SessionId {
    store
        .get_dialog("cli_chat", "chat-1", "d")
        .await
        .unwrap()
        .unwrap()
        .id
}

fn refusal(e: &CopyError) -> String {
    assert_eq!(e.side, Side::Target, "{e}");
    assert!(matches!(e.error, StoreError::Conflict(_)), "{e}");
    e.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_holds_rows_is_refused_untouched() {
    let db = require_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.db");
    let store = Store::open(&source, Default::default()).unwrap();
    store.create_session(new_session("a", 1)).await.unwrap();
    drop(store);
    // PostgreSQL holding one dialog.
    let pg = pg_store(&db).await;
    pg.create_session(new_session("there", 1)).await.unwrap();
    let to_postgres = copy_database(
        &Database::Sqlite(source.clone()),
        &Database::Postgres(db.conninfo.clone()),
        &mut |_| {},
    )
    .await
    .unwrap_err();
    let before = postgres_rows(&db.conninfo).await;
    assert_eq!(count(&before, "sessions"), 1);
    assert_eq!(count(&before, "timelines"), 1);
    // A SQLite file holding one dialog.
    let full = dir.path().join("full.db");
    let other = Store::open(&full, Default::default()).unwrap();
    other.create_session(new_session("here", 1)).await.unwrap();
    drop(other);
    let to_sqlite = copy_database(
        &Database::Postgres(db.conninfo.clone()),
        &Database::Sqlite(full.clone()),
        &mut |_| {},
    )
    .await
    .unwrap_err();
    assert_eq!(count(&sqlite_rows(&full), "sessions"), 1);
    insta::assert_yaml_snapshot!([refusal(&to_postgres), refusal(&to_sqlite)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_fails_halfway_leaves_the_target_empty() {
    let db = require_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.db");
    let store = Store::open(&source, Default::default()).unwrap();
    busy_store(&store).await;
    // SQLite keeps a NUL in text; PostgreSQL's text cannot hold one, so the
    // copy fails at this row, one of the last tables, long after the first.
    store
        .commit_mcp_manifest(McpManifestRecord {
            server: "nul\0".into(),
            hash: "b".repeat(64),
            manifest: r#"{"tools":[]}"#.into(),
            committed_at_ms: 1,
        })
        .await
        .unwrap();
    drop(store);
    let err = copy_database(
        &Database::Sqlite(source.clone()),
        &Database::Postgres(db.conninfo.clone()),
        &mut |_| {},
    )
    .await
    .unwrap_err();
    assert_eq!(err.side, Side::Target, "{err}");
    assert!(err.to_string().contains("mcp_manifests"), "{err}");
    let left = postgres_rows(&db.conninfo).await;
    assert!(left.values().all(Vec::is_empty), "{left:?}");
    // Still a keel database, migrated and empty: a copy can be retried.
    let pg = pg_store(&db).await;
    assert!(pg
        .check_invariants(nobody_running())
        .await
        .unwrap()
        .is_clean());
}
