//! The runtime generation: activation bumps it and recovers what older
//! generations left; every write of an activated store checks it first.

use keel_store::{Result, StoreError};
use tokio_postgres::Transaction;

use crate::store::from_pg;
use crate::util::non_negative;

/// The stored generation and its holder.
pub(crate) async fn current(tx: &Transaction<'_>) -> Result<Option<(u64, String)>> {
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
pub(crate) async fn check_fence(tx: &Transaction<'_>, ours: u64) -> Result<()> {
    match current(tx).await? {
        Some((current, holder)) if current != ours => Err(StoreError::Fenced {
            ours,
            current,
            holder,
        }),
        _ => Ok(()),
    }
}

impl crate::PgStore {
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
