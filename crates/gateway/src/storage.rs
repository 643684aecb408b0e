//! Where a keel keeps its database — the data directory's SQLite file, or
//! the PostgreSQL database `storage.url` (or `KEEL_DATABASE_URL`) names —
//! and how a command opens it. The rest of the gateway holds a
//! [`keel_store::Store`] and never learns which one it is.

use std::path::{Path, PathBuf};

use keel_store::{describe_process, RuntimeLock, Store};
use keel_store_postgres::{PgOptions, PgRuntimeLock, PgStore};

use crate::config::Config;
use crate::error::{database_err, AppError, Result};

/// The variable naming a PostgreSQL database; it wins over `storage.url`.
pub const DATABASE_URL_VAR: &str = "KEEL_DATABASE_URL";

/// Where a database is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL connection string (URL or key=value).
    Postgres(String),
}

impl Location {
    /// The database `config` names: `KEEL_DATABASE_URL` when set, else
    /// `storage.url`, else `keel.db` in the data directory.
    pub fn of(config: &Config) -> Location {
        let env = std::env::var(DATABASE_URL_VAR)
            .ok()
            .filter(|v| !v.trim().is_empty());
        match env.or_else(|| config.storage.url.clone()) {
            Some(url) => Location::Postgres(url),
            None => Location::Sqlite(crate::app::database_path(&config.data_dir())),
        }
    }

    /// A command-line location: `sqlite:PATH`, a `postgres://` /
    /// `postgresql://` URL, or libpq's key=value form (`host=… dbname=…`).
    pub fn parse(arg: &str) -> Result<Location> {
        if let Some(path) = arg.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err(AppError::InvalidInput(
                    "sqlite: needs a path, as in sqlite:.keel/keel.db".into(),
                ));
            }
            return Ok(Location::Sqlite(PathBuf::from(path)));
        }
        if arg.starts_with("postgres://") || arg.starts_with("postgresql://") {
            // Never echoed: it may hold a password.
            check_url(arg).map_err(|why| AppError::InvalidInput(format!("the URL {why}")))?;
            return Ok(Location::Postgres(arg.to_owned()));
        }
        if !arg.contains("://") && arg.contains('=') && check_url(arg).is_ok() {
            return Ok(Location::Postgres(arg.to_owned()));
        }
        let shown = match arg.split_once("://") {
            Some((scheme, _)) => format!("a {scheme}:// URL"),
            None => format!("{arg:?}"),
        };
        Err(AppError::InvalidInput(format!(
            "{shown} is neither sqlite:PATH nor a PostgreSQL connection string \
             (postgres://… or host=… dbname=…)"
        )))
    }

    /// Whether there may be a database to read: a SQLite file that exists,
    /// or any PostgreSQL database (reaching it tells).
    pub fn exists(&self) -> bool {
        match self {
            Location::Sqlite(path) => path.exists(),
            Location::Postgres(_) => true,
        }
    }

    /// The database `config` names, which a command that only reads or
    /// maintains one needs to exist already.
    pub fn existing(config: &Config) -> Result<Location> {
        let location = Location::of(config);
        if location.exists() {
            Ok(location)
        } else {
            Err(AppError::InvalidInput(format!(
                "no keel database at {}",
                location.describe()
            )))
        }
    }

    /// How it is named in messages: the path, or the URL without its password.
    pub fn describe(&self) -> String {
        match self {
            Location::Sqlite(path) => path.display().to_string(),
            Location::Postgres(url) => keel_store_postgres::redacted(url),
        }
    }

    /// The SQLite file, or an error saying `what` works on SQLite only.
    pub fn sqlite_only(&self, what: &str, instead: &str) -> Result<&Path> {
        match self {
            Location::Sqlite(path) => Ok(path),
            Location::Postgres(url) => Err(AppError::InvalidInput(format!(
                "{what} works on a SQLite data directory; this keel's database is \
                 PostgreSQL ({}): {instead}",
                keel_store_postgres::redacted(url)
            ))),
        }
    }

    /// Maps a failure of this database to an error naming it.
    pub fn err(&self) -> impl FnOnce(keel_store::StoreError) -> AppError + '_ {
        move |source| AppError::Database {
            path: PathBuf::from(self.describe()),
            source,
        }
    }

    /// Opens a store on it (migrating it, as every open does), taking no lock.
    pub async fn open(&self, config: &Config) -> Result<Store> {
        match self {
            Location::Sqlite(path) => {
                Ok(Store::open(path, config.store_options()).map_err(database_err(path))?)
            }
            Location::Postgres(url) => {
                let (store, report) = PgStore::connect(url, pg_options(config))
                    .await
                    .map_err(self.err())?;
                if !report.applied.is_empty() {
                    tracing::info!(
                        from = report.from,
                        to = report.to,
                        "migrated the PostgreSQL database"
                    );
                }
                Ok(Store::new(store))
            }
        }
    }
}

/// Whether `url` is a PostgreSQL connection string keel can use (the reason if not).
pub fn check_url(url: &str) -> std::result::Result<(), String> {
    url.parse::<keel_store_postgres::tokio_postgres::Config>()
        .map(|_| ())
        .map_err(|e| {
            // The kind of mistake, never the string itself (it may hold a password).
            let cause = std::error::Error::source(&e).map(ToString::to_string);
            match cause {
                Some(cause) => format!("is not a PostgreSQL connection string: {e}: {cause}"),
                None => format!("is not a PostgreSQL connection string: {e}"),
            }
        })
}

/// The PostgreSQL settings of `config`.
pub(crate) fn pg_options(config: &Config) -> PgOptions {
    PgOptions {
        max_connections: config
            .storage
            .max_connections
            .unwrap_or_else(keel_store_postgres::default_max_connections),
        lease: std::time::Duration::from_secs(config.storage.lease_secs),
        ..PgOptions::default()
    }
}

/// A process's hold on its database while it works there. On SQLite one
/// process owns the file: a second is refused, naming the holder. On
/// PostgreSQL runtimes share it (several `keel serve` processes serve one
/// database) and the commands that need the database alone hold it
/// exclusively. Released when dropped (or when the process dies).
#[derive(Debug)]
pub enum RuntimeHold {
    /// The lock file beside the SQLite database.
    Sqlite(RuntimeLock),
    /// A session advisory lock on its own PostgreSQL connection.
    Postgres(PgRuntimeLock),
}

/// Takes `config`'s database for `command` alone — before anything is
/// migrated or written, so a process that would share it is refused
/// untouched — then opens a store on it.
pub async fn open_exclusive(command: &str, config: &Config) -> Result<(RuntimeHold, Store)> {
    open_held(command, config, false).await
}

/// Takes `config`'s database for a runtime (`keel serve`, `keel chat`):
/// alone on SQLite, shared with other runtimes on PostgreSQL (refused while
/// a command holds it alone); then opens a store on it.
pub async fn open_runtime(command: &str, config: &Config) -> Result<(RuntimeHold, Store)> {
    open_held(command, config, true).await
}

async fn open_held(command: &str, config: &Config, shared: bool) -> Result<(RuntimeHold, Store)> {
    let location = Location::of(config);
    let holder = describe_process(command);
    let hold = match &location {
        Location::Sqlite(path) => RuntimeHold::Sqlite(RuntimeLock::acquire(path, &holder)?),
        Location::Postgres(url) => RuntimeHold::Postgres(
            if shared {
                PgRuntimeLock::acquire_shared(url, &holder).await
            } else {
                PgRuntimeLock::acquire(url, &holder).await
            }
            .map_err(location.err())?,
        ),
    };
    let store = location.open(config).await?;
    Ok((hold, store))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_locations_parse_or_say_what_is_wrong() {
        assert_eq!(
            Location::parse("sqlite:.keel/keel.db").expect("sqlite"),
            Location::Sqlite(PathBuf::from(".keel/keel.db"))
        );
        assert_eq!(
            Location::parse("postgres://keel@db/keel").expect("postgres"),
            Location::Postgres("postgres://keel@db/keel".into())
        );
        assert_eq!(
            Location::parse("host=/run/postgresql dbname=keel").expect("key=value"),
            Location::Postgres("host=/run/postgresql dbname=keel".into())
        );
        let errors: Vec<String> = [
            "sqlite:",
            "mysql://root:hunter2@db/keel",
            "postgres://keel@db:notaport/keel",
        ]
        .iter()
        .map(|arg| Location::parse(arg).expect_err(arg).to_string())
        .collect();
        assert!(
            errors.iter().all(|e| !e.contains("hunter2")),
            "no password in an error: {errors:#?}"
        );
        insta::assert_snapshot!(errors.join("\n"));
    }
}
