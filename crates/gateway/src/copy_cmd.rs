//! `keel copy --from LOCATION --to LOCATION` (`sqlite:PATH`, a
//! `postgres://` URL or libpq's key=value form, either way): moves a whole
//! database between backends — every row into an empty target in one
//! transaction (a copy that fails leaves the target empty) — then runs the
//! invariant checker on the target and prints its verdict.
//!
//! The target's runtime lock is held from before the copy until after the
//! check, so no keel starts on a half-full database. The source is read in
//! one snapshot, also while a keel runs on it (what that keel commits
//! later is not in the copy, and the copy says so); when none does, its
//! lock is held too, so none starts meanwhile.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_store::{check_database, describe_process, CheckOptions, InvariantReport, RuntimeLock};
use keel_store::{Store, StoreError};
use keel_store_postgres::{
    copy_database, CopyError, CopySummary, Database, PgOptions, PgRuntimeLock, PgStore, Side,
    TableProgress,
};

use crate::app::create_data_dir;
use crate::error::{AppError, Result};
use crate::storage::{Location, RuntimeHold};

/// Runs `keel copy`: `from` and `to` are `sqlite:PATH` or a `postgres://`
/// URL. Exit 0 when the target checks clean, 1 with findings (printed as
/// `keel doctor` prints them, with whether the source has them too).
pub async fn run(from: &str, to: &str) -> Result<ExitCode> {
    let source = Location::parse(from)?;
    let target = Location::parse(to)?;
    if same_database(&source, &target) {
        return Err(AppError::InvalidInput(format!(
            "--from and --to both name {}; copy into another database",
            source.describe()
        )));
    }
    if !source.exists() {
        return Err(AppError::InvalidInput(format!(
            "no keel database at {}",
            source.describe()
        )));
    }
    if let Location::Sqlite(path) = &target {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            create_data_dir(dir)?;
        }
    }
    let _source_hold = hold_source(&source).await?;
    let _target_hold = hold(&target, "keel copy (writing)").await?;
    println!("copying {} to {}", source.describe(), target.describe());
    let started = Instant::now();
    let mut progress = progress_printer();
    let summary = copy_database(&database(&source), &database(&target), &mut progress)
        .await
        .map_err(|e| copy_failed(&source, &target, e))?;
    print!("{}", copied(&summary, started.elapsed()));
    let options = CheckOptions {
        // The target's lock is ours: nothing runs there.
        owner_alive: false,
        state_decoder: Some(Arc::new(keel_engine::SessionState::check_blob)),
    };
    let report = check(&target, &options).await?;
    print!("{}", crate::doctor::render(&target.describe(), &report));
    if report.is_clean() {
        return Ok(ExitCode::SUCCESS);
    }
    // Findings the source has too came with the rows; any other is the copy's.
    let before = check(&source, &options).await?;
    println!("{}", compared(&before, &report));
    Ok(ExitCode::from(1))
}

/// Whether two locations name one database.
fn same_database(a: &Location, b: &Location) -> bool {
    match (a, b) {
        (Location::Sqlite(a), Location::Sqlite(b)) => {
            let real = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
            real(a) == real(b)
        }
        (Location::Postgres(a), Location::Postgres(b)) => {
            keel_store_postgres::redacted(a) == keel_store_postgres::redacted(b)
        }
        _ => false,
    }
}

fn database(location: &Location) -> Database {
    match location {
        Location::Sqlite(path) => Database::Sqlite(path.clone()),
        Location::Postgres(url) => Database::Postgres(url.clone()),
    }
}

/// Takes `location`'s runtime lock as `command` (refused while a keel runs there).
async fn hold(location: &Location, command: &str) -> Result<RuntimeHold> {
    let holder = describe_process(command);
    match location {
        Location::Sqlite(path) => RuntimeLock::acquire(path, &holder)
            .map(RuntimeHold::Sqlite)
            .map_err(location.err()),
        Location::Postgres(url) => PgRuntimeLock::acquire(url, &holder)
            .await
            .map(RuntimeHold::Postgres)
            .map_err(location.err()),
    }
}

/// The source's lock when no keel runs on it (so none starts during the
/// copy); a running keel's database, or one nothing may write, is read as
/// a snapshot without it.
async fn hold_source(source: &Location) -> Result<Option<RuntimeHold>> {
    match hold(source, "keel copy (reading)").await {
        Ok(hold) => Ok(Some(hold)),
        Err(AppError::Database {
            source: StoreError::InUse { holder, .. },
            ..
        }) => {
            println!(
                "{} is in use by {holder}: copying a snapshot (what it commits from now on is \
                 not in the copy)",
                source.describe()
            );
            Ok(None)
        }
        Err(AppError::Database {
            source: StoreError::ReadOnly(_),
            ..
        }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A failed copy, named by the end that failed (and the table being written).
fn copy_failed(source: &Location, target: &Location, e: CopyError) -> AppError {
    let (location, table) = match e.side {
        Side::Source => (source, None),
        Side::Target => (target, e.table),
    };
    AppError::Database {
        path: PathBuf::from(match table {
            Some(table) => format!("{} (copying {table})", location.describe()),
            None => location.describe(),
        }),
        source: e.error,
    }
}

/// Prints on stderr how far a large table is, every 10,000 rows.
fn progress_printer() -> impl FnMut(TableProgress) + Send {
    const EVERY: u64 = 10_000;
    let mut shown: (&str, u64) = ("", 0);
    move |p: TableProgress| {
        if p.table != shown.0 {
            shown = (p.table, 0);
        }
        if p.rows / EVERY > shown.1 / EVERY {
            eprintln!("{}: {} rows…", p.table, p.rows);
        }
        shown.1 = p.rows;
    }
}

/// What was copied: every table with its rows.
fn copied(summary: &CopySummary, elapsed: Duration) -> String {
    let mut out = format!(
        "copied {} rows in {:.2} s:\n",
        summary.total_rows(),
        elapsed.as_secs_f64()
    );
    let width = summary
        .tables
        .iter()
        .map(|(t, _)| t.len())
        .max()
        .unwrap_or(0);
    for (table, rows) in &summary.tables {
        let _ = writeln!(out, "  {table:<width$}  {rows:>9}");
    }
    out
}

/// The target's findings against the source's.
fn compared(source: &InvariantReport, target: &InvariantReport) -> String {
    let new: Vec<_> = target
        .findings
        .iter()
        .filter(|f| !source.findings.contains(f))
        .collect();
    if new.is_empty() {
        return "the source has the same findings: the copy carried them over \
                (`keel doctor --repair` on the target fixes the repairable ones)"
            .to_owned();
    }
    let mut out = format!(
        "{} finding(s) the source does not have: the copy differs from its source",
        new.len()
    );
    for f in new {
        let _ = write!(out, "\n  {}: {}", f.invariant.name(), f.detail);
    }
    out
}

/// The invariant check of `location`, read-only.
async fn check(location: &Location, options: &CheckOptions) -> Result<InvariantReport> {
    match location {
        Location::Sqlite(path) => {
            let (path, options) = (path.clone(), options.clone());
            tokio::task::spawn_blocking(move || check_database(&path, &options))
                .await
                .map_err(|e| AppError::InvalidInput(format!("the check stopped: {e}")))?
                .map_err(location.err())
        }
        Location::Postgres(url) => {
            let store = PgStore::attach(url, PgOptions::default())
                .await
                .map_err(location.err())?;
            Store::new(store)
                .check_invariants(options.clone())
                .await
                .map_err(location.err())
        }
    }
}

#[cfg(test)]
mod tests {
    use keel_store::{Finding, Invariant};

    use super::*;

    #[test]
    fn the_summary_lists_every_table_with_its_rows() {
        let summary = CopySummary {
            tables: vec![("sessions", 3), ("messages", 12_345), ("images", 0)],
        };
        insta::assert_snapshot!(copied(&summary, Duration::from_millis(1500)));
    }

    #[test]
    fn findings_are_told_apart_by_whether_the_source_has_them() {
        let finding = |detail: &str| Finding {
            invariant: Invariant::Runs,
            repairable: true,
            detail: detail.into(),
        };
        let source = InvariantReport {
            findings: vec![finding("run a is running")],
            ..InvariantReport::default()
        };
        let same = source.clone();
        let more = InvariantReport {
            findings: vec![finding("run a is running"), finding("run b is running")],
            ..InvariantReport::default()
        };
        insta::assert_snapshot!(format!(
            "{}\n{}",
            compared(&source, &same),
            compared(&source, &more)
        ));
    }

    #[test]
    fn one_database_cannot_be_both_ends() {
        let dir = tempfile::tempdir().unwrap();
        let a = Location::Sqlite(dir.path().join("keel.db"));
        let b = Location::Sqlite(dir.path().join(".").join("keel.db"));
        assert!(same_database(&a, &b));
        assert!(same_database(
            &Location::Postgres("postgres://keel:secret@db/keel".into()),
            &Location::Postgres("postgres://keel@db:5432/keel".into()),
        ));
        assert!(!same_database(
            &a,
            &Location::Postgres("postgres://keel@db/keel".into())
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_to_postgres_checks_clean_and_a_second_one_is_refused() {
        let db = keel_store_postgres::require_postgres!();
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("keel.db");
        let store = Store::open(&source, Default::default()).unwrap();
        store
            .create_session(keel_store::NewSession {
                id: keel_core::SessionId::new(),
                channel: "cli_chat".into(),
                chat_id: "chat-1".into(),
                dialog_id: "d".into(),
                title: "Dialog d".into(),
                agent_id: None,
                parent_id: None,
                delivery_context: None,
                now_ms: 1,
            })
            .await
            .unwrap();
        drop(store);
        let from = format!("sqlite:{}", source.display());
        let url = db.conninfo.clone();
        assert_eq!(run(&from, &url).await.unwrap(), ExitCode::SUCCESS);
        let err = run(&from, &url).await.unwrap_err();
        let target = Location::parse(&url).unwrap().describe();
        insta::assert_snapshot!(err.to_string().replace(&target, "<target>"));
        // And back, into a new file in a directory that does not exist yet.
        let back = dir.path().join("new").join("keel.db");
        let to = format!("sqlite:{}", back.display());
        assert_eq!(run(&url, &to).await.unwrap(), ExitCode::SUCCESS);
        assert!(back.exists());
    }
}
