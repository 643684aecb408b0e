//! `keel copy --from LOCATION --to LOCATION`: moves a whole database
//! between backends (`sqlite:PATH`, `postgres://…`, either way), then
//! checks the copy. The source is read in one snapshot (also while a keel
//! runs on it); the target must be empty, is held with its runtime lock,
//! and gets everything in one transaction, so a failed copy leaves it as
//! it was. Values arrive plain (SQLite's zstd frames decompressed).

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use keel_store::{
    check_database, describe_process, CheckOptions, InvariantReport, RuntimeLock, SqliteLoader,
    Store, StoreError, TableChunk,
};
use keel_store_postgres::{PgLoader, PgOptions, PgRuntimeLock, PgStore};
use tokio::sync::mpsc;

use crate::error::{AppError, Result};
use crate::storage::{Location, RuntimeHold};

/// Rows handed from the reader to the writer at a time.
const CHUNK_ROWS: usize = 500;

/// Runs `keel copy`; exit 0 when the copy is complete and checks clean.
pub async fn run(from: &str, to: &str) -> Result<ExitCode> {
    let (from, to) = (Location::parse(from)?, Location::parse(to)?);
    if from == to {
        return Err(AppError::InvalidInput(
            "--from and --to name the same database".into(),
        ));
    }
    if !from.exists() {
        return Err(AppError::InvalidInput(format!(
            "no keel database at {}",
            from.describe()
        )));
    }
    let holder = describe_process("keel copy");
    let _hold = match &to {
        Location::Sqlite(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                crate::app::create_data_dir(dir)?;
            }
            RuntimeHold::Sqlite(RuntimeLock::acquire(path, &holder).map_err(to.err())?)
        }
        Location::Postgres(url) => RuntimeHold::Postgres(
            PgRuntimeLock::acquire(url, &holder)
                .await
                .map_err(to.err())?,
        ),
    };
    println!("copying {} to {}", from.describe(), to.describe());
    let started = Instant::now();
    let copied = copy(&from, &to).await?;
    let total: usize = copied.values().sum();
    let tables: Vec<String> = copied
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(t, n)| format!("{t} {n}"))
        .collect();
    println!(
        "copied {total} rows in {} ms: {}",
        started.elapsed().as_millis(),
        if tables.is_empty() {
            "nothing (the source is empty)".to_owned()
        } else {
            tables.join(", ")
        }
    );
    let report = check(&to).await?;
    print!("{}", crate::doctor::render(&to.describe(), &report));
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Where the copy writes.
enum Loader {
    Sqlite(SqliteLoader),
    Postgres(PgLoader),
}

/// Reads `from` on one task, writes `to` on this one; rows per table.
async fn copy(from: &Location, to: &Location) -> Result<BTreeMap<&'static str, usize>> {
    let mut loader = match to {
        Location::Sqlite(path) => {
            let path = path.clone();
            Loader::Sqlite(
                tokio::task::spawn_blocking(move || SqliteLoader::create(&path))
                    .await
                    .map_err(|e| AppError::InvalidInput(format!("the copy stopped: {e}")))?
                    .map_err(to.err())?,
            )
        }
        Location::Postgres(url) => Loader::Postgres(PgLoader::create(url).await.map_err(to.err())?),
    };
    let (tx, mut rx) = mpsc::channel::<TableChunk>(4);
    let reader = match from.clone() {
        Location::Sqlite(path) => tokio::task::spawn_blocking(move || {
            keel_store::read_sqlite_tables(&path, CHUNK_ROWS, &mut |chunk| {
                tx.blocking_send(chunk).map_err(|_| StoreError::Closed)
            })
        }),
        Location::Postgres(url) => tokio::spawn(async move {
            keel_store_postgres::read_postgres_tables(&url, CHUNK_ROWS, &mut move |chunk| {
                let tx = tx.clone();
                Box::pin(async move { tx.send(chunk).await.map_err(|_| StoreError::Closed) })
            })
            .await
        }),
    };
    let mut copied = BTreeMap::new();
    let mut failed = None;
    while let Some(chunk) = rx.recv().await {
        let inserted = match &mut loader {
            Loader::Sqlite(l) => tokio::task::block_in_place(|| l.insert(&chunk)),
            Loader::Postgres(l) => l.insert(&chunk).await,
        };
        if let Err(e) = inserted {
            failed = Some(to.err()(e));
            break;
        }
        *copied.entry(chunk.table).or_insert(0) += chunk.rows.len();
    }
    // The reader stops at its next chunk once the receiver is gone.
    drop(rx);
    let read = reader
        .await
        .map_err(|e| AppError::InvalidInput(format!("the copy stopped: {e}")))?;
    if let Some(e) = failed {
        return Err(e);
    }
    read.map_err(from.err())?;
    match loader {
        Loader::Sqlite(l) => tokio::task::block_in_place(|| l.commit()).map_err(to.err())?,
        Loader::Postgres(l) => l.commit().await.map_err(to.err())?,
    }
    Ok(copied)
}

/// The checker on the copy (nothing runs on it: no run is live).
async fn check(to: &Location) -> Result<InvariantReport> {
    let options = CheckOptions {
        owner_alive: false,
        state_decoder: Some(Arc::new(keel_engine::SessionState::check_blob)),
    };
    match to {
        Location::Sqlite(path) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || check_database(&path, &options))
                .await
                .map_err(|e| AppError::InvalidInput(format!("the check stopped: {e}")))?
                .map_err(to.err())
        }
        Location::Postgres(url) => {
            let store = Store::new(
                PgStore::attach(url, PgOptions::default())
                    .await
                    .map_err(to.err())?,
            );
            store.check_invariants(options).await.map_err(to.err())
        }
    }
}
