//! [`Projections`]: turns changes of a dialog's sub-agent runs and inbox
//! events into `agent_run_updated` / `agent_event_updated` frames, in
//! revision order. SQLite is the source of truth: something that may have
//! changed a dialog's runs (a runner's lifecycle point, a turn's end, a
//! cancel) asks for a refresh, which reads every change after the last
//! revision published and publishes it. Refreshes of one dialog are
//! serialized, so its frames never go back in revision.

use std::collections::HashMap;
use std::sync::Arc;

use keel_core::{AgentId, RunId, SessionId};
use keel_engine::{RunEvent, RunObserver};
use keel_store::{AgentChanges, Store};
use parking_lot::Mutex;
use tokio::sync::Mutex as AsyncMutex;

use super::api::{AgentEvent, AgentRun};
use super::frames::ServerFrame;
use super::hub::Hub;
use super::problem::ApiResult;

/// Most changes of each kind read at once.
const CHANGES_PER_READ: usize = 500;

/// Publishes agent changes of watched dialogs; see the module docs.
pub struct Projections {
    store: Store,
    pub(crate) hub: Arc<Hub>,
    /// Last revision published, per watched dialog.
    published: Mutex<HashMap<SessionId, Arc<AsyncMutex<u64>>>>,
}

impl std::fmt::Debug for Projections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Projections").finish_non_exhaustive()
    }
}

/// The frames of `changes`, in revision order (a run before an event of the same revision).
fn frames_of(session: SessionId, changes: &AgentChanges) -> Vec<(u64, ServerFrame)> {
    let session_id = session.as_uuid();
    let mut frames: Vec<(u64, u8, ServerFrame)> = changes
        .runs
        .iter()
        .map(|r| {
            let frame = ServerFrame::AgentRunUpdated {
                session_id,
                revision: r.revision,
                run: AgentRun::from_record(r, false),
            };
            (r.revision, 0, frame)
        })
        .chain(changes.events.iter().map(|e| {
            let frame = ServerFrame::AgentEventUpdated {
                session_id,
                revision: e.revision,
                event: AgentEvent::from(e),
            };
            (e.revision, 1, frame)
        }))
        .collect();
    frames.sort_by_key(|(rev, kind, _)| (*rev, *kind));
    frames.into_iter().map(|(rev, _, f)| (rev, f)).collect()
}

/// The highest revision below which `changes` is complete: when a read hit
/// its limit, items at the last revision it returned may be missing.
fn complete_below(changes: &AgentChanges) -> Option<u64> {
    let mut bound = None::<u64>;
    if changes.runs.len() >= CHANGES_PER_READ {
        bound = changes.runs.last().map(|r| r.revision);
    }
    if changes.events.len() >= CHANGES_PER_READ {
        let e = changes.events.last().map(|e| e.revision);
        bound = match (bound, e) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    bound
}

impl Projections {
    /// Projections of `store`'s changes published through `hub`.
    pub fn new(store: Store, hub: Arc<Hub>) -> Self {
        Self {
            store,
            hub,
            published: Mutex::new(HashMap::new()),
        }
    }

    fn slot(&self, session: SessionId) -> Option<Arc<AsyncMutex<u64>>> {
        self.published.lock().get(&session).cloned()
    }

    /// Starts publishing `session`'s changes (if not yet) and returns the
    /// revision from which frames are published.
    pub async fn watch(&self, session: SessionId) -> ApiResult<u64> {
        if let Some(slot) = self.slot(session) {
            return Ok(*slot.lock().await);
        }
        let revision = self.store.inbox_usage(session).await?.revision;
        let slot = self
            .published
            .lock()
            .entry(session)
            .or_insert_with(|| Arc::new(AsyncMutex::new(revision)))
            .clone();
        let published = *slot.lock().await;
        Ok(published)
    }

    /// The frames a subscriber that saw revision `since` needs: every
    /// change at or after it. `None` when there are too many to replay (the
    /// subscriber resyncs instead).
    pub async fn replay(
        &self,
        session: SessionId,
        since: u64,
    ) -> ApiResult<(u64, Option<Vec<ServerFrame>>)> {
        let changes = self
            .store
            .agent_changes_since(session, since.saturating_sub(1), CHANGES_PER_READ)
            .await?;
        if complete_below(&changes).is_some() || since > changes.revision {
            return Ok((changes.revision, None));
        }
        let frames = frames_of(session, &changes)
            .into_iter()
            .map(|(_, f)| f)
            .collect();
        Ok((changes.revision, Some(frames)))
    }

    /// Publishes every change of `session` after the last one published.
    /// Nothing is read for a dialog nobody watches.
    pub async fn refresh(&self, session: SessionId) {
        if !self.hub.is_watched(session) {
            self.published.lock().remove(&session);
            return;
        }
        let Some(slot) = self.slot(session) else {
            return;
        };
        let mut published = slot.lock().await;
        loop {
            let changes = match self
                .store
                .agent_changes_since(session, *published, CHANGES_PER_READ)
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(session_id = %session, error = %e, "agent projection refresh failed; subscribers resync");
                    self.hub.publish(
                        session,
                        ServerFrame::Resync {
                            session_id: session.as_uuid(),
                            revision: *published,
                            reason: "agent updates could not be read".to_owned(),
                        },
                    );
                    return;
                }
            };
            let bound = complete_below(&changes);
            for (revision, frame) in frames_of(session, &changes) {
                if bound.is_some_and(|b| revision >= b) {
                    break;
                }
                self.hub.publish(session, frame);
                *published = revision;
            }
            match bound {
                None => {
                    *published = (*published).max(changes.revision);
                    return;
                }
                // One revision changed more than a read returns: its frames cannot be
                // published in full, so subscribers re-read instead.
                Some(b) if b <= *published + 1 => {
                    *published = changes.revision;
                    self.hub.publish(
                        session,
                        ServerFrame::Resync {
                            session_id: session.as_uuid(),
                            revision: changes.revision,
                            reason: "too many agent changes at once".to_owned(),
                        },
                    );
                    return;
                }
                Some(_) => {}
            }
        }
    }
}

/// Refreshes the dialog of a run at each point of its life a runner reports.
pub struct RunRefresher {
    /// The projections to refresh.
    pub projections: Arc<Projections>,
    /// Where runs are read.
    pub store: Store,
}

impl RunObserver for RunRefresher {
    fn on_run_event(&self, run_id: RunId, _agent: &AgentId, _event: RunEvent) {
        let projections = self.projections.clone();
        let store = self.store.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            match store.get_run(run_id).await {
                Ok(Some(run)) => {
                    let session = run.spec.root_session_id;
                    // Other processes' clients of the dialog see it too.
                    projections.hub.relay_changed(session);
                    projections.refresh(session).await;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(%run_id, error = %e, "cannot read a run to publish its change")
                }
            }
        });
    }
}
