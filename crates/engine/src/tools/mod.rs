//! Built-in tools and the registry they are assembled into.
//!
//! File tools are confined to a workspace root by the kernel
//! ([`Workspace`]: `openat2(RESOLVE_BENEATH)`, no check-then-use), and never
//! touch keel's own data directory or configuration file. `write_file` and
//! `shell` are `RootOnly` and are registered only when enabled in the
//! configuration; shell commands run under Landlock ([`sandbox`]).

mod fs;
pub(crate) mod memory;
mod sandbox;
mod shell;
mod skills;
mod time;
mod workspace;

use std::path::PathBuf;
use std::sync::Arc;

use keel_core::{ToolError, ToolRegistry};
use serde::de::DeserializeOwned;

use crate::error::Result;
use fs::{ListDirTool, ReadFileTool, SearchTextTool, WriteFileTool};
pub use sandbox::{
    check_sandbox_support, run_sandbox_launcher, LandlockPolicy, DEFAULT_SHELL_READ_PATHS,
    SANDBOX_LAUNCHER_ARG,
};
use shell::ShellTool;
pub use shell::{ShellConfig, ShellConfinement};
use time::{CurrentTimeTool, SleepTool};
use workspace::Workspace;

pub use memory::register_memory_tools;
pub use skills::grant_skills;

/// Most bytes any built-in tool returns to the model.
pub(crate) const MAX_TOOL_OUTPUT_BYTES: usize = 64 * 1024;

/// Which built-in tools exist and where file tools may look.
#[derive(Debug, Clone)]
pub struct BuiltinToolsConfig {
    /// Root directory file tools are confined to.
    pub workspace_root: PathBuf,
    /// Paths no tool may read, list, search or write, wherever they are:
    /// keel's data directory and configuration file.
    pub protected_paths: Vec<PathBuf>,
    /// Register `write_file` (RootOnly).
    pub enable_write: bool,
    /// Register `shell` (RootOnly).
    pub enable_shell: bool,
    /// How shell commands run.
    pub shell: ShellConfig,
}

impl BuiltinToolsConfig {
    /// Read-only tools confined to `workspace_root`; write and shell off.
    pub fn new(workspace_root: impl Into<PathBuf>) -> Self {
        Self {
            workspace_root: workspace_root.into(),
            protected_paths: Vec::new(),
            enable_write: false,
            enable_shell: false,
            shell: ShellConfig::default(),
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
    let workspace = Workspace::new(&config.workspace_root, &config.protected_paths)?;
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
        registry.register(Arc::new(ShellTool::new(workspace, config.shell.clone())?))?;
    }
    Ok(registry)
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
        cfg.shell.confinement = ShellConfinement::Unconfined;
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
}
