//! Resumable turn streams against a real server: a client cut off at any
//! frame reconnects with its last event id (SSE `Last-Event-ID`, WebSocket
//! `resume_from`) and reassembles exactly the committed answer; a stream
//! joined after the turn ended gets its rest and ends; ids older than the
//! replay window get a `replay_gap`.

use std::sync::Arc;

use async_trait::async_trait;
use futures::StreamExt;
use keel_core::provider::{ChatRequest, FinishReason, ProviderError, ProviderStream, StreamEvent};
use keel_core::{CancellationToken, Provider};
use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::{Setup, TestServer};

/// Cut points from a fixed seed (xorshift64), in `1..=DELTAS`.
struct Cuts(u64);

impl Cuts {
    fn next(&mut self) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % DELTAS as u64) as usize + 1
    }
}

/// Deltas of every answer.
const DELTAS: usize = 200;
/// Cut points tried per transport.
const CUTS: usize = 50;

/// A provider answering with [`DELTAS`] deltas, each waiting for a permit
/// of the gate in force when the answer began.
struct DripProvider {
    gate: Mutex<Arc<Semaphore>>,
}

impl DripProvider {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            gate: Mutex::new(Arc::new(Semaphore::new(0))),
        })
    }

    /// A fresh gate with `permits`, for the next answer.
    fn regate(&self, permits: usize) -> Arc<Semaphore> {
        let gate = Arc::new(Semaphore::new(permits));
        *self.gate.lock() = gate.clone();
        gate
    }
}

/// The text of delta `i`: every delta differs, so a repeat or a loss shows.
fn word(i: usize) -> String {
    format!("w{i} ")
}

#[async_trait]
impl Provider for DripProvider {
    fn name(&self) -> &str {
        "drip"
    }

    fn model(&self) -> &str {
        "drip"
    }

    async fn stream(
        &self,
        _request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let gate = self.gate.lock().clone();
        let deltas = futures::stream::unfold(0usize, move |i| {
            let (gate, cancel) = (gate.clone(), cancel.clone());
            async move {
                if i == DELTAS {
                    return None;
                }
                let event = tokio::select! {
                    _ = cancel.cancelled() => Err(ProviderError::Cancelled),
                    permit = gate.acquire() => {
                        permit.unwrap().forget();
                        Ok(StreamEvent::TextDelta { text: word(i) })
                    }
                };
                Some((event, i + 1))
            }
        });
        let finish = futures::stream::iter([Ok(StreamEvent::Finish {
            reason: FinishReason::Stop,
        })]);
        Ok(deltas.chain(finish).boxed())
    }
}

async fn server(provider: Arc<DripProvider>, extra: &str) -> TestServer {
    TestServer::start(Setup {
        provider,
        config: format!("[session]\nauto_title_after_n_messages = 0\n{extra}"),
        ..Setup::default()
    })
    .await
}

/// The dialog's last assistant message, as committed.
async fn committed_answer(s: &TestServer, dialog: &str) -> String {
    let page = s
        .json(&format!(
            "/api/dialogs/{dialog}/messages?order=desc&limit=5"
        ))
        .await;
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "assistant")
        .map(|m| m["text"].as_str().unwrap().to_owned())
        .expect("an assistant message")
}

/// One SSE event: its name, id and JSON data.
#[derive(Debug)]
pub(super) struct SseEvent {
    pub(super) name: String,
    pub(super) id: Option<u64>,
    pub(super) data: Value,
}

/// Reads SSE events off a response body.
pub(super) struct SseReader {
    body: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buffer: String,
}

impl SseReader {
    pub(super) fn new(response: reqwest::Response) -> Self {
        assert_eq!(response.status(), 200);
        Self {
            body: response.bytes_stream().boxed(),
            buffer: String::new(),
        }
    }

    /// The next event, `None` at the end of the body.
    pub(super) async fn next(&mut self) -> Option<SseEvent> {
        // Keep-alive comments do not count: an event within 30 s.
        tokio::time::timeout(std::time::Duration::from_secs(30), self.event())
            .await
            .expect("an event or the end within 30 s")
    }

    async fn event(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let (mut name, mut id, mut data) = (None, None, String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event: ") {
                        name = Some(v.to_owned());
                    } else if let Some(v) = line.strip_prefix("id: ") {
                        id = Some(v.parse().unwrap());
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        data.push_str(v);
                    }
                }
                // Keep-alive comments carry no event.
                let Some(name) = name else { continue };
                return Some(SseEvent {
                    name,
                    id,
                    data: serde_json::from_str(&data).unwrap(),
                });
            }
            let chunk = self.body.next().await?;
            self.buffer
                .push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
    }
}

/// Appends a frame's text; checks ids only increase. Whether it ended the turn.
fn take(
    text: &mut String,
    last: &mut Option<u64>,
    name: &str,
    id: Option<u64>,
    data: &Value,
) -> bool {
    let id = id.unwrap_or_else(|| panic!("{name} without an id"));
    assert!(last.is_none_or(|l| id > l), "{name} id {id} after {last:?}");
    *last = Some(id);
    assert_eq!(data["event_id"], json!(id), "the frame carries its id");
    if name == "text_delta" {
        text.push_str(data["text"].as_str().unwrap());
    }
    assert_ne!(name, "turn_failed", "{data}");
    name == "turn_committed"
}

#[tokio::test]
async fn an_sse_client_cut_off_at_any_frame_resumes_with_exactly_the_committed_answer() {
    let provider = DripProvider::new();
    let s = server(provider.clone(), "").await;
    let mut cuts = Cuts(26);
    for _ in 0..CUTS {
        let dialog = s.dialog("cut").await;
        // Frames before the cut: turn_started and `cut - 1` deltas.
        let cut = cuts.next();
        let gate = provider.regate(cut - 1);
        let response = s
            .http
            .post(format!("{}/api/dialogs/{dialog}/messages", s.base))
            .header("accept", "text/event-stream")
            .json(&json!({"text": "stream"}))
            .send()
            .await
            .unwrap();
        let mut reader = SseReader::new(response);
        let (mut text, mut last) = (String::new(), None);
        for _ in 0..cut {
            let e = reader.next().await.unwrap();
            take(&mut text, &mut last, &e.name, e.id, &e.data);
        }
        drop(reader);
        // The rest streams while nobody listens; the reconnect may come
        // before, during or after the turn's end.
        gate.add_permits(DELTAS);
        let response = s
            .http
            .get(format!("{}/api/dialogs/{dialog}/stream", s.base))
            .header("last-event-id", last.unwrap().to_string())
            .send()
            .await
            .unwrap();
        let mut reader = SseReader::new(response);
        loop {
            let e = reader.next().await.expect("the stream ends after the turn");
            if take(&mut text, &mut last, &e.name, e.id, &e.data) {
                break;
            }
        }
        assert!(
            reader.next().await.is_none(),
            "nothing after the turn ended"
        );
        let answer: String = (0..DELTAS).map(word).collect();
        assert_eq!(text, answer, "cut after frame {cut}");
        assert_eq!(committed_answer(&s, &dialog).await, answer);
    }
}

/// A turn frame's event id and text; panics on anything but turn frames of `turn`.
fn turn_frame(frame: &ServerFrame, turn: Uuid) -> (u64, Option<&str>, bool) {
    assert_eq!(frame.turn_id(), Some(turn), "{frame:?}");
    let text = match frame {
        ServerFrame::TextDelta { text, .. } => Some(text.as_str()),
        ServerFrame::TurnFailed { message, .. } => panic!("the turn failed: {message}"),
        _ => None,
    };
    (
        frame.event_id().expect("a turn frame has an id"),
        text,
        frame.ends_turn(),
    )
}

#[tokio::test]
async fn a_websocket_client_cut_off_at_any_frame_resumes_with_exactly_the_committed_answer() {
    let provider = DripProvider::new();
    let s = server(provider.clone(), "").await;
    let mut cuts = Cuts(62);
    for _ in 0..CUTS {
        let session_id = Uuid::parse_str(&s.dialog("cut").await).unwrap();
        let cut = cuts.next();
        let gate = provider.regate(cut - 1);
        let mut ws = s.ws().await;
        ws.send(&ClientFrame::Send {
            id: Some("s".into()),
            session_id,
            text: Some("stream".into()),
            parts: Vec::new(),
            if_busy: None,
            webhook: None,
        })
        .await;
        let (mut text, mut last, mut turn, mut deltas) = (String::new(), 0, None, 0);
        // Deltas queued together arrive merged: read until `cut - 1` deltas arrived.
        while turn.is_none() || last == 0 || deltas < cut - 1 {
            match ws.frame().await {
                ServerFrame::TurnAccepted { turn_id, .. } => turn = Some(turn_id),
                f @ (ServerFrame::TurnStarted { .. } | ServerFrame::TextDelta { .. }) => {
                    let (id, t, _) = turn_frame(&f, f.turn_id().unwrap());
                    assert!(id > last);
                    last = id;
                    if let Some(t) = t {
                        text.push_str(t);
                        deltas += t.matches(' ').count();
                    }
                }
                other => assert!(
                    matches!(
                        other,
                        ServerFrame::Subscribed { .. } | ServerFrame::DialogUpdated { .. }
                    ),
                    "{other:?}"
                ),
            }
        }
        let turn = turn.unwrap();
        drop(ws);
        gate.add_permits(DELTAS);
        let mut ws = s.ws().await;
        ws.send(&ClientFrame::Subscribe {
            id: Some("r".into()),
            session_id,
            since_revision: None,
            resume_from: Some(last),
            join: false,
        })
        .await;
        assert!(matches!(ws.frame().await, ServerFrame::Subscribed { .. }));
        loop {
            let f = ws.frame().await;
            if matches!(f, ServerFrame::DialogUpdated { .. }) {
                continue;
            }
            let (id, t, end) = turn_frame(&f, turn);
            assert!(
                id > last,
                "frame {id} after {last}: sent twice or out of order"
            );
            last = id;
            text.extend(t);
            if end {
                break;
            }
        }
        let answer: String = (0..DELTAS).map(word).collect();
        assert_eq!(text, answer, "cut after {cut} deltas");
        assert_eq!(committed_answer(&s, &session_id.to_string()).await, answer);
    }
}

#[tokio::test]
async fn a_stream_joined_after_the_turn_ended_gets_its_rest_and_ends() {
    let provider = DripProvider::new();
    let s = server(provider.clone(), "").await;
    let dialog = s.dialog("ended").await;
    provider.regate(DELTAS);
    let response = s
        .http
        .post(format!("{}/api/dialogs/{dialog}/messages", s.base))
        .header("accept", "text/event-stream")
        .json(&json!({"text": "stream"}))
        .send()
        .await
        .unwrap();
    let mut whole = SseReader::new(response);
    let mut events = Vec::new();
    while let Some(e) = whole.next().await {
        events.push(e);
    }
    assert_eq!(events.last().unwrap().name, "turn_committed");
    // From the fifth frame on: exactly the frames the first stream had after it.
    let fifth = events[4].id.unwrap();
    let response = s
        .http
        .get(format!(
            "{}/api/dialogs/{dialog}/stream?last_event_id={fifth}",
            s.base
        ))
        .send()
        .await
        .unwrap();
    let mut rest = SseReader::new(response);
    let mut ids = Vec::new();
    while let Some(e) = rest.next().await {
        ids.push(e.id.unwrap());
    }
    let expected: Vec<u64> = events[5..].iter().map(|e| e.id.unwrap()).collect();
    assert_eq!(ids, expected);
    // Caught up and nothing running: the stream ends at once, empty.
    let last = expected.last().unwrap();
    let caught_up = s
        .get(&format!(
            "/api/dialogs/{dialog}/stream?last_event_id={last}"
        ))
        .await;
    assert_eq!(caught_up.status(), 200);
    assert_eq!(caught_up.text().await.unwrap(), "");
    // Joining with no id and nothing running: empty too.
    let joined = s.get(&format!("/api/dialogs/{dialog}/stream")).await;
    assert_eq!(joined.text().await.unwrap(), "");
}

#[tokio::test]
async fn a_joined_stream_starts_at_the_running_turns_first_frame() {
    let provider = DripProvider::new();
    let s = server(provider.clone(), "").await;
    let dialog = s.dialog("join").await;
    let gate = provider.regate(3);
    let accepted = s
        .post(
            &format!("/api/dialogs/{dialog}/messages"),
            json!({"text": "go"}),
        )
        .await;
    assert_eq!(accepted.status(), 202);
    let response = s
        .http
        .get(format!("{}/api/dialogs/{dialog}/stream", s.base))
        .send()
        .await
        .unwrap();
    let mut reader = SseReader::new(response);
    let first = reader.next().await.unwrap();
    assert_eq!(first.name, "turn_started", "{first:?}");
    let (mut text, mut last) = (String::new(), first.id);
    gate.add_permits(DELTAS);
    loop {
        let e = reader.next().await.unwrap();
        if take(&mut text, &mut last, &e.name, e.id, &e.data) {
            break;
        }
    }
    assert_eq!(text, (0..DELTAS).map(word).collect::<String>());
    assert!(reader.next().await.is_none());
}

#[tokio::test]
async fn an_id_past_the_replay_window_gets_a_replay_gap() {
    let provider = DripProvider::new();
    // Room for a few dozen frames of the 200.
    let s = server(provider.clone(), "[server]\nstream_replay_bytes = 4096\n").await;
    let dialog = s.dialog("gap").await;
    let session_id = Uuid::parse_str(&dialog).unwrap();
    provider.regate(DELTAS);
    let response = s
        .http
        .post(format!("{}/api/dialogs/{dialog}/messages", s.base))
        .header("accept", "text/event-stream")
        .json(&json!({"text": "stream"}))
        .send()
        .await
        .unwrap();
    let mut whole = SseReader::new(response);
    let first = whole.next().await.unwrap().id.unwrap();
    while whole.next().await.is_some() {}
    let response = s
        .http
        .get(format!("{}/api/dialogs/{dialog}/stream", s.base))
        .header("last-event-id", first.to_string())
        .send()
        .await
        .unwrap();
    let mut reader = SseReader::new(response);
    let gap = reader.next().await.unwrap();
    assert_eq!(gap.name, "replay_gap");
    assert_eq!(gap.data["after_event_id"], json!(first));
    insta::assert_snapshot!(gap.data["reason"].as_str().unwrap());
    // Then what is still kept, the turn's end last, and nothing runs: the end.
    let mut kept = Vec::new();
    while let Some(e) = reader.next().await {
        assert!(e.id.unwrap() > first);
        kept.push(e.name);
    }
    assert_eq!(kept.last().map(String::as_str), Some("turn_committed"));
    assert!(
        kept.len() < DELTAS / 2,
        "{} frames kept in 4 KiB",
        kept.len()
    );
    // The WebSocket says the same.
    let mut ws = s.ws().await;
    ws.send(&ClientFrame::Subscribe {
        id: None,
        session_id,
        since_revision: None,
        resume_from: Some(first),
        join: false,
    })
    .await;
    assert!(matches!(ws.frame().await, ServerFrame::Subscribed { .. }));
    assert!(
        matches!(ws.frame().await, ServerFrame::ReplayGap { after_event_id, .. } if after_event_id == first)
    );
    // An id that is no number, or empty, is refused.
    for id in ["yesterday", ""] {
        let bad = s
            .http
            .get(format!("{}/api/dialogs/{dialog}/stream", s.base))
            .header("last-event-id", id)
            .send()
            .await
            .unwrap();
        assert_eq!(bad.status(), 400, "{id:?}");
    }
    // So is one past an int64, in the header or the query, as documented.
    let past = i64::MAX as u64 + 1;
    let header = s
        .http
        .get(format!("{}/api/dialogs/{dialog}/stream", s.base))
        .header("last-event-id", past.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(header.status(), 400);
    let query = s
        .http
        .get(format!(
            "{}/api/dialogs/{dialog}/stream?last_event_id={past}",
            s.base
        ))
        .header("last-event-id", "0")
        .send()
        .await
        .unwrap();
    assert_eq!(query.status(), 400);
}
