//! Queued user input: a message acknowledged while its dialog's turn runs,
//! committed before the acknowledgement and moved into the history when its
//! own turn starts ([`crate::OpenTurn::queued`], in that turn's
//! [`Backend::open_turn`](crate::Backend::open_turn) transaction). Until then it is no part of the
//! history, so replay, rollback and fork never see it; it takes its place
//! after the answer of the turn it waited for. Each row carries the runtime
//! generation that will run it; rows a dead process left are listed by
//! [`Backend::queued_inputs`](crate::Backend::queued_inputs) for the next one to run.

use keel_core::{Message, SessionId, TurnId};
use rusqlite::{params, Connection};

use crate::error::{Result, StoreError};
use crate::sessions::require_session;
use crate::util::parse;
use crate::SqliteStore;

/// A user message acknowledged before its turn started.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuedInput {
    /// The session (dialog) it was sent to.
    pub session_id: SessionId,
    /// The id its turn runs under.
    pub turn_id: TurnId,
    /// The message.
    pub message: Message,
    /// When it was acknowledged (ms).
    pub queued_at_ms: i64,
    /// The URL its turn's commit is delivered to (committed with the input).
    pub webhook: Option<String>,
}

/// Removes the queued input of `turn_id` as its turn opens; an input that is
/// not queued (any more) is refused, so no input enters the history twice.
pub(crate) fn take_queued_tx(conn: &Connection, turn_id: &TurnId) -> Result<()> {
    let n = conn.execute(
        "DELETE FROM queued_inputs WHERE turn_id = ?1",
        [turn_id.to_string()],
    )?;
    if n == 0 {
        return Err(StoreError::Stale(format!(
            "the input of turn {turn_id} is not queued"
        )));
    }
    Ok(())
}

impl SqliteStore {
    pub(crate) async fn queue_input(&self, input: QueuedInput) -> Result<()> {
        let message = serde_json::to_string(&input.message)
            .map_err(|e| StoreError::InvalidInput(format!("message does not serialize: {e}")))?;
        let generation = crate::util::to_i64("generation", self.db.fence())?;
        self.db
            .write(move |c| {
                let session = require_session(c, &input.session_id)?;
                if session.deleted_at_ms.is_some() {
                    return Err(StoreError::NotFound(format!("session {}", session.id)));
                }
                c.prepare_cached(
                    "INSERT INTO queued_inputs (turn_id, session_id, message, queued_at, generation) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?
                .execute(params![
                    input.turn_id.to_string(),
                    input.session_id.to_string(),
                    message,
                    input.queued_at_ms,
                    generation
                ])?;
                if let Some(url) = &input.webhook {
                    crate::webhooks::subscribe_tx(
                        c,
                        &input.turn_id,
                        &input.session_id,
                        url,
                        input.queued_at_ms,
                    )?;
                }
                Ok(())
            })
            .await
    }

    pub(crate) async fn discard_queued_input(&self, turn_id: TurnId) -> Result<bool> {
        self.db
            .write(move |c| {
                crate::webhooks::unsubscribe_tx(c, &turn_id)?;
                Ok(c.execute(
                    "DELETE FROM queued_inputs WHERE turn_id = ?1",
                    [turn_id.to_string()],
                )? > 0)
            })
            .await
    }

    pub(crate) async fn queued_inputs(&self) -> Result<Vec<QueuedInput>> {
        self.db
            .read(|c| {
                let mut stmt = c.prepare_cached(
                    "SELECT q.session_id, q.turn_id, q.message, q.queued_at, w.url \
                     FROM queued_inputs q JOIN sessions s ON s.id = q.session_id \
                     LEFT JOIN webhook_subscriptions w ON w.turn_id = q.turn_id \
                     WHERE s.deleted_at IS NULL ORDER BY q.seq",
                )?;
                let mut rows = stmt.query([])?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    let message: String = r.get(2)?;
                    out.push(QueuedInput {
                        session_id: parse("queued_inputs.session_id", &r.get::<_, String>(0)?)?,
                        turn_id: parse("queued_inputs.turn_id", &r.get::<_, String>(1)?)?,
                        message: serde_json::from_str(&message)
                            .map_err(|e| StoreError::corrupt("queued_inputs.message", e))?,
                        queued_at_ms: r.get(3)?,
                        webhook: r.get(4)?,
                    });
                }
                Ok(out)
            })
            .await
    }
}
