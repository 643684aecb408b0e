//! The PostgreSQL backend of keel's store: [`PgStore`] implements
//! keel-store's `Backend`, so the engine and gateway run on it unchanged.
//!
//! - **Transactions.** Each `Backend` method is an inherent method in the
//!   module named as its SQLite twin (`sessions.rs`, `messages.rs`,
//!   `runs/`, `inbox.rs` …; `backend.rs` lists them). Writes run in one
//!   transaction, retried on serialization failures and deadlocks,
//!   answered after `COMMIT`; reads in one read-only snapshot
//!   (`store.rs`). Most writes are `SERIALIZABLE`. A dialog's hot path
//!   (queue an input, open and commit a turn, append, checkpoint, spend)
//!   is `READ COMMITTED` behind a lock on its sessions row
//!   (`lock_session`), which every write of a dialog's history, inputs and
//!   checkpoints takes first: one dialog's writes run one at a time,
//!   different dialogs' never conflict (serializable checks conflicted
//!   them on shared index pages and cost about 40 % of the turns a
//!   second, docs/BENCHMARKS.md). What every turn does in one statement
//!   (reading the session and the approval and inbox schedules, giving
//!   the session lease back; queueing an input and taking a free lease,
//!   which check the fence themselves) runs without a transaction around
//!   it. Round trips are what a turn costs on a server that shares the
//!   machine, so they are pipelined: `BEGIN`, the fence check and a
//!   body's first statement travel together; a turn's open, commit and
//!   spend check the fence in the statement that takes their lock, and
//!   the open and commit send their writes (one statement each) with it,
//!   against the head the turn expects (`messages.rs`). The same
//!   conformance suite as SQLite's runs against a real server
//!   (`tests/it`).
//! - **The schema**: migrations 1..=[`SCHEMA_VERSION`], the same versions,
//!   tables, columns, CHECKs, unique and partial indexes as keel-store's
//!   SQLite schema (a parity test compares the two table by table), plus
//!   a `row_order` identity where SQLite's listings follow the rowid.
//!   [`migrate`] applies them, one transaction per step under an advisory
//!   lock; a newer database is refused.
//! - [`PgRuntimeLock`]: runtimes share the database, commands that need it
//!   alone hold it exclusively.
//! - [`pool`]: deadpool-postgres with rustls (ring, the system's roots);
//!   [`schema_outline`] / [`schema_definitions`]; the test harness
//!   (module `testing`, feature `testing`).
//!
//! # Several processes on one database
//!
//! - **Registrations** (`runtime.rs`). Each activation registers its
//!   process in `runtime_processes` under a new runtime generation (its
//!   fencing epoch), with an expiry by the server's clock that the process
//!   renews, and a presence lock: an advisory lock held on a connection of
//!   its own, which the server frees when the process dies. Every write
//!   checks first that its registration exists. A registration that
//!   expired, or whose presence lock is free, is deleted by whichever
//!   process notices, which takes its work over: in the same transaction
//!   the session leases it held are freed and those sessions' inbox leases
//!   and open inputs released; then its runs end interrupted with their
//!   completions, one transaction each (alone on the database, a start
//!   recovers everything in one transaction).
//! - **Session leases** (`processes.rs`). A session's turns run under its
//!   lease (`session_leases`), one live holder at a time; the row keeps its
//!   last holder, so a process taking it learns whether to reload.
//! - **Queued inputs** carry the generation that runs them; those of
//!   generations no longer registered are taken, each once, by
//!   `queued_inputs`.
//! - **Live streams** (`relay.rs`). Each process `LISTEN`s on one
//!   connection of its own; the process running a turn relays its frames
//!   with `NOTIFY`, and a run that changes sends a bare note, on which the
//!   others read the committed rows by revision — a lost notification
//!   costs a re-read (`Relayed::Lost`), never a stored row.

/// A CTE named `fence` for a statement that checks its own fence
/// ([`PgStore::write_statement`]): the registration of generation `$g`,
/// locked until the statement's transaction ends, as `check_fence` locks it.
macro_rules! fence_cte {
    ($g:literal) => {
        concat!(
            "fence AS MATERIALIZED (SELECT 1 FROM runtime_processes WHERE generation = ",
            $g,
            "::bigint FOR KEY SHARE)"
        )
    };
}

/// The condition a statement with [`fence_cte`] gates its writes on: no
/// fence (generation `$g` is 0), or the registration found.
macro_rules! fence_holds {
    ($g:literal) => {
        concat!("(", $g, "::bigint = 0 OR EXISTS (SELECT 1 FROM fence))")
    };
}

/// The columns of a `sessions` row, in the order `sessions.rs` reads them.
macro_rules! session_columns {
    () => {
        "id, channel, chat_id, dialog_id, title, agent_id, parent_id, created_at, \
         last_active_at, message_count, deleted_at, delivery_context, head_timeline_id, \
         state_hash"
    };
}
mod approvals;
mod backend;
mod calls;
mod check;
mod checkpoints;
mod copy;
mod counters;
mod error;
mod images;
mod inbox;
mod lock;
mod mcp;
mod messages;
mod migrations;
mod observe;
mod outline;
mod pool;
mod processes;
mod projection;
mod purge;
mod queued;
mod relay;
mod runs;
mod runtime;
mod sessions;
mod spend;
mod store;
#[cfg(feature = "testing")]
pub mod testing;
mod tree;
mod util;
mod webhooks;

pub use copy::{
    copy_database, read_postgres_tables, CopyError, CopySummary, Database, PgLoader, Side,
    TableProgress,
};
pub use error::{PgStoreError, Result};
pub use lock::PgRuntimeLock;
pub use migrations::{
    migrate, migrate_with, schema_version, MigrationReport, MIGRATIONS, SCHEMA_VERSION,
};
pub use outline::{schema_definitions, schema_outline};
pub use pool::pool;
pub use relay::CHANNEL as RELAY_CHANNEL;
pub use store::{default_max_connections, PgOptions, PgStore};

/// `url` without its password, for messages and logs.
pub fn redacted(url: &str) -> String {
    match url.parse::<tokio_postgres::Config>() {
        Ok(config) => {
            let hosts: Vec<String> = config
                .get_hosts()
                .iter()
                .map(|h| match h {
                    tokio_postgres::config::Host::Tcp(name) => name.clone(),
                    #[cfg(unix)]
                    tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
                })
                .collect();
            let port = config.get_ports().first().copied().unwrap_or(5432);
            format!(
                "postgres://{}@{}:{port}/{}",
                config.get_user().unwrap_or(""),
                hosts.join(","),
                config.get_dbname().unwrap_or("")
            )
        }
        Err(_) => "postgres://(unparseable connection string)".to_owned(),
    }
}

/// Re-exported: the pool [`pool`] returns.
pub use deadpool_postgres::Pool;

/// Re-exported so callers need no tokio-postgres dependency of their own.
pub use tokio_postgres;
