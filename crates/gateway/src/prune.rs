//! `keel prune`: applies `[session.retention]` now, as a running keel does
//! in the background, and says what it removed. It holds the data
//! directory's runtime lock, so it is refused while a keel runs there
//! (that keel prunes on its own); every batch is its own transaction, so
//! an interrupted prune leaves a consistent database and the next one
//! carries on. `keel compact-storage` (below) compresses old rows and
//! rebuilds the file.

use std::path::Path;
use std::process::ExitCode;

use keel_engine::RetentionPolicy;
use keel_store::{describe_process, RuntimeLock, Store};

use crate::config::Config;
use crate::error::{database_err, AppError, Result};
use crate::storage::Location;

/// Runs `keel prune`; prints what was removed.
pub async fn run(config_file: Option<&Path>, data_dir: Option<&Path>) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    Location::existing(&loaded.config)?;
    let policy = loaded.config.retention_policy();
    if policy == RetentionPolicy::default() {
        println!(
            "retention is off (session.retention.keep_checkpoints = 0 and \
             purge_deleted_after_days = 0): nothing pruned"
        );
        return Ok(ExitCode::SUCCESS);
    }
    let (lock, store) = crate::storage::open_exclusive("keel prune", &loaded.config).await?;
    let r = keel_engine::apply_retention(&store, policy, keel_core::time::now_ms()).await?;
    let days = loaded.config.session.retention.purge_deleted_after_days;
    if policy.purge_deleted_after.is_some() {
        let p = &r.purged;
        let kept = if p.dialogs_kept_for_forks > 0 {
            format!(
                "; {} deleted dialog(s) keep the history a fork shares",
                p.dialogs_kept_for_forks
            )
        } else {
            String::new()
        };
        println!(
            "purged {} dialog(s) deleted more than {days} day(s) ago: {} messages, \
             {} checkpoints, {} runs, {} inbox events and {} state blobs removed{kept}",
            p.dialogs, p.messages, p.checkpoints, p.runs, p.events, p.blobs
        );
    }
    if let Some(keep) = policy.keep_checkpoints {
        let removed = &r.removed;
        println!(
            "pruned {} dialog(s) to their newest {keep} turn checkpoints: {} checkpoints, \
             {} messages, {} timelines and {} state blobs removed",
            r.sessions,
            removed.checkpoints_deleted,
            removed.messages_deleted,
            removed.timelines_deleted,
            removed.blobs_deleted,
        );
    }
    println!("{} pages given back", r.pages_reclaimed);
    if r.dictionary.is_some() {
        println!("trained the database's compression dictionary");
    }
    drop(store);
    drop(lock);
    Ok(ExitCode::SUCCESS)
}

/// Rows a `keel compact-storage` transaction compresses.
const COMPACT_BATCH: usize = 500;

/// Runs `keel compact-storage`: compresses rows stored before compression,
/// in bounded batches, then rebuilds the file (`keel_store::compact_database`).
pub async fn compact(config_file: Option<&Path>, data_dir: Option<&Path>) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    let location = Location::of(&loaded.config);
    let db = location
        .sqlite_only(
            "keel compact-storage",
            "PostgreSQL compresses large values itself (TOAST) and autovacuum reclaims space",
        )?
        .to_path_buf();
    if !db.exists() {
        return Err(AppError::InvalidInput(format!(
            "no keel database at {}",
            db.display()
        )));
    }
    let lock = RuntimeLock::acquire(&db, &describe_process("keel compact-storage"))?;
    // Opening migrates it to the schema this keel writes.
    drop(Store::open(&db, loaded.config.store_options()).map_err(database_err(&db))?);
    let path = db.clone();
    let r = tokio::task::spawn_blocking(move || {
        keel_store::compact_database(&path, &lock, COMPACT_BATCH)
    })
    .await
    .map_err(|e| AppError::InvalidInput(format!("compact-storage stopped: {e}")))?
    .map_err(database_err(&db))?;
    println!(
        "compressed {} messages, {} run results and {} state blobs stored before compression",
        r.messages, r.run_results, r.state_blobs
    );
    println!(
        "rebuilt {}: {} -> {} bytes (pages of {} -> {} bytes)",
        db.display(),
        r.bytes_before,
        r.bytes_after,
        r.page_size_before,
        r.page_size_after
    );
    Ok(ExitCode::SUCCESS)
}
