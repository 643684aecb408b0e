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
//! matchable history with the head it was read at, and a request reads
//! only the messages added since ([`keel_store::Store::history_after`]).
//! A dialog's checkpoints are read only when no candidate continues.

pub mod agui;
pub mod openai;
pub mod transcript;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};

use keel_core::{AgentId, CheckpointId, Message, Role, SessionId, TurnOrigin};
use keel_store::{MessageFilter, SessionHead, SessionRecord, StoredMessage};
use parking_lot::Mutex;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};
use uuid::Uuid;

use super::api::MAX_TEXT_CHARS;
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
    guard: OwnedMutexGuard<()>,
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
    histories: Mutex<Histories>,
    threads: agui::Threads,
}

/// Dialog histories as last matched, each with the head it was read at.
/// An entry is taken out while a request extends it and put back after.
#[derive(Debug, Default)]
struct Histories {
    entries: HashMap<SessionId, Cached>,
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
    /// Takes `dialog`'s history out, if it is kept.
    fn take(&mut self, dialog: SessionId) -> Option<(SessionHead, Vec<Kept>)> {
        let cached = self.entries.remove(&dialog)?;
        self.bytes -= cached.bytes;
        Some((cached.head, cached.history))
    }

    /// Keeps `dialog`'s history as read at `head`, dropping the least
    /// recently kept ones past [`HISTORY_CACHE_BYTES`].
    fn put(&mut self, dialog: SessionId, head: SessionHead, history: Vec<Kept>) {
        if let Some(old) = self.entries.remove(&dialog) {
            self.bytes -= old.bytes;
        }
        let bytes = history
            .iter()
            .map(|k| k.text.len() + std::mem::size_of::<Kept>())
            .sum::<usize>();
        if bytes > HISTORY_CACHE_BYTES {
            return;
        }
        while self.bytes + bytes > HISTORY_CACHE_BYTES {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, c)| c.used)
                .map(|(d, _)| *d)
            else {
                break;
            };
            if let Some(dropped) = self.entries.remove(&oldest) {
                self.bytes -= dropped.bytes;
            }
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.insert(
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
                guard: self.lock_of(*dialog).lock_owned().await,
            });
        }
        for _ in 0..PLACE_ATTEMPTS {
            let (home, dialogs) = self.candidates(shared, conversation).await?;
            // The likeliest dialog (the most recently active) is locked
            // before it is read, when no request holds it: if the history
            // continues it, nothing changes it before this request's turn.
            let held = dialogs.first().and_then(|&dialog| {
                let guard = self.lock_of(dialog).try_lock_owned().ok()?;
                Some((dialog, guard))
            });
            let mut candidates = self.read(shared, dialogs).await?;
            let mut placement = transcript::place(&conversation.history, &candidates.read);
            if !matches!(placement, Placement::Continue { .. }) {
                // No dialog continues: where could one fork?
                for candidate in &mut candidates.read {
                    candidate.checkpoints = fork_points(shared, candidate.dialog).await?;
                }
                placement = transcript::place(&conversation.history, &candidates.read);
            }
            self.keep(candidates);
            match placement {
                Placement::Continue { dialog } => {
                    if let Some((_, guard)) = held.filter(|(locked, _)| *locked == dialog) {
                        return Ok(Placed {
                            dialog,
                            forked_from: None,
                            guard,
                        });
                    }
                    // Never wait for one dialog while holding another.
                    let guard = self.lock_of(dialog).lock_owned().await;
                    // Another request's turn may have run while this one
                    // waited: the history must still be the dialog's.
                    let now = self.read(shared, vec![dialog]).await?;
                    let continues = matches!(
                        transcript::place(&conversation.history, &now.read),
                        Placement::Continue { .. }
                    );
                    self.keep(now);
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
                    drop(held);
                    let fork = shared.app.manager.fork(checkpoint, None).await?;
                    return self.fill(shared, fork, Some(dialog), tail).await;
                }
                Placement::Start { history } => {
                    drop(held);
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
    /// history is matched against, the most recently active first.
    async fn candidates(
        &self,
        shared: &Shared,
        conversation: &Conversation,
    ) -> ApiResult<((String, String), Vec<SessionId>)> {
        match &conversation.scope {
            Scope::Dialog(id) => {
                let record = shared.dialog_by_id(*id).await?;
                check_agent(&record, conversation.agent.as_ref())?;
                let home = (record.channel.clone(), record.chat_id.clone());
                Ok((home, vec![*id]))
            }
            Scope::Chat { channel, chat_id } => {
                let home = ((*channel).to_owned(), chat_id.clone());
                if conversation.history.is_empty() {
                    return Ok((home, Vec::new()));
                }
                let page = shared
                    .app
                    .manager
                    .list_dialogs(channel, chat_id, MAX_CANDIDATES, None)
                    .await?;
                let mut records: Vec<SessionRecord> = page
                    .items
                    .into_iter()
                    .filter(|r| runs(r, conversation.agent.as_ref()))
                    .collect();
                records.sort_by_key(|r| std::cmp::Reverse(r.last_active_at_ms));
                Ok((home, records.iter().map(|r| r.id).collect()))
            }
        }
    }

    /// The visible histories of `dialogs`, in order: what was kept of each,
    /// extended by what was added since (or read whole).
    async fn read(&self, shared: &Shared, dialogs: Vec<SessionId>) -> ApiResult<Read> {
        let mut read = Read::default();
        for dialog in dialogs {
            let known = self.histories.lock().take(dialog);
            let (head, history) = known.unzip();
            let delta = shared
                .app
                .store
                .history_after(
                    dialog,
                    head,
                    MessageFilter {
                        visible_only: true,
                        ..MessageFilter::default()
                    },
                )
                .await?;
            let mut history = history.filter(|_| !delta.whole).unwrap_or_default();
            history.extend(delta.messages.iter().filter_map(kept));
            read.heads.push(delta.head);
            read.read.push(Candidate {
                dialog,
                history,
                checkpoints: Vec::new(),
            });
        }
        Ok(read)
    }

    /// Puts what `read` read back for the next request.
    fn keep(&self, read: Read) {
        let mut histories = self.histories.lock();
        for (head, candidate) in read.heads.into_iter().zip(read.read) {
            histories.put(candidate.dialog, head, candidate.history);
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
        let guard = self.lock_of(dialog).lock_owned().await;
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
        input: String,
    ) -> ApiResult<TurnFeed> {
        let Placed {
            dialog,
            forked_from,
            guard,
        } = placed;
        // Subscribed before the turn starts, so its first frame is not missed.
        let frames = shared.hub.subscribe(dialog);
        let mut keeper = shared.hub.subscribe(dialog);
        let turn = shared.turns.send(dialog, input).await?.as_uuid();
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
