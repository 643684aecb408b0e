//! The checks of user inputs: one committed `open` is held only by a live
//! turn; one acknowledged waits in `queued_inputs` only until its turn
//! starts, and only for a dialog that can still run it.

use crate::store::Tx;
use keel_store::{CheckOptions, Invariant, InvariantReport, Result};

use super::rows;

/// A user's input still open with no process answering it.
pub(super) async fn open_inputs(
    tx: &Tx<'_>,
    options: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    if options.owner_alive {
        return Ok(());
    }
    for r in rows(
        tx,
        "SELECT timeline_id, seq FROM messages WHERE input_state = 'open' \
         ORDER BY timeline_id, seq",
    )
    .await?
    {
        let (timeline, seq): (String, i64) = (r.get(0), r.get(1));
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

/// Queued inputs of dialogs that are gone, or whose turn already ran.
pub(super) async fn queued_inputs(
    tx: &Tx<'_>,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    let orphans = rows(
        tx,
        "SELECT q.turn_id, q.session_id, s.id IS NULL FROM queued_inputs q \
         LEFT JOIN sessions s ON s.id = q.session_id \
         WHERE s.id IS NULL OR s.deleted_at IS NOT NULL ORDER BY q.seq",
    )
    .await?;
    for r in orphans {
        let (turn, session, missing): (String, String, bool) = (r.get(0), r.get(1), r.get(2));
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
    let started = rows(
        tx,
        "SELECT q.turn_id FROM queued_inputs q WHERE \
         EXISTS (SELECT 1 FROM agent_runs r WHERE r.root_turn_id = q.turn_id) OR \
         EXISTS (SELECT 1 FROM agent_inbox_events e WHERE e.admitted_turn_id = q.turn_id) \
         ORDER BY q.seq",
    )
    .await?;
    for r in started {
        let turn: String = r.get(0);
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
