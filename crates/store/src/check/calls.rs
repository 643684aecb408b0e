//! The check of call spans: each belongs to a stored dialog, and a run's
//! to a stored run (a purge deletes them with their dialog).

use rusqlite::Connection;

use super::{query_rows, CheckOptions, Invariant, InvariantReport};
use crate::error::Result;

/// Most orphaned owners named.
const MAX_NAMED: i64 = 20;

/// Call spans whose dialog or run is no longer stored.
pub(super) fn call_spans(
    conn: &Connection,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    let orphans = query_rows(
        conn,
        &format!(
            "SELECT 'dialog ' || c.session_id, count(*) FROM call_spans c \
             WHERE NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = c.session_id) \
             GROUP BY c.session_id \
             UNION ALL \
             SELECT 'run ' || c.run_id, count(*) FROM call_spans c \
             WHERE c.run_id IS NOT NULL \
               AND NOT EXISTS (SELECT 1 FROM agent_runs r WHERE r.id = c.run_id) \
             GROUP BY c.run_id ORDER BY 1 LIMIT {MAX_NAMED}"
        ),
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
    )?;
    for (owner, n) in orphans {
        report.push(
            Invariant::Runs,
            false,
            format!("{n} call span(s) of {owner}, which is not stored"),
        );
    }
    Ok(())
}
