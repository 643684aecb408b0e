//! Queued user input on PostgreSQL: a message acknowledged while its
//! dialog's turn runs, committed before the acknowledgement and moved into
//! the history when its own turn starts (in that turn's `open_turn`
//! transaction); keel-store's `queued.rs` says why.

use keel_core::TurnId;
use keel_store::{QueuedInput, Result, StoreError};

use crate::store::from_pg;
use crate::util::{parse, to_i64};
use crate::PgStore;

/// Queues input `$1` of dialog `$2` (`$3` the message, at `$4`, for
/// generation `$5`) in one fenced statement: the dialog's row locked (as
/// `lock_session` does) and checked live, the input queued unless it is
/// already, and the turn's webhook subscription to `$6`, if any, stored
/// with it. Answers whether the dialog is live (and the fence holds), and
/// whether the input was queued now.
const QUEUE: &str = concat!(
    "WITH ",
    fence_cte!("$5"),
    ", live AS MATERIALIZED (SELECT id FROM sessions WHERE id = $2 AND deleted_at IS NULL AND ",
    fence_holds!("$5"),
    " FOR NO KEY UPDATE), ",
    "queued AS (INSERT INTO queued_inputs (turn_id, session_id, message, queued_at, generation) ",
    "SELECT $1, id, $3, $4, $5 FROM live ON CONFLICT (turn_id) DO NOTHING RETURNING session_id), ",
    "subscribed AS (INSERT INTO webhook_subscriptions (turn_id, session_id, url, created_at) ",
    "SELECT $1, session_id, $6, $4 FROM queued WHERE $6::text IS NOT NULL RETURNING 1) ",
    "SELECT EXISTS (SELECT 1 FROM live), EXISTS (SELECT 1 FROM queued)"
);

impl PgStore {
    pub(crate) async fn queue_input(&self, input: QueuedInput) -> Result<()> {
        let message = serde_json::to_string(&input.message)
            .map_err(|e| StoreError::InvalidInput(format!("message does not serialize: {e}")))?;
        let (session, turn) = (input.session_id, input.turn_id);
        let queued = self
            .write_statement(move |tx, statement| {
                let (input, message) = (input.clone(), message.clone());
                Box::pin(async move {
                    let row = tx
                        .query_one(
                            QUEUE,
                            &[
                                &input.turn_id.to_string(),
                                &input.session_id.to_string(),
                                &message,
                                &input.queued_at_ms,
                                &statement.generation,
                                &input.webhook,
                            ],
                        )
                        .await
                        .map_err(from_pg)?;
                    let (live, queued): (bool, bool) = (row.get(0), row.get(1));
                    if live && !queued && !statement.again {
                        return Err(StoreError::Constraint(format!(
                            "the input of turn {turn} is queued already"
                        )));
                    }
                    // Not queued now after an attempt that may have
                    // committed: that attempt queued it.
                    Ok(live.then_some(()))
                })
            })
            .await?;
        queued.ok_or_else(|| StoreError::NotFound(format!("session {session}")))
    }

    pub(crate) async fn discard_queued_input(&self, turn_id: TurnId) -> Result<bool> {
        self.write(move |tx| {
            Box::pin(async move {
                crate::webhooks::unsubscribe_tx(tx, &turn_id).await?;
                Ok(tx
                    .execute(
                        "DELETE FROM queued_inputs WHERE turn_id = $1",
                        &[&turn_id.to_string()],
                    )
                    .await
                    .map_err(from_pg)?
                    > 0)
            })
        })
        .await
    }

    pub(crate) async fn queued_inputs(&self) -> Result<Vec<QueuedInput>> {
        let me = to_i64("generation", self.fence())?;
        if me == 0 {
            // Not a runtime (a check, a copy): every queued input, unclaimed.
            return self
                .read(|tx| {
                    Box::pin(async move {
                        let rows = tx
                            .query(
                                &format!("{QUEUED} WHERE s.deleted_at IS NULL ORDER BY q.seq"),
                                &[],
                            )
                            .await
                            .map_err(from_pg)?;
                        rows.iter().map(queued_input).collect()
                    })
                })
                .await;
        }
        // Inputs of processes no longer live become this one's, in one
        // transaction, so two processes never both take one.
        self.write(move |tx| {
            Box::pin(async move {
                let rows = tx
                    .query(
                        &format!(
                            "WITH taken AS (UPDATE queued_inputs SET generation = $1 \
                               WHERE generation NOT IN (SELECT generation FROM runtime_processes) \
                                 AND session_id IN (SELECT id FROM sessions WHERE deleted_at IS NULL) \
                               RETURNING seq) \
                             {QUEUED} WHERE q.seq IN (SELECT seq FROM taken) ORDER BY q.seq"
                        ),
                        &[&me],
                    )
                    .await
                    .map_err(from_pg)?;
                rows.iter().map(queued_input).collect()
            })
        })
        .await
    }
}

/// The columns of a [`QueuedInput`], read by [`queued_input`].
const QUEUED: &str = "SELECT q.session_id, q.turn_id, q.message, q.queued_at, w.url \
     FROM queued_inputs q JOIN sessions s ON s.id = q.session_id \
     LEFT JOIN webhook_subscriptions w ON w.turn_id = q.turn_id";

fn queued_input(r: &tokio_postgres::Row) -> Result<QueuedInput> {
    Ok(QueuedInput {
        session_id: parse("queued_inputs.session_id", r.get::<_, &str>(0))?,
        turn_id: parse("queued_inputs.turn_id", r.get::<_, &str>(1))?,
        message: serde_json::from_str(r.get::<_, &str>(2))
            .map_err(|e| StoreError::corrupt("queued_inputs.message", e))?,
        queued_at_ms: r.get(3),
        webhook: r.get(4),
    })
}
