//! [`ProviderFactory`]: maps an agent definition's `llm_profile` to the
//! provider its runs use.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_core::Provider;

/// Resolves provider profiles (config `[providers.NAME]`) to providers.
pub trait ProviderFactory: Send + Sync {
    /// The provider of profile `profile`, or `None` if it is not configured.
    fn provider(&self, profile: &str) -> Option<Arc<dyn Provider>>;
}

/// A fixed map of profile name → provider (tests, the offline demo).
#[derive(Clone, Default)]
pub struct ProfileProviders {
    profiles: BTreeMap<String, Arc<dyn Provider>>,
}

impl ProfileProviders {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same map with `profile` served by `provider`.
    pub fn with(mut self, profile: impl Into<String>, provider: Arc<dyn Provider>) -> Self {
        self.profiles.insert(profile.into(), provider);
        self
    }
}

impl ProviderFactory for ProfileProviders {
    fn provider(&self, profile: &str) -> Option<Arc<dyn Provider>> {
        self.profiles.get(profile).cloned()
    }
}

impl std::fmt::Debug for ProfileProviders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.profiles.keys()).finish()
    }
}
