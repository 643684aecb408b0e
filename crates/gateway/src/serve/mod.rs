//! `keel serve`: the HTTP and WebSocket API on the same [`App`] as `keel
//! chat`. docs/PROTOCOL.md is the client's guide; `/api/openapi.json` the
//! generated contract.
//!
//! - `connections` accepts and serves connections (HTTP/1.1 and h2c) under
//!   a connection bound and header, body and idle timeouts;
//! - `api` and `frames` are the wire types (REST bodies; WebSocket and SSE
//!   frames), converted from engine and store types by hand;
//! - `routes` maps requests to the engine; `problem` turns every failure
//!   into `application/problem+json`; `origin` refuses requests meant
//!   for another site (`Host`, `Origin`); `auth` checks the bearer token;
//! - `turns` runs the turns clients start, apart from their connections;
//!   `hub` fans a dialog's frames out to its subscribers with bounded
//!   buffers; `projection` publishes sub-agent changes in revision order;
//! - `ws` and `sse` are the two streaming transports;
//! - `interop` speaks the ecosystem's protocols (OpenAI chat completions
//!   under `/v1`, AG-UI under `/ag-ui`, MCP under `/mcp`) over the same turns;
//! - `web` serves the web page at `/`, its files compiled into the binary.
//!
//! Shutdown: stop accepting connections, refuse new turns, let running
//! turns finish for the grace period, cancel the rest (a cancelled turn
//! commits nothing of its answer; the user's message stays, unanswered),
//! then close WebSockets with "going away".

pub mod api;
mod auth;
mod connections;
pub mod frames;
mod hub;
pub mod images;
pub mod interop;
mod openapi;
mod origin;
pub mod problem;
mod projection;
mod relay;
mod routes;
mod sse;
pub mod trace;
mod turns;
pub mod web;
pub mod webhooks;
mod ws;

use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::app::App;
use crate::config::{AllowedOrigin, ConfigError, LoadedConfig};
use crate::{io_err, AppError};

pub use auth::Token;
pub use connections::ConnectionLimits;
pub use openapi::openapi_json;
pub use turns::DrainReport;

use api::ReloadReport;
use hub::Hub;
pub use hub::ReplayLimits;
use problem::{ApiError, ApiResult};
use projection::{Projections, RunRefresher};
use turns::TurnRunner;

/// Sizes a client controls, and the buffers that bound what a slow client costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Largest WebSocket message, in bytes.
    pub max_frame_bytes: usize,
    /// Frames kept per watched dialog for subscribers that read slowly.
    pub hub_capacity: usize,
    /// Frames queued per WebSocket connection before its subscriptions wait.
    pub connection_queue: usize,
    /// Largest image of a message, in bytes (decoded): `server.image_max_bytes`.
    pub image_max_bytes: usize,
    /// Most images of one message: `server.images_per_message`.
    pub images_per_message: usize,
}

impl Limits {
    /// Limits whose bodies and frames also fit `images_per_message` images
    /// of `image_max_bytes` each, base64-encoded.
    pub fn with_images(image_max_bytes: usize, images_per_message: usize) -> Self {
        let base = Self::default();
        let images = image_max_bytes
            .div_ceil(3)
            .saturating_mul(4)
            .saturating_add(1024)
            .saturating_mul(images_per_message);
        Self {
            max_body_bytes: base.max_body_bytes.saturating_add(images),
            max_frame_bytes: base.max_frame_bytes.saturating_add(images),
            image_max_bytes,
            images_per_message,
            ..base
        }
    }
}

impl Default for Limits {
    /// Bodies and frames that fit the longest text even fully JSON-escaped
    /// (about 1.2 MiB), 1024 frames per dialog, 64 per connection.
    fn default() -> Self {
        // A character escaped as a surrogate pair (`\ud83d\ude00`) is 12
        // bytes: a text at the limit must never be refused as too large.
        let longest_text = api::MAX_TEXT_CHARS * 12 + 64 * 1024;
        Self {
            max_body_bytes: longest_text,
            max_frame_bytes: longest_text,
            hub_capacity: 1024,
            connection_queue: 64,
            image_max_bytes: crate::config::DEFAULT_IMAGE_MAX_BYTES as usize,
            images_per_message: crate::config::DEFAULT_IMAGES_PER_MESSAGE as usize,
        }
    }
}

/// How `keel serve` listens.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address to listen on.
    pub bind: SocketAddr,
    /// The bearer token every `/api` request must present; `None`: no auth.
    pub token: Option<Token>,
    /// Origins whose pages may use the server besides its own (and whose
    /// hosts it answers to).
    pub allowed_origins: Vec<AllowedOrigin>,
    /// How long a shutdown waits for running turns before cancelling them.
    pub shutdown_grace: Duration,
    /// Size limits and buffers.
    pub limits: Limits,
    /// Bounds on connections and on how long a request may take to arrive.
    pub connections: ConnectionLimits,
    /// How long and how much of each dialog's turn frames are kept for
    /// clients that reconnect.
    pub replay: ReplayLimits,
    /// Where and how committed turns are delivered as webhooks.
    pub webhooks: webhooks::WebhookOptions,
}

impl ServeOptions {
    /// Options from `[server]` of `config`, `bind` (`--bind`) taking
    /// precedence, and the token from the environment variable
    /// `server.token_env` names (read through `env`). A non-loopback
    /// address without a token is refused.
    pub fn from_config(
        config: &LoadedConfig,
        bind: Option<SocketAddr>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let server = &config.config.server;
        let (addr, key) = match bind {
            Some(addr) => (addr, "--bind"),
            None => (server.bind, "server.bind"),
        };
        let token = env(&server.token_env).and_then(|t| Token::new(&t));
        if token.is_none() && !addr.ip().is_loopback() {
            return Err(ConfigError::single(
                config.source_label(),
                key,
                format!(
                    "{addr} is not a loopback address and no token is set: anyone who can reach it \
                     could use the API. Set the environment variable {} (server.token_env) to a \
                     secret, or bind 127.0.0.1",
                    server.token_env
                ),
            ));
        }
        let secret = env(&server.webhook_secret_env).filter(|s| !s.is_empty());
        if secret.is_none() && !server.webhook_urls.is_empty() {
            return Err(ConfigError::single(
                config.source_label(),
                "server.webhook_urls",
                format!(
                    "webhooks are configured but the environment variable {} \
                     (server.webhook_secret_env) that signs them is unset: set it to a secret \
                     the receivers share",
                    server.webhook_secret_env
                ),
            ));
        }
        Ok(Self {
            webhooks: webhooks::WebhookOptions {
                urls: server.webhook_urls.clone(),
                secret: secret.as_deref().map(webhooks::secret_key),
                secret_env: server.webhook_secret_env.clone(),
                max_attempts: server.webhook_max_attempts,
                retry_base: Duration::from_millis(server.webhook_retry_base_ms),
            },
            bind: addr,
            token,
            allowed_origins: server.allowed_origins.clone(),
            shutdown_grace: Duration::from_secs(server.shutdown_grace_secs),
            limits: Limits::with_images(
                usize::try_from(server.image_max_bytes).unwrap_or(usize::MAX),
                usize::try_from(server.images_per_message).unwrap_or(usize::MAX),
            ),
            connections: ConnectionLimits {
                max_connections: server
                    .max_connections
                    .unwrap_or_else(|| fd_limit::connections_within(fd_limit::current())),
                header_timeout: Duration::from_secs(server.header_timeout_secs),
                body_timeout: Duration::from_secs(server.body_timeout_secs),
                idle_timeout: Duration::from_secs(server.idle_timeout_secs),
            },
            replay: ReplayLimits {
                window: Duration::from_secs(server.stream_replay_secs),
                max_bytes: usize::try_from(server.stream_replay_bytes).unwrap_or(usize::MAX),
            },
        })
    }
}

/// What every request handler reaches: the app and the server's machinery.
pub(crate) struct Shared {
    app: App,
    token: Option<Token>,
    allowed_origins: Vec<AllowedOrigin>,
    limits: Limits,
    hub: Arc<Hub>,
    projections: Arc<Projections>,
    turns: Arc<TurnRunner>,
    /// Conversations of the OpenAI and AG-UI endpoints.
    conversations: interop::Conversations,
    /// Open sessions of `/mcp`.
    mcp_sessions: interop::mcp::Sessions,
    /// Cancelled once running turns are drained: WebSockets close, streams end.
    closing: CancellationToken,
    /// WebSocket connections, which a shutdown waits for.
    sockets: TaskTracker,
    /// How long a WebSocket may send nothing, not even a pong, before it is closed.
    socket_idle: std::time::Duration,
    /// The webhook settings (a send's `webhook` is checked against them).
    webhooks: webhooks::WebhookOptions,
    /// The address the server listens on (no webhook may aim at it).
    addr: SocketAddr,
}

impl Shared {
    /// A `resync` of `session` at its current revision, saying `reason`.
    async fn resync(&self, session: keel_core::SessionId, reason: &str) -> frames::ServerFrame {
        let revision = match self.app.store.inbox_usage(session).await {
            Ok(usage) => usage.revision,
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "cannot read the revision of a resync");
                0
            }
        };
        frames::ServerFrame::Resync {
            session_id: session.as_uuid(),
            revision,
            reason: reason.to_owned(),
        }
    }

    /// Rebuilds the agent catalog from its directory; on any error the
    /// catalog in force stays and the error lists every problem.
    async fn reload(&self) -> ApiResult<ReloadReport> {
        let Some((handle, inputs)) = self.app.catalog.clone() else {
            return Err(ApiError::Conflict(
                "keel started without agent definitions; there is no catalog to reload".to_owned(),
            ));
        };
        // A tool gone from a server's manifest fails the definitions naming it.
        let mut inputs = inputs;
        crate::mcp::narrow_to_listed(&self.app.mcp, &mut inputs.mcp).await;
        let reloading = handle.clone();
        let outcome = tokio::task::spawn_blocking(move || reloading.reload(&inputs))
            .await
            .map_err(|e| ApiError::internal(&e))?;
        match outcome {
            Ok(_) => {
                // The catalog just put in force (a reload after this one
                // reports its own).
                let catalog = handle.current();
                self.mcp_sessions.tools_changed();
                Ok(ReloadReport {
                    generation: catalog.generation(),
                    agents: catalog.ids().map(|id| id.as_str().to_owned()).collect(),
                    warnings: catalog.warnings().iter().map(|w| w.to_string()).collect(),
                })
            }
            Err(diagnostics) => Err(ApiError::Unprocessable {
                detail: format!(
                    "the agent definitions in {} have {} problem(s); generation {} stays in force",
                    handle.root().display(),
                    diagnostics.len(),
                    handle.current().generation()
                ),
                errors: diagnostics
                    .as_slice()
                    .iter()
                    .map(|d| d.to_string())
                    .collect(),
            }),
        }
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    grace: Duration,
    stop_accepting: CancellationToken,
    task: JoinHandle<()>,
    /// Stops the webhook worker (after the turns drained, so their
    /// deliveries are attempted; what is left is sent by the next start).
    webhooks_stop: CancellationToken,
    webhook_task: Option<JoinHandle<()>>,
    /// Renews this process's registration on a shared database and takes
    /// over stopped processes' work (see [`App::spawn_keeper`]).
    keeper: Option<JoinHandle<()>>,
    /// Says why, should this process be taken over by another.
    fenced: parking_lot::Mutex<Option<tokio::sync::oneshot::Receiver<crate::app::Fenced>>>,
    /// Frames to and from the other processes on a shared database.
    relaying: Option<relay::Relaying>,
}

impl Server {
    /// Binds `options.bind` and starts serving `app`.
    pub async fn start(app: App, options: ServeOptions) -> Result<Server, AppError> {
        let listener = TcpListener::bind(options.bind)
            .await
            .map_err(io_err(format!("cannot listen on {}", options.bind)))?;
        let addr = listener
            .local_addr()
            .map_err(io_err("cannot read the listening address"))?;
        let hub = Arc::new(Hub::new(options.limits.hub_capacity, options.replay));
        let projections = Arc::new(Projections::new(app.store.clone(), hub.clone()));
        if let Some(coordinator) = &app.coordinator {
            coordinator.set_observer(Arc::new(RunRefresher {
                projections: projections.clone(),
                store: app.store.clone(),
            }));
        }
        let turns = Arc::new(TurnRunner::new(
            app.manager.clone(),
            hub.clone(),
            projections.clone(),
        ));
        // Before any turn can start, so none of its frames is missed.
        let relaying = app
            .store
            .relay()
            .map(|r| relay::start(r, hub.clone(), projections.clone(), turns.clone()));
        let shared = Arc::new(Shared {
            app,
            token: options.token,
            allowed_origins: options.allowed_origins,
            limits: options.limits,
            hub,
            projections,
            turns,
            conversations: interop::Conversations::new(),
            mcp_sessions: interop::mcp::Sessions::default(),
            closing: CancellationToken::new(),
            sockets: TaskTracker::new(),
            socket_idle: options.connections.idle_timeout,
            webhooks: options.webhooks.clone(),
            addr,
        });
        // Committed turns are delivered to the server-wide URLs; rows an
        // earlier process left are picked up at once.
        shared
            .app
            .store
            .set_webhook_urls(options.webhooks.urls.clone());
        let webhooks_stop = CancellationToken::new();
        let webhook_task = webhooks::Worker::new(shared.app.store.clone(), options.webhooks)
            .map(|worker| tokio::spawn(worker.run(webhooks_stop.clone())));
        let stop_accepting = CancellationToken::new();
        let task = tokio::spawn(connections::serve(
            listener,
            routes::router(shared.clone()),
            options.connections,
            stop_accepting.clone(),
        ));
        // Serving now: results an earlier process left are delivered.
        // Resumed turns have no connection to publish them: the dialog's
        // forwarder does.
        let turns = shared.turns.clone();
        shared
            .app
            .deliver_recovered(|_, turn| turns.adopt(turn))
            .await?;
        let (fenced_tx, fenced) = tokio::sync::oneshot::channel();
        let (turns, hub) = (shared.turns.clone(), shared.hub.clone());
        let keeper = shared.app.spawn_keeper(
            move |taken| match taken {
                crate::app::Takeover::Turn(_, turn) => turns.adopt(turn),
                crate::app::Takeover::Done => relay::took_over(&hub, &turns),
            },
            fenced_tx,
        );
        Ok(Server {
            addr,
            shared,
            grace: options.shutdown_grace,
            stop_accepting,
            task,
            webhooks_stop,
            webhook_task,
            keeper,
            fenced: parking_lot::Mutex::new(Some(fenced)),
            relaying,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Resolves, with the reason, once another process has taken this one
    /// over (a shared database, after this one could not renew in time);
    /// never on SQLite. The server should then stop: it can write nothing.
    pub async fn taken_over(&self) -> crate::app::Fenced {
        let receiver = self.fenced.lock().take();
        match receiver {
            Some(receiver) => match receiver.await {
                Ok(fenced) => fenced,
                Err(_) => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    }

    /// Reloads the agent catalog (what `POST /api/admin/reload` and SIGHUP do).
    pub async fn reload(&self) -> Result<ReloadReport, ApiError> {
        self.shared.reload().await
    }

    /// Starts a shutdown: no new connections, no new turns; running turns
    /// go on. [`Server::shutdown`] completes it.
    pub fn begin_shutdown(&self) {
        self.stop_accepting.cancel();
        self.shared.turns.refuse_new();
    }

    /// Stops accepting, drains running turns (see the module docs), closes
    /// every connection and stops the coordinator.
    pub async fn shutdown(self) -> DrainReport {
        self.begin_shutdown();
        let report = self.shared.turns.drain(self.grace).await;
        self.shared.closing.cancel();
        self.shared.sockets.close();
        self.shared.sockets.wait().await;
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "the server task failed");
        }
        if let Some(keeper) = &self.keeper {
            keeper.abort();
        }
        // Every turn here ended: their last frames go out before the relay stops.
        if let Some(relaying) = self.relaying {
            relaying.stop().await;
        }
        self.webhooks_stop.cancel();
        if let Some(task) = self.webhook_task {
            if let Err(e) = task.await {
                tracing::warn!(error = %e, "the webhook worker failed");
            }
        }
        // Leases kept a moment after their turns go back to the database
        // now, so another process need not wait for them.
        self.shared.app.manager.give_back_leases().await;
        self.shared.app.manager.shutdown();
        if let Some(coordinator) = &self.shared.app.coordinator {
            coordinator.shutdown();
        }
        report
    }
}

/// `keel serve`: serves until SIGTERM or Ctrl-C; SIGHUP reloads the agent catalog.
pub async fn run(
    config: Option<&Path>,
    data_dir: Option<&Path>,
    bind: Option<SocketAddr>,
) -> Result<ExitCode, AppError> {
    // Before the options: the default connection bound derives from it.
    fd_limit::raise();
    // Before the store opens, so its first commits are measured too.
    let metrics_upkeep = CancellationToken::new();
    crate::metrics::start(metrics_upkeep.clone());
    // The trace exporter's drops (zero while `[telemetry]` exports nothing).
    crate::metrics::register_dropped_spans(crate::telemetry::dropped_spans);
    let _stop_upkeep = metrics_upkeep.drop_guard();
    let app = App::open(crate::app::SERVE_COMMAND, config, data_dir, None).await?;
    for notice in &app.notices {
        eprintln!("{notice}");
    }
    let options = ServeOptions::from_config(&app.config, bind, &|var| std::env::var(var).ok())?;
    let auth = if options.token.is_some() {
        "bearer token required"
    } else {
        "no token: loopback only"
    };
    let grace = options.shutdown_grace;
    let server = Server::start(app, options).await?;
    // The handlers go in before the line that says we are up: a SIGHUP or
    // SIGTERM sent right after it must reload or stop, not kill by default.
    let stop = signals::Signals::listen()?;
    println!(
        "keel serve: listening on http://{}/ ({auth}; API under /api, contract at /api/openapi.json)",
        server.addr()
    );
    let taken_over = tokio::select! {
        stopped = stop.serve_until_stopped(&server) => {
            stopped?;
            None
        }
        fenced = server.taken_over() => Some(fenced),
    };
    if let Some(crate::app::Fenced(why)) = &taken_over {
        eprintln!("keel serve: stopping: {why}");
    }
    eprintln!(
        "keel serve: shutting down; running turns get {} s to finish",
        grace.as_secs()
    );
    let report = server.shutdown().await;
    eprintln!(
        "keel serve: stopped ({} turn(s) finished, {} cancelled and not saved)",
        report.finished, report.cancelled
    );
    Ok(if taken_over.is_some() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

mod fd_limit {
    //! The open-file limit, which bounds the connections `keel serve` can hold.

    /// Files kept for everything but connections: the database and its WAL,
    /// provider and MCP connections, tool processes, log files.
    const RESERVED: u64 = 128;
    /// Most connections derived from the limit, however high it is.
    const MAX_DERIVED: u64 = 16_384;

    /// The connection bound that leaves room below an open-file limit of
    /// `limit` (an eighth of it and [`RESERVED`] files), at least 16.
    pub(super) fn connections_within(limit: u64) -> usize {
        let bound = limit
            .saturating_sub(RESERVED + limit / 8)
            .clamp(16, MAX_DERIVED);
        usize::try_from(bound).unwrap_or(16)
    }

    /// The soft open-file limit (1024, the common default, where it cannot be read).
    #[cfg(unix)]
    pub(super) fn current() -> u64 {
        rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX)
    }

    /// The soft open-file limit (1024, the common default, where it cannot be read).
    #[cfg(not(unix))]
    pub(super) fn current() -> u64 {
        1024
    }

    /// Raises the soft open-file limit to the hard one, as servers do: the
    /// soft default (often 1024) is far below what the system allows.
    #[cfg(unix)]
    pub(super) fn raise() {
        use rustix::process::{getrlimit, setrlimit, Resource};
        let mut limit = getrlimit(Resource::Nofile);
        if limit.current == limit.maximum {
            return;
        }
        let from = limit.current;
        limit.current = limit.maximum;
        // macOS refuses an unlimited soft limit: the bound then derives from the old one.
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(error = %e, from = ?from, "cannot raise the open-file limit");
        }
    }

    /// Nothing to raise outside unix.
    #[cfg(not(unix))]
    pub(super) fn raise() {}

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_derived_bound_leaves_room_below_the_limit() {
            assert_eq!(super::connections_within(1024), 768);
            assert_eq!(super::connections_within(256), 96);
            assert_eq!(super::connections_within(100), 16);
            assert_eq!(super::connections_within(1 << 20), 16_384);
            assert_eq!(super::connections_within(u64::MAX), 16_384);
        }
    }
}

mod signals {
    //! The signals `keel serve` acts on.

    use super::*;

    /// The signal handlers of `keel serve`, installed before it announces itself.
    #[cfg(unix)]
    pub(super) struct Signals {
        term: tokio::signal::unix::Signal,
        int: tokio::signal::unix::Signal,
        hup: tokio::signal::unix::Signal,
    }

    #[cfg(unix)]
    impl Signals {
        /// Installs the handlers for SIGTERM, SIGINT and SIGHUP.
        pub(super) fn listen() -> Result<Self, AppError> {
            use tokio::signal::unix::{signal, SignalKind};
            let listen = |kind: SignalKind, what: &str| {
                signal(kind).map_err(io_err(format!("cannot listen for {what}")))
            };
            Ok(Self {
                term: listen(SignalKind::terminate(), "SIGTERM")?,
                int: listen(SignalKind::interrupt(), "SIGINT")?,
                hup: listen(SignalKind::hangup(), "SIGHUP")?,
            })
        }

        /// Waits for SIGTERM or SIGINT, reloading the catalog on each SIGHUP.
        pub(super) async fn serve_until_stopped(mut self, server: &Server) -> Result<(), AppError> {
            loop {
                tokio::select! {
                    _ = self.term.recv() => return Ok(()),
                    _ = self.int.recv() => return Ok(()),
                    _ = self.hup.recv() => match server.reload().await {
                        Ok(r) => {
                            eprintln!(
                                "keel serve: agent catalog reloaded (generation {}, {} agent(s))",
                                r.generation,
                                r.agents.len()
                            );
                            for w in r.warnings {
                                eprintln!("  warning: {w}");
                            }
                        }
                        Err(ApiError::Unprocessable { detail, errors }) => {
                            eprintln!("keel serve: reload refused: {detail}");
                            for e in errors {
                                eprintln!("  {e}");
                            }
                        }
                        Err(e) => eprintln!("keel serve: reload refused: {e}"),
                    },
                }
            }
        }
    }

    /// Ctrl-C, the one stop signal outside unix.
    #[cfg(not(unix))]
    pub(super) struct Signals;

    #[cfg(not(unix))]
    impl Signals {
        /// Nothing to install ahead: Ctrl-C is listened for while serving.
        pub(super) fn listen() -> Result<Self, AppError> {
            Ok(Self)
        }

        /// Waits for Ctrl-C.
        pub(super) async fn serve_until_stopped(self, _server: &Server) -> Result<(), AppError> {
            tokio::signal::ctrl_c()
                .await
                .map_err(io_err("cannot listen for Ctrl-C"))
        }
    }
}
