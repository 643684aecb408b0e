//! Session leases: a session's turns run under its lease, held by one live
//! process at a time (see `runtime.rs` for the processes). The lease row
//! stays when freed, remembering its last holder, so a process that takes
//! it learns whether another wrote the session since it last held it.

use keel_core::SessionId;
use keel_store::{Result, SessionLease, StoreError};

use crate::store::from_pg;
use crate::util::to_i64;
use crate::PgStore;

impl PgStore {
    pub(crate) async fn lease_session(&self, session: SessionId) -> Result<SessionLease> {
        let me = to_i64("generation", self.fence())?;
        if me == 0 {
            return Err(StoreError::InvalidInput(
                "a session lease needs an activated runtime".to_owned(),
            ));
        }
        self.write(move |tx| {
            Box::pin(async move {
                let key = session.to_string();
                // The holder's registration, when another live process holds it.
                let row = tx
                    .query_opt(
                        "SELECT l.generation, l.last_generation, p.holder \
                         FROM session_leases l \
                         LEFT JOIN runtime_processes p ON p.generation = l.generation \
                         WHERE l.session_id = $1 FOR UPDATE OF l",
                        &[&key],
                    )
                    .await
                    .map_err(from_pg)?;
                let moved = match &row {
                    None => true,
                    Some(r) => {
                        let holder: Option<i64> = r.get(0);
                        let live: Option<String> = r.get(2);
                        if let (Some(h), Some(live)) = (holder, live) {
                            if h != me {
                                return Ok(SessionLease::Busy { holder: live });
                            }
                        }
                        r.get::<_, i64>(1) != me
                    }
                };
                tx.execute(
                    "INSERT INTO session_leases (session_id, generation, last_generation, acquired_at) \
                     VALUES ($1, $2, $2, (extract(epoch from clock_timestamp()) * 1000)::bigint) \
                     ON CONFLICT (session_id) DO UPDATE SET generation = EXCLUDED.generation, \
                     last_generation = EXCLUDED.last_generation, acquired_at = EXCLUDED.acquired_at",
                    &[&key, &me],
                )
                .await
                .map_err(from_pg)?;
                Ok(SessionLease::Held { moved })
            })
        })
        .await
    }

    pub(crate) async fn release_session(&self, session: SessionId) -> Result<()> {
        let me = to_i64("generation", self.fence())?;
        self.write(move |tx| {
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
