//! [`Hub`]: fans each dialog's frames out to everyone watching it
//! (WebSocket subscriptions, streamed sends). One bounded broadcast channel
//! per watched dialog: a subscriber that falls behind by more than its
//! capacity loses the oldest frames and is told so (`Lagged`), so a slow
//! client never makes the server hold more than `capacity` frames per dialog.
//!
//! Every turn frame gets an `event_id` when published, increasing within
//! its dialog (one counter for the whole server, starting at the process's
//! start time in seconds × 10⁶, so ids of an earlier process are smaller
//! and never mistaken for this one's). The turn frames of each dialog are
//! also kept in a replay window bounded by age and bytes, watched or not:
//! [`Hub::attach`] gives a reconnecting client every frame after the id it
//! last saw — or says it cannot ([`Attach::gap`]) — and subscribes it, under
//! one lock, so no frame is lost or sent twice between replay and live.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use keel_core::SessionId;
use parking_lot::Mutex;
use std::time::Instant;
use tokio::sync::broadcast;

use super::frames::ServerFrame;
use super::relay::Outgoing;

/// A frame as every subscriber of a dialog receives it.
pub type SharedFrame = Arc<ServerFrame>;

/// How long and how much of each dialog's turn frames are kept for replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayLimits {
    /// Frames older than this are dropped (zero: nothing is kept).
    pub window: Duration,
    /// Bytes (about) kept per dialog; the oldest frames go first.
    pub max_bytes: usize,
}

impl Default for ReplayLimits {
    /// Five minutes, 1 MiB per dialog.
    fn default() -> Self {
        Self {
            window: Duration::from_secs(300),
            max_bytes: 1024 * 1024,
        }
    }
}

/// Where a client joins a dialog's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Live frames only.
    Live,
    /// The frames so far of the turn running now, then live ones.
    Join,
    /// Every turn frame after this `event_id`, then live ones.
    After(u64),
}

/// A client attached to a dialog's stream: what to send first, then the
/// receiver. After a gap, `replay` is every frame still kept.
#[derive(Debug)]
pub struct Attach {
    /// The frames asked for could not all be replayed: send this `replay_gap` first.
    pub gap: Option<ServerFrame>,
    /// Kept frames to send before live ones, in order.
    pub replay: Vec<SharedFrame>,
    /// Live frames, none of them in `replay`.
    pub receiver: broadcast::Receiver<SharedFrame>,
}

/// A turn frame in a replay window.
#[derive(Debug)]
struct Kept {
    frame: SharedFrame,
    id: u64,
    at: Instant,
    bytes: usize,
}

/// One dialog's channel and replay window.
#[derive(Debug)]
struct Channel {
    sender: broadcast::Sender<SharedFrame>,
    window: VecDeque<Kept>,
    bytes: usize,
    /// Every frame of the dialog with an id above this is in `window`.
    complete_after: u64,
    /// The newest id given to a frame of the dialog.
    last_id: u64,
    /// Id of the `turn_started` of the turn running now (not yet ended).
    running_from: Option<u64>,
}

impl Channel {
    fn new(capacity: usize, complete_after: u64) -> Self {
        Self {
            sender: broadcast::channel(capacity).0,
            window: VecDeque::new(),
            bytes: 0,
            complete_after,
            last_id: complete_after,
            running_from: None,
        }
    }

    /// Drops frames past the limits (all of them when `now` is past every frame's window).
    fn prune(&mut self, limits: ReplayLimits, now: Instant) {
        while let Some(front) = self.window.front() {
            let old = now.saturating_duration_since(front.at) >= limits.window;
            if !old && self.bytes <= limits.max_bytes {
                break;
            }
            self.bytes -= front.bytes;
            self.complete_after = front.id;
            self.window.pop_front();
        }
    }

    /// Whether nothing needs the channel: no receiver, nothing kept.
    fn idle(&self) -> bool {
        self.sender.receiver_count() == 0 && self.window.is_empty()
    }
}

#[derive(Debug)]
struct Inner {
    dialogs: HashMap<SessionId, Channel>,
    /// The newest id given out.
    issued: u64,
    /// Every dialog without a channel has no frame with an id above this in
    /// this process (ids of forgotten channels are at or below it).
    forgotten: u64,
    /// Publishes since the last sweep of idle channels.
    since_sweep: u32,
}

/// Per-dialog broadcast of server frames, with a replay window; see the module docs.
#[derive(Debug)]
pub struct Hub {
    capacity: usize,
    limits: ReplayLimits,
    inner: Mutex<Inner>,
    /// Where frames for the other processes on a shared database go.
    outbox: std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<Outgoing>>,
}

/// Publishes between two sweeps of idle channels.
const SWEEP_EVERY: u32 = 1024;

/// The first event id of this process: its start time in seconds × 10⁶
/// (below 2⁵³, so exact in JavaScript, for centuries).
fn first_event_id() -> u64 {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    secs.saturating_mul(1_000_000)
}

impl Hub {
    /// A hub keeping at most `capacity` unread frames per dialog and turn
    /// frames for replay within `limits`.
    pub fn new(capacity: usize, limits: ReplayLimits) -> Self {
        Self::starting_at(capacity, limits, first_event_id())
    }

    /// A hub whose first event id is `base + 1`.
    fn starting_at(capacity: usize, limits: ReplayLimits, base: u64) -> Self {
        Self {
            capacity: capacity.max(1),
            limits,
            inner: Mutex::new(Inner {
                dialogs: HashMap::new(),
                issued: base,
                forgotten: base,
                since_sweep: 0,
            }),
            outbox: std::sync::OnceLock::new(),
        }
    }

    /// Passes the frames published here that the other processes on the
    /// database need (see [`Outgoing::crosses`]) to `outbox` from now on.
    pub(crate) fn relay_to(&self, outbox: tokio::sync::mpsc::UnboundedSender<Outgoing>) {
        if self.outbox.set(outbox).is_err() {
            tracing::warn!("the hub already relays; a second relay is ignored");
        }
    }

    /// Tells the other processes that `session`'s runs or inbox changed here.
    pub(crate) fn relay_changed(&self, session: SessionId) {
        self.relay(Outgoing::Changed(session));
    }

    /// Passes `outgoing` to the other processes; false when there are none
    /// to tell (a database this process owns) or the relay stopped.
    pub(crate) fn relay(&self, outgoing: Outgoing) -> bool {
        // Fails only once the relay stopped (a shutdown).
        self.outbox
            .get()
            .is_some_and(|outbox| outbox.send(outgoing).is_ok())
    }

    /// Starts receiving `session`'s frames published from now on.
    pub fn subscribe(&self, session: SessionId) -> broadcast::Receiver<SharedFrame> {
        self.attach(session, Resume::Live).receiver
    }

    /// Subscribes to `session`, with the kept frames `from` asks for.
    pub fn attach(&self, session: SessionId, from: Resume) -> Attach {
        self.attach_at(session, from, Instant::now())
    }

    fn attach_at(&self, session: SessionId, from: Resume, now: Instant) -> Attach {
        let mut inner = self.inner.lock();
        let (capacity, limits) = (self.capacity, self.limits);
        let (forgotten, issued) = (inner.forgotten, inner.issued);
        let channel = inner
            .dialogs
            .entry(session)
            .or_insert_with(|| Channel::new(capacity, forgotten));
        channel.prune(limits, now);
        let receiver = channel.sender.subscribe();
        let gap = |after: u64, reason: &str| ServerFrame::ReplayGap {
            session_id: session.as_uuid(),
            after_event_id: after,
            reason: reason.to_owned(),
        };
        let after = |id: u64| -> Vec<SharedFrame> {
            let start = channel.window.partition_point(|k| k.id <= id);
            channel
                .window
                .range(start..)
                .map(|k| k.frame.clone())
                .collect()
        };
        // After a gap, every frame still kept follows (a turn's end among
        // them, which a stream waiting for it needs).
        let (gap, replay) = match from {
            Resume::Live => (None, Vec::new()),
            Resume::Join => match channel.running_from {
                Some(from) if from > channel.complete_after => (None, after(from - 1)),
                Some(_) => {
                    let why =
                        "the running turn's first frames are no longer kept; re-read the messages";
                    (Some(gap(channel.complete_after, why)), after(0))
                }
                None => (None, Vec::new()),
            },
            Resume::After(id) if id > issued => {
                let why =
                    "this event id is unknown to this server (it restarted?); re-read the messages";
                (Some(gap(id, why)), after(0))
            }
            Resume::After(id) if id < channel.complete_after => {
                let why =
                    "frames after this event id are no longer kept (server.stream_replay_secs, \
                     server.stream_replay_bytes); re-read the messages";
                (Some(gap(id, why)), after(0))
            }
            Resume::After(id) => (None, after(id)),
        };
        Attach {
            gap,
            replay,
            receiver,
        }
    }

    /// Sends `frame` to `session`'s subscribers, a turn frame numbered and
    /// kept for replay. A dialog that nobody watches and that keeps nothing
    /// loses its channel.
    pub fn publish(&self, session: SessionId, frame: ServerFrame) {
        // Cloned only for a relay (most frames never leave the process).
        if self.outbox.get().is_some() && Outgoing::crosses(&frame) {
            self.relay(Outgoing::Frame(session, Box::new(frame.clone())));
        }
        self.publish_at(session, frame, Instant::now());
    }

    /// [`Self::publish`] of a frame another process published: not relayed
    /// again. A turn frame gets this process's own event id.
    pub(crate) fn publish_relayed(&self, session: SessionId, mut frame: ServerFrame) {
        // The sender's id, if it sent one, means nothing here.
        frame.clear_event_id();
        self.publish_at(session, frame, Instant::now());
    }

    /// Tells `session`'s subscribers that frames were lost (a `replay_gap`
    /// after the newest event id given in the dialog), if anyone watches.
    pub(crate) fn gap(&self, session: SessionId, reason: &str) {
        let last = {
            let inner = self.inner.lock();
            match inner.dialogs.get(&session) {
                Some(channel) => channel.last_id,
                None => return,
            }
        };
        self.publish_at(
            session,
            ServerFrame::ReplayGap {
                session_id: session.as_uuid(),
                after_event_id: last,
                reason: reason.to_owned(),
            },
            Instant::now(),
        );
    }

    /// The dialogs someone watches or may come back for.
    pub(crate) fn watched(&self) -> Vec<SessionId> {
        self.inner.lock().dialogs.keys().copied().collect()
    }

    /// [`Self::publish`] at `now`; returns the frame's event id.
    fn publish_at(&self, session: SessionId, mut frame: ServerFrame, now: Instant) -> Option<u64> {
        let mut inner = self.inner.lock();
        let event_id = frame.turn_id().map(|_| {
            inner.issued += 1;
            inner.issued
        });
        if let Some(id) = event_id {
            frame.set_event_id(id);
        }
        let ends_turn = frame.ends_turn();
        let starts_turn = matches!(frame, ServerFrame::TurnStarted { .. });
        let frame = Arc::new(frame);
        let (capacity, limits, forgotten) = (self.capacity, self.limits, inner.forgotten);
        if !inner.dialogs.contains_key(&session) {
            match event_id {
                // Nobody watches and there is nothing to keep.
                None => return None,
                Some(id) if limits.window.is_zero() => {
                    inner.forgotten = id;
                    return event_id;
                }
                Some(_) => {}
            }
        }
        let channel = inner
            .dialogs
            .entry(session)
            .or_insert_with(|| Channel::new(capacity, forgotten));
        if let Some(id) = event_id {
            channel.last_id = id;
            if starts_turn {
                channel.running_from = Some(id);
            } else if ends_turn {
                channel.running_from = None;
            }
            let bytes = frame.approx_bytes();
            channel.window.push_back(Kept {
                frame: frame.clone(),
                id,
                at: now,
                bytes,
            });
            channel.bytes += bytes;
            channel.prune(limits, now);
        }
        if channel.sender.receiver_count() > 0 {
            // Only fails without receivers, just ruled out.
            let _ = channel.sender.send(frame);
        }
        if channel.idle() {
            let through = channel.last_id;
            inner.dialogs.remove(&session);
            inner.forgotten = inner.forgotten.max(through);
        }
        inner.since_sweep += 1;
        if inner.since_sweep >= SWEEP_EVERY {
            Self::sweep(&mut inner, limits, now);
        }
        event_id
    }

    /// Forgets the channels nobody watches whose frames all aged out.
    fn sweep(inner: &mut Inner, limits: ReplayLimits, now: Instant) {
        inner.since_sweep = 0;
        let mut through = inner.forgotten;
        inner.dialogs.retain(|_, channel| {
            channel.prune(limits, now);
            let idle = channel.idle();
            if idle {
                through = through.max(channel.last_id);
            }
            !idle
        });
        inner.forgotten = through;
    }

    /// Whether anyone watches `session`, or may come back for its kept frames.
    pub fn is_watched(&self, session: SessionId) -> bool {
        self.is_watched_at(session, Instant::now())
    }

    fn is_watched_at(&self, session: SessionId, now: Instant) -> bool {
        let mut inner = self.inner.lock();
        let limits = self.limits;
        let Some(channel) = inner.dialogs.get_mut(&session) else {
            return false;
        };
        channel.prune(limits, now);
        if channel.idle() {
            let through = channel.last_id;
            inner.dialogs.remove(&session);
            inner.forgotten = inner.forgotten.max(through);
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn delta(session: SessionId, turn: Uuid, text: &str) -> ServerFrame {
        ServerFrame::TextDelta {
            session_id: session.as_uuid(),
            event_id: None,
            turn_id: turn,
            text: text.to_owned(),
        }
    }

    fn started(session: SessionId, turn: Uuid) -> ServerFrame {
        ServerFrame::TurnStarted {
            session_id: session.as_uuid(),
            event_id: None,
            turn_id: turn,
            turn_origin: crate::serve::api::TurnOrigin::User,
        }
    }

    fn texts(frames: &[SharedFrame]) -> Vec<String> {
        frames
            .iter()
            .map(|f| match f.as_ref() {
                ServerFrame::TextDelta { text, .. } => text.clone(),
                other => other.kind().to_owned(),
            })
            .collect()
    }

    fn hub(max_bytes: usize) -> Hub {
        let limits = ReplayLimits {
            window: Duration::from_secs(60),
            max_bytes,
        };
        Hub::starting_at(16, limits, 1000)
    }

    #[test]
    fn turn_frames_are_numbered_and_replayed_after_an_id_unwatched_or_not() {
        let hub = hub(1 << 20);
        let (session, turn) = (SessionId::new(), Uuid::new_v4());
        let first = hub
            .publish_at(session, started(session, turn), Instant::now())
            .unwrap();
        assert_eq!(first, 1001);
        let a = hub
            .publish_at(session, delta(session, turn, "a"), Instant::now())
            .unwrap();
        hub.publish_at(session, delta(session, turn, "b"), Instant::now());
        assert!(a > first);
        let attach = hub.attach(session, Resume::After(a));
        assert!(attach.gap.is_none());
        assert_eq!(texts(&attach.replay), ["b"]);
        let joined = hub.attach(session, Resume::Join);
        assert_eq!(texts(&joined.replay), ["turn_started", "a", "b"]);
        // A frame published now is live, not replayed again.
        let mut receiver = attach.receiver;
        hub.publish_at(session, delta(session, turn, "c"), Instant::now());
        assert_eq!(texts(&[receiver.try_recv().unwrap()]), ["c"]);
        assert!(receiver.try_recv().is_err());
    }

    #[test]
    fn an_id_older_than_the_kept_bytes_or_unknown_gets_a_gap() {
        let (session, turn) = (SessionId::new(), Uuid::new_v4());
        // Room for two and a half frames.
        let one = delta(session, turn, "a").approx_bytes();
        let hub = hub(one * 5 / 2);
        let start = hub
            .publish_at(session, started(session, turn), Instant::now())
            .unwrap();
        for text in ["a", "b", "c", "d"] {
            hub.publish_at(session, delta(session, turn, text), Instant::now());
        }
        let attach = hub.attach(session, Resume::After(start));
        assert!(
            matches!(attach.gap, Some(ServerFrame::ReplayGap { after_event_id, .. }) if after_event_id == start)
        );
        // What is still kept follows the gap.
        assert_eq!(texts(&attach.replay), ["c", "d"]);
        let future = hub.attach(session, Resume::After(start + 100));
        assert!(future.gap.is_some());
        // An id still covered replays without a gap.
        let recent = hub.attach(session, Resume::After(start + 3));
        assert!(recent.gap.is_none());
        assert_eq!(texts(&recent.replay), ["d"]);
    }

    #[test]
    fn frames_age_out_of_the_window_and_a_forgotten_dialog_gaps() {
        let hub = hub(1 << 20);
        let (session, turn) = (SessionId::new(), Uuid::new_v4());
        let now = Instant::now();
        let start = hub
            .publish_at(session, started(session, turn), now)
            .unwrap();
        assert!(
            hub.is_watched_at(session, now),
            "kept frames keep the dialog followed"
        );
        let later = now + Duration::from_secs(61);
        assert!(!hub.is_watched_at(session, later));
        let attach = hub.attach_at(session, Resume::After(start - 1), later);
        assert!(attach.gap.is_some());
        // The last id seen is complete: no gap, nothing to replay.
        let caught_up = hub.attach_at(session, Resume::After(start), later);
        assert!(caught_up.gap.is_none() && caught_up.replay.is_empty());
    }

    #[test]
    fn with_no_window_nothing_is_kept_and_ids_still_increase() {
        let limits = ReplayLimits {
            window: Duration::ZERO,
            max_bytes: 1 << 20,
        };
        let hub = Hub::starting_at(16, limits, 0);
        let (session, turn) = (SessionId::new(), Uuid::new_v4());
        let a = hub
            .publish_at(session, started(session, turn), Instant::now())
            .unwrap();
        let b = hub
            .publish_at(session, delta(session, turn, "x"), Instant::now())
            .unwrap();
        assert!(b > a);
        assert!(!hub.is_watched(session));
        assert!(hub.attach(session, Resume::After(a)).gap.is_some());
    }
}
