//! `keel migrate`: brings the database to the schema this keel writes, and
//! says what it did. Every start migrates too; this runs it alone, say
//! before starting several processes of a new release on PostgreSQL.
//! On SQLite it takes the data directory's runtime lock (refused while a
//! keel runs there); on PostgreSQL concurrent migrators are serialized by
//! the server (an advisory lock), each step once.

use std::path::Path;
use std::process::ExitCode;

use keel_store::{describe_process, RuntimeLock, Store};
use keel_store_postgres::PgStore;

use crate::config::Config;
use crate::error::{database_err, Result};
use crate::storage::{pg_options, Location};

/// Runs `keel migrate`.
pub async fn run(config_file: Option<&Path>, data_dir: Option<&Path>) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    let config = &loaded.config;
    let location = Location::of(config);
    let (from, to) = match &location {
        Location::Sqlite(db) => {
            crate::app::create_data_dir(&config.data_dir())?;
            let _lock = RuntimeLock::acquire(db, &describe_process("keel migrate"))?;
            let from = keel_store::database_version(db).map_err(database_err(db))?;
            drop(Store::open(db, config.store_options()).map_err(database_err(db))?);
            (from.unwrap_or(0), keel_store::SCHEMA_VERSION)
        }
        Location::Postgres(url) => {
            let (_, report) = PgStore::connect(url, pg_options(config))
                .await
                .map_err(location.err())?;
            (report.from, report.to)
        }
    };
    println!("{}", describe(&location.describe(), from, to));
    Ok(ExitCode::SUCCESS)
}

/// What a migration did, in one line.
fn describe(database: &str, from: u32, to: u32) -> String {
    match (from, to) {
        (0, to) => format!("{database}: created at schema version {to}"),
        (from, to) if from == to => format!("{database}: already at schema version {to}"),
        (from, to) => format!(
            "{database}: migrated from schema version {from} to {to} (steps {}..={to})",
            from + 1
        ),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_outcome_is_one_line() {
        insta::assert_snapshot!(
            [
                super::describe("postgres://keel@db:5432/keel", 0, 17),
                super::describe(".keel/keel.db", 17, 17),
                super::describe(".keel/keel.db", 9, 17),
            ]
            .join("\n"),
            @r"
        postgres://keel@db:5432/keel: created at schema version 17
        .keel/keel.db: already at schema version 17
        .keel/keel.db: migrated from schema version 9 to 17 (steps 10..=17)
        "
        );
    }
}
