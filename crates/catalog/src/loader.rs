//! Reads definition files from the definitions root. The only module that
//! touches the filesystem, and only below the canonicalized root: top-level
//! `*.md` regular files (or symlinks to files inside the root), sorted by
//! name, each size-checked from metadata before a bounded read.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::diagnostic::{Diagnostic, DiagnosticKind as K};
use crate::parse::{parse_bytes_full, too_large, Parsed, MAX_DEFINITION_BYTES};

/// Most `*.md` files a definitions root may hold.
pub const MAX_DEFINITIONS: usize = 4096;

/// One file of the root, parsed.
pub(crate) struct SourceFile {
    /// File name relative to the root.
    pub file: PathBuf,
    /// What parsing it gave.
    pub parsed: Parsed,
}

fn failed(file: &Path, d: Diagnostic) -> SourceFile {
    SourceFile {
        file: file.to_path_buf(),
        parsed: Parsed {
            outcome: Err(vec![d]),
            yaml: String::new(),
            salvaged_id: None,
        },
    }
}

/// Canonicalizes `root` and parses every top-level `*.md` file in it, sorted
/// by file name. Names starting with `.` (editor and hidden files) and files
/// with any other extension are skipped; the extension match is exact (`.md`).
/// Root-level problems come back as `Err`.
pub(crate) fn read_root(root: &Path) -> Result<(PathBuf, Vec<SourceFile>), Vec<Diagnostic>> {
    let root_err = |msg: String| vec![Diagnostic::new(None, K::RootUnusable, msg)];
    let canonical = fs::canonicalize(root).map_err(|e| {
        root_err(format!(
            "cannot open the definitions directory {}: {e}",
            root.display()
        ))
    })?;
    if !canonical.is_dir() {
        return Err(root_err(format!(
            "the definitions path {} is not a directory",
            root.display()
        )));
    }
    let entries = fs::read_dir(&canonical).map_err(|e| {
        root_err(format!(
            "cannot list the definitions directory {}: {e}",
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
                format!(
                    "cannot list the definitions directory {}: {e}",
                    root.display()
                ),
            )),
        }
        if names.len() > MAX_DEFINITIONS {
            diags.push(Diagnostic::new(
                None,
                K::TooManyDefinitions,
                format!(
                    "{} holds more than {MAX_DEFINITIONS} definition files",
                    root.display()
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
        .iter()
        .map(|name| read_one(&canonical, name))
        .collect();
    Ok((canonical, files))
}

fn read_one(root: &Path, name: &Path) -> SourceFile {
    let path = root.join(name);
    let d = |kind, msg: String| Diagnostic::new(Some(name), kind, msg);
    let link = match fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) => return failed(name, d(K::Io, format!("cannot read the file: {e}"))),
    };
    let target = if link.file_type().is_symlink() {
        match fs::canonicalize(&path) {
            Ok(t) if t.starts_with(root) => t,
            Ok(t) => {
                return failed(
                    name,
                    d(
                        K::SymlinkEscape,
                        format!(
                            "is a symlink to {}, outside the definitions directory; copy the file in instead",
                            t.display()
                        ),
                    ),
                )
            }
            Err(e) => {
                return failed(
                    name,
                    d(K::Io, format!("is a symlink that cannot be followed: {e}")),
                )
            }
        }
    } else {
        path
    };
    let meta = match fs::metadata(&target) {
        Ok(m) => m,
        Err(e) => return failed(name, d(K::Io, format!("cannot read the file: {e}"))),
    };
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return failed(
            name,
            d(
                K::NotRegularFile,
                format!("is {what}; every top-level `*.md` entry must be an agent definition file"),
            ),
        );
    }
    if meta.len() > MAX_DEFINITION_BYTES {
        return failed(name, too_large(name, meta.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    let read = fs::File::open(&target)
        .and_then(|f| f.take(MAX_DEFINITION_BYTES + 1).read_to_end(&mut bytes));
    if let Err(e) = read {
        return failed(name, d(K::Io, format!("cannot read the file: {e}")));
    }
    // The file may have grown between the metadata check and the read;
    // parse_bytes_full rejects anything over the limit.
    SourceFile {
        file: name.to_path_buf(),
        parsed: parse_bytes_full(name, &bytes),
    }
}
