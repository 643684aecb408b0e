//! Forward-only schema migrations 1..=[`SCHEMA_VERSION`], one SQL file per
//! step, each applied in its own transaction together with
//! `PRAGMA user_version`.

use rusqlite::{Connection, TransactionBehavior};

use crate::error::{Result, StoreError};

/// The schema version this build reads and writes.
pub const SCHEMA_VERSION: u32 = 19;

/// The steps, in order: `MIGRATIONS[k - 1]` takes a database from version `k - 1` to `k`.
pub const MIGRATIONS: [&str; SCHEMA_VERSION as usize] = [
    include_str!("migrations/0001_dialogs_messages.sql"),
    include_str!("migrations/0002_session_tree_state.sql"),
    include_str!("migrations/0003_timelines_checkpoints.sql"),
    include_str!("migrations/0004_visibility_delivery.sql"),
    include_str!("migrations/0005_agent_runs_groups.sql"),
    include_str!("migrations/0006_inbox_session_state.sql"),
    include_str!("migrations/0007_runtime_generation.sql"),
    include_str!("migrations/0008_turn_inputs.sql"),
    include_str!("migrations/0009_queued_inputs.sql"),
    include_str!("migrations/0010_tool_approvals.sql"),
    include_str!("migrations/0011_spend_budgets.sql"),
    include_str!("migrations/0012_mcp_manifests.sql"),
    include_str!("migrations/0013_run_approvals.sql"),
    include_str!("migrations/0014_compression.sql"),
    include_str!("migrations/0015_call_spans.sql"),
    include_str!("migrations/0016_webhooks.sql"),
    include_str!("migrations/0017_images.sql"),
    include_str!("migrations/0018_runtime_processes.sql"),
    include_str!("migrations/0019_checkpoints_by_session.sql"),
];

/// A step whose SQL contains this line runs with foreign keys off: it
/// rebuilds a table other rows point at (SQLite cannot alter a CHECK).
const REBUILDS_TABLES: &str = "\n-- keel: foreign keys off for this step";

/// `PRAGMA user_version` of `conn`'s database.
pub fn user_version(conn: &Connection) -> Result<u32> {
    let v: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    u32::try_from(v).map_err(|_| StoreError::corrupt("user_version", v))
}

/// Brings `conn`'s database to [`SCHEMA_VERSION`]; returns the version it started at.
pub fn migrate(conn: &mut Connection) -> Result<u32> {
    migrate_with(conn, &MIGRATIONS)
}

/// Applies the real migrations up to version `target` only (fixtures of older versions in tests).
#[cfg(feature = "testing")]
pub fn migrate_to(conn: &mut Connection, target: u32) -> Result<u32> {
    let n = usize::try_from(target)
        .unwrap_or(usize::MAX)
        .min(MIGRATIONS.len());
    migrate_with(conn, &MIGRATIONS[..n])
}

/// Applies `steps` (step k takes version k-1 to k) from the database's current version.
pub fn migrate_with(conn: &mut Connection, steps: &[&str]) -> Result<u32> {
    let start = user_version(conn)?;
    let known = u32::try_from(steps.len()).unwrap_or(u32::MAX);
    if start > SCHEMA_VERSION.max(known) {
        return Err(StoreError::NewerSchema {
            found: start,
            supported: SCHEMA_VERSION,
        });
    }
    for (i, sql) in steps.iter().enumerate().skip(start as usize) {
        let version = u32::try_from(i + 1).unwrap_or(u32::MAX);
        apply(conn, version, sql).map_err(|e| StoreError::Migration {
            version,
            message: e.to_string(),
        })?;
        failpoint!("store::migration::after_commit");
        tracing::info!(version, "applied schema migration");
    }
    Ok(start)
}

fn apply(conn: &mut Connection, version: u32, sql: &str) -> Result<()> {
    // `foreign_keys` cannot change inside a transaction; the check below
    // still refuses a step that leaves a dangling reference.
    let rebuild = sql.contains(REBUILDS_TABLES);
    if rebuild {
        conn.pragma_update(None, "foreign_keys", "OFF")?;
    }
    let result = apply_step(conn, version, sql);
    if rebuild {
        conn.pragma_update(None, "foreign_keys", "ON")?;
    }
    result
}

fn apply_step(conn: &mut Connection, version: u32, sql: &str) -> Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    // Another process may have migrated meanwhile; the transaction holds the write lock now.
    if user_version(&tx)? >= version {
        return Ok(());
    }
    tx.execute_batch(sql)?;
    tx.pragma_update(None, "user_version", version)?;
    // Foreign keys cannot be deferred across ALTERs; check them before committing.
    let broken: i64 = tx.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| {
        r.get(0)
    })?;
    if broken > 0 {
        return Err(StoreError::Constraint(format!(
            "{broken} foreign key violations after migration {version}"
        )));
    }
    failpoint!("store::migration::before_commit");
    tx.commit()?;
    Ok(())
}
