//! What changed in a root session since a client revision: the runs and
//! inbox events whose last change carries a newer revision. Every
//! transaction that changes a session's runs or inbox stamps the rows it
//! changes with one new revision, and transactions commit one at a time, so
//! a reader that remembers the revision it last saw misses nothing.

use keel_core::SessionId;
use rusqlite::params;

use crate::counters::usage_tx;
use crate::error::Result;
use crate::inbox::{query_events, InboxEvent};
use crate::runs::{query_runs, RunRecord};
use crate::util::to_i64;
use crate::Store;

/// Runs and events of a root session changed after a revision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionChanges {
    /// The session's revision when this was read: every change up to it is included.
    pub revision: u64,
    /// Runs changed after the asked revision, in revision order (each as it is now).
    pub runs: Vec<RunRecord>,
    /// Events changed after the asked revision, in revision order (each as it is now).
    pub events: Vec<InboxEvent>,
}

impl Store {
    /// The runs and inbox events of `root_session_id` whose last change is
    /// newer than `since`, read in one snapshot with the session's revision.
    pub async fn changes_since(
        &self,
        root_session_id: SessionId,
        since: u64,
    ) -> Result<SessionChanges> {
        self.db
            .read(move |c| {
                let revision = usage_tx(c, &root_session_id)?.revision;
                if revision <= since {
                    return Ok(SessionChanges {
                        revision,
                        ..SessionChanges::default()
                    });
                }
                let key = root_session_id.to_string();
                let since = to_i64("revision", since)?;
                let runs = query_runs(
                    c,
                    "WHERE root_session_id = ?1 AND revision > ?2 ORDER BY revision, rowid",
                    params![key, since],
                )?;
                let events = query_events(
                    c,
                    "WHERE root_session_id = ?1 AND revision > ?2 ORDER BY revision, created_at, id",
                    params![key, since],
                )?;
                Ok(SessionChanges {
                    revision,
                    runs,
                    events,
                })
            })
            .await
    }
}
