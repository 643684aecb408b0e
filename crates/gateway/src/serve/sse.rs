//! A send whose answer streams as server-sent events: the turn's frames,
//! each an event named by its `type` with the frame as JSON data, ending
//! after `turn_committed` or `turn_failed`. A reader too slow for the
//! dialog's buffer gets a `resync` event where frames were dropped.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream};
use keel_core::SessionId;
use tokio::sync::broadcast::error::RecvError;

use super::api::IfBusy;
use super::frames::ServerFrame;
use super::hub::SharedFrame;
use super::problem::ApiResult;
use super::Shared;

fn event(frame: &ServerFrame) -> Event {
    Event::default()
        .event(frame.kind())
        .data(serde_json::to_string(frame).unwrap_or_default())
}

/// Starts a turn and answers with its frames as an SSE stream.
pub(crate) async fn send_streamed(
    shared: Arc<Shared>,
    session: SessionId,
    text: String,
    if_busy: IfBusy,
) -> ApiResult<Response> {
    // Subscribed before the turn starts, so its first frame is not missed.
    // A steer streams the rest of the turn it went into.
    let receiver = shared.hub.subscribe(session);
    let turn = shared.turns.send(session, text, if_busy).await?.0.as_uuid();
    let frames = stream::unfold(Some(receiver), move |receiver| {
        let shared = shared.clone();
        async move {
            let mut receiver = receiver?;
            loop {
                let frame: SharedFrame = match receiver.recv().await {
                    Ok(frame) => frame,
                    Err(RecvError::Lagged(_)) => {
                        let resync = shared
                            .resync(
                                session,
                                "the stream was read too slowly; frames were dropped",
                            )
                            .await;
                        return Some((event(&resync), Some(receiver)));
                    }
                    Err(RecvError::Closed) => return None,
                };
                if frame.turn_id() != Some(turn) {
                    continue;
                }
                let next = (!frame.ends_turn()).then_some(receiver);
                return Some((event(&frame), next));
            }
        }
    });
    Ok(sse_response(frames))
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
