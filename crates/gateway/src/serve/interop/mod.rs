//! The ecosystem's protocols on `keel serve`: OpenAI chat completions
//! (`openai`, under `/v1`) and AG-UI (`agui`, under `/ag-ui`). docs/INTEROP.md
//! is the client's guide.
//!
//! Both protocols resend a whole conversation with every request. Here it
//! becomes a keel dialog: [`transcript`] decides whether the history is a
//! dialog's (the new input goes there), shares a prefix with one up to a
//! checkpoint (a fork, with the client's differing messages imported), or
//! is new; `Conversations::place` carries the decision out; and
//! `Conversations::start_turn` runs the input through the same turn
//! runner as the native API, handing back the turn's frames for the
//! protocol to encode. Tools and sub-agents run inside keel; clients see
//! the answer.
//!
//! One dialog runs one interop request at a time: a request holds the
//! dialog's lock from its placement until its turn ended, so two requests
//! resending the same history never both append to it (the second finds
//! the first's turn in the dialog and forks).
//!
//! Matching must not cost a read of the whole history per request (a
//! client resends it every time): `Histories` keeps each dialog's
//! matchable history with the head it was read at, and a request reads a
//! chat's dialogs and only the messages each gained since in one store
//! read ([`keel_store::Backend::dialogs_with_history_after`]). A dialog's
//! checkpoints are read only when no candidate continues. When the dialog
//! a history continues is free and no dialog's lock was released since
//! that read, no other request's turn can have changed it, and it is not
//! read again.

pub mod agui;
mod images;
mod interrupts;
pub mod mcp;
pub mod openai;
pub mod transcript;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use keel_core::{AgentId, CheckpointId, Message, Role, SessionId, TurnOrigin};
use keel_store::{
    DialogQuery, HistoryDelta, MessageFilter, SessionHead, SessionRecord, StoredMessage,
};
use parking_lot::Mutex;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};
use uuid::Uuid;

use super::api::{self, MAX_TEXT_CHARS};
use super::frames::ServerFrame;
use super::hub::SharedFrame;
use super::problem::{ApiError, ApiResult};
use super::projection::Projections;
use super::Shared;
use transcript::{Candidate, ForkPoint, Kept, Placement, Said, Speaker};

/// Most dialogs of a chat a resent history is matched against (the most
/// recently active ones).
pub const MAX_CANDIDATES: usize = 64;
/// Largest request body of the interop endpoints, in bytes (they carry
/// whole conversations).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Most messages a request's history may hold.
pub const MAX_MESSAGES: usize = 10_000;
/// Most bytes of message text the matching cache keeps (past it, the least
/// recently matched dialogs are dropped and read again in full when next
/// matched).
pub const HISTORY_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// Which dialogs a resent history is matched against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The dialogs of a chat: the OpenAI `user`, an AG-UI thread.
    Chat {
        /// The channel (`openai`, `ag-ui`).
        channel: &'static str,
        /// The chat.
        chat_id: String,
    },
    /// One dialog the client named (`X-Keel-Dialog`).
    Dialog(SessionId),
}

/// A resent conversation: where to look, which agent, what was said, and
/// the new input.
#[derive(Debug, Clone)]
pub(crate) struct Conversation {
    pub scope: Scope,
    /// The agent (`None`: the root agent).
    pub agent: Option<AgentId>,
    /// The messages before the new input.
    pub history: Vec<Said>,
    /// The new user input.
    pub input: String,
}

/// The dialog a conversation's input goes to, locked for this request.
#[derive(Debug)]
pub(crate) struct Placed {
    /// The dialog.
    pub dialog: SessionId,
    /// The dialog it was forked from, when the history was edited.
    pub forked_from: Option<SessionId>,
    guard: DialogGuard,
}

/// A dialog's lock, held from a request's placement until its turn ended.
/// Releasing it counts in `Conversations::released`.
#[derive(Debug)]
struct DialogGuard {
    _guard: OwnedMutexGuard<()>,
    released: Arc<AtomicU64>,
}

impl Drop for DialogGuard {
    fn drop(&mut self) {
        // Counted before the lock is free (fields drop after this).
        self.released.fetch_add(1, Ordering::SeqCst);
    }
}

/// The frames of one running turn, in order, for a protocol to encode.
pub(crate) struct TurnFeed {
    /// The dialog.
    pub dialog: SessionId,
    /// The dialog it was forked from, if any.
    pub forked_from: Option<SessionId>,
    /// The turn.
    pub turn: Uuid,
    frames: broadcast::Receiver<SharedFrame>,
    /// Set when the feed carries the dialog's sub-agent updates.
    runs: Option<Arc<Projections>>,
    /// Frames read ahead, in order.
    ready: VecDeque<Fed>,
    done: bool,
}

/// What a [`TurnFeed`] yields.
#[derive(Debug)]
pub(crate) enum Fed {
    /// A frame of the turn, or a sub-agent update of its dialog.
    Frame(SharedFrame),
    /// Frames were dropped because this request read too slowly; the
    /// turn goes on and is saved, but this answer cannot be complete.
    Lost,
}

impl TurnFeed {
    /// The feed with the dialog's sub-agent updates too: those published
    /// while the turn ran, and before its end every change it made.
    pub fn with_runs(mut self, projections: Arc<Projections>) -> Self {
        self.runs = Some(projections);
        self
    }

    /// Whether `frame` belongs to this feed.
    fn ours(&self, frame: &ServerFrame) -> bool {
        match frame.turn_id() {
            Some(turn) => turn == self.turn,
            None => self.runs.is_some() && matches!(frame, ServerFrame::AgentRunUpdated { .. }),
        }
    }

    /// The next frame; `None` after the frame that ended the turn.
    pub async fn next(&mut self) -> Option<Fed> {
        if let Some(fed) = self.ready.pop_front() {
            return Some(fed);
        }
        if self.done {
            return None;
        }
        loop {
            match self.frames.recv().await {
                Ok(frame) => {
                    if !self.ours(&frame) {
                        continue;
                    }
                    if !frame.ends_turn() {
                        return Some(Fed::Frame(frame));
                    }
                    self.done = true;
                    self.settle_runs().await;
                    self.ready.push_back(Fed::Frame(frame));
                    return self.ready.pop_front();
                }
                Err(RecvError::Lagged(_)) => return Some(Fed::Lost),
                Err(RecvError::Closed) => {
                    self.done = true;
                    return None;
                }
            }
        }
    }

    /// Publishes the dialog's sub-agent changes not yet published (their
    /// refreshes run apart from the turn) and queues them, so the turn's
    /// foreground runs are seen finished before the turn's end.
    async fn settle_runs(&mut self) {
        let Some(projections) = self.runs.clone() else {
            return;
        };
        projections.refresh(self.dialog).await;
        loop {
            match self.frames.try_recv() {
                Ok(frame) if matches!(frame.as_ref(), ServerFrame::AgentRunUpdated { .. }) => {
                    self.ready.push_back(Fed::Frame(frame));
                }
                Ok(_) => {}
                Err(broadcast::error::TryRecvError::Lagged(_)) => self.ready.push_back(Fed::Lost),
                Err(_) => return,
            }
        }
    }
}

/// Conversations of the interop endpoints: per-dialog locks, and the
/// dialog each AG-UI thread last ran in.
#[derive(Debug)]
pub(crate) struct Conversations {
    /// When the server started (Unix ms): the `created` of every model.
    pub(crate) started_at_ms: i64,
    locks: Mutex<HashMap<SessionId, Weak<AsyncMutex<()>>>>,
    /// How many dialog locks were released so far.
    released: Arc<AtomicU64>,
    histories: Mutex<Histories>,
    threads: agui::Threads,
}

/// A chat: (channel, chat id).
type Chat = (String, String);

/// Dialog histories as last matched, each with the head it was read at,
/// by chat. An entry is taken out while a request extends it and put back
/// after.
#[derive(Debug, Default)]
struct Histories {
    chats: HashMap<Chat, HashMap<SessionId, Cached>>,
    bytes: usize,
    clock: u64,
}

#[derive(Debug)]
struct Cached {
    head: SessionHead,
    history: Vec<Kept>,
    bytes: usize,
    used: u64,
}

impl Histories {
    /// The heads of the histories kept for `chat`'s dialogs.
    fn heads(&self, chat: &Chat) -> HashMap<SessionId, SessionHead> {
        self.chats.get(chat).map_or_else(HashMap::new, |dialogs| {
            dialogs.iter().map(|(d, c)| (*d, c.head.clone())).collect()
        })
    }

    /// Takes `dialog`'s history out, if it is kept.
    fn take(&mut self, chat: &Chat, dialog: SessionId) -> Option<(SessionHead, Vec<Kept>)> {
        let dialogs = self.chats.get_mut(chat)?;
        let cached = dialogs.remove(&dialog)?;
        if dialogs.is_empty() {
            self.chats.remove(chat);
        }
        self.bytes -= cached.bytes;
        Some((cached.head, cached.history))
    }

    /// Keeps `dialog`'s history as read at `head`, dropping the least
    /// recently kept ones past [`HISTORY_CACHE_BYTES`].
    fn put(&mut self, chat: &Chat, dialog: SessionId, head: SessionHead, history: Vec<Kept>) {
        self.take(chat, dialog);
        let bytes = history
            .iter()
            .map(|k| k.text.len() + std::mem::size_of::<Kept>())
            .sum::<usize>();
        if bytes > HISTORY_CACHE_BYTES {
            return;
        }
        while self.bytes + bytes > HISTORY_CACHE_BYTES {
            let oldest = self
                .chats
                .iter()
                .flat_map(|(chat, dialogs)| dialogs.iter().map(move |(d, c)| (c.used, chat, *d)))
                .min_by_key(|(used, _, _)| *used)
                .map(|(_, chat, d)| (chat.clone(), d));
            let Some((chat, oldest)) = oldest else {
                break;
            };
            self.take(&chat, oldest);
        }
        self.clock += 1;
        self.bytes += bytes;
        self.chats.entry(chat.clone()).or_default().insert(
            dialog,
            Cached {
                head,
                history,
                bytes,
                used: self.clock,
            },
        );
    }
}

/// How often a placement is retried when the dialog changed under it.
const PLACE_ATTEMPTS: usize = 4;

impl Conversations {
    /// Conversations of a server starting now.
    pub(crate) fn new() -> Self {
        Self {
            started_at_ms: keel_core::time::now_ms(),
            locks: Mutex::default(),
            released: Arc::default(),
            histories: Mutex::default(),
            threads: agui::Threads::default(),
        }
    }

    /// The AG-UI threads.
    pub(crate) fn threads(&self) -> &agui::Threads {
        &self.threads
    }

    fn lock_of(&self, dialog: SessionId) -> Arc<AsyncMutex<()>> {
        let mut locks = self.locks.lock();
        if let Some(lock) = locks.get(&dialog).and_then(Weak::upgrade) {
            return lock;
        }
        locks.retain(|_, l| l.strong_count() > 0);
        let lock = Arc::new(AsyncMutex::new(()));
        locks.insert(dialog, Arc::downgrade(&lock));
        lock
    }

    /// Waits for `dialog`'s lock.
    async fn lock(&self, dialog: SessionId) -> DialogGuard {
        DialogGuard {
            _guard: self.lock_of(dialog).lock_owned().await,
            released: self.released.clone(),
        }
    }

    /// Whether a request holds `dialog`'s lock now.
    pub(crate) fn busy(&self, dialog: SessionId) -> bool {
        let lock = self.locks.lock().get(&dialog).and_then(Weak::upgrade);
        lock.is_some_and(|l| l.try_lock().is_err())
    }

    /// `dialog`'s lock, if no request holds it.
    fn try_lock(&self, dialog: SessionId) -> Option<DialogGuard> {
        Some(DialogGuard {
            _guard: self.lock_of(dialog).try_lock_owned().ok()?,
            released: self.released.clone(),
        })
    }

    /// Finds or makes the dialog `conversation`'s input goes to (see the
    /// module docs) and locks it. Nothing is written before every check
    /// passed; a fork or a new dialog is written before this returns.
    pub(crate) async fn place(
        &self,
        shared: &Shared,
        conversation: &Conversation,
    ) -> ApiResult<Placed> {
        if let (Scope::Dialog(dialog), true) =
            (&conversation.scope, conversation.history.is_empty())
        {
            // No history to match: the input goes to the dialog named.
            let record = shared.dialog_by_id(*dialog).await?;
            check_agent(&record, conversation.agent.as_ref())?;
            return Ok(Placed {
                dialog: *dialog,
                forked_from: None,
                guard: self.lock(*dialog).await,
            });
        }
        for _ in 0..PLACE_ATTEMPTS {
            let released = self.released.load(Ordering::SeqCst);
            let (home, mut candidates) = self.candidates(shared, conversation).await?;
            let mut placement = transcript::place(&conversation.history, &candidates.read);
            if !matches!(placement, Placement::Continue { .. }) {
                // No dialog continues: where could one fork?
                for candidate in &mut candidates.read {
                    candidate.checkpoints = fork_points(shared, candidate.dialog).await?;
                }
                placement = transcript::place(&conversation.history, &candidates.read);
            }
            self.keep(&home, candidates);
            match placement {
                Placement::Continue { dialog } => {
                    // Free, and no dialog's lock released since the read:
                    // no other request's turn changed it after it was read.
                    let guard = match self.try_lock(dialog) {
                        Some(guard) if self.released.load(Ordering::SeqCst) == released => {
                            return Ok(Placed {
                                dialog,
                                forked_from: None,
                                guard,
                            });
                        }
                        Some(guard) => guard,
                        None => self.lock(dialog).await,
                    };
                    // Another request's turn may have run meanwhile: the
                    // history must still be the dialog's.
                    let now = self.read(shared, &home, dialog).await?;
                    let continues = matches!(
                        transcript::place(&conversation.history, &now.read),
                        Placement::Continue { .. }
                    );
                    self.keep(&home, now);
                    if continues {
                        return Ok(Placed {
                            dialog,
                            forked_from: None,
                            guard,
                        });
                    }
                }
                Placement::Fork {
                    dialog,
                    checkpoint,
                    tail,
                } => {
                    let fork = shared.app.manager.fork(checkpoint, None).await?;
                    return self.fill(shared, fork, Some(dialog), tail).await;
                }
                Placement::Start { history } => {
                    let manager = &shared.app.manager;
                    let made = manager
                        .create_dialog(&home.0, &home.1, None, conversation.agent.clone())
                        .await?;
                    return self.fill(shared, made, None, history).await;
                }
            }
        }
        Err(ApiError::Conflict(
            "the dialog kept changing while this request was placed; retry".to_owned(),
        ))
    }

    /// The chat new dialogs of `conversation` go to, and the dialogs its
    /// history is matched against (their visible histories), the most
    /// recently active first: the chat's dialogs and what each gained
    /// since it was last matched are read at once.
    async fn candidates(
        &self,
        shared: &Shared,
        conversation: &Conversation,
    ) -> ApiResult<(Chat, Read)> {
        let (channel, chat_id) = match &conversation.scope {
            Scope::Dialog(id) => {
                let record = shared.dialog_by_id(*id).await?;
                check_agent(&record, conversation.agent.as_ref())?;
                let home = (record.channel.clone(), record.chat_id.clone());
                let read = self.read(shared, &home, *id).await?;
                return Ok((home, read));
            }
            Scope::Chat { channel, chat_id } => ((*channel).to_owned(), chat_id.clone()),
        };
        let home = (channel, chat_id);
        if conversation.history.is_empty() {
            return Ok((home, Read::default()));
        }
        let known = self.histories.lock().heads(&home);
        let agent = conversation.agent.clone();
        let mut listed = shared
            .app
            .store
            .dialogs_with_history_after(
                DialogQuery {
                    channel: home.0.clone(),
                    chat_id: home.1.clone(),
                    include_deleted: false,
                    limit: MAX_CANDIDATES,
                    cursor: None,
                },
                Box::new(move |r| runs(r, agent.as_ref())),
                known.clone(),
                visible(),
            )
            .await?;
        listed.sort_by_key(|(r, _)| std::cmp::Reverse(r.last_active_at_ms));
        let mut read = Read::default();
        for (record, delta) in listed {
            let kept = self.histories.lock().take(&home, record.id);
            let history = match kept {
                // What was kept may have moved on meanwhile (another
                // request): the delta then does not apply; read it whole.
                Some((head, history)) if !delta.whole && known.get(&record.id) == Some(&head) => {
                    extended(history, &delta)
                }
                _ if delta.whole => extended(Vec::new(), &delta),
                _ => {
                    let mut one = self.read(shared, &home, record.id).await?;
                    read.heads.append(&mut one.heads);
                    read.read.append(&mut one.read);
                    continue;
                }
            };
            read.heads.push(delta.head);
            read.read.push(Candidate {
                dialog: record.id,
                history,
                checkpoints: Vec::new(),
            });
        }
        Ok((home, read))
    }

    /// The visible history of `dialog` (of `chat`): what was kept of it,
    /// extended by what was added since (or read whole).
    async fn read(&self, shared: &Shared, chat: &Chat, dialog: SessionId) -> ApiResult<Read> {
        let (head, history) = self.histories.lock().take(chat, dialog).unzip();
        let delta = shared
            .app
            .store
            .history_after(dialog, head, visible())
            .await?;
        let history = history.filter(|_| !delta.whole).unwrap_or_default();
        Ok(Read {
            read: vec![Candidate {
                dialog,
                history: extended(history, &delta),
                checkpoints: Vec::new(),
            }],
            heads: vec![delta.head],
        })
    }

    /// Puts what `read` read of `chat`'s dialogs back for the next request.
    fn keep(&self, chat: &Chat, read: Read) {
        let mut histories = self.histories.lock();
        for (head, candidate) in read.heads.into_iter().zip(read.read) {
            histories.put(chat, candidate.dialog, head, candidate.history);
        }
    }

    /// Imports `history` into the new dialog `dialog` and locks it.
    async fn fill(
        &self,
        shared: &Shared,
        dialog: SessionId,
        forked_from: Option<SessionId>,
        history: Vec<Said>,
    ) -> ApiResult<Placed> {
        let guard = self.lock(dialog).await;
        if !history.is_empty() {
            let messages = history
                .into_iter()
                .map(|s| match s.speaker {
                    Speaker::User => Message::user(s.text),
                    Speaker::Assistant => Message::assistant(s.text),
                })
                .collect();
            shared.app.manager.import_messages(dialog, messages).await?;
        }
        Ok(Placed {
            dialog,
            forked_from,
            guard,
        })
    }

    /// Sends `input` as a user turn of the placed dialog and returns its
    /// frames. The dialog stays locked until the turn ended, whether or
    /// not the client still reads.
    pub(crate) async fn start_turn(
        shared: &Arc<Shared>,
        placed: Placed,
        input: Message,
    ) -> ApiResult<TurnFeed> {
        let Placed {
            dialog,
            forked_from,
            guard,
        } = placed;
        // Subscribed before the turn starts, so its first frame is not missed.
        let frames = shared.hub.subscribe(dialog);
        let mut keeper = shared.hub.subscribe(dialog);
        let turn = shared
            .turns
            .send(dialog, input, crate::serve::api::IfBusy::Enqueue, None)
            .await?
            .0
            .as_uuid();
        let closing = shared.closing.clone();
        tokio::spawn(async move {
            let _held = guard;
            loop {
                tokio::select! {
                    frame = keeper.recv() => match frame {
                        Ok(f) if f.turn_id() == Some(turn) && f.ends_turn() => return,
                        Ok(_) | Err(RecvError::Lagged(_)) => {}
                        Err(RecvError::Closed) => return,
                    },
                    () = closing.cancelled() => return,
                }
            }
        });
        Ok(TurnFeed {
            dialog,
            forked_from,
            turn,
            frames,
            runs: None,
            ready: VecDeque::new(),
            done: false,
        })
    }
}

/// A dialog held for a request that resumes its paused turn: locked, and
/// its frames (continuation turns included) subscribed before any decision
/// is committed, so the turn the decisions start is not missed.
pub(crate) struct Resuming {
    /// The dialog.
    pub dialog: SessionId,
    guard: DialogGuard,
    frames: broadcast::Receiver<SharedFrame>,
    keeper: broadcast::Receiver<SharedFrame>,
    mark: ResumeMark,
}

/// While held, the dialog's next continuation is a resume's (thread
/// streams leave it out); dropped once that turn is known, or when the
/// resume gives up.
struct ResumeMark {
    shared: Arc<Shared>,
    dialog: SessionId,
    turn: Option<Uuid>,
}

impl Drop for ResumeMark {
    fn drop(&mut self) {
        self.shared
            .conversations
            .threads()
            .end_resume(self.dialog, self.turn);
    }
}

impl Conversations {
    /// Locks `dialog` for a request that will decide its pending approvals
    /// and subscribes to its frames.
    pub(crate) async fn resuming(
        &self,
        shared: &Arc<Shared>,
        dialog: SessionId,
    ) -> ApiResult<Resuming> {
        let guard = self.lock(dialog).await;
        shared.projections.watch(dialog).await?;
        let frames = shared.hub.subscribe(dialog);
        let keeper = shared.hub.subscribe(dialog);
        // The resumed turn is a continuation: it reaches the hub only
        // through the dialog's forwarder.
        shared.turns.follow_continuations(dialog).await;
        self.threads().begin_resume(dialog);
        let mark = ResumeMark {
            shared: shared.clone(),
            dialog,
            turn: None,
        };
        Ok(Resuming {
            dialog,
            guard,
            frames,
            keeper,
            mark,
        })
    }
}

impl Resuming {
    /// The frames of the continuation turn the committed decisions start
    /// (`None` when the server closes first). The dialog stays locked until
    /// that turn ended, whether or not the client still reads.
    pub(crate) async fn feed(self, shared: &Shared) -> Option<TurnFeed> {
        let Resuming {
            dialog,
            guard,
            mut frames,
            mut keeper,
            mark,
        } = self;
        let closing = shared.closing.clone();
        let mut mark = Some(mark);
        tokio::spawn(async move {
            let _held = guard;
            let mut turn = None;
            loop {
                tokio::select! {
                    frame = keeper.recv() => match frame {
                        Ok(f) => match (f.as_ref(), turn) {
                            (ServerFrame::TurnStarted { turn_id, turn_origin: api::TurnOrigin::AgentContinuation, .. }, None) => {
                                turn = Some(*turn_id);
                                // Thread streams leave this turn out from now on.
                                if let Some(mut known) = mark.take() {
                                    known.turn = turn;
                                }
                            }
                            (f, Some(t)) if f.turn_id() == Some(t) && f.ends_turn() => return,
                            _ => {}
                        },
                        Err(RecvError::Lagged(_)) => {}
                        Err(RecvError::Closed) => return,
                    },
                    () = closing.cancelled() => return,
                }
            }
        });
        loop {
            let frame = tokio::select! {
                () = shared.closing.cancelled() => return None,
                frame = frames.recv() => frame,
            };
            match frame {
                Ok(f) => {
                    if let ServerFrame::TurnStarted {
                        turn_id,
                        turn_origin: api::TurnOrigin::AgentContinuation,
                        ..
                    } = f.as_ref()
                    {
                        let turn = *turn_id;
                        return Some(TurnFeed {
                            dialog,
                            forked_from: None,
                            turn,
                            frames,
                            runs: None,
                            ready: VecDeque::from([Fed::Frame(f)]),
                            done: false,
                        });
                    }
                }
                Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => return None,
            }
        }
    }
}

/// The approvals still pending of root turn `turn` in `dialog`: what the
/// turn paused for, read once its pause is committed (a background run of
/// its tree asks on its own: those are not the turn's).
pub(crate) async fn paused_for(
    shared: &Shared,
    dialog: SessionId,
    turn: Uuid,
) -> ApiResult<Vec<keel_store::ApprovalRecord>> {
    Ok(shared
        .app
        .manager
        .approvals(dialog, true)
        .await?
        .into_iter()
        .filter(|a| a.turn_id.as_uuid() == turn && a.run_id.is_none())
        .collect())
}

/// Whether a dialog runs `agent` (`None`: the root agent).
fn runs(record: &SessionRecord, agent: Option<&AgentId>) -> bool {
    let root = AgentId::root();
    let of_record = record.agent_id.as_ref().filter(|a| **a != root);
    of_record == agent.filter(|a| **a != root)
}

/// Refuses a dialog named by id that runs another agent than the request's.
fn check_agent(record: &SessionRecord, agent: Option<&AgentId>) -> ApiResult<()> {
    if runs(record, agent) {
        return Ok(());
    }
    Err(ApiError::BadRequest(format!(
        "dialog {} runs agent {}, not the one the request names",
        record.id,
        record.agent_id.as_ref().map_or("root", |a| a.as_str())
    )))
}

/// Dialog histories read for matching, with the head each was read at.
#[derive(Debug, Default)]
struct Read {
    heads: Vec<SessionHead>,
    read: Vec<Candidate<SessionId, CheckpointId>>,
}

/// What matching reads of a dialog: the messages clients see.
fn visible() -> MessageFilter {
    MessageFilter {
        visible_only: true,
        ..MessageFilter::default()
    }
}

/// `history` followed by what `delta` read.
fn extended(mut history: Vec<Kept>, delta: &HistoryDelta) -> Vec<Kept> {
    history.extend(delta.messages.iter().filter_map(kept));
    history
}

/// A stored message as matching sees it (`None`: not part of what a client holds).
fn kept(m: &StoredMessage) -> Option<Kept> {
    let speaker = match m.message.role {
        Role::User => Speaker::User,
        Role::Assistant => Speaker::Assistant,
        Role::System | Role::Tool => return None,
    };
    Some(Kept {
        seq: m.seq,
        speaker,
        text: m.message.text(),
        continuation: m.message.origin == TurnOrigin::AgentContinuation,
    })
}

/// The checkpoints of a dialog's current branch.
async fn fork_points(
    shared: &Shared,
    dialog: SessionId,
) -> ApiResult<Vec<ForkPoint<CheckpointId>>> {
    let ranges = shared.app.store.history_ranges(dialog).await?;
    Ok(shared
        .app
        .manager
        .list_checkpoints(dialog)
        .await?
        .into_iter()
        .filter(|c| {
            ranges
                .iter()
                .any(|(t, upto)| *t == c.timeline_id && c.seq <= *upto)
        })
        .map(|c| ForkPoint {
            checkpoint: c.id,
            seq: c.seq,
        })
        .collect())
}

/// A chat id made of a client's key (an OpenAI `user`, an AG-UI thread id).
pub(crate) fn chat_id(what: &str, key: &str) -> ApiResult<String> {
    keel_engine::DialogAddress::new("x", key, "x")
        .map(|_| key.to_owned())
        .map_err(|_| {
            ApiError::BadRequest(format!(
                "{what} must be 1 to 128 characters without ':' or control characters"
            ))
        })
}

/// Checks the size of every text a request carries: at most
/// [`MAX_MESSAGES`] messages of at most [`MAX_TEXT_CHARS`] characters.
pub(crate) fn checked_texts<'a>(texts: impl IntoIterator<Item = &'a str>) -> ApiResult<()> {
    for (i, text) in texts.into_iter().enumerate() {
        if i >= MAX_MESSAGES {
            return Err(ApiError::PayloadTooLarge(format!(
                "a conversation of more than {MAX_MESSAGES} messages is not accepted"
            )));
        }
        let chars = text.chars().count();
        if chars > MAX_TEXT_CHARS {
            return Err(ApiError::BadRequest(format!(
                "a message has {chars} characters; at most {MAX_TEXT_CHARS} are accepted"
            )));
        }
    }
    Ok(())
}
