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

/// Whose work a recovery takes over.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stale {
    /// Generations older than this one that no live process holds (a
    /// runtime's start, `recover_older_generations`); only expired inbox
    /// leases are released.
    OlderThan(u64),
    /// Every generation no live process holds (a process's activation and
    /// the recovery of expired processes, whose dead rows are deleted
    /// first): with the inbox leases of the sessions no live process leases.
    NotLive,
}

/// Runs not held by a live process (`runtime_processes`).
const NOT_LIVE: &str = "runtime_generation NOT IN (SELECT generation FROM runtime_processes)";

/// Recovery of the `stale` generations' work.
pub(crate) async fn recover_tx(
    tx: &Tx<'_>,
    stale: Stale,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    let mut revisions = Revisions::default();
    // 1–3: runs of stale generations end as interrupted, converting their reservations.
    let stale_runs = match stale {
        Stale::OlderThan(active) => {
            let generation = to_i64("active_generation", active)?;
            query_runs(
                tx,
                &format!(
                    "WHERE runtime_generation < $1 AND {NOT_LIVE} AND status IN {EXECUTING_RUN} \
                     ORDER BY row_order"
                ),
                &[&generation],
            )
            .await?
        }
        Stale::NotLive => {
            query_runs(
                tx,
                &format!("WHERE {NOT_LIVE} AND status IN {EXECUTING_RUN} ORDER BY row_order"),
                &[],
            )
            .await?
        }
    };
    let stale = matches!(stale, Stale::NotLive);
    for run in stale_runs {
        let run = require_run(tx, &run.spec.id).await?;
        if run.status.is_terminal() {
            continue;
        }
        let commit = interrupt_tx(tx, &run, now_ms, &mut revisions, webhook_urls).await?;
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
    // 4: expired leases go back to pending; so do those of sessions no
    // live process leases (every claim is made under the session's lease).
    report.leases_expired =
        crate::inbox::expire_leases_tx(tx, now_ms, now_ms, &mut revisions).await?;
    if stale {
        report.leases_expired +=
            crate::inbox::release_orphaned_leases_tx(tx, now_ms, &mut revisions).await?;
    }
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

/// Ends run `id` as interrupted if it still runs under a generation no
/// process holds (its process was taken over), with its completion; one
/// small transaction per run, so the live processes' work rarely conflicts
/// with a takeover. `None` when there was nothing to do.
pub(crate) async fn interrupt_orphan_tx(
    tx: &Tx<'_>,
    id: &keel_core::RunId,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<Option<keel_store::TerminalCommit>> {
    let run = require_run(tx, id).await?;
    if run.status.is_terminal() {
        return Ok(None);
    }
    let generation = to_i64("runtime_generation", run.spec.runtime_generation)?;
    let registered = tx
        .query_opt(
            "SELECT 1 FROM runtime_processes WHERE generation = $1",
            &[&generation],
        )
        .await
        .map_err(from_pg)?
        .is_some();
    if registered {
        return Ok(None);
    }
    let commit = interrupt_tx(tx, &run, now_ms, &mut Revisions::default(), webhook_urls).await?;
    Ok(Some(commit))
}

/// Ends `run`, whose generation stopped, as interrupted, its completion
/// delivered.
async fn interrupt_tx(
    tx: &Tx<'_>,
    run: &keel_store::RunRecord,
    now_ms: i64,
    revisions: &mut Revisions,
    webhook_urls: &[String],
) -> Result<keel_store::TerminalCommit> {
    let outcome = TerminalOutcome::Interrupted {
        reason: format!(
            "runtime generation {} stopped before the run finished",
            run.spec.runtime_generation
        ),
    };
    terminal_tx(
        tx,
        run,
        &outcome,
        CompletionHandling::Deliver,
        now_ms,
        revisions,
        webhook_urls,
    )
    .await
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
            Box::pin(async move {
                recover_tx(tx, Stale::OlderThan(active_generation), now_ms, &urls).await
            })
        })
        .await
    }
}
