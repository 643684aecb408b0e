//! A small MCP server for keel's MCP client tests, written with rmcp's
//! server side: served over stdio by the `keel-mcp-test-server` binary and
//! over Streamable HTTP on loopback by [`serve_http`].
//!
//! Tools: `echo {text}`, `add {a, b}`, `sleep {ms, marker?}` (writes
//! `cancelled` to `marker` when the client cancels it), `big {bytes}`,
//! `fail` (an `isError` result), `image`, and `write {path}` and
//! `connect {addr}` (writes a file, opens a TCP connection: for the sandbox
//! tests), `read {path}` (reads a file) and `pid` (its process id: for the
//! restart tests). A list of names limits which are listed, so a
//! test can change the manifest between two starts.

use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ImageContent,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{json, Value};

/// The test server.
#[derive(Clone, Default)]
pub struct TestServer {
    listed: Option<Vec<String>>,
    /// Notified when a `sleep` starts, and when one is cancelled.
    notify: Option<(Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>)>,
    listed_file: Option<std::path::PathBuf>,
}

impl TestServer {
    /// A server listing the tools `listed` names (comma-separated), or all.
    pub fn new(listed: Option<&str>) -> Self {
        Self {
            listed: listed.map(|v| v.split(',').map(str::to_owned).collect()),
            notify: None,
            listed_file: None,
        }
    }

    /// A server listing the tools `file` names (comma-separated), read
    /// again at every listing, so a test can change them while it runs.
    pub fn listing_from(file: std::path::PathBuf) -> Self {
        Self {
            listed_file: Some(file),
            ..Self::default()
        }
    }

    /// The same server, notifying `started` when a `sleep` starts and
    /// `cancelled` when the client cancels one.
    pub fn notifying(
        mut self,
        started: Arc<tokio::sync::Notify>,
        cancelled: Arc<tokio::sync::Notify>,
    ) -> Self {
        self.notify = Some((started, cancelled));
        self
    }
}

fn schema(properties: Value, required: &[&str]) -> Arc<serde_json::Map<String, Value>> {
    let Value::Object(map) = json!({
        "type": "object",
        "properties": properties,
        "required": required,
    }) else {
        unreachable!("a JSON object literal")
    };
    Arc::new(map)
}

fn all_tools() -> Vec<Tool> {
    vec![
        Tool::new(
            "echo",
            "Returns its text.",
            schema(json!({"text": {"type": "string"}}), &["text"]),
        ),
        Tool::new(
            "add",
            "Adds two integers.",
            schema(
                json!({"a": {"type": "integer"}, "b": {"type": "integer"}}),
                &["a", "b"],
            ),
        ),
        Tool::new(
            "sleep",
            "Sleeps for ms milliseconds.",
            schema(
                json!({"ms": {"type": "integer"}, "marker": {"type": "string"}}),
                &["ms"],
            ),
        ),
        Tool::new(
            "big",
            "Returns bytes times the letter x.",
            schema(json!({"bytes": {"type": "integer"}}), &["bytes"]),
        ),
        Tool::new("fail", "Always fails.", schema(json!({}), &[])),
        Tool::new("image", "Returns a tiny image.", schema(json!({}), &[])),
        Tool::new(
            "write",
            "Writes a file.",
            schema(json!({"path": {"type": "string"}}), &["path"]),
        ),
        Tool::new(
            "connect",
            "Opens a TCP connection.",
            schema(json!({"addr": {"type": "string"}}), &["addr"]),
        ),
        Tool::new(
            "read",
            "Reads a file.",
            schema(json!({"path": {"type": "string"}}), &["path"]),
        ),
        Tool::new("pid", "Returns its process id.", schema(json!({}), &[])),
    ]
}

fn text(s: impl Into<String>) -> Result<CallToolResponse, ErrorData> {
    Ok(CallToolResult::success(vec![ContentBlock::text(s)]).into())
}

fn arg<'a>(request: &'a CallToolRequestParams, key: &str) -> Option<&'a Value> {
    request.arguments.as_ref().and_then(|a| a.get(key))
}

impl ServerHandler for TestServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let from_file: Option<Vec<String>> = self.listed_file.as_ref().map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .trim()
                .split(',')
                .map(str::to_owned)
                .collect()
        });
        let listed = from_file.as_ref().or(self.listed.as_ref());
        let tools = all_tools()
            .into_iter()
            .filter(|t| listed.is_none_or(|l| l.iter().any(|n| n == t.name.as_ref())))
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let int = |k| arg(&request, k).and_then(Value::as_i64).unwrap_or(0);
        match request.name.as_ref() {
            "echo" => text(
                arg(&request, "text")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
            ),
            "add" => text((int("a") + int("b")).to_string()),
            "sleep" => {
                let ms = u64::try_from(int("ms")).unwrap_or(0);
                if let Some((started, _)) = &self.notify {
                    started.notify_one();
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(ms)) => text("slept"),
                    () = context.ct.cancelled() => {
                        if let Some(marker) = arg(&request, "marker").and_then(Value::as_str) {
                            let _ = std::fs::write(marker, "cancelled");
                        }
                        if let Some((_, cancelled)) = &self.notify {
                            cancelled.notify_one();
                        }
                        Err(ErrorData::internal_error("cancelled", None))
                    }
                }
            }
            "big" => text("x".repeat(usize::try_from(int("bytes")).unwrap_or(0))),
            "fail" => Ok(CallToolResult::error(vec![ContentBlock::text("it failed")]).into()),
            "image" => Ok(
                CallToolResult::success(vec![ContentBlock::Image(ImageContent::new(
                    "iVBORw0KGgo=",
                    "image/png",
                ))])
                .into(),
            ),
            "write" => {
                let path = arg(&request, "path")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                match std::fs::write(path, "written") {
                    Ok(()) => text("written"),
                    Err(e) => {
                        Ok(CallToolResult::error(vec![ContentBlock::text(e.to_string())]).into())
                    }
                }
            }
            "connect" => {
                let addr = arg(&request, "addr")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                match std::net::TcpStream::connect(addr) {
                    Ok(_) => text("connected"),
                    Err(e) => {
                        Ok(CallToolResult::error(vec![ContentBlock::text(e.to_string())]).into())
                    }
                }
            }
            "read" => {
                let path = arg(&request, "path")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                match std::fs::read_to_string(path) {
                    Ok(content) => text(content),
                    Err(e) => {
                        Ok(CallToolResult::error(vec![ContentBlock::text(e.to_string())]).into())
                    }
                }
            }
            "pid" => text(std::process::id().to_string()),
            other => Err(ErrorData::invalid_params(format!("no tool {other}"), None)),
        }
    }
}

/// Serves `server` over Streamable HTTP at `http://ADDR/mcp` on `listener`
/// until `shutdown` completes.
pub async fn serve_http(
    server: TestServer,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
