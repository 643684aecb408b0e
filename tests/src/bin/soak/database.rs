//! The database a soak's keel writes and its audits read: the data
//! directory's SQLite file, or a PostgreSQL database of the soak's own
//! (created empty on the server given with `--postgres`, dropped with it).
//! Both readers take the same rows in one read snapshot and hand them to
//! the same audits as a [`Snapshot`]; only how a row is fetched differs
//! (SQLite may store a message's JSON as a zstd frame, PostgreSQL never).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tokio_postgres::{IsolationLevel, NoTls};

/// Every stored user message: sends, steers, sub-agent tasks, and the
/// hidden messages that deliver signals.
const USER_MESSAGES: &str = "SELECT content FROM messages WHERE role = 'user'";
/// Every stored signal event, whatever its status.
const SIGNALS: &str = "SELECT id, run_id, delivery, status, payload_json \
                       FROM agent_inbox_events WHERE event_type = 'signal'";
/// Sub-agent runs, and how many of them ran in the background.
const RUNS: &str = "SELECT count(*), count(*) FILTER (WHERE mode = 'background') FROM agent_runs";

/// The variable that points keel at a PostgreSQL database.
const DATABASE_URL_VAR: &str = "KEEL_DATABASE_URL";

/// What the audits read, all from one read snapshot.
pub struct Snapshot {
    /// The text of every stored user message.
    pub user_texts: Vec<String>,
    pub signals: Vec<StoredSignal>,
    /// Sub-agent runs stored, and of those the background ones.
    pub runs: (i64, i64),
}

/// One stored signal event.
pub struct StoredSignal {
    pub id: String,
    /// The run that emitted it.
    pub run: String,
    /// `queue` or `steer`.
    pub delivery: String,
    pub status: String,
    /// The summary from its payload.
    pub summary: String,
}

impl StoredSignal {
    fn from_row(id: String, run: String, delivery: String, status: String, payload: &str) -> Self {
        let payload: serde_json::Value = serde_json::from_str(payload).unwrap();
        let summary = payload["summary"].as_str().unwrap_or("").to_owned();
        StoredSignal {
            id,
            run,
            delivery,
            status,
            summary,
        }
    }
}

/// A stored message's JSON, as text.
fn message_text(json: &str) -> String {
    let message: keel_core::Message = serde_json::from_str(json).unwrap();
    message.text()
}

/// Where a keel started by the soak keeps its database.
pub enum Database {
    /// The data directory's `keel.db`.
    Sqlite(PathBuf),
    Postgres(ScratchDatabase),
}

impl Database {
    /// An empty database for the data directory `data`: on SQLite its
    /// `keel.db`, which keel creates; with a PostgreSQL `server`, a
    /// database named `name` created on it now.
    pub fn create(server: Option<&str>, data: &Path, name: &str) -> Database {
        match server {
            None => Database::Sqlite(data.join("keel.db")),
            Some(server) => Database::Postgres(ScratchDatabase::create(server, name)),
        }
    }

    /// Points a keel command at this database. On SQLite it also clears a
    /// `KEEL_DATABASE_URL` the soak itself was started with, which would
    /// send keel elsewhere than the audits look.
    pub fn point(&self, keel: &mut Command) {
        match self {
            Database::Sqlite(_) => keel.env_remove(DATABASE_URL_VAR),
            Database::Postgres(db) => keel.env(DATABASE_URL_VAR, &db.url),
        };
    }

    /// Whether keel's failpoints sit on this backend's commit paths (only
    /// keel-store's, SQLite's, have any).
    pub fn has_failpoints(&self) -> bool {
        matches!(self, Database::Sqlite(_))
    }

    pub fn backend(&self) -> &'static str {
        match self {
            Database::Sqlite(_) => "SQLite",
            Database::Postgres(_) => "PostgreSQL",
        }
    }

    /// How the soak's first line names it.
    pub fn describe(&self) -> String {
        match self {
            Database::Sqlite(path) => path.display().to_string(),
            Database::Postgres(db) => format!("PostgreSQL database {}", db.name),
        }
    }

    /// The rows the audits read, in one read snapshot.
    pub fn snapshot(&self) -> Snapshot {
        match self {
            Database::Sqlite(path) => sqlite_snapshot(path),
            Database::Postgres(db) => block_on(db.snapshot()),
        }
    }
}

fn sqlite_snapshot(db: &Path) -> Snapshot {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    conn.busy_timeout(Duration::from_secs(10)).unwrap();
    // In WAL mode a read transaction sees one snapshot from its first read on.
    conn.execute_batch("BEGIN").unwrap();
    let mut stmt = conn.prepare(USER_MESSAGES).unwrap();
    let user_texts = stmt
        .query_map([], |r| {
            // keel stores a long message's JSON as a zstd frame.
            Ok(match r.get_ref(0)? {
                rusqlite::types::ValueRef::Blob(frame) => {
                    String::from_utf8(zstd::stream::decode_all(frame).unwrap()).unwrap()
                }
                _ => r.get(0)?,
            })
        })
        .unwrap()
        .map(|json| message_text(&json.unwrap()))
        .collect();
    let mut stmt = conn.prepare(SIGNALS).unwrap();
    let signals = stmt
        .query_map([], |r| {
            Ok(StoredSignal::from_row(
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                &r.get::<_, String>(4)?,
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let runs = conn
        .query_row(RUNS, [], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap();
    drop(stmt);
    conn.execute_batch("COMMIT").unwrap();
    Snapshot {
        user_texts,
        signals,
        runs,
    }
}

/// A database of the soak's own on a PostgreSQL server: created empty,
/// dropped (with whatever connections a killed keel left) when this is.
pub struct ScratchDatabase {
    /// The server's connection string, naming a database to connect to
    /// for `CREATE DATABASE` and `DROP DATABASE`.
    server: String,
    name: String,
    /// `server` with its database replaced by `name`: what keel gets.
    url: String,
}

impl ScratchDatabase {
    /// Creates the database `name` on `server`; fails when it exists (a
    /// database left by an earlier soak is never reused or dropped here:
    /// it may be another soak's).
    fn create(server: &str, name: &str) -> ScratchDatabase {
        let url = with_dbname(server, name);
        let sql = format!("CREATE DATABASE {name}");
        block_on(async { connect(server).await?.batch_execute(&sql).await })
            .unwrap_or_else(|e| panic!("keel-soak: {sql} on the --postgres server: {}", why(&e)));
        ScratchDatabase {
            server: server.to_owned(),
            name: name.to_owned(),
            url,
        }
    }

    async fn snapshot(&self) -> Snapshot {
        let mut client = connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("keel-soak: cannot reach {}: {}", self.name, why(&e)));
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .unwrap();
        let user_texts = tx
            .query(USER_MESSAGES, &[])
            .await
            .unwrap()
            .iter()
            .map(|r| message_text(r.get(0)))
            .collect();
        let signals = tx
            .query(SIGNALS, &[])
            .await
            .unwrap()
            .into_iter()
            .map(|r| StoredSignal::from_row(r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect();
        let runs = tx.query_one(RUNS, &[]).await.unwrap();
        let runs = (runs.get(0), runs.get(1));
        tx.commit().await.unwrap();
        Snapshot {
            user_texts,
            signals,
            runs,
        }
    }
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        // FORCE: a SIGKILLed keel's connections may not have ended yet.
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        if let Err(e) = block_on(async { connect(&self.server).await?.batch_execute(&sql).await }) {
            eprintln!("keel-soak: {sql}: {}", why(&e));
        }
    }
}

/// `server` (a `postgres://` URL or a libpq `key=value` string) naming
/// the database `name` instead of its own: a later `dbname` wins in both.
fn with_dbname(server: &str, name: &str) -> String {
    let url = if server.starts_with("postgres://") || server.starts_with("postgresql://") {
        let separator = if server.contains('?') { '&' } else { '?' };
        format!("{server}{separator}dbname={name}")
    } else {
        format!("{server} dbname={name}")
    };
    let config: tokio_postgres::Config = url
        .parse()
        .unwrap_or_else(|e| panic!("keel-soak: --postgres is not a connection string: {e}"));
    assert_eq!(
        config.get_dbname(),
        Some(name),
        "keel-soak: --postgres: cannot point the connection string at database {name}"
    );
    url
}

/// A connection to `url`, without TLS (the soak's servers are local).
async fn connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// A PostgreSQL error with its cause, which its `Display` leaves out.
fn why(e: &tokio_postgres::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// Runs `f` to completion on a runtime of its own: the PostgreSQL reads
/// happen between the driver's own `block_on`s, never inside one.
fn block_on<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}
