//! Built-in tools and the registry they are assembled into.
//!
//! File tools are confined to a workspace root: paths are resolved and
//! canonicalized, and anything that leaves the root (`..`, absolute paths,
//! symlinks pointing out) is refused. `write_file` and `shell` are
//! `RootOnly` and are registered only when enabled in the configuration.

mod fs;
mod shell;
mod time;

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel_core::{ToolError, ToolRegistry};
use serde::de::DeserializeOwned;

use crate::error::{EngineError, Result};
use fs::{ListDirTool, ReadFileTool, SearchTextTool, WriteFileTool};
use shell::ShellTool;
use time::{CurrentTimeTool, SleepTool};

/// Most bytes any built-in tool returns to the model.
pub(crate) const MAX_TOOL_OUTPUT_BYTES: usize = 64 * 1024;

/// Which built-in tools exist and where file tools may look.
#[derive(Debug, Clone)]
pub struct BuiltinToolsConfig {
    /// Root directory file tools are confined to.
    pub workspace_root: PathBuf,
    /// Register `write_file` (RootOnly).
    pub enable_write: bool,
    /// Register `shell` (RootOnly).
    pub enable_shell: bool,
    /// Default and maximum run time of a shell command.
    pub shell_timeout: Duration,
}

impl BuiltinToolsConfig {
    /// Read-only tools confined to `workspace_root`; write and shell off.
    pub fn new(workspace_root: impl Into<PathBuf>) -> Self {
        Self {
            workspace_root: workspace_root.into(),
            enable_write: false,
            enable_shell: false,
            shell_timeout: Duration::from_secs(30),
        }
    }
}

/// Names of every built-in tool, whether enabled or not.
#[cfg(test)]
const BUILTIN_TOOL_NAMES: &[&str] = &[
    "current_time",
    "list_dir",
    "read_file",
    "search_text",
    "shell",
    "sleep",
    "write_file",
];

/// Builds the registry of built-in tools described by `config`.
pub fn builtin_registry(config: &BuiltinToolsConfig) -> Result<ToolRegistry> {
    let workspace = Workspace::new(&config.workspace_root)?;
    let mut registry = ToolRegistry::new();
    registry.register(Arc::new(ReadFileTool::new(workspace.clone())))?;
    registry.register(Arc::new(ListDirTool::new(workspace.clone())))?;
    registry.register(Arc::new(SearchTextTool::new(workspace.clone())))?;
    registry.register(Arc::new(CurrentTimeTool))?;
    registry.register(Arc::new(SleepTool))?;
    if config.enable_write {
        registry.register(Arc::new(WriteFileTool::new(workspace.clone())))?;
    }
    if config.enable_shell {
        registry.register(Arc::new(ShellTool::new(workspace, config.shell_timeout)))?;
    }
    Ok(registry)
}

/// A canonical directory that file tools may not leave.
#[derive(Debug, Clone)]
pub(crate) struct Workspace {
    root: Arc<PathBuf>,
}

impl Workspace {
    /// Canonicalizes `root`, which must be an existing directory.
    pub(crate) fn new(root: &Path) -> Result<Self> {
        let bad = |message: String| EngineError::Workspace {
            path: root.to_path_buf(),
            message,
        };
        let canonical = root.canonicalize().map_err(|e| bad(e.to_string()))?;
        if !canonical.is_dir() {
            return Err(bad("not a directory".into()));
        }
        Ok(Self {
            root: Arc::new(canonical),
        })
    }

    /// The canonical root.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a user-supplied path to an existing file or directory inside
    /// the workspace, following symlinks only while they stay inside.
    pub(crate) fn resolve_existing(&self, user_path: &str) -> Result<PathBuf, ToolError> {
        let joined = self.join(user_path)?;
        let canonical = joined
            .canonicalize()
            .map_err(|e| ToolError::Failed(format!("{user_path}: {e}")))?;
        self.ensure_inside(user_path, &canonical)?;
        Ok(canonical)
    }

    /// Resolves a path that may not exist yet (for writing): its parent must
    /// exist inside the workspace and the target must not be a symlink out.
    pub(crate) fn resolve_for_write(&self, user_path: &str) -> Result<PathBuf, ToolError> {
        let joined = self.join(user_path)?;
        let name = joined
            .file_name()
            .ok_or_else(|| ToolError::InvalidArguments(format!("{user_path}: not a file path")))?
            .to_owned();
        let parent = joined
            .parent()
            .ok_or_else(|| ToolError::InvalidArguments(format!("{user_path}: no parent")))?;
        let parent = parent
            .canonicalize()
            .map_err(|e| ToolError::Failed(format!("{user_path}: parent directory: {e}")))?;
        self.ensure_inside(user_path, &parent)?;
        let target = parent.join(name);
        if let Ok(meta) = std::fs::symlink_metadata(&target) {
            if meta.file_type().is_symlink() {
                let real = target
                    .canonicalize()
                    .map_err(|e| ToolError::Failed(format!("{user_path}: {e}")))?;
                self.ensure_inside(user_path, &real)?;
            } else if meta.is_dir() {
                return Err(ToolError::Failed(format!("{user_path}: is a directory")));
            }
        }
        Ok(target)
    }

    /// The path relative to the root, for display.
    pub(crate) fn display(&self, path: &Path) -> String {
        match path.strip_prefix(self.root.as_path()) {
            Ok(rel) if rel.as_os_str().is_empty() => ".".into(),
            Ok(rel) => rel.display().to_string(),
            Err(_) => path.display().to_string(),
        }
    }

    fn join(&self, user_path: &str) -> Result<PathBuf, ToolError> {
        if user_path.contains('\0') {
            return Err(ToolError::InvalidArguments(
                "path contains a NUL byte".into(),
            ));
        }
        let p = Path::new(user_path);
        if p.is_absolute() {
            return Ok(p.to_path_buf());
        }
        if p.components().any(|c| matches!(c, Component::Prefix(_))) {
            return Err(ToolError::InvalidArguments(format!(
                "{user_path}: unsupported path"
            )));
        }
        Ok(self.root.join(p))
    }

    fn ensure_inside(&self, user_path: &str, canonical: &Path) -> Result<(), ToolError> {
        if canonical.starts_with(self.root.as_path()) {
            Ok(())
        } else {
            Err(ToolError::Denied(format!(
                "{user_path} is outside the workspace"
            )))
        }
    }
}

/// Parses tool arguments into `T`, reporting schema mismatches to the model.
pub(crate) fn parse_args<T: DeserializeOwned>(args: serde_json::Value) -> Result<T, ToolError> {
    serde_json::from_value(args).map_err(|e| ToolError::InvalidArguments(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::DelegationPolicy;

    #[test]
    fn write_and_shell_are_root_only_and_off_by_default() {
        let dir = tempfile::tempdir().unwrap();
        let off = builtin_registry(&BuiltinToolsConfig::new(dir.path())).unwrap();
        assert_eq!(
            off.names().collect::<Vec<_>>(),
            [
                "current_time",
                "list_dir",
                "read_file",
                "search_text",
                "sleep"
            ]
        );
        let mut cfg = BuiltinToolsConfig::new(dir.path());
        cfg.enable_write = true;
        cfg.enable_shell = true;
        let on = builtin_registry(&cfg).unwrap();
        assert_eq!(on.policy("write_file"), Some(DelegationPolicy::RootOnly));
        assert_eq!(on.policy("shell"), Some(DelegationPolicy::RootOnly));
        for name in [
            "read_file",
            "list_dir",
            "search_text",
            "current_time",
            "sleep",
        ] {
            assert_eq!(
                on.policy(name),
                Some(DelegationPolicy::Delegatable),
                "{name}"
            );
        }
        let names: Vec<_> = on.names().collect();
        assert_eq!(names, BUILTIN_TOOL_NAMES);
        for def in on.definitions() {
            assert_eq!(
                def.parameters["type"], "object",
                "{} has an object schema",
                def.name
            );
        }
    }

    #[test]
    fn missing_workspace_is_an_error() {
        let err = builtin_registry(&BuiltinToolsConfig::new("/nonexistent/keel-ws")).unwrap_err();
        assert!(err
            .to_string()
            .starts_with("workspace root /nonexistent/keel-ws"));
    }

    #[test]
    fn paths_cannot_leave_the_workspace() {
        let outer = tempfile::tempdir().unwrap();
        let root = outer.path().join("ws");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(outer.path().join("secret.txt"), "s").unwrap();
        std::fs::write(root.join("ok.txt"), "ok").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(outer.path().join("secret.txt"), root.join("link")).unwrap();
        let ws = Workspace::new(&root).unwrap();
        assert!(ws.resolve_existing("ok.txt").is_ok());
        assert!(matches!(
            ws.resolve_existing("../secret.txt"),
            Err(ToolError::Denied(_))
        ));
        let abs = outer.path().join("secret.txt");
        assert!(matches!(
            ws.resolve_existing(abs.to_str().unwrap()),
            Err(ToolError::Denied(_))
        ));
        #[cfg(unix)]
        {
            assert!(matches!(
                ws.resolve_existing("link"),
                Err(ToolError::Denied(_))
            ));
            assert!(matches!(
                ws.resolve_for_write("link"),
                Err(ToolError::Denied(_))
            ));
        }
        assert!(matches!(
            ws.resolve_for_write("../x.txt"),
            Err(ToolError::Denied(_))
        ));
        assert!(ws.resolve_for_write("new.txt").is_ok());
    }
}
