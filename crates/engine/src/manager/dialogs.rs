//! Dialogs: sessions addressed by channel, chat and dialog id, listed,
//! renamed and soft-deleted.

use keel_core::{AgentId, CostTracker, SessionId};
use keel_store::{DialogCursor, DialogQuery, Page, SessionRecord};

use super::{clean_title, new_dialog_id, NewSessionSpec, SessionManager};
use crate::address::DialogAddress;
use crate::error::{EngineError, Result};
use crate::state::SessionState;

impl SessionManager {
    /// The session of a dialog, created (with the default title) if new.
    pub async fn open_dialog(
        &self,
        address: &DialogAddress,
        agent: Option<AgentId>,
    ) -> Result<SessionId> {
        let existing = self
            .store
            .get_dialog(address.channel(), address.chat_id(), address.dialog_id())
            .await?;
        match existing {
            Some(r) if r.deleted_at_ms.is_none() => Ok(r.id),
            Some(_) => Err(EngineError::InvalidInput(format!(
                "dialog {address} was deleted"
            ))),
            None => {
                self.create(NewSessionSpec {
                    address: address.clone(),
                    title: None,
                    agent,
                })
                .await
            }
        }
    }

    /// Creates a new dialog in a chat with a fresh dialog id.
    pub async fn create_dialog(
        &self,
        channel: &str,
        chat_id: &str,
        title: Option<String>,
        agent: Option<AgentId>,
    ) -> Result<SessionId> {
        let address = DialogAddress::new(channel, chat_id, &new_dialog_id())?;
        self.create(NewSessionSpec {
            address,
            title,
            agent,
        })
        .await
    }

    /// Dialogs of a chat, most recently created first, with cursor pagination.
    pub async fn list_dialogs(
        &self,
        channel: &str,
        chat_id: &str,
        limit: usize,
        cursor: Option<DialogCursor>,
    ) -> Result<Page<SessionRecord, DialogCursor>> {
        Ok(self
            .store
            .list_dialogs(DialogQuery {
                channel: channel.to_owned(),
                chat_id: chat_id.to_owned(),
                include_deleted: false,
                limit,
                cursor,
            })
            .await?)
    }

    /// The chat's most recently active dialog.
    pub async fn latest_dialog(
        &self,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<SessionRecord>> {
        Ok(self.store.latest_active_dialog(channel, chat_id).await?)
    }

    /// The stored record of a session.
    pub async fn record(&self, id: SessionId) -> Result<SessionRecord> {
        let session = self.session(id).await?;
        let guard = session.lock().await;
        Ok(guard.record.clone())
    }

    /// Token usage of a session's committed turns, read from its stored
    /// state: a running turn is not waited for (its usage counts once it
    /// commits).
    pub async fn usage(&self, id: SessionId) -> Result<CostTracker> {
        let record = self
            .store
            .get_session(id)
            .await?
            .ok_or(EngineError::SessionNotFound(id))?;
        Ok(SessionState::of_record(&self.store, &record).await?.cost)
    }

    /// Renames a dialog (and turns off auto-titling for it).
    pub async fn rename_dialog(&self, id: SessionId, title: &str) -> Result<()> {
        self.leased(id, self.rename_dialog_leased(id, title)).await
    }

    /// [`Self::rename_dialog`] under the session's lease.
    async fn rename_dialog_leased(&self, id: SessionId, title: &str) -> Result<()> {
        let title = clean_title(title)?;
        let session = self.session(id).await?;
        let mut guard = session.lock().await;
        self.fresh(&mut guard).await?;
        self.store
            .rename_session(id, title.clone(), keel_core::time::now_ms())
            .await?;
        guard.record.title = title;
        Ok(())
    }

    /// Soft-deletes a dialog: it disappears from listings; its sub-agent
    /// runs are cancelled; its rows stay until retention purges it
    /// ([`RetentionPolicy::purge_deleted_after`](crate::RetentionPolicy)).
    pub async fn delete_dialog(&self, id: SessionId) -> Result<()> {
        self.retire(id, "dialog deleted").await?;
        if self
            .store
            .soft_delete_session(id, keel_core::time::now_ms())
            .await?
        {
            Ok(())
        } else {
            Err(EngineError::SessionNotFound(id))
        }
    }
}
