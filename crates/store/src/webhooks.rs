//! The webhook outbox: subscriptions a send names (committed with its
//! queued input, bound to the input's seq when its turn opens) and the
//! deliveries the commit answering that input creates in its own
//! transaction — one per subscription and one per server-wide URL
//! ([`crate::Store::set_webhook_urls`]). The gateway's worker POSTs due rows
//! ([`Backend::due_webhook_deliveries`](crate::Backend::due_webhook_deliveries)) and records each attempt
//! ([`Backend::record_webhook_attempt`](crate::Backend::record_webhook_attempt)); a row's `id` is stable, so a
//! receiver deduplicates redeliveries by it.

use keel_core::{Message, Role, SessionId, TurnId};
use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use crate::error::{Result, StoreError};
use crate::SqliteStore;

/// The server-wide webhook URLs and the wake-up of the delivery worker:
/// process state every backend reads in the transactions that create
/// deliveries, and wakes after they commit.
#[derive(Debug, Default)]
pub struct WebhookHooks {
    urls: parking_lot::RwLock<Vec<String>>,
    committed: tokio::sync::Notify,
}

impl WebhookHooks {
    /// Sets the server-wide URLs.
    pub fn set_urls(&self, urls: Vec<String>) {
        *self.urls.write() = urls;
    }

    /// The server-wide URLs, as set now.
    pub fn urls(&self) -> Vec<String> {
        self.urls.read().clone()
    }

    /// Wakes [`WebhookHooks::committed`]'s waiter (a delivery may have been committed).
    pub fn wake(&self) {
        self.committed.notify_one();
    }

    /// Resolves once deliveries were committed since the last wait (a permit
    /// is kept, so a commit between two waits is not missed).
    pub async fn committed(&self) {
        self.committed.notified().await;
    }
}

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Not delivered yet; another attempt is due at `next_attempt_at_ms`.
    Pending,
    /// A 2xx answered an attempt.
    Delivered,
    /// Every attempt failed; no more are made.
    Dead,
}

impl DeliveryStatus {
    /// The stored word.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Delivered => "delivered",
            Self::Dead => "dead",
        }
    }

    /// Parses the stored word; anything else is corruption.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "pending" => Self::Pending,
            "delivered" => Self::Delivered,
            "dead" => Self::Dead,
            other => return Err(StoreError::corrupt("webhook_deliveries.status", other)),
        })
    }
}

/// One row of the outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookDelivery {
    /// Order of creation (the list cursor).
    pub seq: i64,
    /// The delivery id (`webhook-id`), stable across attempts.
    pub id: String,
    /// Where it is POSTed.
    pub url: String,
    /// The event (`turn.completed`, `run.completed`).
    pub event: String,
    /// The dialog.
    pub session_id: SessionId,
    /// The turn (of a turn event, or the one that started the run).
    pub turn_id: Option<TurnId>,
    /// The run, for a run event.
    pub run_id: Option<keel_core::RunId>,
    /// The JSON body, rendered once.
    pub body: String,
    /// Where it stands.
    pub status: DeliveryStatus,
    /// Attempts made.
    pub attempts: u32,
    /// When the next attempt is due (ms), while pending.
    pub next_attempt_at_ms: Option<i64>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When it was created (ms).
    pub created_at_ms: i64,
    /// When a 2xx answered (ms).
    pub delivered_at_ms: Option<i64>,
}

/// The body of a `turn.completed` delivery.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnCompletedBody {
    /// Always `turn.completed`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// When the turn committed (ms since the epoch).
    pub timestamp_ms: i64,
    /// The turn's final state.
    pub data: TurnCompletedData,
}

/// What a `turn.completed` body says of the turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnCompletedData {
    /// The dialog.
    pub dialog_id: String,
    /// The turn (null when the commit named none).
    pub turn_id: Option<String>,
    /// `committed`, or `unanswered`: the turn failed, was stopped or was
    /// cut off by a crash (its message stays, unanswered; `answer` is empty).
    pub status: &'static str,
    /// The seq of the answer's last message in the dialog's history.
    pub last_seq: Option<i64>,
    /// The answer's text (its last assistant message).
    pub answer: String,
}

/// The outcome of one attempt ([`Backend::record_webhook_attempt`](crate::Backend::record_webhook_attempt)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// A 2xx answered.
    Delivered,
    /// It failed; retry at `retry_at_ms`, or dead-letter when `attempts`
    /// reaches `max_attempts`.
    Failed {
        /// Why (kept as `last_error`).
        error: String,
        /// When the next attempt is due (ms).
        retry_at_ms: i64,
        /// Attempts after which the row is dead.
        max_attempts: u32,
    },
}

const COLUMNS: &str = "seq, id, url, event, session_id, turn_id, body, status, attempts, \
                       next_attempt_at, last_error, created_at, delivered_at, run_id";

fn delivery_from_row(r: &rusqlite::Row<'_>) -> Result<WebhookDelivery> {
    let status: String = r.get(7)?;
    let turn: Option<String> = r.get(5)?;
    Ok(WebhookDelivery {
        seq: r.get(0)?,
        id: r.get(1)?,
        url: r.get(2)?,
        event: r.get(3)?,
        session_id: crate::util::parse("webhook_deliveries.session_id", &r.get::<_, String>(4)?)?,
        turn_id: crate::util::parse_opt("webhook_deliveries.turn_id", turn)?,
        body: r.get(6)?,
        status: DeliveryStatus::parse(&status)?,
        attempts: u32::try_from(r.get::<_, i64>(8)?)
            .map_err(|e| StoreError::corrupt("webhook_deliveries.attempts", e))?,
        next_attempt_at_ms: r.get(9)?,
        last_error: r.get(10)?,
        created_at_ms: r.get(11)?,
        delivered_at_ms: r.get(12)?,
        run_id: crate::util::parse_opt("webhook_deliveries.run_id", r.get(13)?)?,
    })
}

/// Commits the subscription of a queued input's turn.
pub(crate) fn subscribe_tx(
    conn: &Connection,
    turn: &TurnId,
    session: &SessionId,
    url: &str,
    now_ms: i64,
) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO webhook_subscriptions (turn_id, session_id, url, created_at) \
         VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![turn.to_string(), session.to_string(), url, now_ms])?;
    Ok(())
}

/// Drops the subscription of a turn whose queued input was withdrawn.
pub(crate) fn unsubscribe_tx(conn: &Connection, turn: &TurnId) -> Result<()> {
    conn.prepare_cached("DELETE FROM webhook_subscriptions WHERE turn_id = ?1")?
        .execute([turn.to_string()])?;
    Ok(())
}

/// Binds a turn's subscription (if any) to its input's seq as the turn opens.
pub(crate) fn bind_tx(conn: &Connection, turn: &TurnId, timeline: &str, seq: i64) -> Result<()> {
    conn.prepare_cached(
        "UPDATE webhook_subscriptions SET timeline_id = ?2, input_seq = ?3 \
         WHERE turn_id = ?1 AND timeline_id IS NULL",
    )?
    .execute(params![turn.to_string(), timeline, seq])?;
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
    pub messages: &'a [crate::NewMessage],
    pub last_seq: Option<i64>,
    pub now_ms: i64,
}

/// Creates, in the commit's transaction, the deliveries of a committed
/// turn: one per subscription of an input it answers (marked used: it now
/// stands for the turn's background runs) and one per server-wide URL.
/// Returns how many.
pub(crate) fn deliveries_tx(
    conn: &Connection,
    turn: &CommittedTurn<'_>,
    global: &[String],
) -> Result<usize> {
    let mut targets: Vec<(Option<TurnId>, String)> = Vec::new();
    {
        let mut find = conn.prepare_cached(
            "UPDATE webhook_subscriptions SET used_at = ?3 \
             WHERE timeline_id = ?1 AND input_seq = ?2 AND used_at IS NULL \
             RETURNING turn_id, url",
        )?;
        for seq in turn.answers {
            let found: Option<(String, String)> = find
                .query_row(params![turn.timeline, seq, turn.now_ms], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .optional()?;
            if let Some((id, url)) = found {
                let id = crate::util::parse("webhook_subscriptions.turn_id", &id)?;
                targets.push((Some(id), url));
            }
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
    let mut insert = conn.prepare_cached(
        "INSERT INTO webhook_deliveries (id, url, event, session_id, turn_id, body, status, \
         next_attempt_at, created_at) VALUES (?1, ?2, 'turn.completed', ?3, ?4, ?5, 'pending', ?6, ?6)",
    )?;
    for (target_turn, url) in &targets {
        let body = TurnCompletedBody {
            kind: "turn.completed",
            timestamp_ms: turn.now_ms,
            data: TurnCompletedData {
                dialog_id: turn.session.to_string(),
                turn_id: target_turn.map(|t| t.to_string()),
                status: turn.status,
                last_seq: turn.last_seq,
                answer: answer.clone(),
            },
        };
        let body = serde_json::to_string(&body)
            .map_err(|e| StoreError::InvalidInput(format!("webhook body: {e}")))?;
        insert.execute(params![
            format!("msg_{}", uuid::Uuid::now_v7().simple()),
            url,
            turn.session.to_string(),
            target_turn.map(|t| t.to_string()),
            body,
            turn.now_ms
        ])?;
    }
    Ok(targets.len())
}

/// Creates, in the transaction that marks input `seq` of `timeline`
/// unanswered (its turn failed, was stopped or was cut off by a crash), the
/// deliveries saying so: to the send's webhook and to every server-wide URL.
pub(crate) fn unanswered_deliveries_tx(
    conn: &Connection,
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
    deliveries_tx(conn, &turn, global)
}

/// The body of a `run.completed` delivery.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunCompletedBody {
    /// Always `run.completed`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// When the run ended (ms since the epoch).
    pub timestamp_ms: i64,
    /// The run's final state.
    pub data: RunCompletedData,
}

/// What a `run.completed` body says of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunCompletedData {
    /// The run.
    pub run_id: String,
    /// The agent that ran.
    pub agent: String,
    /// The dialog whose turn started it.
    pub dialog_id: String,
    /// The root turn that started it (whose send may have named the webhook).
    pub turn_id: Option<String>,
    /// How it ended (`completed`, `failed`, `timed_out`, `cancelled`, …).
    pub status: String,
    /// Its result, when it completed.
    pub result: Option<String>,
    /// Why it did not complete.
    pub error: Option<String>,
}

/// Creates, in a background run's terminal transaction, a delivery to the
/// webhook the send of its root turn named (if any) and one per server-wide
/// URL. Returns how many.
pub(crate) fn run_deliveries_tx(
    conn: &Connection,
    run: &crate::RunRecord,
    status: &str,
    result: Option<&str>,
    error: Option<&str>,
    now_ms: i64,
    global: &[String],
) -> Result<usize> {
    if run.spec.mode != keel_core::ExecutionMode::Background {
        return Ok(0);
    }
    let turn = run.spec.root_turn_id;
    let subscribed: Option<String> = match turn {
        Some(turn) => conn
            .prepare_cached("SELECT url FROM webhook_subscriptions WHERE turn_id = ?1")?
            .query_row([turn.to_string()], |r| r.get(0))
            .optional()?,
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
    let body = RunCompletedBody {
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
    };
    let body = serde_json::to_string(&body)
        .map_err(|e| StoreError::InvalidInput(format!("webhook body: {e}")))?;
    let mut insert = conn.prepare_cached(
        "INSERT INTO webhook_deliveries (id, url, event, session_id, turn_id, run_id, body, \
         status, next_attempt_at, created_at) \
         VALUES (?1, ?2, 'run.completed', ?3, ?4, ?5, ?6, 'pending', ?7, ?7)",
    )?;
    for url in &urls {
        insert.execute(params![
            format!("msg_{}", uuid::Uuid::now_v7().simple()),
            url,
            run.spec.root_session_id.to_string(),
            turn.map(|t| t.to_string()),
            run.spec.id.to_string(),
            body,
            now_ms
        ])?;
    }
    Ok(urls.len())
}

impl SqliteStore {
    pub(crate) fn webhook_urls(&self) -> Vec<String> {
        self.hooks.urls()
    }

    /// Wakes [`Store::webhook_committed`]'s waiter (a delivery may have been committed).
    pub(crate) fn wake_webhooks(&self) {
        self.hooks.wake();
    }

    pub(crate) async fn due_webhook_deliveries(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> Result<Vec<WebhookDelivery>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.db
            .read(move |c| {
                let sql = format!(
                    "SELECT {COLUMNS} FROM webhook_deliveries INDEXED BY idx_webhook_deliveries_due \
                     WHERE status = 'pending' AND next_attempt_at <= ?1 \
                     ORDER BY next_attempt_at, seq LIMIT ?2"
                );
                let mut stmt = c.prepare_cached(&sql)?;
                let mut rows = stmt.query(params![now_ms, limit])?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    out.push(delivery_from_row(r)?);
                }
                Ok(out)
            })
            .await
    }

    pub(crate) async fn next_webhook_due(&self) -> Result<Option<i64>> {
        self.db
            .read(|c| {
                Ok(c.query_row(
                    "SELECT MIN(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .await
    }

    pub(crate) async fn record_webhook_attempt(
        &self,
        id: String,
        outcome: AttemptOutcome,
        now_ms: i64,
    ) -> Result<Option<DeliveryStatus>> {
        self.db
            .write(move |c| {
                let attempts: Option<i64> = c
                    .query_row(
                        "SELECT attempts FROM webhook_deliveries WHERE id = ?1 AND status = 'pending'",
                        [&id],
                        |r| r.get(0),
                    )
                    .optional()?;
                let Some(attempts) = attempts else {
                    return Ok(None);
                };
                let attempts = attempts + 1;
                let status = match &outcome {
                    AttemptOutcome::Delivered => {
                        c.execute(
                            "UPDATE webhook_deliveries SET status = 'delivered', attempts = ?2, \
                             next_attempt_at = NULL, delivered_at = ?3 WHERE id = ?1",
                            params![id, attempts, now_ms],
                        )?;
                        DeliveryStatus::Delivered
                    }
                    AttemptOutcome::Failed {
                        error,
                        retry_at_ms,
                        max_attempts,
                    } => {
                        let dead = attempts >= i64::from(*max_attempts);
                        c.execute(
                            "UPDATE webhook_deliveries SET status = ?2, attempts = ?3, \
                             next_attempt_at = ?4, last_error = ?5 WHERE id = ?1",
                            params![
                                id,
                                if dead { "dead" } else { "pending" },
                                attempts,
                                if dead { None } else { Some(*retry_at_ms) },
                                error
                            ],
                        )?;
                        if dead {
                            DeliveryStatus::Dead
                        } else {
                            DeliveryStatus::Pending
                        }
                    }
                };
                Ok(Some(status))
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
        self.db
            .read(move |c| {
                let sql = format!(
                    "SELECT {COLUMNS} FROM webhook_deliveries \
                     WHERE seq > ?1 AND (?2 IS NULL OR status = ?2) ORDER BY seq LIMIT ?3"
                );
                let mut stmt = c.prepare_cached(&sql)?;
                let mut rows = stmt.query(params![
                    cursor.unwrap_or(0),
                    status.map(DeliveryStatus::as_str),
                    limit
                ])?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    out.push(delivery_from_row(r)?);
                }
                Ok(out)
            })
            .await
    }
}
