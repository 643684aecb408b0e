//! Tool calls waiting for a person's decision (schema v10).
//!
//! A root turn that calls a tool needing approval commits what it did so
//! far together with one `pending` row per gated call
//! ([`Backend::commit_paused_turn`](crate::Backend::commit_paused_turn)). A decision ([`Backend::decide_approval`](crate::Backend::decide_approval),
//! or expiry, [`Backend::expire_approvals`](crate::Backend::expire_approvals)) is one write of the row (and, for
//! "approve always", of the dialog's grant). Once every row of a turn is
//! decided the session worker resumes it: [`Backend::begin_approved_execution`](crate::Backend::begin_approved_execution)
//! marks an approved call before its tool runs, so a crash never runs it
//! twice, and [`Backend::commit_approval_results`](crate::Backend::commit_approval_results) appends the tool results to
//! the history and settles the rows in one transaction. A user message sent
//! while rows are pending supersedes them through the same commit.

use keel_core::{text_enum, AgentId, ApprovalId, RunId, SessionId, ToolCall, TurnId};
use rusqlite::{params, Connection, OptionalExtension};

use crate::counters::next_revision;
use crate::error::{Result, StoreError};
use crate::messages::{commit_turn_tx, encode, TurnCommit, TurnCommitted};
use crate::sessions::require_session;
use crate::util::{non_negative, parse};
use crate::SqliteStore;

text_enum!(
    /// Where an approval stands.
    ApprovalStatus, "approval status" {
        /// Waiting for a person.
        Pending = "pending",
        /// Approved: the tool runs when the turn resumes.
        Approved = "approved",
        /// Denied: the model reads the denial (and its reason).
        Denied = "denied",
        /// Nobody decided in time: a denial.
        Expired = "expired",
        /// The user sent new input while it was pending: a denial.
        Superseded = "superseded",
    }
);

/// A person's decision on a pending approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Run the tool this once.
    Approve,
    /// Run it, and every later call of this tool in this dialog, unasked.
    ApproveAlways,
    /// Do not run it.
    Deny,
}

/// One gated call of a paused turn.
#[derive(Debug, Clone, PartialEq)]
pub struct NewApproval {
    /// Its id (what a person decides on).
    pub id: ApprovalId,
    /// The agent that asked.
    pub agent_id: AgentId,
    /// The call as the model sent it.
    pub call: ToolCall,
    /// When it expires as a denial (Unix ms).
    pub expires_at_ms: i64,
}

/// A turn that paused for approval: what it did so far, and its gated calls.
#[derive(Debug, Clone, PartialEq)]
pub struct PausedTurnCommit {
    /// The turn's messages (the assistant message with its tool calls, the
    /// results of the calls that ran), state and checkpoint.
    pub turn: TurnCommit,
    /// The turn.
    pub turn_id: TurnId,
    /// One per gated call.
    pub approvals: Vec<NewApproval>,
    /// Steered inbox events the turn read, consumed with it.
    pub consumed: Vec<crate::LeasedEvents>,
}

/// Tool results of approvals appended to the history, settling them.
#[derive(Debug, Clone, PartialEq)]
pub struct ApprovalResultCommit {
    /// The tool result messages (and state), like a turn.
    pub turn: TurnCommit,
    /// The approvals these results answer.
    pub settle: Vec<ApprovalId>,
    /// `Some(reason)`: the approvals are pending and become `superseded`
    /// with this reason; `None`: they are decided already.
    pub supersede: Option<String>,
}

/// An approval as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalRecord {
    /// Its id.
    pub id: ApprovalId,
    /// The dialog (root session) it belongs to.
    pub session_id: SessionId,
    /// The root turn that asked, or whose delegation tree the asking run
    /// belongs to.
    pub turn_id: TurnId,
    /// The background run that asked (`None`: the root turn did).
    pub run_id: Option<RunId>,
    /// The agent that asked.
    pub agent_id: AgentId,
    /// The model's id of the call.
    pub tool_call_id: String,
    /// The tool.
    pub tool_name: String,
    /// The arguments, as the model sent them (JSON text).
    pub arguments: String,
    /// Where it stands.
    pub status: ApprovalStatus,
    /// Approved for every later call of the tool in the dialog.
    pub always: bool,
    /// The reason of a denial, if one was given.
    pub reason: Option<String>,
    /// The dialog's client revision of its last change.
    pub revision: u64,
    /// When it was asked (Unix ms).
    pub created_at_ms: i64,
    /// When it expires (Unix ms).
    pub expires_at_ms: i64,
    /// When it was decided.
    pub decided_at_ms: Option<i64>,
    /// When its approved tool started (it never starts twice).
    pub executing_at_ms: Option<i64>,
    /// When its result entered the history.
    pub settled_at_ms: Option<i64>,
}

/// What [`Backend::decide_approval`](crate::Backend::decide_approval) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecideOutcome {
    /// The decision is committed.
    Decided(ApprovalRecord),
    /// It was decided before (nothing changed).
    AlreadyDecided(ApprovalRecord),
    /// It had expired: it is now recorded as expired (a denial).
    Expired(ApprovalRecord),
}

/// A decision to commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecideApproval {
    /// The approval.
    pub id: ApprovalId,
    /// The dialog the decision comes from, when it names one: an approval
    /// of another dialog is not found.
    pub session_id: Option<SessionId>,
    /// The decision.
    pub decision: Decision,
    /// Why (shown to the model with a denial).
    pub reason: Option<String>,
    /// Now (Unix ms).
    pub now_ms: i64,
}

/// What a session's worker must do about approvals.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApprovalSchedule {
    /// Approvals of root turns still waiting for a person.
    pub pending: u64,
    /// Pending approvals (of turns or runs) past their expiry.
    pub expired: u64,
    /// The earliest expiry of a pending approval (Unix ms).
    pub next_expiry_at_ms: Option<i64>,
    /// The oldest root turn whose approvals are all decided but not settled.
    pub resumable: Option<TurnId>,
    /// Background runs waiting for approval whose approvals are all decided.
    pub resumable_runs: Vec<RunId>,
}

const COLUMNS: &str = "id, session_id, turn_id, agent_id, tool_call_id, tool_name, arguments, \
     status, always, reason, revision, created_at, expires_at, decided_at, executing_at, settled_at, \
     run_id";

fn from_row(r: &rusqlite::Row<'_>) -> Result<ApprovalRecord> {
    Ok(ApprovalRecord {
        id: parse("tool_approvals.id", &r.get::<_, String>(0)?)?,
        session_id: parse("tool_approvals.session_id", &r.get::<_, String>(1)?)?,
        turn_id: parse("tool_approvals.turn_id", &r.get::<_, String>(2)?)?,
        agent_id: parse("tool_approvals.agent_id", &r.get::<_, String>(3)?)?,
        tool_call_id: r.get(4)?,
        tool_name: r.get(5)?,
        arguments: r.get(6)?,
        status: parse("tool_approvals.status", &r.get::<_, String>(7)?)?,
        always: r.get::<_, i64>(8)? == 1,
        reason: r.get(9)?,
        revision: non_negative("tool_approvals.revision", r.get(10)?)?,
        created_at_ms: r.get(11)?,
        expires_at_ms: r.get(12)?,
        decided_at_ms: r.get(13)?,
        executing_at_ms: r.get(14)?,
        settled_at_ms: r.get(15)?,
        run_id: r
            .get::<_, Option<String>>(16)?
            .map(|id| parse("tool_approvals.run_id", &id))
            .transpose()?,
    })
}

pub(crate) fn query(
    conn: &Connection,
    filter: &str,
    args: impl rusqlite::Params,
) -> Result<Vec<ApprovalRecord>> {
    let mut stmt =
        conn.prepare_cached(&format!("SELECT {COLUMNS} FROM tool_approvals {filter}"))?;
    let mut rows = stmt.query(args)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(from_row(r)?);
    }
    Ok(out)
}

fn get_tx(conn: &Connection, id: &ApprovalId) -> Result<Option<ApprovalRecord>> {
    Ok(query(conn, "WHERE id = ?1", [id.to_string()])?.pop())
}

/// Marks the session's pending approvals past `now_ms` expired.
fn expire_tx(conn: &Connection, session: &SessionId, now_ms: i64) -> Result<Vec<ApprovalRecord>> {
    let due = query(
        conn,
        "WHERE session_id = ?1 AND status = 'pending' AND expires_at <= ?2 ORDER BY created_at, id",
        params![session.to_string(), now_ms],
    )?;
    if due.is_empty() {
        return Ok(due);
    }
    let revision = next_revision(conn, session, now_ms)?;
    for a in &due {
        conn.execute(
            "UPDATE tool_approvals SET status = 'expired', decided_at = ?1, revision = ?2, \
             reason = 'nobody decided in time' WHERE id = ?3 AND status = 'pending'",
            params![now_ms, revision, a.id.to_string()],
        )?;
    }
    query(
        conn,
        "WHERE session_id = ?1 AND revision = ?2 AND status = 'expired' ORDER BY created_at, id",
        params![session.to_string(), revision],
    )
}

impl SqliteStore {
    pub(crate) async fn commit_paused_turn(
        &self,
        commit: PausedTurnCommit,
    ) -> Result<TurnCommitted> {
        if commit.approvals.is_empty() {
            return Err(StoreError::InvalidInput(
                "a paused turn has at least one approval".into(),
            ));
        }
        let encoded = encode(self.path(), &commit.turn.messages)?;
        let args: Vec<String> = commit
            .approvals
            .iter()
            .map(|a| a.call.arguments.to_string())
            .collect();
        let global = self.webhook_urls();
        let answers = !commit.turn.answers.is_empty();
        let committed = self
            .db
            .write_cached(move |c, cache| {
                let turn = if commit.consumed.is_empty() {
                    commit_turn_tx(c, &commit.turn, &encoded, Some(cache), &global)?
                } else {
                    let consumed = crate::inbox::ContinuationCommit {
                        turn: commit.turn.clone(),
                        consumed: commit.consumed.clone(),
                    };
                    crate::inbox::continuation_tx(c, &consumed, &encoded, cache)?.turn
                };
                let session = &commit.turn.session_id;
                let now = commit.turn.now_ms;
                let revision = next_revision(c, session, now)?;
                let mut stmt = c.prepare_cached(
                    "INSERT INTO tool_approvals (id, session_id, turn_id, agent_id, tool_call_id, \
                     tool_name, arguments, status, revision, created_at, expires_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'pending', ?8, ?9, ?10)",
                )?;
                for (a, args) in commit.approvals.iter().zip(&args) {
                    stmt.execute(params![
                        a.id.to_string(),
                        session.to_string(),
                        commit.turn_id.to_string(),
                        a.agent_id.as_str(),
                        a.call.id,
                        a.call.name,
                        args,
                        revision,
                        now,
                        a.expires_at_ms
                    ])?;
                }
                Ok(turn)
            })
            .await?;
        if answers {
            self.wake_webhooks();
        }
        Ok(committed)
    }

    pub(crate) async fn get_approval(&self, id: ApprovalId) -> Result<Option<ApprovalRecord>> {
        self.db.read(move |c| get_tx(c, &id)).await
    }

    pub(crate) async fn list_approvals(
        &self,
        session_id: SessionId,
        pending_only: bool,
    ) -> Result<Vec<ApprovalRecord>> {
        self.db
            .read(move |c| {
                require_session(c, &session_id)?;
                let filter = if pending_only {
                    "WHERE session_id = ?1 AND status = 'pending' ORDER BY created_at, id"
                } else {
                    "WHERE session_id = ?1 ORDER BY created_at, id"
                };
                query(c, filter, [session_id.to_string()])
            })
            .await
    }

    pub(crate) async fn approval_grants(&self, session_id: SessionId) -> Result<Vec<String>> {
        self.db
            .read(move |c| {
                let mut stmt = c.prepare_cached(
                    "SELECT tool_name FROM tool_approval_grants WHERE session_id = ?1 ORDER BY tool_name",
                )?;
                let names = stmt
                    .query_map([session_id.to_string()], |r| r.get(0))?
                    .collect::<rusqlite::Result<Vec<String>>>()?;
                Ok(names)
            })
            .await
    }

    pub(crate) async fn decide_approval(&self, d: DecideApproval) -> Result<DecideOutcome> {
        self.db
            .write(move |c| {
                let missing = || StoreError::NotFound(format!("approval {}", d.id));
                let a = get_tx(c, &d.id)?.ok_or_else(missing)?;
                if d.session_id.is_some_and(|s| s != a.session_id) {
                    return Err(missing());
                }
                if require_session(c, &a.session_id)?.deleted_at_ms.is_some() {
                    return Err(missing());
                }
                if a.status != ApprovalStatus::Pending {
                    return Ok(DecideOutcome::AlreadyDecided(a));
                }
                if a.expires_at_ms <= d.now_ms {
                    expire_tx(c, &a.session_id, d.now_ms)?;
                    let a = get_tx(c, &d.id)?.ok_or_else(missing)?;
                    return Ok(DecideOutcome::Expired(a));
                }
                let revision = next_revision(c, &a.session_id, d.now_ms)?;
                let (status, always) = match d.decision {
                    Decision::Approve => (ApprovalStatus::Approved, false),
                    Decision::ApproveAlways => (ApprovalStatus::Approved, true),
                    Decision::Deny => (ApprovalStatus::Denied, false),
                };
                c.execute(
                    "UPDATE tool_approvals SET status = ?1, always = ?2, reason = ?3, \
                     decided_at = ?4, revision = ?5 WHERE id = ?6 AND status = 'pending'",
                    params![
                        status.as_str(),
                        i64::from(always),
                        d.reason,
                        d.now_ms,
                        revision,
                        d.id.to_string()
                    ],
                )?;
                if always {
                    c.execute(
                        "INSERT INTO tool_approval_grants (session_id, tool_name, approval_id, granted_at) \
                         VALUES (?1, ?2, ?3, ?4) ON CONFLICT (session_id, tool_name) DO NOTHING",
                        params![
                            a.session_id.to_string(),
                            a.tool_name,
                            d.id.to_string(),
                            d.now_ms
                        ],
                    )?;
                }
                let a = get_tx(c, &d.id)?.ok_or_else(missing)?;
                Ok(DecideOutcome::Decided(a))
            })
            .await
    }

    pub(crate) async fn expire_approvals(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<Vec<ApprovalRecord>> {
        self.db
            .write(move |c| expire_tx(c, &session_id, now_ms))
            .await
    }

    pub(crate) async fn approval_schedule(
        &self,
        session_id: SessionId,
        now_ms: i64,
    ) -> Result<ApprovalSchedule> {
        self.db
            .read(move |c| {
                // A deleted dialog's approvals wait for nothing any more.
                if require_session(c, &session_id)?.deleted_at_ms.is_some() {
                    return Ok(ApprovalSchedule::default());
                }
                let s = session_id.to_string();
                let (pending, expired, next): (i64, i64, Option<i64>) = c
                    .prepare_cached(
                        "SELECT coalesce(sum(run_id IS NULL), 0), coalesce(sum(expires_at <= ?2), 0), \
                         min(expires_at) FROM tool_approvals WHERE session_id = ?1 AND status = 'pending'",
                    )?
                    .query_row(params![s, now_ms], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
                let resumable: Option<String> = c
                    .prepare_cached(
                        "SELECT turn_id FROM tool_approvals a WHERE session_id = ?1 AND run_id IS NULL \
                         AND settled_at IS NULL AND status <> 'pending' \
                         AND NOT EXISTS (SELECT 1 FROM tool_approvals b WHERE b.session_id = a.session_id \
                             AND b.turn_id = a.turn_id AND b.run_id IS NULL AND b.status = 'pending') \
                         ORDER BY created_at, id LIMIT 1",
                    )?
                    .query_row([&s], |r| r.get(0))
                    .optional()?;
                let runs = c
                    .prepare_cached(
                        "SELECT r.id FROM agent_runs r WHERE r.root_session_id = ?1 \
                         AND r.status = 'waiting_approval' AND NOT EXISTS (SELECT 1 FROM tool_approvals a \
                             WHERE a.run_id = r.id AND a.status = 'pending') ORDER BY r.updated_at, r.id",
                    )?
                    .query_map([&s], |r| r.get::<_, String>(0))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(ApprovalSchedule {
                    pending: non_negative("pending approvals", pending)?,
                    expired: non_negative("expired approvals", expired)?,
                    next_expiry_at_ms: next,
                    resumable: resumable
                        .map(|t| parse("tool_approvals.turn_id", &t))
                        .transpose()?,
                    resumable_runs: runs
                        .iter()
                        .map(|id| parse("agent_runs.id", id))
                        .collect::<Result<_>>()?,
                })
            })
            .await
    }

    pub(crate) async fn sessions_with_open_approvals(&self) -> Result<Vec<SessionId>> {
        self.db
            .read(|c| {
                let mut stmt = c.prepare_cached(
                    "SELECT DISTINCT a.session_id FROM tool_approvals a \
                     JOIN sessions s ON s.id = a.session_id \
                     WHERE a.settled_at IS NULL AND s.deleted_at IS NULL ORDER BY a.session_id",
                )?;
                let ids = stmt
                    .query_map([], |r| r.get::<_, String>(0))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                ids.iter()
                    .map(|id| parse("tool_approvals.session_id", id))
                    .collect()
            })
            .await
    }

    pub(crate) async fn unsettled_approvals(
        &self,
        session_id: SessionId,
        turn_id: TurnId,
    ) -> Result<Vec<ApprovalRecord>> {
        self.db
            .read(move |c| {
                query(
                    c,
                    "WHERE session_id = ?1 AND turn_id = ?2 AND run_id IS NULL AND settled_at IS NULL \
                     ORDER BY created_at, id",
                    params![session_id.to_string(), turn_id.to_string()],
                )
            })
            .await
    }

    pub(crate) async fn begin_approved_execution(
        &self,
        id: ApprovalId,
        now_ms: i64,
    ) -> Result<bool> {
        self.db
            .write(move |c| {
                let n = c.execute(
                    "UPDATE tool_approvals SET executing_at = ?1 WHERE id = ?2 \
                     AND status = 'approved' AND executing_at IS NULL AND settled_at IS NULL",
                    params![now_ms, id.to_string()],
                )?;
                if n == 1 {
                    return Ok(true);
                }
                match get_tx(c, &id)? {
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
            .await
    }

    pub(crate) async fn commit_approval_results(
        &self,
        commit: ApprovalResultCommit,
    ) -> Result<TurnCommitted> {
        let encoded = encode(self.path(), &commit.turn.messages)?;
        let global = self.webhook_urls();
        let answers = !commit.turn.answers.is_empty();
        let committed = self
            .db
            .write_cached(move |c, cache| {
                let turn = commit_turn_tx(c, &commit.turn, &encoded, Some(cache), &global)?;
                let session = &commit.turn.session_id;
                let now = commit.turn.now_ms;
                let revision = next_revision(c, session, now)?;
                for id in &commit.settle {
                    let n = match &commit.supersede {
                        Some(reason) => c.execute(
                            "UPDATE tool_approvals SET status = 'superseded', reason = ?1, \
                             decided_at = ?2, settled_at = ?2, revision = ?3 \
                             WHERE id = ?4 AND session_id = ?5 AND status = 'pending'",
                            params![reason, now, revision, id.to_string(), session.to_string()],
                        )?,
                        None => c.execute(
                            "UPDATE tool_approvals SET settled_at = ?1, revision = ?2 \
                             WHERE id = ?3 AND session_id = ?4 AND status <> 'pending' \
                             AND settled_at IS NULL",
                            params![now, revision, id.to_string(), session.to_string()],
                        )?,
                    };
                    if n != 1 {
                        return Err(StoreError::Stale(format!(
                            "approval {id} is settled already or not in the expected state"
                        )));
                    }
                }
                Ok(turn)
            })
            .await?;
        if answers {
            self.wake_webhooks();
        }
        Ok(committed)
    }
}
