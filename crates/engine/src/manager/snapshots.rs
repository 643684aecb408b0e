//! Snapshots: a whole session exported as portable data and imported as a
//! new session.

use keel_core::{AgentId, SessionId};

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
