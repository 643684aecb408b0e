//! What each dialog spent on model calls (`dialog_spend`): added call by
//! call, never rolled back, so a dialog budget survives rollbacks and
//! restarts.

use keel_core::{SessionId, Usage, Usd};
use rusqlite::{params, OptionalExtension};

use crate::error::{Result, StoreError};
use crate::util::{non_negative, saturating_i64};
use crate::SqliteStore;

/// A dialog's spend so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DialogSpend {
    /// Tokens of every model call of the dialog, its runs' included.
    pub usage: Usage,
    /// Their cost at their profiles' prices (calls of unpriced profiles add 0).
    pub cost: Usd,
    /// Model calls counted.
    pub model_calls: u64,
}

impl SqliteStore {
    pub(crate) async fn add_dialog_spend(
        &self,
        session: SessionId,
        usage: Usage,
        cost: Usd,
        now_ms: i64,
    ) -> Result<DialogSpend> {
        self.db
            .write(move |c| {
                c.prepare_cached(
                    "INSERT INTO dialog_spend \
                     (session_id, prompt_tokens, completion_tokens, cost_usd, model_calls, updated_at) \
                     VALUES (?1, ?2, ?3, ?4, 1, ?5) \
                     ON CONFLICT (session_id) DO UPDATE SET \
                     prompt_tokens = prompt_tokens + excluded.prompt_tokens, \
                     completion_tokens = completion_tokens + excluded.completion_tokens, \
                     cost_usd = cost_usd + excluded.cost_usd, \
                     model_calls = model_calls + 1, updated_at = excluded.updated_at",
                )?
                .execute(params![
                    session.to_string(),
                    saturating_i64(usage.prompt_tokens),
                    saturating_i64(usage.completion_tokens),
                    cost.get(),
                    now_ms
                ])?;
                Ok(read_tx(c, &session)?.unwrap_or_default())
            })
            .await
    }

    pub(crate) async fn dialog_spend(&self, session: SessionId) -> Result<DialogSpend> {
        self.db
            .read(move |c| Ok(read_tx(c, &session)?.unwrap_or_default()))
            .await
    }
}

fn read_tx(c: &rusqlite::Connection, session: &SessionId) -> Result<Option<DialogSpend>> {
    let row = c
        .prepare_cached(
            "SELECT prompt_tokens, completion_tokens, cost_usd, model_calls \
             FROM dialog_spend WHERE session_id = ?1",
        )?
        .query_row([session.to_string()], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, f64>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })
        .optional()?;
    let Some((prompt, completion, cost, calls)) = row else {
        return Ok(None);
    };
    Ok(Some(DialogSpend {
        usage: Usage::new(
            non_negative("dialog_spend.prompt_tokens", prompt)?,
            non_negative("dialog_spend.completion_tokens", completion)?,
        ),
        cost: Usd::new(cost).map_err(|e| StoreError::corrupt("dialog_spend.cost_usd", e))?,
        model_calls: non_negative("dialog_spend.model_calls", calls)?,
    }))
}
