//! [`RuntimeBundle`]: the agents sessions can run and the loop that runs
//! them. The agents are either fixed when the bundle is built or derived
//! from the agent catalog in force, rebuilt when its generation changes, so
//! a catalog reload is seen by the next lookup.

use std::collections::HashMap;
use std::sync::Arc;

use keel_catalog::AgentCatalog;
use keel_core::{AgentId, ToolRegistry};
use parking_lot::Mutex;

use crate::agent_loop::AgentLoop;
use crate::coordinator::{AgentCoordinator, CatalogSource};
use crate::error::{EngineError, Result};
use crate::session::AgentProfile;

/// The agents of one catalog: what a bundle's builder makes of it.
pub struct AgentSet {
    /// The default (root) agent.
    pub root: AgentProfile,
    /// The other agents sessions may run.
    pub agents: Vec<AgentProfile>,
}

/// Builds the [`AgentSet`] of one catalog (providers, tools, prompts).
pub type AgentSetBuilder = dyn Fn(&AgentCatalog) -> Result<AgentSet> + Send + Sync;

/// The agents of one generation, by name.
#[derive(Clone)]
struct Agents {
    /// The catalog generation they were built from (`None`: fixed).
    generation: Option<u64>,
    root: AgentId,
    by_name: HashMap<AgentId, Arc<AgentProfile>>,
}

impl Agents {
    fn new(set: AgentSet, generation: Option<u64>) -> Self {
        let root = set.root.name.clone();
        let by_name = std::iter::once(set.root)
            .chain(set.agents)
            .map(|p| (p.name.clone(), Arc::new(p)))
            .collect();
        Self {
            generation,
            root,
            by_name,
        }
    }
}

/// Where the agents come from.
enum AgentSource {
    /// Fixed when the bundle was built.
    Fixed,
    /// Derived from the catalog `catalog` has in force.
    Catalog {
        catalog: Arc<dyn CatalogSource>,
        build: Arc<AgentSetBuilder>,
    },
}

/// The agents sessions can run, and the loop that runs them. Child sessions
/// share their parent's bundle.
pub struct RuntimeBundle {
    source: AgentSource,
    /// The agents of the latest generation looked up.
    built: Mutex<Arc<Agents>>,
    pub(super) agent_loop: Arc<AgentLoop>,
    pub(super) coordinator: Option<Arc<AgentCoordinator>>,
}

impl RuntimeBundle {
    /// A bundle whose default (root) agent is `root`.
    pub fn new(root: AgentProfile) -> Self {
        Self::with_source(
            AgentSource::Fixed,
            Agents::new(
                AgentSet {
                    root,
                    agents: Vec::new(),
                },
                None,
            ),
        )
    }

    /// A bundle whose agents are `build` of the catalog `catalog` has in
    /// force, rebuilt whenever its generation changes. Fails if the current
    /// catalog cannot be built.
    pub fn from_catalog(
        catalog: Arc<dyn CatalogSource>,
        build: Arc<AgentSetBuilder>,
    ) -> Result<Self> {
        let current = catalog.current();
        let agents = Agents::new(build(&current)?, Some(current.generation()));
        Ok(Self::with_source(
            AgentSource::Catalog { catalog, build },
            agents,
        ))
    }

    fn with_source(source: AgentSource, agents: Agents) -> Self {
        Self {
            source,
            built: Mutex::new(Arc::new(agents)),
            agent_loop: Arc::new(AgentLoop::default()),
            coordinator: None,
        }
    }

    /// Sub-agent runs of deleted sessions are cancelled through `coordinator`.
    pub fn with_coordinator(mut self, coordinator: Arc<AgentCoordinator>) -> Self {
        self.coordinator = Some(coordinator);
        self
    }

    /// Adds another agent sessions may switch to (to a fixed bundle; a
    /// catalog's bundle takes its agents from the catalog only).
    pub fn with_agent(self, profile: AgentProfile) -> Self {
        if let AgentSource::Fixed = self.source {
            Arc::make_mut(&mut self.built.lock())
                .by_name
                .insert(profile.name.clone(), Arc::new(profile));
        }
        self
    }

    /// Runs turns with `agent_loop` (its step gate).
    pub fn with_loop(mut self, agent_loop: AgentLoop) -> Self {
        self.agent_loop = Arc::new(agent_loop);
        self
    }

    /// The agents in force: for a catalog's bundle, those of its current
    /// generation (built on the first lookup after a reload).
    fn agents(&self) -> Result<Arc<Agents>> {
        let AgentSource::Catalog { catalog, build } = &self.source else {
            return Ok(self.built.lock().clone());
        };
        let current = catalog.current();
        // Held while building so one generation is built once.
        let mut built = self.built.lock();
        if built.generation != Some(current.generation()) {
            *built = Arc::new(Agents::new(build(&current)?, Some(current.generation())));
        }
        Ok(built.clone())
    }

    /// The profile of `name`, or of the root agent when `None`.
    pub fn agent(&self, name: Option<&AgentId>) -> Result<Arc<AgentProfile>> {
        let agents = self.agents()?;
        let name = name.unwrap_or(&agents.root);
        agents
            .by_name
            .get(name)
            .cloned()
            .ok_or_else(|| EngineError::UnknownAgent(name.to_string()))
    }

    /// The profile an existing session of `name` runs its next turn with: a
    /// name the catalog no longer defines is [`EngineError::AgentRemoved`].
    pub(super) fn session_agent(&self, name: Option<&AgentId>) -> Result<Arc<AgentProfile>> {
        self.agent(name).map_err(|e| match (e, name) {
            (EngineError::UnknownAgent(_), Some(name)) => {
                EngineError::AgentRemoved(name.to_string())
            }
            (e, _) => e,
        })
    }

    /// The profile a stored session of `name` is loaded with. A session
    /// whose agent a reload removed still loads (to be read, renamed or
    /// switched to another agent) with a stand-in that has no tools; its
    /// turns are refused by [`Self::session_agent`].
    pub(super) fn loaded_agent(&self, name: Option<&AgentId>) -> Result<Arc<AgentProfile>> {
        match self.session_agent(name) {
            Err(EngineError::AgentRemoved(_)) => {
                let root = self.agent(None)?;
                Ok(Arc::new(AgentProfile {
                    name: name.cloned().unwrap_or_else(AgentId::root),
                    system_prompt: String::new(),
                    provider: root.provider.clone(),
                    tools: Arc::new(ToolRegistry::new()),
                    max_iterations: root.max_iterations,
                    max_output_tokens: root.max_output_tokens,
                    context_window_tokens: root.context_window_tokens,
                    approval: crate::ApprovalPolicy::none(),
                    prices: root.prices,
                }))
            }
            other => other,
        }
    }

    /// Every agent sessions can run now, the root agent first, then by name.
    pub fn agent_ids(&self) -> Result<Vec<AgentId>> {
        let agents = self.agents()?;
        let mut others: Vec<AgentId> = agents
            .by_name
            .keys()
            .filter(|id| **id != agents.root)
            .cloned()
            .collect();
        others.sort();
        Ok(std::iter::once(agents.root.clone()).chain(others).collect())
    }
}
