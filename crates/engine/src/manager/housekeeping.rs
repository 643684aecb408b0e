//! What follows a committed turn: a generated title once a dialog has
//! enough user messages, and a summary of the current slot when its context
//! grows past the configured share of the budget. Both are best effort:
//! their failures are logged and never fail the turn.

use std::sync::Arc;

use keel_core::{ChatRequest, Message, SessionId};
use tokio_util::sync::CancellationToken;

use super::{clean_title, default_title, SessionManager};
use crate::error::{EngineError, Result};
use crate::session::AgentSession;

impl SessionManager {
    pub(super) async fn after_commit(&self, session: &mut AgentSession) {
        self.maybe_title(session).await;
        self.maybe_summarize(session, false).await;
    }

    async fn maybe_title(&self, session: &mut AgentSession) {
        let n = self.config.auto_title_after;
        let record = &session.record;
        if n == 0 || record.message_count < n || record.title != default_title(&record.dialog_id) {
            return;
        }
        match generate_title(session).await {
            Ok(title) => {
                let now = keel_core::time::now_ms();
                match self
                    .store
                    .rename_session(session.id(), title.clone(), now)
                    .await
                {
                    Ok(()) => {
                        tracing::info!(session_id = %session.id(), %title, "dialog titled");
                        session.record.title = title;
                    }
                    Err(e) => {
                        tracing::warn!(session_id = %session.id(), error = %e, "saving the generated title failed")
                    }
                }
            }
            Err(e) => {
                tracing::warn!(session_id = %session.id(), error = %e, "title generation failed; will retry after the next turn")
            }
        }
    }

    /// Summarizes the current slot when its context is over the configured
    /// ratio (or always when `force`). Failures are logged, never returned.
    async fn maybe_summarize(&self, session: &mut AgentSession, force: bool) -> bool {
        let config = self.config.summary.clone().unwrap_or_default();
        if self.config.summary.is_none() && !force {
            return false;
        }
        let slot = session.state.current_slot.clone();
        let Ok(replay) = session.replay(&slot) else {
            return false;
        };
        let tokens: usize = replay.iter().map(|m| m.estimated_tokens()).sum();
        let due = session
            .state
            .last_summary_turn
            .is_none_or(|t| session.state.turn_index.saturating_sub(t) >= config.debounce_turns);
        let over = tokens as f32 > config.trigger_ratio * config.max_context_tokens as f32;
        if !(force || over && due) {
            return false;
        }
        match summarize(session, &replay).await {
            Ok(summary) => {
                let mut state = session.state.clone();
                state.last_summary_turn = Some(state.turn_index);
                if let Some(config) = state.slots.get_mut(&slot) {
                    config.summary = Some(summary);
                }
                match session
                    .commit(&self.store, Vec::new(), state, None, &[])
                    .await
                {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(session_id = %session.id(), error = %e, "saving the summary failed");
                        false
                    }
                }
            }
            Err(e) => {
                tracing::warn!(session_id = %session.id(), error = %e, "summary failed; the turn is unaffected");
                false
            }
        }
    }

    /// Summarizes the current slot now (`/compact`); a failure is reported.
    pub async fn compact(&self, id: SessionId) -> Result<bool> {
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        Ok(self.maybe_summarize(&mut guard, true).await)
    }
}

/// The prompt that asks the session's model for a dialog title.
const TITLE_PROMPT: &str = "Given the conversation history below, generate a short title \
(3 to 8 words) that captures the core topic or the user's main need. \
Reply with the title only, no explanation.\n\nHistory:\n";

async fn generate_title(session: &AgentSession) -> Result<String> {
    let visible: Vec<String> = session
        .visible_messages()?
        .iter()
        .filter(|m| {
            matches!(
                m.message.role,
                keel_core::Role::User | keel_core::Role::Assistant
            )
        })
        .map(|m| format!("{}: {}", m.message.role.as_str(), m.message.text()))
        .collect();
    let mut history = visible.join("\n");
    if history.len() > 8_000 {
        let cut = (history.len() - 8_000..history.len())
            .find(|i| history.is_char_boundary(*i))
            .unwrap_or(0);
        history = history[cut..].to_owned();
    }
    let request = ChatRequest {
        messages: vec![Arc::new(Message::user(format!("{TITLE_PROMPT}{history}")))],
        tools: Vec::new(),
        max_tokens: Some(64),
        temperature: None,
    };
    let response = session
        .agent
        .provider
        .complete(&request, CancellationToken::new())
        .await?;
    let raw = response.message.text();
    let title = raw
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .trim()
        .trim_matches(|c| c == '"' || c == '\'' || c == '“' || c == '”' || c == '#' || c == '*')
        .trim();
    clean_title(title)
}

const SUMMARY_PROMPT: &str = "Summarize the conversation below so that it can replace the \
older messages in the context: keep decisions, facts, open questions and the user's goals. \
Be concise.\n\n";

async fn summarize(session: &AgentSession, replay: &[Arc<Message>]) -> Result<String> {
    let text: Vec<String> = replay
        .iter()
        .map(|m| format!("{}: {}", m.role.as_str(), m.text()))
        .collect();
    let request = ChatRequest {
        messages: vec![Arc::new(Message::user(format!(
            "{SUMMARY_PROMPT}{}",
            text.join("\n")
        )))],
        tools: Vec::new(),
        max_tokens: Some(1024),
        temperature: None,
    };
    let response = session
        .agent
        .provider
        .complete(&request, CancellationToken::new())
        .await?;
    let summary = response.message.text().trim().to_owned();
    if summary.is_empty() {
        return Err(EngineError::EmptySummary);
    }
    Ok(summary)
}
