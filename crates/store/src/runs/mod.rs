//! Durable sub-agent runs and groups: acceptance with completion-slot
//! reservation, state transitions conditional on the execution id, the
//! terminal commit that converts a reservation into an inbox event, session
//! cancellation, and recovery of the runs older runtime generations left
//! behind. Every public operation is exactly one transaction.
//!
//! The invariants the transactions keep: only the execution that owns a run
//! (its `execution_id`) moves it, and it becomes terminal at most once; a
//! background run (or an `All` group) holds one completion slot of its root
//! session's inbox from acceptance until its terminal commit converts the
//! slot into exactly one completion event or releases it.
//!
//! - `types`: the records, requests and reports;
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
mod types;

use keel_core::{GroupId, RunId, SessionId};

use crate::error::Result;
use crate::{Page, SqliteStore};

pub(crate) use import::import_runs_tx;
pub(crate) use pauses::end_run_approvals_tx;
pub use pauses::{PausedRunCommit, ResumedRun};
pub(crate) use recovery::recover_tx;
pub(crate) use rows::get_run_tx;
pub use types::{
    AcceptGroup, AcceptRun, AcceptedGroup, AcceptedRun, CancelReport, CompletionHandling,
    GroupRecord, GroupStatus, NewGroup, NewRun, RecoveryReport, RunCursor, RunRecord,
    TerminalCommit, TerminalOutcome,
};

use rows::get_group_tx;
pub(crate) use rows::query_runs;

/// Run statuses that can still change, as an SQL list.
pub(crate) const NONTERMINAL_RUN: &str =
    "('queued', 'running', 'waiting_children', 'waiting_approval')";

/// Non-terminal statuses of a run some execution is working on: what a
/// stopped runtime generation leaves interrupted. A run waiting for
/// approval has no execution and survives restarts.
pub(crate) const EXECUTING_RUN: &str = "('queued', 'running', 'waiting_children')";

impl SqliteStore {
    pub(crate) async fn get_run(&self, run_id: RunId) -> Result<Option<RunRecord>> {
        self.db.read(move |c| get_run_tx(c, &run_id)).await
    }

    pub(crate) async fn get_group(&self, group_id: GroupId) -> Result<Option<GroupRecord>> {
        self.db.read(move |c| get_group_tx(c, &group_id)).await
    }

    pub(crate) async fn group_runs(&self, group_id: GroupId) -> Result<Vec<RunRecord>> {
        self.db
            .read(move |c| {
                query_runs(
                    c,
                    "WHERE group_id = ?1 ORDER BY rowid",
                    [group_id.to_string()],
                )
            })
            .await
    }

    pub(crate) async fn child_runs(&self, parent_run_id: RunId) -> Result<Vec<RunRecord>> {
        self.db
            .read(move |c| {
                query_runs(
                    c,
                    "WHERE parent_run_id = ?1 ORDER BY created_at, id",
                    [parent_run_id.to_string()],
                )
            })
            .await
    }

    pub(crate) async fn list_runs(
        &self,
        root_session_id: SessionId,
        cursor: Option<RunCursor>,
        limit: usize,
    ) -> Result<Page<RunRecord, RunCursor>> {
        self.query_runs(crate::RunQuery {
            root_session_id: Some(root_session_id),
            cursor,
            limit,
            ..crate::RunQuery::default()
        })
        .await
    }
}
