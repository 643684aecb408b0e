//! The invariant checker on PostgreSQL: keel-store's `check.rs` — the same
//! invariants, findings, wording and counts — over one read snapshot of
//! the whole database. Only the integrity pass differs (`integrity.rs`):
//! instead of SQLite's `integrity_check` and `foreign_key_check` it reports
//! what can still be wrong on a server that enforces constraints itself —
//! an index a failed build left invalid, a dangling reference a restore
//! without triggers let in, a row breaking a CHECK added `NOT VALID`, a
//! B-tree index `amcheck` finds damaged (when that extension is installed).

mod calls;
mod images;
mod inputs;
mod integrity;
mod webhooks;

use std::collections::{BTreeMap, HashMap, HashSet};

use keel_core::{Message, Role, RunStatus};
use keel_store::{
    AwaitingApproval, CheckOptions, CheckedCounts, Invariant, InvariantReport, Result, StoreError,
};
use tokio_postgres::Row;

use crate::store::Tx;

use crate::checkpoints::read_state_blob;
use crate::counters::recount_tx;
use crate::messages::visible_inputs;
use crate::runs::{EXECUTING_RUN, NONTERMINAL_RUN};
use crate::store::from_pg;
use crate::util::{parse, sha256_hex};
use crate::PgStore;

/// Most rows a finding list names for one kind of orphan.
const MAX_NAMED: usize = 20;

impl PgStore {
    pub(crate) async fn check_invariants(&self, options: CheckOptions) -> Result<InvariantReport> {
        self.read(move |tx| {
            let options = options.clone();
            Box::pin(async move { check_tx(tx, &options).await })
        })
        .await
    }

    pub(crate) async fn recount_message_counts(&self) -> Result<usize> {
        self.write(|tx| {
            Box::pin(async move {
                let drifted = drifted_message_counts(tx).await?;
                for (session, _, want) in &drifted {
                    tx.execute(
                        "UPDATE sessions SET message_count = $1 WHERE id = $2",
                        &[want, session],
                    )
                    .await
                    .map_err(from_pg)?;
                }
                Ok(drifted.len())
            })
        })
        .await
    }
}

async fn rows(tx: &Tx<'_>, sql: &str) -> Result<Vec<Row>> {
    tx.query(sql, &[]).await.map_err(from_pg)
}

/// Runs every check inside one read transaction.
async fn check_tx(tx: &Tx<'_>, options: &CheckOptions) -> Result<InvariantReport> {
    let mut report = InvariantReport::default();
    let version: i64 = rows(tx, "SELECT version FROM schema_version WHERE id = 1")
        .await?
        .first()
        .map_or(0, |r| r.get(0));
    let version = u32::try_from(version)
        .map_err(|_| StoreError::corrupt("schema_version.version", version))?;
    if version > crate::SCHEMA_VERSION {
        return Err(StoreError::NewerSchema {
            found: version,
            supported: crate::SCHEMA_VERSION,
        });
    }
    integrity::integrity(tx, &mut report).await?;
    if version < crate::SCHEMA_VERSION {
        report.add(
            Invariant::Schema,
            format!(
                "schema version {version}, this build writes {}",
                crate::SCHEMA_VERSION
            ),
        );
        // The other checks read today's tables.
        return Ok(report);
    }
    // A check that cannot finish is a finding, not the end of the others.
    // Each runs in a savepoint: a failed statement aborts only its own.
    macro_rules! run {
        ($invariant:expr, $check:expr) => {
            tx.batch_execute("SAVEPOINT keel_check")
                .await
                .map_err(from_pg)?;
            match $check(tx, options, &mut report).await {
                Ok(()) => tx.batch_execute("RELEASE SAVEPOINT keel_check"),
                Err(e) => {
                    report.push(
                        $invariant,
                        false,
                        format!("the check could not finish: {e}"),
                    );
                    tx.batch_execute("ROLLBACK TO SAVEPOINT keel_check")
                }
            }
            .await
            .map_err(from_pg)?;
        };
    }
    run!(Invariant::History, histories);
    run!(Invariant::History, inputs::open_inputs);
    run!(Invariant::Counters, counters);
    run!(Invariant::MessageCounts, message_counts);
    run!(Invariant::Runs, runs);
    run!(Invariant::Completions, completions);
    run!(Invariant::QueuedInputs, inputs::queued_inputs);
    run!(Invariant::Runs, calls::call_spans);
    run!(Invariant::Webhooks, webhooks::webhooks);
    run!(Invariant::History, images::images);
    report.checked = count_rows(tx).await?;
    report.findings.sort();
    Ok(report)
}

async fn count_rows(tx: &Tx<'_>) -> Result<CheckedCounts> {
    let row = tx
        .query_one(
            "SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM messages), \
                    (SELECT count(*) FROM checkpoints), (SELECT count(*) FROM agent_runs), \
                    (SELECT count(*) FROM agent_inbox_events)",
            &[],
        )
        .await
        .map_err(from_pg)?;
    let n = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap_or(0);
    Ok(CheckedCounts {
        sessions: n(0),
        messages: n(1),
        checkpoints: n(2),
        runs: n(3),
        events: n(4),
    })
}

/// One timeline: where it ends and the tool calls still unanswered at each
/// seq where some are (every other seq has none).
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

fn sorted(set: &HashSet<String>) -> String {
    let mut v: Vec<&str> = set.iter().map(String::as_str).collect();
    v.sort_unstable();
    v.join(", ")
}

/// Whether a state blob restores: its bytes match its hash and the
/// engine's decoder (when given) reads them.
fn state_ok(options: &CheckOptions, hash: &str, bytes: &[u8]) -> std::result::Result<(), String> {
    if sha256_hex(bytes) != hash {
        return Err("its bytes do not match their hash".into());
    }
    match &options.state_decoder {
        Some(decode) => decode(bytes),
        None => Ok(()),
    }
}

/// A state blob: `None` when missing, `Some(Err)` when unreadable.
async fn blob(tx: &Tx<'_>, hash: &str) -> Result<Option<std::result::Result<Vec<u8>, String>>> {
    match read_state_blob(tx, hash).await {
        Ok(bytes) => Ok(bytes.map(Ok)),
        Err(e @ StoreError::Corruption(_)) => Ok(Some(Err(e.to_string()))),
        Err(e) => Err(e),
    }
}

/// Walks every timeline, then checks every session head and checkpoint
/// against the walk.
async fn histories(
    tx: &Tx<'_>,
    options: &CheckOptions,
    report: &mut InvariantReport,
) -> Result<()> {
    let timelines = walk_timelines(tx, report).await?;
    let awaiting = AwaitingApproval::new(
        rows(
            tx,
            "SELECT session_id, tool_call_id FROM tool_approvals WHERE settled_at IS NULL",
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1))),
    );
    let heads = rows(
        tx,
        "SELECT id, head_timeline_id, state_hash FROM sessions WHERE deleted_at IS NULL \
         ORDER BY id",
    )
    .await?;
    for r in heads {
        let (session, head, state_hash): (String, Option<String>, Option<String>) =
            (r.get(0), r.get(1), r.get(2));
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
        if let Some(open) = awaiting.unanswered(&session, walk.open_at(walk.last_seq)) {
            report.add(
                Invariant::History,
                format!(
                    "session {session}'s history ends inside a turn: tool call(s) {} have no result",
                    sorted(&open)
                ),
            );
        }
        if let Some(hash) = state_hash {
            match blob(tx, &hash).await? {
                None => report.add(
                    Invariant::Checkpoints,
                    format!("session {session}'s state blob {hash} is missing"),
                ),
                Some(bytes) => {
                    if let Err(e) = bytes.and_then(|b| state_ok(options, &hash, &b)) {
                        report.add(
                            Invariant::Checkpoints,
                            format!("session {session}'s current state does not restore: {e}"),
                        );
                    }
                }
            }
        }
    }
    let checkpoints = rows(
        tx,
        "SELECT id, session_id, timeline_id, seq, state_hash FROM checkpoints ORDER BY id",
    )
    .await?;
    for r in checkpoints {
        let (id, session, timeline, seq, hash): (String, String, String, i64, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
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
                if let Some(open) = awaiting.unanswered(&session, walk.open_at(seq)) {
                    report.add(
                        Invariant::Checkpoints,
                        format!(
                            "{at}: points into a half turn (tool call(s) {} unanswered)",
                            sorted(&open)
                        ),
                    );
                }
            }
        }
        match blob(tx, &hash).await? {
            None => report.add(
                Invariant::Checkpoints,
                format!("{at}: its state blob {hash} is missing"),
            ),
            Some(bytes) => {
                if let Err(e) = bytes.and_then(|b| state_ok(options, &hash, &b)) {
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

/// Every timeline, parents before children, walked message by message:
/// seqs contiguous after the fork point, every message readable and of its
/// row's role, every tool result answering an open call.
async fn walk_timelines(
    tx: &Tx<'_>,
    report: &mut InvariantReport,
) -> Result<HashMap<String, TimelineWalk>> {
    let mut pending: Vec<(String, Option<(String, i64)>)> =
        rows(tx, "SELECT id, parent_timeline_id, fork_seq FROM timelines")
            .await?
            .iter()
            .map(|r| {
                let parent: Option<String> = r.get(1);
                (r.get(0), parent.zip(r.get::<_, Option<i64>>(2)))
            })
            .collect();
    let mut done: HashMap<String, TimelineWalk> = HashMap::new();
    let messages = "SELECT seq, role, content FROM messages WHERE timeline_id = $1 ORDER BY seq";
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
            for r in tx.query(messages, &[&id]).await.map_err(from_pg)? {
                let (seq, role, content): (i64, String, String) = (r.get(0), r.get(1), r.get(2));
                let at = format!("timeline {id} seq {seq}");
                if seq != walk.last_seq + 1 {
                    report.add(
                        Invariant::History,
                        format!("{at}: follows seq {} (a gap or overlap)", walk.last_seq),
                    );
                }
                walk.last_seq = seq;
                let message: Message = match serde_json::from_str(&content) {
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

async fn counters(tx: &Tx<'_>, _: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    let stored = rows(
        tx,
        "SELECT root_session_id, pending_event_count, reserved_completion_slots \
         FROM agent_session_state ORDER BY root_session_id",
    )
    .await?;
    let mut seen = HashSet::new();
    for r in stored {
        let (root, pending, reserved): (String, i64, i64) = (r.get(0), r.get(1), r.get(2));
        let (want_pending, want_reserved) = recount_tx(tx, &root).await?;
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
    let roots = rows(
        tx,
        "SELECT root_session_id FROM agent_runs \
         UNION SELECT root_session_id FROM agent_inbox_events",
    )
    .await?;
    for r in roots {
        let root: String = r.get(0);
        if seen.contains(&root) {
            continue;
        }
        let (pending, reserved) = recount_tx(tx, &root).await?;
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

async fn message_counts(tx: &Tx<'_>, _: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    for (session, stored, want) in drifted_message_counts(tx).await? {
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
async fn drifted_message_counts(tx: &Tx<'_>) -> Result<Vec<(String, i64, i64)>> {
    let sessions = rows(
        tx,
        "SELECT id, head_timeline_id, message_count FROM sessions \
         WHERE deleted_at IS NULL AND head_timeline_id IS NOT NULL ORDER BY id",
    )
    .await?;
    let mut drifted = Vec::new();
    for r in sessions {
        let (session, head, stored): (String, String, i64) = (r.get(0), r.get(1), r.get(2));
        let want = visible_inputs(tx, &head, i64::MAX).await?;
        if stored != want {
            drifted.push((session, stored, want));
        }
    }
    Ok(drifted)
}

async fn runs(tx: &Tx<'_>, options: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    let generation: i64 = rows(tx, "SELECT generation FROM runtime_state WHERE id = 1")
        .await?
        .first()
        .map_or(0, |r| r.get(0));
    // The server's status CHECK refuses what this keel does not know; the
    // query stays for a database a newer keel wrote before this one's CHECK.
    let known: Vec<String> = RunStatus::ALL
        .iter()
        .map(|s| format!("'{}'", s.as_str()))
        .collect();
    let unknown = rows(
        tx,
        &format!(
            "SELECT id, status FROM agent_runs WHERE status NOT IN ({}) ORDER BY id",
            known.join(", ")
        ),
    )
    .await?;
    for r in unknown {
        let (run, status): (String, String) = (r.get(0), r.get(1));
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
    let pauses = rows(
        tx,
        "SELECT r.id, 'has no pause row' FROM agent_runs r WHERE r.status = 'waiting_approval' \
           AND NOT EXISTS (SELECT 1 FROM agent_run_pauses p WHERE p.run_id = r.id) \
         UNION ALL \
         SELECT r.id, 'has no approval to wait for' FROM agent_runs r \
         WHERE r.status = 'waiting_approval' AND NOT EXISTS (SELECT 1 FROM tool_approvals a \
           WHERE a.run_id = r.id AND a.settled_at IS NULL) \
         UNION ALL \
         SELECT p.run_id, 'has a pause row but is not waiting for approval' \
         FROM agent_run_pauses p JOIN agent_runs r ON r.id = p.run_id \
         WHERE r.status <> 'waiting_approval' ORDER BY 1",
    )
    .await?;
    for r in pauses {
        let (run, what): (String, String) = (r.get(0), r.get(1));
        report.push(Invariant::Runs, false, format!("run {run} {what}"));
    }
    let open = rows(
        tx,
        &format!(
            "SELECT id, status, runtime_generation FROM agent_runs \
             WHERE status IN {EXECUTING_RUN} ORDER BY id"
        ),
    )
    .await?;
    // Every registered process runs its own generation's runs.
    let registered: Vec<i64> = rows(tx, "SELECT generation FROM runtime_processes")
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for r in open {
        let (run, status, run_generation): (String, String, i64) = (r.get(0), r.get(1), r.get(2));
        if options.owner_alive && registered.contains(&run_generation) {
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
    let missing = rows(
        tx,
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
    )
    .await?;
    for r in missing {
        let what = match (r.get::<_, Option<String>>(0), r.get::<_, Option<String>>(1)) {
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

async fn completions(tx: &Tx<'_>, _: &CheckOptions, report: &mut InvariantReport) -> Result<()> {
    let events = rows(
        tx,
        &format!(
            "SELECT e.id, e.scope_kind, e.scope_id, e.status, \
                (e.status = 'consumed' AND e.consumed_at IS NULL) \
                  OR (e.status = 'dead_letter' AND e.dead_lettered_at IS NULL), \
                r.status IN {NONTERMINAL_RUN} \
             FROM agent_inbox_events e LEFT JOIN agent_runs r \
               ON e.scope_kind = 'run' AND r.id = e.scope_id \
             WHERE e.event_type IN ('completion', 'group_completion') ORDER BY e.id"
        ),
    )
    .await?;
    for r in events {
        let (id, scope, scope_id, status): (String, String, String, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        let (unstamped, run_open): (bool, Option<bool>) = (r.get(4), r.get(5));
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
    let doubled = rows(
        tx,
        "SELECT scope_kind, scope_id, count(*) FROM agent_inbox_events \
         WHERE event_type IN ('completion', 'group_completion') \
         GROUP BY scope_kind, scope_id HAVING count(*) > 1",
    )
    .await?;
    for r in doubled {
        let (scope, id, n): (String, String, i64) = (r.get(0), r.get(1), r.get(2));
        report.add(
            Invariant::Completions,
            format!("{scope} {id} has {n} completions; it must have one"),
        );
    }
    Ok(())
}
