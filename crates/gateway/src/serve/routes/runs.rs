//! Sub-agent runs: listing with filters and cursors, one run with its whole
//! result, its events, a dialog's events and inbox counts, and cancelling
//! a run through the coordinator.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use keel_core::{AgentId, CancellationToken, RunId, RunStatus, SessionId, TurnId};
use keel_engine::CallerContext;
use keel_store::{EventCursor, RunCursor, RunQuery, RunRecord};

use super::{decode_cursor, encode_cursor, page_limit, parse_id};
use crate::serve::api::{
    AgentEvent, AgentEventPage, AgentRun, AgentRunPage, DialogInbox, PageQuery, RunEventPage,
    RunListQuery,
};
use crate::serve::openapi::Errors;
use crate::serve::problem::{ApiError, ApiPath, ApiQuery, ApiResult};
use crate::serve::trace::{run_trace, turn_trace as trace_of_turn, Trace};
use crate::serve::Shared;

/// The statuses of a comma-separated `status` filter.
fn statuses(text: &str) -> ApiResult<Vec<RunStatus>> {
    text.split(',')
        .map(|s| {
            s.parse::<RunStatus>()
                .map_err(|e| ApiError::BadRequest(e.to_string()))
        })
        .collect()
}

/// The query a [`RunListQuery`] asks for.
fn run_query(q: &RunListQuery) -> ApiResult<RunQuery> {
    Ok(RunQuery {
        root_session_id: q
            .session_id
            .as_deref()
            .map(|s| parse_id::<SessionId>("dialog", s))
            .transpose()?,
        statuses: q
            .status
            .as_deref()
            .map(statuses)
            .transpose()?
            .unwrap_or_default(),
        agent_id: q
            .agent
            .as_deref()
            .map(AgentId::parse)
            .transpose()
            .map_err(|e| ApiError::BadRequest(e.to_string()))?,
        group_id: q
            .group_id
            .as_deref()
            .map(|g| parse_id("group", g))
            .transpose()?,
        parent_run_id: q
            .parent_run_id
            .as_deref()
            .map(|r| parse_id("run", r))
            .transpose()?,
        limit: page_limit(q.limit)?,
        cursor: match q.cursor.as_deref() {
            None => None,
            Some(c) => {
                let (created_at_ms, id) = decode_cursor(c)?;
                Some(RunCursor { created_at_ms, id })
            }
        },
    })
}

/// Runs, newest first, optionally of one dialog, status, agent, batch or parent.
#[utoipa::path(get, path = "/api/agent-runs", tag = "agent-runs", params(RunListQuery),
    responses((status = 200, description = "A page of runs", body = AgentRunPage), Errors))]
pub(crate) async fn list(
    State(shared): State<Arc<Shared>>,
    ApiQuery(q): ApiQuery<RunListQuery>,
) -> ApiResult<Json<AgentRunPage>> {
    let query = run_query(&q)?;
    Ok(Json(shared.run_page(query).await?))
}

impl Shared {
    /// A page of runs; with a dialog, its revision read first.
    pub(crate) async fn run_page(&self, query: RunQuery) -> ApiResult<AgentRunPage> {
        let store = &self.app.store;
        let revision = match query.root_session_id {
            Some(session) => Some(store.inbox_usage(session).await?.revision),
            None => None,
        };
        let page = match query.group_id {
            // A batch is small: its runs come whole, in creation order.
            Some(group) if query.cursor.is_none() => keel_store::Page {
                items: store
                    .group_runs(group)
                    .await?
                    .into_iter()
                    .filter(|r| matches_query(&query, r))
                    .collect(),
                next_cursor: None,
            },
            Some(_) => keel_store::Page {
                items: Vec::new(),
                next_cursor: None,
            },
            None => store.query_runs(query).await?,
        };
        Ok(AgentRunPage {
            items: page
                .items
                .iter()
                .map(|r| AgentRun::from_record(r, false))
                .collect(),
            next_cursor: page
                .next_cursor
                .map(|c| encode_cursor(c.created_at_ms, c.id)),
            revision,
        })
    }

    /// The run `id` names.
    async fn run(&self, id: &str) -> ApiResult<RunRecord> {
        let run_id: RunId = parse_id("run", id)?;
        self.app
            .store
            .get_run(run_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("run {run_id} not found")))
    }
}

/// Whether `r` passes the filters of `q` other than the group.
fn matches_query(q: &RunQuery, r: &RunRecord) -> bool {
    q.root_session_id
        .is_none_or(|s| s == r.spec.root_session_id)
        && (q.statuses.is_empty() || q.statuses.contains(&r.status))
        && q.agent_id.as_ref().is_none_or(|a| *a == r.spec.agent_id)
        && q.parent_run_id
            .is_none_or(|p| Some(p) == r.spec.parent_run_id)
}

/// One run, with its whole result.
#[utoipa::path(get, path = "/api/agent-runs/{id}", tag = "agent-runs",
    params(("id" = uuid::Uuid, Path, description = "The run's id")),
    responses((status = 200, description = "The run", body = AgentRun), Errors))]
pub(crate) async fn get_one(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<AgentRun>> {
    Ok(Json(AgentRun::from_record(&shared.run(&id).await?, true)))
}

/// The run's signals and completion, oldest first.
#[utoipa::path(get, path = "/api/agent-runs/{id}/events", tag = "agent-runs",
    params(("id" = uuid::Uuid, Path, description = "The run's id"), PageQuery),
    responses((status = 200, description = "A page of the run's events", body = RunEventPage), Errors))]
pub(crate) async fn events(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<Json<RunEventPage>> {
    let run = shared.run(&id).await?;
    let limit = page_limit(q.limit)?;
    let cursor = event_cursor(q.cursor.as_deref())?;
    let page = shared
        .app
        .store
        .run_events(run.spec.id, cursor, limit)
        .await?;
    Ok(Json(RunEventPage {
        items: page.items.iter().map(AgentEvent::from).collect(),
        next_cursor: page
            .next_cursor
            .map(|c| encode_cursor(c.created_at_ms, c.id)),
    }))
}

/// The event a `cursor` query parameter names, if any.
fn event_cursor(cursor: Option<&str>) -> ApiResult<Option<EventCursor>> {
    cursor
        .map(|c| {
            let (created_at_ms, id) = decode_cursor(c)?;
            Ok(EventCursor { created_at_ms, id })
        })
        .transpose()
}

/// A dialog's signals and completions (whatever their delivery status),
/// newest first, with the dialog's revision read before them.
#[utoipa::path(get, path = "/api/dialogs/{id}/agent-events", tag = "agent-runs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"), PageQuery),
    responses((status = 200, description = "A page of the dialog's events", body = AgentEventPage), Errors))]
pub(crate) async fn dialog_events(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PageQuery>,
) -> ApiResult<Json<AgentEventPage>> {
    let record = shared.dialog(&id).await?;
    let store = &shared.app.store;
    let limit = page_limit(q.limit)?;
    let cursor = event_cursor(q.cursor.as_deref())?;
    let revision = store.inbox_usage(record.id).await?.revision;
    let page = store.query_session_events(record.id, cursor, limit).await?;
    Ok(Json(AgentEventPage {
        items: page.items.iter().map(AgentEvent::from).collect(),
        next_cursor: page
            .next_cursor
            .map(|c| encode_cursor(c.created_at_ms, c.id)),
        revision,
    }))
}

/// How many of the dialog's signals and completions are pending, delivered,
/// dead-lettered or superseded.
#[utoipa::path(get, path = "/api/dialogs/{id}/inbox", tag = "agent-runs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id")),
    responses((status = 200, description = "The dialog's inbox counts", body = DialogInbox), Errors))]
pub(crate) async fn dialog_inbox(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<DialogInbox>> {
    let record = shared.dialog(&id).await?;
    Ok(Json(shared.app.store.inbox_counts(record.id).await?.into()))
}

/// Cancels a run that has not ended (with its foreground descendants) and
/// returns it once it has; an ended run is returned as it is.
#[utoipa::path(post, path = "/api/agent-runs/{id}/cancel", tag = "agent-runs",
    params(("id" = uuid::Uuid, Path, description = "The run's id")),
    responses((status = 200, description = "The run, ended", body = AgentRun), Errors))]
pub(crate) async fn cancel(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<AgentRun>> {
    let run = shared.run(&id).await?;
    if run.status.is_terminal() {
        return Ok(Json(AgentRun::from_record(&run, true)));
    }
    let Some(coordinator) = &shared.app.coordinator else {
        return Err(ApiError::Conflict(
            "keel started without agent definitions, so it cannot cancel runs; they end as interrupted on the next start with definitions".to_owned(),
        ));
    };
    // The API acts for the dialog's owner: the root of the run's tree.
    let root = run.spec.root_session_id;
    let caller = CallerContext::root(root, TurnId::new(), CancellationToken::new());
    coordinator.cancel_run(&caller, run.spec.id).await?;
    shared.projections.refresh(root).await;
    let ended = shared.run(&id).await?;
    Ok(Json(AgentRun::from_record(&ended, true)))
}

/// The trace of a run: it and every run below it, with times, tokens and status.
#[utoipa::path(get, path = "/api/agent-runs/{id}/trace", tag = "agent-runs", operation_id = "run_trace",
    params(("id" = uuid::Uuid, Path, description = "The run's id")),
    responses((status = 200, description = "The run's tree", body = Trace), Errors))]
pub(crate) async fn trace(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Trace>> {
    let run_id: RunId = parse_id("run", &id)?;
    let runs = shared.app.store.run_tree(run_id).await?;
    let calls = shared
        .app
        .store
        .runs_calls(runs.iter().map(|r| r.spec.id).collect())
        .await?;
    run_trace(run_id, &runs, &calls)
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("run {run_id} not found")))
}

/// The trace of a root turn: its model and tool calls and its sub-agent runs, at every depth.
#[utoipa::path(get, path = "/api/dialogs/{id}/turns/{turn_id}/trace", tag = "agent-runs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"),
           ("turn_id" = uuid::Uuid, Path, description = "A turn of this dialog")),
    responses((status = 200, description = "The turn's runs as a tree", body = Trace), Errors))]
pub(crate) async fn turn_trace(
    State(shared): State<Arc<Shared>>,
    ApiPath((id, turn)): ApiPath<(String, String)>,
) -> ApiResult<Json<Trace>> {
    let record = shared.dialog(&id).await?;
    let turn: TurnId = parse_id("turn", &turn)?;
    let store = &shared.app.store;
    let calls = store.turn_calls(Some(record.id), turn).await?;
    let runs = store.turn_runs(Some(record.id), turn).await?;
    if runs.is_empty() && calls.is_empty() {
        // A turn still running, not committed, or not of this dialog.
        return Err(ApiError::NotFound(format!(
            "no call or sub-agent run of turn {turn} is stored in dialog {}",
            record.id
        )));
    }
    let run_calls = store
        .runs_calls(runs.iter().map(|r| r.spec.id).collect())
        .await?;
    Ok(Json(trace_of_turn(turn, &calls, &runs, &run_calls)))
}
