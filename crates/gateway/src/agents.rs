//! `keel agents check DIR`: validates agent definitions and skills against
//! the configuration and prints the catalog, or every diagnostic.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use keel_catalog::{AgentCatalog, CatalogInputs, Diagnostics, SkillSet};

use crate::app::default_tool_registry;
use crate::config::Config;
use crate::error::Result;

/// Builds the catalog inputs a configuration implies; `mcp:` references
/// resolve against the manifests committed in its database (no MCP server
/// is started or reached).
pub async fn catalog_inputs(config: Option<&Config>) -> Result<CatalogInputs> {
    let (profiles, tools, root_delegates, depth) = match config {
        None => (
            vec!["default".to_owned()],
            default_tool_registry()?,
            Vec::new(),
            None,
        ),
        Some(c) => (
            c.profile_names(),
            keel_engine::builtin_registry(&c.builtin_tools(Vec::new()).0)?,
            c.root_delegate_ids(),
            Some(c.orchestration.max_tree_depth),
        ),
    };
    let mut inputs = CatalogInputs::new(profiles, Arc::new(tools));
    inputs.root_delegates = root_delegates;
    if let Some(depth) = depth {
        inputs.max_delegation_depth = depth;
    }
    if let Some(c) = config.filter(|c| !c.mcp.is_empty()) {
        let location = crate::storage::Location::of(c);
        let records = if location.exists() {
            location.open(c).await?.mcp_manifests().await?
        } else {
            Vec::new()
        };
        inputs.mcp = crate::mcp::catalog_servers(c, &records)?;
    }
    Ok(inputs)
}

/// The skills a check validates against: `--skills DIR`, else the
/// configuration's skills directory, else a `skills` directory next to the
/// definitions directory (the data-directory layout), else none.
fn skills_for_check(
    dir: &Path,
    config: Option<&Config>,
    skills: Option<&Path>,
) -> std::result::Result<SkillSet, Diagnostics> {
    let chosen: Option<PathBuf> = match (skills, config) {
        (Some(explicit), _) => Some(explicit.to_path_buf()),
        (None, Some(c)) => c.skills_dir(),
        (None, None) => dir
            .parent()
            .map(|p| p.join(crate::config::DEFAULT_SKILLS_SUBDIR))
            .filter(|p| p.is_dir()),
    };
    match chosen {
        Some(root) => SkillSet::load(&root),
        None => Ok(SkillSet::empty()),
    }
}

/// Runs the check; exit 0 with a summary, or 1 with the diagnostics.
pub async fn check(
    dir: &Path,
    config_file: Option<&Path>,
    skills: Option<&Path>,
) -> Result<ExitCode> {
    let loaded = match config_file {
        Some(path) => Some(Config::load(Some(path), None)?),
        None => None,
    };
    let config = loaded.as_ref().map(|l| &l.config);
    let mut inputs = catalog_inputs(config).await?;
    inputs.skills = match skills_for_check(dir, config, skills) {
        Ok(set) => set,
        Err(diagnostics) => {
            println!("{diagnostics}");
            return Ok(ExitCode::FAILURE);
        }
    };
    match AgentCatalog::load(dir, &inputs, 1) {
        Ok(catalog) => {
            println!("{}", catalog.summary());
            for w in catalog.warnings() {
                println!("warning: {w}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(diagnostics) => {
            println!("{diagnostics}");
            Ok(ExitCode::FAILURE)
        }
    }
}
