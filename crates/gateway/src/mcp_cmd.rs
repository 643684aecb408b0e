//! `keel mcp list` and `keel mcp call NAME TOOL JSON`: the configured MCP
//! servers reached now (each once, confined as at start-up), next to the
//! manifests committed in the database, and one call of a server's tool for
//! a user to try it. Neither commits anything nor takes the data
//! directory's lock, so both work while `keel serve` runs.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use keel_core::ToolExecutionContext;
use keel_store::McpManifestRecord;

use crate::config::Config;
use crate::error::{AppError, Result};
use crate::mcp::{probe_all, McpServer};
use crate::storage::Location;

/// The manifests committed in `config`'s database (none without one).
async fn committed(config: &Config) -> Result<Vec<McpManifestRecord>> {
    let location = Location::of(config);
    if !location.exists() {
        return Ok(Vec::new());
    }
    Ok(location.open(config).await?.mcp_manifests().await?)
}

/// How long ago `at_ms` was, in words (`3m 12s`).
fn age(at_ms: i64) -> String {
    let secs = (keel_core::time::now_ms() - at_ms).max(0) / 1000;
    humantime::format_duration(Duration::from_secs(u64::try_from(secs).unwrap_or(0))).to_string()
}

/// The lines `keel mcp list` prints for one server.
fn describe(name: &str, server: &McpServer, record: Option<&McpManifestRecord>) -> Vec<String> {
    let status = server.connection.status();
    let mut lines = vec![match (&status.reason, status.state) {
        (Some(reason), "unavailable") => {
            format!("{name} ({}): unavailable: {reason}", server.transport)
        }
        (_, state) => format!("{name} ({}): {state}", server.transport),
    }];
    lines.push(match record {
        Some(r) => format!(
            "  manifest: committed {} ago, sha256 {}",
            age(r.committed_at_ms),
            r.hash.get(..12).unwrap_or(&r.hash)
        ),
        None => "  manifest: none committed (keel serve or keel chat commits it when they reach the server)".to_owned(),
    });
    let live = status.state == "up";
    if live && record.is_some_and(|r| Some(&r.hash) != server.manifest_hash.as_ref()) {
        lines.push(
            "  the server lists other tools than its committed manifest; keel serve or keel chat commits them when they start"
                .to_owned(),
        );
    }
    let source = if live {
        "listed now"
    } else {
        "from the committed manifest"
    };
    if server.tools.is_empty() {
        lines.push(format!("  tools: none ({source})"));
    } else {
        lines.push(format!("  tools ({}, {source}):", server.tools.len()));
        for t in &server.tools {
            lines.push(format!(
                "    {}  ({})  {}",
                t.name, t.registered, t.description
            ));
        }
    }
    if server.delegatable {
        lines.push("  delegatable: agents that are delegated to may use its tools".to_owned());
    }
    lines
}

/// `keel mcp list`: every configured server, its status now, its committed
/// manifest's age and its tools.
pub async fn list(config_file: Option<&Path>, data_dir: Option<&Path>) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    let config = &loaded.config;
    if config.mcp.is_empty() {
        println!("no MCP server is configured (add an [mcp.NAME] table to keel.toml)");
        return Ok(ExitCode::SUCCESS);
    }
    let records = committed(config).await?;
    let setup = probe_all(config, &records, None).await?;
    for (name, server) in &setup.servers {
        let record = records.iter().find(|r| &r.server == name);
        for line in describe(name, server, record) {
            println!("{line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `keel mcp call NAME TOOL JSON`: calls TOOL (its MCP name) of server
/// NAME with the JSON object `args`, bounded by the server's timeout and
/// output cap; prints what a model would read. Exit 1 when the call fails
/// or the server answers with an error result.
pub async fn call(
    config_file: Option<&Path>,
    data_dir: Option<&Path>,
    name: &str,
    tool: &str,
    args: &str,
) -> Result<ExitCode> {
    let loaded = Config::load(config_file, data_dir)?;
    let mut config = loaded.config.clone();
    if !config.mcp.contains_key(name) {
        let known: Vec<&str> = config.mcp.keys().map(String::as_str).collect();
        return Err(AppError::InvalidInput(format!(
            "no MCP server {name} is configured (configured: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        )));
    }
    config.mcp.retain(|n, _| n == name);
    let args: serde_json::Value = serde_json::from_str(args)
        .map_err(|e| AppError::InvalidInput(format!("the arguments are not JSON: {e}")))?;
    if !args.is_object() {
        return Err(AppError::InvalidInput(
            "the arguments must be a JSON object".to_owned(),
        ));
    }
    let records = committed(&config).await?;
    let setup = probe_all(&config, &records, None).await?;
    let server = &setup.servers[name];
    let status = server.connection.status();
    if status.state != "up" {
        return Err(AppError::InvalidInput(format!(
            "MCP server {name} is unavailable: {}",
            status.reason.unwrap_or_default()
        )));
    }
    let Some(found) = server.tools.iter().find(|t| t.name == tool) else {
        let names: Vec<&str> = server.tools.iter().map(|t| t.name.as_str()).collect();
        return Err(AppError::InvalidInput(format!(
            "MCP server {name} has no tool {tool} that agents may use (its tools: {})",
            names.join(", ")
        )));
    };
    let Some(runnable) = setup.tools.iter().find(|t| t.name() == found.registered) else {
        return Err(AppError::InvalidInput(format!(
            "MCP server {name}'s tool {tool} is not registered"
        )));
    };
    let ctx = ToolExecutionContext::default();
    let cancel = ctx.cancellation.clone();
    // Ctrl-C cancels the call (the server hears MCP's cancellation).
    let interrupt = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            cancel.cancel();
        }
    });
    let outcome = runnable.execute(args, &ctx).await;
    interrupt.abort();
    match outcome {
        Ok(out) => {
            println!("{}", out.content);
            if out.is_error {
                eprintln!("keel: the server answered with an error result");
                return Ok(ExitCode::FAILURE);
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("keel: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}
