//! Who may work on a PostgreSQL database at once: [`PgRuntimeLock`] is a
//! session-level advisory lock held by a connection of its own for the
//! life of the process's runtime, shared by the `keel serve` processes
//! (several serve one database together, see `runtime.rs`) and exclusive
//! for the commands that need the database to themselves (`keel doctor
//! --repair`, a copy's target). PostgreSQL drops it when that connection
//! ends — the process exits, is killed, or loses the server — so a dead
//! process never keeps the database. The holder's name is the connection's
//! `application_name`, which a refused process reads back to say who runs
//! there.
//!
//! The lock only keeps exclusive commands and runtimes apart: what the
//! runtimes do is kept consistent by their registrations and fences.

use keel_store::{Result, StoreError};

use crate::store::{from_pg, from_pg_store, from_pool};

/// The advisory lock key of keel's runtime ("keelrunt").
const RUNTIME_LOCK: i64 = 0x6b65_656c_7275_6e74;

/// `application_name` is at most 63 bytes (NAMEDATALEN - 1).
const MAX_NAME: usize = 63;

/// The runtime lock of a PostgreSQL database; released when dropped.
pub struct PgRuntimeLock {
    // Held, never used again: dropping it closes the connection.
    _client: deadpool_postgres::ClientWrapper,
}

impl std::fmt::Debug for PgRuntimeLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgRuntimeLock").finish_non_exhaustive()
    }
}

impl PgRuntimeLock {
    /// Takes the lock for `holder` on the database `url` names, on a
    /// connection of its own, before anything is migrated or written;
    /// fails with [`StoreError::InUse`] naming the current holder when
    /// another process has it.
    pub async fn acquire(url: &str, holder: &str) -> Result<Self> {
        Self::take(url, holder, false).await
    }

    /// Takes the lock in shared mode (several `keel serve` processes hold
    /// it at once); fails with [`StoreError::InUse`] while an exclusive
    /// holder has it.
    pub async fn acquire_shared(url: &str, holder: &str) -> Result<Self> {
        Self::take(url, holder, true).await
    }

    async fn take(url: &str, holder: &str, shared: bool) -> Result<Self> {
        let pool = crate::pool(url, 1).map_err(from_pg_store)?;
        let pooled = pool.get().await.map_err(from_pool)?;
        let client = deadpool_postgres::Object::take(pooled);
        let name = application_name(holder);
        client
            .execute("SELECT set_config('application_name', $1, false)", &[&name])
            .await
            .map_err(from_pg)?;
        let try_lock = if shared {
            "SELECT pg_try_advisory_lock_shared($1)"
        } else {
            "SELECT pg_try_advisory_lock($1)"
        };
        let row = client
            .query_one(try_lock, &[&RUNTIME_LOCK])
            .await
            .map_err(from_pg)?;
        if row.get::<_, bool>(0) {
            return Ok(Self { _client: client });
        }
        let holder = client
            .query_opt(
                "SELECT string_agg(a.application_name, ', ' ORDER BY a.application_name) \
                 FROM pg_locks l \
                 JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND l.granted \
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                   AND l.classid = ($1::bigint >> 32)::oid AND l.objid = ($1::bigint & 4294967295)::oid",
                &[&RUNTIME_LOCK],
            )
            .await
            .map_err(from_pg)?
            .and_then(|r| r.get::<_, Option<String>>(0))
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "holder unknown".to_owned());
        Err(StoreError::InUse {
            path: crate::redacted(url),
            holder,
        })
    }
}

/// `holder` as PostgreSQL keeps an `application_name`: printable ASCII
/// (it shows anything else as `?`, byte by byte; here one `?` a
/// character), at most [`MAX_NAME`] bytes.
fn application_name(holder: &str) -> String {
    holder
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .take(MAX_NAME)
        .collect()
}
