//! The one error type of keel-store and how SQLite failures map onto it.

use rusqlite::ErrorCode;

/// Result of every keel-store operation.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Everything that can go wrong in keel-store. Each variant says whether a
/// caller may retry ([`StoreError::is_retryable`]): [`StoreError::Busy`] and
/// [`StoreError::Io`] are transient, and the store has already retried them
/// before returning; [`StoreError::InboxFull`] clears as the inbox drains.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The named row does not exist. Not retryable.
    #[error("{0} not found")]
    NotFound(String),
    /// The request conflicts with what is stored (duplicate key, wrong state). Not retryable.
    #[error("conflict: {0}")]
    Conflict(String),
    /// A CHECK, NOT NULL, UNIQUE or FOREIGN KEY constraint rejected a row. Not retryable.
    #[error("constraint violated: {0}")]
    Constraint(String),
    /// The caller's input is invalid before touching SQL. Not retryable.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A session's inbox has no room for another event or reservation. Retryable after the inbox drains.
    #[error("inbox of session {session} is full (capacity {capacity})")]
    InboxFull {
        /// The root session whose inbox is full.
        session: String,
        /// The capacity the caller asked for.
        capacity: u32,
    },
    /// The execution id or lease token no longer owns the row (a late or duplicate actor). Not retryable.
    #[error("stale: {0}")]
    Stale(String),
    /// SQLite stayed busy or locked through every retry. Retryable later; show it as a system notification.
    #[error("database busy after {attempts} attempts: {message}")]
    Busy {
        /// How many times the operation ran.
        attempts: u32,
        /// SQLite's message.
        message: String,
    },
    /// The disk holding the database is full: the write was rolled back,
    /// nothing is corrupted, reads keep working. Retryable once space is freed.
    #[error("disk full: the database cannot grow ({message}); free space on its disk, then retry")]
    DiskFull {
        /// How many times the operation ran.
        attempts: u32,
        /// SQLite's message.
        message: String,
    },
    /// A disk I/O error persisted through every retry. Retryable later.
    #[error("disk I/O error after {attempts} attempts: {message}")]
    Io {
        /// How many times the operation ran.
        attempts: u32,
        /// SQLite's or the OS's message.
        message: String,
    },
    /// Stored data is unreadable: unknown enum text, bad JSON, a corrupt file. Never retried.
    #[error("corrupt data: {0}")]
    Corruption(String),
    /// The database was written by a newer keel; it was left untouched. Not retryable.
    #[error("database schema version {found} is newer than this build supports ({supported}); refusing to open it")]
    NewerSchema {
        /// `PRAGMA user_version` of the file.
        found: u32,
        /// [`crate::SCHEMA_VERSION`] of this build.
        supported: u32,
    },
    /// The file is not a keel database (empty, not SQLite, another
    /// application's); it was left untouched. Not retryable.
    #[error("not a keel database: {0}")]
    NotKeel(String),
    /// The database, or the files keel keeps beside it, cannot be written
    /// (or, for a WAL with commits, read) where they are: a read-only mount,
    /// a file or directory the user may not write. Not retryable.
    #[error("read-only: {0}")]
    ReadOnly(String),
    /// Migration to `version` failed and was rolled back; the database keeps its previous version. Not retryable.
    #[error("migration to schema version {version} failed (rolled back): {message}")]
    Migration {
        /// The version whose step failed.
        version: u32,
        /// Why.
        message: String,
    },
    /// Another process holds the runtime lock of this database. Not retryable
    /// until that process exits.
    #[error("{path} is in use by another keel process ({holder}); stop it first, or use another data directory")]
    InUse {
        /// The database file.
        path: String,
        /// Who holds it, as its lock file says.
        holder: String,
    },
    /// A newer runtime generation activated on this database: this process
    /// no longer owns it and may write nothing more. Not retryable.
    #[error("runtime generation {ours} was superseded by generation {current} ({holder}); this process no longer owns the database")]
    Fenced {
        /// The generation this process activated.
        ours: u64,
        /// The generation on disk.
        current: u64,
        /// Who activated it.
        holder: String,
    },
    /// Several processes share the database and another took this one's
    /// work over (its registration lapsed): it may write nothing more. Not
    /// retryable.
    #[error("this process (runtime generation {generation}) was taken over by another after its registration lapsed; it writes nothing more")]
    TakenOver {
        /// The generation this process activated.
        generation: u64,
    },
    /// Any other SQLite failure (a bug or misuse). Not retryable.
    #[error("sqlite: {0}")]
    Sqlite(String),
    /// Any other PostgreSQL failure (a bug, misuse, or a server refusing
    /// the request). Not retryable.
    #[error("postgres: {0}")]
    Postgres(String),
    /// The store's worker threads are gone (the store was shut down or a worker panicked). Not retryable.
    #[error("store is closed")]
    Closed,
    /// Opening the store failed because the OS refused to start one of its threads. Not retryable.
    #[error("cannot start store thread {name}: {message}")]
    ThreadSpawn {
        /// The thread's name.
        name: String,
        /// The OS's message.
        message: String,
    },
}

impl StoreError {
    /// Whether retrying later may succeed: a busy or locked database, an I/O failure, a full inbox.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Busy { .. }
                | StoreError::Io { .. }
                | StoreError::DiskFull { .. }
                | StoreError::InboxFull { .. }
        )
    }

    /// Whether this process may write nothing more to the database: another
    /// generation superseded it, or another process took it over.
    pub fn is_fenced(&self) -> bool {
        matches!(
            self,
            StoreError::Fenced { .. } | StoreError::TakenOver { .. }
        )
    }

    /// Whether the store itself retries this failure (BUSY/LOCKED/IO/FULL).
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Busy { .. } | StoreError::Io { .. } | StoreError::DiskFull { .. }
        )
    }

    /// The same transient error, stamped with how many attempts were made.
    pub(crate) fn with_attempts(self, n: u32) -> Self {
        match self {
            StoreError::Busy { message, .. } => StoreError::Busy {
                attempts: n,
                message,
            },
            StoreError::Io { message, .. } => StoreError::Io {
                attempts: n,
                message,
            },
            StoreError::DiskFull { message, .. } => StoreError::DiskFull {
                attempts: n,
                message,
            },
            other => other,
        }
    }

    /// A corruption error for a bad value read from `what`.
    pub fn corrupt(what: &str, detail: impl std::fmt::Display) -> Self {
        StoreError::Corruption(format!("{what}: {detail}"))
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        match &e {
            rusqlite::Error::SqliteFailure(f, msg) => {
                let message = msg.clone().unwrap_or_else(|| f.to_string());
                match f.code {
                    ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => StoreError::Busy {
                        attempts: 1,
                        message,
                    },
                    ErrorCode::DiskFull => StoreError::DiskFull {
                        attempts: 1,
                        message,
                    },
                    ErrorCode::SystemIoFailure => StoreError::Io {
                        attempts: 1,
                        message,
                    },
                    ErrorCode::ConstraintViolation => StoreError::Constraint(message),
                    ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase => {
                        StoreError::Corruption(message)
                    }
                    _ => StoreError::Sqlite(message),
                }
            }
            rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::IntegralValueOutOfRange(..)
            | rusqlite::Error::Utf8Error(..) => StoreError::Corruption(e.to_string()),
            _ => StoreError::Sqlite(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_errors_are_classified() {
        let busy = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
            None,
        );
        assert!(StoreError::from(busy).is_transient());
        let check = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT_CHECK),
            Some("CHECK constraint failed".into()),
        );
        let e = StoreError::from(check);
        assert!(!e.is_transient() && !e.is_retryable());
        assert!(matches!(e, StoreError::Constraint(_)));
    }

    #[test]
    fn a_failed_thread_spawn_is_not_retryable() {
        let e = StoreError::ThreadSpawn {
            name: "keel-store-writer".into(),
            message: "Resource temporarily unavailable (os error 11)".into(),
        };
        assert!(!e.is_transient() && !e.is_retryable());
        insta::assert_snapshot!(e, @"cannot start store thread keel-store-writer: Resource temporarily unavailable (os error 11)");
    }
}
