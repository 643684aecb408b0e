//! The PostgreSQL backend of keel's store: [`PgStore`] implements
//! keel-store's `Backend`, so the engine and gateway run on it unchanged.
//!
//! - **Transactions.** Each `Backend` method is an inherent method in the
//!   module named as its SQLite twin (`sessions.rs`, `messages.rs`,
//!   `runs/`, `inbox.rs` …; `backend.rs` lists them). Writes run in one
//!   `SERIALIZABLE` transaction, retried on serialization failures and
//!   deadlocks, answered after `COMMIT`; reads in one read-only snapshot
//!   (`store.rs`). The same conformance suite as SQLite's runs against a
//!   real server (`tests/it`).
//! - **The schema**: migrations 1..=[`SCHEMA_VERSION`], the same versions,
//!   tables, columns, CHECKs, unique and partial indexes as keel-store's
//!   SQLite schema (a parity test compares the two table by table), plus
//!   a `row_order` identity where SQLite's listings follow the rowid.
//!   [`migrate`] applies them, one transaction per step under an advisory
//!   lock; a newer database is refused.
//! - [`PgRuntimeLock`]: one process per database, as on SQLite.
//! - [`pool`]: deadpool-postgres with rustls (ring, the system's roots);
//!   [`schema_outline`] / [`schema_definitions`]; the test harness
//!   (module `testing`, feature `testing`).
//!
//! # Several processes on one database (designed, not built)
//!
//! Today a second process is refused ([`PgRuntimeLock`]). The design for
//! serving one database from several:
//!
//! - **Per-process fencing.** The one-owner lock becomes a process row
//!   with a fencing epoch (from a sequence) renewed every `lease_secs / 3`;
//!   runs are stamped with their process's epoch, and recovery interrupts
//!   only the runs of processes whose lease expired (the recovery a start
//!   runs today — interrupted, completion recorded once — per process
//!   instead of per generation).
//! - **Session leases.** A session's turns run under a lease row
//!   (`session_id`, owner epoch, expiry) taken before the turn and checked
//!   in the turn's commit, so a stale owner's commit is refused; a process
//!   that takes a lease reloads the session if its head moved.
//! - **Leased work.** Inbox events are already claimed `FOR UPDATE SKIP
//!   LOCKED` (each by one process); queued inputs and continuations of a
//!   dead process's sessions are taken by whichever process takes the
//!   session's lease next.
//! - **Live streams** (built: `relay.rs`). Each process `LISTEN`s on one
//!   connection of its own; the process running a turn relays its frames
//!   with `NOTIFY`, and a run that changes sends a bare note, on which the
//!   others read the committed rows by revision — a lost notification
//!   costs a re-read (`Relayed::Lost`), never a stored row.

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
pub use store::{PgOptions, PgStore};

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
