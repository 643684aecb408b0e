//! Diagnostics: one actionable message per problem, with the file, line,
//! column and key path it concerns. Loading collects every diagnostic instead
//! of stopping at the first.

use std::fmt;
use std::path::{Path, PathBuf};

/// What kind of problem a [`Diagnostic`] reports; one variant per rejection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DiagnosticKind {
    /// The definitions root is missing, not a directory or unreadable.
    RootUnusable,
    /// More definition files than [`crate::MAX_DEFINITIONS`].
    TooManyDefinitions,
    /// A file could not be read.
    Io,
    /// A `*.md` entry is a directory, socket, device or other non-file.
    NotRegularFile,
    /// A symlink whose target is outside the definitions root.
    SymlinkEscape,
    /// A file larger than [`crate::MAX_DEFINITION_BYTES`].
    FileTooLarge,
    /// A file that is not valid UTF-8.
    NotUtf8,
    /// The first line is not `---`.
    MissingFrontmatter,
    /// No closing `---` line.
    UnclosedFrontmatter,
    /// Frontmatter larger than [`crate::MAX_FRONTMATTER_BYTES`].
    FrontmatterTooLarge,
    /// A tab in the indentation of a frontmatter line.
    TabIndentation,
    /// A line break other than LF or CRLF (bare CR, U+0085, U+2028, U+2029)
    /// in the frontmatter: YAML would count lines differently than editors.
    LineBreak,
    /// A YAML document marker (`---`, `...`) inside the frontmatter.
    MultipleDocuments,
    /// The frontmatter is not valid YAML.
    YamlSyntax,
    /// The same key twice in one mapping.
    DuplicateKey,
    /// The frontmatter is empty or not a mapping of keys.
    NotAMapping,
    /// A key the definition format does not know.
    UnknownKey,
    /// A required key is absent.
    MissingKey,
    /// A value of the wrong YAML type (or no value at all).
    WrongType,
    /// A value of the right type that is not acceptable (empty, too long,
    /// not an allowed word).
    InvalidValue,
    /// A number outside its documented bounds.
    OutOfRange,
    /// The same entry twice in a list.
    DuplicateEntry,
    /// An `id` that breaks the rule `[a-z][a-z0-9_-]{0,63}`.
    InvalidAgentId,
    /// An `id` reserved by keel.
    ReservedId,
    /// Two files define the same id (after folding case and `-`/`_`).
    DuplicateId,
    /// The role prompt after the frontmatter is empty.
    EmptyBody,
    /// A delegate that names no agent of the catalog.
    UnknownDelegate,
    /// An agent that lists itself as a delegate.
    SelfDelegation,
    /// A `root_delegates` entry of the config that names no agent.
    UnknownRootDelegate,
    /// An input of the catalog itself (config) is out of bounds.
    InvalidInput,
    /// An `llm_profile` that names no configured provider profile.
    UnknownProfile,
    /// A cost budget (`limits.max_cost_usd`) over a profile with no prices.
    UnpricedProfile,
    /// A tool that is not registered.
    UnknownTool,
    /// A `RootOnly` tool listed by an agent that can be delegated to.
    ToolNotDelegatable,
    /// A runtime-injected tool listed in a definition.
    RuntimeInjectedTool,
    /// A skill that does not exist.
    UnknownSkill,
    /// A warning: the body begins with a second frontmatter-like block.
    SecondFrontmatter,
}

impl DiagnosticKind {
    /// Whether it is a warning: reported, but the load still succeeds.
    pub fn is_warning(self) -> bool {
        matches!(self, DiagnosticKind::SecondFrontmatter)
    }
}

/// One problem found while loading the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// The file, relative to the definitions root; `None` for problems of the
    /// configuration or the root itself.
    pub file: Option<PathBuf>,
    /// 1-based line in the file.
    pub line: Option<usize>,
    /// 1-based column in the line.
    pub column: Option<usize>,
    /// The key path, like `limits.max_iterations` or `delegates[1]`.
    pub key: Option<String>,
    /// Which rejection this is.
    pub kind: DiagnosticKind,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl Diagnostic {
    /// A diagnostic about `file` with no position yet.
    pub fn new(file: Option<&Path>, kind: DiagnosticKind, message: impl Into<String>) -> Self {
        Self {
            file: file.map(Path::to_path_buf),
            line: None,
            column: None,
            key: None,
            kind,
            message: message.into(),
        }
    }

    /// Sets the key path.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the 1-based line and optional column.
    pub fn at(mut self, line: usize, column: Option<usize>) -> Self {
        self.line = Some(line);
        self.column = column;
        self
    }

    /// Sets the position from an optional `(line, column)`.
    pub(crate) fn at_opt(self, pos: Option<(usize, Option<usize>)>) -> Self {
        match pos {
            Some((line, column)) => self.at(line, column),
            None => self,
        }
    }
}

/// Writes `s` with control characters and Unicode line breaks escaped, so a
/// diagnostic is always one line whatever the file contained.
fn write_one_line(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    for c in s.chars() {
        if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') {
            write!(f, "{}", c.escape_debug())?;
        } else {
            write!(f, "{c}")?;
        }
    }
    Ok(())
}

impl fmt::Display for Diagnostic {
    /// `file:line:col: key: message`, leaving out what is unknown; problems of
    /// the configuration show `<config>` as the file. Always one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            Some(file) => write_one_line(f, &file.display().to_string())?,
            None => f.write_str("<config>")?,
        }
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        f.write_str(": ")?;
        if let Some(key) = &self.key {
            write_one_line(f, key)?;
            f.write_str(": ")?;
        }
        write_one_line(f, &self.message)
    }
}

/// Every problem of a failed load, in file order. Never empty when returned
/// as an error.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    /// The diagnostics as a slice.
    pub fn as_slice(&self) -> &[Diagnostic] {
        &self.0
    }

    /// Number of problems.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Iterates over the problems.
    pub fn iter(&self) -> std::slice::Iter<'_, Diagnostic> {
        self.0.iter()
    }

    /// Whether any problem is of `kind`.
    pub fn has(&self, kind: DiagnosticKind) -> bool {
        self.0.iter().any(|d| d.kind == kind)
    }
}

impl From<Vec<Diagnostic>> for Diagnostics {
    fn from(v: Vec<Diagnostic>) -> Self {
        Self(v)
    }
}

impl<'a> IntoIterator for &'a Diagnostics {
    type Item = &'a Diagnostic;
    type IntoIter = std::slice::Iter<'a, Diagnostic>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl fmt::Display for Diagnostics {
    /// One diagnostic per line, then a count line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.0 {
            writeln!(f, "{d}")?;
        }
        let n = self.0.len();
        write!(
            f,
            "{n} problem{} found; the agent catalog was not loaded",
            if n == 1 { "" } else { "s" }
        )
    }
}

impl std::error::Error for Diagnostics {}

/// Levenshtein distance between `a` and `b`, for "did you mean" hints.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
