//! The MCP client: `[mcp.NAME]` servers connected at activation, their tool
//! manifests committed to the store, and their tools registered as
//! [`keel_core::Tool`]s (`mcp__NAME__TOOL`) the engine runs like any other.
//!
//! At activation ([`connect_all`]) keel starts or reaches each server, lists
//! its tools and commits the manifest (name, description, input schema)
//! with its hash; a changed hash is logged with what changed. A server keel
//! cannot reach keeps its last committed manifest: its tools are registered
//! and fail at call time naming the server. The catalog validates
//! `mcp:NAME/TOOL` references against the manifests alone
//! ([`catalog_servers`]), so `keel agents check` needs no server running.

mod client;
mod manifest;
mod supervisor;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use keel_catalog::McpServerTools;
use keel_core::Tool;
use keel_engine::LandlockPolicy;
use keel_store::{McpManifestRecord, Store};

use crate::config::{ApprovalMode, Config, McpServerConfig};
use crate::error::Result;

pub use client::McpTool;
pub use manifest::{registered_name, ManifestTool, McpManifest};
pub use supervisor::{ServerConnection, StatusReport};

/// How stdio servers are confined.
#[derive(Debug, Clone)]
pub enum StdioConfinement {
    /// Under Landlock through the sandbox launcher (the `keel` binary).
    Landlock(LandlockPolicy),
    /// With a cleared environment and its own process group only
    /// (`mcp.NAME.unsandboxed` on a kernel without Landlock).
    Unconfined,
}

/// What activation produced: the tools to register and what the catalog
/// validates `mcp:` references against.
pub struct McpSetup {
    /// Every configured server's allowed tools, connected or not.
    pub tools: Vec<Arc<dyn Tool>>,
    /// The registered names of those whose calls wait for a person's
    /// approval (their server's `approval = "always"`, the default).
    pub gated: Vec<String>,
    /// Per server: delegatable, and its tools by MCP name (`None`: never reached).
    pub catalog: BTreeMap<String, McpServerTools>,
    /// One-line notices for start-up (servers down, unconfined servers).
    pub notices: Vec<String>,
    /// Every configured server, by name: its connection is kept alive
    /// (restarted with backoff) while it or one of `tools` is held.
    pub servers: BTreeMap<String, McpServer>,
}

/// One configured server as `keel mcp list` and `GET /api/mcp` show it.
#[derive(Clone)]
pub struct McpServer {
    /// `stdio` or `http`.
    pub transport: &'static str,
    /// Whether delegated agents may use its tools.
    pub delegatable: bool,
    /// Its connection and status.
    pub connection: Arc<ServerConnection>,
    /// Its allowed tools from the manifest in force (none: never reached).
    pub tools: Vec<ServerTool>,
    /// The SHA-256 of the manifest in force (`None`: never reached).
    pub manifest_hash: Option<String>,
}

/// One allowed tool of a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTool {
    /// Its MCP name.
    pub name: String,
    /// The name the model sees (`mcp__NAME__TOOL`).
    pub registered: String,
    /// Its description.
    pub description: String,
}

/// The launcher policy stdio servers run under: `tools.shell_read_paths`
/// to read and execute, the server's `network`.
pub fn stdio_policy(config: &Config, server: &McpServerConfig) -> LandlockPolicy {
    LandlockPolicy {
        launcher: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("keel")),
        read_paths: config.tools.shell_read_paths.clone(),
        network: server.network,
    }
}

/// Connects to every configured server (each bounded by its
/// `timeout_secs`), commits the manifests of those reached, and builds
/// their tools. `launcher` overrides the sandbox launcher (tests run
/// outside the `keel` binary); `None` is this executable.
pub async fn connect_all(
    config: &Config,
    store: &Store,
    launcher: Option<PathBuf>,
) -> Result<McpSetup> {
    let records = store.mcp_manifests().await?;
    start(config, &records, Some(store), launcher).await
}

/// [`connect_all`] without committing anything: what `keel mcp list` and
/// `keel mcp call` use, `records` being the committed manifests (read
/// while another process may hold the database).
pub async fn probe_all(
    config: &Config,
    records: &[McpManifestRecord],
    launcher: Option<PathBuf>,
) -> Result<McpSetup> {
    start(config, records, None, launcher).await
}

/// Connects every server; commits the manifests to `store` when given.
async fn start(
    config: &Config,
    records: &[McpManifestRecord],
    store: Option<&Store>,
    launcher: Option<PathBuf>,
) -> Result<McpSetup> {
    // The MCP HTTP stack needs a process-wide crypto provider; another
    // caller may have installed one already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let committed: BTreeMap<String, &McpManifestRecord> =
        records.iter().map(|r| (r.server.clone(), r)).collect();
    let mut setup = McpSetup {
        tools: Vec::new(),
        gated: Vec::new(),
        catalog: BTreeMap::new(),
        notices: Vec::new(),
        servers: BTreeMap::new(),
    };
    for (name, server) in &config.mcp {
        let mut policy = stdio_policy(config, server);
        if let Some(launcher) = &launcher {
            policy.launcher = launcher.clone();
        }
        let connection =
            client::connect(name, server, &config.workspace_root(), policy.clone()).await;
        let previous = committed
            .get(name)
            .map(|r| McpManifest::from_record(r))
            .transpose()?;
        let (manifest, connection) = match connection {
            Ok((connection, manifest)) => {
                if let Some(store) = store {
                    let record = manifest.record(name, keel_core::time::now_ms())?;
                    store.commit_mcp_manifest(record).await?;
                }
                if let Some(previous) = &previous {
                    manifest.log_changes_from(previous, name);
                }
                (Some(manifest), Ok(connection))
            }
            Err(reason) => {
                let notice = match &previous {
                    Some(_) => format!(
                        "keel: MCP server {name} is unavailable ({reason}); its tools fail until keel reaches it (it tries again with backoff)"
                    ),
                    None => format!(
                        "keel: MCP server {name} is unavailable ({reason}) and was never reached; agents cannot list its tools"
                    ),
                };
                tracing::warn!(server = %name, "{notice}");
                setup.notices.push(notice);
                (previous, Err(reason))
            }
        };
        if let Some(notice) = connection.as_ref().ok().and_then(|c| c.notice()) {
            setup.notices.push(notice);
        }
        let connection = Arc::new(ServerConnection::spawn(
            supervisor::Target {
                name: name.clone(),
                config: server.clone(),
                workspace: config.workspace_root(),
                policy,
                manifest: manifest.clone(),
            },
            connection,
        ));
        let allowed = manifest.as_ref().map(|m| m.allowed(name, server));
        let manifest_hash = match &manifest {
            Some(m) => Some(m.record(name, 0)?.hash),
            None => None,
        };
        setup.servers.insert(
            name.clone(),
            McpServer {
                transport: if server.command.is_some() {
                    "stdio"
                } else {
                    "http"
                },
                delegatable: server.delegatable,
                connection: connection.clone(),
                tools: allowed
                    .iter()
                    .flat_map(|a| a.iter())
                    .map(|(mcp_name, t)| ServerTool {
                        name: mcp_name.clone(),
                        registered: t.registered.clone(),
                        description: t.tool.description.clone(),
                    })
                    .collect(),
                manifest_hash,
            },
        );
        if let Some(allowed) = &allowed {
            for tool in allowed.values() {
                if server.approval == ApprovalMode::Always {
                    setup.gated.push(tool.registered.clone());
                }
                setup
                    .tools
                    .push(Arc::new(McpTool::new(connection.clone(), server, tool)));
            }
        }
        setup.catalog.insert(
            name.clone(),
            McpServerTools {
                delegatable: server.delegatable,
                tools: allowed.map(|a| {
                    a.into_iter()
                        .map(|(mcp_name, t)| (mcp_name, t.registered))
                        .collect()
                }),
            },
        );
    }
    Ok(setup)
}

/// Narrows `catalog` (what a reload validates against) to the tools each
/// server that is up still lists, so a definition naming a tool that
/// disappeared fails the reload. A server that is down keeps its tools in
/// force; a tool that appeared needs a restart (it has no registered tool).
pub async fn narrow_to_listed(
    servers: &BTreeMap<String, McpServer>,
    catalog: &mut BTreeMap<String, McpServerTools>,
) {
    for (name, server) in servers {
        let Some(listed) = server.connection.list_now().await else {
            continue;
        };
        let Some(tools) = catalog.get_mut(name).and_then(|c| c.tools.as_mut()) else {
            continue;
        };
        tools.retain(|tool, _| {
            let kept = listed.contains(tool);
            if !kept {
                tracing::warn!(server = %name, tool = %tool, "MCP server {name} no longer lists {tool}; definitions naming it do not load");
            }
            kept
        });
    }
}

/// What the catalog knows of the configured servers from `records` (the
/// committed manifests) alone: nothing is started or reached.
pub fn catalog_servers(
    config: &Config,
    records: &[McpManifestRecord],
) -> Result<BTreeMap<String, McpServerTools>> {
    let mut out = BTreeMap::new();
    for (name, server) in &config.mcp {
        let manifest = records
            .iter()
            .find(|r| &r.server == name)
            .map(McpManifest::from_record)
            .transpose()?;
        out.insert(
            name.clone(),
            McpServerTools {
                delegatable: server.delegatable,
                tools: manifest.map(|m| {
                    m.allowed(name, server)
                        .into_iter()
                        .map(|(mcp_name, t)| (mcp_name, t.registered))
                        .collect()
                }),
            },
        );
    }
    Ok(out)
}
