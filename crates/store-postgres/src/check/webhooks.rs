//! The check of the webhook outbox: a subscription waits either for its
//! queued input's turn to open or, bound to the input, for the commit that
//! answers it (which uses it up); a delivery's body is JSON and a
//! delivered or dead row had at least one attempt.

use crate::store::Tx;
use keel_store::{CheckOptions, Invariant, InvariantReport, Result};

use super::{rows, MAX_NAMED};

/// Subscriptions that will never be sent, and delivery rows that cannot be.
pub(super) async fn webhooks(
    tx: &Tx<'_>,
    _: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    // Named in SQLite's (byte) order, whatever the database's collation.
    let lost = rows(
        tx,
        &format!(
            "SELECT w.turn_id COLLATE \"C\", 'its message is neither queued nor in the history' \
             FROM webhook_subscriptions w WHERE w.timeline_id IS NULL \
               AND NOT EXISTS (SELECT 1 FROM queued_inputs q WHERE q.turn_id = w.turn_id) \
             UNION ALL \
             SELECT w.turn_id COLLATE \"C\", 'its message was answered, but no delivery was made' \
             FROM webhook_subscriptions w JOIN messages m \
               ON m.timeline_id = w.timeline_id AND m.seq = w.input_seq \
             WHERE m.input_state = 'answered' AND w.used_at IS NULL ORDER BY 1 LIMIT {MAX_NAMED}"
        ),
    )
    .await?;
    for r in lost {
        let (turn, why): (String, String) = (r.get(0), r.get(1));
        report.push(
            Invariant::Webhooks,
            false,
            format!("turn {turn}: a webhook subscription that will never be sent: {why}"),
        );
    }
    let bad = rows(
        tx,
        &format!(
            "SELECT id, CASE WHEN NOT keel_json_valid(body) THEN 'its body is not JSON' \
                        ELSE 'it is ' || status || ' without an attempt' END \
             FROM webhook_deliveries \
             WHERE NOT keel_json_valid(body) OR (status <> 'pending' AND attempts = 0) \
             ORDER BY seq LIMIT {MAX_NAMED}"
        ),
    )
    .await?;
    for r in bad {
        let (id, why): (String, String) = (r.get(0), r.get(1));
        report.push(
            Invariant::Webhooks,
            false,
            format!("webhook delivery {id}: {why}"),
        );
    }
    Ok(())
}
