//! `keel prune`: applies `[session.retention]` now, as a running keel does
//! in the background, and says what it removed. It holds the data
//! directory's runtime lock, so it is refused while a keel runs there
//! (that keel prunes on its own); every batch is its own transaction, so
//! an interrupted prune leaves a consistent database and the next one
//! carries on.

use std::path::Path;
use std::process::ExitCode;

use keel_store::{describe_process, RuntimeLock, Store};

use crate::app::database_path;
use crate::config::Config;
use crate::error::{database_err, AppError, Result};

/// Runs `keel prune`; prints what was removed.
pub async fn run(config_file: Option<&Path>, data_dir: Option<&Path>) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    let db = database_path(&loaded.config.data_dir());
    if !db.exists() {
        return Err(AppError::InvalidInput(format!(
            "no keel database at {}",
            db.display()
        )));
    }
    let Some(keep) = loaded.config.keep_checkpoints() else {
        println!("retention is off (session.retention.keep_checkpoints = 0): nothing pruned");
        return Ok(ExitCode::SUCCESS);
    };
    let lock = RuntimeLock::acquire(&db, &describe_process("keel prune"))?;
    let store = Store::open(&db, loaded.config.store_options()).map_err(database_err(&db))?;
    let r = keel_engine::apply_retention(&store, keep).await?;
    let removed = &r.removed;
    println!(
        "pruned {} dialog(s) to their newest {keep} turn checkpoints: {} checkpoints, \
         {} messages, {} timelines and {} state blobs removed; {} pages given back",
        r.sessions,
        removed.checkpoints_deleted,
        removed.messages_deleted,
        removed.timelines_deleted,
        removed.blobs_deleted,
        r.pages_reclaimed
    );
    drop(store);
    drop(lock);
    Ok(ExitCode::SUCCESS)
}
