//! The PostgreSQL storage of keel (foundation).
//!
//! What exists: the schema — migrations 1..=[`SCHEMA_VERSION`], the same
//! versions, tables, columns, CHECKs, unique and partial indexes as
//! keel-store's SQLite schema, checked against it by a parity test — and
//! [`migrate`], which applies them forward-only, one transaction per step,
//! and refuses a database at a newer version; the schema outline the parity
//! test compares; and the test harness ([`testing`], feature `testing`).
//! No store transaction, no configuration key and no CLI command uses it
//! yet.

mod error;
mod migrations;
mod outline;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::{PgStoreError, Result};
pub use migrations::{
    migrate, migrate_with, schema_version, MigrationReport, MIGRATIONS, SCHEMA_VERSION,
};
pub use outline::{schema_definitions, schema_outline};

/// Re-exported so callers need no tokio-postgres dependency of their own.
pub use tokio_postgres;
