//! `keel agents check DIR`: validates agent definitions against the
//! configuration and prints the catalog, or every diagnostic.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use keel_catalog::{AgentCatalog, CatalogInputs};

use crate::app::default_tool_registry;
use crate::config::Config;
use crate::error::Result;

/// Builds the catalog inputs a configuration implies.
pub fn catalog_inputs(config: Option<&Config>) -> Result<CatalogInputs> {
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
    Ok(inputs)
}

/// Runs the check; exit 0 with a summary, or 1 with the diagnostics.
pub fn check(dir: &Path, config_file: Option<&Path>) -> Result<ExitCode> {
    let loaded = match config_file {
        Some(path) => Some(Config::load(Some(path), None)?),
        None => None,
    };
    let inputs = catalog_inputs(loaded.as_ref().map(|l| &l.config))?;
    match AgentCatalog::load(dir, &inputs, 1) {
        Ok(catalog) => {
            println!("{}", catalog.summary());
            Ok(ExitCode::SUCCESS)
        }
        Err(diagnostics) => {
            println!("{diagnostics}");
            Ok(ExitCode::FAILURE)
        }
    }
}
