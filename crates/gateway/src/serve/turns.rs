//! [`TurnRunner`]: runs the turns clients start, independent of the
//! connection that started them (a client that disconnects does not cancel
//! its turn), publishes their events to the dialog's subscribers, and lets
//! a shutdown wait for them — then cancel those still running, which
//! commits nothing of their answers (a user's message stays, unanswered).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use keel_core::{FinishReason, Message, SessionId, StreamEvent, TurnId};
use keel_engine::{
    EngineError, SessionEvent, SessionManager, SteerOutcome, SubscriptionError, TurnEvent,
};
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::api::{Dialog, IfBusy, SteerReport, TurnOrigin, PREVIEW_BYTES};
use super::frames::ServerFrame;
use super::hub::Hub;
use super::problem::{ApiError, ApiResult};
use super::projection::Projections;
use super::relay::{Outgoing, SteerAnswer};

/// How long a stop waits for the end of the turn another process runs.
const REMOTE_STOP_WAIT: Duration = Duration::from_secs(5);

/// How long a steer waits for the answer of the process running the turn.
const REMOTE_STEER_WAIT: Duration = Duration::from_secs(2);

/// How turns ended during a shutdown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Turns that ended (committed or failed) within the grace period.
    pub finished: usize,
    /// Turns cancelled when the grace period ran out (nothing of them was saved).
    pub cancelled: usize,
}

/// Runs client turns; see the module docs.
pub struct TurnRunner {
    manager: Arc<SessionManager>,
    hub: Arc<Hub>,
    projections: Arc<Projections>,
    tracker: TaskTracker,
    /// Cancelled when a shutdown's grace period runs out: every turn still
    /// running or waiting for its dialog is cancelled.
    cancel_all: CancellationToken,
    /// Turns sent and not ended yet (running or queued), with their dialog.
    running: Mutex<HashMap<TurnId, (SessionId, CancellationToken)>>,
    /// Dialogs whose continuation turns are forwarded to the hub.
    followed: Mutex<HashSet<SessionId>>,
    /// User turns no connection started (resumed after a restart), which
    /// the dialog's forwarder publishes like continuations until they end.
    adopted: Mutex<HashSet<TurnId>>,
    /// The turn another process runs, per dialog, as its relayed frames
    /// say (started and not yet ended).
    remote: Mutex<HashMap<SessionId, uuid::Uuid>>,
    /// Told each time `remote` loses a turn.
    remote_ended: tokio::sync::watch::Sender<()>,
    /// Steers relayed to the process running the turn, awaiting its answer.
    steers: Mutex<HashMap<uuid::Uuid, oneshot::Sender<SteerAnswer>>>,
}

impl std::fmt::Debug for TurnRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnRunner")
            .field("running", &self.running.lock().len())
            .finish_non_exhaustive()
    }
}

/// The frame of one turn event.
fn event_frame(session: SessionId, turn: TurnId, event: TurnEvent) -> Option<ServerFrame> {
    let session_id = session.as_uuid();
    let turn_id = turn.as_uuid();
    Some(match event {
        TurnEvent::Stream(StreamEvent::TextDelta { text }) => ServerFrame::TextDelta {
            event_id: None,
            session_id,
            turn_id,
            text,
        },
        TurnEvent::Stream(StreamEvent::Finish { reason }) => ServerFrame::ModelCallFinished {
            event_id: None,
            session_id,
            turn_id,
            finish_reason: finish_reason_text(&reason),
        },
        TurnEvent::Stream(_) => return None,
        TurnEvent::ToolStarted { call } => ServerFrame::ToolStarted {
            event_id: None,
            session_id,
            turn_id,
            call_id: call.id,
            name: call.name,
            arguments: call.arguments,
        },
        TurnEvent::ToolFinished {
            call_id,
            name,
            output,
        } => ServerFrame::ToolFinished {
            event_id: None,
            session_id,
            turn_id,
            call_id,
            name,
            output: keel_core::truncate_with_note(output.content, PREVIEW_BYTES),
            is_error: output.is_error,
        },
        TurnEvent::SystemNotice { text } => ServerFrame::Notice {
            event_id: None,
            session_id,
            turn_id,
            text,
        },
    })
}

/// The wire word for why a model stopped.
fn finish_reason_text(reason: &FinishReason) -> String {
    match reason {
        FinishReason::Stop => "stop".to_owned(),
        FinishReason::ToolCalls => "tool_calls".to_owned(),
        FinishReason::Length => "length".to_owned(),
        FinishReason::ContentFilter => "content_filter".to_owned(),
        FinishReason::Other(other) => other.clone(),
    }
}

/// The message a client reads about a turn that ended unsaved.
fn failure_message(e: &EngineError) -> String {
    if e.is_cancelled() {
        "the turn was stopped; its answer was not saved".to_owned()
    } else if e.is_timed_out() {
        e.to_string()
    } else if e.is_internal() {
        ApiError::internal(e).to_string()
    } else {
        format!("the turn failed and its answer was not saved: {e}")
    }
}

impl TurnRunner {
    /// A runner of `manager`'s turns publishing to `hub`.
    pub fn new(manager: Arc<SessionManager>, hub: Arc<Hub>, projections: Arc<Projections>) -> Self {
        Self {
            manager,
            hub,
            projections,
            tracker: TaskTracker::new(),
            cancel_all: CancellationToken::new(),
            running: Mutex::new(HashMap::new()),
            followed: Mutex::new(HashSet::new()),
            adopted: Mutex::new(HashSet::new()),
            remote: Mutex::new(HashMap::new()),
            remote_ended: tokio::sync::watch::Sender::new(()),
            steers: Mutex::new(HashMap::new()),
        }
    }

    /// Notes that another process started `turn` of `session`.
    pub(crate) fn remote_turn_started(&self, session: SessionId, turn: uuid::Uuid) {
        self.remote.lock().insert(session, turn);
    }

    /// Notes that another process's `turn` of `session` ended.
    pub(crate) fn remote_turn_ended(&self, session: SessionId, turn: uuid::Uuid) {
        let mut remote = self.remote.lock();
        if remote.get(&session) == Some(&turn) {
            remote.remove(&session);
            self.remote_ended.send_replace(());
        }
    }

    /// Forgets every turn other processes were running (their ends may
    /// have been lost).
    pub(crate) fn forget_remote_turns(&self) {
        self.remote.lock().clear();
        self.remote_ended.send_replace(());
    }

    /// Waits until `turn` of `session`, run by another process, is no
    /// longer known to run.
    async fn remote_turn_gone(&self, session: SessionId, turn: uuid::Uuid) {
        let mut ended = self.remote_ended.subscribe();
        while self.remote.lock().get(&session) == Some(&turn) {
            if ended.changed().await.is_err() {
                return;
            }
        }
    }

    /// `/stop` of `session` from a client of this process: stops what runs
    /// of it here ([`SessionManager::stop`]) and tells the other processes
    /// on the database to stop theirs. A turn another process runs is
    /// waited for (at most [`REMOTE_STOP_WAIT`]). Whether a turn was
    /// running, here or there.
    pub async fn stop(&self, session: SessionId) -> ApiResult<bool> {
        let remote = self.remote.lock().get(&session).copied();
        let relayed = self.hub.relay(Outgoing::Stop(session));
        let here = self.manager.stop(session).await?.turn.is_some();
        let Some(turn) = remote.filter(|_| relayed) else {
            return Ok(here);
        };
        if tokio::time::timeout(REMOTE_STOP_WAIT, self.remote_turn_gone(session, turn))
            .await
            .is_err()
        {
            tracing::warn!(session_id = %session, %turn, "another server was asked to stop this dialog's turn and has not ended it yet");
        }
        Ok(true)
    }

    /// A `/stop` another process relayed: stops what runs of `session` here.
    pub(crate) async fn stop_relayed(&self, session: SessionId) {
        match self.manager.stop(session).await {
            Ok(report) if report.turn.is_some() || !report.runs_cancelled.is_empty() => {
                tracing::info!(session_id = %session, "stopped at another server's request");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "a stop another server relayed failed here");
            }
        }
    }

    /// Gives `text` (checked) to `session`'s running turn, here or, through
    /// the relay, in the process that runs it (waiting at most
    /// [`REMOTE_STEER_WAIT`] for its answer). With no running turn nothing
    /// is done.
    pub async fn steer(&self, session: SessionId, text: String) -> ApiResult<SteerReport> {
        let not_steered = SteerReport {
            steered: false,
            turn_id: None,
        };
        if let SteerOutcome::Steered { turn_id } = self.manager.steer(session, &text)? {
            return Ok(SteerReport {
                steered: true,
                turn_id: Some(turn_id.as_uuid()),
            });
        }
        let Some(turn) = self.remote.lock().get(&session).copied() else {
            return Ok(not_steered);
        };
        let request = uuid::Uuid::new_v4();
        let (answer_tx, answer) = oneshot::channel();
        self.steers.lock().insert(request, answer_tx);
        let asked = self.hub.relay(Outgoing::Steer {
            session,
            request,
            text,
        });
        let answer = if asked {
            tokio::select! {
                answer = answer => answer.ok(),
                () = self.remote_turn_gone(session, turn) => None,
                () = tokio::time::sleep(REMOTE_STEER_WAIT) => None,
            }
        } else {
            None
        };
        self.steers.lock().remove(&request);
        match answer {
            Some(SteerAnswer::Steered { turn_id }) => Ok(SteerReport {
                steered: true,
                turn_id: Some(turn_id),
            }),
            Some(SteerAnswer::Full { capacity }) => Err(EngineError::SteerFull { capacity }.into()),
            None => Ok(not_steered),
        }
    }

    /// A steer another process relayed: given to `session`'s turn if it
    /// runs here, and answered; otherwise left to the process that runs it.
    pub(crate) fn steer_relayed(&self, session: SessionId, request: uuid::Uuid, text: &str) {
        let answer = match self.manager.steer(session, text) {
            Ok(SteerOutcome::Steered { turn_id }) => SteerAnswer::Steered {
                turn_id: turn_id.as_uuid(),
            },
            Ok(SteerOutcome::NoRunningTurn) => return,
            Err(EngineError::SteerFull { capacity }) => SteerAnswer::Full { capacity },
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "a steer another server relayed failed here");
                return;
            }
        };
        self.hub.relay(Outgoing::Steered {
            session,
            request,
            answer,
        });
    }

    /// The answer to a steer this process relayed.
    pub(crate) fn steer_answered(&self, request: uuid::Uuid, answer: SteerAnswer) {
        if let Some(waiting) = self.steers.lock().remove(&request) {
            let _ = waiting.send(answer);
        }
    }

    /// Makes the dialog's forwarder publish `turn`, a user turn no
    /// connection of this process started (one resumed after a restart).
    /// Call it before the turn can start.
    pub fn adopt(&self, turn: TurnId) {
        self.adopted.lock().insert(turn);
    }

    /// Forwards the turns of `session` that no client started — the
    /// continuation turns that answer background results, and adopted
    /// user turns ([`Self::adopt`]) — and its generated titles to the hub
    /// while anyone watches the dialog (one forwarder per dialog). Returns
    /// once the forwarder reads the dialog's feed (or one already did).
    pub async fn follow_continuations(self: &Arc<Self>, session: SessionId) {
        if !self.followed.lock().insert(session) {
            return;
        }
        match self.manager.events().subscribe(session).await {
            Ok(feed) => {
                let me = self.clone();
                tokio::spawn(async move { me.forward_continuations(session, feed).await });
            }
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "cannot follow the dialog's continuation turns");
                self.followed.lock().remove(&session);
            }
        }
    }

    async fn forward_continuations(
        &self,
        session: SessionId,
        mut feed: keel_engine::SessionSubscription,
    ) {
        // Turns no connection publishes: continuations and adopted turns.
        let unowned = |turn: &TurnId, origin: &keel_core::TurnOrigin| {
            *origin != keel_core::TurnOrigin::User || self.adopted.lock().contains(turn)
        };
        loop {
            let event = match feed.recv().await {
                Ok(event) => event,
                Err(SubscriptionError::Lagged { .. }) => continue,
                Err(SubscriptionError::Closed) => {
                    self.followed.lock().remove(&session);
                    return;
                }
            };
            let session_id = session.as_uuid();
            match event.as_ref() {
                // A title generated after a turn, off its path.
                SessionEvent::Retitled { .. } => self.publish_dialog(session).await,
                SessionEvent::ApprovalRequested(a) => self.hub.publish(
                    session,
                    ServerFrame::ApprovalRequested {
                        session_id,
                        revision: a.revision,
                        approval: crate::serve::api::Approval::from(a.as_ref()),
                    },
                ),
                SessionEvent::ApprovalDecided(a) => self.hub.publish(
                    session,
                    ServerFrame::ApprovalDecided {
                        session_id,
                        revision: a.revision,
                        approval: crate::serve::api::Approval::from(a.as_ref()),
                    },
                ),
                SessionEvent::TurnStarted { turn_id, origin } if unowned(turn_id, origin) => {
                    // The runs whose results it answers ended before it was
                    // woken: their final status is published first.
                    self.projections.refresh(session).await;
                    self.hub.publish(
                        session,
                        ServerFrame::TurnStarted {
                            event_id: None,
                            session_id,
                            turn_id: turn_id.as_uuid(),
                            turn_origin: (*origin).into(),
                        },
                    );
                }
                SessionEvent::Turn {
                    turn_id,
                    origin,
                    event,
                } if unowned(turn_id, origin) => {
                    self.publish_event(session, *turn_id, event.clone());
                }
                SessionEvent::TurnCommitted {
                    turn_id,
                    origin,
                    checkpoint,
                    usage,
                } if unowned(turn_id, origin) => {
                    self.adopted.lock().remove(turn_id);
                    self.hub.publish(
                        session,
                        ServerFrame::TurnCommitted {
                            event_id: None,
                            session_id,
                            turn_id: turn_id.as_uuid(),
                            turn_origin: (*origin).into(),
                            checkpoint_id: checkpoint.map(|c| c.as_uuid()),
                            usage: (*usage).into(),
                        },
                    );
                    self.publish_dialog(session).await;
                    self.projections.refresh(session).await;
                }
                SessionEvent::TurnFailed {
                    turn_id,
                    origin,
                    message,
                    cancelled,
                    timed_out,
                    budget_exhausted,
                    input_kept,
                } if unowned(turn_id, origin) => {
                    self.adopted.lock().remove(turn_id);
                    self.hub.publish(
                        session,
                        ServerFrame::TurnFailed {
                            event_id: None,
                            session_id,
                            turn_id: turn_id.as_uuid(),
                            turn_origin: (*origin).into(),
                            cancelled: *cancelled,
                            timed_out: *timed_out,
                            budget_exhausted: *budget_exhausted,
                            input_kept: *input_kept,
                            message: message.clone(),
                        },
                    );
                    self.projections.refresh(session).await;
                }
                _ => {}
            }
            // Checked and forgotten under the lock, so a client that
            // subscribes meanwhile either is seen here or starts a new
            // forwarder.
            let mut followed = self.followed.lock();
            if !self.hub.is_watched(session) {
                followed.remove(&session);
                return;
            }
        }
    }

    /// Turns running now.
    pub fn running(&self) -> usize {
        self.running.lock().len()
    }

    /// Cancels `turn` if this runner runs it (it commits nothing of its
    /// answer); whether it did.
    pub fn cancel(&self, turn: uuid::Uuid) -> bool {
        let running = self.running.lock();
        let token = running.iter().find(|(t, _)| t.as_uuid() == turn);
        token.map(|(_, (_, token))| token.cancel()).is_some()
    }

    /// Whether a turn of `session` other than `except` was sent and has not
    /// ended (running or queued), or runs now (a continuation), here or
    /// (as its relayed frames say) in another process.
    pub fn has_turn(&self, session: SessionId, except: Option<uuid::Uuid>) -> bool {
        let other = |t: &TurnId| Some(t.as_uuid()) != except;
        self.manager
            .running_turn(session)
            .is_some_and(|t| other(&t))
            || self
                .running
                .lock()
                .iter()
                .any(|(t, (s, _))| *s == session && other(t))
            || self
                .remote
                .lock()
                .get(&session)
                .is_some_and(|t| Some(*t) != except)
    }

    /// Whether new turns are refused (a shutdown began).
    pub fn is_draining(&self) -> bool {
        self.tracker.is_closed()
    }

    /// Queues a user turn of `session` with `input` (a user message, its
    /// images already stored) on the session's worker; returns its id at
    /// once (it runs after the dialog's earlier turns). `if_busy` says what
    /// happens instead when a turn is running: see [`IfBusy`] (a steer
    /// carries text only: a message with images is queued instead). Returns
    /// the turn and whether the text steered it.
    pub async fn send(
        self: &Arc<Self>,
        session: SessionId,
        input: Message,
        if_busy: IfBusy,
        webhook: Option<String>,
    ) -> ApiResult<(TurnId, bool)> {
        if self.is_draining() {
            return Err(ApiError::Unavailable(
                "the server is shutting down; no new turns are started".to_owned(),
            ));
        }
        match if_busy {
            IfBusy::Enqueue => {}
            IfBusy::Reject => {
                if let Some(turn) = self.manager.running_turn(session) {
                    return Err(EngineError::TurnRunning(turn).into());
                }
            }
            IfBusy::Interrupt => {
                self.stop(session).await?;
            }
            IfBusy::Steer => {
                let text_only = input
                    .content
                    .iter()
                    .all(|p| matches!(p, keel_core::ContentPart::Text { .. }));
                if text_only {
                    let report = self.steer(session, input.text()).await?;
                    if let Some(turn) = report.turn_id.filter(|_| report.steered) {
                        return Ok((turn.into(), true));
                    }
                }
            }
        }
        self.start(session, input, webhook)
            .await
            .map(|turn| (turn, false))
    }

    /// Starts the task that sends a user turn and follows it.
    async fn start(
        self: &Arc<Self>,
        session: SessionId,
        input: Message,
        webhook: Option<String>,
    ) -> ApiResult<TurnId> {
        let (started_tx, started_rx) = oneshot::channel();
        let me = self.clone();
        self.tracker
            .spawn(async move { me.run(session, input, webhook, started_tx).await });
        match started_rx.await {
            Ok(result) => result.map_err(ApiError::from),
            Err(_) => Err(ApiError::internal(&"the turn task ended before starting")),
        }
    }

    async fn run(
        self: Arc<Self>,
        session: SessionId,
        input: Message,
        webhook: Option<String>,
        started: oneshot::Sender<Result<TurnId, EngineError>>,
    ) {
        // The turn runs on the session's worker; its events come from the
        // session feed, subscribed before it is sent so none is missed.
        let mut feed = match self.manager.events().subscribe(session).await {
            Ok(feed) => feed,
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        let send = self.manager.send_with_webhook(session, input, webhook);
        let ticket = tokio::select! {
            ticket = send => match ticket {
                Ok(t) => t,
                Err(e) => {
                    let _ = started.send(Err(e));
                    return;
                }
            },
            () = self.cancel_all.cancelled() => {
                let _ = started.send(Err(EngineError::Cancelled));
                return;
            }
        };
        let turn = ticket.turn_id();
        let turn_token = ticket.cancellation();
        let mut cancel_sent = false;
        // Whether a failed turn left the user's message stored, unanswered.
        let mut input_kept = false;
        self.running
            .lock()
            .insert(turn, (session, turn_token.clone()));
        let origin = TurnOrigin::User;
        let _ = started.send(Ok(turn));
        let cancel = self.cancel_all.clone();
        loop {
            tokio::select! {
                event = feed.recv() => match event {
                    Ok(event) => match event.as_ref() {
                        SessionEvent::TurnStarted { turn_id, .. } if *turn_id == turn => {
                            // The dialog's turns run here now: one another
                            // process was said to run has ended, its end lost.
                            self.remote.lock().remove(&session);
                            self.hub.publish(
                                session,
                                ServerFrame::TurnStarted {
                                    event_id: None,
                                    session_id: session.as_uuid(),
                                    turn_id: turn.as_uuid(),
                                    turn_origin: origin,
                                },
                            );
                        }
                        SessionEvent::Turn { turn_id, event, .. } if *turn_id == turn => {
                            self.publish_event(session, turn, event.clone());
                        }
                        SessionEvent::TurnCommitted { turn_id, .. } if *turn_id == turn => break,
                        SessionEvent::TurnFailed { turn_id, input_kept: kept, .. }
                            if *turn_id == turn =>
                        {
                            input_kept = *kept;
                            break;
                        }
                        _ => {}
                    },
                    // Frames were lost; the outcome below still arrives.
                    Err(SubscriptionError::Lagged { .. }) => {}
                    Err(SubscriptionError::Closed) => break,
                },
                () = cancel.cancelled(), if !cancel_sent => {
                    cancel_sent = true;
                    turn_token.cancel();
                }
            }
        }
        let result = ticket.outcome().await;
        self.running.lock().remove(&turn);
        let end = match &result {
            Ok(report) => ServerFrame::TurnCommitted {
                event_id: None,
                session_id: session.as_uuid(),
                turn_id: turn.as_uuid(),
                turn_origin: origin,
                checkpoint_id: report.checkpoint.map(|c| c.as_uuid()),
                usage: report.output.usage.into(),
            },
            Err(e) => ServerFrame::TurnFailed {
                event_id: None,
                session_id: session.as_uuid(),
                turn_id: turn.as_uuid(),
                turn_origin: origin,
                cancelled: e.is_cancelled(),
                timed_out: e.is_timed_out(),
                budget_exhausted: e.is_budget_exhausted(),
                input_kept,
                message: failure_message(e),
            },
        };
        self.hub.publish(session, end);
        match &result {
            // The record the commit left, without reading it again.
            Ok(report) => self.hub.publish(
                session,
                ServerFrame::DialogUpdated {
                    session_id: session.as_uuid(),
                    dialog: Dialog::from(&report.dialog),
                },
            ),
            // A kept message changed the dialog's count even without an answer.
            Err(_) if input_kept => self.publish_dialog(session).await,
            Err(_) => {}
        }
        // Only a turn that called tools can have started or cancelled runs.
        if result.as_ref().map_or(true, |r| r.output.tool_calls > 0) {
            self.projections.refresh(session).await;
        }
    }

    /// Publishes the dialog as it is now (a committed turn changed its
    /// message count and activity, and may have titled it).
    async fn publish_dialog(&self, session: SessionId) {
        match self.manager.store().get_session(session).await {
            Ok(Some(record)) => self.hub.publish(
                session,
                ServerFrame::DialogUpdated {
                    session_id: session.as_uuid(),
                    dialog: Dialog::from(&record),
                },
            ),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "cannot read the dialog to publish its change")
            }
        }
    }

    fn publish_event(&self, session: SessionId, turn: TurnId, event: TurnEvent) {
        if let Some(frame) = event_frame(session, turn, event) {
            self.hub.publish(session, frame);
        }
    }

    /// Refuses new turns from now on.
    pub fn refuse_new(&self) {
        self.tracker.close();
    }

    /// Refuses new turns, waits up to `grace` for the running ones, then
    /// cancels the rest and waits for them to end (a cancelled turn commits
    /// nothing).
    pub async fn drain(&self, grace: Duration) -> DrainReport {
        self.tracker.close();
        let before = self.running();
        if tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
        {
            return DrainReport {
                finished: before,
                cancelled: 0,
            };
        }
        let cancelled = self.running();
        self.cancel_all.cancel();
        self.tracker.wait().await;
        DrainReport {
            finished: before.saturating_sub(cancelled),
            cancelled,
        }
    }
}
