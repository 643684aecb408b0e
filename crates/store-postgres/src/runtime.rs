//! Runtime generations, one per process: activation bumps the stored
//! generation and registers the process under it (its fencing epoch),
//! renewed every few seconds; a registration that expired is deleted by
//! whichever process notices, which takes over its work in the same
//! transaction. Every write of an activated store first checks that its
//! registration still exists, so a process that was taken over writes
//! nothing more.

use crate::store::Tx;
use keel_store::{Activation, ProcessRecovery, RecoveryReport, Result, StoreError};

use crate::runs::{interrupt_orphan_tx, recover_tx, Stale};
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

/// The database server's clock, in Unix ms: registrations expire by it,
/// so processes on machines whose clocks disagree still agree on expiry.
pub(crate) const DB_NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// Refuses a write of generation `ours` once its registration is gone:
/// another process found it expired and recovered its work. With
/// `locked`, the registration stays locked (`FOR SHARE`) until the
/// transaction ends, so no recovery of it runs meanwhile.
pub(crate) async fn check_fence(tx: &Tx<'_>, ours: u64, locked: bool) -> Result<()> {
    let sql = if locked {
        "SELECT 1 FROM runtime_processes WHERE generation = $1 FOR KEY SHARE"
    } else {
        "SELECT 1 FROM runtime_processes WHERE generation = $1"
    };
    let registered = tx
        .query_opt(sql, &[&to_i64("generation", ours)?])
        .await
        .map_err(from_pg)?
        .is_some();
    if registered {
        return Ok(());
    }
    Err(StoreError::TakenOver { generation: ours })
}

/// Registrations that are over: expired, or whose process's presence
/// lock is free (its connection to the server ended: the process died).
const GONE: &str = "expires_at < (extract(epoch from clock_timestamp()) * 1000)::bigint \
     OR (presence IS NOT NULL AND pg_try_advisory_xact_lock(presence))";

/// Deletes the registrations that are over; the (generation, holder) of each.
async fn expire_tx(tx: &Tx<'_>) -> Result<Vec<(u64, String)>> {
    tx.query(
        &format!("DELETE FROM runtime_processes WHERE {GONE} RETURNING generation, holder"),
        &[],
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(|r| {
        Ok((
            non_negative("runtime_processes.generation", r.get(0))?,
            r.get(1),
        ))
    })
    .collect()
}

/// Takes over what the `dead` generations left (their registrations
/// deleted already). With no other live process than `me`, the whole
/// database's recovery runs (as a single process's start does: every
/// unregistered generation's runs, every counter, every open input of a
/// session no live process leases); with others live, only the dead
/// generations' rows are read and written, so the live processes' work
/// goes on undisturbed: their session leases are freed and the inbox
/// leases and open inputs of those sessions released (with their webhook
/// deliveries); their runs are interrupted after the commit, one small
/// transaction each (`PgStore::interrupt_orphans`).
async fn take_over_tx(
    tx: &Tx<'_>,
    dead: &[i64],
    me: i64,
    now_ms: i64,
    webhook_urls: &[String],
) -> Result<(RecoveryReport, bool)> {
    let alone = tx
        .query_opt(
            "SELECT 1 FROM runtime_processes WHERE generation <> $1 LIMIT 1",
            &[&me],
        )
        .await
        .map_err(from_pg)?
        .is_none();
    let (mut recovery, closed) = if alone {
        tx.execute(
            "UPDATE session_leases SET generation = NULL WHERE generation IS NOT NULL \
             AND generation NOT IN (SELECT generation FROM runtime_processes)",
            &[],
        )
        .await
        .map_err(from_pg)?;
        let recovery = recover_tx(tx, Stale::NotLive, now_ms, webhook_urls).await?;
        // Turn inputs a dead process committed but never answered: those
        // of sessions no live process leases.
        let closed = tx
            .query(crate::messages::CLOSE_INTERRUPTED_SQL, &[])
            .await
            .map_err(from_pg)?;
        (recovery, closed)
    } else {
        let sessions = tx
            .query(
                "UPDATE session_leases SET generation = NULL WHERE generation = ANY($1) \
                 RETURNING session_id",
                &[&dead],
            )
            .await
            .map_err(from_pg)?
            .iter()
            .map(|r| parse("session_leases.session_id", r.get::<_, &str>(0)))
            .collect::<Result<Vec<keel_core::SessionId>>>()?;
        // Their runs end after this commit, one transaction each
        // (`PgStore::interrupt_orphans`); here, what blocks their dialogs.
        let mut recovery = RecoveryReport::default();
        let mut revisions = crate::counters::Revisions::default();
        for session in &sessions {
            recovery.leases_expired +=
                crate::inbox::release_leases_of_tx(tx, session, now_ms, &mut revisions).await?;
        }
        recovery.sessions_with_inbox_work = sessions.clone();
        let keys: Vec<String> = sessions.iter().map(ToString::to_string).collect();
        let closed = tx
            .query(
                "WITH closed AS ( \
                   UPDATE messages SET input_state = 'unanswered' \
                   WHERE session_id = ANY($1) AND input_state = 'open' \
                   RETURNING session_id, timeline_id, seq) \
                 SELECT session_id, timeline_id, seq FROM closed \
                 ORDER BY session_id COLLATE \"C\", timeline_id COLLATE \"C\", seq",
                &[&keys],
            )
            .await
            .map_err(from_pg)?;
        (recovery, closed)
    };
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
    Ok((recovery, alone))
}

/// What [`activate_tx`] committed, with the generations whose runs are
/// left to interrupt (none when the whole database was recovered).
struct Activated {
    generation: u64,
    previous_holder: Option<String>,
    recovery: RecoveryReport,
    dead: Vec<i64>,
}

/// Serializes activations and recoveries of expired processes ("keelproc").
const PROCESSES_LOCK: i64 = 0x6b65_656c_7072_6f63;

async fn activate_tx(
    tx: &Tx<'_>,
    holder: &str,
    now_ms: i64,
    lease_ms: i64,
    replaced: i64,
    presence: i64,
    webhook_urls: &[String],
) -> Result<Activated> {
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PROCESSES_LOCK])
        .await
        .map_err(from_pg)?;
    // A store activated again starts a new runtime: its previous one is over.
    tx.execute(
        "DELETE FROM runtime_processes WHERE generation = $1",
        &[&replaced],
    )
    .await
    .map_err(from_pg)?;
    let previous = current(tx).await?;
    // Runs stamped by builds that used wall-clock generations stay older.
    let stamped: i64 = tx
        .query_one(
            "SELECT GREATEST(coalesce((SELECT max(runtime_generation) FROM agent_runs), 0), \
                             coalesce((SELECT max(runtime_generation) FROM agent_run_groups), 0), \
                             coalesce((SELECT max(generation) FROM runtime_processes), 0))",
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
    let g = to_i64("generation", generation)?;
    tx.execute(
        "INSERT INTO runtime_state (id, generation, holder, activated_at) VALUES (1, $1, $2, $3) \
         ON CONFLICT (id) DO UPDATE SET generation = EXCLUDED.generation, \
         holder = EXCLUDED.holder, activated_at = EXCLUDED.activated_at",
        &[&g, &holder, &now_ms],
    )
    .await
    .map_err(from_pg)?;
    let dead: Vec<i64> = expire_tx(tx)
        .await?
        .iter()
        .map(|(g, _)| to_i64("generation", *g))
        .collect::<Result<_>>()?;
    tx.execute(
        &format!(
            "INSERT INTO runtime_processes (generation, holder, started_at, expires_at, presence) \
             VALUES ($1, $2, $3, {DB_NOW_MS} + $4, $5)"
        ),
        &[&g, &holder, &now_ms, &lease_ms, &presence],
    )
    .await
    .map_err(from_pg)?;
    // Other live processes keep their work; what dead ones left is ours.
    let (recovery, alone) = take_over_tx(tx, &dead, g, now_ms, webhook_urls).await?;
    Ok(Activated {
        generation,
        previous_holder: previous.map(|(_, h)| h),
        recovery,
        dead: if alone { Vec::new() } else { dead },
    })
}

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

impl crate::PgStore {
    pub(crate) async fn activate_runtime(&self, holder: String, now_ms: i64) -> Result<Activation> {
        let urls = self.inner.hooks.urls();
        let lease_ms = millis(self.inner.lease);
        let replaced = to_i64("generation", self.fence())?;
        // Activation writes unfenced: a store whose runtime was taken over
        // may start a new one.
        self.set_fence(0);
        let presence = self.hold_presence().await?;
        let mut activated = self
            .write(move |tx| {
                let (holder, urls) = (holder.clone(), urls.clone());
                Box::pin(async move {
                    activate_tx(tx, &holder, now_ms, lease_ms, replaced, presence, &urls).await
                })
            })
            .await?;
        self.set_fence(activated.generation);
        self.interrupt_orphans(&activated.dead, now_ms, &mut activated.recovery)
            .await?;
        self.start_relay().await?;
        Ok(Activation {
            generation: activated.generation,
            previous_holder: activated.previous_holder,
            recovery: activated.recovery,
        })
    }

    /// Takes a fresh presence lock on a connection of its own, kept for
    /// the life of the store (replacing an earlier one); returns its key.
    /// While the process lives, the lock is held; when the process dies,
    /// the server ends the connection and frees it.
    async fn hold_presence(&self) -> Result<i64> {
        let tls = crate::pool::tls().map_err(crate::store::from_pg_store)?;
        let (client, connection) = self.inner.config.connect(tls).await.map_err(from_pg)?;
        // Driven until the client is dropped (with the store) or the server
        // ends it; then the lock is free and other processes take over.
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "this process's presence connection ended");
            }
        });
        // A v7 UUID's random bits, a positive key apart from keel's fixed ones.
        let key = (uuid::Uuid::now_v7().as_u128() & ((1 << 62) - 1)) as i64;
        client
            .execute("SELECT pg_advisory_lock($1)", &[&key])
            .await
            .map_err(from_pg)?;
        *self.inner.presence.lock().await = Some(client);
        Ok(key)
    }

    /// Starts listening for the other processes' messages, once (a store
    /// activated again keeps its relay, which reads the new generation).
    async fn start_relay(&self) -> Result<()> {
        if self.inner.relay.get().is_some() {
            return Ok(());
        }
        let relay = crate::relay::PgRelay::start(
            self.inner.pool.clone(),
            self.inner.config.clone(),
            self.fence_cell(),
        )
        .await?;
        // Lost a race with another activation: its relay serves.
        let _ = self.inner.relay.set(std::sync::Arc::new(relay));
        Ok(())
    }

    /// The relay, once this store was activated.
    pub(crate) fn relay(&self) -> Option<std::sync::Arc<dyn keel_store::Relay>> {
        let relay = self.inner.relay.get()?.clone();
        Some(relay)
    }

    /// The stored runtime generation and its holder (`None` before any activation).
    pub(crate) async fn runtime_generation(&self) -> Result<Option<(u64, String)>> {
        self.read(|tx| Box::pin(current(tx))).await
    }

    /// Extends this process's registration by a lease from now, on the
    /// presence connection (never waiting for the pool behind busy
    /// transactions); `TakenOver` once the registration is gone.
    pub(crate) async fn renew_runtime(&self) -> Result<()> {
        let generation = to_i64("generation", self.fence())?;
        if generation == 0 {
            return Ok(());
        }
        let lease_ms = millis(self.inner.lease);
        let presence = self.inner.presence.lock().await;
        let Some(client) = presence.as_ref() else {
            return Ok(());
        };
        let renewed = client
            .execute(
                &format!(
                    "UPDATE runtime_processes SET expires_at = {DB_NOW_MS} + $2 \
                     WHERE generation = $1"
                ),
                &[&generation, &lease_ms],
            )
            .await
            .map_err(from_pg)?;
        if renewed == 0 {
            return Err(StoreError::TakenOver {
                generation: self.fence(),
            });
        }
        Ok(())
    }

    /// Recovers the processes whose registration expired, if any.
    pub(crate) async fn recover_expired_runtimes(
        &self,
        now_ms: i64,
    ) -> Result<Option<ProcessRecovery>> {
        // Most calls find nothing: a read says so without a write.
        let expired = self
            .read(|tx| {
                Box::pin(async move {
                    Ok(tx
                        .query_opt(
                            &format!("SELECT 1 FROM runtime_processes WHERE {GONE} LIMIT 1"),
                            &[],
                        )
                        .await
                        .map_err(from_pg)?
                        .is_some())
                })
            })
            .await?;
        if !expired {
            return Ok(None);
        }
        let urls = self.inner.hooks.urls();
        let me = to_i64("generation", self.fence())?;
        let taken = self
            .write(move |tx| {
                let urls = urls.clone();
                Box::pin(async move {
                    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PROCESSES_LOCK])
                        .await
                        .map_err(from_pg)?;
                    let processes = expire_tx(tx).await?;
                    if processes.is_empty() {
                        return Ok(None);
                    }
                    let dead: Vec<i64> = processes
                        .iter()
                        .map(|(g, _)| to_i64("generation", *g))
                        .collect::<Result<_>>()?;
                    let (recovery, alone) = take_over_tx(tx, &dead, me, now_ms, &urls).await?;
                    let dead = if alone { Vec::new() } else { dead };
                    let sessions_with_queued_inputs = tx
                    .query(
                        "SELECT DISTINCT session_id FROM queued_inputs WHERE generation NOT IN \
                         (SELECT generation FROM runtime_processes) ORDER BY 1",
                        &[],
                    )
                    .await
                    .map_err(from_pg)?
                    .iter()
                    .map(|r| parse("queued_inputs.session_id", r.get::<_, &str>(0)))
                    .collect::<Result<Vec<_>>>()?;
                    Ok(Some((
                        ProcessRecovery {
                            processes,
                            recovery,
                            sessions_with_queued_inputs,
                        },
                        dead,
                    )))
                })
            })
            .await?;
        let Some((mut taken, dead)) = taken else {
            return Ok(None);
        };
        self.interrupt_orphans(&dead, now_ms, &mut taken.recovery)
            .await?;
        Ok(Some(taken))
    }

    /// Ends the runs of the `dead` generations as interrupted, one
    /// transaction each, adding them to `report` (and their roots to the
    /// sessions whose inbox has work).
    async fn interrupt_orphans(
        &self,
        dead: &[i64],
        now_ms: i64,
        report: &mut RecoveryReport,
    ) -> Result<()> {
        if dead.is_empty() {
            return Ok(());
        }
        let dead = dead.to_vec();
        let runs = self
            .read(move |tx| {
                let dead = dead.clone();
                Box::pin(async move {
                    tx.query(
                        &format!(
                            "SELECT id FROM agent_runs WHERE runtime_generation = ANY($1) \
                             AND status IN {} ORDER BY row_order",
                            crate::runs::EXECUTING_RUN
                        ),
                        &[&dead],
                    )
                    .await
                    .map_err(from_pg)?
                    .iter()
                    .map(|r| parse::<keel_core::RunId>("agent_runs.id", r.get::<_, &str>(0)))
                    .collect::<Result<Vec<_>>>()
                })
            })
            .await?;
        let urls = self.inner.hooks.urls();
        for run in runs {
            let urls = urls.clone();
            let commit = self
                .write(move |tx| {
                    let urls = urls.clone();
                    Box::pin(async move { interrupt_orphan_tx(tx, &run, now_ms, &urls).await })
                })
                .await?;
            let Some(commit) = commit else { continue };
            if commit.event_id.is_some() {
                report.completion_events += 1;
            }
            if commit.finished_group.is_some() {
                report.groups_finished += 1;
            }
            report.interrupted_runs.push(run);
            report
                .sessions_with_inbox_work
                .push(commit.run.spec.root_session_id);
        }
        report.sessions_with_inbox_work.sort_unstable();
        report.sessions_with_inbox_work.dedup();
        Ok(())
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
