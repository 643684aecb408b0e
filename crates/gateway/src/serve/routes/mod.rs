//! The router of `keel serve` and what its handlers share: id, cursor and
//! limit parsing, the dialog lookup, the input checks.
//!
//! - `dialogs`: dialogs, messages, sending, stop, checkpoints;
//! - `exports`: a dialog's export and import as portable JSON;
//! - `runs`: sub-agent runs and their events;
//! - `system`: health, readiness, the OpenAPI document, catalog reload;
//! - `mcp_servers`: the MCP servers keel is a client of;
//! - `webhooks`: the webhook outbox, and the check of a send's `webhook`.
//!
//! The web page (`/` and `/assets/…`, see `web`) is outside `/api` and
//! needs no token: it asks the user for one when the API answers 401.

pub(crate) mod approvals;
pub(crate) mod dialogs;
pub(crate) mod exports;
pub(crate) mod mcp_servers;
pub(crate) mod runs;
pub(crate) mod system;
pub(crate) mod webhooks;

use std::str::FromStr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use keel_core::SessionId;
use keel_store::SessionRecord;

use super::api::{DEFAULT_PAGE, MAX_PAGE, MAX_TEXT_CHARS};
use super::problem::{ApiError, ApiResult};
use super::Shared;

/// Every route, each answering only requests meant for this server (see
/// `origin`); `/api`, `/mcp` and `/metrics` behind the bearer token when one is
/// configured, but for the probes `/api/health` and `/api/ready`.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let api = Router::new()
        .route("/openapi.json", get(system::openapi))
        .route("/admin/reload", post(system::reload))
        .route("/mcp", get(mcp_servers::list))
        .route("/dialogs", get(dialogs::list).post(dialogs::create))
        .route(
            "/dialogs/import",
            // An export holds a whole history: its own limit, the one
            // `keel import` reads a file with.
            post(exports::import)
                .layer(DefaultBodyLimit::max(keel_engine::MAX_DIALOG_EXPORT_BYTES)),
        )
        .route("/dialogs/{id}/export", get(exports::export))
        .route(
            "/dialogs/{id}",
            get(dialogs::get_one)
                .patch(dialogs::update)
                .delete(dialogs::delete),
        )
        .route(
            "/dialogs/{id}/messages",
            get(dialogs::messages).post(dialogs::send),
        )
        .route("/dialogs/{id}/stream", get(super::sse::stream))
        .route("/dialogs/{id}/stop", post(dialogs::stop))
        .route("/dialogs/{id}/steer", post(dialogs::steer))
        .route("/dialogs/{id}/usage", get(dialogs::usage))
        .route("/images/{sha256}", get(super::images::get_image))
        .route("/dialogs/{id}/agent-events", get(runs::dialog_events))
        .route("/dialogs/{id}/inbox", get(runs::dialog_inbox))
        .route("/dialogs/{id}/approvals", get(approvals::list))
        .route("/approvals/{id}", post(approvals::decide))
        .route("/dialogs/{id}/checkpoints", get(dialogs::checkpoints))
        .route(
            "/dialogs/{id}/checkpoints/{checkpoint_id}/rollback",
            post(dialogs::rollback),
        )
        .route(
            "/dialogs/{id}/checkpoints/{checkpoint_id}/fork",
            post(dialogs::fork),
        )
        .route("/agent-runs", get(runs::list))
        .route("/agent-runs/{id}", get(runs::get_one))
        .route("/agent-runs/{id}/events", get(runs::events))
        .route("/agent-runs/{id}/cancel", post(runs::cancel))
        .route("/agent-runs/{id}/trace", get(runs::trace))
        .route("/dialogs/{id}/turns/{turn_id}/trace", get(runs::turn_trace))
        .route("/webhooks/deliveries", get(webhooks::list))
        .route("/ws", get(super::ws::upgrade))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            super::auth::require_token,
        ))
        // Added after the token layer, so outside it: load balancers and
        // orchestrators probe these without credentials, and they reveal
        // nothing but liveness and readiness.
        .route("/health", get(system::health))
        .route("/ready", get(system::ready));
    // Prometheus scrapes, behind the token like `/api`.
    let metrics = Router::new().route("/metrics", get(system::metrics)).layer(
        axum::middleware::from_fn_with_state(shared.clone(), super::auth::require_token),
    );
    // MCP's Streamable HTTP (keel as an MCP server), behind the token like `/api`.
    let mcp = Router::new()
        .route_service("/mcp", super::interop::mcp::service(shared.clone()))
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            super::auth::require_token,
        ));
    Router::new()
        .route("/", get(super::web::index))
        .route("/assets/{build}/{*path}", get(super::web::asset))
        .nest("/api", api)
        .merge(metrics)
        .merge(mcp)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            super::origin::require_own_origin,
        ))
        // These check Host and Origin themselves, to refuse in their
        // protocol's own error shape.
        .nest("/v1", super::interop::openai::router(shared.clone()))
        .nest("/ag-ui", super::interop::agui::router(shared.clone()))
        .layer(DefaultBodyLimit::max(shared.limits.max_body_bytes))
        .with_state(shared)
}

async fn not_found(axum::extract::OriginalUri(uri): axum::extract::OriginalUri) -> ApiError {
    ApiError::NotFound(format!("no route {}", uri.path()))
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Parses a path or query id (a UUID), naming `what` it should be.
pub(crate) fn parse_id<T: FromStr>(what: &str, text: &str) -> ApiResult<T> {
    text.parse()
        .map_err(|_| ApiError::BadRequest(format!("{text:?} is not a {what} id (a UUID)")))
}

/// The page size `limit` asks for: 1..=[`MAX_PAGE`], [`DEFAULT_PAGE`] when absent.
pub(crate) fn page_limit(limit: Option<usize>) -> ApiResult<usize> {
    match limit {
        None => Ok(DEFAULT_PAGE),
        Some(n) if (1..=MAX_PAGE).contains(&n) => Ok(n),
        Some(n) => Err(ApiError::BadRequest(format!(
            "limit {n} is outside 1..={MAX_PAGE}"
        ))),
    }
}

/// A cursor of a listing ordered by (created_at, id): `<ms>_<uuid>`.
pub(crate) fn encode_cursor(created_at_ms: i64, id: impl std::fmt::Display) -> String {
    format!("{created_at_ms}_{id}")
}

/// The (created_at, id) of a cursor made by [`encode_cursor`].
pub(crate) fn decode_cursor<T: FromStr>(cursor: &str) -> ApiResult<(i64, T)> {
    let bad = || ApiError::BadRequest(format!("cursor {cursor:?} is not one this server gave"));
    let (at, id) = cursor.split_once('_').ok_or_else(bad)?;
    Ok((
        at.parse().map_err(|_| bad())?,
        id.parse().map_err(|_| bad())?,
    ))
}

/// A message text: 1..=[`MAX_TEXT_CHARS`] characters.
pub(crate) fn checked_text(text: String) -> ApiResult<String> {
    if text.is_empty() {
        return Err(ApiError::BadRequest("text is empty".to_owned()));
    }
    let chars = text.chars().count();
    if chars > MAX_TEXT_CHARS {
        return Err(ApiError::BadRequest(format!(
            "text has {chars} characters; at most {MAX_TEXT_CHARS} are accepted"
        )));
    }
    Ok(text)
}

impl Shared {
    /// The dialog `id` names; a deleted one is not found.
    pub(crate) async fn dialog(&self, id: &str) -> ApiResult<SessionRecord> {
        let session: SessionId = parse_id("dialog", id)?;
        self.dialog_by_id(session).await
    }

    /// `session`, a dialog to send to: one the engine holds in memory is
    /// taken as live without reading the database (a dialog deleted
    /// meanwhile elsewhere refuses the message when it is queued, not
    /// found all the same); any other is read ([`Self::dialog_by_id`]).
    pub(crate) async fn live_dialog(&self, session: SessionId) -> ApiResult<SessionId> {
        if self.app.manager.holds(session) {
            return Ok(session);
        }
        Ok(self.dialog_by_id(session).await?.id)
    }

    /// The dialog with session id `session`; a deleted one is not found.
    pub(crate) async fn dialog_by_id(&self, session: SessionId) -> ApiResult<SessionRecord> {
        self.app
            .store
            .get_session(session)
            .await?
            .filter(|r| r.deleted_at_ms.is_none())
            .ok_or_else(|| ApiError::NotFound(format!("dialog {session} not found")))
    }
}
