//! The invariant checker: reads a whole database in one snapshot and
//! reports, as typed [`Finding`]s, everything that breaks what the commit
//! paths promise — a history that ends inside a turn, a checkpoint that
//! would not restore, inbox counters that disagree with the rows, a run
//! nobody will finish, a completion in a state it can never be in, and
//! SQLite's own integrity and foreign-key checks. It never writes; the
//! safe repairs are the activation's recovery (see [`Invariant::repair`]).
//!
//! Crash tests run it after every recovery, and `keel doctor` prints it.

mod calls;
mod images;
mod inputs;
mod webhooks;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use keel_core::{Message, Role, RunStatus};
use rusqlite::{Connection, OptionalExtension};

use crate::counters::recount_tx;
use crate::error::{Result, StoreError};
use crate::messages::visible_inputs;
use crate::migrations::{self, SCHEMA_VERSION};
use crate::runs::{EXECUTING_RUN, NONTERMINAL_RUN};
use crate::util::{parse, sha256_hex};
use crate::SqliteStore;

/// Decodes a session state blob the way a restore would; `Err` says why it cannot.
pub type StateDecoder = Arc<dyn Fn(&[u8]) -> std::result::Result<(), String> + Send + Sync>;

/// How to judge what the check finds.
#[derive(Clone, Default)]
pub struct CheckOptions {
    /// A process holds the database's runtime lock: non-terminal runs of
    /// the current generation are live, not abandoned.
    pub owner_alive: bool,
    /// Decodes every checkpoint's and session head's state blob (the
    /// engine's decoder); without it only the blob's hash is verified.
    pub state_decoder: Option<StateDecoder>,
}

impl std::fmt::Debug for CheckOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckOptions")
            .field("owner_alive", &self.owner_alive)
            .field("state_decoder", &self.state_decoder.is_some())
            .finish()
    }
}

/// Which promise a finding breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    /// `PRAGMA integrity_check`: the file's b-trees, indexes and CHECK constraints.
    Integrity,
    /// `PRAGMA foreign_key_check`: every reference names an existing row.
    ForeignKeys,
    /// The schema is at the version this build writes.
    Schema,
    /// Histories hold only committed turns: contiguous seqs, readable
    /// messages, every tool call answered before the history's end, and no
    /// user's input open without a live turn answering it.
    History,
    /// Every listed checkpoint (and every session head) restores.
    Checkpoints,
    /// Inbox counters equal the values recomputed from the rows.
    Counters,
    /// Every dialog's message count equals the visible user messages of
    /// its current history.
    MessageCounts,
    /// Every accepted run is terminal, live in the current generation, or
    /// interrupted with its completion.
    Runs,
    /// Every completion is pending, delivered or dead-lettered, exactly once.
    Completions,
    /// Every queued input waits for a turn of a live dialog that has not started.
    QueuedInputs,
    /// Every webhook subscription waits for its input's answer, and every
    /// delivery row is consistent (a readable body, attempts made).
    Webhooks,
}

impl Invariant {
    /// Every invariant, in the order a report lists them.
    pub const ALL: [Invariant; 11] = [
        Invariant::Integrity,
        Invariant::ForeignKeys,
        Invariant::Schema,
        Invariant::History,
        Invariant::Checkpoints,
        Invariant::Counters,
        Invariant::MessageCounts,
        Invariant::Runs,
        Invariant::Completions,
        Invariant::QueuedInputs,
        Invariant::Webhooks,
    ];

    /// A short name, for output.
    pub fn name(self) -> &'static str {
        match self {
            Invariant::Integrity => "integrity",
            Invariant::ForeignKeys => "foreign keys",
            Invariant::Schema => "schema",
            Invariant::History => "history",
            Invariant::Checkpoints => "checkpoints",
            Invariant::Counters => "inbox counters",
            Invariant::MessageCounts => "message counts",
            Invariant::Runs => "runs",
            Invariant::Completions => "completions",
            Invariant::QueuedInputs => "queued inputs",
            Invariant::Webhooks => "webhooks",
        }
    }

    /// What a finding of this kind means for the user's data.
    pub fn meaning(self) -> &'static str {
        match self {
            Invariant::Integrity => {
                "SQLite found the file damaged, or a row breaking its table's constraints \
                 (a value keel does not know): some rows may be unreadable or wrong"
            }
            Invariant::ForeignKeys => "a row refers to a row that does not exist",
            Invariant::Schema => {
                "the database is at an older schema version; the next start migrates it"
            }
            Invariant::History => {
                "a conversation holds messages of a turn that never committed, or lost one"
            }
            Invariant::Checkpoints => {
                "a checkpoint (or a dialog's current state) would not restore"
            }
            Invariant::Counters => {
                "an inbox's capacity counters drifted from its events and runs; \
                 new work may be refused or over-admitted"
            }
            Invariant::MessageCounts => {
                "a dialog's message count (what dialog lists show; it also decides when a \
                 dialog gets its automatic title) differs from the user messages its history \
                 holds; the history itself is intact"
            }
            Invariant::Runs => {
                "a sub-agent run was left unfinished by a process that stopped, is in a \
                 state this keel does not know, or ended without the completion its caller \
                 waits for"
            }
            Invariant::Completions => "a sub-agent's completion could be lost or delivered twice",
            Invariant::QueuedInputs => {
                "a message acknowledged while a turn ran will never be answered, or would be \
                 answered twice"
            }
            Invariant::Webhooks => {
                "a webhook a client asked for will never be sent, or a delivery row cannot be sent"
            }
        }
    }
}

/// One broken invariant, with the rows involved.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Finding {
    /// The invariant it breaks.
    pub invariant: Invariant,
    /// Whether `keel doctor --repair` fixes it: a migration, the recovery
    /// every start runs (counters, abandoned runs), or a recount of the
    /// message counts ([`Backend::recount_message_counts`](crate::Backend::recount_message_counts)). Nothing else is
    /// safe to change without a person.
    pub repairable: bool,
    /// What is wrong, naming the rows.
    pub detail: String,
}

/// How much the check read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckedCounts {
    /// Sessions.
    pub sessions: u64,
    /// Messages.
    pub messages: u64,
    /// Checkpoints.
    pub checkpoints: u64,
    /// Runs.
    pub runs: u64,
    /// Inbox events.
    pub events: u64,
}

/// The result of a check: clean when `findings` is empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InvariantReport {
    /// Every broken invariant, sorted by invariant.
    pub findings: Vec<Finding>,
    /// What was read.
    pub checked: CheckedCounts,
}

impl InvariantReport {
    /// No finding.
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty()
    }

    /// Adds a finding, repairable when the invariant's safe repairs
    /// (migration, recovery, recount) fix it: the schema and counters,
    /// nothing else.
    pub fn add(&mut self, invariant: Invariant, detail: impl Into<String>) {
        let repairable = matches!(
            invariant,
            Invariant::Schema | Invariant::Counters | Invariant::MessageCounts
        );
        self.push(invariant, repairable, detail);
    }

    /// Adds a finding, saying whether `keel doctor --repair` fixes it.
    pub fn push(&mut self, invariant: Invariant, repairable: bool, detail: impl Into<String>) {
        self.findings.push(Finding {
            invariant,
            repairable,
            detail: detail.into(),
        });
    }
}

/// Opens `path` read-only (never creating or migrating it) and checks it.
pub fn check_database(path: &Path, options: &CheckOptions) -> Result<InvariantReport> {
    // Refuses what is not keel's; rows breaking their constraints are
    // findings of the integrity check below, not a refusal.
    if crate::identify::identify(path, false)? == crate::identify::Found::Missing {
        return Err(StoreError::NotFound(format!("database {}", path.display())));
    }
    let conn = crate::identify::inspector(path)?;
    let tx = conn.unchecked_transaction()?;
    check_tx(&tx, options)
}

impl SqliteStore {
    pub(crate) async fn check_invariants(&self, options: CheckOptions) -> Result<InvariantReport> {
        self.db.read(move |conn| check_tx(conn, &options)).await
    }
}

/// Runs every check on `conn` (inside one read transaction).
pub(crate) fn check_tx(conn: &Connection, options: &CheckOptions) -> Result<InvariantReport> {
    let mut report = InvariantReport::default();
    let version = migrations::user_version(conn)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema {
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    integrity(conn, &mut report)?;
    if version < SCHEMA_VERSION {
        report.add(
            Invariant::Schema,
            format!("schema version {version}, this build writes {SCHEMA_VERSION}"),
        );
        // The other checks read today's tables.
        return Ok(report);
    }
    // Frames name the dictionary they were made with: a backup or another
    // file checked here may hold ones this process has not loaded.
    if let Err(e) = crate::compress::register_dictionaries(conn) {
        report.add(Invariant::History, format!("a compression dictionary: {e}"));
    }
    // A damaged row stops one check, not the others: its error is a finding.
    let checks: [(Invariant, CheckFn); 10] = [
        (Invariant::History, histories),
        (Invariant::History, inputs::open_inputs),
        (Invariant::Counters, counters),
        (Invariant::MessageCounts, message_counts),
        (Invariant::Runs, runs),
        (Invariant::Completions, completions),
        (Invariant::QueuedInputs, inputs::queued_inputs),
        (Invariant::Runs, calls::call_spans),
        (Invariant::Webhooks, webhooks::webhooks),
        (Invariant::History, images::images),
    ];
    for (invariant, check) in checks {
        if let Err(e) = check(conn, options, &mut report) {
            report.push(invariant, false, format!("the check could not finish: {e}"));
        }
    }
    report.checked = count_rows(conn)?;
    report.findings.sort();
    Ok(report)
}

type CheckFn = fn(&Connection, &CheckOptions, &mut InvariantReport) -> Result<()>;

fn integrity(conn: &Connection, report: &mut InvariantReport) -> Result<()> {
    let lines = query_rows(conn, "PRAGMA integrity_check(100)", |r| {
        r.get::<_, String>(0)
    })?;
    // A read-only connection checks no CHECK constraint; a writable one
    // names only the table. Each breaking row is named instead.
    for line in lines
        .into_iter()
        .filter(|l| l != "ok" && !l.starts_with("CHECK constraint failed"))
    {
        report.add(Invariant::Integrity, line);
    }
    let tables = query_rows(
        conn,
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' \
         ORDER BY name",
        |r| r.get::<_, String>(0),
    )?;
    for table in tables {
        for violation in crate::constraints::violations(conn, &table)? {
            report.add(Invariant::Integrity, violation.to_string());
        }
    }
    let broken = query_rows(conn, "PRAGMA foreign_key_check", |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, Option<i64>>(1)?,
            r.get::<_, String>(2)?,
        ))
    })?;
    for (table, rowid, parent) in broken {
        let row = rowid.map_or_else(|| "a row".to_owned(), |r| format!("row {r}"));
        report.add(
            Invariant::ForeignKeys,
            format!("{table} {row} refers to a missing {parent} row"),
        );
    }
    Ok(())
}

fn count_rows(conn: &Connection) -> Result<CheckedCounts> {
    let count = |table: &str| -> Result<u64> {
        let n: i64 = conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    Ok(CheckedCounts {
        sessions: count("sessions")?,
        messages: count("messages")?,
        checkpoints: count("checkpoints")?,
        runs: count("agent_runs")?,
        events: count("agent_inbox_events")?,
    })
}

/// One timeline: where it forks from and the tool calls still unanswered
/// at each seq where some are (every other seq has none).
struct TimelineWalk {
    last_seq: i64,
    open_at: BTreeMap<i64, HashSet<String>>,
}

impl TimelineWalk {
    /// Unanswered tool calls at `seq` of this timeline (its own or inherited).
    fn open_at(&self, seq: i64) -> Option<&HashSet<String>> {
        self.open_at
            .range(..=seq)
            .next_back()
            .map(|(_, open)| open)
            .filter(|open| !open.is_empty())
    }
}

/// Walks every timeline in seq order: seqs contiguous after the fork
/// point, every message readable and of its row's role, every tool result
/// answering an open call; records where calls stay open, then checks every
/// session head and checkpoint against it.
fn histories(
    conn: &Connection,
    options: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    let timelines = walk_timelines(conn, report)?;
    let state_ok = |hash: &str, bytes: &[u8]| -> std::result::Result<(), String> {
        if sha256_hex(bytes) != hash {
            return Err("its bytes do not match their hash".into());
        }
        match &options.state_decoder {
            Some(decode) => decode(bytes),
            None => Ok(()),
        }
    };
    // A frame that does not decompress is a finding, not the checker's failure.
    let blob = |hash: &str| -> Result<Option<std::result::Result<Vec<u8>, String>>> {
        match crate::checkpoints::read_state_blob(conn, hash) {
            Ok(bytes) => Ok(bytes.map(Ok)),
            Err(e @ StoreError::Corruption { .. }) => Ok(Some(Err(e.to_string()))),
            Err(e) => Err(e),
        }
    };
    let heads = query_rows(
        conn,
        "SELECT id, head_timeline_id, state_hash FROM sessions WHERE deleted_at IS NULL \
         ORDER BY id",
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, Option<String>>(1)?,
                r.get::<_, Option<String>>(2)?,
            ))
        },
    )?;
    for (session, head, state_hash) in heads {
        let Some(head) = head else {
            report.add(
                Invariant::History,
                format!("session {session} has no head timeline"),
            );
            continue;
        };
        let Some(walk) = timelines.get(&head) else {
            report.add(
                Invariant::History,
                format!("session {session}'s head timeline {head} does not exist"),
            );
            continue;
        };
        if let Some(open) = walk.open_at(walk.last_seq) {
            report.add(
                Invariant::History,
                format!(
                    "session {session}'s history ends inside a turn: tool call(s) {} have no result",
                    sorted(open)
                ),
            );
        }
        if let Some(hash) = state_hash {
            match blob(&hash)? {
                None => report.add(
                    Invariant::Checkpoints,
                    format!("session {session}'s state blob {hash} is missing"),
                ),
                Some(bytes) => {
                    if let Err(e) = bytes.and_then(|b| state_ok(&hash, &b)) {
                        report.add(
                            Invariant::Checkpoints,
                            format!("session {session}'s current state does not restore: {e}"),
                        );
                    }
                }
            }
        }
    }
    let checkpoints = query_rows(
        conn,
        "SELECT id, session_id, timeline_id, seq, state_hash FROM checkpoints ORDER BY id",
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, String>(4)?,
            ))
        },
    )?;
    for (id, session, timeline, seq, hash) in checkpoints {
        let at = format!("checkpoint {id} (session {session}, seq {seq})");
        match timelines.get(&timeline) {
            None => report.add(
                Invariant::Checkpoints,
                format!("{at}: its timeline {timeline} does not exist"),
            ),
            Some(walk) if seq > walk.last_seq => report.add(
                Invariant::Checkpoints,
                format!(
                    "{at}: points past the end of its timeline (last seq {})",
                    walk.last_seq
                ),
            ),
            Some(walk) => {
                if let Some(open) = walk.open_at(seq) {
                    report.add(
                        Invariant::Checkpoints,
                        format!(
                            "{at}: points into a half turn (tool call(s) {} unanswered)",
                            sorted(open)
                        ),
                    );
                }
            }
        }
        match blob(&hash)? {
            None => report.add(
                Invariant::Checkpoints,
                format!("{at}: its state blob {hash} is missing"),
            ),
            Some(bytes) => {
                if let Err(e) = bytes.and_then(|b| state_ok(&hash, &b)) {
                    report.add(
                        Invariant::Checkpoints,
                        format!("{at}: its state does not restore: {e}"),
                    );
                }
            }
        }
    }
    Ok(())
}

fn sorted(set: &HashSet<String>) -> String {
    let mut v: Vec<&str> = set.iter().map(String::as_str).collect();
    v.sort_unstable();
    v.join(", ")
}

/// Every timeline, parents before children, walked message by message.
fn walk_timelines(
    conn: &Connection,
    report: &mut InvariantReport,
) -> Result<HashMap<String, TimelineWalk>> {
    let rows = query_rows(
        conn,
        "SELECT id, parent_timeline_id, fork_seq FROM timelines",
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, Option<String>>(1)?,
                r.get::<_, Option<i64>>(2)?,
            ))
        },
    )?;
    let mut pending: Vec<(String, Option<(String, i64)>)> = rows
        .into_iter()
        .map(|(id, parent, fork)| (id, parent.zip(fork)))
        .collect();
    let mut done: HashMap<String, TimelineWalk> = HashMap::new();
    let mut messages = conn
        .prepare("SELECT seq, role, content FROM messages WHERE timeline_id = ?1 ORDER BY seq")?;
    // Parents first: each pass walks the timelines whose parent is done.
    while !pending.is_empty() {
        let (ready, waiting): (Vec<_>, Vec<_>) = pending
            .into_iter()
            .partition(|(_, parent)| parent.as_ref().is_none_or(|(p, _)| done.contains_key(p)));
        if ready.is_empty() {
            for (id, parent) in &waiting {
                let parent = parent.as_ref().map_or("?", |(p, _)| p.as_str());
                report.add(
                    Invariant::History,
                    format!("timeline {id} forks from timeline {parent}, which does not exist or forks from itself"),
                );
            }
            break;
        }
        pending = waiting;
        for (id, parent) in ready {
            let (start, mut open) = match &parent {
                None => (0, HashSet::new()),
                Some((p, fork)) => {
                    let walk = &done[p];
                    if *fork > walk.last_seq {
                        report.add(
                            Invariant::History,
                            format!(
                                "timeline {id} forks at seq {fork}, past its parent's end ({})",
                                walk.last_seq
                            ),
                        );
                    }
                    (*fork, walk.open_at(*fork).cloned().unwrap_or_default())
                }
            };
            let mut walk = TimelineWalk {
                last_seq: start,
                open_at: BTreeMap::new(),
            };
            if !open.is_empty() {
                walk.open_at.insert(start, open.clone());
            }
            let rows = messages
                .query_map([&id], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, String>(1)?,
                        // Compressed or not; unreadable is a finding below.
                        crate::compress::unpack("messages.content", r.get_ref(2)?),
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            for (seq, role, content) in rows {
                let at = format!("timeline {id} seq {seq}");
                if seq != walk.last_seq + 1 {
                    report.add(
                        Invariant::History,
                        format!("{at}: follows seq {} (a gap or overlap)", walk.last_seq),
                    );
                }
                walk.last_seq = seq;
                let decoded = content
                    .map_err(|e| e.to_string())
                    .and_then(|c| serde_json::from_str::<Message>(&c).map_err(|e| e.to_string()));
                let message: Message = match decoded {
                    Ok(m) => m,
                    Err(e) => {
                        report.add(Invariant::History, format!("{at}: unreadable message: {e}"));
                        continue;
                    }
                };
                if parse::<Role>("messages.role", &role).ok() != Some(message.role) {
                    report.add(
                        Invariant::History,
                        format!("{at}: role column {role:?} disagrees with the message"),
                    );
                }
                let was_open = !open.is_empty();
                for call in &message.tool_calls {
                    open.insert(call.id.clone());
                }
                if let Some(call) = &message.tool_call_id {
                    if message.role == Role::Tool && !open.remove(call) {
                        report.add(
                            Invariant::History,
                            format!(
                                "{at}: tool result for call {call}, which no earlier message made"
                            ),
                        );
                    }
                }
                if was_open || !open.is_empty() {
                    walk.open_at.insert(seq, open.clone());
                }
            }
            done.insert(id, walk);
        }
    }
    Ok(done)
}

fn counters(conn: &Connection, _: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    let stored = query_rows(
        conn,
        "SELECT root_session_id, pending_event_count, reserved_completion_slots \
         FROM agent_session_state ORDER BY root_session_id",
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        },
    )?;
    let mut seen = HashSet::new();
    for (root, pending, reserved) in stored {
        let (want_pending, want_reserved) = recount_tx(conn, &root)?;
        if (pending, reserved) != (want_pending, want_reserved) {
            report.add(
                Invariant::Counters,
                format!(
                    "session {root}: {pending} pending events and {reserved} reserved slots stored, \
                     {want_pending} and {want_reserved} in the rows"
                ),
            );
        }
        seen.insert(root);
    }
    // A session with open events or reservations but no counter row at all.
    let roots = query_rows(
        conn,
        "SELECT root_session_id FROM agent_runs \
         UNION SELECT root_session_id FROM agent_inbox_events",
        |r| r.get::<_, String>(0),
    )?;
    for root in roots.into_iter().filter(|r| !seen.contains(r)) {
        let (pending, reserved) = recount_tx(conn, &root)?;
        if pending != 0 || reserved != 0 {
            report.add(
                Invariant::Counters,
                format!(
                    "session {root}: no counters stored, {pending} pending events and \
                     {reserved} reserved slots in the rows"
                ),
            );
        }
    }
    Ok(())
}

/// Each live dialog's stored message count against its history's visible
/// user messages, recounted.
fn message_counts(conn: &Connection, _: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    for (session, stored, want) in drifted_message_counts(conn)? {
        report.add(
            Invariant::MessageCounts,
            format!(
                "session {session}: message count {stored} stored, {want} visible user messages \
                 in its history"
            ),
        );
    }
    Ok(())
}

/// Sessions whose stored message count differs from their history's:
/// (session, stored, recounted).
fn drifted_message_counts(conn: &Connection) -> Result<Vec<(String, i64, i64)>> {
    let sessions = query_rows(
        conn,
        "SELECT id, head_timeline_id, message_count FROM sessions \
         WHERE deleted_at IS NULL AND head_timeline_id IS NOT NULL ORDER BY id",
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
            ))
        },
    )?;
    let mut drifted = Vec::new();
    for (session, head, stored) in sessions {
        let want = visible_inputs(conn, &head, i64::MAX)?;
        if stored != want {
            drifted.push((session, stored, want));
        }
    }
    Ok(drifted)
}

impl SqliteStore {
    pub(crate) async fn recount_message_counts(&self) -> Result<usize> {
        self.db
            .write(|c| {
                let drifted = drifted_message_counts(c)?;
                let mut stmt =
                    c.prepare_cached("UPDATE sessions SET message_count = ?1 WHERE id = ?2")?;
                for (session, _, want) in &drifted {
                    stmt.execute(rusqlite::params![want, session])?;
                }
                Ok(drifted.len())
            })
            .await
    }
}

fn runs(conn: &Connection, options: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    let generation: i64 = conn
        .query_row(
            "SELECT generation FROM runtime_state WHERE id = 1",
            [],
            |r| r.get(0),
        )
        .optional()?
        .unwrap_or(0);
    let open = query_rows(
        conn,
        &format!(
            "SELECT id, status, runtime_generation FROM agent_runs \
         WHERE status IN {EXECUTING_RUN} ORDER BY id"
        ),
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
            ))
        },
    )?;
    let known: Vec<String> = RunStatus::ALL
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    let unknown = query_rows(
        conn,
        &format!(
            "SELECT id, status FROM agent_runs WHERE status NOT IN ({}) ORDER BY id",
            known.join(", ")
        ),
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
    )?;
    for (run, status) in unknown {
        report.push(
            Invariant::Runs,
            false,
            format!(
                "run {run} has status '{status}', which this keel does not know: \
                 no process will finish, recover or list it"
            ),
        );
    }
    // A run waiting for approval resumes from its pause row and its
    // approvals; a pause row outlives nothing else.
    let pauses = query_rows(
        conn,
        "SELECT r.id, 'has no pause row' FROM agent_runs r WHERE r.status = 'waiting_approval' \
           AND NOT EXISTS (SELECT 1 FROM agent_run_pauses p WHERE p.run_id = r.id) \
         UNION ALL \
         SELECT r.id, 'has no approval to wait for' FROM agent_runs r \
         WHERE r.status = 'waiting_approval' AND NOT EXISTS (SELECT 1 FROM tool_approvals a \
           WHERE a.run_id = r.id AND a.settled_at IS NULL) \
         UNION ALL \
         SELECT p.run_id, 'has a pause row but is not waiting for approval' FROM agent_run_pauses p \
         JOIN agent_runs r ON r.id = p.run_id WHERE r.status <> 'waiting_approval' ORDER BY 1",
        |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
    )?;
    for (run, what) in pauses {
        report.push(Invariant::Runs, false, format!("run {run} {what}"));
    }
    for (run, status, run_generation) in open {
        let live = run_generation == generation && options.owner_alive;
        if live {
            continue;
        }
        let why = if run_generation > generation {
            format!(
                "stamped with generation {run_generation}, newer than the database's {generation}"
            )
        } else if run_generation < generation {
            format!("of generation {run_generation}, older than the running one ({generation}), was never recovered")
        } else {
            format!("of generation {run_generation}, whose process stopped; the next start interrupts it")
        };
        // Recovery at the next start (or --repair) ends abandoned runs;
        // a run from the future is beyond it.
        report.push(
            Invariant::Runs,
            run_generation <= generation,
            format!("run {run} is {status}: {why}"),
        );
    }
    // An interrupted background run owes its caller a completion: its own
    // (no group, or a group whose policy is `each`) or its group's.
    let missing = query_rows(
        conn,
        "SELECT r.id, g.id FROM agent_runs r LEFT JOIN agent_run_groups g ON g.id = r.group_id \
         WHERE r.status = 'interrupted' AND r.mode = 'background' \
           AND (g.id IS NULL OR g.completion_policy = 'each') \
           AND NOT EXISTS (SELECT 1 FROM agent_inbox_events e WHERE e.scope_kind = 'run' \
                           AND e.scope_id = r.id AND e.event_type = 'completion') \
         UNION ALL \
         SELECT NULL, g.id FROM agent_run_groups g \
         WHERE g.mode = 'background' AND g.completion_policy = 'all' AND g.status = 'interrupted' \
           AND NOT EXISTS (SELECT 1 FROM agent_inbox_events e WHERE e.scope_kind = 'group' \
                           AND e.scope_id = g.id AND e.event_type = 'group_completion')",
        |r| {
            Ok((
                r.get::<_, Option<String>>(0)?,
                r.get::<_, Option<String>>(1)?,
            ))
        },
    )?;
    for (run, group) in missing {
        let what = match (run, group) {
            (Some(run), _) => format!("background run {run}"),
            (None, Some(group)) => format!("background group {group}"),
            (None, None) => continue,
        };
        report.add(
            Invariant::Runs,
            format!("{what} was interrupted but its completion was never recorded"),
        );
    }
    Ok(())
}

fn completions(conn: &Connection, _: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    let rows = query_rows(
        conn,
        &format!(
            "SELECT e.id, e.scope_kind, e.scope_id, e.status, \
                (e.status = 'consumed' AND e.consumed_at IS NULL) \
                  OR (e.status = 'dead_letter' AND e.dead_lettered_at IS NULL), \
                r.status IN {NONTERMINAL_RUN} \
         FROM agent_inbox_events e LEFT JOIN agent_runs r \
           ON e.scope_kind = 'run' AND r.id = e.scope_id \
         WHERE e.event_type IN ('completion', 'group_completion') ORDER BY e.id"
        ),
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, bool>(4)?,
                r.get::<_, Option<bool>>(5)?,
            ))
        },
    )?;
    for (id, scope, scope_id, status, unstamped, run_open) in rows {
        let at = format!("completion {id} of {scope} {scope_id}");
        if status == "superseded" {
            report.add(
                Invariant::Completions,
                format!("{at} is superseded; a completion is a fact and must be delivered or dead-lettered"),
            );
        }
        if unstamped {
            report.add(
                Invariant::Completions,
                format!("{at} is {status} without the time it became so"),
            );
        }
        if run_open == Some(true) {
            report.add(
                Invariant::Completions,
                format!("{at} exists while the run has not ended"),
            );
        }
    }
    let doubled = query_rows(
        conn,
        "SELECT scope_kind, scope_id, count(*) FROM agent_inbox_events \
         WHERE event_type IN ('completion', 'group_completion') \
         GROUP BY scope_kind, scope_id HAVING count(*) > 1",
        |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
            ))
        },
    )?;
    for (scope, id, n) in doubled {
        report.add(
            Invariant::Completions,
            format!("{scope} {id} has {n} completions; it must have one"),
        );
    }
    Ok(())
}

/// Every row of `sql` (which takes no parameters), mapped by `row`.
fn query_rows<T>(
    conn: &Connection,
    sql: &str,
    row: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Result<Vec<T>> {
    let mut stmt = conn.prepare(sql)?;
    let rows = stmt
        .query_map([], row)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows)
}
