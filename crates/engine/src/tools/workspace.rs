//! The directory file tools are confined to, and how they open things in it.
//!
//! Every path is resolved by the kernel relative to a descriptor of the root
//! with `openat2(RESOLVE_BENEATH)`: `..`, absolute symlinks and symlinks that
//! lead out fail during resolution, so there is no check-then-use window
//! between deciding a path is inside and opening it. Files are opened as
//! `O_PATH` first and inspected through that descriptor (type, size, real
//! path), so a FIFO or a device is refused without ever being opened for
//! reading. Keel's own data directory and configuration file are refused
//! wherever they are, by the real path of what was opened.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use keel_core::ToolError;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::EngineError;

/// Retries of an open whose `..` a concurrent rename raced (EAGAIN).
const OPEN_RETRIES: usize = 16;

/// A directory file tools may not leave, holding paths they may not touch.
#[derive(Debug, Clone)]
pub(crate) struct Workspace {
    root: Arc<PathBuf>,
    /// The root as configured (absolute paths may name it this way too).
    configured: Arc<PathBuf>,
    root_fd: Arc<OwnedFd>,
    protected: Arc<Vec<PathBuf>>,
}

/// Something opened inside the workspace, as an `O_PATH` descriptor.
pub(crate) struct Node {
    fd: OwnedFd,
    kind: FileType,
    len: u64,
    /// The real path relative to the root (`.` for the root).
    pub(crate) rel: PathBuf,
    /// `rel` as the model sees it.
    pub(crate) shown: String,
}

impl Workspace {
    /// Opens `root`, which must be an existing directory; nothing at or below
    /// a path in `protected` can be read, listed, searched or written.
    pub(crate) fn new(root: &Path, protected: &[PathBuf]) -> crate::error::Result<Self> {
        let bad = |message: String| EngineError::Workspace {
            path: root.to_path_buf(),
            message,
        };
        let canonical = root.canonicalize().map_err(|e| bad(e.to_string()))?;
        let root_fd = rustix::fs::open(
            &canonical,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| bad(std::io::Error::from(e).to_string()))?;
        let configured = if root.is_absolute() {
            root.to_path_buf()
        } else {
            canonical.clone()
        };
        Ok(Self {
            root: Arc::new(canonical),
            configured: Arc::new(configured),
            root_fd: Arc::new(root_fd),
            protected: Arc::new(protected.iter().map(|p| absolute_real(p)).collect()),
        })
    }

    /// The canonical root.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Paths (canonical) no tool may touch.
    pub(crate) fn protected(&self) -> &[PathBuf] {
        &self.protected
    }

    /// Opens what `user_path` names, following symlinks only while they stay
    /// beneath the root.
    pub(crate) fn open(&self, user_path: &str) -> Result<Node, ToolError> {
        let rel = self.relative(user_path)?;
        self.open_rel(&rel, true).map_err(|e| e.for_path(user_path))
    }

    /// Opens `rel` (relative to the root) without following a symlink in its
    /// last component; a symlink comes back as a node of that type.
    pub(crate) fn open_entry(&self, rel: &Path) -> Result<Node, OpenError> {
        self.open_rel(rel, false)
    }

    fn open_rel(&self, rel: &Path, follow_last: bool) -> Result<Node, OpenError> {
        let mut flags = OFlags::PATH | OFlags::CLOEXEC;
        if !follow_last {
            flags |= OFlags::NOFOLLOW;
        }
        let open = || {
            rustix::fs::openat2(
                &*self.root_fd,
                rel,
                flags,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
            )
        };
        // With RESOLVE_BENEATH the kernel answers EAGAIN when a rename or
        // mount anywhere raced a `..` of the path; openat2(2) says retry.
        let mut opened = open();
        for _ in 0..OPEN_RETRIES {
            if !matches!(opened, Err(Errno::AGAIN)) {
                break;
            }
            opened = open();
        }
        let fd = opened.map_err(OpenError::from)?;
        let real = real_path(&fd)?;
        self.check_allowed(&real)?;
        let stat = rustix::fs::fstat(&fd).map_err(OpenError::from)?;
        let rel = match real.strip_prefix(self.root.as_path()) {
            Ok(r) if !r.as_os_str().is_empty() => r.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Ok(Node {
            fd,
            kind: FileType::from_raw_mode(stat.st_mode),
            len: u64::try_from(stat.st_size).unwrap_or(0),
            shown: rel.display().to_string(),
            rel,
        })
    }

    /// Replaces (or creates) the regular file `user_path` with `content`
    /// through a temporary file created exclusively, under a random name, in
    /// the target's own directory, then renamed over it: readers never see a
    /// half-written file, a symlink planted anywhere is never followed, and
    /// parallel writes into one directory cannot collide. An existing file
    /// keeps its permissions. Returns the path as shown to the model.
    pub(crate) fn write_file(&self, user_path: &str, content: &[u8]) -> Result<String, ToolError> {
        let rel = self.relative(user_path)?;
        let name = match rel.components().next_back() {
            Some(Component::Normal(name)) => name.to_owned(),
            _ => {
                return Err(ToolError::InvalidArguments(format!(
                    "{user_path}: not a file path"
                )))
            }
        };
        let parent = rel.parent().unwrap_or(Path::new(""));
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        let dir = self
            .open_rel(parent, true)
            .map_err(|e| e.for_path(user_path))?;
        if dir.kind != FileType::Directory {
            return Err(ToolError::Failed(format!(
                "{user_path}: parent is not a directory"
            )));
        }
        let target = real_path(&dir.fd)
            .map_err(|e| e.for_path(user_path))?
            .join(&name);
        self.check_allowed(&target)
            .map_err(|e| e.for_path(user_path))?;
        let existing_mode = match rustix::fs::statat(&dir.fd, &name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => Some(st.st_mode & 0o7777),
                FileType::Directory => {
                    return Err(ToolError::Failed(format!("{user_path}: is a directory")))
                }
                FileType::Symlink => {
                    return Err(ToolError::Failed(format!(
                    "{user_path}: is a symbolic link; write the file it points to by its own path"
                )))
                }
                _ => {
                    return Err(ToolError::Failed(format!(
                        "{user_path}: not a regular file"
                    )))
                }
            },
            Err(Errno::NOENT) => None,
            Err(e) => return Err(OpenError::from(e).for_path(user_path)),
        };
        let failed = |e: std::io::Error| ToolError::Failed(format!("{user_path}: {e}"));
        // The directory by descriptor: every name below resolves inside the
        // directory that was checked, whatever happens to its path meanwhile.
        let dir_path = proc_fd_path(&dir.fd);
        let mut tmp = tempfile::Builder::new()
            .prefix(".keel-write-")
            .permissions(std::fs::Permissions::from_mode(
                existing_mode.unwrap_or(0o666),
            ))
            .tempfile_in(&dir_path)
            .map_err(failed)?;
        if let Some(mode) = existing_mode {
            // Exactly the old mode (creation was subject to the umask).
            tmp.as_file()
                .set_permissions(std::fs::Permissions::from_mode(mode))
                .map_err(failed)?;
        }
        tmp.write_all(content).map_err(failed)?;
        tmp.as_file().sync_all().map_err(failed)?;
        tmp.persist(dir_path.join(&name))
            .map_err(|e| failed(e.error))?;
        drop(dir);
        Ok(self.display(&target))
    }

    /// The path relative to the root, for display.
    pub(crate) fn display(&self, path: &Path) -> String {
        match path.strip_prefix(self.root.as_path()) {
            Ok(rel) if rel.as_os_str().is_empty() => ".".into(),
            Ok(rel) => rel.display().to_string(),
            Err(_) => path.display().to_string(),
        }
    }

    /// `user_path` relative to the root: relative paths as given, absolute
    /// ones only when they name something under the root.
    fn relative(&self, user_path: &str) -> Result<PathBuf, ToolError> {
        if user_path.contains('\0') {
            return Err(ToolError::InvalidArguments(
                "path contains a NUL byte".into(),
            ));
        }
        let p = Path::new(user_path);
        if p.components().any(|c| matches!(c, Component::Prefix(_))) {
            return Err(ToolError::InvalidArguments(format!(
                "{user_path}: unsupported path"
            )));
        }
        let rel = if p.is_absolute() {
            p.strip_prefix(self.root.as_path())
                .or_else(|_| p.strip_prefix(self.configured.as_path()))
                .map_err(|_| outside(user_path))?
        } else {
            p
        };
        Ok(if rel.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            rel.to_path_buf()
        })
    }

    fn check_allowed(&self, real: &Path) -> Result<(), OpenError> {
        if !real.starts_with(self.root.as_path()) {
            return Err(OpenError::Outside);
        }
        if self.protected.iter().any(|p| real.starts_with(p)) {
            return Err(OpenError::Protected);
        }
        Ok(())
    }
}

impl Node {
    /// Whether this is a directory.
    pub(crate) fn is_dir(&self) -> bool {
        self.kind == FileType::Directory
    }

    /// Whether this is a regular file.
    pub(crate) fn is_file(&self) -> bool {
        self.kind == FileType::RegularFile
    }

    /// Size in bytes (of a regular file).
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Opens the regular file for reading (the same inode that was checked).
    pub(crate) fn reader(&self) -> Result<std::fs::File, ToolError> {
        if !self.is_file() {
            return Err(ToolError::Failed(format!(
                "{}: not a regular file",
                self.shown
            )));
        }
        std::fs::File::open(proc_fd_path(&self.fd))
            .map_err(|e| ToolError::Failed(format!("{}: {e}", self.shown)))
    }

    /// Reads the whole regular file, refusing more than `max` bytes.
    pub(crate) fn read_to_end(&self, max: u64) -> Result<Vec<u8>, ToolError> {
        let file = self.reader()?;
        if self.len > max {
            return Err(ToolError::Failed(format!(
                "{}: {} bytes is over the {max}-byte limit",
                self.shown, self.len
            )));
        }
        let mut bytes = Vec::new();
        file.take(max)
            .read_to_end(&mut bytes)
            .map_err(|e| ToolError::Failed(format!("{}: {e}", self.shown)))?;
        Ok(bytes)
    }

    /// The names in this directory with whether each is a directory (symlinks
    /// are not followed), unsorted.
    pub(crate) fn entries(&self) -> Result<Vec<(std::ffi::OsString, bool)>, ToolError> {
        let fail = |e: std::io::Error| ToolError::Failed(format!("{}: {e}", self.shown));
        if !self.is_dir() {
            return Err(ToolError::Failed(format!(
                "{}: not a directory",
                self.shown
            )));
        }
        let mut out = Vec::new();
        for entry in std::fs::read_dir(proc_fd_path(&self.fd)).map_err(fail)? {
            let entry = entry.map_err(fail)?;
            let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
            out.push((entry.file_name(), is_dir));
        }
        Ok(out)
    }
}

/// Why something could not be opened inside the workspace.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// Resolution left the root.
    Outside,
    /// It is keel's data directory or configuration file.
    Protected,
    /// The system refused.
    Io(std::io::Error),
}

impl From<Errno> for OpenError {
    fn from(e: Errno) -> Self {
        if e == Errno::XDEV {
            // RESOLVE_BENEATH: a `..`, absolute symlink or symlink that leaves the root.
            OpenError::Outside
        } else {
            OpenError::Io(e.into())
        }
    }
}

impl OpenError {
    /// The error the model sees for `user_path`.
    pub(crate) fn for_path(self, user_path: &str) -> ToolError {
        match self {
            OpenError::Outside => outside(user_path),
            OpenError::Protected => ToolError::Denied(format!(
                "{user_path} belongs to keel itself (its data directory or configuration); tools may not touch it"
            )),
            OpenError::Io(e) => ToolError::Failed(format!("{user_path}: {e}")),
        }
    }
}

fn outside(user_path: &str) -> ToolError {
    ToolError::Denied(format!("{user_path} is outside the workspace"))
}

/// `/proc/self/fd/N`: the path through which a descriptor's file is
/// reopened, or names inside its directory are resolved, by descriptor.
fn proc_fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// The real path of what `fd` refers to.
fn real_path(fd: &OwnedFd) -> Result<PathBuf, OpenError> {
    std::fs::read_link(proc_fd_path(fd)).map_err(OpenError::Io)
}

/// `p` made absolute and canonical as far as it exists (a configuration
/// file that does not exist yet is still protected by its future path).
fn absolute_real(p: &Path) -> PathBuf {
    if let Ok(real) = p.canonicalize() {
        return real;
    }
    match (p.parent(), p.file_name()) {
        (Some(parent), Some(name)) if !parent.as_os_str().is_empty() => {
            absolute_real(parent).join(name)
        }
        _ => std::env::current_dir()
            .map(|d| d.join(p))
            .unwrap_or_else(|_| p.to_path_buf()),
    }
}
