//! Assembles a running keel from configuration: the store, the providers,
//! the built-in tools and the session manager.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_core::{AgentId, Provider, ScriptedProvider, ToolRegistry};
use keel_engine::manager::{RuntimeBundle, SessionManager};
use keel_engine::session::AgentProfile;
use keel_engine::tools::builtin_registry;
use keel_store::Store;

use crate::config::{Config, LoadedConfig};

/// Why the binary could not do its job.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The configuration is invalid.
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    /// A provider profile could not be built.
    #[error("{0}")]
    Provider(#[from] keel_providers::ProviderConfigError),
    /// The script given with --script is invalid.
    #[error("{0}")]
    Script(#[from] keel_core::ScriptError),
    /// The database could not be opened or written.
    #[error("storage: {0}")]
    Store(#[from] keel_store::StoreError),
    /// An engine operation failed.
    #[error("{0}")]
    Engine(#[from] keel_engine::EngineError),
    /// The built-in tools could not be set up.
    #[error("{0}")]
    Tools(#[from] keel_engine::tools::BuiltinToolsError),
    /// A file or terminal operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

/// Maps an I/O error with what was being done.
pub fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> AppError {
    let context = context.into();
    move |source| AppError::Io { context, source }
}

/// The root agent's role prompt when none is configured.
pub const ROOT_PROMPT: &str = "You are keel's root agent, a careful and concise assistant. \
Use the tools you are given when they help, and say plainly when you cannot do something.";

/// A running keel: configuration, store and session manager.
pub struct App {
    /// The loaded configuration.
    pub config: LoadedConfig,
    /// The database.
    pub store: Store,
    /// Sessions and turns.
    pub manager: Arc<SessionManager>,
    /// The one-line notice printed at start-up when no provider is configured.
    pub offline_notice: Option<&'static str>,
}

/// The database file inside a data directory.
pub fn database_path(data_dir: &Path) -> PathBuf {
    data_dir.join("keel.db")
}

impl App {
    /// Loads configuration, opens the data directory and builds the runtime.
    /// `script` replaces every provider with a ScriptedProvider.
    pub fn open(
        config_file: Option<&Path>,
        data_dir: Option<&Path>,
        script: Option<&Path>,
    ) -> Result<Self, AppError> {
        let loaded = Config::load(config_file, data_dir)?;
        let config = &loaded.config;
        let data_dir = config.data_dir();
        std::fs::create_dir_all(&data_dir).map_err(io_err(format!(
            "cannot create data directory {}",
            data_dir.display()
        )))?;
        let store = Store::open(database_path(&data_dir), config.store_options())?;
        let (provider, offline_notice): (Arc<dyn Provider>, _) = match script {
            Some(path) => (Arc::new(ScriptedProvider::from_file(path)?), None),
            None => {
                let (name, profile) = config.resolve_profile("default").ok_or_else(|| {
                    crate::config::ConfigError::single(
                        loaded.source_label(),
                        "default_profile",
                        "no provider profile named default",
                    )
                })?;
                (
                    keel_providers::build_provider(name, profile)?,
                    config.offline_notice(),
                )
            }
        };
        let tools = builtin_registry(&config.builtin_tools())?;
        let root = AgentProfile {
            name: root_agent_id(),
            system_prompt: ROOT_PROMPT.to_owned(),
            provider,
            tools: Arc::new(tools),
            max_iterations: 16,
            max_output_tokens: None,
        };
        let manager = SessionManager::new(
            store.clone(),
            RuntimeBundle::new(root),
            config.session_manager_config(),
        );
        Ok(Self {
            config: loaded,
            store,
            manager,
            offline_notice,
        })
    }
}

/// The root agent's id.
pub fn root_agent_id() -> AgentId {
    AgentId::parse("root").expect("\"root\" matches the agent id rule")
}

/// The built-in tools a default configuration registers (for `agents check`).
pub fn default_tool_registry() -> Result<ToolRegistry, AppError> {
    let dir = std::env::current_dir().map_err(io_err("cannot read the current directory"))?;
    let mut cfg = keel_engine::tools::BuiltinToolsConfig::new(dir);
    cfg.enable_write = true;
    cfg.enable_shell = true;
    Ok(builtin_registry(&cfg)?)
}
