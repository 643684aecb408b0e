//! [`ProviderFactory`]: maps an agent definition's `llm_profile` to the
//! provider its runs use.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_core::{Prices, Provider};

/// Resolves provider profiles (config `[providers.NAME]`) to providers.
pub trait ProviderFactory: Send + Sync {
    /// The provider of profile `profile`, or `None` if it is not configured.
    fn provider(&self, profile: &str) -> Option<Arc<dyn Provider>>;

    /// What profile `profile`'s tokens cost, if it has prices.
    fn prices(&self, _profile: &str) -> Option<Prices> {
        None
    }
}

/// A fixed map of profile name → provider (tests, the offline demo).
#[derive(Clone, Default)]
pub struct ProfileProviders {
    profiles: BTreeMap<String, Arc<dyn Provider>>,
    prices: BTreeMap<String, Prices>,
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

    /// The same map with `profile`'s tokens priced at `prices`.
    pub fn with_prices(mut self, profile: impl Into<String>, prices: Prices) -> Self {
        self.prices.insert(profile.into(), prices);
        self
    }
}

impl ProviderFactory for ProfileProviders {
    fn provider(&self, profile: &str) -> Option<Arc<dyn Provider>> {
        self.profiles.get(profile).cloned()
    }

    fn prices(&self, profile: &str) -> Option<Prices> {
        self.prices.get(profile).copied()
    }
}

impl std::fmt::Debug for ProfileProviders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.profiles.keys()).finish()
    }
}
