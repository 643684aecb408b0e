//! Turn frames as server-sent events: each an event named by its `type`,
//! the frame as JSON data, its `event_id` as the SSE `id:`.
//!
//! - A streamed send carries one turn's frames and ends after its
//!   `turn_committed` or `turn_failed`.
//! - `GET /api/dialogs/{id}/stream` joins the dialog's stream: with
//!   `Last-Event-ID` (or `?last_event_id=`) every turn frame after that id
//!   first — of the running turn and of turns that ended meanwhile — else the
//!   running turn's frames so far; then live frames, until a turn ends with
//!   none running.
//!
//! A reader too slow for the dialog's buffer is caught up from the replay
//! window, past which it gets a `replay_gap`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream};
use keel_core::SessionId;
use serde::Deserialize;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::broadcast::Receiver;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::api::IfBusy;
use super::frames::ServerFrame;
use super::hub::{Resume, SharedFrame};
use super::openapi::Errors;
use super::problem::{ApiError, ApiPath, ApiQuery, ApiResult};
use super::Shared;

fn event(frame: &ServerFrame) -> Event {
    let event = Event::default()
        .event(frame.kind())
        .data(serde_json::to_string(frame).unwrap_or_default());
    match frame.event_id() {
        Some(id) => event.id(id.to_string()),
        None => event,
    }
}

/// One SSE reader of a dialog's turn frames.
struct Follow {
    shared: Arc<Shared>,
    session: SessionId,
    /// Frames to send before reading the receiver (a replay).
    pending: VecDeque<SharedFrame>,
    receiver: Receiver<SharedFrame>,
    /// The newest event id sent.
    last: Option<u64>,
    /// Only this turn's frames, ending with it (a streamed send).
    turn: Option<Uuid>,
}

impl Follow {
    /// The next frame to send, `None` at the end of the stream.
    async fn next(&mut self) -> Option<SharedFrame> {
        loop {
            let frame = match self.pending.pop_front() {
                Some(frame) => frame,
                None => match self.receiver.recv().await {
                    Ok(frame) => frame,
                    // Caught up from the window, which the dropped frames are in.
                    Err(RecvError::Lagged(_)) => {
                        let from = self.last.map_or(Resume::Join, Resume::After);
                        let attach = self.shared.hub.attach(self.session, from);
                        self.receiver = attach.receiver;
                        self.pending.extend(attach.gap.map(Arc::new));
                        self.pending.extend(attach.replay);
                        continue;
                    }
                    Err(RecvError::Closed) => return None,
                },
            };
            // Turn frames only (and gaps), each once.
            match frame.event_id() {
                // After a gap, whatever follows is new to the client.
                None if matches!(frame.as_ref(), ServerFrame::ReplayGap { .. }) => {
                    self.last = None;
                    return Some(frame);
                }
                None => continue,
                Some(id) if self.last.is_some_and(|last| id <= last) => continue,
                Some(_) => {}
            }
            if self.turn.is_some() && frame.turn_id() != self.turn {
                continue;
            }
            self.last = frame.event_id().or(self.last);
            return Some(frame);
        }
    }

    /// Whether the stream ends after `frame`: a streamed send's turn ended;
    /// or a turn ended (or a gap was said), nothing is left to replay and no
    /// other turn runs or waits. (Only then: between a turn's last frame and
    /// its end nothing may run, yet its end is still to come.)
    fn ends_after(&self, frame: &ServerFrame) -> bool {
        if self.turn.is_some() {
            return frame.ends_turn();
        }
        let gap = matches!(frame, ServerFrame::ReplayGap { .. });
        if !frame.ends_turn() && !gap {
            return false;
        }
        // The ended turn may still be seen as running.
        self.pending.is_empty() && !self.shared.turns.has_turn(self.session, frame.turn_id())
    }

    /// Whether nothing is to be sent now or later (nothing replayed, no
    /// turn running or waiting to).
    fn idle(&self) -> bool {
        self.pending.is_empty() && !self.shared.turns.has_turn(self.session, None)
    }

    fn into_response(self) -> Response {
        let frames = stream::unfold(Some(self), |follow| async move {
            let mut follow = follow?;
            let frame = follow.next().await?;
            let next = (!follow.ends_after(&frame)).then_some(follow);
            Some((event(&frame), next))
        });
        sse_response(frames)
    }
}

/// Starts a turn and answers with its frames as an SSE stream.
pub(crate) async fn send_streamed(
    shared: Arc<Shared>,
    session: SessionId,
    input: keel_core::Message,
    if_busy: IfBusy,
    webhook: Option<String>,
) -> ApiResult<Response> {
    // Subscribed before the turn starts, so its first frame is not missed.
    // A steer streams the rest of the turn it went into.
    let receiver = shared.hub.subscribe(session);
    let turn = shared
        .turns
        .send(session, input, if_busy, webhook)
        .await?
        .0
        .as_uuid();
    let follow = Follow {
        shared,
        session,
        pending: VecDeque::new(),
        receiver,
        last: None,
        turn: Some(turn),
    };
    Ok(follow.into_response())
}

/// One server-sent event of a turn stream, as the OpenAPI document
/// describes it: `event` is the frame's `type`, `data` the frame as JSON,
/// `id` its `event_id` (frames that have one).
#[derive(ToSchema)]
#[expect(
    dead_code,
    reason = "documents the wire format; events are written by the SSE encoder"
)]
pub(crate) struct SseEvent {
    /// The frame's `type`.
    event: String,
    /// The frame, as JSON.
    data: String,
    /// The frame's `event_id`, as decimal text.
    id: Option<String>,
}

/// Query of `GET /api/dialogs/{id}/stream`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct StreamQuery {
    /// The `event_id` of the last frame seen, for clients that cannot send
    /// the `Last-Event-ID` header (the header wins).
    last_event_id: Option<u64>,
}

/// The `Last-Event-ID` header, when there is one.
fn last_event_id(headers: &HeaderMap) -> ApiResult<Option<u64>> {
    let Some(value) = headers.get("last-event-id") else {
        return Ok(None);
    };
    // An empty one is refused too: a browser sends none after a reset id
    // (the SSE spec), and the document says the header is a number.
    let text = value.to_str().unwrap_or_default().trim();
    text.parse()
        .ok()
        .and_then(given_id)
        .map(Some)
        .ok_or_else(|| {
            ApiError::BadRequest(format!(
                "Last-Event-ID {text:?} is not an event id this server gave (a number)"
            ))
        })
}

/// `id` if it can be an event id (they fit an `int64`, as documented).
fn given_id(id: u64) -> Option<u64> {
    (i64::try_from(id).is_ok()).then_some(id)
}

/// Joins the dialog's turn stream (SSE): with `Last-Event-ID`, every turn
/// frame after it first, or a `replay_gap` when they are no longer kept;
/// without, the running turn's frames so far. Then live frames, until a turn
/// ends and none runs (at once when nothing runs and nothing is replayed).
#[utoipa::path(get, path = "/api/dialogs/{id}/stream", tag = "dialogs",
    params(("id" = uuid::Uuid, Path, description = "The dialog's id"), StreamQuery,
        ("Last-Event-ID" = Option<u64>, Header, nullable = false, description = "The `event_id` of the last frame seen")),
    responses(
        (status = 200, description = "Turn frames (`turn_started`, `text_delta`, … `turn_committed` or `turn_failed`, `replay_gap`) as server-sent events named by their `type`, each with its `event_id` as `id`", content_type = "text/event-stream", body = SseEvent),
        Errors))]
pub(crate) async fn stream(
    State(shared): State<Arc<Shared>>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<StreamQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let session = shared.dialog(&id).await?.id;
    let asked = match query.last_event_id {
        Some(id) => Some(given_id(id).ok_or_else(|| {
            ApiError::BadRequest(format!(
                "last_event_id {id} is not an event id this server gave (at most {})",
                i64::MAX
            ))
        })?),
        None => None,
    };
    let from = last_event_id(&headers)?
        .or(asked)
        .map_or(Resume::Join, Resume::After);
    let attach = shared.hub.attach(session, from);
    let follow = Follow {
        shared,
        session,
        pending: attach
            .gap
            .map(Arc::new)
            .into_iter()
            .chain(attach.replay)
            .collect(),
        receiver: attach.receiver,
        last: match from {
            Resume::After(id) => Some(id),
            _ => None,
        },
        turn: None,
    };
    if follow.idle() {
        return Ok(sse_response(stream::empty()));
    }
    Ok(follow.into_response())
}

fn sse_response(events: impl Stream<Item = Event> + Send + 'static) -> Response {
    use futures::StreamExt;
    // Counted while the stream lives (it owns the gauge).
    let client = crate::metrics::ClientGauge::sse();
    Sse::new(events.map(move |e| {
        let _open = &client;
        Ok::<Event, Infallible>(e)
    }))
    .keep_alive(KeepAlive::default())
    .into_response()
}
