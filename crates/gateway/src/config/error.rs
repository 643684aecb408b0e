//! [`ConfigError`]: what is wrong with a configuration, one problem per line,
//! each naming the file, the line when known, and the key path.

use std::fmt;
use std::path::PathBuf;

use keel_providers::ProviderConfigError;

use super::spans::KeyIndex;

/// One problem in a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The file label (usually its path).
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, for syntax and type errors.
    pub column: Option<usize>,
    /// Dotted key path, e.g. `orchestration.max_concurrent_runs`, when known.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        match (self.line, self.column) {
            (Some(line), Some(column)) => write!(f, ":{line}:{column}")?,
            (Some(line), None) => write!(f, ":{line}")?,
            _ => {}
        }
        if let Some(key) = &self.key {
            write!(f, ": {key}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Why a configuration could not be loaded or used. Displays one error per line.
///
/// The narrow error of the config API ([`Config::load`](super::Config::load),
/// parsing, validation, provider building), kept apart from
/// [`AppError`](crate::AppError), which wraps it: it is a report of every
/// located problem (file, line, key) rather than one failure, and callers
/// — `keel agents check`, the start-up message, the tests — read it problem
/// by problem through [`problems`](Self::problems). Returning the whole
/// binary's error from `Config::load` would hide that shape. Never
/// retryable: the file or the environment must change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--config` names a file that does not exist.
    #[error("{}: config file not found (given with --config)", path.display())]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// Something is at the config file's path, but not a file keel can read.
    #[error("{}: not a config file keel can read: it is {what}", path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What is there instead.
        what: String,
    },
    /// The file exists but could not be read.
    #[error("{}: cannot read config file: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// The file does not parse or breaks validation rules; every problem is listed.
    #[error("{}", render(.0))]
    Invalid(Vec<ConfigProblem>),
    /// A profile name that neither `[providers.NAME]` nor `default` resolves.
    #[error("llm profile `{name}` is not configured (known: {})", known.join(", "))]
    UnknownProfile {
        /// The requested name.
        name: String,
        /// The names that resolve.
        known: Vec<String>,
    },
    /// A provider could not be built from its profile.
    #[error(transparent)]
    Provider(#[from] ProviderConfigError),
}

impl ConfigError {
    /// One problem at `key` of `file`.
    pub fn single(
        file: impl Into<String>,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid(vec![ConfigProblem {
            file: file.into(),
            line: None,
            column: None,
            key: Some(key.into()),
            message: message.into(),
        }])
    }

    /// The individual problems (empty for I/O, lookup and provider errors).
    pub fn problems(&self) -> &[ConfigProblem] {
        match self {
            ConfigError::Invalid(problems) => problems,
            _ => &[],
        }
    }
}

fn render(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// A validation problem before it is placed in a file: key path and message.
pub(super) type KeyedProblem = (String, String);

/// `Ok` when there is no problem, else every problem located through `index`.
pub(super) fn into_result(
    file: &str,
    index: &KeyIndex,
    problems: Vec<KeyedProblem>,
) -> Result<(), ConfigError> {
    if problems.is_empty() {
        return Ok(());
    }
    let mut located: Vec<ConfigProblem> = problems
        .into_iter()
        .map(|(key, message)| ConfigProblem {
            file: file.to_owned(),
            line: index.line_of_key(&key),
            column: None,
            key: Some(key),
            message,
        })
        .collect();
    // File order, then discovery order; problems without a line go last.
    located.sort_by_key(|p| (p.line.is_none(), p.line));
    Err(ConfigError::Invalid(located))
}

/// A TOML syntax or type error as one problem on one line.
pub(super) fn parse_error(
    file: &str,
    text: &str,
    index: Option<&KeyIndex>,
    error: &toml::de::Error,
) -> ConfigError {
    let span = error.span();
    let (line, column) = match &span {
        Some(span) => {
            let (l, c) = super::spans::line_col(text, span.start);
            (Some(l), Some(c))
        }
        None => (None, None),
    };
    let key = match (index, &span) {
        (Some(index), Some(span)) => index.path_at(span.start).map(str::to_owned),
        _ => None,
    };
    let message = error
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    ConfigError::Invalid(vec![ConfigProblem {
        file: file.to_owned(),
        line,
        column,
        key,
        message,
    }])
}
