//! `/api/dialogs/{id}/approvals` and `/api/approvals/{id}`: tool calls
//! waiting for a person, and deciding them.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use keel_core::ApprovalId;
use keel_store::Decision;

use super::parse_id;
use crate::serve::api::{Approval, ApprovalChoice, ApprovalDecision, ApprovalList, ApprovalQuery};
use crate::serve::openapi::Errors;
use crate::serve::problem::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::serve::Shared;

/// The dialog's tool calls waiting for a decision (`status=all`: every
/// approval it had), oldest first.
#[utoipa::path(get, path = "/api/dialogs/{id}/approvals", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"), ApprovalQuery),
    responses((status = 200, description = "The dialog's approvals", body = ApprovalList), Errors))]
pub(crate) async fn list(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ApprovalQuery>,
) -> ApiResult<Json<ApprovalList>> {
    let record = shared.dialog(&id).await?;
    let pending_only = match q.status.as_deref() {
        None | Some("pending") => true,
        Some("all") => false,
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "status {other:?} is not `pending` or `all`"
            )))
        }
    };
    let items = shared
        .app
        .manager
        .approvals(record.id, pending_only)
        .await?;
    Ok(Json(ApprovalList {
        items: items.iter().map(Approval::from).collect(),
    }))
}

/// Decides a pending approval: the paused turn resumes once all its calls
/// are decided (an approved call runs exactly once). A decided, expired or
/// superseded approval is 409; an unknown one (or one of a deleted dialog) 404.
#[utoipa::path(post, path = "/api/approvals/{id}", tag = "dialogs", request_body = ApprovalDecision,
    params(("id" = uuid::Uuid, Path, description = "The approval's id")),
    responses((status = 200, description = "The approval, decided", body = Approval), Errors))]
pub(crate) async fn decide(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<ApprovalDecision>,
) -> ApiResult<Json<Approval>> {
    let approval: ApprovalId = parse_id("approval", &id)?;
    let decision = match body.decision {
        ApprovalChoice::Approve => Decision::Approve,
        ApprovalChoice::ApproveAlways => Decision::ApproveAlways,
        ApprovalChoice::Deny => Decision::Deny,
    };
    let record = shared
        .app
        .manager
        .decide_approval(approval, None, decision, body.reason)
        .await?;
    Ok(Json(Approval::from(&record)))
}
