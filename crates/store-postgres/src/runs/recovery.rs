//! Recovery when a runtime generation starts: the runs older generations
//! left unfinished end as interrupted, and the inbox's leases and counters
//! are made consistent with the rows again.

use crate::store::Tx;
use keel_core::SessionId;
use keel_store::{CompletionHandling, RecoveryReport, Result, TerminalOutcome};

use super::lifecycle::{finish_group, terminal_tx};
use super::rows::{query_groups, query_runs, require_group, require_run, u32_col};
use super::{EXECUTING_RUN, NONTERMINAL_RUN};
use crate::counters::{reconcile_tx, Revisions};
use crate::store::from_pg;
use crate::util::{parse, to_i64};
use crate::PgStore;

/// Recovery for `active_generation`; with `all_leases`, every lease is
/// released (the process that held it is gone), else only expired ones.
pub(crate) async fn recover_tx(
    tx: &Tx<'_>,
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
        tx,
        &format!("WHERE runtime_generation < $1 AND status IN {EXECUTING_RUN} ORDER BY row_order"),
        &[&generation],
    )
    .await?;
    for run in stale {
        let run = require_run(tx, &run.spec.id).await?;
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
            tx,
            &run,
            &outcome,
            CompletionHandling::Deliver,
            now_ms,
            &mut revisions,
            webhook_urls,
        )
        .await?;
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
    // SQLite reads them without an ORDER BY, which is its rowid order.
    let open_groups = query_groups(
        tx,
        "WHERE status IN ('queued', 'running') ORDER BY row_order",
        &[],
    )
    .await?;
    for group in open_groups {
        let row = tx
            .query_one(
                &format!(
                    "SELECT count(*) FILTER (WHERE status NOT IN {NONTERMINAL_RUN}), \
                     count(*) FILTER (WHERE status NOT IN {NONTERMINAL_RUN} AND status <> 'completed') \
                     FROM agent_runs WHERE group_id = $1"
                ),
                &[&group.spec.id.to_string()],
            )
            .await
            .map_err(from_pg)?;
        let terminal = u32_col("group terminal runs", row.get(0))?;
        let abnormal = u32_col("group abnormal runs", row.get(1))?;
        if terminal != group.terminal_runs || abnormal != group.abnormal_runs {
            let revision = revisions
                .of(tx, &group.spec.root_session_id, now_ms)
                .await?;
            tx.execute(
                "UPDATE agent_run_groups SET terminal_runs = $1, abnormal_runs = $2, \
                 revision = $3, updated_at = $4 WHERE id = $5",
                &[
                    &i64::from(terminal),
                    &i64::from(abnormal),
                    &revision,
                    &now_ms,
                    &group.spec.id.to_string(),
                ],
            )
            .await
            .map_err(from_pg)?;
            if terminal == group.expected_runs {
                let group = require_group(tx, &group.spec.id).await?;
                let (_, event) =
                    finish_group(tx, &group, CompletionHandling::Deliver, revision, now_ms).await?;
                if event.is_some() {
                    report.completion_events += 1;
                }
                report.groups_finished += 1;
            }
        }
    }
    // 4: expired leases go back to pending.
    let cutoff = if all_leases { i64::MAX } else { now_ms };
    report.leases_expired =
        crate::inbox::expire_leases_tx(tx, cutoff, now_ms, &mut revisions).await?;
    // 5: recompute every root session's counters, in the order SQLite's
    // UNION returns them (sorted, duplicates removed).
    let roots = tx
        .query(
            "SELECT root_session_id FROM agent_session_state \
             UNION SELECT root_session_id FROM agent_runs \
             UNION SELECT root_session_id FROM agent_inbox_events \
             ORDER BY 1",
            &[],
        )
        .await
        .map_err(from_pg)?
        .iter()
        .map(|r| parse::<SessionId>("root_session_id", r.get(0)))
        .collect::<Result<Vec<_>>>()?;
    for root in &roots {
        if let Some(repair) = reconcile_tx(tx, root, now_ms, &mut revisions).await? {
            report.counters_repaired.push(repair);
        }
    }
    // 6: who to wake.
    report.sessions_with_inbox_work = crate::inbox::sessions_with_inbox_work_tx(tx).await?;
    Ok(report)
}

impl PgStore {
    pub(crate) async fn recover_older_generations(
        &self,
        active_generation: u64,
        now_ms: i64,
    ) -> Result<RecoveryReport> {
        let urls = self.inner.hooks.urls();
        self.write(move |tx| {
            let urls = urls.clone();
            Box::pin(async move { recover_tx(tx, active_generation, now_ms, false, &urls).await })
        })
        .await
    }
}
