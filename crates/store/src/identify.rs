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

/// Page size of a database keel creates.
pub(crate) const PAGE_SIZE: u32 = 8192;

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

/// The file a database path names, with every symbolic link followed —
/// also to a file not created yet — and its directory made absolute, so
/// that two paths to one database give one answer (one lock, one place for
/// the WAL SQLite keeps beside the real file).
pub(crate) fn resolve(path: &Path) -> Result<PathBuf> {
    let io = |what: &Path, e: std::io::Error| StoreError::Io {
        attempts: 1,
        message: format!("cannot resolve {}: {e}", what.display()),
    };
    let mut current = path.to_path_buf();
    // The kernel's own limit on links followed in one lookup.
    for _ in 0..40 {
        match std::fs::symlink_metadata(&current) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(&current).map_err(|e| io(&current, e))?;
                current = match current.parent() {
                    Some(dir) => dir.join(target),
                    None => target,
                };
            }
            Ok(_) => return absolute_dir(&current).map_err(|e| io(&current, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return absolute_dir(&current).map_err(|e| io(&current, e))
            }
            Err(e) => return Err(io(&current, e)),
        }
    }
    Err(io(
        path,
        std::io::Error::other("too many levels of symbolic links"),
    ))
}

/// `path` with its directory canonicalized (the file itself may not exist).
fn absolute_dir(path: &Path) -> std::io::Result<PathBuf> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file")
    })?;
    Ok(std::fs::canonicalize(dir)?.join(name))
}

/// What kind of file `meta` is, when it is not a regular file.
fn odd_kind(meta: &std::fs::Metadata) -> Option<&'static str> {
    #[cfg(unix)]
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    if kind.is_file() {
        return None;
    }
    if kind.is_dir() {
        return Some("a directory");
    }
    #[cfg(unix)]
    {
        if kind.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if kind.is_socket() {
            return Some("a socket");
        }
        if kind.is_block_device() || kind.is_char_device() {
            return Some("a device");
        }
    }
    Some("a special file")
}

/// The refusal of a database file that has more than one name (hard
/// link): SQLite keeps the WAL, its shared memory and keel's lock beside
/// the name it opens, so two names would be two owners and two logs of
/// one file, and commits in one log unseen through the other.
fn other_names(path: &Path, meta: &std::fs::Metadata) -> Option<StoreError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let links = meta.nlink();
        (links > 1).then(|| {
            StoreError::Conflict(format!(
                "{} has {links} names (hard links); keel keeps its write-ahead log and lock \
                 beside a database's name, so each name would be another owner and another log: \
                 keep one name (`find / -samefile {}` lists them) or copy the file",
                path.display(),
                path.display()
            ))
        })
    }
    #[cfg(not(unix))]
    {
        let _ = (path, meta);
        None
    }
}

/// The schema version of the keel database at `path`, read without
/// writing to it; `None` when there is no file there yet.
pub fn database_version(path: &Path) -> Result<Option<u32>> {
    match identify(&resolve(path)?, false)? {
        Found::Missing => Ok(None),
        Found::Keel { version } => Ok(Some(version)),
    }
}

/// Looks at `path` without writing to it; with `check_rows`, also checks
/// the state tables' rows (see [`STATE_TABLES`]).
pub(crate) fn identify(path: &Path, check_rows: bool) -> Result<Found> {
    let io = |what: &str, e: std::io::Error| StoreError::Io {
        attempts: 1,
        message: format!("cannot {what} {}: {e}", path.display()),
    };
    // Looked at before it is opened: opening a FIFO for reading waits for a writer forever.
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Missing),
        Err(e) => return Err(io("stat", e)),
    };
    if let Some(kind) = odd_kind(&meta) {
        return Err(not_keel(format!(
            "it is {kind}, not a regular file; move it away to start a new database"
        )));
    }
    if let Some(refusal) = other_names(path, &meta) {
        return Err(refusal);
    }
    let mut file = std::fs::File::open(path).map_err(|e| io("read", e))?;
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
    let conn = inspector(path)?;
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

/// A read-only connection to a database that works where nothing may be
/// written (a read-only mount, a directory or file the user cannot write)
/// and never writes, not even a checkpoint when it closes.
///
/// In WAL mode SQLite reads through the `-shm` file beside the database and
/// creates it when missing; where it cannot, the open fails. Then, if no
/// WAL file holds commits (keel's last connection checkpoints and removes
/// it), everything is in the main file and it is read as `immutable`, which
/// needs no `-shm`; a WAL with commits cannot be read without one, which is
/// [`StoreError::ReadOnly`].
pub(crate) fn inspector(path: &Path) -> Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    // The first read opens the WAL and its index, if any.
    match conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(())) {
        Ok(()) => return Ok(conn),
        Err(rusqlite::Error::SqliteFailure(f, _)) if f.code == rusqlite::ErrorCode::CannotOpen => {}
        Err(e) => return Err(e.into()),
    }
    drop(conn);
    let wal = sibling(path, "-wal");
    if std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
        return Err(StoreError::ReadOnly(format!(
            "its WAL {} holds commits that SQLite can read only through {}, which it cannot \
             create here; copy the data directory somewhere writable and check the copy",
            wal.display(),
            sibling(path, "-shm").display()
        )));
    }
    let conn = Connection::open_with_flags(
        file_uri(path, "immutable=1"),
        flags | OpenFlags::SQLITE_OPEN_URI,
    )?;
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
    Ok(conn)
}

/// `<path><suffix>`: the database's WAL, shared-memory or lock file.
pub(crate) fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// An SQLite `file:` URI for `path` with `query`; every byte a URI path
/// may not hold as it is (`?`, `#`, `%`, controls, non-ASCII) percent-encoded.
fn file_uri(path: &Path, query: &str) -> String {
    use std::fmt::Write as _;
    let mut uri = String::from("file:");
    for &b in path.as_os_str().as_encoded_bytes() {
        if b.is_ascii_graphic() && !matches!(b, b'?' | b'#' | b'%') {
            uri.push(char::from(b));
        } else {
            let _ = write!(uri, "%{b:02X}");
        }
    }
    uri.push('?');
    uri.push_str(query);
    uri
}

/// Every state table's rows hold its CHECK and NOT NULL constraints (an
/// unknown enum value is a row a newer or foreign program wrote).
fn check_state_tables(conn: &Connection) -> Result<()> {
    for table in STATE_TABLES {
        let mut problems: Vec<String> = conn
            .prepare(&format!("PRAGMA quick_check({table})"))?
            .query_map([], |r| r.get(0))?
            .filter(|p| !matches!(p.as_deref(), Ok("ok")))
            .collect::<rusqlite::Result<_>>()?;
        problems.extend(
            crate::constraints::violations(conn, table)?
                .iter()
                .map(ToString::to_string),
        );
        if !problems.is_empty() {
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
        // Freed pages go back in steps (`Store::reclaim_pages`). 8 KiB pages:
        // a compressed message row is ~1 KB, and a 4 KiB page left a
        // quarter of itself unused at the end. Both can only be chosen
        // before the first table exists (older databases keep theirs).
        conn.execute_batch(&format!(
            "PRAGMA page_size = {PAGE_SIZE}; PRAGMA auto_vacuum = INCREMENTAL"
        ))?;
        migrations::migrate(&mut conn)?;
        conn.pragma_update(None, "application_id", APPLICATION_ID)?;
        conn.close().map_err(|(_, e)| StoreError::from(e))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| io("sync the new database", e))?;
        match std::fs::hard_link(&tmp, path) {
            // Unlinked at once: a database with two names is refused.
            Ok(()) => std::fs::remove_file(&tmp).map_err(|e| io("remove the temporary file", e))?,
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
