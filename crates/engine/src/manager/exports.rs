//! Dialogs as portable data: one exported as a [`DialogExport`] and
//! imported as a new dialog; and messages a client brings imported into a
//! dialog.

use keel_core::{AgentId, ClientVisibility, Message, Role, SessionId};
use keel_store::{CheckpointSource, NewCheckpoint, NewMessage, NewSession, TurnCommit};

use super::{clean_title, new_dialog_id, SessionManager};
use crate::address::DialogAddress;
use crate::error::{EngineError, Result};
use crate::export::{DialogExport, ExportedImage};
use base64::Engine as _;

impl SessionManager {
    /// The dialog's current history, hidden messages included, its state
    /// and its sub-agent runs.
    pub async fn export_dialog(&self, id: SessionId) -> Result<DialogExport> {
        let session = self.session(id).await?;
        let guard = session.lock().await;
        let runs = self.store.session_runs(id).await?;
        let tree = self.store.dialog_tree(id).await?;
        let mut export = DialogExport::of(&guard, &runs, &tree)?;
        for hash in export.image_hashes() {
            let image = self.store.image(&hash).await?.ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "image {hash} of this dialog is missing from the database (keel doctor reports it)"
                ))
            })?;
            export.images.push(ExportedImage {
                sha256: image.sha256,
                media_type: image.media_type,
                data: base64::engine::general_purpose::STANDARD.encode(&image.bytes),
            });
        }
        Ok(export)
    }

    /// Stores the export's images, each checked against the hash its
    /// references name, before the dialog that refers to them is imported
    /// (as a send stores its images before the message). Refuses a file
    /// whose messages refer to an image it does not carry.
    async fn import_images(&self, export: &DialogExport) -> Result<()> {
        let carried: std::collections::HashMap<&str, &ExportedImage> = export
            .images
            .iter()
            .map(|i| (i.sha256.as_str(), i))
            .collect();
        let mut decoded = Vec::new();
        for hash in export.image_hashes() {
            let image = carried.get(hash.as_str()).ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "a message refers to image {hash}, which the file does not carry"
                ))
            })?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(&image.data)
                .map_err(|e| EngineError::InvalidInput(format!("image {hash}: {e}")))?;
            decoded.push((hash, bytes));
        }
        for (hash, bytes) in decoded {
            let stored = self.store.put_image(bytes).await?;
            if stored.sha256 != hash {
                return Err(EngineError::InvalidInput(format!(
                    "image {hash}: its bytes have another hash ({})",
                    stored.sha256
                )));
            }
        }
        Ok(())
    }

    /// Recreates an export as a new dialog of the same chat, with new ids,
    /// in one transaction: its timelines, checkpoints and runs (as ended
    /// runs), or for an older file its history with a checkpoint at its
    /// end; nothing is written when any part of it is refused.
    pub async fn import_dialog(&self, export: DialogExport) -> Result<SessionId> {
        let agent = export
            .dialog
            .agent
            .as_deref()
            .map(AgentId::parse)
            .transpose()
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        let agent = self.bundle.agent(agent.as_ref())?;
        self.import_images(&export).await?;
        let address = DialogAddress::new(
            &export.dialog.channel,
            &export.dialog.chat_id,
            &new_dialog_id(),
        )?;
        let now = keel_core::time::now_ms();
        let session = NewSession {
            id: SessionId::new(),
            channel: address.channel().to_owned(),
            chat_id: address.chat_id().to_owned(),
            dialog_id: address.dialog_id().to_owned(),
            title: clean_title(&export.dialog.title)?,
            agent_id: Some(agent.name.clone()),
            parent_id: None,
            delivery_context: None,
            now_ms: now,
        };
        let id = session.id;
        let runs = crate::export_runs::imported_runs(&export.runs, id)?;
        match export.import_tree()? {
            Some(tree) => {
                self.store.import_session_tree(session, tree, runs).await?;
            }
            None => self.import_flat(&export, session, runs).await?,
        }
        tracing::info!(session_id = %id, "dialog imported");
        Ok(id)
    }

    /// Imports a file without timelines (an older keel's): its history
    /// renumbered 1, 2, … with one checkpoint at its end.
    async fn import_flat(
        &self,
        export: &DialogExport,
        session: NewSession,
        runs: Vec<keel_store::RunRecord>,
    ) -> Result<()> {
        let state = export.remapped_state()?;
        let messages = export.ordered_messages();
        let now = session.now_ms;
        let visible = messages
            .iter()
            .filter(|(_, m)| m.is_visible_user_input())
            .count();
        let turn = TurnCommit {
            calls: None,
            session_id: session.id,
            messages: messages
                .iter()
                .map(|(slot, m)| NewMessage::in_slot(slot, m.clone()))
                .collect(),
            state: state.to_blob()?,
            checkpoint: Some(NewCheckpoint {
                id: keel_core::CheckpointId::new(),
                turn_index: u64::from(state.turn_index),
                source: CheckpointSource::Manual,
            }),
            visible_user_inputs: u32::try_from(visible).unwrap_or(u32::MAX),
            answers: Vec::new(),
            expected_head: None,
            now_ms: now,
        };
        self.store.import_session(session, turn, runs).await?;
        Ok(())
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
        self.leased(id, self.import_messages_leased(id, messages))
            .await
    }

    /// [`Self::import_messages`] under the session's lease.
    async fn import_messages_leased(&self, id: SessionId, messages: Vec<Message>) -> Result<()> {
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
        self.fresh(&mut guard).await?;
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
