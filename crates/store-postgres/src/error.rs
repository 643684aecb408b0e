//! Errors of the PostgreSQL store.

/// Result of the PostgreSQL store.
pub type Result<T, E = PgStoreError> = std::result::Result<T, E>;

/// What can go wrong in the PostgreSQL store.
#[derive(Debug, thiserror::Error)]
pub enum PgStoreError {
    /// The database was migrated by a newer keel; this build must not write it.
    #[error("the database is at schema version {found}, newer than this keel's {supported}; upgrade keel")]
    NewerSchema {
        /// The version found in `schema_version`.
        found: u32,
        /// [`crate::SCHEMA_VERSION`].
        supported: u32,
    },
    /// A migration step failed and was rolled back.
    #[error("schema migration {version} failed: {message}")]
    Migration {
        /// The version the step would have reached.
        version: u32,
        /// What PostgreSQL said.
        message: String,
    },
    /// A stored value this build cannot read.
    #[error("corrupt value in {what}: {value}")]
    Corruption {
        /// The table and column.
        what: &'static str,
        /// The value found.
        value: String,
    },
    /// A connection string, TLS setup or pool setting that cannot work.
    #[error("PostgreSQL configuration: {0}")]
    Config(String),
    /// Any other error of the server or the connection.
    #[error("PostgreSQL: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}
