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
    /// Every configured server's connection, by name: kept alive (restarted
    /// with backoff) while any of these or of `tools` is held.
    pub servers: BTreeMap<String, Arc<ServerConnection>>,
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
    // The MCP HTTP stack needs a process-wide crypto provider; another
    // caller may have installed one already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let committed: BTreeMap<String, McpManifestRecord> = store
        .mcp_manifests()
        .await?
        .into_iter()
        .map(|r| (r.server.clone(), r))
        .collect();
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
            .map(McpManifest::from_record)
            .transpose()?;
        let (manifest, connection) = match connection {
            Ok((connection, manifest)) => {
                let record = manifest.record(name, keel_core::time::now_ms())?;
                store.commit_mcp_manifest(record).await?;
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
        setup.servers.insert(name.clone(), connection.clone());
        let allowed = manifest.as_ref().map(|m| m.allowed(name, server));
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
