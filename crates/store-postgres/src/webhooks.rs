//! The webhook outbox on PostgreSQL: subscriptions a send names, the
//! deliveries the commit answering its input (or ending a background run)
//! creates in its own transaction, and the worker's reads and attempts
//! (keel-store's `webhooks.rs`, the same rows and rules).
//!
//! A delivery's `seq` is an identity column: like SQLite's AUTOINCREMENT it
//! is never reused, but it is taken when the row is inserted, not when its
//! transaction commits, so a retried transaction leaves a gap and two
//! concurrent commits may become visible out of `seq` order.

use keel_core::{ExecutionMode, Message, Role, SessionId, TurnId};
use keel_store::{
    AttemptOutcome, DeliveryStatus, NewMessage, Result, RunCompletedBody, RunCompletedData,
    RunRecord, StoreError, TurnCompletedBody, TurnCompletedData, WebhookDelivery,
};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::store::Tx;

use crate::store::from_pg;
use crate::util::{parse, parse_opt};
use crate::PgStore;

/// How long a delivery handed to a process's worker is not due for
/// another (longer than an attempt's timeout).
const ATTEMPT_CLAIM_MS: i64 = 60_000;

const COLUMNS: &str = "seq, id, url, event, session_id, turn_id, body, status, attempts, \
                       next_attempt_at, last_error, created_at, delivered_at, run_id";

fn delivery_from_row(r: &Row) -> Result<WebhookDelivery> {
    let session: String = r.get(4);
    let status: String = r.get(7);
    Ok(WebhookDelivery {
        seq: r.get(0),
        id: r.get(1),
        url: r.get(2),
        event: r.get(3),
        session_id: parse("webhook_deliveries.session_id", &session)?,
        turn_id: parse_opt("webhook_deliveries.turn_id", r.get(5))?,
        body: r.get(6),
        status: DeliveryStatus::parse(&status)?,
        attempts: u32::try_from(r.get::<_, i64>(8))
            .map_err(|e| StoreError::corrupt("webhook_deliveries.attempts", e))?,
        next_attempt_at_ms: r.get(9),
        last_error: r.get(10),
        created_at_ms: r.get(11),
        delivered_at_ms: r.get(12),
        run_id: parse_opt("webhook_deliveries.run_id", r.get(13))?,
    })
}

async fn query_deliveries(
    tx: &Tx<'_>,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<WebhookDelivery>> {
    tx.query(sql, params)
        .await
        .map_err(from_pg)?
        .iter()
        .map(delivery_from_row)
        .collect()
}

/// A fresh delivery id (`webhook-id`): drawn inside the transaction, so a
/// retried attempt draws another and only the committed one is ever seen.
fn delivery_id() -> String {
    format!("msg_{}", uuid::Uuid::now_v7().simple())
}

fn render<T: serde::Serialize>(body: &T) -> Result<String> {
    serde_json::to_string(body).map_err(|e| StoreError::InvalidInput(format!("webhook body: {e}")))
}

/// Drops the subscription of a turn whose queued input was withdrawn.
pub(crate) async fn unsubscribe_tx(tx: &Tx<'_>, turn: &TurnId) -> Result<()> {
    tx.execute(
        "DELETE FROM webhook_subscriptions WHERE turn_id = $1",
        &[&turn.to_string()],
    )
    .await
    .map_err(from_pg)?;
    Ok(())
}

/// What the end of a turn tells [`deliveries_tx`].
pub(crate) struct CommittedTurn<'a> {
    /// `committed`, or `unanswered` ([`unanswered_deliveries_tx`]).
    pub status: &'static str,
    pub session: &'a SessionId,
    pub timeline: &'a str,
    pub answers: &'a [i64],
    pub turn_id: Option<TurnId>,
    pub messages: &'a [NewMessage],
    pub last_seq: Option<i64>,
    pub now_ms: i64,
}

/// Creates, in the commit's transaction, the deliveries of a committed
/// turn: one per subscription of an input it answers (marked used: it now
/// stands for the turn's background runs) and one per server-wide URL.
/// Returns how many.
pub(crate) async fn deliveries_tx(
    tx: &Tx<'_>,
    turn: &CommittedTurn<'_>,
    global: &[String],
) -> Result<usize> {
    let mut targets: Vec<(Option<TurnId>, String)> = Vec::new();
    for seq in turn.answers {
        // Every subscription of the input is used up; the first one names
        // the delivery, as SQLite's first RETURNING row does.
        let found = tx
            .query(
                "UPDATE webhook_subscriptions SET used_at = $3 \
                 WHERE timeline_id = $1 AND input_seq = $2 AND used_at IS NULL \
                 RETURNING turn_id, url",
                &[&turn.timeline, seq, &turn.now_ms],
            )
            .await
            .map_err(from_pg)?;
        if let Some(row) = found.first() {
            let id: String = row.get(0);
            let id = parse("webhook_subscriptions.turn_id", &id)?;
            targets.push((Some(id), row.get(1)));
        }
    }
    let subscribed_turn = targets.first().and_then(|(t, _)| *t);
    let turn_id = turn.turn_id.or(subscribed_turn);
    if !turn.answers.is_empty() {
        targets.extend(global.iter().map(|u| (turn_id, u.clone())));
    }
    if targets.is_empty() {
        return Ok(0);
    }
    let answer = turn
        .messages
        .iter()
        .rev()
        .find(|m| m.message.role == Role::Assistant)
        .map(|m| Message::text(&m.message))
        .unwrap_or_default();
    let insert =
        "INSERT INTO webhook_deliveries (id, url, event, session_id, turn_id, body, status, \
             next_attempt_at, created_at) \
             VALUES ($1, $2, 'turn.completed', $3, $4, $5, 'pending', $6, $6)";
    let session = turn.session.to_string();
    for (target_turn, url) in &targets {
        let body = render(&TurnCompletedBody {
            kind: "turn.completed",
            timestamp_ms: turn.now_ms,
            data: TurnCompletedData {
                dialog_id: session.clone(),
                turn_id: target_turn.map(|t| t.to_string()),
                status: turn.status,
                last_seq: turn.last_seq,
                answer: answer.clone(),
            },
        })?;
        tx.execute(
            insert,
            &[
                &delivery_id(),
                url,
                &session,
                &target_turn.map(|t| t.to_string()),
                &body,
                &turn.now_ms,
            ],
        )
        .await
        .map_err(from_pg)?;
    }
    Ok(targets.len())
}

/// Creates, in the transaction that marks input `seq` of `timeline`
/// unanswered (its turn failed, was stopped or was cut off by a crash), the
/// deliveries saying so: to the send's webhook and to every server-wide URL.
pub(crate) async fn unanswered_deliveries_tx(
    tx: &Tx<'_>,
    session: &SessionId,
    timeline: &str,
    seq: i64,
    now_ms: i64,
    global: &[String],
) -> Result<usize> {
    let turn = CommittedTurn {
        status: "unanswered",
        session,
        timeline,
        answers: &[seq],
        turn_id: None,
        messages: &[],
        last_seq: None,
        now_ms,
    };
    deliveries_tx(tx, &turn, global).await
}

/// Creates, in a background run's terminal transaction, a delivery to the
/// webhook the send of its root turn named (if any) and one per server-wide
/// URL. Returns how many.
pub(crate) async fn run_deliveries_tx(
    tx: &Tx<'_>,
    run: &RunRecord,
    status: &str,
    result: Option<&str>,
    error: Option<&str>,
    now_ms: i64,
    global: &[String],
) -> Result<usize> {
    if run.spec.mode != ExecutionMode::Background {
        return Ok(0);
    }
    let turn = run.spec.root_turn_id;
    let subscribed: Option<String> = match turn {
        Some(turn) => tx
            .query_opt(
                "SELECT url FROM webhook_subscriptions WHERE turn_id = $1",
                &[&turn.to_string()],
            )
            .await
            .map_err(from_pg)?
            .map(|r| r.get(0)),
        None => None,
    };
    let urls: Vec<&str> = subscribed
        .as_deref()
        .into_iter()
        .chain(global.iter().map(String::as_str))
        .collect();
    if urls.is_empty() {
        return Ok(0);
    }
    let body = render(&RunCompletedBody {
        kind: "run.completed",
        timestamp_ms: now_ms,
        data: RunCompletedData {
            run_id: run.spec.id.to_string(),
            agent: run.spec.agent_id.as_str().to_owned(),
            dialog_id: run.spec.root_session_id.to_string(),
            turn_id: turn.map(|t| t.to_string()),
            status: status.to_owned(),
            result: result.map(str::to_owned),
            error: error.map(str::to_owned),
        },
    })?;
    let insert =
        "INSERT INTO webhook_deliveries (id, url, event, session_id, turn_id, run_id, body, \
             status, next_attempt_at, created_at) \
             VALUES ($1, $2, 'run.completed', $3, $4, $5, $6, 'pending', $7, $7)";
    let (session, turn, run_id) = (
        run.spec.root_session_id.to_string(),
        turn.map(|t| t.to_string()),
        run.spec.id.to_string(),
    );
    for url in &urls {
        tx.execute(
            insert,
            &[
                &delivery_id(),
                url,
                &session,
                &turn,
                &run_id,
                &body,
                &now_ms,
            ],
        )
        .await
        .map_err(from_pg)?;
    }
    Ok(urls.len())
}

impl PgStore {
    pub(crate) async fn due_webhook_deliveries(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        if self.fence() == 0 {
            // Not a runtime: nothing delivers, nothing is claimed.
            return self
                .read(move |tx| {
                    Box::pin(async move {
                        let sql = format!(
                            "SELECT {COLUMNS} FROM webhook_deliveries \
                             WHERE status = 'pending' AND next_attempt_at <= $1 \
                             ORDER BY next_attempt_at, seq LIMIT $2"
                        );
                        query_deliveries(tx, &sql, &[&now_ms, &limit]).await
                    })
                })
                .await;
        }
        // Several processes deliver from one outbox: the rows handed out
        // are claimed (not due again for a while), so no other process
        // posts them meanwhile. The attempt's record sets their real next
        // time; a claimer that dies leaves them due again after the claim.
        let until = now_ms.saturating_add(ATTEMPT_CLAIM_MS);
        self.write(move |tx| {
            Box::pin(async move {
                let sql = format!(
                    "WITH due AS (SELECT seq FROM webhook_deliveries \
                       WHERE status = 'pending' AND next_attempt_at <= $1 \
                       ORDER BY next_attempt_at, seq LIMIT $2 FOR UPDATE SKIP LOCKED), \
                     claimed AS (UPDATE webhook_deliveries w SET next_attempt_at = $3 \
                       FROM due WHERE w.seq = due.seq RETURNING w.seq) \
                     SELECT {COLUMNS} FROM webhook_deliveries \
                     WHERE seq IN (SELECT seq FROM claimed) ORDER BY next_attempt_at, seq"
                );
                query_deliveries(tx, &sql, &[&now_ms, &limit, &until]).await
            })
        })
        .await
    }

    pub(crate) async fn next_webhook_due(&self) -> Result<Option<i64>> {
        self.read(|tx| {
            Box::pin(async move {
                Ok(tx
                    .query_one(
                        "SELECT min(next_attempt_at) FROM webhook_deliveries \
                         WHERE status = 'pending'",
                        &[],
                    )
                    .await
                    .map_err(from_pg)?
                    .get(0))
            })
        })
        .await
    }

    pub(crate) async fn record_webhook_attempt(
        &self,
        id: String,
        outcome: AttemptOutcome,
        now_ms: i64,
    ) -> Result<Option<DeliveryStatus>> {
        self.write(move |tx| {
            let (id, outcome) = (id.clone(), outcome.clone());
            Box::pin(async move {
                let attempts: Option<i64> = tx
                    .query_opt(
                        "SELECT attempts FROM webhook_deliveries \
                         WHERE id = $1 AND status = 'pending'",
                        &[&id],
                    )
                    .await
                    .map_err(from_pg)?
                    .map(|r| r.get(0));
                let Some(attempts) = attempts else {
                    return Ok(None);
                };
                let attempts = attempts + 1;
                let status = match &outcome {
                    AttemptOutcome::Delivered => {
                        tx.execute(
                            "UPDATE webhook_deliveries SET status = 'delivered', attempts = $2, \
                             next_attempt_at = NULL, delivered_at = $3 WHERE id = $1",
                            &[&id, &attempts, &now_ms],
                        )
                        .await
                        .map_err(from_pg)?;
                        DeliveryStatus::Delivered
                    }
                    AttemptOutcome::Failed {
                        error,
                        retry_at_ms,
                        max_attempts,
                    } => {
                        let dead = attempts >= i64::from(*max_attempts);
                        let status = if dead {
                            DeliveryStatus::Dead
                        } else {
                            DeliveryStatus::Pending
                        };
                        let next = if dead { None } else { Some(*retry_at_ms) };
                        tx.execute(
                            "UPDATE webhook_deliveries SET status = $2, attempts = $3, \
                             next_attempt_at = $4, last_error = $5 WHERE id = $1",
                            &[&id, &status.as_str(), &attempts, &next, error],
                        )
                        .await
                        .map_err(from_pg)?;
                        status
                    }
                };
                Ok(Some(status))
            })
        })
        .await
    }

    pub(crate) async fn list_webhook_deliveries(
        &self,
        status: Option<DeliveryStatus>,
        cursor: Option<i64>,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read(move |tx| {
            Box::pin(async move {
                let sql = format!(
                    "SELECT {COLUMNS} FROM webhook_deliveries \
                     WHERE seq > $1 AND ($2::text IS NULL OR status = $2) ORDER BY seq LIMIT $3"
                );
                query_deliveries(
                    tx,
                    &sql,
                    &[
                        &cursor.unwrap_or(0),
                        &status.map(DeliveryStatus::as_str),
                        &limit,
                    ],
                )
                .await
            })
        })
        .await
    }
}
