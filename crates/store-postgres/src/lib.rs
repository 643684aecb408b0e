//! The PostgreSQL storage of keel (foundation).
//!
//! # What exists
//!
//! - The schema: migrations 1..=[`SCHEMA_VERSION`], the same versions,
//!   tables, columns, CHECKs, unique and partial indexes as keel-store's
//!   SQLite schema (a parity test compares the two table by table).
//! - [`migrate`]: forward-only, one transaction per step together with the
//!   one-row `schema_version` table, serialized by an advisory lock;
//!   reports what it applied and refuses a newer database.
//! - [`pool`]: deadpool-postgres with rustls (ring, the system's roots).
//! - [`schema_outline`] / [`schema_definitions`], and the test harness
//!   (module `testing`, feature `testing`): a database per test on
//!   `KEEL_TEST_DATABASE_URL` or on a throwaway cluster.
//!
//! No store transaction, configuration key or CLI command uses it yet.
//!
//! # Design of what comes next (a proposal, not built)
//!
//! - **Boundary.** A closed set of backends behind the current `Store`
//!   facade: keel-store keeps `Store` and dispatches on an enum (SQLite,
//!   and PostgreSQL behind a cargo feature, so a SQLite-only build links no
//!   PostgreSQL client), rather than a `dyn` trait over ~100 domain
//!   methods. The records (`NewSession`, `TurnCommit`, …) stay
//!   keel-store's; this crate would then take them from keel-store or a
//!   crate below both. To be measured with the store bench before/after
//!   (append, inbox claim→consume) on SQLite: the dispatch must not cost
//!   the SQLite path.
//! - **Several processes.** The one-owner runtime lock becomes, on
//!   PostgreSQL only, per-process fencing: each process registers a row
//!   with a fencing epoch (from a sequence) and renews its lease every
//!   `lease_secs / 3`. A session's turns run under a session lease row
//!   (`session_id`, owner epoch, expiry); every commit of a turn checks, in
//!   its transaction, that the lease is still held with the same epoch, so
//!   a stale owner's commit is refused. Inbox events and background runs
//!   are claimed with `SELECT … FOR UPDATE SKIP LOCKED`, so each is taken
//!   by exactly one process; an expired lease's work is recovered as seed
//!   002's recovery does for a restart.
//! - **Live streams.** A commit that changes what a client follows sends
//!   `NOTIFY` (payload: session id and revision) in its transaction, so it
//!   is delivered only after COMMIT; each process `LISTEN`s on one
//!   connection and reads the committed rows by revision, so a lost
//!   notification costs latency, not correctness.

mod approvals;
mod backend;
mod calls;
mod check;
mod checkpoints;
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
mod projection;
mod purge;
mod queued;
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

pub use error::{PgStoreError, Result};
pub use lock::PgRuntimeLock;
pub use migrations::{
    migrate, migrate_with, schema_version, MigrationReport, MIGRATIONS, SCHEMA_VERSION,
};
pub use outline::{schema_definitions, schema_outline};
pub use pool::pool;
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
