//! [`TurnMailbox`]: input that reaches a root turn while it runs (steer),
//! and the wake state its `sleep` watches.
//!
//! Two lanes with separate capacities: the user's steer messages, and
//! inbox events routed to the turn (signals with `steer` delivery). The
//! agent loop drains both, in arrival order, at each model-call boundary —
//! never in the middle of a provider call or a tool batch.
//!
//! An inbox event enters in two phases, so the durable state and the
//! mailbox never disagree: the router claims it in the store (leased),
//! reserves a place here (invisible to the loop), admits it in the store
//! bound to this turn, and only then activates the reservation (drainable).
//! Whoever removes a reservation from the mailbox — the router on a failed
//! admission, `/stop`, or the end of the turn — owns releasing its lease, so
//! it is released exactly once. Drained events are consumed by the turn's
//! commit.
//!
//! The wake state tells a sleeping root turn that something is waiting for
//! it: steer to read at the next boundary, or input queued for the next
//! turn. It is updated after the input is in place, so a sleep that wakes
//! always finds what woke it.

use std::collections::VecDeque;

use keel_core::{Message, RunId, TurnId};
use keel_store::LeasedEvents;
use parking_lot::Mutex;
use tokio::sync::watch;

/// Capacities of a turn's mailbox lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MailboxLimits {
    /// User steer messages waiting for the next model call.
    pub user: usize,
    /// Inbox events reserved or waiting for the next model call.
    pub agent: usize,
}

impl Default for MailboxLimits {
    /// 8 user messages, 16 inbox events.
    fn default() -> Self {
        Self { user: 8, agent: 16 }
    }
}

/// Why input could not enter a turn's mailbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The turn is ending or was stopped.
    Closed,
    /// The lane is at capacity.
    Full,
}

/// What most recently woke (or would wake) a sleeping root turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WakeSource {
    /// The user steered the turn.
    UserSteer,
    /// The user sent input for the next turn.
    UserQueue,
    /// A sub-agent's signal was admitted into the turn.
    AgentSteer {
        /// The signalling run.
        run_id: Option<RunId>,
        /// A short summary that is safe to show the model.
        preview: String,
    },
    /// Background results are waiting for a continuation turn.
    AgentQueue,
}

/// What is waiting for a root turn; see the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WakeupState {
    /// Increases with every change.
    pub revision: u64,
    /// User steer messages not yet read by the model.
    pub pending_user_steer: usize,
    /// User inputs queued for later turns.
    pub pending_user_queue: usize,
    /// Admitted inbox events not yet read by the model.
    pub pending_agent_steer: usize,
    /// Background results waiting for a continuation.
    pub pending_agent_queue: usize,
    /// The latest thing that arrived.
    pub latest: Option<WakeSource>,
}

impl WakeupState {
    /// Whether anything waits for the turn.
    pub fn pending(&self) -> usize {
        self.pending_user_steer
            + self.pending_user_queue
            + self.pending_agent_steer
            + self.pending_agent_queue
    }
}

struct AgentEntry {
    reservation: u64,
    seq: u64,
    held: LeasedEvents,
    message: Message,
    wake: WakeSource,
    active: bool,
}

#[derive(Default)]
struct Inner {
    closed: bool,
    next: u64,
    user: VecDeque<(u64, Message)>,
    agent: Vec<AgentEntry>,
    drained: Vec<LeasedEvents>,
}

/// What was still in a mailbox when it closed.
#[derive(Debug, Default)]
pub(crate) struct Leftovers {
    /// User steer messages the model never read (they become the next turn).
    pub(crate) user: Vec<Message>,
    /// Inbox events reserved or admitted but never read (release them).
    pub(crate) agent: Vec<LeasedEvents>,
}

/// The mailbox of one running root turn; see the module docs.
pub(crate) struct TurnMailbox {
    turn_id: TurnId,
    limits: MailboxLimits,
    inner: Mutex<Inner>,
    wakeup: watch::Sender<WakeupState>,
}

impl std::fmt::Debug for TurnMailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnMailbox")
            .field("turn_id", &self.turn_id)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl TurnMailbox {
    /// An open, empty mailbox of `turn_id`.
    pub(crate) fn new(turn_id: TurnId, limits: MailboxLimits) -> Self {
        Self {
            turn_id,
            limits,
            inner: Mutex::new(Inner::default()),
            wakeup: watch::channel(WakeupState::default()).0,
        }
    }

    /// Watches what waits for the turn (for `sleep`).
    pub(crate) fn wakeup(&self) -> watch::Receiver<WakeupState> {
        self.wakeup.subscribe()
    }

    fn wake(&self, change: impl FnOnce(&mut WakeupState)) {
        self.wakeup.send_modify(|s| {
            change(s);
            s.revision += 1;
        });
    }

    /// Adds a user steer message for the next model call.
    pub(crate) fn push_user(&self, message: Message) -> Result<(), Refused> {
        {
            let mut inner = self.inner.lock();
            if inner.closed {
                return Err(Refused::Closed);
            }
            if inner.user.len() >= self.limits.user {
                return Err(Refused::Full);
            }
            inner.next += 1;
            let seq = inner.next;
            inner.user.push_back((seq, message));
        }
        self.wake(|s| {
            s.pending_user_steer += 1;
            s.latest = Some(WakeSource::UserSteer);
        });
        Ok(())
    }

    /// Reserves a place for inbox events claimed under a lease (phase 2 of
    /// admission); the loop cannot see them until [`Self::activate`].
    pub(crate) fn reserve(
        &self,
        held: LeasedEvents,
        message: Message,
        wake: WakeSource,
    ) -> Result<u64, (Refused, LeasedEvents)> {
        let mut inner = self.inner.lock();
        if inner.closed {
            return Err((Refused::Closed, held));
        }
        let in_lane: usize = inner.agent.iter().map(|e| e.held.event_ids.len()).sum();
        if in_lane + held.event_ids.len() > self.limits.agent {
            return Err((Refused::Full, held));
        }
        inner.next += 1;
        let seq = inner.next;
        inner.agent.push(AgentEntry {
            reservation: seq,
            seq,
            held,
            message,
            wake,
            active: false,
        });
        Ok(seq)
    }

    /// Makes a reservation drainable once its events are admitted in the
    /// store (phase 4). False when the reservation is gone (the turn closed
    /// and its closer released the events).
    pub(crate) fn activate(&self, reservation: u64) -> bool {
        let wake = {
            let mut inner = self.inner.lock();
            match inner
                .agent
                .iter_mut()
                .find(|e| e.reservation == reservation)
            {
                Some(e) => {
                    e.active = true;
                    e.wake.clone()
                }
                None => return false,
            }
        };
        self.wake(|s| {
            s.pending_agent_steer += 1;
            s.latest = Some(wake);
        });
        true
    }

    /// Takes back a reservation whose admission failed; the caller releases
    /// its events. `None` when the closer took it already.
    pub(crate) fn withdraw(&self, reservation: u64) -> Option<LeasedEvents> {
        let mut inner = self.inner.lock();
        let i = inner
            .agent
            .iter()
            .position(|e| e.reservation == reservation)?;
        Some(inner.agent.remove(i).held)
    }

    /// Notes input queued for a later turn (it wakes a sleeping turn).
    pub(crate) fn note_queued(&self, source: WakeSource) {
        self.wake(|s| {
            match source {
                WakeSource::UserQueue => s.pending_user_queue += 1,
                _ => s.pending_agent_queue += 1,
            }
            s.latest = Some(source);
        });
    }

    /// Whether the next drain would return something.
    pub(crate) fn has_input(&self) -> bool {
        let inner = self.inner.lock();
        !inner.user.is_empty() || inner.agent.iter().any(|e| e.active)
    }

    /// The waiting steer input, in arrival order, for the next model call.
    /// Drained inbox events are recorded for the turn's commit.
    pub(crate) fn drain(&self) -> Vec<Message> {
        let (out, users, agents) = {
            let mut inner = self.inner.lock();
            let mut batch: Vec<(u64, Message)> = inner.user.drain(..).collect();
            let users = batch.len();
            let mut kept = Vec::with_capacity(inner.agent.len());
            let mut agents = 0;
            for e in std::mem::take(&mut inner.agent) {
                if e.active {
                    agents += 1;
                    batch.push((e.seq, e.message));
                    inner.drained.push(e.held);
                } else {
                    kept.push(e);
                }
            }
            inner.agent = kept;
            batch.sort_by_key(|(seq, _)| *seq);
            (
                batch.into_iter().map(|(_, m)| m).collect::<Vec<_>>(),
                users,
                agents,
            )
        };
        if users + agents > 0 {
            self.wake(|s| {
                s.pending_user_steer = s.pending_user_steer.saturating_sub(users);
                s.pending_agent_steer = s.pending_agent_steer.saturating_sub(agents);
            });
        }
        out
    }

    /// Inbox events the model read in this turn (consumed by its commit).
    pub(crate) fn drained_events(&self) -> Vec<LeasedEvents> {
        self.inner.lock().drained.clone()
    }

    /// Closes the mailbox: nothing more enters. Returns what the model never
    /// read; with `include_drained`, also the events it read (a turn that
    /// will not commit releases those too).
    pub(crate) fn close(&self, include_drained: bool) -> Leftovers {
        let mut inner = self.inner.lock();
        inner.closed = true;
        let mut agent: Vec<LeasedEvents> = inner.agent.drain(..).map(|e| e.held).collect();
        if include_drained {
            agent.append(&mut inner.drained);
        }
        Leftovers {
            user: inner.user.drain(..).map(|(_, m)| m).collect(),
            agent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::EventId;

    fn held(token: &str) -> LeasedEvents {
        LeasedEvents {
            lease_token: token.into(),
            event_ids: vec![EventId::new()],
        }
    }

    #[test]
    fn lanes_drain_in_arrival_order_and_only_admitted_events() {
        let mb = TurnMailbox::new(TurnId::new(), MailboxLimits { user: 2, agent: 1 });
        mb.push_user(Message::user("a")).unwrap();
        let signal = held("t1");
        let r = mb
            .reserve(
                signal.clone(),
                Message::user("signal"),
                WakeSource::AgentQueue,
            )
            .unwrap();
        mb.push_user(Message::user("b")).unwrap();
        assert_eq!(mb.push_user(Message::user("c")), Err(Refused::Full));
        assert!(matches!(
            mb.reserve(held("t2"), Message::user("x"), WakeSource::AgentQueue),
            Err((Refused::Full, _))
        ));
        // Reserved but not admitted: invisible.
        let texts: Vec<String> = mb.drain().iter().map(Message::text).collect();
        assert_eq!(texts, ["a", "b"]);
        assert!(!mb.has_input());
        assert!(mb.activate(r));
        assert!(mb.has_input());
        let texts: Vec<String> = mb.drain().iter().map(Message::text).collect();
        assert_eq!(texts, ["signal"]);
        assert_eq!(mb.drained_events(), [signal]);
        let state = mb.wakeup().borrow().clone();
        assert_eq!(
            (state.pending_user_steer, state.pending_agent_steer),
            (0, 0)
        );
    }

    #[test]
    fn the_closer_owns_reservations_and_late_admissions_find_them_gone() {
        let mb = TurnMailbox::new(TurnId::new(), MailboxLimits::default());
        let r = mb
            .reserve(held("t"), Message::user("s"), WakeSource::AgentQueue)
            .unwrap();
        mb.push_user(Message::user("late steer")).unwrap();
        let left = mb.close(false);
        assert_eq!(left.agent.len(), 1, "the closer releases the reservation");
        assert_eq!(left.user.len(), 1, "unread steer becomes the next turn");
        assert!(!mb.activate(r), "activation after close is a no-op");
        assert_eq!(mb.withdraw(r), None, "nobody releases twice");
        assert_eq!(mb.push_user(Message::user("x")), Err(Refused::Closed));
        assert!(matches!(
            mb.reserve(held("u"), Message::user("x"), WakeSource::AgentQueue),
            Err((Refused::Closed, _))
        ));
    }
}
