//! What each dialog spent on model calls (`dialog_spend`) on PostgreSQL:
//! added call by call, never rolled back, so a dialog budget survives
//! rollbacks and restarts.

use crate::store::Tx;
use keel_core::{SessionId, Usage, Usd};
use keel_store::{DialogSpend, Result, StoreError};

use crate::store::from_pg;
use crate::util::{non_negative, saturating_i64};
use crate::PgStore;

/// Adds a model call's spend to dialog `$1`'s row (`$2` prompt and `$3`
/// completion tokens, `$4` USD, at `$5`) unless the fence of generation
/// `$6` is gone; answers the dialog's totals (no row: fenced out).
const ADD: &str = concat!(
    "WITH ",
    fence_cte!("$6"),
    " INSERT INTO dialog_spend AS d ",
    "(session_id, prompt_tokens, completion_tokens, cost_usd, model_calls, updated_at) ",
    "SELECT $1, $2, $3, $4, 1, $5 WHERE ",
    fence_holds!("$6"),
    " ON CONFLICT (session_id) DO UPDATE SET ",
    "prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens, ",
    "completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens, ",
    "cost_usd = d.cost_usd + EXCLUDED.cost_usd, ",
    "model_calls = d.model_calls + 1, updated_at = EXCLUDED.updated_at ",
    "RETURNING prompt_tokens, completion_tokens, cost_usd, model_calls"
);

impl PgStore {
    pub(crate) async fn add_dialog_spend(
        &self,
        session: SessionId,
        usage: Usage,
        cost: Usd,
        now_ms: i64,
    ) -> Result<DialogSpend> {
        // One row per dialog, added to in one statement that checks the
        // fence too: no lock to take first.
        self.write_committed_fenced(move |tx, generation| {
            Box::pin(async move {
                let row = tx
                    .query_opt(
                        ADD,
                        &[
                            &session.to_string(),
                            &saturating_i64(usage.prompt_tokens),
                            &saturating_i64(usage.completion_tokens),
                            &cost.get(),
                            &now_ms,
                            &generation,
                        ],
                    )
                    .await
                    .map_err(from_pg)?;
                match row {
                    Some(row) => spend_from_row(&row),
                    None => Err(StoreError::TakenOver {
                        generation: non_negative("generation", generation)?,
                    }),
                }
            })
        })
        .await
    }

    pub(crate) async fn dialog_spend(&self, session: SessionId) -> Result<DialogSpend> {
        self.read(move |tx| {
            Box::pin(async move { Ok(read_tx(tx, &session).await?.unwrap_or_default()) })
        })
        .await
    }
}

async fn read_tx(tx: &Tx<'_>, session: &SessionId) -> Result<Option<DialogSpend>> {
    let Some(r) = tx
        .query_opt(
            "SELECT prompt_tokens, completion_tokens, cost_usd, model_calls \
             FROM dialog_spend WHERE session_id = $1",
            &[&session.to_string()],
        )
        .await
        .map_err(from_pg)?
    else {
        return Ok(None);
    };
    spend_from_row(&r).map(Some)
}

/// A `dialog_spend` row read as (prompt_tokens, completion_tokens,
/// cost_usd, model_calls).
fn spend_from_row(r: &tokio_postgres::Row) -> Result<DialogSpend> {
    Ok(DialogSpend {
        usage: Usage::new(
            non_negative("dialog_spend.prompt_tokens", r.get(0))?,
            non_negative("dialog_spend.completion_tokens", r.get(1))?,
        ),
        cost: Usd::new(r.get(2)).map_err(|e| StoreError::corrupt("dialog_spend.cost_usd", e))?,
        model_calls: non_negative("dialog_spend.model_calls", r.get(3))?,
    })
}
