//! One configured server kept alive: a task that holds its session,
//! notices when it ends (the process died, the connection dropped) and
//! connects again with backoff; calls wait for a live session up to their
//! deadline.

use std::path::PathBuf;
use std::time::Duration;

use keel_engine::LandlockPolicy;
use rmcp::service::{Peer, RoleClient};
use tokio::sync::watch;
use tokio::time::Instant;

use super::client::{connect, Connected};
use super::manifest::McpManifest;
use crate::config::McpServerConfig;

/// A session that lasted this long resets the backoff.
const STABLE: Duration = Duration::from_secs(60);
/// The wait before the second attempt in a row; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(2);
/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// The wait before attempt `streak` in a row (0: at once).
fn backoff(streak: u32) -> Duration {
    match streak {
        0 => Duration::ZERO,
        n => FIRST_BACKOFF
            .saturating_mul(1 << (n - 1).min(16))
            .min(MAX_BACKOFF),
    }
}

/// Where a server is: connecting, up, or down until its next attempt.
#[derive(Clone)]
pub(crate) enum State {
    Starting,
    Up(Peer<RoleClient>),
    Down { retry_at: Instant },
}

/// A server's state as `keel mcp list` and `GET /api/mcp` report it.
#[derive(Clone)]
struct Status {
    state: State,
    /// Sessions started after the first (restarts and reconnections).
    restarts: u64,
    /// Why the last attempt or session ended, for the operator.
    reason: Option<String>,
}

impl Status {
    fn report(&self) -> StatusReport {
        StatusReport {
            state: match self.state {
                State::Starting => "starting",
                State::Up(_) => "up",
                State::Down { .. } => "unavailable",
            },
            restarts: self.restarts,
            reason: self.reason.clone(),
        }
    }
}

/// What a status report says of one server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusReport {
    /// `up`, `starting` or `unavailable`.
    pub state: &'static str,
    /// Sessions started after the first one.
    pub restarts: u64,
    /// Why it last stopped or failed to start (operator detail).
    pub reason: Option<String>,
}

/// How to start or reach one server again.
pub(crate) struct Target {
    pub name: String,
    pub config: McpServerConfig,
    pub workspace: PathBuf,
    pub policy: LandlockPolicy,
    /// The tools in force (from activation), to log what a restart changed.
    pub manifest: Option<McpManifest>,
}

/// One configured server as its tools see it: its supervisor's state.
pub struct ServerConnection {
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    pub(crate) max_output_bytes: usize,
    status: watch::Receiver<Status>,
}

impl ServerConnection {
    /// Supervises `target`, starting from `first` (activation's attempt:
    /// a session, or why there is none).
    pub(crate) fn spawn(target: Target, first: Result<Connected, String>) -> Self {
        let (state, reason, streak) = match &first {
            Ok(c) => (State::Up(c.service.peer().clone()), None, 0),
            Err(reason) => (
                State::Down {
                    retry_at: Instant::now() + backoff(1),
                },
                Some(reason.clone()),
                1,
            ),
        };
        let (tx, rx) = watch::channel(Status {
            state,
            restarts: 0,
            reason,
        });
        let connection = Self {
            name: target.name.clone(),
            timeout: Duration::from_secs(target.config.timeout_secs),
            max_output_bytes: target.config.max_output_bytes,
            status: rx,
        };
        tokio::spawn(supervise(target, tx, first.ok(), streak));
        connection
    }

    /// The server's name (`[mcp.NAME]`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's state now.
    pub fn status(&self) -> StatusReport {
        self.status.borrow().report()
    }

    /// Waits until the server's state satisfies `pred` (returns at once
    /// should its supervisor have stopped).
    pub async fn wait_for(&self, pred: impl Fn(&StatusReport) -> bool) {
        let mut rx = self.status.clone();
        // An error is a stopped supervisor: nothing more will change.
        let _stopped = rx.wait_for(|s| pred(&s.report())).await;
    }

    /// The names of the tools the server lists now (bounded by its
    /// timeout); `None` when it is not up or does not answer (logged).
    pub(crate) async fn list_now(&self) -> Option<std::collections::BTreeSet<String>> {
        let peer = match &self.status.borrow().state {
            State::Up(peer) if !peer.is_transport_closed() => peer.clone(),
            _ => return None,
        };
        match tokio::time::timeout(self.timeout, peer.list_all_tools()).await {
            Ok(Ok(tools)) => Some(tools.into_iter().map(|t| t.name.to_string()).collect()),
            Ok(Err(e)) => {
                tracing::warn!(server = %self.name, error = %e, "MCP server did not list its tools");
                None
            }
            Err(_) => {
                tracing::warn!(server = %self.name, "MCP server did not list its tools within its timeout");
                None
            }
        }
    }

    /// A live session, waiting for a restart that is under way or due
    /// before `deadline`; else the state that ended the wait (a `Down`
    /// whose next attempt comes after `deadline`, with its reason).
    pub(crate) async fn session(&self, deadline: Instant) -> Result<Peer<RoleClient>, Unavailable> {
        let mut rx = self.status.clone();
        let status = rx
            .wait_for(|s| match &s.state {
                State::Up(peer) => !peer.is_transport_closed(),
                State::Down { retry_at } => *retry_at > deadline,
                State::Starting => false,
            })
            .await;
        let Ok(status) = status else {
            return Err(Unavailable {
                retry_in: None,
                reason: "its supervisor stopped".to_owned(),
            });
        };
        match &status.state {
            State::Up(peer) => Ok(peer.clone()),
            State::Down { retry_at } => Err(Unavailable {
                retry_in: Some(retry_at.saturating_duration_since(Instant::now())),
                reason: status.reason.clone().unwrap_or_default(),
            }),
            State::Starting => unreachable!("wait_for returned a state it does not accept"),
        }
    }
}

/// Why no session is to be had before a call's deadline.
pub(crate) struct Unavailable {
    /// When the supervisor tries again (`None`: it does not).
    pub retry_in: Option<Duration>,
    /// The operator detail (for the log).
    pub reason: String,
}

/// Holds `target`'s session while it lasts, then connects again after
/// [`backoff`]; ends when the last [`ServerConnection`] is dropped (which
/// drops the session: the child process is killed).
async fn supervise(
    target: Target,
    tx: watch::Sender<Status>,
    mut session: Option<Connected>,
    mut streak: u32,
) {
    let name = &target.name;
    loop {
        if let Some(connected) = session.take() {
            let started = Instant::now();
            let Connected { service, _tmp, .. } = connected;
            let ended = tokio::select! {
                ended = service.waiting() => ended,
                () = tx.closed() => return,
            };
            drop(_tmp);
            let reason = match ended {
                Ok(reason) => format!("its session ended ({reason:?})"),
                Err(e) => format!("its session task failed: {e}"),
            };
            if started.elapsed() >= STABLE {
                streak = 0;
            }
            tracing::warn!(server = %name, "MCP server {name} stopped: {reason}; restarting");
            tx.send_modify(|s| s.reason = Some(reason));
        }
        let delay = backoff(streak);
        if !delay.is_zero() {
            let retry_at = Instant::now() + delay;
            tx.send_modify(|s| s.state = State::Down { retry_at });
            tokio::select! {
                () = tokio::time::sleep_until(retry_at) => {}
                () = tx.closed() => return,
            }
        }
        tx.send_modify(|s| s.state = State::Starting);
        streak = streak.saturating_add(1);
        let attempt = tokio::select! {
            attempt = connect(name, &target.config, &target.workspace, target.policy.clone()) => attempt,
            () = tx.closed() => return,
        };
        match attempt {
            Ok((connected, manifest)) => {
                match &target.manifest {
                    Some(in_force) if *in_force != manifest => {
                        manifest.log_changes_from(in_force, name);
                        tracing::warn!(
                            server = %name,
                            "MCP server {name} lists other tools than at start-up; \
                             keel offers those of start-up until it restarts"
                        );
                    }
                    _ => {}
                }
                tracing::info!(server = %name, "MCP server {name} is up again");
                tx.send_modify(|s| {
                    s.state = State::Up(connected.service.peer().clone());
                    s.restarts += 1;
                });
                session = Some(connected);
            }
            Err(reason) => {
                tracing::warn!(server = %name, "MCP server {name} could not be restarted: {reason}");
                tx.send_modify(|s| s.reason = Some(reason));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_starts_at_once_doubles_and_is_capped() {
        let secs: Vec<u64> = (0..9).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [0, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }
}
