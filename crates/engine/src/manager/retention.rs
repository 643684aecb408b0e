//! Retention: keeps each session's newest turn checkpoints (and everything
//! a head, a fork, a rollback or a manual checkpoint needs) and purges
//! dialogs deleted long enough ago, off the turn path, then gives the freed
//! pages back.

use std::sync::{Arc, Weak};
use std::time::Duration;

use keel_store::{PrunePolicy, PruneReport, PurgeReport, Store};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::SessionManager;
use crate::error::Result;

/// Free pages given back per transaction.
const RECLAIM_STEP: u32 = 1024;

/// What retention keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Turn checkpoints kept per session, newest first; `None` keeps all.
    pub keep_checkpoints: Option<usize>,
    /// How long a soft-deleted dialog is kept before it is purged for
    /// good; `None` keeps it forever.
    pub purge_deleted_after: Option<Duration>,
}

/// What one retention pass removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionReport {
    /// Sessions whose checkpoints were pruned.
    pub sessions: u64,
    /// Rows removed across them.
    pub removed: PruneReport,
    /// Deleted dialogs purged, and their rows.
    pub purged: PurgeReport,
    /// Database pages given back to the file system.
    pub pages_reclaimed: u64,
    /// The compression dictionary trained in this pass, if one was due.
    pub dictionary: Option<u32>,
}

/// One pass over `store` at `now_ms`: purges the dialogs deleted before
/// `policy.purge_deleted_after`, prunes every session with more turn
/// checkpoints than `policy.keep_checkpoints` (each batch its own
/// transaction), reclaims free pages in bounded steps, and trains the
/// database's compression dictionary once it is due. Safe to interrupt at
/// any point.
pub async fn apply_retention(
    store: &Store,
    policy: RetentionPolicy,
    now_ms: i64,
) -> Result<RetentionReport> {
    let mut report = RetentionReport::default();
    if let Some(after) = policy.purge_deleted_after {
        let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
        let cutoff = now_ms.saturating_sub(after_ms);
        // Newest created first: a fork is purged before the dialog it shares history with.
        for id in store.deleted_sessions_before(cutoff).await? {
            report.purged.add(&store.purge_session(id).await?);
        }
        if report.purged != PurgeReport::default() {
            report.purged.blobs += store.sweep_state_blobs().await?;
        }
    }
    if let Some(keep) = policy.keep_checkpoints {
        let prune = PrunePolicy {
            keep_latest: Some(keep),
            older_than_ms: None,
        };
        for id in store.sessions_over_turn_checkpoints(keep).await? {
            let r = store.prune_checkpoints(id, prune).await?;
            if r.checkpoints_deleted > 0 {
                report.sessions += 1;
            }
            let total = &mut report.removed;
            total.checkpoints_deleted += r.checkpoints_deleted;
            total.timelines_deleted += r.timelines_deleted;
            total.messages_deleted += r.messages_deleted;
            total.blobs_deleted += r.blobs_deleted;
        }
    }
    loop {
        let n = store.reclaim_pages(RECLAIM_STEP).await?;
        report.pages_reclaimed += n;
        if n < u64::from(RECLAIM_STEP) {
            break;
        }
    }
    // A failed training costs only bytes (values compress without it) and
    // must not stop retention: logged, and tried again next pass.
    match store.train_dictionary_if_due(now_ms).await {
        Ok(id) => report.dictionary = id,
        Err(e) => tracing::warn!(error = %e, "training the compression dictionary failed"),
    }
    Ok(report)
}

impl SessionManager {
    /// Runs [`apply_retention`] every `interval` (the first after one
    /// interval) until the manager is dropped; a failed pass is logged and
    /// the next one tries again.
    pub fn spawn_retention(
        self: &Arc<Self>,
        interval: Duration,
        policy: RetentionPolicy,
    ) -> JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(self);
        let mut ticker = tokio::time::interval_at(Instant::now() + interval, interval);
        tokio::spawn(async move {
            loop {
                ticker.tick().await;
                let Some(manager) = weak.upgrade() else { break };
                let now = keel_core::time::now_ms();
                match apply_retention(&manager.store, policy, now).await {
                    Ok(r) if r.sessions > 0 || r.pages_reclaimed > 0 || r.purged.dialogs > 0 => {
                        tracing::info!(
                            sessions = r.sessions,
                            checkpoints = r.removed.checkpoints_deleted,
                            messages = r.removed.messages_deleted,
                            purged_dialogs = r.purged.dialogs,
                            purged_messages = r.purged.messages,
                            pages = r.pages_reclaimed,
                            "retention pass"
                        );
                    }
                    Ok(_) => {}
                    Err(e) => tracing::error!(error = %e, "retention pass failed"),
                }
            }
        })
    }
}
