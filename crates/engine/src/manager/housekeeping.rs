//! What follows a committed turn, off the turn path: a generated title once
//! a dialog has enough user messages, and a summary of the current slot when
//! its context grows past the configured share of the budget.
//!
//! The turn's commit only decides whether either is due and copies what the
//! model needs; a spawned task (at most one per session) then calls the
//! model through the gate's provider permits, without the session's lock,
//! and takes the lock only to commit. `/stop`, deleting the dialog and
//! [`SessionManager::shutdown`] cancel it. Both are best effort: a failure is
//! logged and never fails a turn; a result the history moved past (a
//! rollback, a rename, another summary) is dropped.
//!
//! A summary covers the slot's messages up to a point (`summary_upto`);
//! the newest messages stay as they are. With nothing new before the point
//! to summarize, none is made.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use keel_core::{
    AgentId, ChatRequest, Message, Provider, Role, SessionId, ToolExecutionContext, TurnOrigin,
};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{default_title, generated_title, SessionManager};
use crate::context::{input_budget, messages_tokens, tools_tokens};
use crate::error::{EngineError, Result};
use crate::session::AgentSession;

/// Share of the context budget the newest messages may keep, unsummarized.
const KEEP_RATIO: f32 = 0.25;
/// Most summaries one fit makes (each covers what one request can hold).
const MAX_FIT_ROUNDS: usize = 16;

/// Tokens of the newest messages a compaction leaves as they are.
fn keep_tokens(budget: usize) -> usize {
    (KEEP_RATIO * budget as f32) as usize
}

/// Estimated tokens of a request of the session's current slot without new
/// input: system prompt, tool definitions and the replayed history.
fn context_tokens(session: &AgentSession) -> Result<usize> {
    let replay = session.replay(&session.state.current_slot)?;
    let agent = &session.agent;
    Ok(
        Message::system(agent.system_prompt.clone()).estimated_tokens()
            + tools_tokens(&agent.tools.definitions())
            + messages_tokens(&replay),
    )
}

/// The housekeeping tasks of a manager: one per session at most.
#[derive(Default)]
pub(super) struct Housekeeping {
    /// Cancelled at shutdown; every task's token is a child of it.
    root: CancellationToken,
    running: Mutex<HashMap<SessionId, Task>>,
    next_key: AtomicU64,
}

/// A running housekeeping task.
struct Task {
    key: u64,
    cancel: CancellationToken,
    done: watch::Receiver<bool>,
}

impl Housekeeping {
    /// Registers a task for `session` unless one runs or the manager shut down.
    fn begin(&self, session: SessionId) -> Option<(u64, CancellationToken, watch::Sender<bool>)> {
        if self.root.is_cancelled() {
            return None;
        }
        let mut running = self.running.lock();
        if running.contains_key(&session) {
            return None;
        }
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let cancel = self.root.child_token();
        let (done_tx, done) = watch::channel(false);
        running.insert(
            session,
            Task {
                key,
                cancel: cancel.clone(),
                done,
            },
        );
        Some((key, cancel, done_tx))
    }

    fn end(&self, session: SessionId, key: u64) {
        let mut running = self.running.lock();
        if running.get(&session).is_some_and(|t| t.key == key) {
            running.remove(&session);
        }
    }

    /// Cancels `session`'s task, if one runs.
    pub(super) fn cancel(&self, session: SessionId) {
        if let Some(task) = self.running.lock().get(&session) {
            task.cancel.cancel();
        }
    }
}

/// A title to generate.
struct TitleJob {
    prompt: String,
}

/// A part of a slot's history to summarize.
struct SummaryJob {
    slot: String,
    /// The head timeline the seqs belong to.
    timeline: String,
    /// The compaction point the job starts from (the slot's `summary_upto`).
    base: Option<i64>,
    /// The summary so far, folded into the new one.
    previous: Option<String>,
    /// The messages after `base` up to `upto`.
    messages: Vec<Arc<Message>>,
    /// The new compaction point.
    upto: i64,
    /// Longest text of one message in the request (longer ones are cut).
    max_message_bytes: usize,
    /// The summary's output cap.
    max_tokens: u32,
}

/// What a housekeeping task calls the model with.
struct Model {
    agent: AgentId,
    provider: Arc<dyn Provider>,
}

impl Model {
    fn of(session: &AgentSession) -> Self {
        Self {
            agent: session.agent.name.clone(),
            provider: Arc::clone(&session.agent.provider),
        }
    }
}

impl SessionManager {
    /// Called under the session's lock right after a turn committed: spawns
    /// a task when a title or a summary is due (never waits for it).
    pub(super) fn after_commit(self: &Arc<Self>, session: &AgentSession) {
        let title = self.title_job(session);
        let summary = self.auto_summary_job(session);
        if title.is_none() && summary.is_none() {
            return;
        }
        let id = session.id();
        let Some((key, cancel, done)) = self.housekeeping.begin(id) else {
            return;
        };
        let model = Model::of(session);
        let manager = Arc::clone(self);
        tokio::spawn(async move {
            if let Some(job) = title {
                manager.title(id, &model, job, &cancel).await;
            }
            if let Some(job) = summary {
                if let Err(e) = manager.summarize(id, &model, job, &cancel).await {
                    tracing::warn!(session_id = %id, error = %e, "summary failed; the turns are unaffected");
                }
            }
            manager.housekeeping.end(id, key);
            done.send_replace(true);
        });
    }

    /// Waits until `session` has no housekeeping task running (its title
    /// and summary after the last turn are committed, dropped or cancelled).
    /// Returns whether one was running.
    pub async fn housekeeping_settled(&self, session: SessionId) -> bool {
        let done = self
            .housekeeping
            .running
            .lock()
            .get(&session)
            .map(|t| t.done.clone());
        match done {
            Some(mut done) => {
                let _ = done.wait_for(|d| *d).await;
                true
            }
            None => false,
        }
    }

    /// Cancels every housekeeping task and starts no more (the process is
    /// shutting down).
    pub fn shutdown(&self) {
        self.housekeeping.root.cancel();
    }

    fn title_job(&self, session: &AgentSession) -> Option<TitleJob> {
        let n = self.config.auto_title_after;
        let record = &session.record;
        if n == 0 || record.message_count < n || record.title != default_title(&record.dialog_id) {
            return None;
        }
        Some(TitleJob {
            prompt: title_prompt(session).ok()?,
        })
    }

    /// A summary when the current slot's context is over the configured
    /// share of the agent's budget and the debounce allows.
    fn auto_summary_job(&self, session: &AgentSession) -> Option<SummaryJob> {
        let config = self.config.summary.as_ref()?;
        let budget = input_budget(&session.agent);
        let tokens = context_tokens(session).ok()?;
        let due = session
            .state
            .last_summary_turn
            .is_none_or(|t| session.state.turn_index.saturating_sub(t) >= config.debounce_turns);
        let over = tokens as f32 > config.trigger_ratio * budget as f32;
        if !(over && due) {
            return None;
        }
        summary_job(session, keep_tokens(budget), budget, None)
    }

    /// Summarizes older history of the current slot until a request of the
    /// session (with `extra` tokens of input not in the history yet) fits
    /// the agent's budget — or once at least, the newest messages included,
    /// when `force`. Messages from seq `exclude_from` on (the running turn's
    /// input) are never summarized. Failures are logged: the request is
    /// sent anyway and the provider decides.
    pub(super) async fn fit_context(
        &self,
        session: &mut AgentSession,
        extra: usize,
        exclude_from: Option<i64>,
        force: bool,
        cancel: &CancellationToken,
    ) {
        let budget = input_budget(&session.agent);
        let mut keep = if force { 0 } else { keep_tokens(budget) };
        let mut forced = force;
        for _ in 0..MAX_FIT_ROUNDS {
            let Ok(tokens) = context_tokens(session) else {
                return;
            };
            if tokens + extra <= budget && !forced {
                return;
            }
            let Some(job) = summary_job(session, keep, budget, exclude_from) else {
                if keep == 0 {
                    return; // nothing left to summarize: only the input
                }
                keep = 0;
                continue;
            };
            forced = false;
            let id = session.id();
            let model = Model::of(session);
            let started = std::time::Instant::now();
            let result = match self
                .call_model(id, &model, &summary_request(&job), cancel)
                .await
            {
                Ok(text) => match text.trim() {
                    "" => Err(EngineError::EmptySummary),
                    summary => self.commit_summary(session, job, summary.to_owned()).await,
                },
                Err(e) => Err(e),
            };
            tracing::debug!(session_id = %id, elapsed_ms = started.elapsed().as_millis() as u64, "context compacted before the model call");
            match result {
                Ok(_) => {}
                Err(e) if e.is_cancelled() => return,
                Err(e) => {
                    tracing::warn!(session_id = %id, error = %e, "compacting the context failed; sending it as it is");
                    return;
                }
            }
        }
    }

    async fn title(&self, id: SessionId, model: &Model, job: TitleJob, cancel: &CancellationToken) {
        let request = ChatRequest {
            messages: vec![Arc::new(Message::user(job.prompt))],
            tools: Vec::new(),
            max_tokens: Some(64),
            temperature: None,
        };
        let title = match self.call_model(id, model, &request, cancel).await {
            Ok(text) => match generated_title(&first_line(&text)) {
                Ok(title) => title,
                Err(e) => {
                    tracing::warn!(session_id = %id, error = %e, "the generated title is unusable; will retry after the next turn");
                    return;
                }
            },
            Err(e) if e.is_cancelled() => return,
            Err(e) => {
                tracing::warn!(session_id = %id, error = %e, "title generation failed; will retry after the next turn");
                return;
            }
        };
        let result = self.commit_title(id, &title, cancel).await;
        if matches!(result, Ok(true)) {
            self.events.publish(
                id,
                crate::events::SessionEvent::Retitled {
                    title: title.clone(),
                },
            );
        }
        match result {
            Ok(true) => tracing::info!(session_id = %id, %title, "dialog titled"),
            Ok(false) => {}
            Err(e) if e.is_cancelled() => {}
            Err(e) => {
                tracing::warn!(session_id = %id, error = %e, "saving the generated title failed")
            }
        }
    }

    /// Sets the generated `title` unless the dialog was renamed meanwhile.
    /// Returns whether it was set.
    async fn commit_title(
        &self,
        id: SessionId,
        title: &str,
        cancel: &CancellationToken,
    ) -> Result<bool> {
        self.leased(id, async {
            let mut guard = self.locked_fresh(id, cancel).await?;
            let record = &guard.record;
            if record.title != default_title(&record.dialog_id) {
                return Ok(false); // renamed meanwhile: the user's title stays
            }
            self.store
                .rename_session(id, title.to_owned(), keel_core::time::now_ms())
                .await?;
            guard.record.title = title.to_owned();
            Ok(true)
        })
        .await
    }

    /// Session `id` locked (unless `cancel` fires first) and reloaded if
    /// another process wrote it since this one last held its lease.
    async fn locked_fresh(
        &self,
        id: SessionId,
        cancel: &CancellationToken,
    ) -> Result<tokio::sync::OwnedMutexGuard<AgentSession>> {
        let session = self.session(id).await?;
        let mut guard = tokio::select! {
            guard = session.lock_owned() => guard,
            () = cancel.cancelled() => return Err(EngineError::Cancelled),
        };
        self.fresh(&mut guard).await?;
        Ok(guard)
    }

    /// Summarizes `job` and commits it as the slot's summary, unless the
    /// history moved past it meanwhile. Returns whether it was committed.
    async fn summarize(
        &self,
        id: SessionId,
        model: &Model,
        job: SummaryJob,
        cancel: &CancellationToken,
    ) -> Result<bool> {
        let request = summary_request(&job);
        let summary = self.call_model(id, model, &request, cancel).await?;
        let summary = summary.trim().to_owned();
        if summary.is_empty() {
            return Err(EngineError::EmptySummary);
        }
        self.leased(id, async {
            let mut guard = self.locked_fresh(id, cancel).await?;
            self.commit_summary(&mut guard, job, summary).await
        })
        .await
    }

    /// Commits `summary` for `job` on the session's current state.
    async fn commit_summary(
        &self,
        session: &mut AgentSession,
        job: SummaryJob,
        summary: String,
    ) -> Result<bool> {
        let unchanged = session.record.head_timeline_id.as_str() == job.timeline
            && session
                .state
                .slots
                .get(&job.slot)
                .is_some_and(|c| c.summary_upto == job.base);
        if !unchanged {
            tracing::info!(session_id = %session.id(), slot = %job.slot, "the history moved past the summary; dropped");
            return Ok(false);
        }
        let mut state = session.state.clone();
        state.last_summary_turn = Some(state.turn_index);
        if let Some(config) = state.slots.get_mut(&job.slot) {
            config.summary = Some(summary);
            config.summary_upto = Some(job.upto);
        }
        session
            .commit(&self.store, Vec::new(), state, None, &[])
            .await?;
        Ok(true)
    }

    /// Calls the session's model for housekeeping: through the gate's
    /// provider permits, cancellably. Returns the answer's text.
    async fn call_model(
        &self,
        id: SessionId,
        model: &Model,
        request: &ChatRequest,
        cancel: &CancellationToken,
    ) -> Result<String> {
        let mut extensions = keel_core::Extensions::default();
        extensions.insert(crate::gate::StepScope {
            session: Some(id),
            agent: Some(model.agent.clone()),
        });
        let context = ToolExecutionContext {
            session_id: Some(id),
            turn_id: None,
            run_id: None,
            origin: TurnOrigin::User,
            cancellation: cancel.clone(),
            extensions,
        };
        let _permit = self
            .bundle
            .agent_loop
            .gate()
            .provider_step(&context)
            .await?;
        let response = tokio::select! {
            response = model.provider.complete(request, cancel.clone()) => response?,
            () = cancel.cancelled() => return Err(EngineError::Cancelled),
        };
        Ok(response.message.text())
    }

    /// Summarizes the current slot now (`/compact`), the newest messages
    /// included. Returns whether a summary was committed (false: nothing
    /// new to summarize).
    pub async fn compact(&self, id: SessionId) -> Result<bool> {
        self.leased(id, self.compact_leased(id)).await
    }

    /// [`Self::compact`] under the session's lease.
    async fn compact_leased(&self, id: SessionId) -> Result<bool> {
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        self.fresh(&mut guard).await?;
        let budget = input_budget(&guard.agent);
        let Some(job) = summary_job(&guard, 0, budget, None) else {
            return Ok(false);
        };
        let model = Model::of(&guard);
        let summary = self
            .call_model(
                id,
                &model,
                &summary_request(&job),
                &CancellationToken::new(),
            )
            .await?;
        let summary = summary.trim().to_owned();
        if summary.is_empty() {
            return Err(EngineError::EmptySummary);
        }
        self.commit_summary(&mut guard, job, summary).await
    }
}

/// What to summarize in the session's current slot so that at most about
/// `keep_tokens` of its newest messages stay as they are (starting at a
/// user message, so no turn is cut in half), in a summary request of at
/// most `max_request` tokens (the oldest part first when all of it does not
/// fit; a later round takes the rest). Messages from seq `exclude_from` on
/// are left out. `None` when nothing new lies before the kept part.
fn summary_job(
    session: &AgentSession,
    keep_tokens: usize,
    max_request: usize,
    exclude_from: Option<i64>,
) -> Option<SummaryJob> {
    let slot = session.state.current_slot.clone();
    let config = session.state.slot(&slot).ok()?;
    let view = session.state.slot_view(&slot, &session.history).ok()?;
    let base = config.summary_upto;
    let after: Vec<_> = view
        .into_iter()
        .filter(|m| base.is_none_or(|b| m.seq > b) && exclude_from.is_none_or(|x| m.seq < x))
        .collect();
    let mut tail = after.len();
    let mut kept = 0usize;
    while tail > 0 {
        kept += after[tail - 1].message.estimated_tokens();
        if kept > keep_tokens {
            break;
        }
        tail -= 1;
    }
    // The kept part starts at a user message (or is empty).
    while tail < after.len() && after[tail].message.role != Role::User {
        tail += 1;
    }
    let previous = config.summary.clone().filter(|_| base.is_some());
    // What the request holds besides the messages; the answer's room is
    // not part of the request.
    let fixed = (SUMMARY_PROMPT.len() + previous.as_ref().map_or(0, String::len) + 128).div_ceil(4);
    let room = max_request.saturating_sub(fixed).max(16);
    let max_message_bytes = room.saturating_sub(8) * 4;
    let mut used = 0usize;
    let mut end = 0;
    while end < tail {
        let tokens = after[end].message.estimated_tokens().min(room);
        if end > 0 && used + tokens > room {
            break;
        }
        used += tokens;
        end += 1;
    }
    let summarized = &after[..end];
    let upto = summarized.last()?.seq;
    Some(SummaryJob {
        slot,
        timeline: session.record.head_timeline_id.to_string(),
        base,
        previous,
        messages: summarized.iter().map(|m| Arc::clone(&m.message)).collect(),
        upto,
        max_message_bytes,
        max_tokens: (max_request / 4).clamp(64, 1024) as u32,
    })
}

/// The prompt that asks the session's model for a dialog title.
const TITLE_PROMPT: &str = "Given the conversation history below, generate a short title \
(3 to 8 words) that captures the core topic or the user's main need. \
Reply with the title only, no explanation.\n\nHistory:\n";

fn title_prompt(session: &AgentSession) -> Result<String> {
    let visible: Vec<String> = session
        .visible_messages()?
        .iter()
        .filter(|m| matches!(m.message.role, Role::User | Role::Assistant))
        .map(|m| format!("{}: {}", m.message.role.as_str(), m.message.text()))
        .collect();
    let mut history = visible.join("\n");
    if history.len() > 8_000 {
        let cut = (history.len() - 8_000..history.len())
            .find(|i| history.is_char_boundary(*i))
            .unwrap_or(0);
        history = history[cut..].to_owned();
    }
    Ok(format!("{TITLE_PROMPT}{history}"))
}

/// The first non-empty line of a model's title answer, without quotes or
/// Markdown emphasis.
fn first_line(raw: &str) -> String {
    raw.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .trim()
        .trim_matches(|c| c == '"' || c == '\'' || c == '“' || c == '”' || c == '#' || c == '*')
        .trim()
        .to_owned()
}

const SUMMARY_PROMPT: &str = "Summarize the conversation below so that it can replace the \
older messages in the context: keep decisions, facts, open questions and the user's goals. \
Be concise.\n\n";

fn summary_request(job: &SummaryJob) -> ChatRequest {
    let mut text = String::from(SUMMARY_PROMPT);
    if let Some(previous) = &job.previous {
        text.push_str("Summary of the conversation before:\n");
        text.push_str(previous);
        text.push_str("\n\nWhat followed:\n");
    }
    for m in &job.messages {
        let body = m.text();
        let mut cut = body.len().min(job.max_message_bytes);
        while !body.is_char_boundary(cut) {
            cut -= 1;
        }
        text.push_str(m.role.as_str());
        text.push_str(": ");
        text.push_str(&body[..cut]);
        text.push('\n');
    }
    ChatRequest {
        messages: vec![Arc::new(Message::user(text))],
        tools: Vec::new(),
        max_tokens: Some(job.max_tokens),
        temperature: None,
    }
}
