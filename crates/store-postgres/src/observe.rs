//! Reads for operators on PostgreSQL: the inbox gauges `GET /metrics`
//! reports at scrape time, and the run trees a trace view draws. Each is
//! one bounded read.

use keel_core::{RunId, SessionId, TurnId};
use keel_store::{InboxGauges, Result, RunRecord, MAX_TRACE_RUNS};

use crate::runs::query_runs;
use crate::store::from_pg;
use crate::util::non_negative;
use crate::PgStore;

impl PgStore {
    pub(crate) async fn inbox_gauges(&self) -> Result<InboxGauges> {
        self.read(|tx| {
            Box::pin(async move {
                let row = tx
                    .query_one(
                        "SELECT count(*), min(created_at) FROM agent_inbox_events \
                         WHERE status IN ('pending', 'leased', 'admitted')",
                        &[],
                    )
                    .await
                    .map_err(from_pg)?;
                let dead: i64 = tx
                    .query_one(
                        "SELECT count(*) FROM agent_inbox_events WHERE status = 'dead_letter'",
                        &[],
                    )
                    .await
                    .map_err(from_pg)?
                    .get(0);
                Ok(InboxGauges {
                    pending: non_negative("pending inbox events", row.get(0))?,
                    oldest_pending_at_ms: row.get(1),
                    dead_lettered: non_negative("dead-lettered events", dead)?,
                })
            })
        })
        .await
    }

    pub(crate) async fn run_tree(&self, id: RunId) -> Result<Vec<RunRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                let found = tx
                    .query_opt("SELECT 1 FROM agent_runs WHERE id = $1", &[&id.to_string()])
                    .await
                    .map_err(from_pg)?;
                if found.is_none() {
                    return Ok(Vec::new());
                }
                query_runs(
                    tx,
                    &format!(
                        "WHERE id IN (WITH RECURSIVE tree(id) AS \
                         (SELECT $1::text UNION SELECT r.id FROM agent_runs r \
                          JOIN tree ON r.parent_run_id = tree.id) \
                         SELECT id FROM tree LIMIT {MAX_TRACE_RUNS}) ORDER BY created_at, id"
                    ),
                    &[&id.to_string()],
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn turn_runs(
        &self,
        session: Option<SessionId>,
        turn: TurnId,
    ) -> Result<Vec<RunRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                match session {
                    Some(s) => {
                        query_runs(
                            tx,
                            &format!(
                                "WHERE root_session_id = $1 AND root_turn_id = $2 \
                                 ORDER BY created_at, id LIMIT {MAX_TRACE_RUNS}"
                            ),
                            &[&s.to_string(), &turn.to_string()],
                        )
                        .await
                    }
                    None => {
                        query_runs(
                            tx,
                            &format!(
                                "WHERE root_turn_id = $1 ORDER BY created_at, id \
                                 LIMIT {MAX_TRACE_RUNS}"
                            ),
                            &[&turn.to_string()],
                        )
                        .await
                    }
                }
            })
        })
        .await
    }
}
