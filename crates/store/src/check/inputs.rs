//! The checks of user inputs: one committed `open` is held only by a live
//! turn; one acknowledged waits in `queued_inputs` only until its turn
//! starts, and only for a dialog that can still run it.

use rusqlite::Connection;

use super::{query_rows, CheckOptions, Invariant, InvariantReport};
use crate::error::Result;

/// A user's input is committed `open` before the model is called; only a
/// live turn holds one open. One left by a stopped process is marked
/// unanswered by the next start's recovery.
pub(super) fn open_inputs(
    conn: &Connection,
    options: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    if options.owner_alive {
        return Ok(());
    }
    let open = query_rows(
        conn,
        "SELECT timeline_id, seq FROM messages WHERE input_state = 'open' \
         ORDER BY timeline_id, seq",
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
    )?;
    for (timeline, seq) in open {
        report.push(
            Invariant::History,
            true,
            format!(
                "timeline {timeline} seq {seq}: a user's message is still open, but no process \
                 is answering it; the next start marks it unanswered"
            ),
        );
    }
    Ok(())
}

/// Every queued input belongs to a live dialog, and none belongs to a turn
/// that already started (opening a turn takes its input off the queue in the
/// same transaction; a turn that delegated or admitted inbox events started).
pub(super) fn queued_inputs(
    conn: &Connection,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    let orphans = query_rows(
        conn,
        "SELECT q.turn_id, q.session_id, s.id IS NULL FROM queued_inputs q \
         LEFT JOIN sessions s ON s.id = q.session_id \
         WHERE s.id IS NULL OR s.deleted_at IS NOT NULL ORDER BY q.seq",
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, bool>(2)?,
            ))
        },
    )?;
    for (turn, session, missing) in orphans {
        let gone = if missing {
            "does not exist"
        } else {
            "is deleted"
        };
        report.add(
            Invariant::QueuedInputs,
            format!(
                "turn {turn}: a message acknowledged for dialog {session}, which {gone}; \
                 it will never be answered"
            ),
        );
    }
    let started = query_rows(
        conn,
        "SELECT q.turn_id FROM queued_inputs q WHERE \
         EXISTS (SELECT 1 FROM agent_runs r WHERE r.root_turn_id = q.turn_id) OR \
         EXISTS (SELECT 1 FROM agent_inbox_events e WHERE e.admitted_turn_id = q.turn_id) \
         ORDER BY q.seq",
        |r| r.get::<_, String>(0),
    )?;
    for turn in started {
        report.add(
            Invariant::QueuedInputs,
            format!(
                "turn {turn}: its message is still queued, but the turn already ran \
                 (it started runs or took inbox events); the next start would run it twice"
            ),
        );
    }
    Ok(())
}
