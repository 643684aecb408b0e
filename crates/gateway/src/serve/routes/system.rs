//! The server itself: liveness, readiness, the OpenAPI document, catalog
//! reload.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;

use crate::serve::api::{Health, Ready, ReloadReport};
use crate::serve::openapi::Errors;
use crate::serve::problem::{ApiError, ApiResult};
use crate::serve::Shared;

/// The server is up (public, as probes need: no token).
#[utoipa::path(get, path = "/api/health", tag = "system", security(()),
    responses((status = 200, description = "Up", body = Health), Errors))]
pub(crate) async fn health() -> Json<Health> {
    Json(Health {
        status: "ok".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
    })
}

/// The server accepts turns (503 while it shuts down; public, as probes need: no token).
#[utoipa::path(get, path = "/api/ready", tag = "system", security(()),
    responses((status = 200, description = "Ready", body = Ready), Errors))]
pub(crate) async fn ready(State(shared): State<Arc<Shared>>) -> ApiResult<Json<Ready>> {
    if shared.turns.is_draining() {
        return Err(ApiError::Unavailable(
            "the server is shutting down".to_owned(),
        ));
    }
    Ok(Json(Ready {
        status: "ready".to_owned(),
        catalog_generation: shared
            .app
            .catalog
            .as_ref()
            .map(|(handle, _)| handle.current().generation()),
        running_turns: shared.turns.running(),
    }))
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(get, path = "/api/openapi.json", tag = "system",
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json", body = Object), Errors))]
pub(crate) async fn openapi() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::serve::openapi_json(),
    )
}

/// Rebuilds the agent catalog from its directory. On any error the catalog
/// in force stays, and the answer (422) lists every problem.
#[utoipa::path(post, path = "/api/admin/reload", tag = "system",
    responses((status = 200, description = "The new catalog", body = ReloadReport), Errors))]
pub(crate) async fn reload(State(shared): State<Arc<Shared>>) -> ApiResult<Json<ReloadReport>> {
    let report = shared.reload().await?;
    tracing::info!(
        generation = report.generation,
        "agent catalog reloaded through the API"
    );
    Ok(Json(report))
}

/// keel's metrics in the Prometheus text format (docs/OPERATIONS.md), behind
/// the token when one is set.
#[utoipa::path(get, path = "/metrics", tag = "system",
    responses((status = 200, description = "The metrics", content_type = "text/plain", body = String), Errors))]
pub(crate) async fn metrics(State(shared): State<Arc<Shared>>) -> ApiResult<impl IntoResponse> {
    let text = crate::metrics::render(&shared.app.store, &shared.app.gate)
        .await
        .ok_or_else(|| {
            ApiError::Unavailable("this process has no Prometheus recorder".to_owned())
        })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    ))
}
