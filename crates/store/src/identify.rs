//! Before keel writes a byte to a database file it makes sure the file is
//! keel's: not empty, an SQLite file, not another application's database,
//! not from a newer keel, its state tables within their CHECK constraints.
//! Anything else is refused with [`StoreError::NotKeel`] (or
//! [`StoreError::NewerSchema`], [`StoreError::Corruption`]) and the file is
//! left exactly as it was.
//!
//! For the same reason a new database is never created in place: it is
//! built and migrated under a temporary name and linked into place only
//! when complete, so an empty or half-initialized `keel.db` is never
//! keel's own doing, even after a crash.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use crate::error::{Result, StoreError};
use crate::migrations::{self, SCHEMA_VERSION};

/// `PRAGMA application_id` of a keel database ("keel" in ASCII).
pub(crate) const APPLICATION_ID: i32 = 0x6B65_656C;

/// The tables keel's own processes read in bulk (recovery, listings): their
/// rows are checked against their CHECK constraints at every open. Messages
/// are checked when read (their JSON content is parsed strictly).
const STATE_TABLES: [&str; 8] = [
    "sessions",
    "timelines",
    "checkpoints",
    "agent_run_groups",
    "agent_runs",
    "agent_inbox_events",
    "agent_session_state",
    "runtime_state",
];

/// What is at a database path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// Nothing: a new database may be created.
    Missing,
    /// A keel database at this schema version.
    Keel {
        /// `PRAGMA user_version`.
        version: u32,
    },
}

fn not_keel(why: impl Into<String>) -> StoreError {
    StoreError::NotKeel(why.into())
}

/// Looks at `path` without writing to it; with `check_rows`, also checks
/// the state tables' rows (see [`STATE_TABLES`]).
pub(crate) fn identify(path: &Path, check_rows: bool) -> Result<Found> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Missing),
        Err(e) => {
            return Err(StoreError::Io {
                attempts: 1,
                message: format!("cannot read {}: {e}", path.display()),
            })
        }
    };
    let meta = file.metadata().map_err(|e| StoreError::Io {
        attempts: 1,
        message: format!("cannot stat {}: {e}", path.display()),
    })?;
    if !meta.is_file() {
        return Err(not_keel("it is not a regular file"));
    }
    if meta.len() == 0 {
        return Err(not_keel(
            "the file is empty (0 bytes), which keel never leaves behind: \
             move it away to start a new database, or restore it from a backup",
        ));
    }
    let mut header = [0u8; 16];
    let read = file.read(&mut header).unwrap_or(0);
    if read < header.len() || &header != b"SQLite format 3\0" {
        return Err(not_keel(
            "it is not an SQLite database (its first bytes are not SQLite's header); \
             it may be damaged or another program's file",
        ));
    }
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(Duration::from_secs(5))?;
    let application_id: i32 = conn.query_row("PRAGMA application_id", [], |r| r.get(0))?;
    let version = migrations::user_version(&conn)?;
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    match application_id {
        APPLICATION_ID => {}
        // Databases keel created before it stamped its id: its tables, its versions.
        0 if tables.is_empty() && version == 0 => {}
        0 if version >= 1
            && ["sessions", "messages"]
                .iter()
                .all(|t| tables.iter().any(|n| n == t)) => {}
        0 => {
            let mut shown: Vec<&str> = tables.iter().map(String::as_str).take(5).collect();
            if tables.len() > shown.len() {
                shown.push("…");
            }
            return Err(not_keel(format!(
                "it is another application's SQLite database (no keel schema; its tables: {})",
                if shown.is_empty() {
                    "none".to_owned()
                } else {
                    shown.join(", ")
                }
            )));
        }
        other => {
            return Err(not_keel(format!(
                "it is another application's SQLite database (application_id {other:#010x})"
            )))
        }
    }
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema {
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    if check_rows && version == SCHEMA_VERSION {
        drop(conn);
        check_state_tables(&inspector(path)?)?;
    }
    Ok(Found::Keel { version })
}

/// A connection to a keel database that reads everything and writes
/// nothing, not even a checkpoint when it closes. Not read-only as SQLite
/// means it: a read-only connection skips CHECK constraints in its
/// integrity checks.
pub(crate) fn inspector(path: &Path) -> Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
        true,
    )?;
    conn.pragma_update(None, "query_only", "ON")?;
    conn.busy_timeout(Duration::from_secs(5))?;
    Ok(conn)
}

/// Every state table's rows hold its CHECK and NOT NULL constraints (an
/// unknown enum value is a row a newer or foreign program wrote).
fn check_state_tables(conn: &Connection) -> Result<()> {
    for table in STATE_TABLES {
        let problems: Vec<String> = conn
            .prepare(&format!("PRAGMA quick_check({table})"))?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        if problems.iter().any(|p| p != "ok") {
            return Err(StoreError::Corruption(format!(
                "table {table} holds a row keel cannot read (an unknown enum value or a broken \
                 constraint, written by a newer or another program): {}",
                problems.join("; ")
            )));
        }
    }
    Ok(())
}

/// Creates a new, fully migrated database at `path`: built under a
/// temporary name beside it, synced, then linked into place only if
/// nothing appeared there meanwhile (else that database is used).
pub(crate) fn create(path: &Path) -> Result<()> {
    let io = |what: &str, e: std::io::Error| StoreError::Io {
        attempts: 1,
        message: format!("cannot {what} for {}: {e}", path.display()),
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| StoreError::InvalidInput(format!("{} names no file", path.display())))?
        .to_string_lossy()
        .into_owned();
    sweep_stale(dir, &name);
    let tmp = dir.join(format!("{name}.new-{}", crate::util::fresh_id()));
    let result = (|| {
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        options
            .open(&tmp)
            .map_err(|e| io("create a temporary file", e))?;
        let mut conn = Connection::open(&tmp)?;
        migrations::migrate(&mut conn)?;
        conn.pragma_update(None, "application_id", APPLICATION_ID)?;
        conn.close().map_err(|(_, e)| StoreError::from(e))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| io("sync the new database", e))?;
        match std::fs::hard_link(&tmp, path) {
            Ok(()) => {}
            // Another opener linked its own first: use that one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("link the new database into place", e)),
        }
        #[cfg(unix)]
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("sync the data directory", e))?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&tmp);
    result
}

/// Removes temporary files of creations that crashed (older than a minute).
fn sweep_stale(dir: &Path, name: &str) {
    let prefix = format!("{name}.new-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(60));
        if stale && entry.file_name().to_string_lossy().starts_with(&prefix) {
            let path: PathBuf = entry.path();
            let _ = std::fs::remove_file(path);
        }
    }
}
