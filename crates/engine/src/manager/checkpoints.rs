//! Checkpoints: list, create, roll back to, fork from, delete and prune.

use keel_core::{CheckpointId, SessionId};
use keel_store::{CheckpointRecord, NewSession, PrunePolicy, PruneReport};

use super::{bounded_title, clean_title, new_dialog_id, SessionManager};
use crate::error::{EngineError, Result};
use crate::session::AgentSession;

impl SessionManager {
    /// Checkpoints of a session, newest first (abandoned branches included).
    pub async fn list_checkpoints(&self, id: SessionId) -> Result<Vec<CheckpointRecord>> {
        Ok(self.store.list_checkpoints(id).await?)
    }

    /// The newest checkpoint of a session.
    pub async fn latest_checkpoint(&self, id: SessionId) -> Result<Option<CheckpointRecord>> {
        Ok(self.list_checkpoints(id).await?.into_iter().next())
    }

    /// Takes a manual checkpoint of the session's current state.
    pub async fn create_checkpoint(&self, id: SessionId) -> Result<CheckpointRecord> {
        let session = self.session(id).await?;
        let guard = session.lock().await;
        Ok(self
            .store
            .create_checkpoint(
                id,
                keel_store::NewCheckpoint {
                    id: CheckpointId::new(),
                    turn_index: u64::from(guard.state.turn_index),
                    source: keel_store::CheckpointSource::Manual,
                },
                guard.state.to_blob()?,
                keel_core::time::now_ms(),
            )
            .await?)
    }

    async fn checkpoint_of(
        &self,
        id: SessionId,
        checkpoint: CheckpointId,
    ) -> Result<CheckpointRecord> {
        self.store
            .get_checkpoint(checkpoint)
            .await?
            .filter(|c| c.session_id == id)
            .ok_or(EngineError::CheckpointNotFound(checkpoint))
    }

    /// Restores the session to `checkpoint` (of this session): a new branch
    /// starts there; the abandoned branch stays listable.
    pub async fn rollback(
        &self,
        id: SessionId,
        checkpoint: CheckpointId,
    ) -> Result<CheckpointRecord> {
        self.leased(id, self.rollback_leased(id, checkpoint)).await
    }

    /// [`Self::rollback`] under the session's lease.
    async fn rollback_leased(
        &self,
        id: SessionId,
        checkpoint: CheckpointId,
    ) -> Result<CheckpointRecord> {
        self.checkpoint_of(id, checkpoint).await?;
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        let record = self
            .store
            .rollback(
                id,
                checkpoint,
                CheckpointId::new(),
                keel_core::time::now_ms(),
            )
            .await?;
        let stored = self
            .store
            .get_session(id)
            .await?
            .ok_or(EngineError::SessionNotFound(id))?;
        *guard = AgentSession::load(&self.store, stored, guard.agent.clone()).await?;
        tracing::info!(session_id = %id, %checkpoint, "rolled back");
        Ok(record)
    }

    /// Creates a new session from any checkpoint of any session (no history
    /// is copied). Dialogs fork into a new dialog of the same chat.
    pub async fn fork(&self, checkpoint: CheckpointId, title: Option<String>) -> Result<SessionId> {
        let source = self
            .store
            .get_checkpoint(checkpoint)
            .await?
            .ok_or(EngineError::CheckpointNotFound(checkpoint))?;
        let origin = self
            .store
            .get_session(source.session_id)
            .await?
            .ok_or(EngineError::SessionNotFound(source.session_id))?;
        let title = match title {
            Some(t) => clean_title(&t)?,
            None => bounded_title(&format!("Fork of {}", origin.title)),
        };
        let (record, _) = self
            .store
            .fork(
                checkpoint,
                NewSession {
                    id: SessionId::new(),
                    channel: origin.channel.clone(),
                    chat_id: origin.chat_id.clone(),
                    dialog_id: new_dialog_id(),
                    title,
                    agent_id: origin.agent_id.clone(),
                    parent_id: origin.parent_id,
                    delivery_context: None,
                    now_ms: keel_core::time::now_ms(),
                },
                CheckpointId::new(),
            )
            .await?;
        Ok(record.id)
    }

    /// Deletes every checkpoint of a session.
    pub async fn delete_checkpoints(&self, id: SessionId) -> Result<PruneReport> {
        Ok(self.store.delete_checkpoints(id).await?)
    }

    /// Prunes checkpoints by `policy` (never what the live head needs).
    pub async fn prune_checkpoints(
        &self,
        id: SessionId,
        policy: PrunePolicy,
    ) -> Result<PruneReport> {
        Ok(self.store.prune_checkpoints(id, policy).await?)
    }
}
