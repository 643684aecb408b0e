//! Hot backup and restore of a database file.
//!
//! [`backup_database`] copies a database while another process (a running
//! `keel serve`) keeps committing to it: the source is opened read-only
//! beside the writer (WAL lets a reader run next to it) and copied with
//! SQLite's online backup API in bounded steps. One read transaction spans
//! every step, so the copy is the database exactly as it was when the copy
//! began — every turn committed before it, none half — and other processes'
//! commits neither wait for it nor restart it (the WAL grows meanwhile and is
//! checkpointed after). The copy is written under a temporary name with
//! private permissions, checked with [`check_database`], synced, and linked
//! into place only when clean; an existing destination is never overwritten.
//!
//! [`restore_database`] makes the same verified copy of a backup beside the
//! database it replaces, then moves it into place with one rename while the
//! caller holds the database's [`RuntimeLock`]; the previous database is kept
//! under another name.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::backup::{Backup, StepResult};
use rusqlite::Connection;

use crate::check::{check_database, CheckOptions, InvariantReport};
use crate::error::{Result, StoreError};
use crate::identify::{self, sibling, Found};
use crate::runtime::RuntimeLock;

/// Pages copied per step (about 2 MiB of a new database's 8 KiB pages).
const PAGES_PER_STEP: i32 = 256;
/// How long to wait before retrying a step the destination's lock refused.
const BUSY_PAUSE: Duration = Duration::from_millis(10);
/// Steps retried on a busy or locked destination before giving up.
const BUSY_STEPS: u32 = 500;

/// How far a copy has come, reported after every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyProgress {
    /// Pages copied so far.
    pub copied_pages: u64,
    /// Pages in the source snapshot.
    pub total_pages: u64,
}

/// What a backup or restore copied, and the checker's verdict on the copy.
#[derive(Debug, Clone)]
pub struct CopyReport {
    /// Pages copied.
    pub pages: u64,
    /// Size of the copy in bytes.
    pub bytes: u64,
    /// How long copying and checking took.
    pub elapsed: Duration,
    /// [`check_database`] on the copy (clean, or the copy was not kept).
    pub check: InvariantReport,
}

/// What [`restore_database`] did.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    /// The copy now in place.
    pub copy: CopyReport,
    /// Where the database it replaced was kept, if there was one.
    pub previous: Option<PathBuf>,
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> StoreError {
    move |e| StoreError::Io {
        attempts: 1,
        message: format!("{what}: {e}"),
    }
}

/// Copies the keel database at `source` to the new file `dest` while other
/// processes keep writing to it; `dest` appears only complete and clean.
pub fn backup_database(
    source: &Path,
    dest: &Path,
    options: &CheckOptions,
    progress: &mut dyn FnMut(CopyProgress),
) -> Result<CopyReport> {
    if std::fs::symlink_metadata(dest).is_ok() {
        return Err(StoreError::Conflict(format!(
            "{} already exists; a backup never overwrites a file: name a new one",
            dest.display()
        )));
    }
    require_keel(source)?;
    let tmp = Temporary::beside(dest)?;
    let report = verified_copy(source, &tmp.0, options, progress)?;
    match std::fs::hard_link(&tmp.0, dest) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(StoreError::Conflict(format!(
                "{} appeared while the backup ran; the copy was discarded",
                dest.display()
            )))
        }
        Err(e) => return Err(io(format!("cannot link the copy to {}", dest.display()))(e)),
    }
    sync_dir(dest)?;
    Ok(report)
}

/// Replaces the database at `dest` with a verified copy of the keel
/// database `source`, in one rename, while `lock` (on `dest`) keeps every
/// other keel away; the replaced database is kept beside it.
pub fn restore_database(
    source: &Path,
    dest: &Path,
    lock: &RuntimeLock,
    options: &CheckOptions,
    progress: &mut dyn FnMut(CopyProgress),
) -> Result<RestoreReport> {
    let dest = identify::resolve(dest)?;
    if lock.path() != sibling(&dest, ".lock") {
        return Err(StoreError::InvalidInput(format!(
            "the lock {} is not {}'s",
            lock.path().display(),
            dest.display()
        )));
    }
    require_keel(source)?;
    let tmp = Temporary::beside(&dest)?;
    let copy = verified_copy(source, &tmp.0, options, progress)?;
    let previous = match std::fs::symlink_metadata(&dest) {
        Ok(_) => Some(set_aside(&dest)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(format!("cannot stat {}", dest.display()))(e)),
    };
    std::fs::rename(&tmp.0, &dest)
        .map_err(io(format!("cannot move the copy to {}", dest.display())))?;
    sync_dir(&dest)?;
    Ok(RestoreReport { copy, previous })
}

/// Refuses a `path` that holds no keel database.
fn require_keel(path: &Path) -> Result<()> {
    match identify::identify(path, false)? {
        Found::Missing => Err(StoreError::NotFound(format!("database {}", path.display()))),
        Found::Keel { .. } => Ok(()),
    }
}

/// Keeps the database at `dest` as `<dest>.before-restore-<unix seconds>`
/// (a second name for the same file, so `dest` never goes missing), with
/// everything its WAL held moved into it first and the WAL and its index
/// then removed, so that they cannot be applied to the file that replaces it.
fn set_aside(dest: &Path) -> Result<PathBuf> {
    let wal = sibling(dest, "-wal");
    if std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
        let conn = Connection::open(dest)?;
        let (busy, _, _): (i64, i64, i64) =
            conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })?;
        if busy != 0 {
            return Err(StoreError::Busy {
                attempts: 1,
                message: format!("another connection keeps {} busy", dest.display()),
            });
        }
        conn.close().map_err(|(_, e)| StoreError::from(e))?;
    }
    for file in [wal, sibling(dest, "-shm")] {
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(format!("cannot remove {}", file.display()))(e)),
        }
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let kept = sibling(dest, &format!(".before-restore-{stamp}"));
    std::fs::hard_link(dest, &kept).map_err(io(format!(
        "cannot keep the replaced database as {}",
        kept.display()
    )))?;
    Ok(kept)
}

/// Copies `source` into the new file `tmp` from one read snapshot, in
/// bounded steps, then checks the copy; an unclean copy is an error.
fn verified_copy(
    source: &Path,
    tmp: &Path,
    options: &CheckOptions,
    progress: &mut dyn FnMut(CopyProgress),
) -> Result<CopyReport> {
    let started = Instant::now();
    let pages = copy_pages(source, tmp, progress)?;
    let check = check_database(tmp, options)?;
    if !check.is_clean() {
        let findings: Vec<String> = check
            .findings
            .iter()
            .map(|f| format!("{}: {}", f.invariant.name(), f.detail))
            .collect();
        return Err(StoreError::Corruption(format!(
            "the copy of {} fails the check ({}); it was discarded",
            source.display(),
            findings.join("; ")
        )));
    }
    std::fs::File::open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(io(format!("cannot sync {}", tmp.display())))?;
    let bytes = std::fs::metadata(tmp)
        .map_err(io(format!("cannot stat {}", tmp.display())))?
        .len();
    Ok(CopyReport {
        pages,
        bytes,
        elapsed: started.elapsed(),
        check,
    })
}

/// The online backup of `source` into `tmp`; returns the pages copied.
fn copy_pages(source: &Path, tmp: &Path, progress: &mut dyn FnMut(CopyProgress)) -> Result<u64> {
    let from = identify::inspector(source)?;
    // Held across every step: the copy is this one snapshot, and commits
    // of other connections do not restart it.
    let snapshot = from.unchecked_transaction()?;
    snapshot.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
    let mut to = Connection::open(tmp)?;
    let backup = Backup::new(&from, &mut to)?;
    let mut busy = 0;
    loop {
        let step = backup.step(PAGES_PER_STEP)?;
        let p = backup.progress();
        let total = u64::try_from(p.pagecount).unwrap_or(0);
        let remaining = u64::try_from(p.remaining).unwrap_or(0);
        match step {
            StepResult::Done => {
                progress(CopyProgress {
                    copied_pages: total,
                    total_pages: total,
                });
                break;
            }
            StepResult::More => {
                progress(CopyProgress {
                    copied_pages: total.saturating_sub(remaining),
                    total_pages: total,
                });
                std::thread::yield_now();
            }
            // The destination is a new private file; another connection to
            // it is someone else's mistake, given a little time to go away.
            StepResult::Busy | StepResult::Locked if busy < BUSY_STEPS => {
                busy += 1;
                std::thread::sleep(BUSY_PAUSE);
            }
            StepResult::Busy | StepResult::Locked => {
                return Err(StoreError::Busy {
                    attempts: busy,
                    message: format!("{} stayed locked during the copy", tmp.display()),
                })
            }
            _ => {}
        }
    }
    let pages = u64::try_from(backup.progress().pagecount).unwrap_or(0);
    drop(backup);
    drop(snapshot);
    to.close().map_err(|(_, e)| StoreError::from(e))?;
    Ok(pages)
}

/// A temporary file beside a destination, removed (with any `-wal`,
/// `-shm` or `-journal` SQLite left) when dropped.
struct Temporary(PathBuf);

impl Temporary {
    /// Creates `<dest>.new-<id>`, readable by the owner only.
    fn beside(dest: &Path) -> Result<Self> {
        let path = sibling(dest, &format!(".new-{}", crate::util::fresh_id()));
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        options
            .open(&path)
            .map_err(io(format!("cannot create {}", path.display())))?;
        Ok(Self(path))
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let _ = std::fs::remove_file(sibling(&self.0, suffix));
        }
    }
}

/// Syncs the directory holding `path`, so a link or rename in it is durable.
fn sync_dir(path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(format!("cannot sync {}", dir.display())))?;
    Ok(())
}
