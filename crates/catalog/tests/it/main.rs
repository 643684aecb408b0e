//! Integration tests of keel-catalog, linked into one binary: the parser
//! (one snapshot per rejection kind, fuzz regressions), definition hashes,
//! resolution against the caller's inputs, the loader on real files in
//! tempdirs, and reload.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

mod hash;
mod load;
mod mcp;
mod parse;
mod resolve;
mod skills;

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use keel_catalog::*;
use keel_core::{
    AgentId, DelegationPolicy, Delivery, Tool, ToolError, ToolExecutionContext, ToolOutput,
    ToolRegistry,
};

struct FakeTool(&'static str, DelegationPolicy);

#[async_trait]
impl Tool for FakeTool {
    fn name(&self) -> &str {
        self.0
    }
    fn description(&self) -> &str {
        "fake"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({"type": "object"})
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        self.1
    }
    async fn execute(
        &self,
        _args: serde_json::Value,
        _ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text(self.0))
    }
}

fn registry() -> Arc<ToolRegistry> {
    let mut r = ToolRegistry::new();
    for (name, policy) in [
        ("read_file", DelegationPolicy::Delegatable),
        ("search_text", DelegationPolicy::Delegatable),
        ("shell", DelegationPolicy::RootOnly),
        ("write_file", DelegationPolicy::RootOnly),
        ("delegate", DelegationPolicy::RuntimeInjected),
    ] {
        r.register(Arc::new(FakeTool(name, policy))).unwrap();
    }
    Arc::new(r)
}

fn inputs(root_delegates: &[&str]) -> CatalogInputs {
    let mut i = CatalogInputs::new(["default", "fast"], registry());
    let (git, rust) = (skill("git", "Git workflows."), skill("rust", "Rust style."));
    i.skills =
        SkillSet::from_texts([("git.md", git.as_str()), ("rust.md", rust.as_str())]).unwrap();
    i.root_delegates = root_delegates
        .iter()
        .map(|s| AgentId::parse(s).unwrap())
        .collect();
    i
}

fn skill(name: &str, description: &str) -> String {
    format!("---\nname: {name}\ndescription: {description}\n---\nHow to {name}.\n")
}

fn agent(id: &str, extra: &str) -> String {
    format!("---\nid: {id}\ndescription: The {id} agent.\nllm_profile: default\n{extra}---\nYou are {id}.\n")
}

fn render(diags: &[Diagnostic]) -> String {
    diags.iter().map(|d| format!("{d}\n")).collect()
}

fn parse_err(text: &str) -> Vec<Diagnostic> {
    parse_definition(Path::new("agent.md"), text).expect_err("should be rejected")
}

/// The frontmatter keys every definition needs.
const H: &str = "id: a\ndescription: d\nllm_profile: default\n";

fn valid_dir_files() -> Vec<(&'static str, String)> {
    vec![
        ("planner.md", agent("planner", "tools: [read_file]\ndelegates: [researcher, coder]\n").replace("llm_profile: default", "llm_profile: fast")),
        ("researcher.md", agent("researcher", "tools: [read_file, search_text]\ndelegates: [summarizer]\nskills: [git]\nsignal:\n  delivery: steer\n  severities: [info, warning]\n")),
        ("summarizer.md", agent("summarizer", "limits: {max_iterations: 4}\n")),
        ("coder.md", agent("coder", "tools: [read_file]\nskills: [rust, git]\n")),
        ("z-admin.md", agent("admin", "tools: [shell, write_file, read_file]\ndelegates: [planner]\n")),
    ]
}
