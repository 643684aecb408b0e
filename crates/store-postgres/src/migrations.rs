//! Forward-only schema migrations 1..=[`SCHEMA_VERSION`], the same steps as
//! keel-store's SQLite migrations translated to PostgreSQL, one SQL file
//! per step, each applied in its own transaction together with the
//! one-row `schema_version` table (SQLite's `PRAGMA user_version`).
//! Concurrent migrators are serialized by a transaction-scoped advisory lock.

use tokio_postgres::Client;

use crate::error::{PgStoreError, Result};

/// The schema version this build reads and writes (keel-store's v19).
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

/// The advisory lock key every migration transaction takes ("keelmigr").
const MIGRATION_LOCK: i64 = 0x6b65_656c_6d69_6772;

/// What [`migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// The version the database was at.
    pub from: u32,
    /// The versions applied by this call, in order (empty: it was up to date).
    pub applied: Vec<u32>,
    /// The version it is at now.
    pub to: u32,
}

/// Brings `client`'s database to [`SCHEMA_VERSION`]; refuses a newer one.
pub async fn migrate(client: &Client) -> Result<MigrationReport> {
    migrate_with(client, &MIGRATIONS).await
}

/// Applies `steps` (step k takes version k-1 to k) from the database's current version.
pub async fn migrate_with(client: &Client, steps: &[&str]) -> Result<MigrationReport> {
    let from = in_transaction(client, bookkeeping(client)).await?;
    let known = u32::try_from(steps.len()).unwrap_or(u32::MAX);
    if from > SCHEMA_VERSION.max(known) {
        return Err(PgStoreError::NewerSchema {
            found: from,
            supported: SCHEMA_VERSION,
        });
    }
    let mut applied = Vec::new();
    for (i, sql) in steps.iter().enumerate().skip(from as usize) {
        let version = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let done = in_transaction(client, apply_step(client, version, sql))
            .await
            .map_err(|e| PgStoreError::Migration {
                version,
                message: describe(&e),
            })?;
        if done {
            tracing::info!(version, "applied schema migration (PostgreSQL)");
            applied.push(version);
        }
    }
    let to = in_transaction(client, bookkeeping(client)).await?;
    Ok(MigrationReport { from, applied, to })
}

/// The schema version of `client`'s database (0: keel never migrated it).
pub async fn schema_version(client: &Client) -> Result<u32> {
    let exists: bool = client
        .query_one("SELECT to_regclass('schema_version') IS NOT NULL", &[])
        .await?
        .get(0);
    if !exists {
        return Ok(0);
    }
    let row = client
        .query_one("SELECT version FROM schema_version WHERE id = 1", &[])
        .await?;
    version_of(row.get(0))
}

fn version_of(v: i64) -> Result<u32> {
    u32::try_from(v).map_err(|_| PgStoreError::Corruption {
        what: "schema_version.version",
        value: v.to_string(),
    })
}

/// Creates the bookkeeping row if missing; returns the current version.
async fn bookkeeping(client: &Client) -> Result<u32> {
    client
        .execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_version (\
                 id BIGINT PRIMARY KEY CHECK (id = 1), \
                 version BIGINT NOT NULL CHECK (version >= 0)); \
             INSERT INTO schema_version (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
        )
        .await?;
    let row = client
        .query_one("SELECT version FROM schema_version WHERE id = 1", &[])
        .await?;
    version_of(row.get(0))
}

/// Applies one step unless another migrator did meanwhile; true if it did.
async fn apply_step(client: &Client, version: u32, sql: &str) -> Result<bool> {
    if bookkeeping(client).await? >= version {
        return Ok(false);
    }
    client.batch_execute(sql).await?;
    client
        .execute(
            "UPDATE schema_version SET version = $1 WHERE id = 1",
            &[&i64::from(version)],
        )
        .await?;
    Ok(true)
}

/// Runs `work` between BEGIN and COMMIT, rolling back when it fails.
async fn in_transaction<T>(
    client: &Client,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    client.batch_execute("BEGIN").await?;
    match work.await {
        Ok(v) => {
            client.batch_execute("COMMIT").await?;
            Ok(v)
        }
        Err(e) => {
            if let Err(rollback) = client.batch_execute("ROLLBACK").await {
                tracing::warn!(error = %rollback, "ROLLBACK after a failed migration step failed");
            }
            Err(e)
        }
    }
}

/// The server's message (and detail) rather than tokio-postgres' "db error".
fn describe(e: &PgStoreError) -> String {
    if let PgStoreError::Postgres(pg) = e {
        if let Some(db) = pg.as_db_error() {
            return match db.detail() {
                Some(detail) => format!("{} ({detail})", db.message()),
                None => db.message().to_owned(),
            };
        }
    }
    e.to_string()
}
