//! Turns another process runs, live here: on a database several processes
//! serve (keel-store's `Relay`), the frames a dialog's turn publishes in
//! the process that runs it reach the clients of every other process.
//!
//! - **Out.** The [`Hub`] passes each frame published here that the others
//!   cannot derive themselves ([`Outgoing::crosses`]: turn frames, dialog
//!   and approval changes) to one sending task, which relays them in
//!   order, adjacent text deltas of a turn merged over [`COALESCE`] (one
//!   notification per token would be wasteful). Runs that change here send
//!   a bare "changed" note ([`Hub::relay_changed`]).
//! - **In.** A receiving task publishes what the others relay into the
//!   local hub ([`Hub::publish_relayed`]: this process's own event ids,
//!   never relayed back), only for dialogs watched here; a turn's end or a
//!   "changed" note refreshes the dialog's projections, which read runs and
//!   inbox events from the database by revision. A frame too long to relay,
//!   or messages lost to a broken connection, become a `replay_gap` for the
//!   dialogs concerned: their clients re-read the messages.
//!
//! - **Control.** A client may ask any process to stop or steer a dialog:
//!   `/stop` is relayed to every process, which stops what it runs of the
//!   dialog; a steer is relayed when another process runs the dialog's
//!   turn, and that process answers (see `TurnRunner::stop` and
//!   `TurnRunner::steer`).
//!
//! Agent frames (`agent_run_updated` …) never cross: each process derives
//! its own from the database.

use std::sync::Arc;
use std::time::Duration;

use keel_core::SessionId;
use keel_store::{Relay, Relayed};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::frames::ServerFrame;
use super::hub::Hub;
use super::projection::Projections;
use super::turns::TurnRunner;

/// How long text deltas are gathered before they are relayed as one.
pub(crate) const COALESCE: Duration = Duration::from_millis(30);

/// How long a shutdown waits for the last frames to be relayed.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Most text one relayed delta carries, in bytes (well under the relay's
/// limit, whatever JSON escaping adds to ordinary text).
const DELTA_TEXT_BYTES: usize = 2048;

/// What this process tells the others, in the order it happened.
#[derive(Debug)]
pub(crate) enum Outgoing {
    /// A frame published here.
    Frame(SessionId, Box<ServerFrame>),
    /// The session's runs or inbox changed here.
    Changed(SessionId),
    /// A client here stopped the session: the others stop what they run of it.
    Stop(SessionId),
    /// A client here steers the session's turn, which another process runs.
    Steer {
        /// The session.
        session: SessionId,
        /// Matches the answer ([`Outgoing::Steered`]) to the ask.
        request: uuid::Uuid,
        /// The text for the turn.
        text: String,
    },
    /// How a steer another process relayed went here (sent only by the
    /// process running the session's turn).
    Steered {
        /// The session.
        session: SessionId,
        /// The ask's [`Outgoing::Steer::request`].
        request: uuid::Uuid,
        /// What became of the text.
        answer: SteerAnswer,
    },
}

/// What the process running a turn did with a relayed steer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum SteerAnswer {
    /// The turn took the text.
    Steered {
        /// The turn.
        turn_id: uuid::Uuid,
    },
    /// The turn's steer mailbox is full.
    Full {
        /// How many steers it holds.
        capacity: usize,
    },
}

impl Outgoing {
    /// Whether the other processes need `frame` from this one: turn
    /// frames, dialog and approval changes. Agent frames and resyncs they
    /// derive from the database themselves.
    pub(crate) fn crosses(frame: &ServerFrame) -> bool {
        frame.turn_id().is_some()
            || matches!(
                frame,
                ServerFrame::DialogUpdated { .. }
                    | ServerFrame::ApprovalRequested { .. }
                    | ServerFrame::ApprovalDecided { .. }
            )
    }
}

/// A relayed message's payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Note {
    /// A frame to publish (its `event_id` unset).
    Frame(Box<ServerFrame>),
    /// The session's runs or inbox changed: refresh its projections.
    Changed,
    /// Stop what runs of the session here, as `/stop` does.
    Stop,
    /// Give `text` to the session's turn if it runs here, and answer.
    Steer {
        /// The ask, repeated in the answer.
        request: uuid::Uuid,
        /// The text.
        text: String,
    },
    /// The answer to a relayed steer.
    Steered {
        /// The ask's id.
        request: uuid::Uuid,
        /// What became of it.
        answer: SteerAnswer,
    },
}

/// The relay's two tasks; stopped when dropped.
#[derive(Debug)]
pub(crate) struct Relaying {
    sending: Option<JoinHandle<()>>,
    receiving: JoinHandle<()>,
    /// Tells the sending task to relay what is queued and stop.
    stop: CancellationToken,
}

impl Relaying {
    /// Relays the frames handed over so far (a shutdown's last turns'
    /// ends among them), then stops.
    pub(crate) async fn stop(mut self) {
        self.stop.cancel();
        let Some(sending) = self.sending.take() else {
            return;
        };
        match tokio::time::timeout(STOP_WAIT, sending).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the relay's sending task failed"),
            Err(_) => tracing::warn!(
                wait_secs = STOP_WAIT.as_secs(),
                "the relay could not send its last frames in time; other servers' clients miss them"
            ),
        }
    }
}

impl Drop for Relaying {
    fn drop(&mut self) {
        if let Some(sending) = &self.sending {
            sending.abort();
        }
        self.receiving.abort();
    }
}

/// Starts relaying `hub`'s frames through `relay` and publishing the
/// others' into it.
pub(crate) fn start(
    relay: Arc<dyn Relay>,
    hub: Arc<Hub>,
    projections: Arc<Projections>,
    turns: Arc<TurnRunner>,
) -> Relaying {
    // Subscribed before anything is sent, so no answer is missed.
    let received = relay.subscribe();
    let (outbox, outgoing) = mpsc::unbounded_channel();
    hub.relay_to(outbox);
    let stop = CancellationToken::new();
    Relaying {
        sending: Some(tokio::spawn(send(relay, outgoing, stop.clone()))),
        receiving: tokio::spawn(receive(received, hub, projections, turns)),
        stop,
    }
}

/// Relays what the hub hands over, in order, text deltas merged.
async fn send(
    relay: Arc<dyn Relay>,
    mut outgoing: mpsc::UnboundedReceiver<Outgoing>,
    stop: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            first = outgoing.recv() => first,
            () = stop.cancelled() => outgoing.try_recv().ok(),
        };
        let Some(first) = first else { return };
        let mut batch = vec![first];
        if is_delta(&batch[0]) && !stop.is_cancelled() {
            let until = tokio::time::Instant::now() + COALESCE;
            loop {
                tokio::select! {
                    next = outgoing.recv() => match next {
                        Some(next) => {
                            // A turn's other frames go out at once.
                            let more = is_delta(&next);
                            batch.push(next);
                            if !more {
                                break;
                            }
                        }
                        None => break,
                    },
                    () = tokio::time::sleep_until(until) => break,
                }
            }
        }
        while let Ok(next) = outgoing.try_recv() {
            batch.push(next);
        }
        let mut notes = Vec::new();
        for (session, note) in merged(batch) {
            match serde_json::to_string(&note) {
                Ok(payload) => notes.push((session, payload)),
                Err(e) => {
                    tracing::error!(session_id = %session, error = %e, "a frame cannot be written as JSON; not relayed");
                }
            }
        }
        let count = notes.len();
        if let Err(e) = relay.publish(notes).await {
            tracing::warn!(frames = count, error = %e, "frames could not be relayed; other servers' clients of their dialogs miss them");
        }
    }
}

fn is_delta(outgoing: &Outgoing) -> bool {
    matches!(outgoing, Outgoing::Frame(_, frame) if matches!(**frame, ServerFrame::TextDelta { .. }))
}

/// `batch` as notes, in order within each session: adjacent text deltas of
/// one turn merged, long ones cut, at most [`DELTA_TEXT_BYTES`] each.
fn merged(batch: Vec<Outgoing>) -> Vec<(SessionId, Note)> {
    let mut out: Vec<(SessionId, Vec<Note>)> = Vec::new();
    for outgoing in batch {
        let (session, note) = match outgoing {
            Outgoing::Frame(session, frame) => (session, Note::Frame(frame)),
            Outgoing::Changed(session) => (session, Note::Changed),
            Outgoing::Stop(session) => (session, Note::Stop),
            Outgoing::Steer {
                session,
                request,
                text,
            } => (session, Note::Steer { request, text }),
            Outgoing::Steered {
                session,
                request,
                answer,
            } => (session, Note::Steered { request, answer }),
        };
        let notes = match out.iter().position(|(s, _)| *s == session) {
            Some(i) => &mut out[i].1,
            None => {
                out.push((session, Vec::new()));
                &mut out.last_mut().expect("just pushed").1
            }
        };
        if let (Some(Note::Frame(last)), Note::Frame(next)) = (notes.last_mut(), &note) {
            if let (
                ServerFrame::TextDelta {
                    turn_id: last_turn,
                    text: last_text,
                    ..
                },
                ServerFrame::TextDelta { turn_id, text, .. },
            ) = (last.as_mut(), next.as_ref())
            {
                if last_turn == turn_id && last_text.len() + text.len() <= DELTA_TEXT_BYTES {
                    last_text.push_str(text);
                    continue;
                }
            }
        }
        notes.extend(cut(note));
    }
    out.into_iter()
        .flat_map(|(session, notes)| notes.into_iter().map(move |n| (session, n)))
        .collect()
}

/// A text delta longer than [`DELTA_TEXT_BYTES`] as several (at character
/// boundaries); any other note as it is.
fn cut(note: Note) -> Vec<Note> {
    let Note::Frame(frame) = note else {
        return vec![note];
    };
    let ServerFrame::TextDelta {
        session_id,
        event_id,
        turn_id,
        text,
    } = *frame
    else {
        return vec![Note::Frame(frame)];
    };
    let mut pieces = Vec::new();
    let mut rest = text.as_str();
    while !rest.is_empty() {
        let mut end = rest.len().min(DELTA_TEXT_BYTES);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        let (piece, after) = rest.split_at(end);
        pieces.push(Note::Frame(Box::new(ServerFrame::TextDelta {
            session_id,
            event_id,
            turn_id,
            text: piece.to_owned(),
        })));
        rest = after;
    }
    pieces
}

/// Publishes what the other processes relay into the local hub.
async fn receive(
    mut received: tokio::sync::broadcast::Receiver<Relayed>,
    hub: Arc<Hub>,
    projections: Arc<Projections>,
    turns: Arc<TurnRunner>,
) {
    loop {
        match received.recv().await {
            Ok(Relayed::Message { session, payload }) => match serde_json::from_str(&payload) {
                Ok(note) => take(session, note, &hub, &projections, &turns),
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "a relayed message this keel cannot read (another version?); its clients re-read");
                    hub.gap(session, UNREADABLE);
                }
            },
            Ok(Relayed::Oversized { session }) => hub.gap(session, OVERSIZED),
            Ok(Relayed::Lost) | Err(RecvError::Lagged(_)) => {
                tracing::warn!("frames relayed from other processes were lost; the dialogs watched here re-read");
                reread_all(&hub, &turns, LOST);
            }
            Err(RecvError::Closed) => return,
        }
    }
}

/// Every dialog watched here re-reads, told `reason`; turns other
/// processes ran are no longer taken to be running.
fn reread_all(hub: &Hub, turns: &TurnRunner, reason: &str) {
    // A turn whose end was lost is not known to run any more.
    turns.forget_remote_turns();
    for session in hub.watched() {
        hub.gap(session, reason);
    }
}

/// This process took over a stopped one: the turns it ran ended without
/// their last frames, so the dialogs watched here re-read.
pub(crate) fn took_over(hub: &Hub, turns: &TurnRunner) {
    reread_all(hub, turns, TAKEN_OVER);
}

const TAKEN_OVER: &str =
    "a server that ran turns here stopped; its turns ended unanswered — re-read the messages";
const OVERSIZED: &str =
    "a frame of a turn another server runs was too long to pass on; re-read the messages";
const UNREADABLE: &str =
    "a frame of a turn another server runs could not be read here; re-read the messages";
const LOST: &str =
    "frames of turns other servers run were lost on the way here; re-read the messages";

/// Publishes one relayed note of `session`, or acts on it.
fn take(
    session: SessionId,
    note: Note,
    hub: &Hub,
    projections: &Arc<Projections>,
    turns: &Arc<TurnRunner>,
) {
    let refresh = match note {
        Note::Stop => {
            let turns = Arc::clone(turns);
            tokio::spawn(async move { turns.stop_relayed(session).await });
            false
        }
        Note::Steer { request, text } => {
            turns.steer_relayed(session, request, &text);
            false
        }
        Note::Steered { request, answer } => {
            turns.steer_answered(request, answer);
            false
        }
        Note::Frame(frame) => {
            match frame.as_ref() {
                ServerFrame::TurnStarted { turn_id, .. } => {
                    turns.remote_turn_started(session, *turn_id)
                }
                frame if frame.ends_turn() => {
                    if let Some(turn) = frame.turn_id() {
                        turns.remote_turn_ended(session, turn);
                    }
                }
                _ => {}
            }
            let ends_turn = frame.ends_turn();
            if hub.is_watched(session) {
                hub.publish_relayed(session, *frame);
            }
            ends_turn
        }
        Note::Changed => true,
    };
    if refresh && hub.is_watched(session) {
        let projections = projections.clone();
        tokio::spawn(async move { projections.refresh(session).await });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn delta(session: SessionId, turn: Uuid, text: &str) -> Outgoing {
        Outgoing::Frame(
            session,
            Box::new(ServerFrame::TextDelta {
                session_id: session.as_uuid(),
                event_id: None,
                turn_id: turn,
                text: text.to_owned(),
            }),
        )
    }

    fn texts(notes: &[(SessionId, Note)]) -> Vec<String> {
        notes
            .iter()
            .map(|(_, n)| match n {
                Note::Frame(f) => match f.as_ref() {
                    ServerFrame::TextDelta { text, .. } => text.clone(),
                    f => f.kind().to_owned(),
                },
                Note::Changed => "changed".to_owned(),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn deltas_of_a_turn_merge_in_order_per_dialog_and_long_ones_are_cut() {
        let (a, b) = (SessionId::new(), SessionId::new());
        let (ta, tb) = (Uuid::new_v4(), Uuid::new_v4());
        let long = "é".repeat(DELTA_TEXT_BYTES); // twice the limit in bytes
        let notes = merged(vec![
            delta(a, ta, "he"),
            delta(b, tb, "x"),
            delta(a, ta, "llo"),
            Outgoing::Changed(a),
            delta(a, ta, "!"),
            delta(b, tb, &long),
        ]);
        let of = |s: SessionId| -> Vec<(SessionId, Note)> {
            notes.iter().filter(|(x, _)| *x == s).cloned().collect()
        };
        assert_eq!(texts(&of(a)), ["hello", "changed", "!"]);
        let at_b = texts(&of(b));
        assert_eq!(at_b.len(), 3, "x, then the long one in two pieces");
        assert!(at_b.iter().all(|t| t.len() <= DELTA_TEXT_BYTES));
        assert_eq!(at_b.concat(), format!("x{long}"));
    }

    #[test]
    fn a_note_round_trips_as_json() {
        let session = SessionId::new();
        let note = Note::Frame(Box::new(ServerFrame::TurnStarted {
            session_id: session.as_uuid(),
            event_id: None,
            turn_id: Uuid::nil(),
            turn_origin: super::super::api::TurnOrigin::User,
        }));
        let json = serde_json::to_string(&note).unwrap();
        assert_eq!(serde_json::from_str::<Note>(&json).unwrap(), note);
        assert_eq!(
            serde_json::to_string(&Note::Changed).unwrap(),
            "\"changed\""
        );
        let control = [
            Note::Stop,
            Note::Steer {
                request: Uuid::nil(),
                text: "shorter, please".to_owned(),
            },
            Note::Steered {
                request: Uuid::nil(),
                answer: SteerAnswer::Steered {
                    turn_id: Uuid::nil(),
                },
            },
            Note::Steered {
                request: Uuid::nil(),
                answer: SteerAnswer::Full { capacity: 8 },
            },
        ];
        for note in &control {
            let json = serde_json::to_string(note).unwrap();
            assert_eq!(&serde_json::from_str::<Note>(&json).unwrap(), note);
        }
        insta::assert_json_snapshot!("relay_control_notes", control);
    }
}
