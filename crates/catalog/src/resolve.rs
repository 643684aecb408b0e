//! The resolution pass: with every file parsed and the id map built, check
//! what definitions refer to — delegates, `root_delegates`, provider
//! profiles, tools (fail-closed by delegation policy) and skills — against
//! the [`CatalogInputs`] the caller supplies. The catalog never reaches into
//! higher layers for them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use keel_core::{AgentId, ScopeRule, ToolRegistry, ToolRegistryError};

use crate::definition::AgentDefinition;
use crate::diagnostic::{Diagnostic, DiagnosticKind as K};
use crate::loader::SourceFile;
use crate::locate::{render_path, Locator, Seg};
use crate::skills::SkillSet;

/// Default longest delegation chain (root → a → b → c).
pub const DEFAULT_MAX_DELEGATION_DEPTH: u32 = 3;
/// Hard cap on the delegation depth a configuration may ask for.
pub const MAX_DELEGATION_DEPTH_CAP: u32 = 8;

/// What the catalog validates definitions against. Supplied by the caller
/// (the gateway builds it from config and the engine's built-in tools).
#[derive(Debug, Clone)]
pub struct CatalogInputs {
    /// Names of the configured provider profiles (`[providers.NAME]`).
    pub profiles: BTreeSet<String>,
    /// The profiles that have prices (`price_input_per_mtok` and
    /// `price_output_per_mtok`): `limits.max_cost_usd` needs them.
    pub priced_profiles: BTreeSet<String>,
    /// Every registered tool with its delegation policy.
    pub tools: Arc<ToolRegistry>,
    /// The skills definitions may list.
    pub skills: SkillSet,
    /// Agents the root agent may delegate to (config `root_delegates`).
    pub root_delegates: Vec<AgentId>,
    /// Longest delegation chain from the root (config `max_tree_depth`),
    /// 1..=[`MAX_DELEGATION_DEPTH_CAP`]. It is what makes delegation cycles
    /// finite, so the catalog refuses to load without a valid one.
    pub max_delegation_depth: u32,
    /// The run deadline of a definition that sets no `limits.timeout_secs`
    /// (config `default_run_timeout_secs`), in seconds within
    /// [`TIMEOUT_SECS_BOUND`](crate::TIMEOUT_SECS_BOUND).
    pub default_timeout_secs: u64,
    /// The configured MCP servers by name (`[mcp.NAME]`), with the tools of
    /// their last committed manifest; `mcp:NAME/TOOL` and `mcp:NAME/*`
    /// entries of `tools:` resolve against them.
    pub mcp: BTreeMap<String, McpServerTools>,
}

/// What the catalog knows of one MCP server: plain data from its last
/// committed manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct McpServerTools {
    /// Whether agents that are delegated to may use its tools.
    pub delegatable: bool,
    /// Its tools: MCP tool name → the registered tool's name; `None` when
    /// keel has never reached the server (no manifest was ever committed).
    pub tools: Option<BTreeMap<String, String>>,
}

impl CatalogInputs {
    /// Inputs with the given profiles and tools, no skills, no root delegates
    /// and the default depth.
    pub fn new(
        profiles: impl IntoIterator<Item = impl Into<String>>,
        tools: Arc<ToolRegistry>,
    ) -> Self {
        Self {
            profiles: profiles.into_iter().map(Into::into).collect(),
            priced_profiles: BTreeSet::new(),
            tools,
            skills: SkillSet::empty(),
            root_delegates: Vec::new(),
            max_delegation_depth: DEFAULT_MAX_DELEGATION_DEPTH,
            default_timeout_secs: crate::DEFAULT_TIMEOUT_SECS,
            mcp: BTreeMap::new(),
        }
    }
}

/// A successful resolution.
pub(crate) struct Resolved {
    pub definitions: BTreeMap<AgentId, Arc<AgentDefinition>>,
    pub delegatable: BTreeSet<AgentId>,
    /// Problems that did not fail the load, by file.
    pub warnings: Vec<Diagnostic>,
}

/// The key two ids collide on: case folded, `_` and `-` equal (so
/// `code_review` and `Code-Review` cannot both exist).
fn fold(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c == '_' {
                '-'
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect()
}

fn closest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    known
        .into_iter()
        .map(|k| (crate::diagnostic::edit_distance(name, k), k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min()
        .map(|(_, k)| k)
}

/// `; known X: a, b, c` (at most 12 names) or a did-you-mean.
fn hint<'a>(name: &str, what: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    let all: Vec<&str> = known.into_iter().collect();
    if let Some(c) = closest(name, all.iter().copied()) {
        return format!("; did you mean {c:?}?");
    }
    if all.is_empty() {
        return format!("; no {what} are defined");
    }
    let shown: Vec<&str> = all.iter().take(12).copied().collect();
    let more = if all.len() > shown.len() { ", …" } else { "" };
    format!("; known {what}: {}{more}", shown.join(", "))
}

struct FileCtx<'a> {
    file: PathBuf,
    locator: Locator<'a>,
}

impl FileCtx<'_> {
    fn diag(&self, kind: K, path: &[Seg<'_>], msg: String) -> Diagnostic {
        let pos = self.locator.locate(path).map(|(l, c)| (l + 2, Some(c)));
        Diagnostic::new(Some(&self.file), kind, msg)
            .at_opt(pos)
            .with_key(render_path(path))
    }
}

/// A definition that parsed, with the YAML its diagnostics point into.
type Parsed = (AgentDefinition, String);

/// An id some file claims: the id, the file, its YAML.
type Claim = (AgentId, PathBuf, String);

/// Builds the id map and resolves every reference; collects every problem,
/// parse problems included, sorted by file (config problems last).
pub(crate) fn resolve(
    files: Vec<SourceFile>,
    inputs: &CatalogInputs,
) -> Result<Resolved, Vec<Diagnostic>> {
    let mut diags = Vec::new();
    let warnings: Vec<Diagnostic> = files
        .iter()
        .flat_map(|f| f.parsed.warnings.iter().cloned())
        .collect();
    let (parsed, claims) = split_parsed(files, &mut diags);
    let known: BTreeSet<AgentId> = claims.iter().map(|(id, _, _)| id.clone()).collect();
    check_unique_ids(&claims, &mut diags);
    let delegators = delegators(&parsed, inputs);
    for (def, yaml) in &parsed {
        let ctx = FileCtx {
            file: def.source_file.clone(),
            locator: Locator::new(yaml),
        };
        check_delegates(def, &ctx, &known, &mut diags);
        check_profile(def, &ctx, inputs, &mut diags);
        check_priced(def, &ctx, &parsed, inputs, &mut diags);
        check_tools(def, &ctx, inputs, delegators.get(&def.id), &mut diags);
        check_approval(def, &ctx, &mut diags);
        check_skills(def, &ctx, inputs, &mut diags);
    }
    check_config_inputs(inputs, &known, &mut diags);
    if !diags.is_empty() {
        // By file (config last), then line; stable, so problems on one line
        // keep the order they were found in.
        diags.sort_by(|a, b| {
            (a.file.is_none(), &a.file, a.line.unwrap_or(0)).cmp(&(
                b.file.is_none(),
                &b.file,
                b.line.unwrap_or(0),
            ))
        });
        return Err(diags);
    }
    let delegatable = delegators.keys().map(|id| (*id).clone()).collect();
    let definitions = parsed
        .into_iter()
        .map(|(mut def, yaml)| {
            if !sets_timeout(&yaml) {
                def.limits.timeout_secs = inputs.default_timeout_secs;
            }
            def.tools = expand_mcp(&def.tools, &inputs.mcp);
            (def.id.clone(), Arc::new(def))
        })
        .collect();
    Ok(Resolved {
        definitions,
        delegatable,
        warnings,
    })
}

/// The definitions that parsed, and every id some file claims, in file
/// order, even if that file has other errors (so a duplicate or a delegate
/// to it is judged correctly). Parse problems go to `diags`.
fn split_parsed(files: Vec<SourceFile>, diags: &mut Vec<Diagnostic>) -> (Vec<Parsed>, Vec<Claim>) {
    let mut parsed = Vec::new();
    let mut claims = Vec::new();
    for sf in files {
        match sf.parsed.outcome {
            Ok(def) => {
                claims.push((def.id.clone(), sf.file, sf.parsed.yaml.clone()));
                parsed.push((def, sf.parsed.yaml));
            }
            Err(mut d) => {
                if let Some(id) = sf.parsed.salvaged_id {
                    claims.push((id, sf.file, sf.parsed.yaml));
                }
                diags.append(&mut d);
            }
        }
    }
    (parsed, claims)
}

/// Whether a definition's frontmatter sets `limits.timeout_secs` (else the
/// configured default deadline applies).
fn sets_timeout(yaml: &str) -> bool {
    serde_yaml::from_str::<serde_yaml::Value>(yaml)
        .ok()
        .and_then(|v| v.get("limits")?.get("timeout_secs").cloned())
        .is_some()
}

/// The id map: a second claim of an id (after folding) is reported on its
/// file, naming the first.
fn check_unique_ids(claims: &[Claim], diags: &mut Vec<Diagnostic>) {
    let mut by_fold: BTreeMap<String, (&AgentId, &PathBuf)> = BTreeMap::new();
    for (id, file, yaml) in claims {
        let folded = fold(id.as_str());
        let Some((first_id, first_file)) = by_fold.get(&folded) else {
            by_fold.insert(folded, (id, file));
            continue;
        };
        let ctx = FileCtx {
            file: file.clone(),
            locator: Locator::new(yaml),
        };
        let same = if *first_id == id {
            String::new()
        } else {
            format!(
                " as {:?} (ids are compared ignoring case and `-`/`_`)",
                first_id.as_str()
            )
        };
        diags.push(ctx.diag(
            K::DuplicateId,
            &[Seg::Key("id")],
            format!(
                "agent id {:?} is already defined by {}{same}; ids must be unique — rename one of the two",
                id.as_str(),
                first_file.display()
            ),
        ));
    }
}

/// Who delegates to each agent: `root_delegates` and every agent listing
/// it. An agent can be delegated to if it has an entry here.
fn delegators<'a>(
    parsed: &'a [Parsed],
    inputs: &'a CatalogInputs,
) -> BTreeMap<&'a AgentId, Vec<String>> {
    let mut delegators: BTreeMap<&AgentId, Vec<String>> = BTreeMap::new();
    for id in &inputs.root_delegates {
        delegators
            .entry(id)
            .or_default()
            .push("root_delegates".to_owned());
    }
    for (def, _) in parsed {
        for target in &def.delegates {
            if target != &def.id {
                delegators
                    .entry(target)
                    .or_default()
                    .push(format!("{:?}", def.id.as_str()));
            }
        }
    }
    delegators
}

/// Every delegate exists and is not the agent itself.
fn check_delegates(
    def: &AgentDefinition,
    ctx: &FileCtx<'_>,
    known: &BTreeSet<AgentId>,
    diags: &mut Vec<Diagnostic>,
) {
    for (i, target) in def.delegates.iter().enumerate() {
        let path = [Seg::Key("delegates"), Seg::Index(i)];
        if target == &def.id {
            diags.push(ctx.diag(
                K::SelfDelegation,
                &path,
                format!(
                    "{:?} lists itself as a delegate; an agent cannot delegate to itself — remove it",
                    target.as_str()
                ),
            ));
        } else if !known.contains(target) {
            diags.push(ctx.diag(
                K::UnknownDelegate,
                &path,
                format!(
                    "no agent has id {:?}{}",
                    target.as_str(),
                    hint(target.as_str(), "agents", known.iter().map(AgentId::as_str))
                ),
            ));
        }
    }
}

/// A cost budget counts what the run and its foreground descendants spend,
/// so every profile they may run on (the agent's, and those of the agents it
/// reaches by delegation) needs prices.
fn check_priced(
    def: &AgentDefinition,
    ctx: &FileCtx<'_>,
    parsed: &[Parsed],
    inputs: &CatalogInputs,
    diags: &mut Vec<Diagnostic>,
) {
    if def.limits.max_cost_usd.is_none() {
        return;
    }
    let by_id: BTreeMap<&AgentId, &AgentDefinition> =
        parsed.iter().map(|(d, _)| (&d.id, d)).collect();
    let mut seen = BTreeSet::from([&def.id]);
    let mut todo = vec![def];
    let mut unpriced: BTreeMap<&str, &AgentId> = BTreeMap::new();
    while let Some(agent) = todo.pop() {
        let profile = agent.llm_profile.as_str();
        if inputs.profiles.contains(profile) && !inputs.priced_profiles.contains(profile) {
            unpriced.entry(profile).or_insert(&agent.id);
        }
        for next in agent.delegates.iter().filter_map(|id| by_id.get(id)) {
            if seen.insert(&next.id) {
                todo.push(next);
            }
        }
    }
    for (profile, agent) in unpriced {
        let whose = if *agent == def.id {
            "its profile".to_owned()
        } else {
            format!("the profile of its delegate {:?}", agent.as_str())
        };
        diags.push(ctx.diag(
            K::UnpricedProfile,
            &[Seg::Key("limits"), Seg::Key("max_cost_usd")],
            format!(
                "a cost budget needs prices, but {whose}, {profile:?}, has none; \
                 set price_input_per_mtok and price_output_per_mtok in [providers.{profile}] \
                 or remove limits.max_cost_usd"
            ),
        ));
    }
}

/// `llm_profile` names a configured profile.
fn check_profile(
    def: &AgentDefinition,
    ctx: &FileCtx<'_>,
    inputs: &CatalogInputs,
    diags: &mut Vec<Diagnostic>,
) {
    if !inputs.profiles.contains(&def.llm_profile) {
        diags.push(ctx.diag(
            K::UnknownProfile,
            &[Seg::Key("llm_profile")],
            format!(
                "no provider profile {:?} is configured{}",
                def.llm_profile,
                hint(
                    &def.llm_profile,
                    "profiles",
                    inputs.profiles.iter().map(String::as_str)
                )
            ),
        ));
    }
}

/// Every tool is registered, listable, and — for an agent someone
/// delegates to (`by`) — allowed in a delegated scope (fail-closed).
fn check_tools(
    def: &AgentDefinition,
    ctx: &FileCtx<'_>,
    inputs: &CatalogInputs,
    by: Option<&Vec<String>>,
    diags: &mut Vec<Diagnostic>,
) {
    let rule = if by.is_some() {
        ScopeRule::Delegated
    } else {
        ScopeRule::Root
    };
    for (i, tool) in def.tools.iter().enumerate() {
        let path = [Seg::Key("tools"), Seg::Index(i)];
        if let Some(reference) = tool.strip_prefix(MCP_PREFIX) {
            let problem = check_mcp(reference, &inputs.mcp, by.is_some());
            if let Some((kind, msg)) = problem {
                let msg = match (kind, by) {
                    (K::ToolNotDelegatable, Some(by)) => format!(
                        "{msg} and cannot be given to an agent that is delegated to (by {}); set `mcp.{}.delegatable = true` in keel.toml or stop delegating to {:?}",
                        by.join(", "),
                        reference.split('/').next().unwrap_or_default(),
                        def.id.as_str()
                    ),
                    _ => msg,
                };
                diags.push(ctx.diag(kind, &path, msg));
            }
            continue;
        }
        let Err(e) = inputs.tools.check(tool, rule) else {
            continue;
        };
        let d = match e {
            ToolRegistryError::Unknown(_) => ctx.diag(
                K::UnknownTool,
                &path,
                format!(
                    "no tool {tool:?} is registered{}",
                    hint(tool, "tools", inputs.tools.names())
                ),
            ),
            ToolRegistryError::RuntimeOnly(_) => ctx.diag(
                K::RuntimeInjectedTool,
                &path,
                format!(
                    "tool {tool:?} is injected by the runtime when allowed and cannot be listed; remove it"
                ),
            ),
            ToolRegistryError::NotDelegatable { policy, .. } => ctx.diag(
                K::ToolNotDelegatable,
                &path,
                format!(
                    "tool {tool:?} has policy {policy:?} and cannot be given to an agent that is delegated to (by {}); remove the tool or stop delegating to {:?}",
                    by.map(|v| v.join(", ")).unwrap_or_default(),
                    def.id.as_str()
                ),
            ),
            ToolRegistryError::Duplicate(_) => ctx.diag(K::UnknownTool, &path, e.to_string()),
        };
        diags.push(d);
    }
}

/// Every tool named in `approval:` is one of the agent's tools.
fn check_approval(def: &AgentDefinition, ctx: &FileCtx<'_>, diags: &mut Vec<Diagnostic>) {
    let Some(crate::definition::Approval::Tools(tools)) = &def.approval else {
        return;
    };
    for (i, tool) in tools.iter().enumerate() {
        if def.tools.iter().any(|t| t == tool) {
            continue;
        }
        diags.push(ctx.diag(
            K::UnknownTool,
            &[Seg::Key("approval"), Seg::Index(i)],
            format!(
                "tool {tool:?} is not one of this agent's tools{}",
                hint(tool, "tools", def.tools.iter().map(String::as_str))
            ),
        ));
    }
}

/// How a `tools:` entry names MCP tools: `mcp:SERVER/TOOL`, `mcp:SERVER/*`.
const MCP_PREFIX: &str = "mcp:";

/// What is wrong with the MCP reference `SERVER/TOOL` (after `mcp:`), if
/// anything.
fn check_mcp(
    reference: &str,
    servers: &BTreeMap<String, McpServerTools>,
    delegated: bool,
) -> Option<(K, String)> {
    let Some((server, tool)) = reference.split_once('/') else {
        return Some((
            K::UnknownTool,
            format!("\"mcp:{reference}\" names no tool; write `mcp:SERVER/TOOL` or `mcp:SERVER/*`"),
        ));
    };
    let Some(known) = servers.get(server) else {
        return Some((
            K::UnknownTool,
            format!(
                "no MCP server {server:?} is configured{}",
                hint(server, "MCP servers", servers.keys().map(String::as_str))
            ),
        ));
    };
    let Some(tools) = &known.tools else {
        return Some((
            K::UnknownTool,
            format!(
                "MCP server {server:?} has never been reached, so its tools are unknown; start keel once with the server available so its manifest is committed"
            ),
        ));
    };
    if tool != "*" && !tools.contains_key(tool) {
        return Some((
            K::UnknownTool,
            format!(
                "MCP server {server:?} has no tool {tool:?} in its last manifest{}",
                hint(tool, "tools", tools.keys().map(String::as_str))
            ),
        ));
    }
    if delegated && !known.delegatable {
        return Some((
            K::ToolNotDelegatable,
            format!("the tools of MCP server {server:?} are root-only"),
        ));
    }
    None
}

/// `tools` with every MCP reference replaced by the registered names of
/// the tools it names (by MCP tool name for `*`), each name once.
fn expand_mcp(tools: &[String], servers: &BTreeMap<String, McpServerTools>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(tools.len());
    let mut push = |name: &str| {
        if !out.iter().any(|t| t == name) {
            out.push(name.to_owned());
        }
    };
    for tool in tools {
        let Some((server, name)) = tool
            .strip_prefix(MCP_PREFIX)
            .and_then(|r| r.split_once('/'))
        else {
            push(tool);
            continue;
        };
        let Some(known) = servers.get(server).and_then(|s| s.tools.as_ref()) else {
            continue;
        };
        if name == "*" {
            known.values().for_each(|n| push(n));
        } else if let Some(registered) = known.get(name) {
            push(registered);
        }
    }
    out
}

/// Every skill exists.
fn check_skills(
    def: &AgentDefinition,
    ctx: &FileCtx<'_>,
    inputs: &CatalogInputs,
    diags: &mut Vec<Diagnostic>,
) {
    for (i, skill) in def.skills.iter().enumerate() {
        if !inputs.skills.contains(skill) {
            diags.push(ctx.diag(
                K::UnknownSkill,
                &[Seg::Key("skills"), Seg::Index(i)],
                format!(
                    "no skill {skill:?} exists{}",
                    hint(skill, "skills", inputs.skills.names())
                ),
            ));
        }
    }
}

/// The caller's inputs: `root_delegates` name defined agents, each once;
/// the depth bound is in range.
fn check_config_inputs(
    inputs: &CatalogInputs,
    known: &BTreeSet<AgentId>,
    diags: &mut Vec<Diagnostic>,
) {
    let mut seen = BTreeSet::new();
    for (i, id) in inputs.root_delegates.iter().enumerate() {
        let key = format!("root_delegates[{i}]");
        if !seen.insert(id) {
            diags.push(
                Diagnostic::new(
                    None,
                    K::DuplicateEntry,
                    format!("{:?} is listed twice; remove one", id.as_str()),
                )
                .with_key(key),
            );
        } else if !known.contains(id) {
            diags.push(
                Diagnostic::new(
                    None,
                    K::UnknownRootDelegate,
                    format!(
                        "no agent definition has id {:?}{}",
                        id.as_str(),
                        hint(id.as_str(), "agents", known.iter().map(AgentId::as_str))
                    ),
                )
                .with_key(key),
            );
        }
    }
    let timeout = inputs.default_timeout_secs;
    let bound = crate::TIMEOUT_SECS_BOUND;
    if !(bound.min..=bound.max).contains(&timeout) {
        diags.push(
            Diagnostic::new(
                None,
                K::InvalidInput,
                format!("{timeout} is outside {}..={}", bound.min, bound.max),
            )
            .with_key("default_run_timeout_secs"),
        );
    }
    let depth = inputs.max_delegation_depth;
    if !(1..=MAX_DELEGATION_DEPTH_CAP).contains(&depth) {
        diags.push(
            Diagnostic::new(
                None,
                K::InvalidInput,
                format!(
                    "{depth} is outside 1..={MAX_DELEGATION_DEPTH_CAP}; the depth bound is what keeps delegation cycles finite"
                ),
            )
            .with_key("max_tree_depth"),
        );
    }
}
