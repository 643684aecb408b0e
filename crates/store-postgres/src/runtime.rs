//! The runtime generation: activation bumps it and recovers what older
//! generations left; every write of an activated store checks it first.

use crate::store::Tx;
use keel_store::{Activation, Result, StoreError};

use crate::runs::recover_tx;
use crate::store::from_pg;
use crate::util::{non_negative, parse, to_i64};

/// The stored generation and its holder.
pub(crate) async fn current(tx: &Tx<'_>) -> Result<Option<(u64, String)>> {
    let row = tx
        .query_opt(
            "SELECT generation, holder FROM runtime_state WHERE id = 1",
            &[],
        )
        .await
        .map_err(from_pg)?;
    row.map(|r| {
        Ok((
            non_negative("runtime_state.generation", r.get(0))?,
            r.get(1),
        ))
    })
    .transpose()
}

/// Refuses a write of generation `ours` once a newer one activated.
pub(crate) async fn check_fence(tx: &Tx<'_>, ours: u64) -> Result<()> {
    match current(tx).await? {
        Some((current, holder)) if current != ours => Err(StoreError::Fenced {
            ours,
            current,
            holder,
        }),
        _ => Ok(()),
    }
}

async fn activate_tx(
    tx: &Tx<'_>,
    holder: &str,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<Activation> {
    let previous = current(tx).await?;
    // Runs stamped by builds that used wall-clock generations stay older.
    let stamped: i64 = tx
        .query_one(
            "SELECT GREATEST(coalesce((SELECT max(runtime_generation) FROM agent_runs), 0), \
                             coalesce((SELECT max(runtime_generation) FROM agent_run_groups), 0))",
            &[],
        )
        .await
        .map_err(from_pg)?
        .get(0);
    let stored = previous.as_ref().map_or(0, |(g, _)| *g);
    let generation = stored
        .max(non_negative("agent_runs.runtime_generation", stamped)?)
        .checked_add(1)
        .ok_or_else(|| StoreError::corrupt("runtime_state.generation", "overflow"))?;
    tx.execute(
        "INSERT INTO runtime_state (id, generation, holder, activated_at) VALUES (1, $1, $2, $3) \
         ON CONFLICT (id) DO UPDATE SET generation = EXCLUDED.generation, \
         holder = EXCLUDED.holder, activated_at = EXCLUDED.activated_at",
        &[&to_i64("generation", generation)?, &holder, &now_ms],
    )
    .await
    .map_err(from_pg)?;
    // The lock says no other process runs: every lease was held by a
    // process that is gone, expired or not.
    let mut recovery = recover_tx(tx, generation, now_ms, true, webhook_urls).await?;
    // Turn inputs an older process committed but never answered. Only here,
    // where no turn of this process runs yet, may every open input be closed.
    let closed = tx
        .query(crate::messages::CLOSE_INTERRUPTED_SQL, &[])
        .await
        .map_err(from_pg)?;
    for row in &closed {
        let session = parse("messages.session_id", row.get::<_, &str>(0))?;
        let timeline: &str = row.get(1);
        crate::webhooks::unanswered_deliveries_tx(
            tx,
            &session,
            timeline,
            row.get(2),
            now_ms,
            webhook_urls,
        )
        .await?;
    }
    recovery.unanswered_inputs = closed.len() as u64;
    Ok(Activation {
        generation,
        previous_holder: previous.map(|(_, h)| h),
        recovery,
    })
}

impl crate::PgStore {
    pub(crate) async fn activate_runtime(&self, holder: String, now_ms: i64) -> Result<Activation> {
        let urls = self.inner.hooks.urls();
        let activation = self
            .write(move |tx| {
                let (holder, urls) = (holder.clone(), urls.clone());
                Box::pin(async move { activate_tx(tx, &holder, now_ms, &urls).await })
            })
            .await?;
        self.set_fence(activation.generation);
        Ok(activation)
    }

    /// The stored runtime generation and its holder (`None` before any activation).
    pub(crate) async fn runtime_generation(&self) -> Result<Option<(u64, String)>> {
        self.read(|tx| Box::pin(current(tx))).await
    }
}

#[cfg(test)]
mod tests {
    fn assert_send<T: Send>(_: &T) {}

    #[allow(dead_code)]
    fn futures_are_send(store: &crate::PgStore) {
        assert_send(&store.runtime_generation());
        let holder = String::from("x");
        assert_send(&store.write(move |tx| {
            let holder = holder.clone();
            Box::pin(async move {
                tx.execute("SELECT $1::text", &[&holder])
                    .await
                    .map_err(crate::store::from_pg)
            })
        }));
    }
}
