//! Connecting to one MCP server (a confined child process over stdio, or
//! Streamable HTTP) with rmcp, and [`McpTool`], a server's tool as a
//! [`keel_core::Tool`].

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::tool::truncate_with_note;
use keel_core::{DelegationPolicy, Tool, ToolError, ToolExecutionContext, ToolOutput};
use keel_engine::{check_sandbox_support, LandlockPolicy};
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock, ResourceContents};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ServiceError, ServiceExt};
use std::sync::Arc;

use super::manifest::{AllowedTool, ManifestTool, McpManifest};
use super::supervisor::{ServerConnection, Unavailable};
use super::StdioConfinement;
use crate::config::McpServerConfig;

/// Variables every stdio server gets from keel's environment (when set),
/// as the shell tool's commands do.
const BASE_ENV: [&str; 4] = ["PATH", "HOME", "LANG", "TERM"];

/// A live session with one server.
pub struct Connected {
    pub(crate) service: RunningService<RoleClient, rmcp::model::ClientConfig>,
    /// A stdio server's private temporary directory (its `TMPDIR`).
    pub(crate) _tmp: Option<tempfile::TempDir>,
    notice: Option<String>,
}

impl Connected {
    /// The start-up notice this server needs (it runs unconfined).
    pub fn notice(&self) -> Option<String> {
        self.notice.clone()
    }
}

/// Starts or reaches `name` and lists its tools, within its timeout. The
/// error is a one-line reason for the log and the start-up notice.
pub(crate) async fn connect(
    name: &str,
    config: &McpServerConfig,
    workspace: &Path,
    policy: LandlockPolicy,
) -> Result<(Connected, McpManifest), String> {
    let timeout = Duration::from_secs(config.timeout_secs);
    let connecting = async {
        let (service, tmp, notice) = match (&config.command, &config.url) {
            (Some(command), _) => {
                let (transport, tmp, notice) =
                    spawn_stdio(name, command, config, workspace, policy)?;
                let service = hello().serve(transport).await.map_err(|e| e.to_string())?;
                (service, Some(tmp), notice)
            }
            (None, Some(url)) => {
                let transport =
                    StreamableHttpClientTransport::from_config(http_config(url, config)?);
                let service = hello().serve(transport).await.map_err(|e| e.to_string())?;
                (service, None, None)
            }
            (None, None) => return Err("neither `command` nor `url` is set".to_owned()),
        };
        let tools = service
            .peer()
            .list_all_tools()
            .await
            .map_err(|e| e.to_string())?;
        let manifest = McpManifest {
            tools: tools
                .into_iter()
                .map(|t| ManifestTool {
                    name: t.name.to_string(),
                    description: t.description.map(|d| d.to_string()).unwrap_or_default(),
                    input_schema: serde_json::Value::Object((*t.input_schema).clone()),
                })
                .collect(),
        };
        Ok((
            Connected {
                service,
                _tmp: tmp,
                notice,
            },
            manifest,
        ))
    };
    match tokio::time::timeout(timeout, connecting).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "no answer within mcp.{name}.timeout_secs = {}",
            config.timeout_secs
        )),
    }
}

/// What keel's `initialize` says: keel and its version, and the newest
/// protocol version that has that handshake (rmcp's newest, a draft,
/// replaced it, and servers answering `initialize` do not know it).
fn hello() -> rmcp::model::ClientConfig {
    rmcp::model::ClientConfig::new(
        rmcp::model::ClientCapabilities::default(),
        rmcp::model::Implementation::new("keel", env!("CARGO_PKG_VERSION")),
    )
    .with_protocol_version(rmcp::model::ProtocolVersion::LATEST_WITH_INITIALIZE)
}

/// The child process of a stdio server: under the sandbox launcher when the
/// kernel has Landlock (refused without it unless `unsandboxed`), with a
/// cleared environment, its own process group and a private `TMPDIR`.
fn spawn_stdio(
    name: &str,
    command: &str,
    config: &McpServerConfig,
    workspace: &Path,
    policy: LandlockPolicy,
) -> Result<(TokioChildProcess, tempfile::TempDir, Option<String>), String> {
    let (confinement, notice) = match check_sandbox_support(config.network) {
        Ok(()) => (StdioConfinement::Landlock(policy), None),
        Err(_) if config.unsandboxed => (
            StdioConfinement::Unconfined,
            Some(format!(
                "keel: MCP server {name} runs without Landlock confinement (mcp.{name}.unsandboxed = true on a kernel without Landlock)"
            )),
        ),
        Err(reason) => {
            return Err(format!(
                "{reason}; set mcp.{name}.unsandboxed = true to run it unconfined"
            ))
        }
    };
    let tmp = tempfile::Builder::new()
        .prefix("keel-mcp-")
        .tempdir()
        .map_err(|e| format!("cannot create its temporary directory: {e}"))?;
    let argv: Vec<OsString> = std::iter::once(OsString::from(command))
        .chain(config.args.iter().map(OsString::from))
        .collect();
    let mut cmd = match &confinement {
        StdioConfinement::Landlock(policy) => {
            let mut cmd = tokio::process::Command::new(&policy.launcher);
            cmd.args(policy.launcher_args(&[workspace, tmp.path()], &argv));
            cmd
        }
        StdioConfinement::Unconfined => {
            let mut cmd = tokio::process::Command::new(command);
            cmd.args(&config.args);
            cmd
        }
    };
    cmd.env_clear();
    for var in BASE_ENV
        .iter()
        .copied()
        .chain(config.env.iter().map(String::as_str))
    {
        if let Some(value) = std::env::var_os(var) {
            cmd.env(var, value);
        }
    }
    cmd.env("TMPDIR", tmp.path());
    cmd.current_dir(config.cwd.as_deref().unwrap_or(workspace));
    cmd.kill_on_drop(true);
    #[cfg(unix)]
    cmd.process_group(0);
    let (transport, stderr) = TokioChildProcess::builder(cmd)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {command:?}: {e}"))?;
    if let Some(stderr) = stderr {
        let server = name.to_owned();
        tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt;
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::info!(server = %server, "mcp server stderr: {line}");
            }
        });
    }
    Ok((transport, tmp, notice))
}

/// The Streamable HTTP transport settings for `url` with the configured
/// headers, their values read from the environment.
fn http_config(
    url: &str,
    config: &McpServerConfig,
) -> Result<StreamableHttpClientTransportConfig, String> {
    let mut headers = HashMap::new();
    for (header, var) in &config.headers_env {
        let value =
            std::env::var(var).map_err(|_| format!("environment variable {var} is not set"))?;
        let name = http::HeaderName::from_bytes(header.as_bytes())
            .map_err(|_| format!("{header:?} is not an HTTP header name"))?;
        let value = http::HeaderValue::from_str(&value)
            .map_err(|_| format!("the value of {var} is not a valid {header} header"))?;
        headers.insert(name, value);
    }
    Ok(StreamableHttpClientTransportConfig::with_uri(url).custom_headers(headers))
}

/// One MCP tool as a keel tool, registered as `mcp__SERVER__TOOL`.
pub struct McpTool {
    connection: Arc<ServerConnection>,
    registered: String,
    tool: ManifestTool,
    parameters: serde_json::Value,
    policy: DelegationPolicy,
}

impl McpTool {
    /// The tool `allowed` of the server behind `connection`.
    pub(crate) fn new(
        connection: Arc<ServerConnection>,
        config: &McpServerConfig,
        allowed: &AllowedTool,
    ) -> Self {
        // Both provider APIs want an object schema at the top.
        let mut parameters = allowed.tool.input_schema.clone();
        match parameters.as_object_mut() {
            Some(object) => {
                object
                    .entry("type")
                    .or_insert_with(|| serde_json::Value::from("object"));
            }
            None => parameters = serde_json::json!({"type": "object"}),
        }
        Self {
            connection,
            registered: allowed.registered.clone(),
            tool: allowed.tool.clone(),
            parameters,
            policy: if config.delegatable {
                DelegationPolicy::Delegatable
            } else {
                DelegationPolicy::RootOnly
            },
        }
    }

    /// A failure the model reads: what happened, naming the server, with an
    /// error id whose detail is in the log.
    fn failure(&self, what: &str, detail: &dyn std::fmt::Display) -> ToolError {
        let id = uuid::Uuid::now_v7();
        tracing::warn!(
            error_id = %id,
            server = %self.connection.name,
            tool = %self.tool.name,
            error = %detail,
            "MCP tool call failed"
        );
        ToolError::Failed(format!(
            "MCP server {} {what} (error id {id})",
            self.connection.name
        ))
    }
}

#[async_trait]
impl Tool for McpTool {
    fn name(&self) -> &str {
        &self.registered
    }

    fn description(&self) -> &str {
        &self.tool.description
    }

    fn parameters(&self) -> serde_json::Value {
        self.parameters.clone()
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        self.policy
    }

    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        use tracing::Instrument;
        // The MCP request, a child of the engine's `execute_tool` span
        // (named after OpenTelemetry's MCP conventions).
        let span = tracing::info_span!(
            target: keel_engine::TRACE_TARGET,
            "tools/call",
            otel.name = format!("tools/call {}", self.tool.name),
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            mcp.method.name = "tools/call",
            gen_ai.tool.name = %self.tool.name,
            keel.mcp.server = %self.connection.name,
            error.type = tracing::field::Empty,
        );
        let result = self.call(args, ctx).instrument(span.clone()).await;
        if result.is_err() && !span.is_disabled() {
            span.record("otel.status_code", "ERROR");
            span.record("error.type", "tool_error");
        }
        result
    }
}

impl McpTool {
    /// One `tools/call` request, bounded by the server's timeout.
    async fn call(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let arguments = match args {
            serde_json::Value::Object(map) => map,
            serde_json::Value::Null => serde_json::Map::new(),
            other => {
                return Err(ToolError::InvalidArguments(format!(
                    "expected a JSON object, found {other}"
                )))
            }
        };
        let connection = &self.connection;
        // The timeout bounds the whole call, a wait for a restart included.
        let deadline = tokio::time::Instant::now() + connection.timeout;
        let session = tokio::select! {
            () = ctx.cancellation.cancelled() => return Err(ToolError::Cancelled),
            session = tokio::time::timeout_at(deadline, connection.session(deadline)) => session,
        };
        let peer = match session {
            Ok(Ok(peer)) => peer,
            Ok(Err(Unavailable { retry_in, reason })) => {
                let when = match retry_in {
                    Some(d) => format!("keel tries again in {} s", d.as_millis().div_ceil(1000)),
                    None => "keel does not try again until it restarts".to_owned(),
                };
                return Err(self.failure(
                    &format!("is unavailable: it stopped or could not be started, and {when}"),
                    &reason,
                ));
            }
            Err(_) => {
                return Err(self.failure(
                    &format!(
                        "is restarting and was not back within the call's timeout ({} s)",
                        connection.timeout.as_secs()
                    ),
                    &"restart still under way",
                ))
            }
        };
        let params = CallToolRequestParams::new(self.tool.name.clone()).with_arguments(arguments);
        // Dropping the call (cancelled or timed out) sends MCP's
        // notifications/cancelled to the server.
        let call = peer.call_tool(params);
        let outcome = tokio::select! {
            () = ctx.cancellation.cancelled() => return Err(ToolError::Cancelled),
            outcome = tokio::time::timeout_at(deadline, call) => outcome,
        };
        match outcome {
            Err(_) => Err(ToolError::TimedOut(
                u64::try_from(connection.timeout.as_millis()).unwrap_or(u64::MAX),
            )),
            Ok(Err(ServiceError::McpError(e))) => {
                Err(self.failure(&format!("refused the call ({})", e.code.0), &e.message))
            }
            Ok(Err(e)) => Err(self.failure(
                "failed to answer; it may have stopped (keel restarts it)",
                &e,
            )),
            Ok(Ok(result)) => Ok(output(result, connection.max_output_bytes)),
        }
    }
}

/// What the model reads of a result: its text; an image, audio or a
/// resource as a line saying what it is; `isError` as an error result.
pub(crate) fn output(result: CallToolResult, max_bytes: usize) -> ToolOutput {
    let mut parts: Vec<String> = Vec::new();
    for block in &result.content {
        parts.push(match block {
            ContentBlock::Text(t) => t.text.clone(),
            ContentBlock::Image(i) => format!(
                "[image {}, {} bytes of base64 not shown]",
                i.mime_type,
                i.data.len()
            ),
            ContentBlock::Audio(a) => format!(
                "[audio {}, {} bytes of base64 not shown]",
                a.mime_type,
                a.data.len()
            ),
            ContentBlock::Resource(r) => match &r.resource {
                ResourceContents::TextResourceContents { uri, text, .. } => {
                    format!("[resource {uri}]\n{text}")
                }
                ResourceContents::BlobResourceContents {
                    uri,
                    mime_type,
                    blob,
                    ..
                } => format!(
                    "[resource {uri}, {}, {} bytes of base64 not shown]",
                    mime_type.as_deref().unwrap_or("binary"),
                    blob.len()
                ),
                _ => "[a resource keel does not show]".to_owned(),
            },
            ContentBlock::ResourceLink(r) => format!("[resource link {} ({})]", r.uri, r.name),
            _ => "[content of a kind keel does not show]".to_owned(),
        });
    }
    if parts.is_empty() {
        if let Some(structured) = &result.structured_content {
            parts.push(structured.to_string());
        }
    }
    ToolOutput {
        content: truncate_with_note(parts.join("\n"), max_bytes),
        is_error: result.is_error.unwrap_or(false),
    }
}
