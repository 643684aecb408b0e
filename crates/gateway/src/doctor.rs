//! `keel doctor`: checks a data directory's database against every
//! invariant the commit paths keep, prints each finding with what it means
//! and whether `--repair` fixes it, and with `--repair` runs the safe
//! reconciliations (migration and the recovery every start runs).
//!
//! It never writes without `--repair`, and repairs only while it holds the
//! data directory's runtime lock; a running keel's database is checked as a
//! read-only snapshot, its live runs counted as live, and so is a database
//! where nothing may be written (a read-only mount or file).

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use keel_store::{
    check_database, describe_process, CheckOptions, Invariant, InvariantReport, RuntimeLock, Store,
    StoreError,
};

use keel_store_postgres::{PgRuntimeLock, PgStore};

use crate::config::Config;
use crate::error::{database_err, AppError, Result};
use crate::storage::{pg_options, Location};

/// Runs `keel doctor`; exit 0 when clean, 1 with findings.
pub async fn run(
    config_file: Option<&Path>,
    data_dir: Option<&Path>,
    repair: bool,
) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    let location = Location::of(&loaded.config);
    let db = match &location {
        Location::Sqlite(db) => db.clone(),
        Location::Postgres(url) => return run_postgres(&loaded.config, url, repair).await,
    };
    if !db.exists() {
        return Err(AppError::InvalidInput(format!(
            "no keel database at {}",
            db.display()
        )));
    }
    let (lock, owner_alive) = match RuntimeLock::acquire(&db, &describe_process("keel doctor")) {
        Ok(lock) => (Some(lock), false),
        Err(StoreError::InUse { holder, .. }) if !repair => {
            println!(
                "{} is in use by {holder}: checking a read-only snapshot",
                db.display()
            );
            (None, true)
        }
        // Nothing can run on a database where nothing may be written.
        Err(StoreError::ReadOnly(why)) if !repair => {
            println!(
                "{} is read-only here ({why}): checking it read-only",
                db.display()
            );
            (None, false)
        }
        Err(StoreError::ReadOnly(why)) => return Err(cannot_repair(&db, &why)),
        Err(e) => return Err(e.into()),
    };
    let options = CheckOptions {
        owner_alive,
        state_decoder: Some(Arc::new(keel_engine::SessionState::check_blob)),
    };
    let report = check(&db, &options).await?;
    print!("{}", render(&db.display(), &report));
    if !repair || report.findings.iter().all(|f| !f.repairable) {
        return Ok(exit_code(&report));
    }
    println!(
        "repairing: migrating and recovering as a start would, then recounting message counts"
    );
    let store = Store::open(&db, Default::default()).map_err(|e| match e {
        StoreError::ReadOnly(why) => cannot_repair(&db, &why),
        e => database_err(&db)(e),
    })?;
    repair_with(&store).await?;
    drop(store);
    let after = check(&db, &options).await?;
    print!("{}", render(&db.display(), &after));
    drop(lock);
    Ok(exit_code(&after))
}

/// `keel doctor` on PostgreSQL: the same checks in one read snapshot of
/// the server's database; `--repair` takes the runtime lock first (refused
/// while a keel runs there), as on SQLite.
async fn run_postgres(config: &Config, url: &str, repair: bool) -> Result<ExitCode> {
    let location = Location::Postgres(url.to_owned());
    let label = location.describe();
    let lock = match PgRuntimeLock::acquire(url, &describe_process("keel doctor")).await {
        Ok(lock) => Some(lock),
        Err(StoreError::InUse { holder, .. }) if !repair => {
            println!("{label} is in use by {holder}: checking a read-only snapshot");
            None
        }
        Err(e) => return Err(location.err()(e)),
    };
    let options = CheckOptions {
        owner_alive: lock.is_none(),
        state_decoder: Some(Arc::new(keel_engine::SessionState::check_blob)),
    };
    let pg = |e| location.err()(e);
    // Only a repair writes: it migrates, as a start would.
    let store = Store::new(if repair {
        PgStore::connect(url, pg_options(config))
            .await
            .map_err(pg)?
            .0
    } else {
        PgStore::attach(url, pg_options(config)).await.map_err(pg)?
    });
    let report = store.check_invariants(options.clone()).await.map_err(pg)?;
    print!("{}", render(&label, &report));
    if !repair || report.findings.iter().all(|f| !f.repairable) {
        return Ok(exit_code(&report));
    }
    println!("repairing: recovering as a start would, then recounting message counts");
    repair_with(&store).await?;
    let after = store.check_invariants(options).await.map_err(pg)?;
    print!("{}", render(&label, &after));
    drop(lock);
    Ok(exit_code(&after))
}

/// The safe reconciliations: the recovery every start runs, then the
/// message counts recounted.
async fn repair_with(store: &Store) -> Result<()> {
    let activation = store
        .activate_runtime(
            describe_process("keel doctor --repair"),
            keel_core::time::now_ms(),
        )
        .await?;
    let recovery = &activation.recovery;
    let recounted = store.recount_message_counts().await?;
    println!(
        "repaired: {} inputs marked unanswered, {} runs interrupted, {} completions recorded, \
         {} leases expired, {} counters recomputed, {} message counts recounted",
        recovery.unanswered_inputs,
        recovery.interrupted_runs.len(),
        recovery.completion_events,
        recovery.leases_expired,
        recovery.counters_repaired.len(),
        recounted
    );
    Ok(())
}

/// `--repair` on a database that cannot be written where it is.
fn cannot_repair(db: &Path, why: &str) -> AppError {
    database_err(db)(StoreError::ReadOnly(format!(
        "{why}; --repair must write, so it cannot run here (without --repair, \
         keel doctor checks the database read-only)"
    )))
}

/// Checks on a blocking thread (the whole database is read).
async fn check(db: &Path, options: &CheckOptions) -> Result<InvariantReport> {
    let (path, options) = (db.to_path_buf(), options.clone());
    tokio::task::spawn_blocking(move || check_database(&path, &options))
        .await
        .map_err(|e| AppError::InvalidInput(format!("the check stopped: {e}")))?
        .map_err(database_err(db))
}

fn exit_code(report: &InvariantReport) -> ExitCode {
    if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The report as the user reads it: one line per invariant, each finding
/// with what it means and whether `--repair` fixes it.
pub fn render(db: &dyn std::fmt::Display, report: &InvariantReport) -> String {
    let c = report.checked;
    let mut out = format!(
        "checked {}: {} sessions, {} messages, {} checkpoints, {} runs, {} inbox events\n",
        db, c.sessions, c.messages, c.checkpoints, c.runs, c.events
    );
    for invariant in Invariant::ALL {
        let findings: Vec<_> = report
            .findings
            .iter()
            .filter(|f| f.invariant == invariant)
            .collect();
        if findings.is_empty() {
            let _ = writeln!(out, "ok       {}", invariant.name());
            continue;
        }
        for f in findings {
            let _ = writeln!(out, "FINDING  {}: {}", invariant.name(), f.detail);
            let _ = writeln!(out, "         means: {}", invariant.meaning());
            let _ = writeln!(
                out,
                "         repair: {}",
                if f.repairable && invariant == Invariant::MessageCounts {
                    "`keel doctor --repair` fixes this (it recounts them)"
                } else if f.repairable {
                    "`keel doctor --repair` fixes this (the recovery every start runs)"
                } else {
                    "not automatic: keep a copy of the data directory and restore from a backup or report it"
                }
            );
        }
    }
    let n = report.findings.len();
    let fixable = report.findings.iter().filter(|f| f.repairable).count();
    if n == 0 {
        out.push_str("clean: every invariant holds\n");
    } else {
        let _ = writeln!(
            out,
            "{n} finding(s), {fixable} fixed by `keel doctor --repair`"
        );
    }
    out
}
