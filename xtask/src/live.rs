//! A live `keel serve` for the checks that drive it from outside
//! (schemathesis, the official OpenAI and AG-UI clients, the MCP
//! conformance suite): the debug binary on an ephemeral loopback port,
//! with a token (or, for clients that cannot send one, none) and a fresh
//! data directory
//! (a copy of a fixture when given). SIGTERM stops it, and must end it with
//! exit 0.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::build_keel;

/// A running `keel serve`.
pub(crate) struct LiveServer {
    child: Child,
    data: PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub(crate) url: String,
    /// The bearer token it requires (empty when it requires none).
    pub(crate) token: String,
}

impl LiveServer {
    fn start(name: &str, fixture: Option<&Path>, token: bool) -> Result<Self, String> {
        let keel = build_keel()?;
        let data = std::env::temp_dir().join(format!("keel-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data);
        if let Some(fixture) = fixture {
            copy_dir(fixture, &data).map_err(|e| {
                format!(
                    "cannot copy {} to {}: {e}",
                    fixture.display(),
                    data.display()
                )
            })?;
        }
        let mut command = Command::new(keel);
        command
            .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .env_remove("KEEL_TOKEN");
        let token = if token {
            let token = format!("ci-{}", std::process::id());
            command.env("KEEL_TOKEN", &token);
            token
        } else {
            String::new()
        };
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start keel serve: {e}"))?;
        let stdout = child.stdout.take().ok_or("keel serve has no stdout")?;
        let mut first = String::new();
        let read = BufReader::new(stdout).read_line(&mut first);
        let addr = first
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .map(str::to_owned);
        let server = Self {
            child,
            data,
            url: String::new(),
            token,
        };
        match (read, addr) {
            (Ok(_), Some(addr)) => Ok(Self {
                url: format!("http://{addr}"),
                ..server
            }),
            (read, _) => {
                let _ = server.stop();
                Err(format!(
                    "keel serve printed no address: {first:?} ({read:?})"
                ))
            }
        }
    }

    /// SIGTERM, then waits: the server shuts down gracefully and exits 0.
    fn stop(mut self) -> Result<(), String> {
        let stopped = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .map_err(|e| format!("cannot signal keel serve: {e}"))
            .and_then(|_| self.child.wait().map_err(|e| format!("keel serve: {e}")));
        let _ = std::fs::remove_dir_all(&self.data);
        match stopped? {
            status if status.success() => Ok(()),
            status => Err(format!("keel serve exited with {status} after SIGTERM")),
        }
    }
}

/// Runs `check` against a live server started on a copy of `fixture` (or
/// an empty data directory), then stops it; both must succeed.
pub(crate) fn with_live_server(
    name: &str,
    fixture: Option<&Path>,
    check: impl FnOnce(&LiveServer) -> Result<(), String>,
) -> Result<(), String> {
    let server = LiveServer::start(name, fixture, true)?;
    let result = check(&server);
    let stopped = server.stop();
    result.and(stopped)
}

/// [`with_live_server`] without a token (loopback only), for clients that
/// cannot send one (the MCP conformance suite).
pub(crate) fn with_open_live_server(
    name: &str,
    check: impl FnOnce(&LiveServer) -> Result<(), String>,
) -> Result<(), String> {
    let server = LiveServer::start(name, None, false)?;
    let result = check(&server);
    let stopped = server.stop();
    result.and(stopped)
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}
