//! Tool calls waiting for a person's decision on PostgreSQL (keel-store's
//! `approvals.rs`, the same rows and rules): a paused turn commits its
//! gated calls as `pending` rows, a decision or expiry is one conditional
//! write of a row, and the approved calls' results settle them.
//!
//! Every change of a row is conditional on the state it leaves (`status =
//! 'pending'`, `executing_at IS NULL`, `settled_at IS NULL`), so a decision
//! is committed exactly once however many writers race for it.

use std::sync::Arc;

use keel_core::{ApprovalId, SessionId, TurnId};
use keel_store::{
    ApprovalRecord, ApprovalResultCommit, ApprovalSchedule, ApprovalStatus, ContinuationCommit,
    DecideApproval, DecideOutcome, Decision, PausedTurnCommit, Result, StoreError, TurnCommitted,
};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::store::Tx;

use crate::counters::next_revision;
use crate::messages::{commit_turn_tx, encode};
use crate::sessions::require_session;
use crate::store::from_pg;
use crate::util::{non_negative, parse, parse_opt};
use crate::PgStore;

const COLUMNS: &str = "id, session_id, turn_id, agent_id, tool_call_id, tool_name, arguments, \
     status, always, reason, revision, created_at, expires_at, decided_at, executing_at, settled_at, \
     run_id";

fn from_row(r: &Row) -> Result<ApprovalRecord> {
    let (id, session, turn, agent, status): (String, String, String, String, String) =
        (r.get(0), r.get(1), r.get(2), r.get(3), r.get(7));
    Ok(ApprovalRecord {
        id: parse("tool_approvals.id", &id)?,
        session_id: parse("tool_approvals.session_id", &session)?,
        turn_id: parse("tool_approvals.turn_id", &turn)?,
        agent_id: parse("tool_approvals.agent_id", &agent)?,
        tool_call_id: r.get(4),
        tool_name: r.get(5),
        arguments: r.get(6),
        status: parse("tool_approvals.status", &status)?,
        always: r.get::<_, i64>(8) == 1,
        reason: r.get(9),
        revision: non_negative("tool_approvals.revision", r.get(10))?,
        created_at_ms: r.get(11),
        expires_at_ms: r.get(12),
        decided_at_ms: r.get(13),
        executing_at_ms: r.get(14),
        settled_at_ms: r.get(15),
        run_id: parse_opt("tool_approvals.run_id", r.get(16))?,
    })
}

/// The approvals `filter` (a `WHERE … ORDER BY …` tail over `args`) selects.
pub(crate) async fn query(
    tx: &Tx<'_>,
    filter: &str,
    args: &[&(dyn ToSql + Sync)],
) -> Result<Vec<ApprovalRecord>> {
    tx.query(
        &format!("SELECT {COLUMNS} FROM tool_approvals {filter}"),
        args,
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(from_row)
    .collect()
}

async fn get_tx(tx: &Tx<'_>, id: &ApprovalId) -> Result<Option<ApprovalRecord>> {
    Ok(query(tx, "WHERE id = $1", &[&id.to_string()]).await?.pop())
}

/// Marks the session's pending approvals past `now_ms` expired.
async fn expire_tx(tx: &Tx<'_>, session: &SessionId, now_ms: i64) -> Result<Vec<ApprovalRecord>> {
    let s = session.to_string();
    let due = query(
        tx,
        "WHERE session_id = $1 AND status = 'pending' AND expires_at <= $2 ORDER BY created_at, id",
        &[&s, &now_ms],
    )
    .await?;
    if due.is_empty() {
        return Ok(due);
    }
    let revision = next_revision(tx, session, now_ms).await?;
    for a in &due {
        tx.execute(
            "UPDATE tool_approvals SET status = 'expired', decided_at = $1, revision = $2, \
             reason = 'nobody decided in time' WHERE id = $3 AND status = 'pending'",
            &[&now_ms, &revision, &a.id.to_string()],
        )
        .await
        .map_err(from_pg)?;
    }
    query(
        tx,
        "WHERE session_id = $1 AND revision = $2 AND status = 'expired' ORDER BY created_at, id",
        &[&s, &revision],
    )
    .await
}

impl PgStore {
    pub(crate) async fn commit_paused_turn(
        &self,
        commit: PausedTurnCommit,
    ) -> Result<TurnCommitted> {
        if commit.approvals.is_empty() {
            return Err(StoreError::InvalidInput(
                "a paused turn has at least one approval".into(),
            ));
        }
        let encoded = Arc::new(encode(&commit.turn.messages)?);
        let args: Arc<Vec<String>> = Arc::new(
            commit
                .approvals
                .iter()
                .map(|a| a.call.arguments.to_string())
                .collect(),
        );
        let global = Arc::new(self.inner.hooks.urls());
        let answers = !commit.turn.answers.is_empty();
        let commit = Arc::new(commit);
        let committed = self
            .write(move |tx| {
                let (commit, encoded, args, global) = (
                    commit.clone(),
                    encoded.clone(),
                    args.clone(),
                    global.clone(),
                );
                Box::pin(async move {
                    let turn = if commit.consumed.is_empty() {
                        commit_turn_tx(tx, &commit.turn, &encoded, &global).await?
                    } else {
                        let consumed = ContinuationCommit {
                            turn: commit.turn.clone(),
                            consumed: commit.consumed.clone(),
                        };
                        crate::inbox::continuation_tx(tx, &consumed, &encoded)
                            .await?
                            .turn
                    };
                    let session = &commit.turn.session_id;
                    let now = commit.turn.now_ms;
                    let revision = next_revision(tx, session, now).await?;
                    let insert = "INSERT INTO tool_approvals (id, session_id, turn_id, agent_id, \
                             tool_call_id, tool_name, arguments, status, revision, created_at, \
                             expires_at) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending', $8, $9, $10)";
                    let (session, turn_id) = (session.to_string(), commit.turn_id.to_string());
                    for (a, args) in commit.approvals.iter().zip(args.iter()) {
                        tx.execute(
                            insert,
                            &[
                                &a.id.to_string(),
                                &session,
                                &turn_id,
                                &a.agent_id.as_str(),
                                &a.call.id,
                                &a.call.name,
                                args,
                                &revision,
                                &now,
                                &a.expires_at_ms,
                            ],
                        )
                        .await
                        .map_err(from_pg)?;
                    }
                    Ok(turn)
                })
            })
            .await?;
        if answers {
            self.inner.hooks.wake();
        }
        Ok(committed)
    }

    pub(crate) async fn get_approval(&self, id: ApprovalId) -> Result<Option<ApprovalRecord>> {
        self.read(move |tx| Box::pin(async move { get_tx(tx, &id).await }))
            .await
    }

    pub(crate) async fn list_approvals(
        &self,
        session_id: SessionId,
        pending_only: bool,
    ) -> Result<Vec<ApprovalRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                require_session(tx, &session_id).await?;
                let filter = if pending_only {
                    "WHERE session_id = $1 AND status = 'pending' ORDER BY created_at, id"
                } else {
                    "WHERE session_id = $1 ORDER BY created_at, id"
                };
                query(tx, filter, &[&session_id.to_string()]).await
            })
        })
        .await
    }

    pub(crate) async fn approval_grants(&self, session_id: SessionId) -> Result<Vec<String>> {
        self.read(move |tx| {
            Box::pin(async move {
                // Byte order, as SQLite's BINARY collation sorts tool names,
                // whatever the database's collation.
                Ok(tx
                    .query(
                        "SELECT tool_name FROM tool_approval_grants WHERE session_id = $1 \
                         ORDER BY tool_name COLLATE \"C\"",
                        &[&session_id.to_string()],
                    )
                    .await
                    .map_err(from_pg)?
                    .iter()
                    .map(|r| r.get(0))
                    .collect())
            })
        })
        .await
    }

    pub(crate) async fn decide_approval(&self, d: DecideApproval) -> Result<DecideOutcome> {
        self.write(move |tx| {
            let d = d.clone();
            Box::pin(async move {
                let missing = || StoreError::NotFound(format!("approval {}", d.id));
                let a = get_tx(tx, &d.id).await?.ok_or_else(missing)?;
                if d.session_id.is_some_and(|s| s != a.session_id) {
                    return Err(missing());
                }
                if require_session(tx, &a.session_id)
                    .await?
                    .deleted_at_ms
                    .is_some()
                {
                    return Err(missing());
                }
                if a.status != ApprovalStatus::Pending {
                    return Ok(DecideOutcome::AlreadyDecided(a));
                }
                if a.expires_at_ms <= d.now_ms {
                    expire_tx(tx, &a.session_id, d.now_ms).await?;
                    let a = get_tx(tx, &d.id).await?.ok_or_else(missing)?;
                    return Ok(DecideOutcome::Expired(a));
                }
                let revision = next_revision(tx, &a.session_id, d.now_ms).await?;
                let (status, always) = match d.decision {
                    Decision::Approve => (ApprovalStatus::Approved, false),
                    Decision::ApproveAlways => (ApprovalStatus::Approved, true),
                    Decision::Deny => (ApprovalStatus::Denied, false),
                };
                tx.execute(
                    "UPDATE tool_approvals SET status = $1, always = $2, reason = $3, \
                     decided_at = $4, revision = $5 WHERE id = $6 AND status = 'pending'",
                    &[
                        &status.as_str(),
                        &i64::from(always),
                        &d.reason,
                        &d.now_ms,
                        &revision,
                        &d.id.to_string(),
                    ],
                )
                .await
                .map_err(from_pg)?;
                if always {
                    tx.execute(
                        "INSERT INTO tool_approval_grants (session_id, tool_name, approval_id, \
                         granted_at) VALUES ($1, $2, $3, $4) \
                         ON CONFLICT (session_id, tool_name) DO NOTHING",
                        &[
                            &a.session_id.to_string(),
                            &a.tool_name,
                            &d.id.to_string(),
                            &d.now_ms,
                        ],
                    )
                    .await
                    .map_err(from_pg)?;
                }
                let a = get_tx(tx, &d.id).await?.ok_or_else(missing)?;
                Ok(DecideOutcome::Decided(a))
            })
        })
        .await
    }

    pub(crate) async fn expire_approvals(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>> {
        self.write(move |tx| Box::pin(async move { expire_tx(tx, &session_id, now_ms).await }))
            .await
    }

    pub(crate) async fn approval_schedule(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<ApprovalSchedule> {
        // Read after every turn: one statement, one round trip.
        self.one_statement(move |tx| Box::pin(approval_schedule_on(tx, session_id, now_ms)))
            .await
    }

    pub(crate) async fn sessions_with_open_approvals(&self) -> Result<Vec<SessionId>> {
        self.read(|tx| {
            Box::pin(async move {
                tx.query(
                    "SELECT DISTINCT a.session_id FROM tool_approvals a \
                     JOIN sessions s ON s.id = a.session_id \
                     WHERE a.settled_at IS NULL AND s.deleted_at IS NULL ORDER BY a.session_id",
                    &[],
                )
                .await
                .map_err(from_pg)?
                .iter()
                .map(|r| parse("tool_approvals.session_id", r.get::<_, &str>(0)))
                .collect()
            })
        })
        .await
    }

    pub(crate) async fn unsettled_approvals(
        &self,
        session_id: SessionId,
        turn_id: TurnId,
    ) -> Result<Vec<ApprovalRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                query(
                    tx,
                    "WHERE session_id = $1 AND turn_id = $2 AND run_id IS NULL \
                     AND settled_at IS NULL ORDER BY created_at, id",
                    &[&session_id.to_string(), &turn_id.to_string()],
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn begin_approved_execution(
        &self,
        id: ApprovalId,
        now_ms: i64,
    ) -> Result<bool> {
        self.write(move |tx| {
            Box::pin(async move {
                let n = tx
                    .execute(
                        "UPDATE tool_approvals SET executing_at = $1 WHERE id = $2 \
                         AND status = 'approved' AND executing_at IS NULL AND settled_at IS NULL",
                        &[&now_ms, &id.to_string()],
                    )
                    .await
                    .map_err(from_pg)?;
                if n == 1 {
                    return Ok(true);
                }
                match get_tx(tx, &id).await? {
                    Some(a)
                        if a.status == ApprovalStatus::Approved && a.settled_at_ms.is_none() =>
                    {
                        Ok(false)
                    }
                    _ => Err(StoreError::Stale(format!(
                        "approval {id} is not an approved, unsettled call"
                    ))),
                }
            })
        })
        .await
    }

    pub(crate) async fn commit_approval_results(
        &self,
        commit: ApprovalResultCommit,
    ) -> Result<TurnCommitted> {
        let encoded = Arc::new(encode(&commit.turn.messages)?);
        let global = Arc::new(self.inner.hooks.urls());
        let answers = !commit.turn.answers.is_empty();
        let commit = Arc::new(commit);
        let committed = self
            .write(move |tx| {
                let (commit, encoded, global) = (commit.clone(), encoded.clone(), global.clone());
                Box::pin(async move {
                    let turn = commit_turn_tx(tx, &commit.turn, &encoded, &global).await?;
                    let session = commit.turn.session_id.to_string();
                    let now = commit.turn.now_ms;
                    let revision = next_revision(tx, &commit.turn.session_id, now).await?;
                    for id in &commit.settle {
                        let id_text = id.to_string();
                        let n = match &commit.supersede {
                            Some(reason) => {
                                tx.execute(
                                    "UPDATE tool_approvals SET status = 'superseded', \
                                     reason = $1, decided_at = $2, settled_at = $2, revision = $3 \
                                     WHERE id = $4 AND session_id = $5 AND status = 'pending'",
                                    &[reason, &now, &revision, &id_text, &session],
                                )
                                .await
                            }
                            None => {
                                tx.execute(
                                    "UPDATE tool_approvals SET settled_at = $1, revision = $2 \
                                     WHERE id = $3 AND session_id = $4 AND status <> 'pending' \
                                     AND settled_at IS NULL",
                                    &[&now, &revision, &id_text, &session],
                                )
                                .await
                            }
                        }
                        .map_err(from_pg)?;
                        if n != 1 {
                            return Err(StoreError::Stale(format!(
                                "approval {id} is settled already or not in the expected state"
                            )));
                        }
                    }
                    Ok(turn)
                })
            })
            .await?;
        if answers {
            self.inner.hooks.wake();
        }
        Ok(committed)
    }
}

/// What the worker of `session_id` must do about approvals at `now_ms`,
/// in one statement.
pub(crate) async fn approval_schedule_on(
    tx: &Tx<'_>,
    session_id: SessionId,
    now_ms: i64,
) -> Result<ApprovalSchedule> {
    let row = tx
        .query_opt(
            "SELECT s.deleted_at IS NOT NULL, c.pending, c.expired, c.next, r.turn_id, \
               ARRAY(SELECT w.id FROM agent_runs w WHERE w.root_session_id = s.id \
                 AND w.status = 'waiting_approval' AND NOT EXISTS (SELECT 1 \
                     FROM tool_approvals a WHERE a.run_id = w.id AND a.status = 'pending') \
                 ORDER BY w.updated_at, w.id) \
             FROM sessions s \
             CROSS JOIN LATERAL (SELECT count(*) FILTER (WHERE run_id IS NULL) AS pending, \
                 count(*) FILTER (WHERE expires_at <= $2) AS expired, \
                 min(expires_at) AS next \
               FROM tool_approvals WHERE session_id = s.id AND status = 'pending') c \
             LEFT JOIN LATERAL (SELECT a.turn_id FROM tool_approvals a \
               WHERE a.session_id = s.id AND a.run_id IS NULL AND a.settled_at IS NULL \
                 AND a.status <> 'pending' \
                 AND NOT EXISTS (SELECT 1 FROM tool_approvals b \
                     WHERE b.session_id = a.session_id AND b.turn_id = a.turn_id \
                     AND b.run_id IS NULL AND b.status = 'pending') \
               ORDER BY a.created_at, a.id LIMIT 1) r ON true \
             WHERE s.id = $1",
            &[&session_id.to_string(), &now_ms],
        )
        .await
        .map_err(from_pg)?
        .ok_or_else(|| StoreError::NotFound(format!("session {session_id}")))?;
    // A deleted dialog's approvals wait for nothing any more.
    if row.get::<_, bool>(0) {
        return Ok(ApprovalSchedule::default());
    }
    let (pending, expired, next): (i64, i64, Option<i64>) = (row.get(1), row.get(2), row.get(3));
    let resumable: Option<String> = row.get(4);
    let runs: Vec<String> = row.get(5);
    Ok(ApprovalSchedule {
        pending: non_negative("pending approvals", pending)?,
        expired: non_negative("expired approvals", expired)?,
        next_expiry_at_ms: next,
        resumable: parse_opt("tool_approvals.turn_id", resumable)?,
        resumable_runs: runs
            .iter()
            .map(|r| parse("agent_runs.id", r))
            .collect::<Result<_>>()?,
    })
}
