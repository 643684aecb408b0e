//! The agent profiles sessions run, built from one agent catalog: each
//! definition with its provider, tools and skills, and the root agent with
//! the runtime tools that delegate to the catalog's agents. The session
//! manager rebuilds them from every catalog generation a reload brings.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_catalog::{AgentCatalog, SkillSet};
use keel_core::tool::ScopeRule;
use keel_core::{AgentId, Provider, ToolRegistry};
use keel_engine::{
    grant_skills, AgentCoordinator, AgentProfile, AgentSet, ApprovalPolicy, EngineError,
};
use keel_engine::{ProfileProviders, ProviderFactory};

use crate::app::ROOT_PROMPT;

/// What every generation's profiles are built with.
pub(crate) struct ProfileBuilder {
    /// A provider per profile name.
    pub(crate) providers: Arc<ProfileProviders>,
    /// The root agent's provider.
    pub(crate) root_provider: Arc<dyn Provider>,
    /// The built-in tools definitions choose from.
    pub(crate) builtin: Arc<ToolRegistry>,
    /// Every skill; the root agent may load them all.
    pub(crate) skills: SkillSet,
    /// The context window of each profile name.
    pub(crate) context_windows: BTreeMap<String, usize>,
    /// The root agent's output cap per call.
    pub(crate) root_max_output_tokens: u32,
    /// The tools keel.toml gates behind a person's approval.
    pub(crate) approval: ApprovalPolicy,
    /// The root agent's runtime tools come from it; `None` without agent
    /// definitions.
    pub(crate) coordinator: Option<Arc<AgentCoordinator>>,
}

impl ProfileBuilder {
    /// The root agent and every agent of `catalog`.
    pub(crate) fn build(&self, catalog: &AgentCatalog) -> keel_engine::Result<AgentSet> {
        let agents = catalog
            .iter()
            .map(|def| self.agent(def))
            .collect::<keel_engine::Result<_>>()?;
        Ok(AgentSet {
            root: self.root(catalog)?,
            agents,
        })
    }

    fn context_window(&self, profile: &str) -> usize {
        self.context_windows
            .get(profile)
            .copied()
            .unwrap_or(keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS)
    }

    /// A defined agent talked to directly (`chat --agent`, a dialog's agent).
    fn agent(&self, def: &keel_catalog::AgentDefinition) -> keel_engine::Result<AgentProfile> {
        let provider = self.providers.provider(&def.llm_profile).ok_or_else(|| {
            EngineError::UnknownProfile {
                agent: def.id.to_string(),
                profile: def.llm_profile.clone(),
            }
        })?;
        let mut tools = self
            .builtin
            .scoped(def.tools.iter().map(String::as_str), ScopeRule::Root)?;
        let mut prompt = def.body.clone();
        grant_skills(&self.skills, &def.skills, &mut tools, &mut prompt)?;
        Ok(AgentProfile {
            name: def.id.clone(),
            system_prompt: prompt,
            provider,
            tools: Arc::new(tools),
            max_iterations: def.limits.max_iterations,
            max_output_tokens: Some(def.limits.max_output_tokens),
            context_window_tokens: self.context_window(&def.llm_profile),
            approval: match &def.approval {
                Some(keel_catalog::Approval::All(_)) => ApprovalPolicy::all(),
                Some(keel_catalog::Approval::Tools(tools)) => {
                    ApprovalPolicy::tools(tools.iter().cloned())
                }
                None => ApprovalPolicy::none(),
            }
            .union(&self.approval),
            prices: self.providers.prices(&def.llm_profile),
        })
    }

    /// The root agent: the built-in tools, delegation to `catalog`'s root
    /// delegates, the memory tools and every skill.
    fn root(&self, catalog: &AgentCatalog) -> keel_engine::Result<AgentProfile> {
        let mut tools = (*self.builtin).clone();
        let mut system_prompt = ROOT_PROMPT.to_owned();
        if let Some(coordinator) = &self.coordinator {
            for tool in coordinator.root_tools_for(catalog) {
                tools.register(tool)?;
            }
            if !catalog.root_delegates().is_empty() {
                system_prompt.push_str(
                    " You can hand work to sub-agents with the delegate tool; its description lists them.",
                );
            }
        }
        // The root agent is the user's own: it may load every skill.
        keel_engine::register_memory_tools(&mut tools)?;
        let all_skills: Vec<String> = self.skills.names().map(str::to_owned).collect();
        grant_skills(&self.skills, &all_skills, &mut tools, &mut system_prompt)?;
        Ok(AgentProfile {
            name: AgentId::root(),
            system_prompt,
            provider: self.root_provider.clone(),
            tools: Arc::new(tools),
            max_iterations: 16,
            max_output_tokens: Some(self.root_max_output_tokens),
            context_window_tokens: self.context_window(crate::app::DEFAULT_PROFILE),
            approval: self.approval.clone(),
            prices: self.providers.prices(crate::app::DEFAULT_PROFILE),
        })
    }
}
