//! Assembles a running keel from configuration: the store, the providers,
//! the built-in tools and the session manager.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_catalog::{AgentCatalog, CatalogHandle, CatalogInputs};
use keel_core::{Provider, ScriptedProvider, SessionId, ToolRegistry, TurnId};
use keel_engine::builtin_registry;
use keel_engine::AgentLoop;
use keel_engine::ExecutionGate;
use keel_engine::{AgentCoordinator, CoordinatorConfig, ProfileProviders, ProviderFactory};
use keel_engine::{RuntimeBundle, SessionManager};
use keel_store::{describe_process, Activation, Store};

use crate::storage::{Location, RuntimeHold};

use crate::config::{Config, ConfigError, LoadedConfig};
use crate::error::{io_err, AppError, Result};
use crate::profiles::ProfileBuilder;

/// The profile the root agent runs on.
pub(crate) const DEFAULT_PROFILE: &str = "default";

/// The root agent's role prompt when none is configured.
pub const ROOT_PROMPT: &str = "You are keel's root agent, a careful and concise assistant. \
Use the tools you are given when they help, and say plainly when you cannot do something.";

/// A running keel: configuration, store, session manager and (when agent
/// definitions exist) the sub-agent coordinator.
pub struct App {
    /// The loaded configuration.
    pub config: LoadedConfig,
    /// The database.
    pub store: Store,
    /// Sessions and turns.
    pub manager: Arc<SessionManager>,
    /// Sub-agent runs; `None` without agent definitions.
    pub coordinator: Option<Arc<AgentCoordinator>>,
    /// The agent catalog and what a reload validates it against; `None`
    /// without agent definitions.
    pub catalog: Option<(Arc<CatalogHandle>, CatalogInputs)>,
    /// One-line notices to print once at start-up: no provider configured,
    /// shell commands not confined.
    pub notices: Vec<String>,
    /// The runtime generation this process activated on the database.
    pub generation: u64,
    /// This process's hold on the database (see [`RuntimeHold`]); released on drop.
    pub lock: RuntimeHold,
    /// Sessions whose inbox had work when this process started; see
    /// [`App::deliver_recovered`].
    pub recovered: Vec<SessionId>,
    /// The `[mcp.NAME]` servers, by name: their connections and tools.
    pub mcp: std::collections::BTreeMap<String, crate::mcp::McpServer>,
    /// The execution gate every run and step is admitted through.
    pub gate: Arc<ExecutionGate>,
}

/// Creates the data directory (and missing parents) readable by its owner
/// only (0700): it holds the database, with every transcript. An existing
/// directory is left as it is.
pub fn create_data_dir(path: &Path) -> Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(path).map_err(io_err(format!(
        "cannot create data directory {}",
        path.display()
    )))
}

/// The database file inside a data directory.
pub fn database_path(data_dir: &Path) -> PathBuf {
    data_dir.join("keel.db")
}

impl App {
    /// Loads configuration, opens the data directory and builds the runtime:
    /// providers for every profile, the built-in tools and the tools of the
    /// `[mcp.NAME]` servers (connected now, their manifests committed), the execution gate,
    /// the agent catalog and coordinator when `agents_dir` has definitions
    /// (recovering runs of earlier processes), and the session manager.
    /// `command` names this process in the data directory's lock (`keel chat`),
    /// so a second process is refused with its name.
    /// `script` replaces every provider with one ScriptedProvider.
    pub async fn open(
        command: &str,
        config_file: Option<&Path>,
        data_dir: Option<&Path>,
        script: Option<&Path>,
    ) -> Result<Self> {
        let scripted: Option<Arc<dyn Provider>> = match script {
            Some(path) => Some(Arc::new(ScriptedProvider::from_script(
                keel_providers::load_script(path)?,
            ))),
            None => None,
        };
        Self::open_with_provider(command, config_file, data_dir, scripted).await
    }

    /// [`App::open`] with `provider`, when given, in place of every configured one.
    pub async fn open_with_provider(
        command: &str,
        config_file: Option<&Path>,
        data_dir: Option<&Path>,
        scripted: Option<Arc<dyn Provider>>,
    ) -> Result<Self> {
        let loaded = Config::load(config_file, data_dir)?;
        let config = &loaded.config;
        let data_dir = config.data_dir();
        create_data_dir(&data_dir)?;
        let (lock, store, activation) = activate(command, config).await?;
        let mut providers = ProfileProviders::new();
        for name in config.profile_names() {
            let provider = match &scripted {
                Some(p) => p.clone(),
                None => config.build_provider(&name)?,
            };
            // Metered under the profile the name resolves to (`default` may name another).
            let label = config
                .resolve_profile(&name)
                .map_or(name.as_str(), |(r, _)| r);
            let provider = crate::metrics::MeteredProvider::wrap(label, provider);
            if let Some(prices) = config.profile_prices(&name) {
                providers = providers.with_prices(name.clone(), prices);
            }
            providers = providers.with(name, provider);
        }
        let root_provider = match &scripted {
            Some(p) => p.clone(),
            None => config.build_provider(DEFAULT_PROFILE)?,
        };
        let root_label = config
            .resolve_profile(DEFAULT_PROFILE)
            .map_or(DEFAULT_PROFILE, |(r, _)| r);
        let root_provider = crate::metrics::MeteredProvider::wrap(root_label, root_provider);
        let mut notices = Vec::new();
        if scripted.is_none() {
            notices.extend(config.offline_notice().map(str::to_owned));
        }
        let gate = Arc::new(ExecutionGate::new(config.gate_limits()));
        let (tools, shell_notice) = config.builtin_tools(loaded.protected_paths());
        if let Some(notice) = shell_notice {
            tracing::warn!("{notice}");
            notices.push(notice);
        }
        let mut registry = builtin_registry(&tools)?;
        let mcp = crate::mcp::connect_all(config, &store, None).await?;
        let mcp_servers = mcp.servers;
        for tool in mcp.tools {
            registry.register(tool).map_err(|e| {
                ConfigError::single(
                    loaded.source_label(),
                    "mcp",
                    format!("{e}; rename one of the MCP servers"),
                )
            })?;
        }
        notices.extend(mcp.notices);
        // keel.toml's gates, and the MCP tools whose server asks for approval.
        let approval = config
            .approval_policy()
            .union(&keel_engine::ApprovalPolicy::tools(mcp.gated));
        let builtin = Arc::new(registry);
        let skills = config.load_skills().map_err(AppError::Catalog)?;
        let mut inputs = config.catalog_inputs(builtin.clone(), skills.clone());
        inputs.mcp = mcp.catalog;
        let catalog = match config.agents_dir() {
            Some(dir) if dir.is_dir() => Some(Arc::new(
                CatalogHandle::load(&dir, &inputs).map_err(AppError::Catalog)?,
            )),
            _ => None,
        };
        let providers = Arc::new(providers);
        if let Some(catalog) = &catalog {
            check_profiles(&loaded, &catalog.current(), &providers)?;
        }
        let coordinator = catalog.as_ref().map(|catalog| {
            let coordinator = AgentCoordinator::new(
                store.clone(),
                catalog.clone(),
                providers.clone(),
                builtin.clone(),
                gate.clone(),
                CoordinatorConfig {
                    runtime_generation: activation.generation,
                    approval: approval.clone(),
                    ..config.coordinator_config()
                },
            );
            coordinator.spawn_reaper(coordinator.config().reaper_interval);
            coordinator
        });
        let profiles = ProfileBuilder {
            approval,
            providers,
            root_provider,
            builtin,
            skills,
            context_windows: config
                .profile_names()
                .into_iter()
                .map(|name| {
                    let window = config.context_window(&name);
                    (name, window)
                })
                .collect(),
            root_max_output_tokens: config.root_max_output_tokens,
            coordinator: coordinator.clone(),
        };
        // Every defined agent can also be talked to directly (`chat
        // --agent`); the agents follow the catalog through its reloads.
        let bundle = match &catalog {
            Some(catalog) => RuntimeBundle::from_catalog(
                catalog.clone(),
                Arc::new(move |current: &AgentCatalog| profiles.build(current)),
            )?,
            None => RuntimeBundle::new(profiles.build(&AgentCatalog::empty(0))?.root),
        };
        let mut bundle = bundle.with_loop(AgentLoop::new(gate.clone()));
        if let Some(c) = &coordinator {
            bundle = bundle.with_coordinator(c.clone());
        }
        let manager = SessionManager::new(store.clone(), bundle, config.session_manager_config());

        manager.spawn_evictor(config.cleanup_interval());
        // Always: with retention off the pass still reclaims free pages and
        // trains the compression dictionary.
        manager.spawn_retention(config.cleanup_interval(), config.retention_policy());
        Ok(Self {
            config: loaded,
            store,
            manager,
            coordinator,
            catalog: catalog.map(|c| (c, inputs)),
            notices,
            generation: activation.generation,
            lock,
            recovered: activation.recovery.sessions_with_inbox_work,
            mcp: mcp_servers,
            gate,
        })
    }
}

/// Refuses a catalog with an agent whose profile has no provider.
fn check_profiles(
    loaded: &LoadedConfig,
    catalog: &AgentCatalog,
    providers: &ProfileProviders,
) -> Result<()> {
    for def in catalog.iter() {
        if providers.provider(&def.llm_profile).is_none() {
            return Err(ConfigError::single(
                loaded.source_label(),
                "agents_dir",
                format!(
                    "agent {} names profile {} which is not configured",
                    def.id, def.llm_profile
                ),
            )
            .into());
        }
    }
    Ok(())
}

/// The name `keel serve` opens the data directory with.
pub(crate) const SERVE_COMMAND: &str = "keel serve";

/// Takes the database for this process and starts its runtime: the lock
/// (on SQLite a second process is refused here, before it migrates,
/// recovers or writes anything; on PostgreSQL runtimes share it), the
/// store, and the activation that registers this process under a new
/// generation and recovers what dead processes left.
async fn activate(command: &str, config: &Config) -> Result<(RuntimeHold, Store, Activation)> {
    let (lock, store) = crate::storage::open_runtime(command, config).await?;
    let location = Location::of(config);
    if command == SERVE_COMMAND {
        // Only `keel serve` delivers webhooks. Its server-wide URLs are set
        // before the activation, so the runs it recovers from an earlier
        // process (interrupted now) are delivered to them too.
        store.set_webhook_urls(config.server.webhook_urls.clone());
    }
    let activation = store
        .activate_runtime(describe_process(command), keel_core::time::now_ms())
        .await
        .map_err(location.err())?;
    log_recovery(&activation.recovery);
    Ok((lock, store, activation))
}

/// Says what the activation recovered from an earlier process, if anything.
fn log_recovery(recovery: &keel_store::RecoveryReport) {
    if recovery.unanswered_inputs > 0 {
        tracing::warn!(
            inputs = recovery.unanswered_inputs,
            "turns of an earlier process ended without an answer; their inputs are kept, marked unanswered"
        );
    }
    if !recovery.interrupted_runs.is_empty() || !recovery.counters_repaired.is_empty() {
        tracing::warn!(
            interrupted = recovery.interrupted_runs.len(),
            repaired = recovery.counters_repaired.len(),
            "recovered sub-agent runs of an earlier process"
        );
    }
}

impl App {
    /// Starts what earlier processes acknowledged but never finished: the
    /// turns of queued user input, in the order it was acknowledged, and one
    /// coalesced wake per session whose inbox had work at start-up. Call it
    /// once clients are listening, so they see those turns from their start.
    /// `adopt` is told each resumed turn before it is queued (see
    /// [`SessionManager::resume_queued`]).
    pub async fn deliver_recovered(&self, adopt: impl FnMut(SessionId, TurnId)) -> Result<()> {
        let resumed = self.manager.resume_queued(adopt).await?;
        if resumed > 0 {
            tracing::info!(
                inputs = resumed,
                "messages an earlier process acknowledged before their turn started run now"
            );
        }
        for session in &self.recovered {
            self.manager.wake_inbox(*session);
        }
        // Approvals an earlier process left: their expiry timers start now,
        // and a turn decided but not resumed resumes.
        for session in self.store.sessions_with_open_approvals().await? {
            self.manager.wake_inbox(session);
        }
        Ok(())
    }
}

/// Why a runtime on a shared database stopped on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fenced(pub String);

/// What [`App::spawn_keeper`] tells its caller as it takes a stopped
/// process's work over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// A turn of the dialog is queued here (an input the stopped process
    /// acknowledged): whoever shows the dialog's turns may follow it.
    Turn(SessionId, TurnId),
    /// The takeover is committed and its work queued here; the stopped
    /// process's own turns ended without an answer.
    Done,
}

impl App {
    /// On a database several processes share (PostgreSQL): renews this
    /// process's registration every third of `storage.lease_secs` and takes
    /// over the work of processes that stopped renewing (see
    /// [`SessionManager::take_over_expired`]), telling `taken` what it
    /// took. When the registration is gone — this process could not renew
    /// in time and another took its work over — it writes nothing more:
    /// `fenced` gets the reason, and the process should stop. `None` on
    /// SQLite.
    pub fn spawn_keeper(
        &self,
        taken: impl Fn(Takeover) + Send + Sync + 'static,
        fenced: tokio::sync::oneshot::Sender<Fenced>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if !self.store.shared() {
            return None;
        }
        let (store, manager) = (self.store.clone(), Arc::clone(&self.manager));
        let every = std::time::Duration::from_secs(self.config.config.storage.lease_secs) / 3;
        Some(tokio::spawn(async move {
            // Renewals never wait for a takeover, which may take a while.
            let renewals = async {
                let mut ticker = tokio::time::interval(every);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    match store.renew_runtime().await {
                        Ok(()) => {}
                        Err(e) if e.is_fenced() => return e,
                        // The next tick tries again; past the lease, another
                        // process takes over and the next renewal says so.
                        Err(e) => {
                            tracing::warn!(error = %e, "renewing this process's registration failed")
                        }
                    }
                }
            };
            let takeovers = async {
                let mut ticker = tokio::time::interval(every);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    match manager
                        .take_over_expired(|session, turn| taken(Takeover::Turn(session, turn)))
                        .await
                    {
                        Ok(Some(_)) => taken(Takeover::Done),
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "taking over a stopped process's work failed; retried at the next renewal");
                        }
                    }
                }
            };
            tokio::select! {
                e = renewals => {
                    tracing::error!(error = %e, "this process was taken over by another; stopping");
                    let _ = fenced.send(Fenced(e.to_string()));
                }
                () = takeovers => {}
            }
        }))
    }
}

/// The built-in tools a default configuration registers (for `agents check`).
pub fn default_tool_registry() -> Result<ToolRegistry> {
    let dir = std::env::current_dir().map_err(io_err("cannot read the current directory"))?;
    let mut cfg = keel_engine::BuiltinToolsConfig::new(dir);
    cfg.enable_write = true;
    cfg.enable_shell = true;
    Ok(builtin_registry(&cfg)?)
}
