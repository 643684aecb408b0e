//! One process owns a database at a time. [`RuntimeLock`] is an exclusive
//! lock on a file next to the database (the real file, past any symbolic
//! link), naming its holder, so a second process is refused before it
//! touches anything; [`Backend::activate_runtime`](crate::Backend::activate_runtime) then bumps the stored
//! runtime generation and recovers what older generations left unfinished,
//! in one transaction. From then on every write
//! of that store checks the generation: if a newer process activated (say the
//! lock file was deleted under a running process), the older one's writes are
//! refused instead of silently interleaving with the newer one's.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension};

use crate::error::{Result, StoreError};
use crate::runs::{recover_tx, RecoveryReport};
use crate::util::{non_negative, to_i64};
use crate::SqliteStore;

/// The exclusive lock of a database file, held for the life of a process's
/// runtime; released when dropped (or when the process dies, even by
/// `kill -9`: the operating system drops the lock with the file handle).
#[derive(Debug)]
pub struct RuntimeLock {
    path: PathBuf,
    _file: File,
}

impl RuntimeLock {
    /// Locks `<database>.lock` and records `holder` (who, for the error a
    /// second process gets) in it. The lock sits beside the file every
    /// symbolic link in `database` leads to, so two paths to one database
    /// take one lock. Fails with [`StoreError::InUse`] naming the current
    /// holder when another process has it, and with [`StoreError::ReadOnly`]
    /// when the lock file cannot be written there.
    pub fn acquire(database: &Path, holder: &str) -> Result<Self> {
        let resolved = crate::identify::resolve(database)?;
        let path = crate::identify::sibling(&resolved, ".lock");
        let io = |e: std::io::Error| StoreError::Io {
            attempts: 1,
            message: format!("lock file {}: {e}", path.display()),
        };
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path);
        let mut file = match opened {
            Ok(file) => file,
            Err(e) if is_read_only(&e) => {
                return Err(StoreError::ReadOnly(format!(
                    "cannot write the lock file {} ({e}); keel must write beside its database",
                    path.display()
                )))
            }
            Err(e) => return Err(io(e)),
        };
        match try_lock(&file) {
            Ok(true) => {}
            Ok(false) => {
                let mut text = String::new();
                // The holder writes its line right after locking; an empty
                // file means it has not yet.
                let _ = file.read_to_string(&mut text);
                let holder = text.trim();
                let shown = if resolved == database {
                    database.display().to_string()
                } else {
                    format!("{} (the file {})", database.display(), resolved.display())
                };
                return Err(StoreError::InUse {
                    path: shown,
                    holder: if holder.is_empty() {
                        "holder unknown".to_owned()
                    } else {
                        holder.to_owned()
                    },
                });
            }
            Err(e) => return Err(io(e)),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        file.write_all(holder.as_bytes()).map_err(io)?;
        file.flush().map_err(io)?;
        Ok(Self { path, _file: file })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes an exclusive advisory lock on `file` without waiting; false when
/// another open file holds it.
#[cfg(unix)]
fn try_lock(file: &File) -> std::io::Result<bool> {
    use rustix::fs::{flock, FlockOperation};
    match flock(file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Without flock the lock file only names the holder; the generation fence
/// still refuses a superseded process's writes.
#[cfg(not(unix))]
fn try_lock(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}

/// Whether opening a file failed because nothing may be written there.
fn is_read_only(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::PermissionDenied
        || e.kind() == std::io::ErrorKind::ReadOnlyFilesystem
}

/// Who this process is, for lock files and the stored holder:
/// `<what> (pid <pid> on <host>)`.
pub fn describe_process(what: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "an unknown host".to_owned());
    format!("{what} (pid {} on {host})", std::process::id())
}

/// What [`Backend::activate_runtime`](crate::Backend::activate_runtime) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activation {
    /// The generation this process now owns; greater than every generation
    /// any earlier process activated or stamped on a run.
    pub generation: u64,
    /// The holder of the previous generation, if any process activated before.
    pub previous_holder: Option<String>,
    /// What recovery of the older generations changed.
    pub recovery: RecoveryReport,
}

/// The stored generation and its holder.
fn current(conn: &Connection) -> Result<Option<(u64, String)>> {
    conn.prepare_cached("SELECT generation, holder FROM runtime_state WHERE id = 1")?
        .query_row([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
        .optional()?
        .map(|(g, h)| Ok((non_negative("runtime_state.generation", g)?, h)))
        .transpose()
}

/// Refuses a write of generation `ours` once a newer one activated (0 = not fenced).
pub(crate) fn check_fence(conn: &Connection, ours: u64) -> Result<()> {
    if ours == 0 {
        return Ok(());
    }
    match current(conn)? {
        Some((current, holder)) if current != ours => Err(StoreError::Fenced {
            ours,
            current,
            holder,
        }),
        _ => Ok(()),
    }
}

fn activate_tx(
    conn: &Connection,
    holder: &str,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<Activation> {
    let previous = current(conn)?;
    // Runs stamped by builds that used wall-clock generations stay older.
    let stamped: i64 = conn.query_row(
        "SELECT max(coalesce((SELECT max(runtime_generation) FROM agent_runs), 0), \
                    coalesce((SELECT max(runtime_generation) FROM agent_run_groups), 0))",
        [],
        |r| r.get(0),
    )?;
    let stored = previous.as_ref().map_or(0, |(g, _)| *g);
    let generation = stored
        .max(non_negative("agent_runs.runtime_generation", stamped)?)
        .checked_add(1)
        .ok_or_else(|| StoreError::corrupt("runtime_state.generation", "overflow"))?;
    conn.execute(
        "INSERT INTO runtime_state (id, generation, holder, activated_at) VALUES (1, ?1, ?2, ?3) \
         ON CONFLICT (id) DO UPDATE SET generation = ?1, holder = ?2, activated_at = ?3",
        params![to_i64("generation", generation)?, holder, now_ms],
    )?;
    // The lock says no other process runs: every lease was held by a
    // process that is gone, expired or not.
    let mut recovery = recover_tx(conn, generation, now_ms, true, webhook_urls)?;
    // Turn inputs an older process committed but never answered. Only here,
    // where no turn of this process runs yet, may every open input be closed.
    let closed: Vec<(String, String, i64)> = conn
        .prepare_cached(crate::messages::CLOSE_INTERRUPTED_SQL)?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    for (session, timeline, seq) in &closed {
        let session = crate::util::parse("messages.session_id", session)?;
        crate::webhooks::unanswered_deliveries_tx(
            conn,
            &session,
            timeline,
            *seq,
            now_ms,
            webhook_urls,
        )?;
    }
    recovery.unanswered_inputs = closed.len() as u64;
    Ok(Activation {
        generation,
        previous_holder: previous.map(|(_, h)| h),
        recovery,
    })
}

impl SqliteStore {
    pub(crate) async fn activate_runtime(&self, holder: String, now_ms: i64) -> Result<Activation> {
        let urls = self.webhook_urls();
        let activation = self
            .db
            .write(move |c| {
                let activation = activate_tx(c, &holder, now_ms, &urls)?;
                failpoint!("store::activate::before_commit");
                Ok(activation)
            })
            .await?;
        self.db.set_fence(activation.generation);
        Ok(activation)
    }

    pub(crate) async fn runtime_generation(&self) -> Result<Option<(u64, String)>> {
        self.db.read(current).await
    }
}
