//! `keel backup DEST` and `keel restore SRC`: a checked copy of a data
//! directory's database taken while keel runs, and its restore into a data
//! directory no keel is running on.
//!
//! Both check the copy as a snapshot of a running keel (its open turns and
//! live runs are what a start recovers), with the engine's decoder for every
//! state blob; a restore then runs that recovery itself, so the restored
//! directory is clean before anything starts on it.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use keel_store::{
    backup_database, describe_process, restore_database, CheckOptions, CopyProgress, CopyReport,
    RuntimeLock, Store, StoreError,
};

use crate::app::{create_data_dir, database_path};
use crate::config::Config;
use crate::error::{database_err, AppError, Result};
use crate::storage::Location;

/// Runs `keel backup DEST`.
pub async fn backup(
    config_file: Option<&Path>,
    data_dir: Option<&Path>,
    dest: &Path,
) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    let db = Location::of(&loaded.config)
        .sqlite_only(
            "keel backup",
            "back it up with pg_dump or the server's own backups (docs/DEPLOY.md)",
        )?
        .to_path_buf();
    if !db.exists() {
        return Err(AppError::InvalidInput(format!(
            "no keel database at {}",
            db.display()
        )));
    }
    println!("backing up {} to {}", db.display(), dest.display());
    let (source, to) = (db.clone(), dest.to_path_buf());
    let report = tokio::task::spawn_blocking(move || {
        backup_database(&source, &to, &options(), &mut progress_printer())
    })
    .await
    .map_err(|e| AppError::InvalidInput(format!("the backup stopped: {e}")))?
    .map_err(database_err(&db))?;
    print!("{}", summary("backed up", dest, &report));
    Ok(ExitCode::SUCCESS)
}

/// Runs `keel restore SRC`: refused while a keel runs on the data
/// directory, and over an existing database without `force`.
pub async fn restore(
    config_file: Option<&Path>,
    data_dir: Option<&Path>,
    source: &Path,
    force: bool,
) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    Location::of(&loaded.config).sqlite_only(
        "keel restore",
        "restore it with pg_restore, or `keel copy` a SQLite backup into it (docs/DEPLOY.md)",
    )?;
    let dir = loaded.config.data_dir();
    create_data_dir(&dir)?;
    let db = database_path(&dir);
    let lock = match RuntimeLock::acquire(&db, &describe_process("keel restore")) {
        Ok(lock) => lock,
        Err(StoreError::InUse { path, holder }) => {
            return Err(AppError::InvalidInput(format!(
                "{path} is in use by {holder}; stop it before restoring into its data directory"
            )))
        }
        Err(e) => return Err(database_err(&db)(e)),
    };
    if db.exists() && !force {
        return Err(AppError::InvalidInput(format!(
            "{} already holds a database; pass --force to replace it (it is kept beside as \
             keel.db.before-restore-<time>)",
            db.display()
        )));
    }
    println!("restoring {} into {}", source.display(), db.display());
    let (from, to) = (source.to_path_buf(), db.clone());
    let (lock, restored) = tokio::task::spawn_blocking(move || {
        let restored = restore_database(&from, &to, &lock, &options(), &mut progress_printer());
        (lock, restored)
    })
    .await
    .map_err(|e| AppError::InvalidInput(format!("the restore stopped: {e}")))?;
    let report = restored.map_err(database_err(source))?;
    print!("{}", summary("restored", &db, &report.copy));
    if let Some(previous) = report.previous {
        println!("the database it replaced is kept as {}", previous.display());
    }
    // What was in flight when the backup was taken is recovered now, as a
    // start would, while the lock still keeps every other keel away.
    let store = Store::open(&db, Default::default()).map_err(database_err(&db))?;
    let activation = store
        .activate_runtime(describe_process("keel restore"), keel_core::time::now_ms())
        .await?;
    let recovery = &activation.recovery;
    println!(
        "recovered what was in flight at the backup: {} inputs marked unanswered, {} runs \
         interrupted",
        recovery.unanswered_inputs,
        recovery.interrupted_runs.len()
    );
    drop(store);
    drop(lock);
    Ok(ExitCode::SUCCESS)
}

fn options() -> CheckOptions {
    CheckOptions {
        owner_alive: true,
        state_decoder: Some(Arc::new(keel_engine::SessionState::check_blob)),
    }
}

/// Prints progress on stderr at every tenth of the pages, and at the end.
fn progress_printer() -> impl FnMut(CopyProgress) {
    let mut shown = 0;
    move |p: CopyProgress| {
        let tenth = (p.copied_pages * 10)
            .checked_div(p.total_pages)
            .unwrap_or(10);
        if tenth > shown {
            shown = tenth;
            eprintln!("copied {}/{} pages", p.copied_pages, p.total_pages);
        }
    }
}

/// The summary the user reads after a backup or restore.
fn summary(done: &str, dest: &Path, report: &CopyReport) -> String {
    let c = report.check.checked;
    format!(
        "{done} {} ({} bytes, {} pages) in {:.2} s\n\
         checked the copy: {} sessions, {} messages, {} checkpoints, {} runs, {} inbox events: \
         every invariant holds\n",
        dest.display(),
        report.bytes,
        report.pages,
        report.elapsed.as_secs_f64(),
        c.sessions,
        c.messages,
        c.checkpoints,
        c.runs,
        c.events
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_what_was_copied_and_that_the_copy_is_clean() {
        let mut check = keel_store::InvariantReport::default();
        check.checked.sessions = 3;
        check.checked.messages = 19;
        check.checked.checkpoints = 9;
        let report = CopyReport {
            pages: 46,
            bytes: 188_416,
            elapsed: std::time::Duration::from_millis(110),
            check,
        };
        insta::assert_snapshot!(summary("backed up", Path::new("/b/keel.db"), &report), @r"
        backed up /b/keel.db (188416 bytes, 46 pages) in 0.11 s
        checked the copy: 3 sessions, 19 messages, 9 checkpoints, 0 runs, 0 inbox events: every invariant holds
        ");
    }
}
