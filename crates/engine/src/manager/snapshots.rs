//! Snapshots: a whole session exported as portable data and imported as a
//! new session; and messages a client brings imported into a session.

use keel_core::{AgentId, ClientVisibility, Message, Role, SessionId};
use keel_store::CheckpointSource;

use super::{NewSessionSpec, SessionManager};
use crate::address::DialogAddress;
use crate::error::{EngineError, Result};
use crate::snapshot::SessionSnapshot;

impl SessionManager {
    /// The whole session as portable JSON-able data.
    pub async fn export_snapshot(&self, id: SessionId) -> Result<SessionSnapshot> {
        let session = self.session(id).await?;
        let guard = session.lock().await;
        Ok(SessionSnapshot::of(&guard))
    }

    /// Creates a new session from a snapshot (fresh history, same content).
    pub async fn import_snapshot(
        &self,
        snapshot: SessionSnapshot,
        address: DialogAddress,
    ) -> Result<SessionId> {
        let agent = snapshot
            .agent
            .as_deref()
            .map(AgentId::parse)
            .transpose()
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        let id = self
            .create(NewSessionSpec {
                address,
                title: snapshot.title.clone(),
                agent,
            })
            .await?;
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        let keep = guard.state.clone();
        let (seqs, _) = guard
            .commit(&self.store, snapshot.ordered_messages(), keep, None, &[])
            .await?;
        let state = snapshot.remapped_state(&seqs)?;
        guard
            .commit(&self.store, Vec::new(), state, None, &[])
            .await?;
        Ok(id)
    }
}

impl SessionManager {
    /// Appends history a client brings — text keel did not produce, such as
    /// an edited answer or a conversation begun elsewhere — to the session's
    /// current slot in one commit with a checkpoint after it; no model is
    /// called and the turn index does not move. Only visible user and
    /// assistant text is accepted: tool calls and results belong to turns
    /// keel ran. On error nothing is written.
    pub async fn import_messages(&self, id: SessionId, messages: Vec<Message>) -> Result<()> {
        if messages.is_empty() {
            return Err(EngineError::InvalidInput(
                "there are no messages to import".to_owned(),
            ));
        }
        if let Some(bad) = messages.iter().find(|m| {
            !matches!(m.role, Role::User | Role::Assistant)
                || !m.tool_calls.is_empty()
                || m.tool_call_id.is_some()
                || m.visibility != ClientVisibility::Visible
        }) {
            return Err(EngineError::InvalidInput(format!(
                "only visible user and assistant text can be imported, not a {} message{}",
                bad.role.as_str(),
                if bad.tool_calls.is_empty() {
                    ""
                } else {
                    " with tool calls"
                }
            )));
        }
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        let slot = guard.writable_slot()?;
        let state = guard.state.clone();
        let messages = messages.into_iter().map(|m| (slot.clone(), m)).collect();
        guard
            .commit(
                &self.store,
                messages,
                state,
                Some(CheckpointSource::Manual),
                &[],
            )
            .await?;
        Ok(())
    }
}
