//! The session worker: every turn of a session runs on it, one at a time.
//!
//! A worker exists only while its session has work: [`SessionManager::send`]
//! (a user turn) or an inbox wake starts it, and it leaves as soon as it finds
//! nothing to do. It has two lanes: a bounded queue of user turns, and a
//! payload-free inbox wake (SQLite holds the events; the wake only says
//! "look"). Between turns it decides what runs next: the user's turn first,
//! unless the inbox has due events and either `max_user_turn_burst_before_inbox`
//! user turns ran in a row or the oldest due event waited
//! `max_inbox_wait_secs` — then a continuation turn answers the inbox first.
//!
//! While a turn runs, [`SessionManager::steer`] puts input into it (read at
//! the next model call) and [`SessionManager::stop`] ends it. Every turn's
//! events go to the session's feed ([`crate::SessionEvents`]).
//!
//! Leaving without losing work: the worker removes itself from the registry
//! only under the registry lock, after checking that no user turn is queued
//! and no wake is pending; senders and wakers enqueue under the same lock,
//! so anything that arrives afterwards finds no worker and starts a new one.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Why a message with images is refused for a text-only model.
pub(crate) const TEXT_ONLY: &str =
    "this dialog's model takes text only (its profile has images = false); send the message without images";

use keel_core::{Message, RunId, SessionId, TurnId, TurnOrigin};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use keel_store::LeasedEvents;

use super::turns::TurnStart;
use super::{SessionManager, TurnReport};
use crate::clock;
use crate::error::{internal_message, EngineError, Result};
use crate::events::SessionEvent;
use crate::mailbox::{Refused, TurnMailbox, WakeSource};
use crate::trace;

/// A user turn accepted by [`SessionManager::send`]: its id at once, its
/// outcome when it ends.
#[derive(Debug)]
pub struct TurnTicket {
    turn_id: TurnId,
    cancel: CancellationToken,
    outcome: oneshot::Receiver<Result<TurnReport>>,
}

impl TurnTicket {
    /// The turn's id (its events on the session feed carry it).
    pub fn turn_id(&self) -> TurnId {
        self.turn_id
    }

    /// A token that cancels this turn alone — before it starts (it never
    /// runs) or while it runs (nothing of its answer is committed; its
    /// input, committed when it started, stays unanswered). Unlike
    /// [`SessionManager::stop`], background runs are left alone.
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Waits for the turn to end: its report once committed, or why it
    /// committed nothing ([`EngineError::Cancelled`] after `/stop`).
    pub async fn outcome(self) -> Result<TurnReport> {
        self.outcome.await.unwrap_or(Err(EngineError::Cancelled))
    }
}

/// What [`SessionManager::steer`] did with the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SteerOutcome {
    /// The running turn reads it at its next model call.
    Steered {
        /// The turn.
        turn_id: TurnId,
    },
    /// No turn is running (or it is ending): nothing was done; send it as
    /// the next turn instead.
    NoRunningTurn,
}

/// What [`SessionManager::stop`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopReport {
    /// The turn that was stopped (nothing of its answer is committed), if one ran.
    pub turn: Option<TurnId>,
    /// Inbox events the turn held that are pending again.
    pub events_released: u64,
    /// Background runs of the session that were cancelled (their results
    /// are recorded without starting a turn).
    pub runs_cancelled: Vec<RunId>,
}

/// A queued user turn.
struct UserTask {
    turn_id: TurnId,
    input: Message,
    /// Its input is queued in the store (every sent turn; not steer the
    /// model never read, which runs as the next turn from memory).
    queued: bool,
    cancel: CancellationToken,
    reply: Option<oneshot::Sender<Result<TurnReport>>>,
}

/// The running turn, as steer and stop see it.
#[derive(Clone)]
pub(super) struct ActiveTurn {
    pub(super) turn_id: TurnId,
    origin: TurnOrigin,
    cancel: CancellationToken,
    pub(super) mailbox: Arc<TurnMailbox>,
    /// Becomes true once the turn ended and everything it held is released.
    done: watch::Receiver<bool>,
}

/// State a worker shares with senders, wakers, steer and stop.
pub(super) struct WorkerShared {
    wake: Notify,
    wake_pending: AtomicBool,
    /// Set by `/stop`: no continuation starts until the next user turn or
    /// the next inbox wake. Read and written under `active`'s lock.
    paused: AtomicBool,
    /// The session has approvals pending or decided and not yet settled:
    /// the worker reads the approval schedule before each step.
    pub(super) approvals_open: AtomicBool,
    active: Mutex<Option<ActiveTurn>>,
    /// Counts the worker's turns, each with what it claimed and releases:
    /// odd while one is in progress. `/stop` waits for the one in progress
    /// when it came to end, so it returns once nothing is held — and not
    /// after a turn queued behind it.
    busy: watch::Sender<u64>,
}

impl Default for WorkerShared {
    fn default() -> Self {
        Self {
            wake: Notify::new(),
            wake_pending: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            approvals_open: AtomicBool::new(false),
            active: Mutex::new(None),
            busy: watch::Sender::new(0),
        }
    }
}

/// One turn of the worker with what it claims and releases; ends on drop.
struct Busy<'a>(&'a watch::Sender<u64>);

impl<'a> Busy<'a> {
    fn start(busy: &'a watch::Sender<u64>) -> Self {
        busy.send_modify(|n| *n += 1);
        Self(busy)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n += 1);
    }
}

/// How a turn on the worker ended.
pub(super) struct TurnEnd {
    /// Its report, or why nothing of it was committed.
    pub(super) result: Result<TurnReport>,
    /// User steer the model never read.
    pub(super) unread: Vec<Message>,
    /// Dropping it tells `/stop` the turn and what it held are finished.
    pub(super) done: watch::Sender<bool>,
}

/// A worker as the registry holds it.
pub(super) struct WorkerHandle {
    user_tx: mpsc::Sender<UserTask>,
    shared: Arc<WorkerShared>,
}

/// The live workers, by session.
pub(super) type Workers = Mutex<HashMap<SessionId, WorkerHandle>>;

/// What the worker does after a step.
enum Step {
    /// Look for more work now.
    Again,
    /// Nothing to do now: wait for a user turn, a wake, or this time (Unix
    /// ms) when an event backing off becomes due.
    Wait(Option<i64>),
    /// Nothing to do now: wait for a user turn or a wake until this time
    /// (Unix ms), then look again (and leave if there is still nothing).
    Linger(i64),
    /// The worker left the registry.
    Exit,
}

/// What the approval part of a worker step did.
enum ApprovalStep {
    /// It expired approvals or resumed a turn: look again.
    Ran,
    /// Approvals wait for a person: results wait too.
    Pending,
    /// Nothing waits.
    Clear,
}

/// A worker's private state.
struct WorkerState {
    user_rx: mpsc::Receiver<UserTask>,
    /// Steer the model never read, to run as the next user turns.
    carried: VecDeque<UserTask>,
    /// A user turn taken from the queue, not yet run.
    next_user: Option<UserTask>,
    /// The inbox may have due events (a wake, a start, a retry time).
    inbox_due: bool,
    /// When the earliest event that backs off becomes due (Unix ms).
    next_inbox_at: Option<i64>,
    /// When the earliest pending approval expires (Unix ms).
    next_approval_at: Option<i64>,
    /// User turns run in a row while results waited.
    user_burst: usize,
    /// The worker has nothing to do and stays a moment before it leaves
    /// (see [`Step::Linger`]).
    lingered: bool,
}

impl SessionManager {
    /// Queues a user turn of `session` with `input` (a user message) and
    /// returns with its ticket once the input is committed to the store's
    /// queue (durable from then on; a process that dies before the turn
    /// starts leaves it for [`Self::resume_queued`]). The turn runs on the
    /// session's worker after the turns queued before it. Fails with
    /// [`EngineError::SessionBusy`] when the session's queue is full.
    pub async fn send(self: &Arc<Self>, session: SessionId, input: Message) -> Result<TurnTicket> {
        self.send_with_webhook(session, input, None).await
    }

    /// [`Self::send`] whose input is committed with a webhook subscription:
    /// the commit that answers it creates a delivery to `webhook` in the
    /// store's outbox (the engine never calls it).
    pub async fn send_with_webhook(
        self: &Arc<Self>,
        session: SessionId,
        input: Message,
        webhook: Option<String>,
    ) -> Result<TurnTicket> {
        if input.role != keel_core::Role::User {
            return Err(EngineError::InvalidInput(
                "a turn's input is a user message".into(),
            ));
        }
        // Fail now, not in the ticket, for a session that does not exist
        // or whose agent a reload removed.
        self.session(session).await?;
        self.check_agent(session).await?;
        let has_image = input
            .content
            .iter()
            .any(|p| matches!(p, keel_core::ContentPart::ImageRef { .. }));
        if has_image && !self.accepts_images(session).await? {
            return Err(EngineError::InvalidInput(TEXT_ONLY.into()));
        }
        if self.queue_full(session) {
            return Err(EngineError::SessionBusy {
                queued: self.config.user_queue,
            });
        }
        let turn_id = TurnId::new();
        self.store
            .queue_input(keel_store::QueuedInput {
                session_id: session,
                turn_id,
                message: input.clone(),
                queued_at_ms: keel_core::time::now_ms(),
                webhook,
            })
            .await?;
        let cancel = CancellationToken::new();
        let (reply, outcome) = oneshot::channel();
        let task = UserTask {
            turn_id,
            input,
            queued: true,
            cancel: cancel.clone(),
            reply: Some(reply),
        };
        if let Err(e) = self.enqueue(session, task) {
            // Not acknowledged: the input leaves the queue it was committed to.
            self.store.discard_queued_input(turn_id).await?;
            return Err(e);
        }
        Ok(TurnTicket {
            turn_id,
            cancel,
            outcome,
        })
    }

    /// Queues the turns of every input a dead process acknowledged but never
    /// started, in the order they were acknowledged; they run like any sent
    /// turn (no ticket waits for them). `adopt` is told each turn before it
    /// is queued, so whoever shows a dialog's turns can follow it from its
    /// start. Those a full session queue refuses stay queued in the store
    /// for the next start. Returns how many were queued.
    pub async fn resume_queued(
        self: &Arc<Self>,
        mut adopt: impl FnMut(SessionId, TurnId),
    ) -> Result<usize> {
        let mut resumed = 0;
        for input in self.store.queued_inputs().await? {
            adopt(input.session_id, input.turn_id);
            let task = UserTask {
                turn_id: input.turn_id,
                input: input.message,
                queued: true,
                cancel: CancellationToken::new(),
                reply: None,
            };
            match self.enqueue(input.session_id, task) {
                Ok(()) => resumed += 1,
                Err(e) => {
                    tracing::warn!(session_id = %input.session_id, turn_id = %input.turn_id, error = %e, "a queued input stays queued for the next start");
                }
            }
        }
        Ok(resumed)
    }

    /// Whether the user queue of `session`'s worker has no room.
    fn queue_full(&self, session: SessionId) -> bool {
        self.workers
            .lock()
            .get(&session)
            .is_some_and(|h| h.user_tx.capacity() == 0)
    }

    /// Runs a user turn with `input` to its end (queued like [`Self::send`]).
    pub async fn submit_turn(self: &Arc<Self>, id: SessionId, input: &str) -> Result<TurnReport> {
        self.send(id, Message::user(input)).await?.outcome().await
    }

    /// Gives `text` to the running turn of `session`, read by the model at
    /// its next call. With no running turn nothing is done.
    pub fn steer(&self, session: SessionId, text: &str) -> Result<SteerOutcome> {
        if text.trim().is_empty() {
            return Err(EngineError::InvalidInput("steer text is empty".into()));
        }
        let Some(active) = self.active_turn(session) else {
            return Ok(SteerOutcome::NoRunningTurn);
        };
        match active.mailbox.push_user(Message::user(text)) {
            Ok(()) => Ok(SteerOutcome::Steered {
                turn_id: active.turn_id,
            }),
            Err(Refused::Closed) => Ok(SteerOutcome::NoRunningTurn),
            Err(Refused::Full) => Err(EngineError::SteerFull {
                capacity: self.config.mailbox.user,
            }),
        }
    }

    /// `/stop`: closes the running turn of `session` to new input and
    /// cancels it with its foreground runs (nothing of its answer is committed),
    /// cancels its title or summary generation,
    /// gives back the inbox events it held (leased or admitted: pending
    /// again, no failed attempt), cancels the session's background runs
    /// (their completions are recorded consumed, their pending signals
    /// superseded, so no continuation starts for them), and pauses the
    /// inbox until the next user turn or a new result. Returns once all of
    /// it is done: nothing of the session is leased or admitted then.
    pub async fn stop(self: &Arc<Self>, session: SessionId) -> Result<StopReport> {
        self.housekeeping.cancel(session);
        let mut report = StopReport {
            turn: self.halt(session, false).await,
            ..StopReport::default()
        };
        if let Some(coordinator) = &self.bundle.coordinator {
            report.runs_cancelled = coordinator.stop_background_runs(session).await?;
            // A signal of a run being cancelled may have woken the inbox
            // meanwhile: stop the continuation that started, too (a user
            // turn queued behind the stopped one runs).
            if let Some(turn) = self.halt(session, true).await {
                report.turn.get_or_insert(turn);
            }
        }
        tracing::info!(session_id = %session, turn = ?report.turn, runs = report.runs_cancelled.len(), "stopped");
        Ok(report)
    }

    /// Pauses the inbox of `session`, cancels its running turn (only a
    /// continuation when `continuations_only`) and waits until the worker's
    /// turn in progress ended and released what it held — not for a user
    /// turn queued behind it, which runs. Returns the cancelled turn.
    async fn halt(&self, session: SessionId, continuations_only: bool) -> Option<TurnId> {
        let shared = self
            .workers
            .lock()
            .get(&session)
            .map(|h| Arc::clone(&h.shared))?;
        let (running, in_progress) = {
            let active = shared.active.lock();
            // Under the lock a continuation about to register sees it
            // and does not start; one that registered is cancelled here.
            shared.paused.store(true, Ordering::Release);
            (active.clone(), *shared.busy.borrow())
        };
        if continuations_only
            && running
                .as_ref()
                .is_some_and(|a| a.origin == TurnOrigin::User)
        {
            return None;
        }
        let mut stopped = None;
        if let Some(mut active) = running {
            active.cancel.cancel();
            let _ = active.done.wait_for(|done| *done).await;
            stopped = Some(active.turn_id);
        }
        if in_progress % 2 == 1 {
            // Whatever the worker claimed for that turn is released then.
            let mut busy = shared.busy.subscribe();
            let _ = busy.wait_for(|n| *n != in_progress).await;
        }
        stopped
    }

    /// Cancels the running turn of `session` without waiting for it.
    pub(super) fn cancel_turn(&self, session: SessionId) {
        if let Some(active) = self.active_turn(session) {
            active.cancel.cancel();
        }
    }

    /// How many sessions have a worker right now (sessions with work).
    pub fn active_workers(&self) -> usize {
        self.workers.lock().len()
    }

    /// Wakes `session`'s worker to look at its inbox (starting one if
    /// needed); wakes coalesce, and a sleeping root turn learns that
    /// background results wait.
    pub fn wake_inbox(self: &Arc<Self>, session: SessionId) {
        let mut workers = self.workers.lock();
        let handle = self.worker_locked(&mut workers, session);
        let shared = &handle.shared;
        if let Some(active) = shared.active.lock().as_ref() {
            active.mailbox.note_queued(WakeSource::AgentQueue);
        }
        shared.paused.store(false, Ordering::Release);
        shared.wake_pending.store(true, Ordering::Release);
        shared.wake.notify_one();
    }

    /// The id of the turn `session` is running, if any.
    pub fn running_turn(&self, session: SessionId) -> Option<TurnId> {
        self.active_turn(session).map(|a| a.turn_id)
    }

    pub(super) fn active_turn(&self, session: SessionId) -> Option<ActiveTurn> {
        let workers = self.workers.lock();
        let handle = workers.get(&session)?;
        let active = handle.shared.active.lock().clone();
        active
    }

    /// Queues `task` on the session's worker, starting one if needed.
    fn enqueue(self: &Arc<Self>, session: SessionId, task: UserTask) -> Result<()> {
        let mut workers = self.workers.lock();
        let mut task = task;
        for _ in 0..2 {
            let handle = self.worker_locked(&mut workers, session);
            match handle.user_tx.try_send(task) {
                Ok(()) => {
                    // The user's next turn also resumes the inbox after /stop.
                    handle.shared.paused.store(false, Ordering::Release);
                    if let Some(active) = handle.shared.active.lock().as_ref() {
                        active.mailbox.note_queued(WakeSource::UserQueue);
                    }
                    return Ok(());
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    return Err(EngineError::SessionBusy {
                        queued: self.config.user_queue,
                    })
                }
                // The worker is gone without deregistering (it panicked):
                // replace it.
                Err(mpsc::error::TrySendError::Closed(t)) => {
                    workers.remove(&session);
                    task = t;
                }
            }
        }
        Err(EngineError::SessionBusy {
            queued: self.config.user_queue,
        })
    }

    /// The session's worker; started if it has none. Called under the
    /// registry lock.
    fn worker_locked<'a>(
        self: &Arc<Self>,
        workers: &'a mut HashMap<SessionId, WorkerHandle>,
        session: SessionId,
    ) -> &'a WorkerHandle {
        workers.entry(session).or_insert_with(|| {
            let (user_tx, user_rx) = mpsc::channel(self.config.user_queue.max(1));
            let shared = Arc::new(WorkerShared::default());
            let state = WorkerState {
                user_rx,
                carried: VecDeque::new(),
                next_user: None,
                // A new worker looks at the inbox once.
                inbox_due: true,
                next_inbox_at: None,
                next_approval_at: None,
                user_burst: 0,
                lingered: false,
            };
            tokio::spawn(worker_loop(
                Arc::downgrade(self),
                session,
                state,
                Arc::clone(&shared),
            ));
            WorkerHandle { user_tx, shared }
        })
    }

    /// One decision of the worker: run the next turn, wait, or leave. A
    /// step that may run a turn or write the session holds its lease
    /// (several processes on one database; see `leases`).
    async fn worker_step(
        self: &Arc<Self>,
        session: SessionId,
        shared: &Arc<WorkerShared>,
        state: &mut WorkerState,
    ) -> Step {
        if shared.wake_pending.swap(false, Ordering::AcqRel) {
            state.inbox_due = true;
        }
        if state.next_user.is_none() {
            state.next_user = state
                .carried
                .pop_front()
                .or_else(|| state.user_rx.try_recv().ok());
        }
        let work = state.next_user.is_some()
            || state.inbox_due
            || shared.approvals_open.load(Ordering::Acquire);
        if !work {
            return self.decide(session, shared, state).await;
        }
        let hold = match self.hold(session).await {
            Ok(hold) => hold,
            Err(EngineError::Store(e)) if e.is_fenced() => {
                // This process may write nothing more: what waits here is
                // refused, and the worker leaves (another process runs the
                // session's queued inputs once it takes this one over).
                tracing::error!(session_id = %session, error = %e, "this process was taken over; the session's queued turns are refused here");
                return self.refuse_all(session, shared, state, &e);
            }
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "taking the session's lease failed; retried in a second");
                state.inbox_due = true;
                return Step::Wait(Some(clock::now_ms().saturating_add(1000)));
            }
        };
        let step = self.decide(session, shared, state).await;
        hold.release().await;
        step
    }

    /// Answers every user turn waiting on the worker with `error` and
    /// leaves the registry (a later send starts a new worker).
    fn refuse_all(
        &self,
        session: SessionId,
        shared: &Arc<WorkerShared>,
        state: &mut WorkerState,
        error: &keel_store::StoreError,
    ) -> Step {
        let mut workers = self.workers.lock();
        let refused = state
            .next_user
            .take()
            .into_iter()
            .chain(std::mem::take(&mut state.carried))
            .chain(std::iter::from_fn(|| state.user_rx.try_recv().ok()));
        for task in refused {
            if let Some(reply) = task.reply {
                let _ = reply.send(Err(EngineError::Store(error.clone())));
            }
        }
        if workers
            .get(&session)
            .is_some_and(|h| Arc::ptr_eq(&h.shared, shared))
        {
            workers.remove(&session);
        }
        Step::Exit
    }

    /// [`Self::worker_step`] once the lease, if needed, is held.
    async fn decide(
        self: &Arc<Self>,
        session: SessionId,
        shared: &Arc<WorkerShared>,
        state: &mut WorkerState,
    ) -> Step {
        let paused = shared.paused.load(Ordering::Acquire);
        let policy = &self.config.inbox;
        let now = clock::now_ms();
        let ttl = super::continuation::millis(policy.event_ttl);
        let inbox_read = state.inbox_due && !paused;
        // Approvals come first: a decided turn resumes before anything
        // else runs, and results wait while a decision is pending. When the
        // inbox is to be read too, both schedules are read at once.
        let mut approvals_pending = false;
        let mut inbox = None;
        if state.inbox_due || shared.approvals_open.load(Ordering::Acquire) {
            let approvals = if inbox_read {
                let read = self.store.schedules(session, now, ttl).await;
                let (approvals, read) = match read {
                    Ok((approvals, schedule)) => (Ok(approvals), Ok(schedule)),
                    Err(e) => (Err(e.clone()), Err(e)),
                };
                inbox = Some(read);
                approvals
            } else {
                self.store.approval_schedule(session, now).await
            };
            match self
                .approval_step(session, shared, state, now, approvals)
                .await
            {
                ApprovalStep::Ran => return Step::Again,
                ApprovalStep::Pending => approvals_pending = true,
                ApprovalStep::Clear => {}
            }
        }
        if inbox_read && !approvals_pending {
            let read = match inbox {
                Some(read) => read,
                None => self.store.inbox_schedule(session, now, ttl).await,
            };
            match read {
                Ok(schedule) => {
                    if schedule.expired > 0 {
                        self.dead_letter_expired(session, now).await;
                    } else if schedule.untold_dead_letters > 0 {
                        self.tell_dead_letters(session).await;
                    }
                    state.next_inbox_at = schedule.next_due_at_ms;
                    match schedule.oldest_due_at_ms {
                        None => state.inbox_due = false,
                        Some(oldest) => {
                            let waited = u64::try_from(now.saturating_sub(oldest)).unwrap_or(0);
                            let first = state.next_user.is_none()
                                || state.user_burst >= policy.max_user_turn_burst
                                || u128::from(waited) >= policy.max_wait.as_millis();
                            if first {
                                state.user_burst = 0;
                                let _busy = Busy::start(&shared.busy);
                                if !self.run_continuation(session, shared).await {
                                    state.inbox_due = false;
                                }
                                return Step::Again;
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "reading the inbox schedule failed; retried in a second");
                    state.inbox_due = false;
                    state.next_inbox_at = Some(now.saturating_add(1000));
                }
            }
        }
        if let Some(task) = state.next_user.take() {
            if state.inbox_due {
                state.user_burst += 1;
            }
            state.lingered = false;
            let _busy = Busy::start(&shared.busy);
            self.run_user_turn(session, shared, state, task).await;
            return Step::Again;
        }
        let due = [
            state.next_inbox_at.filter(|_| !paused),
            state.next_approval_at,
        ]
        .into_iter()
        .flatten()
        .min();
        if let Some(at) = due {
            return Step::Wait(Some(at));
        }
        // On a database other processes share, an idle worker stays as
        // long as its dialog's lease lingers: the dialog's next message
        // finds it with its schedules read, and runs at once.
        let linger = self.config.lease_linger;
        if !state.lingered && !linger.is_zero() && self.store.shared() {
            state.lingered = true;
            let millis = i64::try_from(linger.as_millis()).unwrap_or(i64::MAX);
            return Step::Linger(clock::now_ms().saturating_add(millis));
        }
        let mut workers = self.workers.lock();
        if !state.user_rx.is_empty() || shared.wake_pending.load(Ordering::Acquire) {
            return Step::Again;
        }
        if workers
            .get(&session)
            .is_some_and(|h| Arc::ptr_eq(&h.shared, shared))
        {
            workers.remove(&session);
            return Step::Exit;
        }
        Step::Wait(None)
    }

    /// Expires, resumes or reports the session's approvals, given their
    /// schedule read at `now`.
    async fn approval_step(
        self: &Arc<Self>,
        session: SessionId,
        shared: &Arc<WorkerShared>,
        state: &mut WorkerState,
        now: i64,
        schedule: keel_store::Result<keel_store::ApprovalSchedule>,
    ) -> ApprovalStep {
        let schedule = match schedule {
            Ok(schedule) => schedule,
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "reading the approval schedule failed; retried in a second");
                shared.approvals_open.store(false, Ordering::Release);
                state.next_approval_at = Some(now.saturating_add(1000));
                return ApprovalStep::Clear;
            }
        };
        if schedule.expired > 0 {
            match self.store.expire_approvals(session, now).await {
                Ok(expired) => {
                    for record in expired {
                        trace::settle_approval(record.id, "expired");
                        self.events
                            .publish(session, SessionEvent::ApprovalDecided(Box::new(record)));
                    }
                }
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "expiring approvals failed; retried in a second");
                    state.next_approval_at = Some(now.saturating_add(1000));
                    return ApprovalStep::Pending;
                }
            }
            return ApprovalStep::Ran;
        }
        shared.approvals_open.store(
            schedule.pending > 0 || schedule.resumable.is_some(),
            Ordering::Release,
        );
        state.next_approval_at = schedule.next_expiry_at_ms;
        if !schedule.resumable_runs.is_empty() {
            // Background runs resume in tasks of their own: the worker goes on.
            if let Err(e) = self.resume_runs(session, &schedule.resumable_runs).await {
                tracing::warn!(session_id = %session, error = %e, "resuming runs after their approvals failed; retried in a second");
                state.next_approval_at = Some(now.saturating_add(1000));
            }
        }
        if let Some(turn) = schedule.resumable {
            let _busy = Busy::start(&shared.busy);
            if let Err(e) = self.resume_approved(session, shared, turn).await {
                tracing::warn!(session_id = %session, error = %e, "resuming a turn after its approvals failed; retried in a second");
                shared.approvals_open.store(false, Ordering::Release);
                state.next_approval_at = Some(now.saturating_add(1000));
                return ApprovalStep::Pending;
            }
            return ApprovalStep::Ran;
        }
        if schedule.pending > 0 {
            ApprovalStep::Pending
        } else {
            ApprovalStep::Clear
        }
    }

    async fn run_user_turn(
        self: &Arc<Self>,
        session: SessionId,
        shared: &Arc<WorkerShared>,
        state: &mut WorkerState,
        task: UserTask,
    ) {
        let span = trace::turn_span(session, task.turn_id, TurnOrigin::User);
        let end = self
            .run_turn(
                session,
                shared,
                task.turn_id,
                TurnOrigin::User,
                vec![task.input],
                task.cancel,
                None,
                task.queued,
            )
            .instrument(span)
            .await;
        let result = end.result;
        if result.is_ok() {
            // Steer the model never read becomes the next turn, in order.
            for input in end.unread {
                state.carried.push_back(UserTask {
                    turn_id: TurnId::new(),
                    input,
                    queued: false,
                    cancel: CancellationToken::new(),
                    reply: None,
                });
            }
        }
        if let Some(reply) = task.reply {
            let _ = reply.send(result);
        }
    }

    /// Runs one turn on the worker: registers it for steer and stop,
    /// streams its events to the session feed, commits it (consuming
    /// `answers` with it), publishes the outcome, and releases inbox events
    /// steered into it that it never read. A `queued` input (see
    /// [`Self::send`]) that cannot start is withdrawn from the queue; one
    /// cancelled before it started stays queued for the next process.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_turn(
        self: &Arc<Self>,
        session: SessionId,
        shared: &Arc<WorkerShared>,
        turn_id: TurnId,
        origin: TurnOrigin,
        input: Vec<Message>,
        cancel: CancellationToken,
        answers: Option<LeasedEvents>,
        queued: bool,
    ) -> TurnEnd {
        let mailbox = Arc::new(TurnMailbox::new(turn_id, self.config.mailbox));
        let (done_tx, done_rx) = watch::channel(false);
        {
            let mut active = shared.active.lock();
            if origin != TurnOrigin::User && shared.paused.load(Ordering::Acquire) {
                // Stopped before it started: answer nothing now.
                cancel.cancel();
            }
            *active = Some(ActiveTurn {
                turn_id,
                origin,
                cancel: cancel.clone(),
                mailbox: Arc::clone(&mailbox),
                done: done_rx,
            });
        }
        self.events
            .publish(session, SessionEvent::TurnStarted { turn_id, origin });
        let started_at = std::time::Instant::now();
        // Armed once the turn starts on the worker (time in the queue does
        // not count), for user and continuation turns alike.
        let deadline = self
            .config
            .turn_timeout
            .map(|after| Deadline::arm(after, &cancel));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let started = if cancel.is_cancelled() {
            // Cancelled while it waited in the queue: it never runs.
            Err(EngineError::Cancelled)
        } else {
            self.start_turn(
                session,
                TurnStart {
                    turn_id,
                    origin,
                    input,
                    events: Some(tx),
                    mailbox: Arc::clone(&mailbox),
                    cancel,
                    read_only: origin != TurnOrigin::User,
                    answers,
                    queued,
                    approvals_open: shared.approvals_open.load(Ordering::Acquire),
                },
            )
            .await
        };
        if let Err(e) = &started {
            // The storage failing, or another process holding the session,
            // refuses nothing: the acknowledged input stays queued for the
            // next process that runs it (a restart, or a takeover).
            let storage = matches!(
                e,
                EngineError::Store(s) if s.is_retryable()
                    || s.is_fenced()
                    || matches!(s, keel_store::StoreError::Conflict(_))
            );
            if queued && !e.is_cancelled() && !storage {
                self.withdraw_queued(session, turn_id).await;
            }
        }
        let mut input_kept = false;
        let result = match started {
            Err(e) => Err(e),
            Ok(pending) => {
                input_kept = pending.input_committed();
                let finalize = pending.finalize();
                tokio::pin!(finalize);
                loop {
                    tokio::select! {
                        biased;
                        Some(event) = rx.recv() => {
                            self.events.publish(session, SessionEvent::Turn { turn_id, origin, event });
                        }
                        result = &mut finalize => break result,
                    }
                }
            }
        };
        while let Ok(event) = rx.try_recv() {
            self.events.publish(
                session,
                SessionEvent::Turn {
                    turn_id,
                    origin,
                    event,
                },
            );
        }
        let result = result.map_err(|e| match &deadline {
            Some(deadline) => deadline.explain(e),
            None => e,
        });
        trace::record_end(
            &tracing::Span::current(),
            result.as_ref().map(|r| &r.output.usage),
        );
        let leftovers = mailbox.close(result.is_err());
        *shared.active.lock() = None;
        if !leftovers.agent.is_empty() {
            // Steered events the turn did not consume go back to the queue.
            self.release_unread(session, leftovers.agent).await;
        }
        if let Ok(report) = &result {
            if !report.approvals.is_empty() {
                shared.approvals_open.store(true, Ordering::Release);
                self.announce_approvals(session, &report.approvals).await;
            }
        }
        let outcome = match &result {
            Ok(report) => SessionEvent::TurnCommitted {
                turn_id,
                origin,
                checkpoint: report.checkpoint,
                usage: report.output.usage,
            },
            Err(e) => SessionEvent::TurnFailed {
                turn_id,
                origin,
                message: if e.is_internal() {
                    internal_message(e)
                } else {
                    e.to_string()
                },
                cancelled: e.is_cancelled(),
                timed_out: e.is_timed_out(),
                budget_exhausted: e.is_budget_exhausted(),
                input_kept,
            },
        };
        crate::metrics::turn_ended(origin, &result, started_at.elapsed());
        self.events.publish(session, outcome);
        TurnEnd {
            result,
            unread: leftovers.user,
            done: done_tx,
        }
    }

    /// Takes the input of a turn that could not start off the store's queue
    /// (it was refused like a message sent to a read-only slot), so no later
    /// process runs it.
    async fn withdraw_queued(&self, session: SessionId, turn_id: TurnId) {
        if let Err(e) = self.store.discard_queued_input(turn_id).await {
            tracing::warn!(session_id = %session, turn_id = %turn_id, error = %e, "withdrawing a queued input that could not start failed; the next start runs it");
        }
    }

    /// Returns inbox events a turn held but did not consume to pending
    /// (no failed attempt: they were never answered) and wakes the worker.
    pub(super) async fn release_unread(
        self: &Arc<Self>,
        session: SessionId,
        held: Vec<LeasedEvents>,
    ) {
        for lease in held {
            let released = self
                .store
                .release_inbox_lease(keel_store::ReleaseRequest {
                    event_ids: lease.event_ids,
                    lease_token: lease.lease_token,
                    now_ms: clock::now_ms(),
                    backoff_ms: 0,
                    max_attempts: self.config.inbox.max_delivery_attempts,
                    count_attempt: false,
                    error: None,
                })
                .await;
            if let Err(e) = released {
                tracing::warn!(session_id = %session, error = %e, "releasing unread steered events failed; they are recovered at the next start");
            }
        }
        self.events.project(session).await;
    }
}

/// A turn's deadline: cancels the turn when it passes; disarmed on drop.
struct Deadline {
    after: Duration,
    fired: Arc<AtomicBool>,
    timer: tokio::task::JoinHandle<()>,
}

impl Deadline {
    /// Cancels `turn` `after` from now, unless it was cancelled before.
    fn arm(after: Duration, turn: &CancellationToken) -> Self {
        let fired = Arc::new(AtomicBool::new(false));
        let timer = tokio::spawn({
            let (fired, turn) = (Arc::clone(&fired), turn.clone());
            async move {
                tokio::select! {
                    () = tokio::time::sleep(after) => {
                        fired.store(true, Ordering::Release);
                        turn.cancel();
                    }
                    () = turn.cancelled() => {}
                }
            }
        });
        Self {
            after,
            fired,
            timer,
        }
    }

    /// `error`, or [`EngineError::TimedOut`] when it is the cancellation
    /// this deadline caused.
    fn explain(&self, error: EngineError) -> EngineError {
        if error.is_cancelled() && self.fired.load(Ordering::Acquire) {
            EngineError::TimedOut {
                secs: self.after.as_secs(),
            }
        } else {
            error
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.timer.abort();
    }
}

/// The worker task of `session`; see the module docs. It holds the manager
/// only while it works, never while it waits.
async fn worker_loop(
    manager: Weak<SessionManager>,
    session: SessionId,
    mut state: WorkerState,
    shared: Arc<WorkerShared>,
) {
    loop {
        let step = {
            let Some(manager) = manager.upgrade() else {
                return;
            };
            manager.worker_step(session, &shared, &mut state).await
        };
        match step {
            Step::Again => {}
            Step::Exit => return,
            Step::Linger(until) => {
                tokio::select! {
                    biased;
                    task = state.user_rx.recv() => match task {
                        Some(task) => state.next_user = Some(task),
                        None => return,
                    },
                    () = shared.wake.notified() => state.lingered = false,
                    () = tokio::time::sleep_until(clock::instant_at(until)) => {}
                }
            }
            Step::Wait(due) => {
                let retry = async {
                    match due {
                        Some(at) => tokio::time::sleep_until(clock::instant_at(at)).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    task = state.user_rx.recv() => match task {
                        Some(task) => state.next_user = Some(task),
                        None => return,
                    },
                    () = shared.wake.notified() => {}
                    () = retry => {
                        state.inbox_due = true;
                        state.next_inbox_at = None;
                        state.next_approval_at = None;
                    }
                }
            }
        }
    }
}
