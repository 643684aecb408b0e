//! Recovery when a runtime generation starts: the runs older generations
//! left unfinished end as interrupted, and the inbox's leases and counters
//! are made consistent with the rows again.

use keel_core::SessionId;
use rusqlite::{params, Connection};

use super::lifecycle::{finish_group, terminal_tx};
use super::rows::{query_groups, query_runs, require_group, require_run, u32_col};
use super::types::{CompletionHandling, RecoveryReport, TerminalOutcome};
use super::{EXECUTING_RUN, NONTERMINAL_RUN};
use crate::counters::{reconcile_tx, Revisions};
use crate::error::Result;
use crate::util::{parse, to_i64};
use crate::SqliteStore;

/// Recovery for `active_generation`; with `all_leases`, every lease is
/// released (the process that held it is gone), else only expired ones.
pub(crate) fn recover_tx(
    conn: &Connection,
    active_generation: u64,
    now_ms: i64,
    all_leases: bool,
    webhook_urls: &[String],
) -> Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    let generation = to_i64("active_generation", active_generation)?;
    let mut revisions = Revisions::default();
    // 1–3: old-generation runs end as interrupted, converting their reservations.
    let stale = query_runs(
        conn,
        &format!("WHERE runtime_generation < ?1 AND status IN {EXECUTING_RUN} ORDER BY rowid"),
        [generation],
    )?;
    for run in stale {
        let run = require_run(conn, &run.spec.id)?;
        if run.status.is_terminal() {
            continue;
        }
        let outcome = TerminalOutcome::Interrupted {
            reason: format!(
                "runtime generation {} stopped before the run finished",
                run.spec.runtime_generation
            ),
        };
        let commit = terminal_tx(
            conn,
            &run,
            &outcome,
            CompletionHandling::Deliver,
            now_ms,
            &mut revisions,
            webhook_urls,
        )?;
        if commit.event_id.is_some() {
            report.completion_events += 1;
        }
        if commit.finished_group.is_some() {
            report.groups_finished += 1;
        }
        report.interrupted_runs.push(run.spec.id);
    }
    // Groups whose counters drifted from their runs (a crash between writes cannot
    // happen inside one transaction, but a hand-edited or older database can).
    let open_groups = query_groups(conn, "WHERE status IN ('queued', 'running')", [])?;
    for group in open_groups {
        let (terminal, abnormal): (i64, i64) = conn.query_row(
            &format!(
                "SELECT count(*) FILTER (WHERE status NOT IN {NONTERMINAL_RUN}), \
                 count(*) FILTER (WHERE status NOT IN {NONTERMINAL_RUN} AND status <> 'completed') \
                 FROM agent_runs WHERE group_id = ?1"
            ),
            [group.spec.id.to_string()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let terminal = u32_col("group terminal runs", terminal)?;
        let abnormal = u32_col("group abnormal runs", abnormal)?;
        if terminal != group.terminal_runs || abnormal != group.abnormal_runs {
            let revision = revisions.of(conn, &group.spec.root_session_id, now_ms)?;
            conn.execute(
                "UPDATE agent_run_groups SET terminal_runs = ?1, abnormal_runs = ?2, \
                 revision = ?3, updated_at = ?4 WHERE id = ?5",
                params![
                    terminal,
                    abnormal,
                    revision,
                    now_ms,
                    group.spec.id.to_string()
                ],
            )?;
            if terminal == group.expected_runs {
                let group = require_group(conn, &group.spec.id)?;
                let (_, event) =
                    finish_group(conn, &group, CompletionHandling::Deliver, revision, now_ms)?;
                if event.is_some() {
                    report.completion_events += 1;
                }
                report.groups_finished += 1;
            }
        }
    }
    // 4: expired leases go back to pending.
    let cutoff = if all_leases { i64::MAX } else { now_ms };
    report.leases_expired = crate::inbox::expire_leases_tx(conn, cutoff, now_ms, &mut revisions)?;
    // 5: recompute every root session's counters.
    let mut stmt = conn.prepare(
        "SELECT root_session_id FROM agent_session_state \
         UNION SELECT root_session_id FROM agent_runs \
         UNION SELECT root_session_id FROM agent_inbox_events",
    )?;
    let roots = stmt
        .query_map([], |r| r.get::<_, String>(0))?
        .map(|s| parse::<SessionId>("root_session_id", &s?))
        .collect::<Result<Vec<_>>>()?;
    for root in &roots {
        if let Some(repair) = reconcile_tx(conn, root, now_ms, &mut revisions)? {
            report.counters_repaired.push(repair);
        }
    }
    // 6: who to wake.
    report.sessions_with_inbox_work = crate::inbox::sessions_with_inbox_work_tx(conn)?;
    Ok(report)
}

impl SqliteStore {
    pub(crate) async fn recover_older_generations(
        &self,
        active_generation: u64,
        now_ms: i64,
    ) -> Result<RecoveryReport> {
        let urls = self.webhook_urls();
        self.db
            .write(move |c| recover_tx(c, active_generation, now_ms, false, &urls))
            .await
    }
}
