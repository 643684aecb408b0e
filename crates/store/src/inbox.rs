//! The durable agent inbox of a root session: signals inserted with
//! capacity and dedupe, claims with a lease token, steer admission, release
//! with backoff and dead-lettering, and the continuation-turn commit that
//! consumes the leased events together with the turn's messages.

use keel_core::{text_enum, Delivery, EventId, GroupId, RunId, RunStatus, SessionId, TurnId};
use rusqlite::{params, Connection, Row};

use crate::counters::{adjust_counters, next_revision, Revisions};
use crate::db::WriteCache;
use crate::error::{Result, StoreError};
use crate::messages::{commit_turn_tx, encode, EncodedMessage, TurnCommit, TurnCommitted};
use crate::runs::get_run_tx;
use crate::util::{fresh_id, non_negative, parse, parse_opt};
use crate::SqliteStore;

/// Longest accepted signal payload, in bytes.
pub const MAX_SIGNAL_PAYLOAD_BYTES: usize = 64 * 1024;

text_enum!(
    /// What an event is about.
    ScopeKind, "event scope" {
        /// One run.
        Run = "run",
        /// A group of runs.
        Group = "group",
    }
);

text_enum!(
    /// Kind of inbox event.
    EventType, "event type" {
        /// A signal emitted by a running background run.
        Signal = "signal",
        /// A run's completion.
        Completion = "completion",
        /// A group's completion (policy all).
        GroupCompletion = "group_completion",
    }
);

text_enum!(
    /// Lifecycle of an inbox event.
    EventStatus, "event status" {
        /// Waiting to be claimed.
        Pending = "pending",
        /// Claimed under a lease token.
        Leased = "leased",
        /// Admitted into a running turn (steer).
        Admitted = "admitted",
        /// Consumed by a committed turn.
        Consumed = "consumed",
        /// Replaced by a later fact (a cancelled run's signals).
        Superseded = "superseded",
        /// Given up on (max attempts, session cancelled or deleted).
        DeadLetter = "dead_letter",
    }
);

/// A stored inbox event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxEvent {
    /// Its id.
    pub id: EventId,
    /// The root session whose inbox holds it.
    pub root_session_id: SessionId,
    /// Run or group scope.
    pub scope: ScopeKind,
    /// The run, for run scope.
    pub run_id: Option<RunId>,
    /// The group, for group scope.
    pub group_id: Option<GroupId>,
    /// Signal, completion or group completion.
    pub event_type: EventType,
    /// Dedupe key within (scope, type).
    pub event_key: String,
    /// Queue or steer.
    pub delivery: Delivery,
    /// Whether it should start a continuation turn.
    pub requires_continuation: bool,
    /// Severity of a signal.
    pub severity: Option<String>,
    /// Payload (JSON).
    pub payload_json: String,
    /// Status.
    pub status: EventStatus,
    /// Failed delivery attempts so far.
    pub attempt_count: u32,
    /// Current lease token.
    pub lease_token: Option<String>,
    /// Lease expiry (ms).
    pub lease_until_ms: Option<i64>,
    /// Not claimable before (ms).
    pub next_attempt_at_ms: Option<i64>,
    /// The turn it was admitted into.
    pub admitted_turn_id: Option<TurnId>,
    /// Last delivery error.
    pub last_error: Option<String>,
    /// Client revision of its last change.
    pub revision: u64,
    /// Creation time (ms).
    pub created_at_ms: i64,
    /// Consumption time (ms).
    pub consumed_at_ms: Option<i64>,
    /// Dead-letter time (ms).
    pub dead_lettered_at_ms: Option<i64>,
}

/// The per-run limits of a signal contract that [`Backend::insert_signal`](crate::Backend::insert_signal)
/// checks in its transaction (so parallel emits of one run cannot pass
/// them together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignalLimits {
    /// Signals one run may emit in total.
    pub max_signals: u32,
    /// Signals allowed back to back; the allowance refills one signal per
    /// `min_interval_ms`.
    pub burst: u32,
    /// Milliseconds to refill one signal of the burst allowance.
    pub min_interval_ms: u64,
    /// A signal repeating a dedupe key within this many milliseconds of
    /// the key's last accepted signal returns that signal (0: never).
    pub dedupe_window_ms: u64,
}

/// A signal from a running background run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSignal {
    /// The emitting run.
    pub run_id: RunId,
    /// Its execution (must still own the run).
    pub execution_id: String,
    /// Dedupe key, if the agent gave one (see [`SignalLimits::dedupe_window_ms`]).
    pub dedupe_key: Option<String>,
    /// Queue or steer.
    pub delivery: Delivery,
    /// Severity.
    pub severity: Option<String>,
    /// Payload (JSON, at most [`MAX_SIGNAL_PAYLOAD_BYTES`]).
    pub payload_json: String,
    /// Inbox capacity of the root session.
    pub inbox_capacity: u32,
    /// The contract's count, rate and dedupe limits.
    pub limits: SignalLimits,
    /// Now (ms).
    pub now_ms: i64,
}

/// Result of [`Backend::insert_signal`](crate::Backend::insert_signal): written, deduplicated, or refused by
/// a limit (nothing written).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignalCommit {
    /// A new pending event.
    Accepted {
        /// The event.
        event_id: EventId,
    },
    /// The dedupe key matched a signal within the window; nothing was written.
    Deduplicated {
        /// The earlier signal.
        event_id: EventId,
    },
    /// The run already emitted `max_signals` signals.
    TooMany {
        /// The limit.
        max_signals: u32,
    },
    /// The burst allowance is spent; a signal fits again after this wait.
    TooSoon {
        /// Milliseconds until the next signal is allowed.
        retry_after_ms: u64,
    },
}

/// Claim due pending events of one root session under a fresh lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The root session.
    pub root_session_id: SessionId,
    /// Now (ms).
    pub now_ms: i64,
    /// Lease length (ms).
    pub lease_ms: i64,
    /// Most events in the batch (at least 1).
    pub max_events: usize,
    /// Most payload bytes in the batch (the first event is always taken).
    pub max_bytes: usize,
    /// Only events with this delivery, if set.
    pub delivery: Option<Delivery>,
}

/// A claimed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxLease {
    /// The token every follow-up (admit, release, commit) must present.
    pub token: String,
    /// Lease expiry (ms).
    pub lease_until_ms: i64,
    /// The events, oldest first.
    pub events: Vec<InboxEvent>,
}

/// Give leased events back after a failed delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseRequest {
    /// The events.
    pub event_ids: Vec<EventId>,
    /// Their lease token.
    pub lease_token: String,
    /// Now (ms).
    pub now_ms: i64,
    /// Not claimable again before now + backoff (ms).
    pub backoff_ms: i64,
    /// Dead-letter an event once its attempt count reaches this.
    pub max_attempts: u32,
    /// Whether this counts as a failed delivery attempt. A turn that was
    /// stopped, or one that ended before reading steered events, did not
    /// fail to deliver them: their attempt count and backoff stay as they are.
    pub count_attempt: bool,
    /// Why delivery failed.
    pub error: Option<String>,
}

/// Result of [`Backend::release_inbox_lease`](crate::Backend::release_inbox_lease).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReleaseReport {
    /// Events back to pending.
    pub released: u64,
    /// Events dead-lettered (attempts exhausted).
    pub dead_lettered: u64,
}

/// Inbox events held under one lease token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedEvents {
    /// The token the events hold.
    pub lease_token: String,
    /// The events.
    pub event_ids: Vec<EventId>,
}

/// A turn that consumes inbox events: a continuation (its hidden trigger,
/// assistant/tool messages, state, checkpoint) and the events it answered,
/// or any turn into which steered events were read.
#[derive(Debug, Clone, PartialEq)]
pub struct ContinuationCommit {
    /// The turn.
    pub turn: TurnCommit,
    /// The events the turn consumed, by lease (all of one root session).
    pub consumed: Vec<LeasedEvents>,
}

/// A notice in a session's history about dead-lettered events, committed
/// with the marks that say their user was told.
#[derive(Debug, Clone, PartialEq)]
pub struct NoticeCommit {
    /// The notice (messages and state, like a turn).
    pub turn: TurnCommit,
    /// The dead-lettered events it tells of.
    pub event_ids: Vec<EventId>,
}

/// Result of [`Backend::commit_continuation_turn`](crate::Backend::commit_continuation_turn).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContinuationCommitted {
    /// What the turn commit assigned.
    pub turn: TurnCommitted,
    /// Events consumed.
    pub consumed: u64,
}

/// When a root session's inbox has work (see [`Backend::inbox_schedule`](crate::Backend::inbox_schedule)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxSchedule {
    /// Creation time of the oldest pending event that is due now (ms).
    pub oldest_due_at_ms: Option<i64>,
    /// When the inbox next has work without a wake (ms): the earliest retry
    /// time or time-to-live expiry of a pending event not yet due.
    pub next_due_at_ms: Option<i64>,
    /// Pending events past their time to live while backing off (dead-letter
    /// them with [`Backend::dead_letter_expired_events`](crate::Backend::dead_letter_expired_events)).
    pub expired: u64,
    /// Dead letters whose user was not told yet.
    pub untold_dead_letters: u64,
}

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

pub(crate) fn insert_event_tx(conn: &Connection, e: &NewEventRow<'_>) -> Result<EventId> {
    let id = EventId::new();
    let (run_id, group_id) = match e.scope {
        ScopeKind::Run => (Some(e.scope_id), None),
        ScopeKind::Group => (None, Some(e.scope_id)),
    };
    conn.prepare_cached(
        "INSERT INTO agent_inbox_events (id, root_session_id, scope_kind, scope_id, run_id, \
         group_id, event_type, event_key, delivery, requires_continuation, severity, \
         payload_json, status, revision, created_at, consumed_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
    )?
    .execute(params![
        id.to_string(),
        e.root_session_id.to_string(),
        e.scope.as_str(),
        e.scope_id,
        run_id,
        group_id,
        e.event_type.as_str(),
        e.event_key,
        e.delivery.as_str(),
        e.requires_continuation,
        e.severity,
        e.payload_json,
        if e.consumed { "consumed" } else { "pending" },
        e.revision,
        e.now_ms,
        e.consumed.then_some(e.now_ms),
    ])?;
    Ok(id)
}

const EVENT_COLUMNS: &str = "id, root_session_id, scope_kind, run_id, group_id, event_type, \
    event_key, delivery, requires_continuation, severity, payload_json, status, attempt_count, \
    lease_token, lease_until, next_attempt_at, admitted_turn_id, last_error, revision, \
    created_at, consumed_at, dead_lettered_at";

fn event_from_row(r: &Row<'_>) -> Result<InboxEvent> {
    let s = |i: usize| -> Result<String> { Ok(r.get::<_, String>(i)?) };
    let requires: i64 = r.get(8)?;
    let attempts: i64 = r.get(12)?;
    Ok(InboxEvent {
        id: parse("agent_inbox_events.id", &s(0)?)?,
        root_session_id: parse("agent_inbox_events.root_session_id", &s(1)?)?,
        scope: parse("agent_inbox_events.scope_kind", &s(2)?)?,
        run_id: parse_opt("agent_inbox_events.run_id", r.get(3)?)?,
        group_id: parse_opt("agent_inbox_events.group_id", r.get(4)?)?,
        event_type: parse("agent_inbox_events.event_type", &s(5)?)?,
        event_key: s(6)?,
        delivery: parse("agent_inbox_events.delivery", &s(7)?)?,
        requires_continuation: requires != 0,
        severity: r.get(9)?,
        payload_json: s(10)?,
        status: parse("agent_inbox_events.status", &s(11)?)?,
        attempt_count: u32::try_from(attempts)
            .map_err(|_| StoreError::corrupt("agent_inbox_events.attempt_count", attempts))?,
        lease_token: r.get(13)?,
        lease_until_ms: r.get(14)?,
        next_attempt_at_ms: r.get(15)?,
        admitted_turn_id: parse_opt("agent_inbox_events.admitted_turn_id", r.get(16)?)?,
        last_error: r.get(17)?,
        revision: non_negative("agent_inbox_events.revision", r.get(18)?)?,
        created_at_ms: r.get(19)?,
        consumed_at_ms: r.get(20)?,
        dead_lettered_at_ms: r.get(21)?,
    })
}

pub(crate) fn query_events(
    conn: &Connection,
    where_sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<InboxEvent>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {EVENT_COLUMNS} FROM agent_inbox_events {where_sql}"
    ))?;
    let mut rows = stmt.query(params)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(event_from_row(r)?);
    }
    Ok(out)
}

/// Separates a signal's dedupe key from the id that keeps its event key
/// unique (every backend stores signal keys this way).
pub const SIGNAL_KEY_SEPARATOR: char = '#';

/// Milliseconds until a run that emitted at `times` (oldest first) may emit
/// again at `now_ms`: a bucket of `burst` signals refilled one per
/// `interval_ms` (the rule every backend's `insert_signal` applies).
pub fn signal_wait_ms(times: &[i64], burst: u32, interval_ms: u64, now_ms: i64) -> u64 {
    if interval_ms == 0 {
        return 0;
    }
    let burst = f64::from(burst.max(1));
    let per_ms = 1.0 / interval_ms as f64;
    let mut tokens = burst;
    let mut last: Option<i64> = None;
    for &t in times {
        if let Some(l) = last {
            tokens = (tokens + (t - l).max(0) as f64 * per_ms).min(burst);
        }
        tokens -= 1.0;
        last = Some(t);
    }
    if let Some(l) = last {
        tokens = (tokens + (now_ms - l).max(0) as f64 * per_ms).min(burst);
    }
    if tokens >= 1.0 {
        0
    } else {
        ((1.0 - tokens) * interval_ms as f64).ceil() as u64
    }
}

fn insert_signal_tx(conn: &Connection, s: &NewSignal) -> Result<SignalCommit> {
    if s.payload_json.len() > MAX_SIGNAL_PAYLOAD_BYTES {
        return Err(StoreError::InvalidInput(format!(
            "signal payload is {} bytes, more than {MAX_SIGNAL_PAYLOAD_BYTES}",
            s.payload_json.len()
        )));
    }
    let run = get_run_tx(conn, &s.run_id)?
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
        conn,
        "WHERE scope_kind = 'run' AND scope_id = ?1 AND event_type = 'signal' \
         ORDER BY created_at, id",
        params![run_key],
    )?;
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
    adjust_counters(conn, root, 1, 0, Some(s.inbox_capacity), s.now_ms)?;
    let revision = next_revision(conn, root, s.now_ms)?;
    let event_key = format!(
        "{}{SIGNAL_KEY_SEPARATOR}{}",
        s.dedupe_key.as_deref().unwrap_or(""),
        fresh_id()
    );
    let event_id = insert_event_tx(
        conn,
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
    )?;
    Ok(SignalCommit::Accepted { event_id })
}

/// Pending signals of a cancelled run become superseded (a signal already
/// held by a turn is left to that turn). Returns how many.
pub(crate) fn supersede_run_signals_tx(
    conn: &Connection,
    run_id: &RunId,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    let Some(run) = get_run_tx(conn, run_id)? else {
        return Ok(0);
    };
    let root = run.spec.root_session_id;
    let open: i64 = conn.query_row(
        "SELECT count(*) FROM agent_inbox_events WHERE scope_kind = 'run' AND scope_id = ?1 \
           AND event_type = 'signal' AND status = 'pending'",
        [run_id.to_string()],
        |r| r.get(0),
    )?;
    if open == 0 {
        return Ok(0);
    }
    let revision = revisions.of(conn, &root, now_ms)?;
    let n = conn.execute(
        "UPDATE agent_inbox_events SET status = 'superseded', superseded_at = ?1, revision = ?2 \
         WHERE scope_kind = 'run' AND scope_id = ?3 AND event_type = 'signal' \
           AND status = 'pending'",
        params![now_ms, revision, run_id.to_string()],
    )? as u64;
    adjust_counters(conn, &root, -i64::try_from(n).unwrap_or(0), 0, None, now_ms)?;
    Ok(n)
}

fn claim_tx(conn: &Connection, req: &ClaimRequest) -> Result<Option<InboxLease>> {
    if req.max_events == 0 || req.lease_ms <= 0 {
        return Err(StoreError::InvalidInput(
            "a claim needs max_events >= 1 and a positive lease".into(),
        ));
    }
    let due = query_events(
        conn,
        "WHERE root_session_id = ?1 AND status = 'pending' \
           AND (next_attempt_at IS NULL OR next_attempt_at <= ?2) \
           AND (?3 IS NULL OR delivery = ?3) \
         ORDER BY created_at, id LIMIT ?4",
        params![
            req.root_session_id.to_string(),
            req.now_ms,
            req.delivery.map(Delivery::as_str),
            i64::try_from(req.max_events).unwrap_or(i64::MAX)
        ],
    )?;
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
    let revision = next_revision(conn, &req.root_session_id, req.now_ms)?;
    let mut stmt = conn.prepare_cached(
        "UPDATE agent_inbox_events SET status = 'leased', lease_token = ?1, lease_until = ?2, \
         revision = ?3 WHERE id = ?4 AND status = 'pending'",
    )?;
    for e in &mut batch {
        stmt.execute(params![token, until, revision, e.id.to_string()])?;
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
fn leased_root(
    conn: &Connection,
    ids: &[EventId],
    token: &str,
    statuses: &[EventStatus],
) -> Result<SessionId> {
    let mut root = None;
    for id in ids {
        let e = query_events(conn, "WHERE id = ?1", [id.to_string()])?
            .pop()
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

fn admit_tx(
    conn: &Connection,
    ids: &[EventId],
    token: &str,
    turn: &TurnId,
    now_ms: i64,
) -> Result<u64> {
    let root = leased_root(conn, ids, token, &[EventStatus::Leased])?;
    let revision = next_revision(conn, &root, now_ms)?;
    let mut n = 0;
    for id in ids {
        n += conn.execute(
            "UPDATE agent_inbox_events SET status = 'admitted', admitted_turn_id = ?1, \
             revision = ?2 WHERE id = ?3 AND lease_token = ?4 AND status = 'leased'",
            params![turn.to_string(), revision, id.to_string(), token],
        )? as u64;
    }
    Ok(n)
}

fn release_tx(conn: &Connection, req: &ReleaseRequest) -> Result<ReleaseReport> {
    let root = leased_root(
        conn,
        &req.event_ids,
        &req.lease_token,
        &[EventStatus::Leased, EventStatus::Admitted],
    )?;
    let revision = next_revision(conn, &root, req.now_ms)?;
    let mut report = ReleaseReport::default();
    if !req.count_attempt {
        for id in &req.event_ids {
            report.released += conn.execute(
                "UPDATE agent_inbox_events SET status = 'pending', lease_token = NULL, \
                 lease_until = NULL, admitted_turn_id = NULL, revision = ?1 WHERE id = ?2",
                params![revision, id.to_string()],
            )? as u64;
        }
        return Ok(report);
    }
    for id in &req.event_ids {
        let dead: bool = conn.query_row(
            "SELECT attempt_count + 1 >= ?1 FROM agent_inbox_events WHERE id = ?2",
            params![req.max_attempts, id.to_string()],
            |r| r.get(0),
        )?;
        if dead {
            conn.execute(
                "UPDATE agent_inbox_events SET status = 'dead_letter', \
                 attempt_count = attempt_count + 1, lease_token = NULL, lease_until = NULL, \
                 last_error = ?1, dead_lettered_at = ?2, revision = ?3 WHERE id = ?4",
                params![req.error, req.now_ms, revision, id.to_string()],
            )?;
            report.dead_lettered += 1;
        } else {
            conn.execute(
                "UPDATE agent_inbox_events SET status = 'pending', \
                 attempt_count = attempt_count + 1, lease_token = NULL, lease_until = NULL, \
                 admitted_turn_id = NULL, next_attempt_at = ?1, last_error = ?2, revision = ?3 \
                 WHERE id = ?4",
                params![
                    req.now_ms.saturating_add(req.backoff_ms.max(0)),
                    req.error,
                    revision,
                    id.to_string()
                ],
            )?;
            report.released += 1;
        }
    }
    adjust_counters(
        conn,
        &root,
        -i64::try_from(report.dead_lettered).unwrap_or(0),
        0,
        None,
        req.now_ms,
    )?;
    Ok(report)
}

fn dead_letter_tx(conn: &Connection, ids: &[EventId], reason: &str, now_ms: i64) -> Result<u64> {
    let mut n = 0u64;
    let mut revisions = Revisions::default();
    for id in ids {
        let Some(e) = query_events(conn, "WHERE id = ?1", [id.to_string()])?.pop() else {
            return Err(StoreError::NotFound(format!("inbox event {id}")));
        };
        if !matches!(
            e.status,
            EventStatus::Pending | EventStatus::Leased | EventStatus::Admitted
        ) {
            continue;
        }
        let revision = revisions.of(conn, &e.root_session_id, now_ms)?;
        conn.execute(
            "UPDATE agent_inbox_events SET status = 'dead_letter', lease_token = NULL, \
             lease_until = NULL, last_error = ?1, dead_lettered_at = ?2, revision = ?3 \
             WHERE id = ?4",
            params![reason, now_ms, revision, id.to_string()],
        )?;
        adjust_counters(conn, &e.root_session_id, -1, 0, None, now_ms)?;
        n += 1;
    }
    Ok(n)
}

/// Dead-letters every open event of a root session (session archived or deleted; no fallback notice).
pub(crate) fn dead_letter_session_tx(
    conn: &Connection,
    root: &SessionId,
    reason: &str,
    revision: i64,
    now_ms: i64,
) -> Result<u64> {
    let n = conn.execute(
        "UPDATE agent_inbox_events SET status = 'dead_letter', lease_token = NULL, \
         lease_until = NULL, last_error = ?1, fallback_suppressed_reason = ?1, \
         dead_lettered_at = ?2, revision = ?3 \
         WHERE root_session_id = ?4 AND status IN ('pending', 'leased', 'admitted')",
        params![reason, now_ms, revision, root.to_string()],
    )? as u64;
    adjust_counters(conn, root, -i64::try_from(n).unwrap_or(0), 0, None, now_ms)?;
    Ok(n)
}

/// Leased/admitted events whose lease ends by `cutoff_ms` back to pending
/// with one more attempt, due at `now_ms`.
pub(crate) fn expire_leases_tx(
    conn: &Connection,
    cutoff_ms: i64,
    now_ms: i64,
    revisions: &mut Revisions,
) -> Result<u64> {
    let roots = {
        let mut stmt = conn.prepare_cached(
            "SELECT DISTINCT root_session_id FROM agent_inbox_events \
             WHERE status IN ('leased', 'admitted') AND lease_until <= ?1",
        )?;
        let rows = stmt.query_map([cutoff_ms], |r| r.get::<_, String>(0))?;
        rows.map(|s| parse::<SessionId>("agent_inbox_events.root_session_id", &s?))
            .collect::<Result<Vec<_>>>()?
    };
    let mut n = 0;
    for root in &roots {
        let revision = revisions.of(conn, root, now_ms)?;
        n += conn.execute(
            "UPDATE agent_inbox_events SET status = 'pending', lease_token = NULL, \
             lease_until = NULL, admitted_turn_id = NULL, attempt_count = attempt_count + 1, \
             next_attempt_at = ?1, last_error = 'lease expired', revision = ?2 \
             WHERE root_session_id = ?3 AND status IN ('leased', 'admitted') AND lease_until <= ?4",
            params![now_ms, revision, root.to_string(), cutoff_ms],
        )? as u64;
    }
    Ok(n)
}

/// Root sessions whose inbox has work: pending events (due, or backing off
/// until a retry time), or dead letters whose user was not told yet.
pub(crate) fn sessions_with_inbox_work_tx(conn: &Connection) -> Result<Vec<SessionId>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT DISTINCT root_session_id FROM agent_inbox_events \
         WHERE status = 'pending' OR ({UNNOTIFIED}) ORDER BY root_session_id"
    ))?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    rows.map(|s| parse("agent_inbox_events.root_session_id", &s?))
        .collect()
}

/// Dead letters whose user was not told (and should be), as an SQL condition.
const UNNOTIFIED: &str = "status = 'dead_letter' AND fallback_notified_at IS NULL \
     AND fallback_suppressed_reason IS NULL";

pub(crate) fn continuation_tx(
    conn: &Connection,
    c: &ContinuationCommit,
    messages: &[EncodedMessage],
    cache: &mut WriteCache,
) -> Result<ContinuationCommitted> {
    let mut root = None;
    for lease in &c.consumed {
        let r = leased_root(
            conn,
            &lease.event_ids,
            &lease.lease_token,
            &[EventStatus::Leased, EventStatus::Admitted],
        )?;
        if root.is_some_and(|root| root != r) || r != c.turn.session_id {
            return Err(StoreError::InvalidInput(
                "a turn consumes only its own session's inbox events".into(),
            ));
        }
        root = Some(r);
    }
    let root = root.ok_or_else(|| StoreError::InvalidInput("no events to consume".into()))?;
    let turn = commit_turn_tx(conn, &c.turn, messages, Some(cache), &[])?;
    let revision = next_revision(conn, &root, c.turn.now_ms)?;
    let mut consumed = 0u64;
    for lease in &c.consumed {
        for id in &lease.event_ids {
            consumed += conn.execute(
                "UPDATE agent_inbox_events SET status = 'consumed', consumed_at = ?1, \
                 lease_token = NULL, lease_until = NULL, revision = ?2 \
                 WHERE id = ?3 AND lease_token = ?4 AND status IN ('leased', 'admitted')",
                params![c.turn.now_ms, revision, id.to_string(), lease.lease_token],
            )? as u64;
        }
    }
    adjust_counters(
        conn,
        &root,
        -i64::try_from(consumed).unwrap_or(0),
        0,
        None,
        c.turn.now_ms,
    )?;
    Ok(ContinuationCommitted { turn, consumed })
}

impl SqliteStore {
    pub(crate) async fn insert_signal(&self, signal: NewSignal) -> Result<SignalCommit> {
        let commit = self
            .db
            .write(move |c| {
                let commit = insert_signal_tx(c, &signal)?;
                failpoint!("store::insert_signal::before_commit");
                Ok(commit)
            })
            .await?;
        failpoint!("store::insert_signal::after_commit");
        Ok(commit)
    }

    pub(crate) async fn claim_inbox_batch(
        &self,
        request: ClaimRequest,
    ) -> Result<Option<InboxLease>> {
        let lease = self.db.write(move |c| claim_tx(c, &request)).await?;
        failpoint!("store::claim_inbox::after_commit");
        Ok(lease)
    }

    pub(crate) async fn admit_inbox_events(
        &self,
        event_ids: Vec<EventId>,
        lease_token: String,
        turn_id: TurnId,
        now_ms: i64,
    ) -> Result<u64> {
        let admitted = self
            .db
            .write(move |c| {
                let n = admit_tx(c, &event_ids, &lease_token, &turn_id, now_ms)?;
                failpoint!("store::admit_inbox::before_commit");
                Ok(n)
            })
            .await?;
        failpoint!("store::admit_inbox::after_commit");
        Ok(admitted)
    }

    pub(crate) async fn release_inbox_lease(
        &self,
        request: ReleaseRequest,
    ) -> Result<ReleaseReport> {
        let report = self
            .db
            .write(move |c| {
                let report = release_tx(c, &request)?;
                failpoint!("store::release_lease::before_commit");
                Ok(report)
            })
            .await?;
        failpoint!("store::release_lease::after_commit");
        Ok(report)
    }

    pub(crate) async fn dead_letter_events(
        &self,
        event_ids: Vec<EventId>,
        reason: String,
        now_ms: i64,
    ) -> Result<u64> {
        self.db
            .write(move |c| dead_letter_tx(c, &event_ids, &reason, now_ms))
            .await
    }

    pub(crate) async fn commit_continuation_turn(
        &self,
        commit: ContinuationCommit,
    ) -> Result<ContinuationCommitted> {
        let encoded = encode(self.path(), &commit.turn.messages)?;
        let committed = self
            .db
            .write_cached(move |c, cache| {
                let committed = continuation_tx(c, &commit, &encoded, cache)?;
                failpoint!("store::commit_continuation::before_commit");
                Ok(committed)
            })
            .await?;
        failpoint!("store::commit_continuation::after_commit");
        Ok(committed)
    }

    pub(crate) async fn unnotified_dead_letters(
        &self,
        root_session_id: SessionId,
    ) -> Result<Vec<InboxEvent>> {
        self.db
            .read(move |c| {
                query_events(
                    c,
                    &format!("WHERE root_session_id = ?1 AND {UNNOTIFIED} ORDER BY created_at, id"),
                    [root_session_id.to_string()],
                )
            })
            .await
    }

    pub(crate) async fn commit_dead_letter_notice(
        &self,
        commit: NoticeCommit,
    ) -> Result<TurnCommitted> {
        let encoded = encode(self.path(), &commit.turn.messages)?;
        self.db
            .write_cached(move |c, cache| {
                let turn = commit_turn_tx(c, &commit.turn, &encoded, Some(cache), &[])?;
                let revision = next_revision(c, &commit.turn.session_id, commit.turn.now_ms)?;
                for id in &commit.event_ids {
                    let n = c.execute(
                        &format!(
                            "UPDATE agent_inbox_events SET fallback_notified_at = ?1, revision = ?2 \
                             WHERE id = ?3 AND root_session_id = ?4 AND {UNNOTIFIED}"
                        ),
                        params![
                            commit.turn.now_ms,
                            revision,
                            id.to_string(),
                            commit.turn.session_id.to_string()
                        ],
                    )?;
                    if n != 1 {
                        return Err(StoreError::Stale(format!(
                            "inbox event {id} is not an untold dead letter of this session"
                        )));
                    }
                }
                Ok(turn)
            })
            .await
    }

    pub(crate) async fn supersede_run_signals(&self, run_id: RunId, now_ms: i64) -> Result<u64> {
        self.db
            .write(move |c| supersede_run_signals_tx(c, &run_id, now_ms, &mut Revisions::default()))
            .await
    }

    pub(crate) async fn list_signals(
        &self,
        root_session_id: SessionId,
        limit: usize,
    ) -> Result<Vec<InboxEvent>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.db
            .read(move |c| {
                query_events(
                    c,
                    "WHERE root_session_id = ?1 AND event_type = 'signal' \
                     ORDER BY created_at DESC, id DESC LIMIT ?2",
                    params![root_session_id.to_string(), limit],
                )
            })
            .await
    }

    pub(crate) async fn list_inbox_events(
        &self,
        root_session_id: SessionId,
    ) -> Result<Vec<InboxEvent>> {
        self.db
            .read(move |c| {
                query_events(
                    c,
                    "WHERE root_session_id = ?1 ORDER BY created_at, id",
                    [root_session_id.to_string()],
                )
            })
            .await
    }

    pub(crate) async fn inbox_schedule(
        &self,
        root_session_id: SessionId,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<InboxSchedule> {
        self.db
            .read(move |c| {
                let (oldest_due_at_ms, next_due_at_ms, expired, untold) = c.query_row(
                    &format!(
                        "SELECT min(created_at) FILTER (WHERE status = 'pending' AND \
                                  (next_attempt_at IS NULL OR next_attempt_at <= ?2)), \
                                min(min(next_attempt_at, created_at + ?3)) FILTER (WHERE \
                                  status = 'pending' AND next_attempt_at > ?2 \
                                  AND created_at + ?3 > ?2), \
                                count(*) FILTER (WHERE status = 'pending' \
                                  AND next_attempt_at > ?2 AND created_at + ?3 <= ?2), \
                                count(*) FILTER (WHERE {UNNOTIFIED}) \
                         FROM agent_inbox_events WHERE root_session_id = ?1 \
                           AND status IN ('pending', 'dead_letter')"
                    ),
                    params![root_session_id.to_string(), now_ms, ttl_ms],
                    |r| {
                        Ok((
                            r.get(0)?,
                            r.get(1)?,
                            r.get::<_, i64>(2)?,
                            r.get::<_, i64>(3)?,
                        ))
                    },
                )?;
                Ok(InboxSchedule {
                    oldest_due_at_ms,
                    next_due_at_ms,
                    expired: non_negative("expired events", expired)?,
                    untold_dead_letters: non_negative("dead letters", untold)?,
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
        self.db
            .write(move |c| {
                let revision = next_revision(c, &root_session_id, now_ms)?;
                let n = c.execute(
                    "UPDATE agent_inbox_events SET status = 'dead_letter', last_error = ?1, \
                     dead_lettered_at = ?2, revision = ?3 \
                     WHERE root_session_id = ?4 AND status = 'pending' AND created_at <= ?5",
                    params![
                        reason,
                        now_ms,
                        revision,
                        root_session_id.to_string(),
                        created_by_ms
                    ],
                )? as u64;
                adjust_counters(
                    c,
                    &root_session_id,
                    -i64::try_from(n).unwrap_or(0),
                    0,
                    None,
                    now_ms,
                )?;
                Ok(n)
            })
            .await
    }
}
