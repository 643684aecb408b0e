//! Context slots and session memory: every edit is validated on a copy of
//! the state and committed (with any appended messages) in one transaction.

use keel_core::{Message, SessionId};

use super::SessionManager;
use crate::error::{EngineError, Result};
use crate::session::AgentSession;
use crate::state::{MergeStrategy, SessionState, SlotMode};

impl SessionManager {
    async fn edit_state<T>(
        &self,
        id: SessionId,
        edit: impl FnOnce(&AgentSession, &mut SessionState) -> Result<(T, Vec<Message>, String)>,
    ) -> Result<T> {
        self.leased(id, async {
            let session = self.session(id).await?;
            let mut guard = session.lock().await;
            self.fresh(&mut guard).await?;
            let mut state = guard.state.clone();
            let (out, messages, slot) = edit(&guard, &mut state)?;
            let messages = messages.into_iter().map(|m| (slot.clone(), m)).collect();
            guard
                .commit(&self.store, messages, state, None, &[])
                .await?;
            Ok(out)
        })
        .await
    }

    /// Creates an empty slot.
    pub async fn create_slot(&self, id: SessionId, name: &str, mode: SlotMode) -> Result<()> {
        self.edit_state(id, |s, st| {
            st.create_slot(name, mode, s.last_seq + 1)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Makes `name` the slot new turns use.
    pub async fn switch_slot(&self, id: SessionId, name: &str) -> Result<()> {
        self.edit_state(id, |_, st| {
            st.switch_slot(name)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Forks slot `from` into a new slot `name`.
    pub async fn derive_slot(
        &self,
        id: SessionId,
        from: &str,
        name: &str,
        mode: SlotMode,
    ) -> Result<()> {
        self.edit_state(id, |s, st| {
            st.derive_slot(from, name, mode, s.last_seq)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Merges slot `source` of session `source_session` into `target`.
    /// Merging across sessions, into itself or into a read-only slot is refused.
    pub async fn merge_slot(
        &self,
        id: SessionId,
        source_session: SessionId,
        source: &str,
        target: &str,
        strategy: MergeStrategy,
    ) -> Result<()> {
        if source_session != id {
            return Err(EngineError::SlotRule(
                "slots can only be merged within one session".into(),
            ));
        }
        self.edit_state(id, |s, st| {
            let appended = st.merge_slot(source, target, strategy, &s.history, s.last_seq)?;
            Ok(((), appended, target.to_owned()))
        })
        .await
    }

    /// Deletes a slot.
    pub async fn delete_slot(&self, id: SessionId, name: &str) -> Result<()> {
        self.edit_state(id, |_, st| {
            st.delete_slot(name)?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }

    /// Sets a session memory entry.
    pub async fn set_memory(
        &self,
        id: SessionId,
        key: &str,
        value: String,
        metadata: serde_json::Value,
    ) -> Result<()> {
        self.edit_state(id, |_, st| {
            st.set_memory(key, value, metadata, keel_core::time::now_ms())?;
            Ok(((), Vec::new(), st.current_slot.clone()))
        })
        .await
    }
}
