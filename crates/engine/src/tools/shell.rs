//! `shell`: runs a command with `sh -c` in the workspace root. Root only, and
//! registered only when enabled.
//!
//! Each command starts with a cleared environment (only `PATH`, `HOME`,
//! `LANG`, `TERM`, the configured names and `TMPDIR`, a private temporary
//! directory), in its own process group, confined by Landlock where the
//! kernel allows it ([`super::sandbox`]). Its stdout and stderr are read
//! concurrently: the first bytes of each are kept, the rest drained, so a
//! chatty command never blocks on a full pipe. When the command ends, times
//! out, or its turn is cancelled or stopped, the whole group is killed.

use std::ffi::OsString;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::{Tool, ToolError, ToolExecutionContext, ToolOutput};
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::sandbox::LandlockPolicy;
use super::{parse_args, Workspace, MAX_TOOL_OUTPUT_BYTES};
use crate::error::{internal_tool_error, EngineError};

/// Environment variables every command gets from keel's environment (when
/// set there); everything else is left out unless configured.
const BASE_ENV: &[&str] = &["PATH", "HOME", "LANG", "TERM"];

/// Bytes of stdout, and of stderr, kept for the model (both, with the
/// headings and notes, fit in one tool output).
const KEPT_BYTES_PER_STREAM: usize = MAX_TOOL_OUTPUT_BYTES / 2 - 1024;

/// How shell commands are confined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShellConfinement {
    /// Under Landlock, through the launcher.
    Landlock(LandlockPolicy),
    /// Without confinement beyond the working directory, the environment
    /// and the process group (`tools.shell_unsandboxed` on a kernel without
    /// Landlock).
    Unconfined,
    /// Every command is refused with this reason.
    Refused(String),
}

impl ShellConfinement {
    /// Landlock when the kernel supports `policy`; otherwise unconfined if
    /// `allow_unconfined`, else refused. The notice, for the start-up
    /// output, says when commands are not confined.
    pub fn choose(policy: LandlockPolicy, allow_unconfined: bool) -> (Self, Option<String>) {
        let network = policy.network;
        Self::from_support(
            policy,
            super::sandbox::check_sandbox_support(network),
            allow_unconfined,
        )
    }

    fn from_support(
        policy: LandlockPolicy,
        support: Result<(), String>,
        allow_unconfined: bool,
    ) -> (Self, Option<String>) {
        match support {
            Ok(()) => (Self::Landlock(policy), None),
            Err(why) if allow_unconfined => (
                Self::Unconfined,
                Some(format!(
                    "keel: {why}; shell commands run UNCONFINED (tools.shell_unsandboxed = true)"
                )),
            ),
            Err(why) => (
                Self::Refused(format!(
                    "the shell is disabled: {why}. Set tools.shell_unsandboxed = true in keel.toml to run commands without confinement"
                )),
                Some(format!(
                    "keel: {why}; the shell tool refuses every command (set tools.shell_unsandboxed = true to run them unconfined)"
                )),
            ),
        }
    }
}

/// How shell commands run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellConfig {
    /// Default and maximum run time of one command.
    pub timeout: Duration,
    /// Names of further environment variables passed on from keel's
    /// environment besides `PATH`, `HOME`, `LANG` and `TERM`.
    pub env: Vec<String>,
    /// How commands are confined.
    pub confinement: ShellConfinement,
}

impl Default for ShellConfig {
    /// 30 s, no extra variables, refused until a confinement is chosen.
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            env: Vec::new(),
            confinement: ShellConfinement::Refused("the shell is not configured".into()),
        }
    }
}

/// Runs shell commands in the workspace.
pub(crate) struct ShellTool {
    workspace: Workspace,
    config: ShellConfig,
    /// `TMPDIR` of every command, removed with the tool.
    tmp: Arc<tempfile::TempDir>,
}

impl ShellTool {
    /// A shell whose commands run in `workspace` as `config` says. Fails
    /// when a Landlock policy would let commands reach one of the
    /// workspace's protected paths (keel's data directory and configuration
    /// file), since Landlock can only allow trees, never carve one out.
    pub(crate) fn new(workspace: Workspace, config: ShellConfig) -> crate::error::Result<Self> {
        let tmp = tempfile::Builder::new()
            .prefix("keel-shell-")
            .tempdir()
            .map_err(|e| EngineError::Workspace {
                path: std::env::temp_dir(),
                message: format!("cannot create the shell's temporary directory: {e}"),
            })?;
        if let ShellConfinement::Landlock(policy) = &config.confinement {
            let reachable = std::iter::once(workspace.root().to_path_buf()).chain(
                policy
                    .read_paths
                    .iter()
                    .filter_map(|p| p.canonicalize().ok()),
            );
            for tree in reachable {
                if let Some(p) = workspace.protected().iter().find(|p| p.starts_with(&tree)) {
                    return Err(EngineError::Workspace {
                        path: workspace.root().to_path_buf(),
                        message: format!(
                            "the shell would be able to reach {} (keel's own data or configuration) through {}; \
                             move data_dir (and --config) out of workspace_root and tools.shell_read_paths",
                            p.display(),
                            tree.display()
                        ),
                    });
                }
            }
        }
        Ok(Self {
            workspace,
            config,
            tmp: Arc::new(tmp),
        })
    }

    fn command(&self, command: &str) -> Result<tokio::process::Command, ToolError> {
        let argv: Vec<OsString> = vec!["sh".into(), "-c".into(), command.into()];
        let mut cmd = match &self.config.confinement {
            ShellConfinement::Refused(reason) => return Err(ToolError::Denied(reason.clone())),
            ShellConfinement::Unconfined => {
                let mut cmd = tokio::process::Command::new(&argv[0]);
                cmd.args(&argv[1..]);
                cmd
            }
            ShellConfinement::Landlock(policy) => {
                let mut cmd = tokio::process::Command::new(&policy.launcher);
                cmd.args(policy.launcher_args(&[self.workspace.root(), self.tmp.path()], &argv));
                cmd
            }
        };
        cmd.env_clear();
        for name in BASE_ENV
            .iter()
            .copied()
            .chain(self.config.env.iter().map(String::as_str))
        {
            if let Some(value) = std::env::var_os(name) {
                cmd.env(name, value);
            }
        }
        cmd.env("TMPDIR", self.tmp.path())
            .current_dir(self.workspace.root())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        Ok(cmd)
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
                "timeout_secs": {"type": "integer", "minimum": 1, "maximum": self.config.timeout.as_secs().max(1)}
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
            .unwrap_or(self.config.timeout)
            .min(self.config.timeout);
        let mut child = self
            .command(&args.command)?
            .spawn()
            .map_err(|e| internal_tool_error(&format_args!("cannot start sh: {e}")))?;
        // Kills the group on every way out of this function: timeout,
        // cancellation, /stop (the turn's future is dropped) or completion.
        let group = ProcessGroup::of(&child);
        let stdout = drain(child.stdout.take(), KEPT_BYTES_PER_STREAM);
        let stderr = drain(child.stderr.take(), KEPT_BYTES_PER_STREAM);
        let finished = async {
            let status = child.wait().await;
            // Whatever the command left running in its group dies with it,
            // which also closes the pipes the drains are reading.
            group.kill();
            status
        };
        let ((out, out_dropped), (err, err_dropped), status) = tokio::select! {
            biased;
            _ = ctx.cancellation.cancelled() => return Err(ToolError::Cancelled),
            _ = tokio::time::sleep(timeout) => {
                return Err(ToolError::TimedOut(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)))
            }
            r = async { tokio::join!(stdout, stderr, finished) } => r,
        };
        let status =
            status.map_err(|e| internal_tool_error(&format_args!("waiting for sh: {e}")))?;
        let text = format!(
            "exit status: {}\n--- stdout ---\n{}{}\n--- stderr ---\n{}{}",
            status
                .code()
                .map_or_else(|| "killed".to_owned(), |c| c.to_string()),
            String::from_utf8_lossy(&out),
            dropped_note(out_dropped),
            String::from_utf8_lossy(&err),
            dropped_note(err_dropped),
        );
        let mut output = ToolOutput::bounded(text, MAX_TOOL_OUTPUT_BYTES);
        output.is_error = !status.success();
        Ok(output)
    }
}

/// Reads `pipe` to its end, keeping the first `keep` bytes; returns them
/// and how many more were read and dropped.
async fn drain(pipe: Option<impl AsyncRead + Unpin>, keep: usize) -> (Vec<u8>, u64) {
    let (mut kept, mut dropped) = (Vec::new(), 0u64);
    let Some(mut pipe) = pipe else {
        return (kept, dropped);
    };
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let take = n.min(keep - kept.len());
                kept.extend_from_slice(&buf[..take]);
                dropped += (n - take) as u64;
            }
        }
    }
    (kept, dropped)
}

fn dropped_note(dropped: u64) -> String {
    if dropped == 0 {
        String::new()
    } else {
        format!("\n… [{dropped} more bytes not kept]")
    }
}

/// A command's process group (its id is the command's pid); killed when
/// dropped.
struct ProcessGroup(Option<rustix::process::Pid>);

impl ProcessGroup {
    fn of(child: &tokio::process::Child) -> Self {
        Self(
            child
                .id()
                .and_then(|id| i32::try_from(id).ok())
                .and_then(rustix::process::Pid::from_raw),
        )
    }

    fn kill(&self) {
        if let Some(pid) = self.0 {
            // ESRCH: the group is already gone.
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(dir: &std::path::Path, secs: u64) -> ShellTool {
        tool_with_env(dir, secs, &[])
    }

    fn tool_with_env(dir: &std::path::Path, secs: u64, env: &[&str]) -> ShellTool {
        ShellTool::new(
            Workspace::new(dir, &[]).unwrap(),
            ShellConfig {
                timeout: Duration::from_secs(secs),
                env: env.iter().map(|s| s.to_string()).collect(),
                confinement: ShellConfinement::Unconfined,
            },
        )
        .unwrap()
    }

    /// The pid a test command wrote to `child.pid` in the workspace.
    fn child_pid(dir: &std::path::Path) -> i32 {
        let text = std::fs::read_to_string(dir.join("child.pid")).unwrap();
        text.trim().parse().unwrap()
    }

    /// Waits (up to a minute, for a failing test) until process `pid` has
    /// exited; false if it is still running then.
    fn exits(pid: i32) -> bool {
        let Some(pid) = rustix::process::Pid::from_raw(pid) else {
            return true;
        };
        let Ok(fd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) else {
            return true; // already gone
        };
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let timeout = rustix::event::Timespec {
            tv_sec: 60,
            tv_nsec: 0,
        };
        // A pidfd becomes readable when its process exits.
        rustix::event::poll(&mut fds, Some(&timeout)).unwrap() == 1
    }

    async fn run(tool: &ShellTool, command: &str) -> Result<ToolOutput, ToolError> {
        tool.execute(
            json!({ "command": command }),
            &ToolExecutionContext::default(),
        )
        .await
    }

    #[tokio::test]
    async fn runs_in_the_workspace_and_reports_status() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("f.txt"), "x").unwrap();
        let out = run(&tool(d.path(), 5), "ls; echo oops >&2; exit 3")
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
        let err = run(&tool(d.path(), 1), "sleep 30").await.unwrap_err();
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

    #[test]
    fn without_landlock_the_shell_is_refused_unless_unconfined_is_allowed() {
        let policy = LandlockPolicy {
            launcher: "/bin/keel".into(),
            read_paths: Vec::new(),
            network: false,
        };
        let missing = || Err("no Landlock".to_owned());
        let (c, notice) = ShellConfinement::from_support(policy.clone(), Ok(()), false);
        assert_eq!(
            (c, notice),
            (ShellConfinement::Landlock(policy.clone()), None)
        );
        let (c, notice) = ShellConfinement::from_support(policy.clone(), missing(), true);
        assert_eq!(c, ShellConfinement::Unconfined);
        assert!(notice.unwrap().contains("UNCONFINED"));
        let (c, notice) = ShellConfinement::from_support(policy, missing(), false);
        let ShellConfinement::Refused(reason) = c else {
            panic!("{c:?}")
        };
        assert!(reason.contains("tools.shell_unsandboxed"), "{reason}");
        assert!(notice.unwrap().contains("refuses every command"));
    }

    #[tokio::test]
    async fn output_on_both_pipes_is_read_concurrently_and_cut() {
        let d = tempfile::tempdir().unwrap();
        // Each pipe gets ~1.3 MB: far more than a pipe buffer or the output cap.
        let out = run(&tool(d.path(), 20), "seq 1 200000; seq 1 200000 >&2")
            .await
            .unwrap();
        assert!(!out.is_error);
        assert!(out
            .content
            .starts_with("exit status: 0\n--- stdout ---\n1\n2\n"));
        assert!(
            out.content.contains("--- stderr ---\n1\n2\n"),
            "stderr is kept too"
        );
        assert_eq!(out.content.matches("more bytes not kept]").count(), 2);
        assert!(out.content.len() <= MAX_TOOL_OUTPUT_BYTES + 200);
    }

    #[tokio::test]
    async fn commands_see_only_allowlisted_environment_variables() {
        // Set by cargo for every test process; a stand-in for an API key.
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
        let d = tempfile::tempdir().unwrap();
        let out = run(&tool_with_env(d.path(), 10, &["CARGO_PKG_NAME"]), "env")
            .await
            .unwrap();
        let mut names: Vec<&str> = out
            .content
            .lines()
            .skip_while(|l| *l != "--- stdout ---")
            .skip(1)
            .take_while(|l| *l != "--- stderr ---")
            .filter_map(|l| l.split_once('=').map(|(k, _)| k))
            .collect();
        names.sort();
        names.dedup();
        // What sh adds itself.
        names.retain(|n| !["PWD", "OLDPWD", "SHLVL", "_"].contains(n));
        let allowed = ["CARGO_PKG_NAME", "HOME", "LANG", "PATH", "TERM", "TMPDIR"];
        assert!(names.iter().all(|n| allowed.contains(n)), "{names:?}");
        assert!(
            names.contains(&"CARGO_PKG_NAME") && names.contains(&"TMPDIR"),
            "{names:?}"
        );
    }

    #[tokio::test]
    async fn a_timed_out_command_takes_its_whole_process_group_with_it() {
        let d = tempfile::tempdir().unwrap();
        let err = run(&tool(d.path(), 1), "sleep 1000 & echo $! > child.pid; wait")
            .await
            .unwrap_err();
        assert_eq!(err, ToolError::TimedOut(1000));
        let pid = child_pid(d.path());
        assert!(
            exits(pid),
            "the background child of a timed-out command survived"
        );
    }

    #[tokio::test]
    async fn a_finished_command_leaves_nothing_running_and_does_not_wait_for_it() {
        let d = tempfile::tempdir().unwrap();
        // The background child keeps stdout open: waiting for it to close
        // would last until the timeout.
        let out = run(
            &tool(d.path(), 10),
            "sleep 1000 & echo $! > child.pid; echo started",
        )
        .await
        .unwrap();
        assert!(out.content.contains("started"), "{}", out.content);
        let pid = child_pid(d.path());
        assert!(exits(pid), "the command's background child outlived it");
    }

    #[tokio::test]
    async fn cancelling_a_running_command_kills_its_group() {
        let d = tempfile::tempdir().unwrap();
        let ctx = ToolExecutionContext::default();
        let shell = tool(d.path(), 60);
        // The command says it is running by creating a FIFO's writer end
        // only after the background child exists.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            d.path().join("ready"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let running = shell.execute(
            json!({"command": "sleep 1000 & echo $! > child.pid; echo go > ready; wait"}),
            &ctx,
        );
        let ready = tokio::task::spawn_blocking({
            let fifo = d.path().join("ready");
            move || std::fs::read_to_string(fifo).unwrap()
        });
        let cancel = async {
            assert_eq!(ready.await.unwrap(), "go\n");
            ctx.cancellation.cancel();
        };
        let (result, ()) = tokio::join!(running, cancel);
        assert_eq!(result.unwrap_err(), ToolError::Cancelled);
        let pid = child_pid(d.path());
        assert!(
            exits(pid),
            "the background child of a cancelled command survived"
        );
    }
}
