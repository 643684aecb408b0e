//! A dialog as portable JSON: its export, and an import that recreates one
//! (the `keel.dialog` format, docs/EXPORT.md).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use keel_engine::DialogExport;

use crate::serve::api::Dialog;
use crate::serve::openapi::Errors;
use crate::serve::problem::{ApiJson, ApiPath, ApiResult};
use crate::serve::Shared;

/// The dialog as a `keel.dialog` export: its current history (hidden messages included), state, timelines, checkpoints and sub-agent runs.
#[utoipa::path(get, path = "/api/dialogs/{id}/export", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 200, description = "The export (format keel.dialog, docs/EXPORT.md)",
        body = Object), Errors))]
pub(crate) async fn export(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<DialogExport>> {
    let record = shared.dialog(&id).await?;
    Ok(Json(shared.app.manager.export_dialog(record.id).await?))
}

/// Recreates a `keel.dialog` export as a new dialog of its chat, with new ids, in one transaction.
#[utoipa::path(post, path = "/api/dialogs/import", tag = "dialogs",
    request_body(content = Object, description = "An export (format keel.dialog, docs/EXPORT.md)"),
    responses((status = 201, description = "The new dialog", body = Dialog), Errors))]
pub(crate) async fn import(
    State(shared): State<Arc<Shared>>,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> ApiResult<(StatusCode, Json<Dialog>)> {
    let export = DialogExport::from_value(body)?;
    let id = shared.app.manager.import_dialog(export).await?;
    let record = shared.dialog_by_id(id).await?;
    Ok((StatusCode::CREATED, Json(Dialog::from(&record))))
}
