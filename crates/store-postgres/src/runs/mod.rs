//! Durable sub-agent runs and groups on PostgreSQL: acceptance with
//! completion-slot reservation, state transitions conditional on the
//! execution id, the terminal commit that converts a reservation into an
//! inbox event, session cancellation, and recovery of the runs older runtime
//! generations left behind (keel-store's `runs/`, the same rules; every
//! public operation is exactly one transaction).
//!
//! - `rows`: row ↔ record mapping and the inserts;
//! - `lifecycle`: accept, transitions, terminal commit, cancellation;
//! - `pauses`: background runs waiting for approval (pause, resume);
//! - `import`: whole runs read for an export and written back by an import;
//! - `recovery`: what a new runtime generation does with the older ones' runs.

mod import;
mod lifecycle;
mod pauses;
mod recovery;
mod rows;

use keel_core::{GroupId, RunId, SessionId};
use keel_store::{GroupRecord, Page, Result, RunCursor, RunQuery, RunRecord};

use crate::PgStore;

pub(crate) use import::import_runs_tx;
pub(crate) use pauses::end_run_approvals_tx;
pub(crate) use recovery::{interrupt_orphan_tx, recover_tx, Stale};
pub(crate) use rows::{get_run_tx, query_runs};

use rows::get_group_tx;

/// Run statuses that can still change, as an SQL list.
pub(crate) const NONTERMINAL_RUN: &str =
    "('queued', 'running', 'waiting_children', 'waiting_approval')";

/// Non-terminal statuses of a run some execution is working on: what a
/// stopped runtime generation leaves interrupted. A run waiting for
/// approval has no execution and survives restarts.
pub(crate) const EXECUTING_RUN: &str = "('queued', 'running', 'waiting_children')";

impl PgStore {
    pub(crate) async fn get_run(&self, run_id: RunId) -> Result<Option<RunRecord>> {
        self.read(move |tx| Box::pin(async move { get_run_tx(tx, &run_id).await }))
            .await
    }

    pub(crate) async fn get_group(&self, group_id: GroupId) -> Result<Option<GroupRecord>> {
        self.read(move |tx| Box::pin(async move { get_group_tx(tx, &group_id).await }))
            .await
    }

    pub(crate) async fn group_runs(&self, group_id: GroupId) -> Result<Vec<RunRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                query_runs(
                    tx,
                    "WHERE group_id = $1 ORDER BY row_order",
                    &[&group_id.to_string()],
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn child_runs(&self, parent_run_id: RunId) -> Result<Vec<RunRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                query_runs(
                    tx,
                    "WHERE parent_run_id = $1 ORDER BY created_at, id",
                    &[&parent_run_id.to_string()],
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn list_runs(
        &self,
        root_session_id: SessionId,
        cursor: Option<RunCursor>,
        limit: usize,
    ) -> Result<Page<RunRecord, RunCursor>> {
        self.query_runs(RunQuery {
            root_session_id: Some(root_session_id),
            cursor,
            limit,
            ..RunQuery::default()
        })
        .await
    }
}
