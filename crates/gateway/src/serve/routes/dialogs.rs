//! Dialogs and what happens in them: listing, creating, renaming and
//! deleting dialogs; their visible messages; sending (a turn, optionally
//! streamed as SSE); stopping the running turn; checkpoints, rollback, fork.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::{AgentId, CheckpointId};
use keel_engine::DialogAddress;
use keel_store::{CheckpointCursor, DialogCursor, MessagePage as StorePage};

use super::{checked_text, decode_cursor, encode_cursor, page_limit, parse_id};
use crate::serve::api::{
    ChatMessage, Checkpoint, CheckpointPage, Dialog, DialogListQuery, DialogPage, DialogPatch,
    DialogStorage, DialogUsage, ForkRequest, MessageListQuery, MessagePage, NewDialog, Order,
    PageQuery, RunSpend, SendMessage, SteerReport, SteerText, StopReport, TurnAccepted,
};
use crate::serve::frames::ServerFrame;
use crate::serve::openapi::Errors;
use crate::serve::problem::{ApiError, ApiJson, ApiPath, ApiQuery, ApiResult};
use crate::serve::Shared;

/// Channel of dialogs created through the API when none is given.
pub const DEFAULT_CHANNEL: &str = "api";
/// Chat of dialogs created or listed through the API when none is given.
pub const DEFAULT_CHAT: &str = "default";

/// Lists a chat's dialogs, most recently created first.
#[utoipa::path(get, path = "/api/dialogs", tag = "dialogs", params(DialogListQuery),
    responses((status = 200, description = "A page of dialogs", body = DialogPage), Errors))]
pub(crate) async fn list(
    State(shared): State<Arc<Shared>>,
    ApiQuery(q): ApiQuery<DialogListQuery>,
) -> ApiResult<Json<DialogPage>> {
    let channel = q.channel.as_deref().unwrap_or(DEFAULT_CHANNEL);
    let chat = q.chat_id.as_deref().unwrap_or(DEFAULT_CHAT);
    DialogAddress::new(channel, chat, DEFAULT_CHAT)?;
    let limit = page_limit(q.limit)?;
    let cursor = match q.cursor.as_deref() {
        None => None,
        Some(c) => {
            let (created_at_ms, id) = decode_cursor(c)?;
            Some(DialogCursor { created_at_ms, id })
        }
    };
    let page = shared
        .app
        .manager
        .list_dialogs(channel, chat, limit, cursor)
        .await?;
    Ok(Json(DialogPage {
        items: page.items.iter().map(Dialog::from).collect(),
        next_cursor: page
            .next_cursor
            .map(|c| encode_cursor(c.created_at_ms, c.id)),
    }))
}

/// Creates a dialog with a fresh short id in a chat.
#[utoipa::path(post, path = "/api/dialogs", tag = "dialogs", request_body = NewDialog,
    responses((status = 201, description = "The new dialog", body = Dialog), Errors))]
pub(crate) async fn create(
    State(shared): State<Arc<Shared>>,
    ApiJson(body): ApiJson<NewDialog>,
) -> ApiResult<(StatusCode, Json<Dialog>)> {
    let channel = body.channel.as_deref().unwrap_or(DEFAULT_CHANNEL);
    let chat = body.chat_id.as_deref().unwrap_or(DEFAULT_CHAT);
    let agent = body
        .agent
        .as_deref()
        .map(AgentId::parse)
        .transpose()
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let manager = &shared.app.manager;
    let id = manager
        .create_dialog(channel, chat, body.title, agent)
        .await?;
    let record = shared.dialog_by_id(id).await?;
    Ok((StatusCode::CREATED, Json(Dialog::from(&record))))
}

/// One dialog, with what it occupies in the database (`storage`).
#[utoipa::path(get, path = "/api/dialogs/{id}", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 200, description = "The dialog", body = Dialog), Errors))]
pub(crate) async fn get_one(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Dialog>> {
    let record = shared.dialog(&id).await?;
    let usage = shared.app.store.dialog_usage(record.id).await?;
    let mut dialog = Dialog::from(&record);
    dialog.storage = Some(DialogStorage {
        stored_bytes: usage.stored_bytes,
        checkpoints: usage.checkpoints,
    });
    Ok(Json(dialog))
}

/// Renames a dialog (which also stops automatic titles for it) and/or
/// switches its agent (refused while a turn runs; the history is kept).
#[utoipa::path(patch, path = "/api/dialogs/{id}", tag = "dialogs", request_body = DialogPatch,
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 200, description = "The changed dialog", body = Dialog), Errors))]
pub(crate) async fn update(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(patch): ApiJson<DialogPatch>,
) -> ApiResult<Json<Dialog>> {
    let record = shared.dialog(&id).await?;
    let agent = patch
        .agent
        .as_deref()
        .map(AgentId::parse)
        .transpose()
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    shared
        .app
        .manager
        .update_dialog(record.id, patch.title.as_deref(), agent.as_ref())
        .await?;
    let dialog = Dialog::from(&shared.dialog_by_id(record.id).await?);
    shared.hub.publish(
        record.id,
        ServerFrame::DialogUpdated {
            session_id: dialog.id,
            dialog: dialog.clone(),
        },
    );
    Ok(Json(dialog))
}

/// Deletes a dialog: it leaves listings, its sub-agent runs are cancelled, retention purges it later.
#[utoipa::path(delete, path = "/api/dialogs/{id}", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 204, description = "Deleted"), Errors))]
pub(crate) async fn delete(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let record = shared.dialog(&id).await?;
    shared.app.manager.delete_dialog(record.id).await?;
    shared.projections.refresh(record.id).await;
    Ok(StatusCode::NO_CONTENT)
}

/// The dialog's visible messages (hidden runtime messages are never listed).
#[utoipa::path(get, path = "/api/dialogs/{id}/messages", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"), MessageListQuery),
    responses((status = 200, description = "A page of messages", body = MessagePage), Errors))]
pub(crate) async fn messages(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<MessageListQuery>,
) -> ApiResult<Json<MessagePage>> {
    let record = shared.dialog(&id).await?;
    let limit = page_limit(q.limit)?;
    let cursor = match q.cursor.as_deref() {
        None => None,
        Some(c) => Some(c.parse::<i64>().map_err(|_| {
            ApiError::BadRequest(format!("cursor {c:?} is not one this server gave"))
        })?),
    };
    let items = shared
        .app
        .store
        .load_message_page(
            record.id,
            StorePage {
                visible_only: true,
                newest_first: q.order.unwrap_or_default() == Order::Desc,
                cursor,
                limit,
            },
        )
        .await?;
    let next_cursor = (items.len() == limit)
        .then(|| items.last().map(|m| m.seq.to_string()))
        .flatten();
    Ok(Json(MessagePage {
        items: items.iter().map(ChatMessage::from).collect(),
        next_cursor,
    }))
}

/// Sends a message: a turn starts once the dialog's previous turn ended.
/// With `Accept: text/event-stream` the turn's frames stream as SSE events
/// until `turn_committed` or `turn_failed`; otherwise the turn's id returns
/// at once and its frames go to the dialog's WebSocket subscribers.
#[utoipa::path(post, path = "/api/dialogs/{id}/messages", tag = "dialogs", request_body = SendMessage,
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses(
        (status = 202, description = "The turn started", body = TurnAccepted),
        (status = 200, description = "The turn's frames (`turn_started`, `text_delta`, … `turn_committed` or `turn_failed`) as server-sent events named by their `type`", content_type = "text/event-stream", body = crate::serve::sse::SseEvent),
        Errors))]
pub(crate) async fn send(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<SendMessage>,
) -> ApiResult<Response> {
    let session = shared.live_dialog(super::parse_id("dialog", &id)?).await?;
    let webhook = shared.checked_webhook(body.webhook, body.if_busy)?;
    let input = shared.user_input(session, body.text, body.parts).await?;
    let wants_stream = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"));
    if wants_stream {
        return crate::serve::sse::send_streamed(shared, session, input, body.if_busy, webhook)
            .await;
    }
    let (turn, steered) = shared
        .turns
        .send(session, input, body.if_busy, webhook)
        .await?;
    let accepted = TurnAccepted {
        session_id: session.as_uuid(),
        turn_id: turn.as_uuid(),
        steered,
    };
    Ok((StatusCode::ACCEPTED, Json(accepted)).into_response())
}

/// Cancels the dialog's running turn (nothing of its answer is saved; the
/// user's message stays, unanswered) and its running background runs
/// (their results start no turn).
#[utoipa::path(post, path = "/api/dialogs/{id}/stop", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 200, description = "Whether a turn was running", body = StopReport), Errors))]
pub(crate) async fn stop(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<StopReport>> {
    let record = shared.dialog(&id).await?;
    Ok(Json(StopReport {
        stopped: shared.turns.stop(record.id).await?,
    }))
}

/// Gives text to the dialog's running turn (the model reads it at its next
/// call). With no running turn nothing is done: `steered` is false, and
/// the client sends the text as a message instead.
#[utoipa::path(post, path = "/api/dialogs/{id}/steer", tag = "dialogs", request_body = SteerText,
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 200, description = "Whether a running turn took the text", body = SteerReport), Errors))]
pub(crate) async fn steer(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiJson(body): ApiJson<SteerText>,
) -> ApiResult<Json<SteerReport>> {
    let record = shared.dialog(&id).await?;
    Ok(Json(
        shared
            .turns
            .steer(record.id, checked_text(body.text)?)
            .await?,
    ))
}

/// Tokens and model calls of the dialog's committed turns (a running turn
/// counts once it commits), what the dialog spent in all (every model call,
/// its runs' included) against its budget, and what its newest runs and
/// their trees spent.
#[utoipa::path(get, path = "/api/dialogs/{id}/usage", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 200, description = "The dialog's usage", body = DialogUsage), Errors))]
pub(crate) async fn usage(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<DialogUsage>> {
    let record = shared.dialog(&id).await?;
    let manager = &shared.app.manager;
    let turns = manager.usage(record.id).await?;
    let spend = manager.dialog_spend(record.id).await?;
    let runs = shared
        .app
        .store
        .list_runs(record.id, None, 100)
        .await?
        .items;
    Ok(Json(DialogUsage {
        prompt_tokens: turns.prompt_tokens,
        completion_tokens: turns.completion_tokens,
        model_calls: turns.requests,
        spend: spend.into(),
        max_cost_usd: manager.dialog_budget().map(keel_core::Usd::get),
        runs: run_spends(&runs),
    }))
}

/// Each run with its own tokens and those of its tree (of the runs listed).
fn run_spends(runs: &[keel_store::RunRecord]) -> Vec<RunSpend> {
    let mut tree: std::collections::HashMap<keel_core::RunId, keel_core::Usage> = runs
        .iter()
        .map(|r| (r.spec.id, r.usage.unwrap_or_default()))
        .collect();
    // Deepest first, so each run's total is complete before its parent adds it.
    let mut by_depth: Vec<&keel_store::RunRecord> = runs.iter().collect();
    by_depth.sort_by_key(|r| std::cmp::Reverse(r.spec.depth));
    for r in by_depth {
        let (Some(parent), Some(own)) = (r.spec.parent_run_id, tree.get(&r.spec.id).copied())
        else {
            continue;
        };
        if let Some(total) = tree.get_mut(&parent) {
            total.add(own);
        }
    }
    runs.iter()
        .map(|r| RunSpend {
            run_id: r.spec.id.as_uuid(),
            agent: r.spec.agent_id.to_string(),
            parent_run_id: r.spec.parent_run_id.map(|p| p.as_uuid()),
            status: r.status.into(),
            usage: r.usage.map(Into::into),
            cost_usd: r.cost,
            tree_usage: tree.get(&r.spec.id).copied().unwrap_or_default().into(),
        })
        .collect()
}

/// The dialog's checkpoints, newest first, as a tree through `parent_id`.
#[utoipa::path(get, path = "/api/dialogs/{id}/checkpoints", tag = "checkpoints",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"), PageQuery),
    responses((status = 200, description = "A page of checkpoints", body = CheckpointPage), Errors))]
pub(crate) async fn checkpoints(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<Json<CheckpointPage>> {
    let record = shared.dialog(&id).await?;
    let limit = page_limit(q.limit)?;
    let cursor = match q.cursor.as_deref() {
        None => None,
        Some(c) => {
            let (created_at_ms, id) = decode_cursor(c)?;
            Some(CheckpointCursor { created_at_ms, id })
        }
    };
    let store = &shared.app.store;
    let ranges = store.history_ranges(record.id).await?;
    let page = store.checkpoint_page(record.id, cursor, limit).await?;
    let items = page
        .items
        .iter()
        .map(|c| {
            let current = ranges
                .iter()
                .any(|(t, upto)| *t == c.timeline_id && c.seq <= *upto);
            Checkpoint::from_record(c, current)
        })
        .collect();
    Ok(Json(CheckpointPage {
        items,
        next_cursor: page
            .next_cursor
            .map(|c| encode_cursor(c.created_at_ms, c.id)),
    }))
}

/// Goes back to a checkpoint: a new branch starts there (after the running
/// turn, if any, ended); the abandoned branch stays listed.
#[utoipa::path(post, path = "/api/dialogs/{id}/checkpoints/{checkpoint_id}/rollback", tag = "checkpoints",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"),
           ("checkpoint_id" = uuid::Uuid, Path, description = "A checkpoint of this dialog")),
    responses((status = 200, description = "The checkpoint the new branch starts from", body = Checkpoint), Errors))]
pub(crate) async fn rollback(
    State(shared): State<Arc<Shared>>,
    ApiPath((id, checkpoint)): ApiPath<(String, String)>,
) -> ApiResult<Json<Checkpoint>> {
    let record = shared.dialog(&id).await?;
    let checkpoint: CheckpointId = parse_id("checkpoint", &checkpoint)?;
    let made = shared.app.manager.rollback(record.id, checkpoint).await?;
    Ok(Json(Checkpoint::from_record(&made, true)))
}

/// Copies a checkpoint into a new dialog of the same chat (no history is copied).
#[utoipa::path(post, path = "/api/dialogs/{id}/checkpoints/{checkpoint_id}/fork", tag = "checkpoints",
    request_body = ForkRequest,
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"),
           ("checkpoint_id" = uuid::Uuid, Path, description = "A checkpoint of this dialog")),
    responses((status = 201, description = "The new dialog", body = Dialog), Errors))]
pub(crate) async fn fork(
    State(shared): State<Arc<Shared>>,
    ApiPath((id, checkpoint)): ApiPath<(String, String)>,
    ApiJson(body): ApiJson<ForkRequest>,
) -> ApiResult<(StatusCode, Json<Dialog>)> {
    let record = shared.dialog(&id).await?;
    let checkpoint: CheckpointId = parse_id("checkpoint", &checkpoint)?;
    let store = &shared.app.store;
    store
        .get_checkpoint(checkpoint)
        .await?
        .filter(|c| c.session_id == record.id)
        .ok_or_else(|| ApiError::NotFound(format!("checkpoint {checkpoint} not found")))?;
    let new = shared.app.manager.fork(checkpoint, body.title).await?;
    let made = shared.dialog_by_id(new).await?;
    Ok((StatusCode::CREATED, Json(Dialog::from(&made))))
}
