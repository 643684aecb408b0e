//! The PostgreSQL backend against SQLite (`synchronous = FULL`, the durable
//! comparison: PostgreSQL acknowledges after its WAL flush), measured in the
//! same run: message appends (one writer; several writers on their own
//! dialogs) and inbox claim → continuation commit. Each line is
//! `BENCH <name> … ratio=<postgres / sqlite>`.
//!
//! Needs a server: `cargo xtask bench postgres` starts a throwaway cluster
//! (or uses `KEEL_TEST_DATABASE_URL`).

use std::time::{Duration, Instant};

use keel_core::{Message, SessionId};
use keel_store::conformance::fixtures::{new_run, new_session};
use keel_store::{
    AcceptRun, ClaimRequest, CompletionHandling, ContinuationCommit, LeasedEvents, NewMessage,
    Store, StoreOptions, Synchronous, TerminalOutcome, TurnCommit,
};
use keel_store_postgres::testing::TestDb;
use keel_store_postgres::{PgOptions, PgStore};

/// Appends of the one-writer run.
const APPENDS: usize = 2_000;
/// Writers of the concurrent run, each on its own dialog.
const WRITERS: usize = 16;
/// Appends of each concurrent writer.
const APPENDS_EACH: usize = 200;
/// Completions claimed and consumed.
const EVENTS: usize = 1_000;

fn per_s(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

async fn one_writer(store: &Store) -> f64 {
    let s = store
        .create_session(new_session("append", 1))
        .await
        .expect("session");
    let start = Instant::now();
    for i in 0..APPENDS {
        store
            .append_message(s.id, NewMessage::new(Message::user(format!("m{i}"))), 2)
            .await
            .expect("append");
    }
    per_s(APPENDS, start.elapsed())
}

async fn many_writers(store: &Store) -> f64 {
    let mut sessions = Vec::new();
    for w in 0..WRITERS {
        let s = store
            .create_session(new_session(&format!("w{w}"), 1))
            .await
            .expect("session");
        sessions.push(s.id);
    }
    let start = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|sid| {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..APPENDS_EACH {
                    store
                        .append_message(sid, NewMessage::new(Message::user(format!("m{i}"))), 2)
                        .await
                        .expect("append");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("writer");
    }
    per_s(WRITERS * APPENDS_EACH, start.elapsed())
}

/// Completions of `EVENTS` background runs, then claimed and consumed by
/// continuation turns until the inbox is empty; events per second.
async fn claim_consume(store: &Store) -> f64 {
    let s = store
        .create_session(new_session("inbox", 1))
        .await
        .expect("session");
    for _ in 0..EVENTS {
        let run = new_run(s.id, keel_core::ExecutionMode::Background);
        store
            .accept_run(AcceptRun {
                run: run.clone(),
                inbox_capacity: u32::MAX,
                now_ms: 1,
            })
            .await
            .expect("accept");
        store
            .commit_terminal(
                run.id,
                run.execution_id,
                TerminalOutcome::Completed {
                    result: "done".into(),
                    usage: keel_core::Usage::default(),
                    tool_calls: 0,
                    iterations: 1,
                    cost: None,
                },
                CompletionHandling::Deliver,
                2,
            )
            .await
            .expect("terminal");
    }
    let start = Instant::now();
    let (consumed, _) = drain(store, s.id).await;
    per_s(consumed, start.elapsed())
}

async fn drain(store: &Store, root: SessionId) -> (usize, u64) {
    let (mut consumed, mut turns) = (0usize, 0u64);
    while let Some(lease) = store
        .claim_inbox_batch(ClaimRequest {
            root_session_id: root,
            now_ms: 10,
            lease_ms: 60_000,
            max_events: 8,
            max_bytes: 32 * 1024,
            delivery: None,
        })
        .await
        .expect("claim")
    {
        let ids = lease.events.iter().map(|e| e.id).collect();
        let done = store
            .commit_continuation_turn(ContinuationCommit {
                turn: TurnCommit {
                    calls: None,
                    session_id: root,
                    messages: vec![
                        NewMessage::new(Message::user("[results]").hidden()),
                        NewMessage::new(Message::assistant("noted")),
                    ],
                    state: turns.to_string().into_bytes(),
                    checkpoint: None,
                    visible_user_inputs: 0,
                    answers: Vec::new(),
                    expected_head: None,
                    now_ms: 11,
                },
                consumed: vec![LeasedEvents {
                    lease_token: lease.token,
                    event_ids: ids,
                }],
            })
            .await
            .expect("commit");
        consumed += usize::try_from(done.consumed).expect("count");
        turns += 1;
    }
    (consumed, turns)
}

/// A fresh store of each backend per measurement.
struct Backends {
    dir: tempfile::TempDir,
    n: usize,
    pg: Vec<TestDb>,
}

impl Backends {
    fn sqlite(&mut self) -> Store {
        self.n += 1;
        let options = StoreOptions {
            synchronous: Synchronous::Full,
            ..StoreOptions::default()
        };
        Store::open(self.dir.path().join(format!("{}.db", self.n)), options).expect("sqlite")
    }

    async fn postgres(&mut self) -> Store {
        let db = TestDb::start().await.expect("a PostgreSQL server");
        let (store, _) = PgStore::connect(&db.conninfo, PgOptions::default())
            .await
            .expect("connect");
        self.pg.push(db);
        Store::new(store)
    }
}

fn report(name: &str, unit: &str, pg: f64, sqlite: f64) {
    println!(
        "BENCH {name} postgres_{unit}={pg:.0} sqlite_full_{unit}={sqlite:.0} ratio={:.2}",
        pg / sqlite
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut b = Backends {
            dir: tempfile::tempdir().expect("tempdir"),
            n: 0,
            pg: Vec::new(),
        };
        let server = TestDb::start().await.expect("a PostgreSQL server");
        println!("bench: PostgreSQL {}", server.server_version);
        drop(server);

        let sqlite = one_writer(&b.sqlite()).await;
        let pg = one_writer(&b.postgres().await).await;
        report("append_one_writer", "appends_per_s", pg, sqlite);

        let sqlite = many_writers(&b.sqlite()).await;
        let pg = many_writers(&b.postgres().await).await;
        report(
            &format!("append_{WRITERS}_writers"),
            "appends_per_s",
            pg,
            sqlite,
        );

        let sqlite = claim_consume(&b.sqlite()).await;
        let pg = claim_consume(&b.postgres().await).await;
        report("inbox_claim_consume", "events_per_s", pg, sqlite);
    });
}
