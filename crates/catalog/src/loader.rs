//! Reads definition files from a root (the agent definitions root or the
//! skills root). The only module that touches the filesystem, and only below
//! the canonicalized root: top-level `*.md` regular files (or symlinks to
//! files inside the root), sorted by name, each size-checked from metadata
//! before a bounded read.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::diagnostic::{Diagnostic, DiagnosticKind as K};
use crate::parse::{parse_bytes_full, too_large, Parsed, MAX_DEFINITION_BYTES};

/// Most `*.md` files a definitions (or skills) root may hold.
pub const MAX_DEFINITIONS: usize = 4096;

/// One file of the root, parsed.
pub(crate) struct SourceFile {
    /// File name relative to the root.
    pub file: PathBuf,
    /// What parsing it gave.
    pub parsed: Parsed,
}

/// What a root holds, for the wording of its errors.
#[derive(Clone, Copy)]
pub(crate) struct RootKind {
    /// `definitions` or `skills`.
    pub what: &'static str,
    /// What each `*.md` entry must be.
    pub entry: &'static str,
    /// The entries, in the plural.
    pub files: &'static str,
}

/// The agent definitions root.
pub(crate) const DEFINITIONS: RootKind = RootKind {
    what: "definitions",
    entry: "an agent definition file",
    files: "definition files",
};

/// Canonicalizes `root` and parses every top-level `*.md` agent definition in
/// it, sorted by file name (see [`read_files`]).
pub(crate) fn read_root(root: &Path) -> Result<(PathBuf, Vec<SourceFile>), Vec<Diagnostic>> {
    let (canonical, files) = read_files(root, DEFINITIONS)?;
    let files = files
        .into_iter()
        .map(|(file, bytes)| SourceFile {
            parsed: match bytes {
                Ok(bytes) => parse_bytes_full(&file, &bytes),
                Err(d) => Parsed {
                    outcome: Err(vec![d]),
                    yaml: String::new(),
                    salvaged_id: None,
                    warnings: Vec::new(),
                },
            },
            file,
        })
        .collect();
    Ok((canonical, files))
}

/// A canonical root and its files (name, then bytes or why they cannot be used).
pub(crate) type RootFiles = (PathBuf, Vec<(PathBuf, Result<Vec<u8>, Diagnostic>)>);

/// Canonicalizes `root` and reads every top-level `*.md` file in it, sorted
/// by file name. Names starting with `.` (editor and hidden files) and files
/// with any other extension are skipped; the extension match is exact
/// (`.md`). Root-level problems come back as `Err`.
pub(crate) fn read_files(root: &Path, kind: RootKind) -> Result<RootFiles, Vec<Diagnostic>> {
    let what = kind.what;
    let root_err = |msg: String| vec![Diagnostic::new(None, K::RootUnusable, msg)];
    let canonical = fs::canonicalize(root).map_err(|e| {
        root_err(format!(
            "cannot open the {what} directory {}: {e}",
            root.display()
        ))
    })?;
    if !canonical.is_dir() {
        return Err(root_err(format!(
            "the {what} path {} is not a directory",
            root.display()
        )));
    }
    let entries = fs::read_dir(&canonical).map_err(|e| {
        root_err(format!(
            "cannot list the {what} directory {}: {e}",
            root.display()
        ))
    })?;
    let mut names = Vec::new();
    let mut diags = Vec::new();
    for entry in entries {
        match entry {
            Ok(e) => {
                let name = PathBuf::from(e.file_name());
                let hidden = e.file_name().to_string_lossy().starts_with('.');
                if !hidden && name.extension().is_some_and(|x| x == "md") {
                    names.push(name);
                }
            }
            Err(e) => diags.push(Diagnostic::new(
                None,
                K::Io,
                format!("cannot list the {what} directory {}: {e}", root.display()),
            )),
        }
        if names.len() > MAX_DEFINITIONS {
            diags.push(Diagnostic::new(
                None,
                K::TooManyDefinitions,
                format!(
                    "{} holds more than {MAX_DEFINITIONS} {}",
                    root.display(),
                    kind.files
                ),
            ));
            break;
        }
    }
    if !diags.is_empty() {
        return Err(diags);
    }
    names.sort();
    let files = names
        .into_iter()
        .map(|name| {
            let bytes = read_one(&canonical, &name, kind);
            (name, bytes)
        })
        .collect();
    Ok((canonical, files))
}

/// The bytes of one entry. The file may grow between the metadata check and
/// the read; the parsers reject anything over the limit.
fn read_one(root: &Path, name: &Path, kind: RootKind) -> Result<Vec<u8>, Diagnostic> {
    let path = root.join(name);
    let d = |k, msg: String| Diagnostic::new(Some(name), k, msg);
    let link =
        fs::symlink_metadata(&path).map_err(|e| d(K::Io, format!("cannot read the file: {e}")))?;
    let target = if link.file_type().is_symlink() {
        match fs::canonicalize(&path) {
            Ok(t) if t.starts_with(root) => t,
            Ok(t) => {
                return Err(d(
                    K::SymlinkEscape,
                    format!(
                        "is a symlink to {}, outside the {} directory; copy the file in instead",
                        t.display(),
                        kind.what
                    ),
                ))
            }
            Err(e) => {
                return Err(d(
                    K::Io,
                    format!("is a symlink that cannot be followed: {e}"),
                ))
            }
        }
    } else {
        path
    };
    let meta = fs::metadata(&target).map_err(|e| d(K::Io, format!("cannot read the file: {e}")))?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(d(
            K::NotRegularFile,
            format!(
                "is {what}; every top-level `*.md` entry must be {}",
                kind.entry
            ),
        ));
    }
    if meta.len() > MAX_DEFINITION_BYTES {
        return Err(too_large(name, meta.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    fs::File::open(&target)
        .and_then(|f| f.take(MAX_DEFINITION_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| d(K::Io, format!("cannot read the file: {e}")))?;
    Ok(bytes)
}
