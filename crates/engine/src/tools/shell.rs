//! `shell`: runs a command with `sh -c` in the workspace root, with a timeout
//! and bounded output. Root only, and registered only when enabled.

use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::{Tool, ToolError, ToolExecutionContext, ToolOutput};
use serde::Deserialize;
use serde_json::json;
use tokio::io::AsyncReadExt;

use super::{parse_args, Workspace, MAX_TOOL_OUTPUT_BYTES};
use crate::error::internal_tool_error;

/// Runs shell commands in the workspace.
pub(crate) struct ShellTool {
    workspace: Workspace,
    timeout: Duration,
}

impl ShellTool {
    /// A shell whose commands run in `workspace` for at most `timeout`.
    pub(crate) fn new(workspace: Workspace, timeout: Duration) -> Self {
        Self { workspace, timeout }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ShellArgs {
    command: String,
    #[serde(default)]
    timeout_secs: Option<u64>,
}

#[async_trait]
impl Tool for ShellTool {
    fn name(&self) -> &str {
        "shell"
    }
    fn description(&self) -> &str {
        "Run a shell command in the workspace root; returns exit status, stdout and stderr."
    }
    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout_secs": {"type": "integer", "minimum": 1, "maximum": self.timeout.as_secs().max(1)}
            },
            "required": ["command"],
            "additionalProperties": false
        })
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let args: ShellArgs = parse_args(args)?;
        let timeout = args
            .timeout_secs
            .map(Duration::from_secs)
            .unwrap_or(self.timeout)
            .min(self.timeout);
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&args.command)
            .current_dir(self.workspace.root())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| internal_tool_error(&format_args!("cannot start sh: {e}")))?;
        let mut stdout = child.stdout.take();
        let mut stderr = child.stderr.take();
        let read_all = async {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let cap = MAX_TOOL_OUTPUT_BYTES as u64;
            if let Some(s) = stdout.as_mut() {
                s.take(cap).read_to_end(&mut out).await.ok();
            }
            if let Some(s) = stderr.as_mut() {
                s.take(cap).read_to_end(&mut err).await.ok();
            }
            let status = child.wait().await;
            (status, out, err)
        };
        // Dropping `read_all` drops the child, and kill_on_drop kills it.
        let (status, out, err) = tokio::select! {
            biased;
            _ = ctx.cancellation.cancelled() => return Err(ToolError::Cancelled),
            _ = tokio::time::sleep(timeout) => {
                return Err(ToolError::TimedOut(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)))
            }
            r = read_all => r,
        };
        let status =
            status.map_err(|e| internal_tool_error(&format_args!("waiting for sh: {e}")))?;
        let text = format!(
            "exit status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            status
                .code()
                .map_or_else(|| "killed".to_owned(), |c| c.to_string()),
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        );
        let mut output = ToolOutput::bounded(text, MAX_TOOL_OUTPUT_BYTES);
        output.is_error = !status.success();
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(dir: &std::path::Path, secs: u64) -> ShellTool {
        ShellTool::new(Workspace::new(dir).unwrap(), Duration::from_secs(secs))
    }

    #[tokio::test]
    async fn runs_in_the_workspace_and_reports_status() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("f.txt"), "x").unwrap();
        let out = tool(d.path(), 5)
            .execute(
                json!({"command": "ls; echo oops >&2; exit 3"}),
                &ToolExecutionContext::default(),
            )
            .await
            .unwrap();
        assert!(out.is_error);
        assert_eq!(
            out.content,
            "exit status: 3\n--- stdout ---\nf.txt\n\n--- stderr ---\noops\n"
        );
    }

    #[tokio::test]
    async fn times_out() {
        let d = tempfile::tempdir().unwrap();
        let err = tool(d.path(), 1)
            .execute(
                json!({"command": "sleep 30"}),
                &ToolExecutionContext::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(err, ToolError::TimedOut(1000));
    }

    #[tokio::test]
    async fn cancellation_kills_the_command() {
        let d = tempfile::tempdir().unwrap();
        let ctx = ToolExecutionContext::default();
        ctx.cancellation.cancel();
        let err = tool(d.path(), 30)
            .execute(json!({"command": "sleep 30"}), &ctx)
            .await
            .unwrap_err();
        assert_eq!(err, ToolError::Cancelled);
    }
}
