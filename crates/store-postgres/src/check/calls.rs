//! The check of call spans: each belongs to a stored dialog, and a run's
//! to a stored run (a purge deletes them with their dialog).

use crate::store::Tx;
use keel_store::{CheckOptions, Invariant, InvariantReport, Result};

use super::{rows, MAX_NAMED};

/// Call spans whose dialog or run is not stored.
pub(super) async fn call_spans(
    tx: &Tx<'_>,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    // Named in SQLite's (byte) order, whatever the database's collation.
    let orphans = rows(
        tx,
        &format!(
            "SELECT ('dialog ' || c.session_id) COLLATE \"C\", count(*) FROM call_spans c \
             WHERE NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = c.session_id) \
             GROUP BY c.session_id \
             UNION ALL \
             SELECT ('run ' || c.run_id) COLLATE \"C\", count(*) FROM call_spans c \
             WHERE c.run_id IS NOT NULL \
               AND NOT EXISTS (SELECT 1 FROM agent_runs r WHERE r.id = c.run_id) \
             GROUP BY c.run_id ORDER BY 1 LIMIT {MAX_NAMED}"
        ),
    )
    .await?;
    for r in orphans {
        let (owner, n): (String, i64) = (r.get(0), r.get(1));
        report.push(
            Invariant::Runs,
            false,
            format!("{n} call span(s) of {owner}, which is not stored"),
        );
    }
    Ok(())
}
