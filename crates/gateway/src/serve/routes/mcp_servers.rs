//! `GET /api/mcp`: the configured MCP servers keel is a client of, their
//! status, committed manifest and tools (what `keel mcp list` shows; the
//! reason a server is down goes to the log, not here).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::serve::api::Timestamp;
use crate::serve::openapi::Errors;
use crate::serve::problem::ApiResult;
use crate::serve::Shared;

/// The configured MCP servers, by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct McpServerList {
    /// Every `[mcp.NAME]` server, sorted by name.
    pub servers: Vec<McpServerView>,
}

/// How keel reaches a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpTransport {
    /// A child process keel starts (confined), over stdin/stdout.
    Stdio,
    /// Streamable HTTP.
    Http,
}

/// Where a server's session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpServerStatus {
    /// A live session.
    Up,
    /// keel is starting or reaching it (at start-up or after it stopped).
    Starting,
    /// Down; keel tries again with backoff.
    Unavailable,
}

/// One MCP server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct McpServerView {
    /// Its name (`[mcp.NAME]`).
    pub name: String,
    /// How keel reaches it.
    pub transport: McpTransport,
    /// Its session now.
    pub status: McpServerStatus,
    /// Sessions keel started after the first (restarts, reconnections).
    pub restarts: u64,
    /// Whether agents that are delegated to may use its tools.
    pub delegatable: bool,
    /// Its last committed manifest (`null`: never reached).
    pub manifest: Option<McpManifestView>,
    /// Its allowed tools, from the manifest in force.
    pub tools: Vec<McpToolView>,
}

/// A committed tool manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct McpManifestView {
    /// SHA-256 of the manifest, lowercase hex.
    pub hash: String,
    /// When it was committed.
    pub committed_at: Timestamp,
}

/// One tool of a server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct McpToolView {
    /// Its MCP name.
    pub name: String,
    /// The name the model and the transcript see (`mcp__NAME__TOOL`).
    pub registered_name: String,
    /// Its description, as the server gave it.
    pub description: String,
}

/// The configured MCP servers, their status, committed manifests and tools.
#[utoipa::path(get, path = "/api/mcp", tag = "system",
    responses((status = 200, description = "The MCP servers", body = McpServerList), Errors))]
pub(crate) async fn list(State(shared): State<Arc<Shared>>) -> ApiResult<Json<McpServerList>> {
    let records = shared.app.store.mcp_manifests().await?;
    let servers = shared
        .app
        .mcp
        .iter()
        .map(|(name, server)| McpServerView {
            name: name.clone(),
            transport: if server.transport == "stdio" {
                McpTransport::Stdio
            } else {
                McpTransport::Http
            },
            status: match server.connection.status().state {
                "up" => McpServerStatus::Up,
                "starting" => McpServerStatus::Starting,
                _ => McpServerStatus::Unavailable,
            },
            restarts: server.connection.status().restarts,
            delegatable: server.delegatable,
            manifest: records
                .iter()
                .find(|r| &r.server == name)
                .map(|r| McpManifestView {
                    hash: r.hash.clone(),
                    committed_at: Timestamp(r.committed_at_ms),
                }),
            tools: server
                .tools
                .iter()
                .map(|t| McpToolView {
                    name: t.name.clone(),
                    registered_name: t.registered.clone(),
                    description: t.description.clone(),
                })
                .collect(),
        })
        .collect();
    Ok(Json(McpServerList { servers }))
}
