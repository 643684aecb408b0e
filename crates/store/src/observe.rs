//! Reads for operators: the inbox gauges `GET /metrics` reports at scrape
//! time, and the run trees a trace view draws. Each is one bounded read.

use keel_core::{RunId, SessionId, TurnId};
use rusqlite::OptionalExtension;

use crate::error::Result;
use crate::runs::{query_runs, RunRecord};
use crate::util::non_negative;
use crate::SqliteStore;

/// Most runs one trace returns (a tree is bounded by `max_runs_per_tree`
/// far below this; the bound keeps a corrupt parent chain from running on).
pub const MAX_TRACE_RUNS: usize = 1000;

/// The inbox across every dialog, right now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxGauges {
    /// Signals and completions waiting for a turn (pending, leased or admitted).
    pub pending: u64,
    /// When the oldest of them was created (ms); `None` when none waits.
    pub oldest_pending_at_ms: Option<i64>,
    /// Events given up on (dead-lettered) and still stored.
    pub dead_lettered: u64,
}

impl SqliteStore {
    pub(crate) async fn inbox_gauges(&self) -> Result<InboxGauges> {
        self.db
            .read(|c| {
                let (pending, oldest): (i64, Option<i64>) = c
                    .prepare_cached(
                        "SELECT count(*), min(created_at) FROM agent_inbox_events \
                         WHERE status IN ('pending', 'leased', 'admitted')",
                    )?
                    .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
                let dead: i64 = c
                    .prepare_cached(
                        "SELECT count(*) FROM agent_inbox_events WHERE status = 'dead_letter'",
                    )?
                    .query_row([], |r| r.get(0))?;
                Ok(InboxGauges {
                    pending: non_negative("pending inbox events", pending)?,
                    oldest_pending_at_ms: oldest,
                    dead_lettered: non_negative("dead-lettered events", dead)?,
                })
            })
            .await
    }

    pub(crate) async fn run_tree(&self, id: RunId) -> Result<Vec<RunRecord>> {
        self.db
            .read(move |c| {
                let found = c
                    .prepare_cached("SELECT 1 FROM agent_runs WHERE id = ?1")?
                    .query_row([id.to_string()], |_| Ok(()))
                    .optional()?;
                if found.is_none() {
                    return Ok(Vec::new());
                }
                query_runs(
                    c,
                    &format!(
                        "WHERE id IN (WITH RECURSIVE tree(id) AS \
                         (SELECT ?1 UNION SELECT r.id FROM agent_runs r JOIN tree ON r.parent_run_id = tree.id) \
                         SELECT id FROM tree LIMIT {MAX_TRACE_RUNS}) ORDER BY created_at, id"
                    ),
                    [id.to_string()],
                )
            })
            .await
    }

    pub(crate) async fn turn_runs(
        &self,
        session: Option<SessionId>,
        turn: TurnId,
    ) -> Result<Vec<RunRecord>> {
        self.db
            .read(move |c| match session {
                Some(s) => query_runs(
                    c,
                    &format!(
                        "WHERE root_session_id = ?1 AND root_turn_id = ?2 \
                         ORDER BY created_at, id LIMIT {MAX_TRACE_RUNS}"
                    ),
                    [s.to_string(), turn.to_string()],
                ),
                None => query_runs(
                    c,
                    &format!(
                        "WHERE root_turn_id = ?1 ORDER BY created_at, id LIMIT {MAX_TRACE_RUNS}"
                    ),
                    [turn.to_string()],
                ),
            })
            .await
    }
}
