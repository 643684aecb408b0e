//! Session leases: a session's turns run under its lease, held by one live
//! process at a time (see `runtime.rs` for the processes). A free lease is
//! taken in one statement that locks the lease row and this process's
//! registration; a lease held elsewhere, or not yet stored, is looked at
//! in a short `READ COMMITTED` transaction that does the same; either joins
//! no serializable conflict. It is given back in one unfenced statement. The lease row
//! stays when freed, remembering its last holder, so a process that takes
//! it learns whether another wrote the session since it last held it.

use keel_core::SessionId;
use keel_store::{Result, SessionLease, StoreError};

use crate::store::from_pg;
use crate::util::to_i64;
use crate::PgStore;

/// Takes the lease of session `$1` for generation `$2` when it is free or
/// already this generation's, fenced; answers the lease's last holder
/// before, or no row.
const TAKE_FREE: &str = concat!(
    "WITH ",
    fence_cte!("$2"),
    ", old AS (SELECT last_generation FROM session_leases ",
    "WHERE session_id = $1 AND (generation IS NULL OR generation = $2) AND ",
    fence_holds!("$2"),
    " FOR UPDATE) ",
    "UPDATE session_leases l SET generation = $2, last_generation = $2, ",
    "acquired_at = (extract(epoch from clock_timestamp()) * 1000)::bigint ",
    "FROM old WHERE l.session_id = $1 RETURNING old.last_generation"
);

impl PgStore {
    pub(crate) async fn lease_session(&self, session: SessionId) -> Result<SessionLease> {
        let me = to_i64("generation", self.fence())?;
        if me == 0 {
            return Err(StoreError::InvalidInput(
                "a session lease needs an activated runtime".to_owned(),
            ));
        }
        // The common case, a lease free or already this process's, in one
        // fenced statement; the row is locked first and checked again once
        // locked.
        let taken = self
            .write_statement(move |tx, statement| {
                Box::pin(async move {
                    let row = tx
                        .query_opt(TAKE_FREE, &[&session.to_string(), &statement.generation])
                        .await
                        .map_err(from_pg)?;
                    // After an attempt that may have taken it, the holder
                    // before is unknown: say moved, so the session is read
                    // again.
                    Ok(row.map(|old| SessionLease::Held {
                        moved: statement.again || old.get::<_, i64>(0) != statement.generation,
                    }))
                })
            })
            .await?;
        if let Some(held) = taken {
            return Ok(held);
        }
        self.write_committed(move |tx| {
            Box::pin(async move {
                let key = session.to_string();
                // Each statement reads the latest commit (READ COMMITTED):
                // a row another process inserts meanwhile is found again.
                loop {
                    // The lease row alone: a row lock waited for re-reads
                    // only this row, so a join here could pair its new holder
                    // with no registration and take a held lease.
                    let row = tx
                        .query_opt(
                            "SELECT generation, last_generation FROM session_leases \
                             WHERE session_id = $1 FOR UPDATE",
                            &[&key],
                        )
                        .await
                        .map_err(from_pg)?;
                    let Some(r) = row else {
                        let exists = tx
                            .query_opt("SELECT 1 FROM sessions WHERE id = $1", &[&key])
                            .await
                            .map_err(from_pg)?
                            .is_some();
                        if !exists {
                            // Nothing to serialize: loading it fails.
                            return Ok(SessionLease::Held { moved: true });
                        }
                        let inserted = tx
                            .execute(
                                "INSERT INTO session_leases \
                                 (session_id, generation, last_generation, acquired_at) \
                                 VALUES ($1, $2, $2, (extract(epoch from clock_timestamp()) * 1000)::bigint) \
                                 ON CONFLICT (session_id) DO NOTHING",
                                &[&key, &me],
                            )
                            .await
                            .map_err(from_pg)?;
                        if inserted == 1 {
                            return Ok(SessionLease::Held { moved: true });
                        }
                        continue;
                    };
                    // Held by a live process (a holder whose registration is
                    // gone holds nothing: its recovery is under way).
                    let holder: Option<i64> = r.get(0);
                    if let Some(h) = holder.filter(|h| *h != me) {
                        // Read after the row lock: the latest registration.
                        let live = tx
                            .query_opt(
                                "SELECT holder FROM runtime_processes WHERE generation = $1",
                                &[&h],
                            )
                            .await
                            .map_err(from_pg)?;
                        if let Some(live) = live {
                            return Ok(SessionLease::Busy { holder: live.get(0) });
                        }
                    }
                    let moved = r.get::<_, i64>(1) != me;
                    tx.execute(
                        "UPDATE session_leases SET generation = $2, last_generation = $2, \
                         acquired_at = (extract(epoch from clock_timestamp()) * 1000)::bigint \
                         WHERE session_id = $1",
                        &[&key, &me],
                    )
                    .await
                    .map_err(from_pg)?;
                    return Ok(SessionLease::Held { moved });
                }
            })
        })
        .await
    }

    pub(crate) async fn release_session(&self, session: SessionId) -> Result<()> {
        let me = to_i64("generation", self.fence())?;
        // No fence needed: once this process is taken over, the lease is
        // freed or another generation's, and this matches nothing.
        self.one_statement(move |tx| {
            Box::pin(async move {
                tx.execute(
                    "UPDATE session_leases SET generation = NULL \
                     WHERE session_id = $1 AND generation = $2",
                    &[&session.to_string(), &me],
                )
                .await
                .map_err(from_pg)?;
                Ok(())
            })
        })
        .await
    }
}
