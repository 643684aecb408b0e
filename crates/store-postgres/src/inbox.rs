//! The durable agent inbox of a root session on PostgreSQL (keel-store's
//! `inbox.rs`, the same state machine): signals inserted with capacity and
//! dedupe, claims with a lease token — the events locked `FOR UPDATE SKIP
//! LOCKED`, so two claimers never take one event — steer admission,
//! release with backoff and dead-lettering, and the continuation-turn
//! commit that consumes the leased events with the turn's messages.

use keel_core::{Delivery, EventId, RunId, RunStatus, SessionId, TurnId};
use keel_store::{
    signal_wait_ms, ClaimRequest, ContinuationCommit, ContinuationCommitted, EventStatus,
    EventType, InboxEvent, InboxLease, InboxSchedule, NewSignal, NoticeCommit, ReleaseReport,
    ReleaseRequest, Result, ScopeKind, SignalCommit, StoreError, TurnCommitted,
    MAX_SIGNAL_PAYLOAD_BYTES, SIGNAL_KEY_SEPARATOR,
};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::store::Tx;

use crate::counters::{adjust_counters, next_revision, Revisions};
use crate::messages::{commit_turn_tx, encode, EncodedMessage};
use crate::runs::get_run_tx;
use crate::store::from_pg;
use crate::util::{fresh_id, non_negative, parse, parse_opt};
use crate::PgStore;

/// Row of a new event (internal).
pub(crate) struct NewEventRow<'a> {
    pub root_session_id: SessionId,
    pub scope: ScopeKind,
    pub scope_id: &'a str,
    pub event_type: EventType,
    pub event_key: &'a str,
    pub delivery: Delivery,
    pub requires_continuation: bool,
    pub severity: Option<&'a str>,
    pub payload_json: &'a str,
    /// Insert as already consumed (no continuation, no pending count).
    pub consumed: bool,
    pub revision: i64,
    pub now_ms: i64,
}

pub(crate) async fn insert_event_tx(tx: &Tx<'_>, e: &NewEventRow<'_>) -> Result<EventId> {
    let id = EventId::new();
    let (run_id, group_id) = match e.scope {
        ScopeKind::Run => (Some(e.scope_id), None),
        ScopeKind::Group => (None, Some(e.scope_id)),
    };
    tx.execute(
        "INSERT INTO agent_inbox_events (id, root_session_id, scope_kind, scope_id, run_id, \
         group_id, event_type, event_key, delivery, requires_continuation, severity, \
         payload_json, status, revision, created_at, consumed_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)",
        &[
            &id.to_string(),
            &e.root_session_id.to_string(),
            &e.scope.as_str(),
            &e.scope_id,
            &run_id,
            &group_id,
            &e.event_type.as_str(),
            &e.event_key,
            &e.delivery.as_str(),
            &i64::from(e.requires_continuation),
            &e.severity,
            &e.payload_json,
            &if e.consumed { "consumed" } else { "pending" },
            &e.revision,
            &e.now_ms,
            &e.consumed.then_some(e.now_ms),
        ],
    )
    .await
    .map_err(from_pg)?;
    Ok(id)
}

const EVENT_COLUMNS: &str = "id, root_session_id, scope_kind, run_id, group_id, event_type, \
    event_key, delivery, requires_continuation, severity, payload_json, status, attempt_count, \
    lease_token, lease_until, next_attempt_at, admitted_turn_id, last_error, revision, \
    created_at, consumed_at, dead_lettered_at";

fn event_from_row(r: &Row) -> Result<InboxEvent> {
    let s = |i: usize| -> String { r.get(i) };
    let requires: i64 = r.get(8);
    let attempts: i64 = r.get(12);
    Ok(InboxEvent {
        id: parse("agent_inbox_events.id", &s(0))?,
        root_session_id: parse("agent_inbox_events.root_session_id", &s(1))?,
        scope: parse("agent_inbox_events.scope_kind", &s(2))?,
        run_id: parse_opt("agent_inbox_events.run_id", r.get(3))?,
        group_id: parse_opt("agent_inbox_events.group_id", r.get(4))?,
        event_type: parse("agent_inbox_events.event_type", &s(5))?,
        event_key: s(6),
        delivery: parse("agent_inbox_events.delivery", &s(7))?,
        requires_continuation: requires != 0,
        severity: r.get(9),
        payload_json: s(10),
        status: parse("agent_inbox_events.status", &s(11))?,
        attempt_count: u32::try_from(attempts)
            .map_err(|_| StoreError::corrupt("agent_inbox_events.attempt_count", attempts))?,
        lease_token: r.get(13),
        lease_until_ms: r.get(14),
        next_attempt_at_ms: r.get(15),
        admitted_turn_id: parse_opt("agent_inbox_events.admitted_turn_id", r.get(16))?,
        last_error: r.get(17),
        revision: non_negative("agent_inbox_events.revision", r.get(18))?,
        created_at_ms: r.get(19),
        consumed_at_ms: r.get(20),
        dead_lettered_at_ms: r.get(21),
    })
}

/// The events `where_sql` (a `WHERE …`/`ORDER BY …` tail over
/// `agent_inbox_events`) selects.
pub(crate) async fn query_events(
    tx: &Tx<'_>,
    where_sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<InboxEvent>> {
    tx.query(
        &format!("SELECT {EVENT_COLUMNS} FROM agent_inbox_events {where_sql}"),
        params,
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(event_from_row)
    .collect()
}

async fn get_event(tx: &Tx<'_>, id: &EventId) -> Result<Option<InboxEvent>> {
    Ok(query_events(tx, "WHERE id = $1", &[&id.to_string()])
        .await?
        .pop())
}

async fn insert_signal_tx(tx: &Tx<'_>, s: &NewSignal) -> Result<SignalCommit> {
    if s.payload_json.len() > MAX_SIGNAL_PAYLOAD_BYTES {
        return Err(StoreError::InvalidInput(format!(
            "signal payload is {} bytes, more than {MAX_SIGNAL_PAYLOAD_BYTES}",
            s.payload_json.len()
        )));
    }
    let run = get_run_tx(tx, &s.run_id)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("run {}", s.run_id)))?;
    if run.spec.execution_id != s.execution_id
        || !matches!(run.status, RunStatus::Running | RunStatus::WaitingChildren)
    {
        return Err(StoreError::Stale(format!(
            "run {} is {} or owned by another execution; signal dropped",
            s.run_id, run.status
        )));
    }
    let run_key = s.run_id.to_string();
    // Every signal the run emitted, oldest first (at most max_signals rows).
    let emitted = query_events(
        tx,
        "WHERE scope_kind = 'run' AND scope_id = $1 AND event_type = 'signal' \
         ORDER BY created_at, id",
        &[&run_key],
    )
    .await?;
    if let Some(key) = &s.dedupe_key {
        let window = i64::try_from(s.limits.dedupe_window_ms).unwrap_or(i64::MAX);
        let same_key = emitted.iter().rev().find(|e| {
            e.event_key
                .rsplit_once(SIGNAL_KEY_SEPARATOR)
                .is_some_and(|(k, _)| k == key)
        });
        if let Some(e) = same_key.filter(|e| s.now_ms.saturating_sub(e.created_at_ms) < window) {
            return Ok(SignalCommit::Deduplicated { event_id: e.id });
        }
    }
    if emitted.len() >= s.limits.max_signals as usize {
        return Ok(SignalCommit::TooMany {
            max_signals: s.limits.max_signals,
        });
    }
    let times: Vec<i64> = emitted.iter().map(|e| e.created_at_ms).collect();
    let wait = signal_wait_ms(&times, s.limits.burst, s.limits.min_interval_ms, s.now_ms);
    if wait > 0 {
        return Ok(SignalCommit::TooSoon {
            retry_after_ms: wait,
        });
    }
    let root = &run.spec.root_session_id;
    // Capacity counts reserved completions, so signals can never crowd them out.
    adjust_counters(tx, root, 1, 0, Some(s.inbox_capacity), s.now_ms).await?;
    let revision = next_revision(tx, root, s.now_ms).await?;
    let event_key = format!(
        "{}{SIGNAL_KEY_SEPARATOR}{}",
        s.dedupe_key.as_deref().unwrap_or(""),
        fresh_id()
    );
    let event_id = insert_event_tx(
        tx,
        &NewEventRow {
            root_session_id: *root,
            scope: ScopeKind::Run,
            scope_id: &run_key,
            event_type: EventType::Signal,
            event_key: &event_key,
            delivery: s.delivery,
            requires_continuation: true,
            severity: s.severity.as_deref(),
            payload_json: &s.payload_json,
            consumed: false,
            revision,
            now_ms: s.now_ms,
        },
    )
    .await?;
    Ok(SignalCommit::Accepted { event_id })
}

/// Pending signals of a cancelled run become superseded (a signal already
/// held by a turn is left to that turn). Returns how many.
pub(crate) async fn supersede_run_signals_tx(
    tx: &Tx<'_>,
    run_id: &RunId,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    let Some(run) = get_run_tx(tx, run_id).await? else {
        return Ok(0);
    };
    let root = run.spec.root_session_id;
    let open: i64 = tx
        .query_one(
            "SELECT count(*) FROM agent_inbox_events WHERE scope_kind = 'run' \
             AND scope_id = $1 AND event_type = 'signal' AND status = 'pending'",
            &[&run_id.to_string()],
        )
        .await
        .map_err(from_pg)?
        .get(0);
    if open == 0 {
        return Ok(0);
    }
    let revision = revisions.of(tx, &root, now_ms).await?;
    let n = tx
        .execute(
            "UPDATE agent_inbox_events SET status = 'superseded', superseded_at = $1, \
             revision = $2 WHERE scope_kind = 'run' AND scope_id = $3 \
             AND event_type = 'signal' AND status = 'pending'",
            &[&now_ms, &revision, &run_id.to_string()],
        )
        .await
        .map_err(from_pg)?;
    adjust_counters(tx, &root, -i64::try_from(n).unwrap_or(0), 0, None, now_ms).await?;
    Ok(n)
}

async fn claim_tx(tx: &Tx<'_>, req: &ClaimRequest) -> Result<Option<InboxLease>> {
    if req.max_events == 0 || req.lease_ms <= 0 {
        return Err(StoreError::InvalidInput(
            "a claim needs max_events >= 1 and a positive lease".into(),
        ));
    }
    // Locked as read: a concurrent claimer skips these rows rather than
    // waiting for them (or being aborted for them) and takes the next ones.
    let due = query_events(
        tx,
        "WHERE root_session_id = $1 AND status = 'pending' \
           AND (next_attempt_at IS NULL OR next_attempt_at <= $2) \
           AND ($3::text IS NULL OR delivery = $3) \
         ORDER BY created_at, id LIMIT $4 FOR UPDATE SKIP LOCKED",
        &[
            &req.root_session_id.to_string(),
            &req.now_ms,
            &req.delivery.map(Delivery::as_str),
            &i64::try_from(req.max_events).unwrap_or(i64::MAX),
        ],
    )
    .await?;
    let mut bytes = 0usize;
    let mut batch = Vec::new();
    for e in due {
        bytes += e.payload_json.len();
        if !batch.is_empty() && bytes > req.max_bytes {
            break;
        }
        batch.push(e);
    }
    if batch.is_empty() {
        return Ok(None);
    }
    let token = fresh_id();
    let until = req.now_ms.saturating_add(req.lease_ms);
    let revision = next_revision(tx, &req.root_session_id, req.now_ms).await?;
    let ids: Vec<String> = batch.iter().map(|e| e.id.to_string()).collect();
    tx.execute(
        "UPDATE agent_inbox_events SET status = 'leased', lease_token = $1, lease_until = $2, \
         revision = $3 WHERE id = ANY($4) AND status = 'pending'",
        &[&token, &until, &revision, &ids],
    )
    .await
    .map_err(from_pg)?;
    for e in &mut batch {
        e.status = EventStatus::Leased;
        e.lease_token = Some(token.clone());
        e.lease_until_ms = Some(until);
        e.revision = non_negative("revision", revision)?;
    }
    Ok(Some(InboxLease {
        token,
        lease_until_ms: until,
        events: batch,
    }))
}

/// Root session of the events, checking they all hold `token` in one of `statuses`.
async fn leased_root(
    tx: &Tx<'_>,
    ids: &[EventId],
    token: &str,
    statuses: &[EventStatus],
) -> Result<SessionId> {
    let mut root = None;
    for id in ids {
        let e = get_event(tx, id)
            .await?
            .ok_or_else(|| StoreError::NotFound(format!("inbox event {id}")))?;
        if e.lease_token.as_deref() != Some(token) || !statuses.contains(&e.status) {
            return Err(StoreError::Stale(format!(
                "inbox event {id} is {} and no longer held by this lease",
                e.status.as_str()
            )));
        }
        if root.is_some_and(|r| r != e.root_session_id) {
            return Err(StoreError::InvalidInput(
                "events of one lease belong to one root session".into(),
            ));
        }
        root = Some(e.root_session_id);
    }
    root.ok_or_else(|| StoreError::InvalidInput("no event ids given".into()))
}

async fn admit_tx(
    tx: &Tx<'_>,
    ids: &[EventId],
    token: &str,
    turn: &TurnId,
    now_ms: i64,
) -> Result<u64> {
    let root = leased_root(tx, ids, token, &[EventStatus::Leased]).await?;
    let revision = next_revision(tx, &root, now_ms).await?;
    let mut n = 0;
    for id in ids {
        n += tx
            .execute(
                "UPDATE agent_inbox_events SET status = 'admitted', admitted_turn_id = $1, \
                 revision = $2 WHERE id = $3 AND lease_token = $4 AND status = 'leased'",
                &[&turn.to_string(), &revision, &id.to_string(), &token],
            )
            .await
            .map_err(from_pg)?;
    }
    Ok(n)
}

async fn release_tx(tx: &Tx<'_>, req: &ReleaseRequest) -> Result<ReleaseReport> {
    let root = leased_root(
        tx,
        &req.event_ids,
        &req.lease_token,
        &[EventStatus::Leased, EventStatus::Admitted],
    )
    .await?;
    let revision = next_revision(tx, &root, req.now_ms).await?;
    let mut report = ReleaseReport::default();
    if !req.count_attempt {
        for id in &req.event_ids {
            report.released += tx
                .execute(
                    "UPDATE agent_inbox_events SET status = 'pending', lease_token = NULL, \
                     lease_until = NULL, admitted_turn_id = NULL, revision = $1 WHERE id = $2",
                    &[&revision, &id.to_string()],
                )
                .await
                .map_err(from_pg)?;
        }
        return Ok(report);
    }
    let max_attempts = i64::from(req.max_attempts);
    for id in &req.event_ids {
        let dead: bool = tx
            .query_one(
                "SELECT attempt_count + 1 >= $1 FROM agent_inbox_events WHERE id = $2",
                &[&max_attempts, &id.to_string()],
            )
            .await
            .map_err(from_pg)?
            .get(0);
        if dead {
            tx.execute(
                "UPDATE agent_inbox_events SET status = 'dead_letter', \
                 attempt_count = attempt_count + 1, lease_token = NULL, lease_until = NULL, \
                 last_error = $1, dead_lettered_at = $2, revision = $3 WHERE id = $4",
                &[&req.error, &req.now_ms, &revision, &id.to_string()],
            )
            .await
            .map_err(from_pg)?;
            report.dead_lettered += 1;
        } else {
            tx.execute(
                "UPDATE agent_inbox_events SET status = 'pending', \
                 attempt_count = attempt_count + 1, lease_token = NULL, lease_until = NULL, \
                 admitted_turn_id = NULL, next_attempt_at = $1, last_error = $2, revision = $3 \
                 WHERE id = $4",
                &[
                    &req.now_ms.saturating_add(req.backoff_ms.max(0)),
                    &req.error,
                    &revision,
                    &id.to_string(),
                ],
            )
            .await
            .map_err(from_pg)?;
            report.released += 1;
        }
    }
    adjust_counters(
        tx,
        &root,
        -i64::try_from(report.dead_lettered).unwrap_or(0),
        0,
        None,
        req.now_ms,
    )
    .await?;
    Ok(report)
}

async fn dead_letter_tx(tx: &Tx<'_>, ids: &[EventId], reason: &str, now_ms: i64) -> Result<u64> {
    let mut n = 0u64;
    let mut revisions = Revisions::default();
    for id in ids {
        let Some(e) = get_event(tx, id).await? else {
            return Err(StoreError::NotFound(format!("inbox event {id}")));
        };
        if !matches!(
            e.status,
            EventStatus::Pending | EventStatus::Leased | EventStatus::Admitted
        ) {
            continue;
        }
        let revision = revisions.of(tx, &e.root_session_id, now_ms).await?;
        tx.execute(
            "UPDATE agent_inbox_events SET status = 'dead_letter', lease_token = NULL, \
             lease_until = NULL, last_error = $1, dead_lettered_at = $2, revision = $3 \
             WHERE id = $4",
            &[&reason, &now_ms, &revision, &id.to_string()],
        )
        .await
        .map_err(from_pg)?;
        adjust_counters(tx, &e.root_session_id, -1, 0, None, now_ms).await?;
        n += 1;
    }
    Ok(n)
}

/// Dead-letters every open event of a root session (session archived or
/// deleted; no fallback notice).
pub(crate) async fn dead_letter_session_tx(
    tx: &Tx<'_>,
    root: &SessionId,
    reason: &str,
    revision: i64,
    now_ms: i64,
) -> Result<u64> {
    let n = tx
        .execute(
            "UPDATE agent_inbox_events SET status = 'dead_letter', lease_token = NULL, \
             lease_until = NULL, last_error = $1, fallback_suppressed_reason = $1, \
             dead_lettered_at = $2, revision = $3 \
             WHERE root_session_id = $4 AND status IN ('pending', 'leased', 'admitted')",
            &[&reason, &now_ms, &revision, &root.to_string()],
        )
        .await
        .map_err(from_pg)?;
    adjust_counters(tx, root, -i64::try_from(n).unwrap_or(0), 0, None, now_ms).await?;
    Ok(n)
}

/// Leased/admitted events whose lease ends by `cutoff_ms` back to pending
/// with one more attempt, due at `now_ms`.
pub(crate) async fn expire_leases_tx(
    tx: &Tx<'_>,
    cutoff_ms: i64,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    let roots = roots_where(
        tx,
        "status IN ('leased', 'admitted') AND lease_until <= $1",
        &[&cutoff_ms],
    )
    .await?;
    let mut n = 0;
    for root in &roots {
        let revision = revisions.of(tx, root, now_ms).await?;
        n += tx
            .execute(
                "UPDATE agent_inbox_events SET status = 'pending', lease_token = NULL, \
                 lease_until = NULL, admitted_turn_id = NULL, \
                 attempt_count = attempt_count + 1, next_attempt_at = $1, \
                 last_error = 'lease expired', revision = $2 \
                 WHERE root_session_id = $3 AND status IN ('leased', 'admitted') \
                   AND lease_until <= $4",
                &[&now_ms, &revision, &root.to_string(), &cutoff_ms],
            )
            .await
            .map_err(from_pg)?;
    }
    Ok(n)
}

/// Leased/admitted events of root sessions no process leases (their
/// holder died: every claim is made under the session's lease) back to
/// pending with one more attempt, due at `now_ms`. Dead processes' session
/// leases must be freed first.
pub(crate) async fn release_orphaned_leases_tx(
    tx: &Tx<'_>,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    const ORPHANED: &str = "status IN ('leased', 'admitted') AND root_session_id NOT IN \
         (SELECT session_id FROM session_leases WHERE generation IS NOT NULL)";
    let mut n = 0;
    for root in &roots_where(tx, ORPHANED, &[]).await? {
        n += release_leases_of_tx(tx, root, now_ms, revisions).await?;
    }
    Ok(n)
}

/// The root sessions of the inbox events matching `condition`.
async fn roots_where(
    tx: &Tx<'_>,
    condition: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<SessionId>> {
    tx.query(
        &format!("SELECT DISTINCT root_session_id FROM agent_inbox_events WHERE {condition}"),
        params,
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(|r| parse::<SessionId>("agent_inbox_events.root_session_id", &r.get::<_, String>(0)))
    .collect()
}

/// Every leased or admitted event of `root` back to pending with one more
/// attempt, due at `now_ms`: their holder stopped.
pub(crate) async fn release_leases_of_tx(
    tx: &Tx<'_>,
    root: &SessionId,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    let revision = revisions.of(tx, root, now_ms).await?;
    tx.execute(
        "UPDATE agent_inbox_events SET status = 'pending', lease_token = NULL, \
         lease_until = NULL, admitted_turn_id = NULL, \
         attempt_count = attempt_count + 1, next_attempt_at = $1, \
         last_error = 'lease holder stopped', revision = $2 \
         WHERE root_session_id = $3 AND status IN ('leased', 'admitted')",
        &[&now_ms, &revision, &root.to_string()],
    )
    .await
    .map_err(from_pg)
}

/// Root sessions whose inbox has work: pending events (due, or backing off
/// until a retry time), or dead letters whose user was not told yet.
pub(crate) async fn sessions_with_inbox_work_tx(tx: &Tx<'_>) -> Result<Vec<SessionId>> {
    tx.query(
        &format!(
            "SELECT DISTINCT root_session_id FROM agent_inbox_events \
             WHERE status = 'pending' OR ({UNNOTIFIED}) ORDER BY root_session_id"
        ),
        &[],
    )
    .await
    .map_err(from_pg)?
    .iter()
    .map(|r| parse("agent_inbox_events.root_session_id", &r.get::<_, String>(0)))
    .collect()
}

/// When an event's time to live (`$3`) ends, as an SQL expression.
const EXPIRY: &str = "(created_at::numeric + $3::bigint)";

/// Dead letters whose user was not told (and should be), as an SQL condition.
const UNNOTIFIED: &str = "status = 'dead_letter' AND fallback_notified_at IS NULL \
     AND fallback_suppressed_reason IS NULL";

pub(crate) async fn continuation_tx(
    tx: &Tx<'_>,
    c: &ContinuationCommit,
    messages: &[EncodedMessage],
) -> Result<ContinuationCommitted> {
    let mut root = None;
    for lease in &c.consumed {
        let r = leased_root(
            tx,
            &lease.event_ids,
            &lease.lease_token,
            &[EventStatus::Leased, EventStatus::Admitted],
        )
        .await?;
        if root.is_some_and(|root| root != r) || r != c.turn.session_id {
            return Err(StoreError::InvalidInput(
                "a turn consumes only its own session's inbox events".into(),
            ));
        }
        root = Some(r);
    }
    let root = root.ok_or_else(|| StoreError::InvalidInput("no events to consume".into()))?;
    let turn = commit_turn_tx(tx, &c.turn, messages, &[]).await?;
    let revision = next_revision(tx, &root, c.turn.now_ms).await?;
    let mut consumed = 0u64;
    for lease in &c.consumed {
        let ids: Vec<String> = lease.event_ids.iter().map(ToString::to_string).collect();
        consumed += tx
            .execute(
                "UPDATE agent_inbox_events SET status = 'consumed', consumed_at = $1, \
                 lease_token = NULL, lease_until = NULL, revision = $2 \
                 WHERE id = ANY($3) AND lease_token = $4 AND status IN ('leased', 'admitted')",
                &[&c.turn.now_ms, &revision, &ids, &lease.lease_token],
            )
            .await
            .map_err(from_pg)?;
    }
    adjust_counters(
        tx,
        &root,
        -i64::try_from(consumed).unwrap_or(0),
        0,
        None,
        c.turn.now_ms,
    )
    .await?;
    Ok(ContinuationCommitted { turn, consumed })
}

impl PgStore {
    pub(crate) async fn insert_signal(&self, signal: NewSignal) -> Result<SignalCommit> {
        self.write(move |tx| {
            let signal = signal.clone();
            Box::pin(async move { insert_signal_tx(tx, &signal).await })
        })
        .await
    }

    pub(crate) async fn claim_inbox_batch(
        &self,
        request: ClaimRequest,
    ) -> Result<Option<InboxLease>> {
        self.write(move |tx| {
            let request = request.clone();
            Box::pin(async move { claim_tx(tx, &request).await })
        })
        .await
    }

    pub(crate) async fn admit_inbox_events(
        &self,
        event_ids: Vec<EventId>,
        lease_token: String,
        turn_id: TurnId,
        now_ms: i64,
    ) -> Result<u64> {
        self.write(move |tx| {
            let (event_ids, lease_token) = (event_ids.clone(), lease_token.clone());
            Box::pin(async move { admit_tx(tx, &event_ids, &lease_token, &turn_id, now_ms).await })
        })
        .await
    }

    pub(crate) async fn release_inbox_lease(
        &self,
        request: ReleaseRequest,
    ) -> Result<ReleaseReport> {
        self.write(move |tx| {
            let request = request.clone();
            Box::pin(async move { release_tx(tx, &request).await })
        })
        .await
    }

    pub(crate) async fn dead_letter_events(
        &self,
        event_ids: Vec<EventId>,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        self.write(move |tx| {
            let (event_ids, reason) = (event_ids.clone(), reason.clone());
            Box::pin(async move { dead_letter_tx(tx, &event_ids, &reason, now_ms).await })
        })
        .await
    }

    pub(crate) async fn commit_continuation_turn(
        &self,
        commit: ContinuationCommit,
    ) -> Result<ContinuationCommitted> {
        let encoded = encode(&commit.turn.messages)?;
        self.write(move |tx| {
            let (commit, encoded) = (commit.clone(), encoded.clone());
            Box::pin(async move { continuation_tx(tx, &commit, &encoded).await })
        })
        .await
    }

    pub(crate) async fn unnotified_dead_letters(
        &self,
        root_session_id: SessionId,
    ) -> Result<Vec<InboxEvent>> {
        self.read(move |tx| {
            Box::pin(async move {
                query_events(
                    tx,
                    &format!("WHERE root_session_id = $1 AND {UNNOTIFIED} ORDER BY created_at, id"),
                    &[&root_session_id.to_string()],
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn commit_dead_letter_notice(
        &self,
        commit: NoticeCommit,
    ) -> Result<TurnCommitted> {
        let encoded = encode(&commit.turn.messages)?;
        self.write(move |tx| {
            let (commit, encoded) = (commit.clone(), encoded.clone());
            Box::pin(async move {
                let turn = commit_turn_tx(tx, &commit.turn, &encoded, &[]).await?;
                let session = commit.turn.session_id;
                let revision = next_revision(tx, &session, commit.turn.now_ms).await?;
                for id in &commit.event_ids {
                    let n = tx
                        .execute(
                            &format!(
                                "UPDATE agent_inbox_events SET fallback_notified_at = $1, \
                                 revision = $2 WHERE id = $3 AND root_session_id = $4 \
                                 AND {UNNOTIFIED}"
                            ),
                            &[
                                &commit.turn.now_ms,
                                &revision,
                                &id.to_string(),
                                &session.to_string(),
                            ],
                        )
                        .await
                        .map_err(from_pg)?;
                    if n != 1 {
                        return Err(StoreError::Stale(format!(
                            "inbox event {id} is not an untold dead letter of this session"
                        )));
                    }
                }
                Ok(turn)
            })
        })
        .await
    }

    pub(crate) async fn supersede_run_signals(&self, run_id: RunId, now_ms: i64) -> Result<u64> {
        self.write(move |tx| {
            Box::pin(async move {
                supersede_run_signals_tx(tx, &run_id, now_ms, &mut Revisions::default()).await
            })
        })
        .await
    }

    pub(crate) async fn list_signals(
        &self,
        root_session_id: SessionId,
        limit: usize,
    ) -> Result<Vec<InboxEvent>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read(move |tx| {
            Box::pin(async move {
                query_events(
                    tx,
                    "WHERE root_session_id = $1 AND event_type = 'signal' \
                     ORDER BY created_at DESC, id DESC LIMIT $2",
                    &[&root_session_id.to_string(), &limit],
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn list_inbox_events(
        &self,
        root_session_id: SessionId,
    ) -> Result<Vec<InboxEvent>> {
        self.read(move |tx| {
            Box::pin(async move {
                query_events(
                    tx,
                    "WHERE root_session_id = $1 ORDER BY created_at, id",
                    &[&root_session_id.to_string()],
                )
                .await
            })
        })
        .await
    }

    pub(crate) async fn inbox_schedule(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<InboxSchedule> {
        // Read after every turn: one statement, one round trip.
        self.one_statement(move |tx| {
            Box::pin(inbox_schedule_on(tx, root_session_id, now_ms, ttl_ms))
        })
        .await
    }

    /// The approval and inbox schedules of `session_id`, the two statements
    /// sent at once on one connection: one round trip.
    pub(crate) async fn schedules(
        &self,
        session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<(keel_store::ApprovalSchedule, InboxSchedule)> {
        self.one_statement(move |tx| {
            Box::pin(async move {
                futures::try_join!(
                    crate::approvals::approval_schedule_on(tx, session_id, now_ms),
                    inbox_schedule_on(tx, session_id, now_ms, ttl_ms),
                )
            })
        })
        .await
    }

    pub(crate) async fn dead_letter_expired_events(
        &self,
        root_session_id: SessionId,
        created_by_ms: i64,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        self.write(move |tx| {
            let reason = reason.clone();
            Box::pin(async move {
                let revision = next_revision(tx, &root_session_id, now_ms).await?;
                let n = tx
                    .execute(
                        "UPDATE agent_inbox_events SET status = 'dead_letter', last_error = $1, \
                         dead_lettered_at = $2, revision = $3 \
                         WHERE root_session_id = $4 AND status = 'pending' AND created_at <= $5",
                        &[
                            &reason,
                            &now_ms,
                            &revision,
                            &root_session_id.to_string(),
                            &created_by_ms,
                        ],
                    )
                    .await
                    .map_err(from_pg)?;
                adjust_counters(
                    tx,
                    &root_session_id,
                    -i64::try_from(n).unwrap_or(0),
                    0,
                    None,
                    now_ms,
                )
                .await?;
                Ok(n)
            })
        })
        .await
    }
}

/// When `root_session_id`'s inbox has work at `now_ms`, in one statement.
async fn inbox_schedule_on(
    tx: &Tx<'_>,
    root_session_id: SessionId,
    now_ms: i64,
    ttl_ms: i64,
) -> Result<InboxSchedule> {
    // Expiry (`created_at + ttl`) is computed in numeric: a ttl saturated
    // to i64::MAX would overflow BIGINT (an error here; SQLite goes on in
    // floating point). The least of it and a BIGINT retry time fits BIGINT
    // again.
    let r = tx
        .query_one(
            &format!(
                "SELECT min(created_at) FILTER (WHERE status = 'pending' AND \
                          (next_attempt_at IS NULL OR next_attempt_at <= $2)), \
                        (min(LEAST(next_attempt_at, {EXPIRY})) FILTER (WHERE \
                          status = 'pending' AND next_attempt_at > $2 \
                          AND {EXPIRY} > $2))::bigint, \
                        count(*) FILTER (WHERE status = 'pending' \
                          AND next_attempt_at > $2 AND {EXPIRY} <= $2), \
                        count(*) FILTER (WHERE {UNNOTIFIED}) \
                 FROM agent_inbox_events WHERE root_session_id = $1 \
                   AND status IN ('pending', 'dead_letter')"
            ),
            &[&root_session_id.to_string(), &now_ms, &ttl_ms],
        )
        .await
        .map_err(from_pg)?;
    Ok(InboxSchedule {
        oldest_due_at_ms: r.get(0),
        next_due_at_ms: r.get(1),
        expired: non_negative("expired events", r.get(2))?,
        untold_dead_letters: non_negative("dead letters", r.get(3))?,
    })
}
