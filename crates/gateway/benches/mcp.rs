//! `cargo bench -p keel-gateway --bench mcp` (`cargo xtask bench mcp`): one
//! MCP tool call through keel's client (`McpTool::execute`: the server's
//! supervisor state, the deadline, the result mapping and output cap) against
//! the same call made directly with rmcp (`Peer::call_tool`), in the same
//! run. The server is this binary itself (`--serve`: an rmcp stdio server
//! with one trivial tool, `echo`); keel's side starts it as configured,
//! under the Landlock launcher (this binary again) when the kernel has it.
//! Prints `BENCH mcp_call …`: p50 and p99 of each side and their ratios.
//!
//! [`ROUNDS`] rounds alternate [`CALLS`] sequential calls on each side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::{Tool, ToolExecutionContext};
use keel_gateway::config::{Config, ToolsConfig};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool as McpToolDef,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler, ServiceExt};
use serde_json::{json, Value};

const ROUNDS: usize = 10;
const CALLS: usize = 200;

/// The trivial server: `echo {text}` returns its text.
#[derive(Clone)]
struct Echo;

impl ServerHandler for Echo {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let Value::Object(schema) = json!({
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        }) else {
            unreachable!("an object literal")
        };
        Ok(ListToolsResult::with_all_items(vec![McpToolDef::new(
            "echo",
            "Returns its text.",
            Arc::new(schema),
        )]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let text = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("text"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        Ok(CallToolResult::success(vec![ContentBlock::text(text)]).into())
    }
}

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn serve() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let service = Echo
            .serve(rmcp::transport::stdio())
            .await
            .expect("the server starts");
        let _ = service.waiting().await;
    });
}

fn main() -> std::process::ExitCode {
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        // This binary is also keel's sandbox launcher and the server.
        Some(a) if a == keel_engine::SANDBOX_LAUNCHER_ARG => {
            return keel_engine::run_sandbox_launcher(args)
        }
        Some(a) if a == "--serve" => {
            serve();
            return std::process::ExitCode::SUCCESS;
        }
        _ => {}
    }
    bench();
    std::process::ExitCode::SUCCESS
}

fn bench() {
    let exe = std::env::current_exe().expect("this binary's path");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let quoted = |p: &std::path::Path| format!("{:?}", p.display().to_string());
        let mut read: Vec<String> = ToolsConfig::default()
            .shell_read_paths
            .iter()
            .map(|p| quoted(p))
            .collect();
        read.push(quoted(exe.parent().expect("a directory")));
        let unsandboxed = keel_engine::check_sandbox_support(false).is_err();
        let text = format!(
            "data_dir = {d}\nworkspace_root = {d}\n[tools]\nshell_read_paths = [{}]\n\
             [mcp.bench]\ncommand = {}\nargs = [\"--serve\"]\napproval = \"never\"\nunsandboxed = {unsandboxed}\n",
            read.join(", "),
            quoted(&exe),
            d = quoted(dir.path()),
        );
        let config = Config::from_toml_str_with_env(&text, "keel.toml", &|k| std::env::var(k).ok())
            .expect("the bench configuration");
        let store = keel_store::Store::open(dir.path().join("keel.db"), Default::default())
            .expect("a store");
        let setup = keel_gateway::mcp::connect_all(&config, &store, Some(exe.clone()))
            .await
            .expect("keel connects");
        assert!(setup.notices.iter().all(|n| !n.contains("unavailable")), "{:?}", setup.notices);
        let keel_tool: Arc<dyn Tool> = setup
            .tools
            .iter()
            .find(|t| t.name() == "mcp__bench__echo")
            .expect("the echo tool")
            .clone();
        let direct = ()
            .serve(
                rmcp::transport::TokioChildProcess::new({
                    let mut cmd = tokio::process::Command::new(&exe);
                    cmd.arg("--serve");
                    cmd
                })
                .expect("the direct server starts"),
            )
            .await
            .expect("rmcp connects");
        let ctx = ToolExecutionContext::default();
        let (mut through_keel, mut raw) = (Vec::new(), Vec::new());
        // Warm both up.
        for _ in 0..50 {
            let _ = keel_tool.execute(json!({"text": "hi"}), &ctx).await;
            let _ = direct
                .peer()
                .call_tool(CallToolRequestParams::new("echo").with_arguments(
                    json!({"text": "hi"}).as_object().cloned().unwrap_or_default(),
                ))
                .await;
        }
        for _ in 0..ROUNDS {
            for _ in 0..CALLS {
                let started = Instant::now();
                let out = keel_tool.execute(json!({"text": "hi"}), &ctx).await;
                through_keel.push(started.elapsed());
                assert_eq!(out.map(|o| o.content).as_deref(), Ok("hi"));
            }
            for _ in 0..CALLS {
                let started = Instant::now();
                let params = CallToolRequestParams::new("echo").with_arguments(
                    json!({"text": "hi"}).as_object().cloned().unwrap_or_default(),
                );
                let out = direct.peer().call_tool(params).await;
                raw.push(started.elapsed());
                assert!(out.is_ok(), "{out:?}");
            }
        }
        let (r50, r99) = (percentile(&raw, 0.5), percentile(&raw, 0.99));
        let (k50, k99) = (percentile(&through_keel, 0.5), percentile(&through_keel, 0.99));
        println!(
            "BENCH mcp_call transport=stdio confined={} samples={}+{} rmcp_p50_us={:.0} rmcp_p99_us={:.0} \
             keel_p50_us={:.0} keel_p99_us={:.0} ratio_p50={:.2} ratio_p99={:.2}",
            !unsandboxed,
            raw.len(),
            through_keel.len(),
            us(r50),
            us(r99),
            us(k50),
            us(k99),
            us(k50) / us(r50),
            us(k99) / us(r99),
        );
    });
}
