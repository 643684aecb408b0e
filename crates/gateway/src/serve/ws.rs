//! The WebSocket at `/api/ws`. One task per connection reads client
//! frames, writes queued server frames and closes with "going away" on
//! shutdown. Each request runs in its own task (at most
//! [`MAX_IN_FLIGHT`] at once) and each subscription forwards its dialog's
//! frames into the connection's bounded queue: a client that reads slowly
//! makes its subscriptions wait, their dialog buffers drop its oldest
//! frames, and it gets a `resync` — the server's memory stays bounded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use keel_core::SessionId;
use keel_store::RunQuery;
use parking_lot::Mutex;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::AbortHandle;

use super::frames::{ClientFrame, ServerFrame, MAX_REQUEST_ID_BYTES};
use super::hub::{Resume, SharedFrame};
use super::problem::{ApiError, ApiResult};
use super::routes::{checked_text, decode_cursor, page_limit};
use super::Shared;

/// Requests of one connection handled at once; more are refused with status 429.
pub const MAX_IN_FLIGHT: usize = 16;
/// Dialogs one connection may subscribe to.
pub const MAX_SUBSCRIPTIONS: usize = 64;
/// Most frames a subscription takes from its dialog at once.
const FORWARD_BATCH: usize = 64;
/// How long one frame may take to write before the connection is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Close codes (RFC 6455).
mod close {
    /// The server is shutting down.
    pub(super) const GOING_AWAY: u16 = 1001;
    /// A violation of RFC 6455: an unmasked client frame, an oversized or
    /// fragmented control frame, a reserved bit or opcode.
    pub(super) const PROTOCOL: u16 = 1002;
    /// A binary frame: not part of the protocol.
    pub(super) const UNSUPPORTED: u16 = 1003;
    /// A text frame that is not UTF-8.
    pub(super) const INVALID_PAYLOAD: u16 = 1007;
    /// A frame over the size limit.
    pub(super) const TOO_BIG: u16 = 1009;
    /// Nothing, not even a pong, arrived for the idle timeout.
    pub(super) const POLICY: u16 = 1008;
}

/// The close code RFC 6455 gives the read error `e`, if the connection can
/// still carry a close frame (not after an I/O error).
fn close_code(e: axum::Error) -> Option<(u16, String)> {
    use tungstenite::Error as E;
    let e = e.into_inner().downcast::<E>().ok()?;
    let code = match *e {
        E::Utf8(_) => close::INVALID_PAYLOAD,
        E::Capacity(_) => close::TOO_BIG,
        E::Protocol(_) | E::AttackAttempt => close::PROTOCOL,
        _ => return None,
    };
    Some((code, e.to_string()))
}

/// `GET /api/ws`: upgrades to the WebSocket protocol.
pub(crate) async fn upgrade(
    State(shared): State<Arc<Shared>>,
    busy: Option<axum::Extension<super::connections::Busy>>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let ws = match ws {
        Ok(ws) => ws,
        Err(rejection) => {
            return ApiError::BadRequest(format!(
                "{}; connect with a WebSocket client",
                rejection.body_text()
            ))
            .into_response()
        }
    };
    let max = shared.limits.max_frame_bytes;
    ws.max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| {
            let tracker = shared.sockets.clone();
            let (connection, queue) = Connection::new(shared);
            tracker.track_future(async move {
                // The socket keeps its connection's slot until it closes.
                let _busy = busy;
                let _client = crate::metrics::ClientGauge::websocket();
                connection.serve(socket, queue).await;
            })
        })
}

/// One connection's state shared with its request tasks.
struct Connection {
    shared: Arc<Shared>,
    out: mpsc::Sender<SharedFrame>,
    subscriptions: Mutex<HashMap<SessionId, AbortHandle>>,
    in_flight: Arc<Semaphore>,
}

fn error_frame(id: Option<String>, e: &ApiError) -> ServerFrame {
    ServerFrame::Error {
        id,
        status: e.status().as_u16(),
        code: e.code().to_owned(),
        detail: e.to_string(),
    }
}

fn text(frame: &ServerFrame) -> Message {
    Message::Text(Utf8Bytes::from(
        serde_json::to_string(frame).unwrap_or_default(),
    ))
}

/// `text` cut to what a close frame carries (123 bytes), at a character boundary.
fn close_reason(text: &str) -> String {
    let mut end = text.len().min(123);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

fn close_message(code: u16, reason: &str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: Utf8Bytes::from(reason),
    }))
}

impl Connection {
    /// A connection and the queue of frames to write to it.
    fn new(shared: Arc<Shared>) -> (Arc<Self>, mpsc::Receiver<SharedFrame>) {
        let (out, queue) = mpsc::channel(shared.limits.connection_queue.max(1));
        let connection = Arc::new(Self {
            shared,
            out,
            subscriptions: Mutex::new(HashMap::new()),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        });
        (connection, queue)
    }

    async fn serve(self: Arc<Self>, socket: WebSocket, mut queue: mpsc::Receiver<SharedFrame>) {
        let (mut sink, mut incoming) = socket.split();
        let closing = self.shared.closing.clone();
        // A socket holds a connection slot and counts as busy, so one that
        // sends nothing is closed after the idle timeout; a ping halfway
        // lets a live client (browsers answer pings themselves) show it is.
        let idle = self.shared.socket_idle;
        let mut heard = tokio::time::Instant::now();
        let mut pinged = false;
        let end = loop {
            let ping_at = heard + idle / 2;
            tokio::select! {
                biased;
                () = closing.cancelled() => {
                    break Some(close_message(close::GOING_AWAY, "the server is shutting down"));
                }
                () = tokio::time::sleep_until(ping_at), if !pinged => {
                    pinged = true;
                    let ping = sink.send(Message::Ping(axum::body::Bytes::new()));
                    if !matches!(tokio::time::timeout(WRITE_TIMEOUT, ping).await, Ok(Ok(()))) {
                        break None;
                    }
                }
                () = tokio::time::sleep_until(heard + idle) => {
                    break Some(close_message(
                        close::POLICY,
                        &format!("nothing arrived for {} s, not even a pong (server.idle_timeout_secs)", idle.as_secs()),
                    ));
                }
                Some(frame) = queue.recv() => {
                    // Everything queued goes out with one flush, adjacent
                    // text deltas of a turn merged into one frame.
                    let mut batch = vec![frame];
                    while let Ok(more) = queue.try_recv() {
                        batch.push(more);
                    }
                    let write = async {
                        for frame in coalesce(batch) {
                            sink.feed(text(&frame)).await?;
                        }
                        sink.flush().await
                    };
                    match tokio::time::timeout(WRITE_TIMEOUT, write).await {
                        Ok(Ok(())) => {}
                        _ => break None,
                    }
                }
                message = incoming.next() => {
                    (heard, pinged) = (tokio::time::Instant::now(), false);
                    match message {
                    Some(Ok(Message::Text(t))) => self.clone().request(t.as_str()),
                    Some(Ok(Message::Binary(_))) => {
                        break Some(close_message(close::UNSUPPORTED, "binary frames are not part of the protocol; send JSON text"));
                    }
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Ok(Message::Close(_))) | None => break None,
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "WebSocket read failed");
                        break close_code(e).map(|(code, why)| {
                            close_message(code, &close_reason(&format!("frame refused: {why}")))
                        });
                    }
                }},
            }
        };
        if let Some(message) = end {
            let _ = tokio::time::timeout(WRITE_TIMEOUT, sink.send(message)).await;
        }
        let _ = sink.close().await;
        for (_, handle) in self.subscriptions.lock().drain() {
            handle.abort();
        }
    }

    /// Handles one text frame in a task of its own.
    fn request(self: Arc<Self>, text: &str) {
        let (id, parsed) = parse(text);
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            let frame = ServerFrame::Error {
                id,
                status: 429,
                code: "too_many_requests".to_owned(),
                detail: format!("at most {MAX_IN_FLIGHT} requests of one connection run at once"),
            };
            let _ = self.out.try_send(Arc::new(frame));
            return;
        };
        tokio::spawn(async move {
            let answers = match parsed {
                Ok(frame) => self.handle(frame).await,
                Err(e) => Err(e),
            };
            let answers = answers.unwrap_or_else(|e| vec![error_frame(id, &e)]);
            for frame in answers {
                if self.out.send(Arc::new(frame)).await.is_err() {
                    break;
                }
            }
            drop(permit);
        });
    }

    async fn handle(self: &Arc<Self>, frame: ClientFrame) -> ApiResult<Vec<ServerFrame>> {
        let shared = &self.shared;
        match frame {
            ClientFrame::Subscribe {
                id,
                session_id,
                since_revision,
                resume_from,
                join,
            } => {
                let resume = match (resume_from, join) {
                    (Some(after), _) => Resume::After(after),
                    (None, true) => Resume::Join,
                    (None, false) => Resume::Live,
                };
                self.subscribe(id, session_id.into(), since_revision, resume)
                    .await
            }
            ClientFrame::Unsubscribe { id, session_id } => {
                if let Some(handle) = self.subscriptions.lock().remove(&session_id.into()) {
                    handle.abort();
                }
                Ok(vec![ServerFrame::Unsubscribed { id, session_id }])
            }
            ClientFrame::Send {
                id,
                session_id,
                text,
                parts,
                if_busy,
                webhook,
            } => {
                let session = shared.live_dialog(session_id.into()).await?;
                let if_busy = if_busy.unwrap_or_default();
                let webhook = shared.checked_webhook(webhook, if_busy)?;
                let input = shared.user_input(session, text, parts).await?;
                if !self.subscriptions.lock().contains_key(&session) {
                    self.subscribe(None, session, None, Resume::Live).await?;
                }
                let (turn, steered) = shared.turns.send(session, input, if_busy, webhook).await?;
                Ok(vec![ServerFrame::TurnAccepted {
                    id,
                    session_id,
                    turn_id: turn.as_uuid(),
                    steered,
                }])
            }
            ClientFrame::Stop { id, session_id } => {
                let session = shared.dialog_by_id(session_id.into()).await?.id;
                Ok(vec![ServerFrame::Stopped {
                    id,
                    session_id,
                    stopped: shared.turns.stop(session).await?,
                }])
            }
            ClientFrame::Steer {
                id,
                session_id,
                text,
            } => {
                let session = shared.dialog_by_id(session_id.into()).await?.id;
                let report = shared.turns.steer(session, checked_text(text)?).await?;
                Ok(vec![ServerFrame::Steered {
                    id,
                    session_id,
                    steered: report.steered,
                    turn_id: report.turn_id,
                }])
            }
            ClientFrame::GetAgentRuns {
                id,
                session_id,
                cursor,
                limit,
            } => {
                let session = shared.dialog_by_id(session_id.into()).await?.id;
                let cursor = match cursor.as_deref() {
                    None => None,
                    Some(c) => {
                        let (created_at_ms, id) = decode_cursor(c)?;
                        Some(keel_store::RunCursor { created_at_ms, id })
                    }
                };
                let page = shared
                    .run_page(RunQuery {
                        root_session_id: Some(session),
                        limit: page_limit(limit)?,
                        cursor,
                        ..RunQuery::default()
                    })
                    .await?;
                Ok(vec![ServerFrame::AgentRuns {
                    id,
                    session_id,
                    revision: page.revision.unwrap_or(0),
                    runs: page.items,
                    next_cursor: page.next_cursor,
                }])
            }
        }
    }

    /// Subscribes to `session`: the answer, the replay of changes at or
    /// after `since` (or a `resync` when there are too many), the turn
    /// frames `resume` asks for (or a `replay_gap`), then live frames.
    async fn subscribe(
        self: &Arc<Self>,
        id: Option<String>,
        session: SessionId,
        since: Option<u64>,
        resume: Resume,
    ) -> ApiResult<Vec<ServerFrame>> {
        let shared = &self.shared;
        shared.dialog_by_id(session).await?;
        if let Some(old) = self.subscriptions.lock().remove(&session) {
            old.abort();
        }
        if self.subscriptions.lock().len() >= MAX_SUBSCRIPTIONS {
            return Err(ApiError::Conflict(format!(
                "a connection may subscribe to at most {MAX_SUBSCRIPTIONS} dialogs"
            )));
        }
        let attach = shared.hub.attach(session, resume);
        let receiver = attach.receiver;
        shared.turns.follow_continuations(session).await;
        let watched_from = shared.projections.watch(session).await?;
        let session_id = session.as_uuid();
        let (revision, replay) = match since {
            None => (watched_from, Vec::new()),
            Some(since) => match shared.projections.replay(session, since).await? {
                (now, Some(frames)) => (now, frames),
                (now, None) => (
                    now,
                    vec![ServerFrame::Resync {
                        session_id,
                        revision: now,
                        reason: format!(
                            "revision {since} is too old or unknown to replay; re-read the runs"
                        ),
                    }],
                ),
            },
        };
        // The answer and the replays are queued before any live frame.
        let answers = std::iter::once(ServerFrame::Subscribed {
            id,
            session_id,
            revision,
        })
        .chain(replay)
        .chain(attach.gap)
        .map(Arc::new)
        .chain(attach.replay);
        for frame in answers {
            self.out
                .send(frame)
                .await
                .map_err(|_| ApiError::Conflict("the connection closed".to_owned()))?;
        }
        // Live frames already in the replay are skipped.
        let skip_through = since.map(|_| revision);
        let forward = tokio::spawn(forward(
            shared.clone(),
            session,
            receiver,
            self.out.clone(),
            skip_through,
        ));
        self.subscriptions
            .lock()
            .insert(session, forward.abort_handle());
        Ok(Vec::new())
    }
}

/// `frames` with each run of adjacent `text_delta`s of one turn merged into one.
fn coalesce(frames: Vec<SharedFrame>) -> Vec<SharedFrame> {
    let mut out: Vec<SharedFrame> = Vec::with_capacity(frames.len());
    for frame in frames {
        if let (
            Some(ServerFrame::TextDelta {
                session_id,
                turn_id,
                text,
                ..
            }),
            ServerFrame::TextDelta {
                turn_id: next_turn,
                text: next,
                event_id,
                ..
            },
        ) = (out.last().map(|f| f.as_ref()), frame.as_ref())
        {
            if turn_id == next_turn {
                // The merged frame stands for the last one: its id is where to resume.
                let merged = ServerFrame::TextDelta {
                    session_id: *session_id,
                    event_id: *event_id,
                    turn_id: *turn_id,
                    text: format!("{text}{next}"),
                };
                if let Some(last) = out.last_mut() {
                    *last = Arc::new(merged);
                }
                continue;
            }
        }
        out.push(frame);
    }
    out
}

/// Parses a client frame; the error says what was wrong, with the frame's `id` if it had one.
fn parse(text: &str) -> (Option<String>, ApiResult<ClientFrame>) {
    let id = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v.get("id").and_then(|i| i.as_str()).map(str::to_owned))
        .filter(|id| id.len() <= MAX_REQUEST_ID_BYTES);
    let frame = serde_json::from_str::<ClientFrame>(text)
        .map_err(|e| ApiError::BadRequest(format!("invalid frame: {e}")))
        .and_then(|frame| {
            let too_long = match &frame {
                ClientFrame::Subscribe { id, .. }
                | ClientFrame::Unsubscribe { id, .. }
                | ClientFrame::Send { id, .. }
                | ClientFrame::Stop { id, .. }
                | ClientFrame::Steer { id, .. }
                | ClientFrame::GetAgentRuns { id, .. } => {
                    id.as_ref().is_some_and(|i| i.len() > MAX_REQUEST_ID_BYTES)
                }
            };
            if too_long {
                Err(ApiError::BadRequest(format!(
                    "id is longer than {MAX_REQUEST_ID_BYTES} bytes"
                )))
            } else {
                Ok(frame)
            }
        });
    (id, frame)
}

/// Forwards a dialog's frames to a connection's queue, waiting while it is
/// full; frames the dialog's buffer dropped meanwhile become one `resync`.
async fn forward(
    shared: Arc<Shared>,
    session: SessionId,
    mut receiver: tokio::sync::broadcast::Receiver<SharedFrame>,
    out: mpsc::Sender<SharedFrame>,
    skip_through: Option<u64>,
) {
    let lagged = || {
        shared.resync(
            session,
            "frames were dropped because this connection read too slowly",
        )
    };
    loop {
        let first = match receiver.recv().await {
            Ok(frame) => frame,
            Err(RecvError::Lagged(_)) => Arc::new(lagged().await),
            Err(RecvError::Closed) => return,
        };
        // Frames already waiting go on together, adjacent text deltas merged.
        let mut batch = vec![first];
        while batch.len() < FORWARD_BATCH {
            match receiver.try_recv() {
                Ok(frame) => batch.push(frame),
                Err(TryRecvError::Lagged(_)) => batch.push(Arc::new(lagged().await)),
                Err(TryRecvError::Empty | TryRecvError::Closed) => break,
            }
        }
        for frame in coalesce(batch) {
            if let (Some(skip), Some(revision)) = (skip_through, frame.revision()) {
                if revision <= skip {
                    continue;
                }
            }
            if out.send(frame).await.is_err() {
                return;
            }
        }
    }
}
