//! The check of the webhook outbox: a subscription waits either for its
//! queued input's turn to open or, bound to the input, for the commit that
//! answers it (which uses it up); a delivery's body is JSON and a
//! delivered or dead row had at least one attempt.

use rusqlite::Connection;

use super::{query_rows, CheckOptions, Invariant, InvariantReport};
use crate::error::Result;

/// Most rows named per kind of finding.
const MAX_NAMED: i64 = 20;

/// See the module docs.
pub(super) fn webhooks(
    conn: &Connection,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    let lost = query_rows(
        conn,
        &format!(
            "SELECT w.turn_id, 'its message is neither queued nor in the history' \
             FROM webhook_subscriptions w WHERE w.timeline_id IS NULL \
               AND NOT EXISTS (SELECT 1 FROM queued_inputs q WHERE q.turn_id = w.turn_id) \
             UNION ALL \
             SELECT w.turn_id, 'its message was answered, but no delivery was made' \
             FROM webhook_subscriptions w JOIN messages m \
               ON m.timeline_id = w.timeline_id AND m.seq = w.input_seq \
             WHERE m.input_state = 'answered' AND w.used_at IS NULL ORDER BY 1 LIMIT {MAX_NAMED}"
        ),
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
    )?;
    for (turn, why) in lost {
        report.push(
            Invariant::Webhooks,
            false,
            format!("turn {turn}: a webhook subscription that will never be sent: {why}"),
        );
    }
    let bad = query_rows(
        conn,
        &format!(
            "SELECT id, CASE WHEN NOT json_valid(body) THEN 'its body is not JSON' \
                        ELSE 'it is ' || status || ' without an attempt' END \
             FROM webhook_deliveries \
             WHERE NOT json_valid(body) OR (status <> 'pending' AND attempts = 0) \
             ORDER BY seq LIMIT {MAX_NAMED}"
        ),
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
    )?;
    for (id, why) in bad {
        report.push(
            Invariant::Webhooks,
            false,
            format!("webhook delivery {id}: {why}"),
        );
    }
    Ok(())
}
