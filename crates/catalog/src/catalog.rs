//! The immutable [`AgentCatalog`], the [`CatalogHandle`] that reloads it
//! all-or-nothing, and the [`CatalogSummary`] printed by `keel agents check`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use keel_core::AgentId;

use crate::definition::AgentDefinition;
use crate::diagnostic::{Diagnostic, Diagnostics};
use crate::loader::{read_root, SourceFile};
use crate::parse::parse_full;
use crate::resolve::{resolve, CatalogInputs};
use crate::skills::SkillSet;

/// A validated, immutable set of agent definitions. Cloning is cheap (one
/// `Arc`); a reload builds a new catalog and never changes this one.
///
/// **Delegation cycles are allowed** (`a → b → a`, even `a → b → c → a`):
/// a catalog only says who *may* delegate to whom. Every chain is finite
/// because the engine refuses a delegation deeper than
/// [`AgentCatalog::max_delegation_depth`], which the catalog requires to be
/// in `1..=MAX_DELEGATION_DEPTH_CAP`. Use [`AgentCatalog::delegates_of`] to
/// walk the graph. Self-delegation is still rejected: it is always a typo.
#[derive(Clone)]
pub struct AgentCatalog {
    inner: Arc<CatalogInner>,
}

struct CatalogInner {
    definitions: BTreeMap<AgentId, Arc<AgentDefinition>>,
    skills: SkillSet,
    root_delegates: Vec<AgentId>,
    delegatable: BTreeSet<AgentId>,
    max_delegation_depth: u32,
    generation: u64,
    root: Option<PathBuf>,
    /// What the load found that does not fail it.
    warnings: Vec<Diagnostic>,
}

impl AgentCatalog {
    /// Loads and validates every definition under `root`. Any problem fails
    /// the whole load and every problem is returned.
    pub fn load(root: &Path, inputs: &CatalogInputs, generation: u64) -> Result<Self, Diagnostics> {
        let (canonical, files) = read_root(root)?;
        Self::build(files, inputs, generation, Some(canonical))
    }

    /// Builds a catalog from `(file name, text)` pairs without touching the
    /// filesystem (tests, embedded definitions).
    pub fn from_texts<'a>(
        texts: impl IntoIterator<Item = (&'a str, &'a str)>,
        inputs: &CatalogInputs,
        generation: u64,
    ) -> Result<Self, Diagnostics> {
        let mut files: Vec<SourceFile> = texts
            .into_iter()
            .map(|(name, text)| SourceFile {
                file: PathBuf::from(name),
                parsed: parse_full(Path::new(name), text),
            })
            .collect();
        files.sort_by(|a, b| a.file.cmp(&b.file));
        Self::build(files, inputs, generation, None)
    }

    /// A catalog with no agents (orchestration not configured).
    pub fn empty(generation: u64) -> Self {
        Self {
            inner: Arc::new(CatalogInner {
                definitions: BTreeMap::new(),
                skills: SkillSet::empty(),
                root_delegates: Vec::new(),
                delegatable: BTreeSet::new(),
                max_delegation_depth: crate::resolve::DEFAULT_MAX_DELEGATION_DEPTH,
                generation,
                root: None,
                warnings: Vec::new(),
            }),
        }
    }

    fn build(
        files: Vec<SourceFile>,
        inputs: &CatalogInputs,
        generation: u64,
        root: Option<PathBuf>,
    ) -> Result<Self, Diagnostics> {
        let resolved = resolve(files, inputs)?;
        Ok(Self {
            inner: Arc::new(CatalogInner {
                definitions: resolved.definitions,
                skills: inputs.skills.clone(),
                root_delegates: inputs.root_delegates.clone(),
                delegatable: resolved.delegatable,
                max_delegation_depth: inputs.max_delegation_depth,
                generation,
                root,
                warnings: resolved.warnings,
            }),
        })
    }

    /// Problems the load found that did not fail it (warnings), by file.
    pub fn warnings(&self) -> &[Diagnostic] {
        &self.inner.warnings
    }

    /// The definition of `id`.
    pub fn get(&self, id: &AgentId) -> Option<&Arc<AgentDefinition>> {
        self.inner.definitions.get(id)
    }

    /// The definition whose id is `id` (text form).
    pub fn get_str(&self, id: &str) -> Option<&Arc<AgentDefinition>> {
        AgentId::parse(id)
            .ok()
            .and_then(|id| self.inner.definitions.get(&id))
    }

    /// Every definition, sorted by id.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<AgentDefinition>> {
        self.inner.definitions.values()
    }

    /// Every id, sorted.
    pub fn ids(&self) -> impl Iterator<Item = &AgentId> {
        self.inner.definitions.keys()
    }

    /// Number of agents.
    pub fn len(&self) -> usize {
        self.inner.definitions.len()
    }

    /// Whether there are no agents.
    pub fn is_empty(&self) -> bool {
        self.inner.definitions.is_empty()
    }

    /// The skills the definitions were checked against (what `get_skill`
    /// serves).
    pub fn skills(&self) -> &SkillSet {
        &self.inner.skills
    }

    /// Agents the root agent may delegate to, in config order.
    pub fn root_delegates(&self) -> &[AgentId] {
        &self.inner.root_delegates
    }

    /// Agents `id` may delegate to (empty for an unknown id): the edges of
    /// the delegation graph, which may contain cycles.
    pub fn delegates_of(&self, id: &AgentId) -> &[AgentId] {
        self.get(id).map_or(&[], |d| d.delegates.as_slice())
    }

    /// Whether `caller` (`None` = the root agent) may delegate to `target`.
    pub fn may_delegate(&self, caller: Option<&AgentId>, target: &AgentId) -> bool {
        match caller {
            None => self.inner.root_delegates.contains(target),
            Some(c) => self.delegates_of(c).contains(target),
        }
    }

    /// Whether some agent or the root may delegate to `id` — such an agent's
    /// tools were checked with `ScopeRule::Delegated`.
    pub fn is_delegatable(&self, id: &AgentId) -> bool {
        self.inner.delegatable.contains(id)
    }

    /// Longest delegation chain the engine must allow (the bound that keeps
    /// cycles finite).
    pub fn max_delegation_depth(&self) -> u32 {
        self.inner.max_delegation_depth
    }

    /// Whether the delegation graph has a cycle (allowed; see the type docs).
    pub fn has_cycle(&self) -> bool {
        // Iterative three-colour DFS; the graph is small and bounded.
        let mut state: BTreeMap<&AgentId, u8> = BTreeMap::new();
        for start in self.inner.definitions.keys() {
            if state.contains_key(start) {
                continue;
            }
            let mut stack: Vec<(&AgentId, usize)> = vec![(start, 0)];
            state.insert(start, 1);
            while let Some((node, next)) = stack.pop() {
                let edges = self.delegates_of(node);
                if let Some(t) = edges.get(next) {
                    stack.push((node, next + 1));
                    match state.get(t) {
                        Some(1) => return true,
                        Some(_) => {}
                        None => {
                            state.insert(t, 1);
                            stack.push((t, 0));
                        }
                    }
                } else {
                    state.insert(node, 2);
                }
            }
        }
        false
    }

    /// The generation this catalog was built as.
    pub fn generation(&self) -> u64 {
        self.inner.generation
    }

    /// The canonical definitions root it was loaded from, if any.
    pub fn root(&self) -> Option<&Path> {
        self.inner.root.as_deref()
    }

    /// A printable summary of every agent.
    pub fn summary(&self) -> CatalogSummary {
        CatalogSummary {
            generation: self.inner.generation,
            root_delegates: self.inner.root_delegates.clone(),
            agents: self
                .iter()
                .map(|d| AgentSummary {
                    id: d.id.clone(),
                    file: d.source_file.clone(),
                    llm_profile: d.llm_profile.clone(),
                    tools: d.tools.clone(),
                    delegates: d.delegates.clone(),
                    skills: d.skills.clone(),
                    signal: d.signal.is_some(),
                    hash_prefix: d.hash_prefix().to_owned(),
                })
                .collect(),
            skills: self
                .inner
                .skills
                .iter()
                .map(|s| SkillSummary {
                    name: s.name.clone(),
                    description: s.description.clone(),
                    file: s.source_file.clone(),
                })
                .collect(),
        }
    }
}

impl fmt::Debug for AgentCatalog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentCatalog")
            .field("generation", &self.inner.generation)
            .field("agents", &self.inner.definitions.keys().collect::<Vec<_>>())
            .field("root_delegates", &self.inner.root_delegates)
            .finish()
    }
}

/// One line of a [`CatalogSummary`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentSummary {
    /// The agent's id.
    pub id: AgentId,
    /// Its file, relative to the root.
    pub file: PathBuf,
    /// Its provider profile.
    pub llm_profile: String,
    /// Its tools.
    pub tools: Vec<String>,
    /// Agents it may delegate to.
    pub delegates: Vec<AgentId>,
    /// Skills it may read.
    pub skills: Vec<String>,
    /// Whether it has a signal contract.
    pub signal: bool,
    /// First 12 hex digits of its `definition_hash`.
    pub hash_prefix: String,
}

/// What `keel agents check` prints for a valid catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogSummary {
    /// The catalog's generation.
    pub generation: u64,
    /// The config's root delegates.
    pub root_delegates: Vec<AgentId>,
    /// One entry per agent, sorted by id.
    pub agents: Vec<AgentSummary>,
    /// One entry per skill, sorted by name.
    pub skills: Vec<SkillSummary>,
}

/// One skill line of a [`CatalogSummary`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkillSummary {
    /// The skill's name.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// Its file.
    pub file: PathBuf,
}

fn join<T: AsRef<str>>(items: &[T]) -> String {
    if items.is_empty() {
        "-".to_owned()
    } else {
        items
            .iter()
            .map(AsRef::as_ref)
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl fmt::Display for CatalogSummary {
    /// A header line, then one aligned line per agent.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.agents.len();
        write!(
            f,
            "{n} agent{} OK (generation {}); root delegates: {}",
            if n == 1 { "" } else { "s" },
            self.generation,
            join(&self.root_delegates)
        )?;
        let w_id = self
            .agents
            .iter()
            .map(|a| a.id.as_str().len())
            .max()
            .unwrap_or(0);
        let w_prof = self
            .agents
            .iter()
            .map(|a| a.llm_profile.len())
            .max()
            .unwrap_or(0);
        for a in &self.agents {
            let skills = if a.skills.is_empty() {
                String::new()
            } else {
                format!("  skills={}", join(&a.skills))
            };
            write!(
                f,
                "\n  {:<w_id$}  {}  profile={:<w_prof$}  tools={}  delegates={}{skills}{}  ({})",
                a.id.as_str(),
                a.hash_prefix,
                a.llm_profile,
                join(&a.tools),
                join(&a.delegates),
                if a.signal { "  signal" } else { "" },
                a.file.display()
            )?;
        }
        let n = self.skills.len();
        write!(f, "\n{n} skill{}", if n == 1 { "" } else { "s" })?;
        let w_name = self.skills.iter().map(|s| s.name.len()).max().unwrap_or(0);
        for s in &self.skills {
            write!(
                f,
                "\n  {:<w_name$}  {}  ({})",
                s.name,
                s.description,
                s.file.display()
            )?;
        }
        Ok(())
    }
}

/// The current catalog of a running gateway plus where it is loaded from.
/// Readers take a cheap clone; [`CatalogHandle::reload`] swaps in a new
/// catalog only if the whole directory is valid.
pub struct CatalogHandle {
    root: PathBuf,
    current: RwLock<AgentCatalog>,
    reloading: Mutex<()>,
}

impl CatalogHandle {
    /// Loads generation 1 from `root`.
    pub fn load(root: &Path, inputs: &CatalogInputs) -> Result<Self, Diagnostics> {
        let catalog = AgentCatalog::load(root, inputs, 1)?;
        log_warnings(&catalog);
        Ok(Self::new(root, catalog))
    }

    /// Wraps an already built catalog; reloads read from `root`.
    pub fn new(root: &Path, catalog: AgentCatalog) -> Self {
        Self {
            root: root.to_path_buf(),
            current: RwLock::new(catalog),
            reloading: Mutex::new(()),
        }
    }

    /// The current catalog (a cheap clone; unaffected by later reloads).
    pub fn current(&self) -> AgentCatalog {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The definitions root reloads read from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Rebuilds the catalog from disk with `inputs`. On success the new
    /// catalog (generation + 1) replaces the old one and its generation is
    /// returned; on any problem the old catalog stays and the diagnostics are
    /// returned. Concurrent reloads are serialized.
    pub fn reload(&self, inputs: &CatalogInputs) -> Result<u64, Diagnostics> {
        let _one_at_a_time = self
            .reloading
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let next = self.current().generation() + 1;
        let catalog = AgentCatalog::load(&self.root, inputs, next)?;
        log_warnings(&catalog);
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = catalog;
        tracing::info!(generation = next, "agent catalog reloaded");
        Ok(next)
    }
}

/// Logs each warning of a catalog about to be put in force.
fn log_warnings(catalog: &AgentCatalog) {
    for w in catalog.warnings() {
        tracing::warn!(generation = catalog.generation(), "agent definitions: {w}");
    }
}

impl fmt::Debug for CatalogHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CatalogHandle")
            .field("root", &self.root)
            .field("current", &self.current())
            .finish()
    }
}
