//! [`SessionEvents`]: the live feed of a session for its clients (`keel
//! chat`, `keel serve`). Every turn of the session — a user's or a hidden
//! continuation — streams its events here, followed by its commit or its
//! failure; and every committed change of the session's sub-agent runs and
//! inbox events is projected here with the store's revision.
//!
//! Each session has its own bounded broadcast channel, created by the first
//! subscriber and dropped once nobody listens; with no subscriber nothing is
//! buffered or read. A subscriber that falls behind by more than the
//! channel's capacity gets [`SubscriptionError::Lagged`] once and should
//! re-query what it shows (the store is the source of truth).
//!
//! Revisions of [`SessionEvent::RunUpdated`] and
//! [`SessionEvent::InboxEventUpdated`] strictly increase per session: the
//! projection reads the store's changes since the revision it last published,
//! under a per-session lock, after each change the engine commits. Gaps are
//! normal (not every revision changes something a client sees).

use std::collections::HashMap;
use std::sync::Arc;

use keel_core::{CheckpointId, SessionId, TurnId, TurnOrigin, Usage};
use keel_store::{InboxEvent, RunRecord, Store};
use parking_lot::Mutex;
use tokio::sync::{broadcast, Mutex as AsyncMutex};

use crate::agent_loop::TurnEvent;
use crate::coordinator::SignalView;
use crate::error::Result;

/// Most runs (and most events) one projection read returns.
const CHANGES_PER_READ: usize = 500;

/// Events one session channel buffers for a slow subscriber.
pub const DEFAULT_EVENT_CAPACITY: usize = 1024;

/// Something that happened in a session, in the order it happened.
#[derive(Debug, Clone, PartialEq)]
pub enum SessionEvent {
    /// A turn started (a user's, or a continuation answering inbox events).
    TurnStarted {
        /// The turn.
        turn_id: TurnId,
        /// Who started it.
        origin: TurnOrigin,
    },
    /// A turn streamed an event (text, tool calls, notices).
    Turn {
        /// The turn.
        turn_id: TurnId,
        /// Who started it.
        origin: TurnOrigin,
        /// The event.
        event: TurnEvent,
    },
    /// A turn's messages, state and checkpoint are committed.
    TurnCommitted {
        /// The turn.
        turn_id: TurnId,
        /// Who started it.
        origin: TurnOrigin,
        /// Its automatic checkpoint, if one was taken.
        checkpoint: Option<CheckpointId>,
        /// The tokens its model calls used.
        usage: Usage,
    },
    /// A turn ended without committing an answer.
    TurnFailed {
        /// The turn.
        turn_id: TurnId,
        /// Who started it.
        origin: TurnOrigin,
        /// Why, in words safe to show a client (internal detail is in the log).
        message: String,
        /// Whether it was cancelled (`/stop`) rather than failed.
        cancelled: bool,
        /// Whether it ran past its deadline and was cancelled there.
        timed_out: bool,
        /// Whether a spend budget stopped it before a model call.
        budget_exhausted: bool,
        /// Whether the turn's input was committed before it failed: it stays
        /// in the history, marked unanswered (a user turn that got as far as
        /// calling the model).
        input_kept: bool,
    },
    /// A notice for the user that no turn produced (e.g. a background result
    /// that could not be delivered). It is also in the session's history.
    Notice {
        /// The text.
        text: String,
    },
    /// A tool call waits for a person's decision (committed with the
    /// turn that paused for it).
    ApprovalRequested(Box<keel_store::ApprovalRecord>),
    /// An approval was decided (approved, denied, expired or superseded),
    /// as committed.
    ApprovalDecided(Box<keel_store::ApprovalRecord>),
    /// A generated title of the dialog was committed (after a turn, off
    /// its path).
    Retitled {
        /// The new title.
        title: String,
    },
    /// A background run emitted a signal (committed; sent once, when it
    /// was accepted). Its later delivery states arrive as
    /// [`SessionEvent::InboxEventUpdated`].
    Signal(Box<SignalView>),
    /// A sub-agent run of the session changed (as committed).
    RunUpdated {
        /// The session's revision of this change.
        revision: u64,
        /// The run as stored after it.
        run: Box<RunRecord>,
    },
    /// An inbox event of the session changed (inserted, leased, delivered,
    /// released, dead-lettered, superseded).
    InboxEventUpdated {
        /// The session's revision of this change.
        revision: u64,
        /// The event as stored after it.
        event: Box<InboxEvent>,
    },
}

/// Why [`SessionSubscription::recv`] returned no event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubscriptionError {
    /// The subscriber fell behind: `skipped` events are gone. Re-query the
    /// session's state; the subscription continues with newer events.
    #[error("the subscriber fell behind by {skipped} events")]
    Lagged {
        /// How many events were dropped.
        skipped: u64,
    },
    /// The feed is gone (the engine shut down).
    #[error("the session feed is closed")]
    Closed,
}

/// One subscriber's view of a session's feed.
#[derive(Debug)]
pub struct SessionSubscription {
    rx: broadcast::Receiver<Arc<SessionEvent>>,
    revision: u64,
}

impl SessionSubscription {
    /// Every run or inbox change with a revision above this one reaches this
    /// subscription (earlier ones may too): query the session's runs and
    /// events after subscribing, and apply events whose revision is newer
    /// than what the query showed.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The next event.
    pub async fn recv(&mut self) -> std::result::Result<Arc<SessionEvent>, SubscriptionError> {
        self.rx.recv().await.map_err(|e| match e {
            broadcast::error::RecvError::Lagged(skipped) => SubscriptionError::Lagged { skipped },
            broadcast::error::RecvError::Closed => SubscriptionError::Closed,
        })
    }

    /// The next event if one is waiting.
    pub fn try_recv(
        &mut self,
    ) -> std::result::Result<Option<Arc<SessionEvent>>, SubscriptionError> {
        match self.rx.try_recv() {
            Ok(e) => Ok(Some(e)),
            Err(broadcast::error::TryRecvError::Empty) => Ok(None),
            Err(broadcast::error::TryRecvError::Lagged(skipped)) => {
                Err(SubscriptionError::Lagged { skipped })
            }
            Err(broadcast::error::TryRecvError::Closed) => Err(SubscriptionError::Closed),
        }
    }
}

struct Channel {
    tx: broadcast::Sender<Arc<SessionEvent>>,
    /// The revision projected so far (`None` until the first subscriber read it).
    projected: Arc<AsyncMutex<Option<u64>>>,
}

/// The per-session feeds; see the module docs.
pub struct SessionEvents {
    store: Store,
    capacity: usize,
    channels: Mutex<HashMap<SessionId, Channel>>,
}

impl std::fmt::Debug for SessionEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionEvents")
            .field("capacity", &self.capacity)
            .field("sessions", &self.channels.lock().len())
            .finish()
    }
}

impl SessionEvents {
    /// Feeds over `store` whose channels buffer `capacity` events each.
    pub fn new(store: Store, capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            store,
            capacity: capacity.max(1),
            channels: Mutex::new(HashMap::new()),
        })
    }

    /// Subscribes to `session`'s feed (creating it if nobody listened yet).
    pub async fn subscribe(&self, session: SessionId) -> Result<SessionSubscription> {
        let (rx, projected) = {
            let mut channels = self.channels.lock();
            let channel = channels.entry(session).or_insert_with(|| Channel {
                tx: broadcast::channel(self.capacity).0,
                projected: Arc::new(AsyncMutex::new(None)),
            });
            (channel.tx.subscribe(), Arc::clone(&channel.projected))
        };
        let mut projected = projected.lock().await;
        let revision = match *projected {
            Some(r) => r,
            None => {
                let r = self.store.inbox_usage(session).await?.revision;
                *projected = Some(r);
                r
            }
        };
        Ok(SessionSubscription { rx, revision })
    }

    /// Whether anybody listens to `session`.
    pub fn has_subscribers(&self, session: SessionId) -> bool {
        self.channels
            .lock()
            .get(&session)
            .is_some_and(|c| c.tx.receiver_count() > 0)
    }

    /// Sends `event` to `session`'s subscribers, if any; a channel nobody
    /// listens to any more is dropped.
    pub(crate) fn publish(&self, session: SessionId, event: SessionEvent) {
        let mut channels = self.channels.lock();
        let Some(channel) = channels.get(&session) else {
            return;
        };
        if channel.tx.send(Arc::new(event)).is_err() {
            channels.remove(&session);
        }
    }

    /// Publishes the runs and inbox events of `session` that changed since
    /// the last projection, in revision order. A storage failure is logged:
    /// subscribers catch up at the next projection.
    pub(crate) async fn project(&self, session: SessionId) {
        let projected = {
            let channels = self.channels.lock();
            match channels.get(&session) {
                Some(c) if c.tx.receiver_count() > 0 => Arc::clone(&c.projected),
                _ => return,
            }
        };
        let mut projected = projected.lock().await;
        let Some(mut since) = *projected else {
            // A subscriber is reading the starting revision; it will see
            // these changes in its query.
            return;
        };
        loop {
            let changes = match self
                .store
                .agent_changes_since(session, since, CHANGES_PER_READ)
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "projecting run and inbox changes failed; retried at the next change");
                    break;
                }
            };
            // A list cut at the read limit is complete only up to its last
            // revision: publish up to there, read again from there.
            let full = |n: usize| n >= CHANGES_PER_READ;
            let cut = [
                full(changes.runs.len()).then(|| changes.runs.last().map(|r| r.revision)),
                full(changes.events.len()).then(|| changes.events.last().map(|e| e.revision)),
            ]
            .into_iter()
            .flatten()
            .flatten()
            .min();
            let upto = cut.unwrap_or(changes.revision);
            let mut runs = changes
                .runs
                .into_iter()
                .filter(|r| r.revision <= upto)
                .peekable();
            let mut events = changes
                .events
                .into_iter()
                .filter(|e| e.revision <= upto)
                .peekable();
            // Merge the two revision-ordered lists.
            loop {
                let next = match (runs.peek(), events.peek()) {
                    (None, None) => break,
                    (Some(r), Some(e)) if r.revision <= e.revision => runs.next().map(run_event),
                    (Some(_), None) => runs.next().map(run_event),
                    (_, Some(_)) => events.next().map(inbox_event),
                };
                if let Some(event) = next {
                    self.publish(session, event);
                }
            }
            since = since.max(upto);
            *projected = Some(since);
            if cut.is_none() {
                break;
            }
        }
    }
}

fn run_event(run: RunRecord) -> SessionEvent {
    SessionEvent::RunUpdated {
        revision: run.revision,
        run: Box::new(run),
    }
}

fn inbox_event(event: InboxEvent) -> SessionEvent {
    SessionEvent::InboxEventUpdated {
        revision: event.revision,
        event: Box::new(event),
    }
}
