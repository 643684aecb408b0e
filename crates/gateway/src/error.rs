//! [`AppError`]: the one error of keel-gateway — why a command of the `keel`
//! binary could not do its job — and [`Result`].
//!
//! Configuration keeps a narrow error of its own, [`ConfigError`]: see its
//! docs for why.

use crate::config::ConfigError;

/// Why a command of the `keel` binary could not do its job. Each variant
/// says whether running the same command again may succeed
/// ([`AppError::is_retryable`]).
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The configuration is invalid or names something that does not exist.
    /// Not retryable: the file must change.
    #[error("{0}")]
    Config(#[from] ConfigError),
    /// The script given with `--script` cannot be read or is invalid. Not
    /// retryable.
    #[error("{0}")]
    Script(#[from] keel_providers::ScriptError),
    /// The database could not be opened or written. Retryable when the
    /// store says so (a lock held elsewhere, a full disk freed).
    #[error("storage: {0}")]
    Store(#[from] keel_store::StoreError),
    /// The database file cannot be opened as keel's (not a keel database,
    /// damaged, from a newer keel, in use); the message names the file.
    /// Retryable when the store says so (a lock held elsewhere).
    #[error("{}: {source}", path.display())]
    Database {
        /// The database file.
        path: std::path::PathBuf,
        /// Why it cannot be opened.
        source: keel_store::StoreError,
    },
    /// An engine operation failed (sessions, sub-agent runs, built-in
    /// tools). Retryable when the engine says so (a provider's rate limit,
    /// a full quota).
    #[error("{0}")]
    Engine(#[from] keel_engine::EngineError),
    /// The agent definitions are invalid (every problem is listed). Not
    /// retryable.
    #[error("agent definitions:\n{0}")]
    Catalog(keel_catalog::Diagnostics),
    /// What the user typed (an argument, a slash command's operand) is not
    /// valid. Not retryable as typed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The offline demo did not go as scripted: a bug in keel or the demo.
    /// Not retryable.
    #[error("the demo went off script: {0}")]
    Demo(String),
    /// A file or terminal operation failed. Retryable when the operation was
    /// interrupted or timed out.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

/// The result of a gateway operation.
pub type Result<T, E = AppError> = std::result::Result<T, E>;

impl AppError {
    /// Whether running the same command again may succeed (see each
    /// variant's doc).
    pub fn is_retryable(&self) -> bool {
        match self {
            AppError::Store(e) | AppError::Database { source: e, .. } => e.is_retryable(),
            AppError::Engine(e) => e.is_retryable(),
            AppError::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::WouldBlock
            ),
            AppError::Config(_)
            | AppError::Script(_)
            | AppError::Catalog(_)
            | AppError::InvalidInput(_)
            | AppError::Demo(_) => false,
        }
    }
}

/// Maps a failure to open the database at `path` to an error naming the file.
pub fn database_err(
    path: &std::path::Path,
) -> impl FnOnce(keel_store::StoreError) -> AppError + '_ {
    move |source| AppError::Database {
        path: path.to_path_buf(),
        source,
    }
}

/// Maps an I/O error with what was being done.
pub fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> AppError {
    let context = context.into();
    move |source| AppError::Io { context, source }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    fn io(kind: ErrorKind) -> AppError {
        io_err("reading stdin")(std::io::Error::from(kind))
    }

    #[test]
    fn retryable_variants_are_the_transient_ones() {
        let engine_busy = keel_engine::EngineError::SpawnRejected;
        assert!(engine_busy.is_retryable(), "precondition");
        let retryable = [
            io(ErrorKind::Interrupted),
            io(ErrorKind::TimedOut),
            AppError::Engine(engine_busy),
        ];
        for e in &retryable {
            assert!(e.is_retryable(), "{e}");
        }
        let permanent = [
            io(ErrorKind::PermissionDenied),
            AppError::InvalidInput("x".into()),
            AppError::Demo("x".into()),
            AppError::Engine(keel_engine::EngineError::Cancelled),
            AppError::Config(ConfigError::single(
                "keel.toml",
                "session.ttl_hours",
                "0 is below 1",
            )),
        ];
        for e in &permanent {
            assert!(!e.is_retryable(), "{e}");
        }
    }

    #[test]
    fn messages_say_what_failed() {
        let errs: Vec<String> = [
            io(ErrorKind::PermissionDenied),
            AppError::InvalidInput("\"-\" is not a checkpoint id".into()),
            AppError::Demo("no checkpoint at turn 3".into()),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        insta::assert_yaml_snapshot!(errs, @r#"
        - "reading stdin: permission denied"
        - "invalid input: \"-\" is not a checkpoint id"
        - "the demo went off script: no checkpoint at turn 3"
        "#);
    }
}
