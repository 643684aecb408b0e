//! Strict Markdown-frontmatter agent definitions and skills, and the
//! immutable agent catalog.
//!
//! Users write one agent per `*.md` file: a YAML frontmatter between a
//! first-line `---` and a closing `---`, then the role prompt. A typo must
//! never silently change what an agent may do, so parsing is strict (unknown
//! and duplicate keys, wrong types, out-of-range limits, tabs in indentation,
//! extra YAML documents are all errors) and every problem is reported with
//! its file, line, key path and a fix.
//!
//! ```text
//! ---
//! id: researcher
//! description: Finds and summarizes sources.
//! llm_profile: default
//! tools: [read_file, search_text]
//! delegates: [summarizer]
//! limits: { max_iterations: 8 }
//! signal: { delivery: queue, severities: [info, warning] }
//! ---
//! You are a careful researcher …
//! ```
//!
//! Loading has two passes: parse every file ([`parse_definition`]), then
//! resolve references against [`CatalogInputs`] (provider profiles, the
//! [`keel_core::ToolRegistry`], skills, `root_delegates`). The result is an
//! immutable [`AgentCatalog`]; [`CatalogHandle::reload`] swaps in a new one
//! only when the whole directory is valid.
//!
//! # Rules
//!
//! - **Files**: every top-level `*.md` entry of the root is a definition
//!   (exact, lowercase extension; names starting with `.` and other
//!   extensions are ignored; subdirectories are not read). At most
//!   [`MAX_DEFINITIONS`] files of at most [`MAX_DEFINITION_BYTES`] each, with
//!   at most [`MAX_FRONTMATTER_BYTES`] of frontmatter. Directories, devices,
//!   symlinks leaving the root and non-UTF-8 files are errors.
//! - **Ids** match `[a-z][a-z0-9_-]{0,63}`, are not in [`RESERVED_IDS`], and
//!   are unique after folding case and treating `-` and `_` as equal. The
//!   file name may differ from the id.
//! - **Defaults and caps**: every limit has a documented default and hard
//!   bounds ([`AgentLimits`], [`SignalContract`]); out-of-bounds values are
//!   errors naming the key, never clamped.
//! - **Tools** are fail-closed: an agent that the root or any agent may
//!   delegate to is checked with `ScopeRule::Delegated` (only `Delegatable`
//!   tools); runtime-injected tools can never be listed.
//! - **Approval**: `approval: [shell, write_file]` names tools of the
//!   agent's own `tools:` whose calls wait for a person's approval, and
//!   `approval: all` gates every call; any other name is an error. (A
//!   sub-agent run cannot ask yet: keel refuses its gated calls.)
//! - **Cycles** in the delegation graph are allowed; the depth bound makes
//!   every chain finite (see [`AgentCatalog`]).
//! - **Hash**: `definition_hash` ignores formatting and changes with any
//!   value (see [`AgentDefinition::definition_hash`]).
//! - **MCP tools** are listed as `mcp:SERVER/TOOL` or `mcp:SERVER/*` and
//!   resolve against [`CatalogInputs::mcp`], the tools of each configured
//!   server's last committed manifest (so a check needs no server running);
//!   after loading, a definition's `tools` holds the registered names they
//!   stand for. A server's tools are root-only unless it is delegatable.
//! - **Skills** ([`SkillSet`]) come from their own root with the same file
//!   rules (frontmatter `name`, `description`; the body is the skill); an
//!   agent's `skills:` entries must name existing skills.
//! - **Warnings** never fail a load; they stay with the catalog
//!   ([`AgentCatalog::warnings`]). One today: a role prompt that begins
//!   with a second frontmatter-like block (`---`, keys, `---`).
//!
//! Architecture invariant: keel-catalog depends only on keel-core and never
//! touches the filesystem outside the definitions and skills roots.
#![deny(missing_docs)]

mod catalog;
mod definition;
mod diagnostic;
mod loader;
mod locate;
mod parse;
mod resolve;
mod skills;
mod warnings;

use std::path::Path;

pub use catalog::{AgentCatalog, AgentSummary, CatalogHandle, CatalogSummary, SkillSummary};
pub use definition::*;
pub use diagnostic::{Diagnostic, DiagnosticKind, Diagnostics};
pub use loader::MAX_DEFINITIONS;
pub use parse::{
    is_reserved, parse_definition, parse_definition_bytes, parse_skill, parse_skill_bytes,
    MAX_DEFINITION_BYTES, MAX_FRONTMATTER_BYTES, RESERVED_IDS,
};
pub use resolve::{
    CatalogInputs, McpServerTools, DEFAULT_MAX_DELEGATION_DEPTH, MAX_DELEGATION_DEPTH_CAP,
};
pub use skills::{Skill, SkillSet};

/// What `keel agents check DIR` runs: loads `root` as generation 0 and
/// returns the summary to print, or every problem.
pub fn check(root: &Path, inputs: &CatalogInputs) -> Result<CatalogSummary, Diagnostics> {
    AgentCatalog::load(root, inputs, 0).map(|c| c.summary())
}
