//! `cargo bench -p keel-engine --bench engine`: the engine's checkpoints,
//! recovery, per-turn overhead and idle memory, each compared with a
//! baseline measured in the same run. Prints one `BENCH <name> key=value …`
//! line per figure (lines starting with `#` explain them).
//!
//! Turns are driven through [`SessionManager::submit_turn`] with a
//! zero-latency provider that answers every request at once with a fixed
//! text ([`InstantProvider`]). `ScriptedProvider::offline()` is used only for
//! a short comparison run: it keeps a clone of every request it receives, so
//! over a 1000-turn session it would hold ~10⁶ cloned messages and its own
//! bookkeeping would dominate the figures.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use keel_core::{
    AgentId, CancellationToken, ChatRequest, CheckpointId, FinishReason, Provider, ProviderError,
    ProviderStream, ScriptedProvider, SessionId, StreamEvent, ToolRegistry, Usage,
};
use keel_engine::AgentProfile;
use keel_engine::DialogAddress;
use keel_engine::{NewSessionSpec, RuntimeBundle, SessionManager, SessionManagerConfig};
use keel_store::{
    CheckpointSource, NewCheckpoint, NewMessage, NewSession, Store, StoreOptions, TurnCommit,
};
use rusqlite::{params, Connection, OpenFlags};

mod approval;
mod inbox;

/// Turns of the long session (figures 1–3).
const LONG_TURNS: u32 = 1000;
/// Turns of the short session and of the first checkpoint measurement.
const SHORT_TURNS: u32 = 10;
/// Manual checkpoints measured at each history length.
const CHECKPOINT_SAMPLES: usize = 51;
/// Untimed manual checkpoints taken before each series.
const CHECKPOINT_WARMUP: usize = 5;
/// Turns at each end of the long session whose WAL growth is averaged.
const TURN_SAMPLES: usize = 20;
/// Replays of the long session's context measured (median reported).
const REPLAY_SAMPLES: usize = 21;
/// Recoveries per session through a warm store handle (median reported).
const RECOVER_WARM: usize = 21;
/// Recoveries per session through a freshly opened store (median reported).
const RECOVER_COLD: usize = 7;
/// Turns of the turn-overhead comparison, per side.
const OVERHEAD_TURNS: u32 = 1000;
/// Turns of the turn-overhead comparison with `ScriptedProvider::offline()`.
const SCRIPTED_TURNS: u32 = 200;
/// Turns run by one side before the other side runs as many (interleaving).
const OVERHEAD_BLOCK: u32 = 100;
/// Sessions loaded for the idle-memory figure.
const IDLE_SESSIONS: usize = 1000;
/// Environment variable that makes the binary run the idle-memory child.
const CHILD_ENV: &str = "KEEL_ENGINE_BENCH_IDLE_MEMORY_DIR";

/// The assistant's fixed answer (about the size of the offline echo).
const REPLY: &str = "Understood. Here is a considered answer of a realistic length, long \
enough to look like a short assistant reply in a chat: it restates the question, gives two \
or three sentences of substance and ends with a suggestion for what to do next, so that each \
stored assistant message is a few hundred bytes of JSON like a real one would be.";

/// A provider that answers every request at once with [`REPLY`] and keeps
/// nothing (zero latency, constant cost per call).
struct InstantProvider;

#[async_trait]
impl Provider for InstantProvider {
    fn name(&self) -> &str {
        "instant"
    }

    fn model(&self) -> &str {
        "instant"
    }

    async fn stream(
        &self,
        _request: &ChatRequest,
        _cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let events = vec![
            Ok(StreamEvent::TextDelta {
                text: REPLY.to_owned(),
            }),
            Ok(StreamEvent::Usage {
                usage: Usage::new(100, 60),
            }),
            Ok(StreamEvent::Finish {
                reason: FinishReason::Stop,
            }),
        ];
        Ok(Box::pin(futures::stream::iter(events)))
    }
}

/// The user input of turn `n` (about 230 bytes, like the store benchmark).
fn question(n: u32) -> String {
    format!("question {n:06}: {}", "please look into this ".repeat(10))
}

/// A manager over `store` whose root agent runs `provider`, auto-checkpoint
/// on, auto-title, summaries and compaction off.
fn manager(store: Store, provider: Arc<dyn Provider>) -> Arc<SessionManager> {
    let root = AgentProfile {
        name: AgentId::parse("root").unwrap(),
        system_prompt: "You are a helpful assistant.".into(),
        provider,
        tools: Arc::new(ToolRegistry::new()),
        max_iterations: 4,
        max_output_tokens: None,
        // No compaction: these figures are about the whole history.
        context_window_tokens: usize::MAX,
        approval: keel_engine::ApprovalPolicy::none(),
        prices: None,
    };
    SessionManager::new(
        store,
        RuntimeBundle::new(root),
        SessionManagerConfig {
            auto_checkpoint: true,
            auto_title_after: 0,
            summary: None,
            ..SessionManagerConfig::default()
        },
    )
}

/// A dialog address in chat `chat`.
fn spec(chat: &str, dialog: &str) -> NewSessionSpec {
    NewSessionSpec {
        address: DialogAddress::new("bench", chat, dialog).unwrap(),
        title: None,
        agent: None,
    }
}

/// Store options whose WAL only grows (no automatic WAL checkpoint), so the
/// WAL size delta is exactly what a transaction wrote.
fn growing_wal() -> StoreOptions {
    StoreOptions {
        wal_autocheckpoint_pages: 0,
        ..StoreOptions::default()
    }
}

/// Size of `db`'s WAL file (0 when absent).
fn wal_size(db: &Path) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

/// Median of `samples`.
fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// Microseconds, for printing.
fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// `a / b`, 0 when `b` is 0.
fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        a / b
    }
}

/// A plain SQLite connection beside the store, used only to read row sizes
/// (and once to fold the WAL back into the database file).
fn side_connection(db: &Path) -> Connection {
    Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .unwrap()
}

/// Page numbers of the WAL frames between byte offsets `from` and `to` of
/// `db`'s WAL (frames are a 24-byte header, whose first 4 bytes are the page
/// number, then one page).
fn wal_frame_pages(db: &Path, from: u64, to: u64) -> Vec<u32> {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    let Ok(bytes) = std::fs::read(wal) else {
        return Vec::new();
    };
    let Some(page_size) = bytes
        .get(8..12)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    else {
        return Vec::new();
    };
    let frame = 24 + page_size as usize;
    let mut at = (from as usize).max(32);
    let mut pages = Vec::new();
    while at + frame <= (to as usize).min(bytes.len()) {
        let h = &bytes[at..at + 4];
        pages.push(u32::from_be_bytes([h[0], h[1], h[2], h[3]]));
        at += frame;
    }
    pages
}

/// Average WAL frames per sample by the table or index owning each page
/// (SQLite's `dbstat`), as `name:frames,…`.
fn frames_by_btree(side: &Connection, pages: &[u32], samples: usize) -> String {
    let owners: BTreeMap<u32, String> = match side.prepare("SELECT pageno, name FROM dbstat") {
        Ok(mut stmt) => stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map(|rows| rows.filter_map(Result::ok).collect())
            .unwrap_or_default(),
        Err(_) => return "unavailable".into(),
    };
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for p in pages {
        let name = match *p {
            1 => "header_page_1",
            p => owners.get(&p).map_or("other", String::as_str),
        };
        *counts.entry(name).or_default() += 1;
    }
    counts
        .iter()
        .map(|(name, n)| format!("{name}:{:.2}", *n as f64 / samples as f64))
        .collect::<Vec<_>>()
        .join(",")
}

/// Number and total payload bytes of the state blobs.
fn blob_totals(side: &Connection) -> (i64, i64) {
    side.query_row(
        "SELECT count(*), coalesce(sum(length(hash) + length(bytes)), 0) FROM state_blobs",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .unwrap()
}

/// Payload bytes of one checkpoint row: its text columns' lengths plus 8
/// bytes per integer column (indexes and SQLite page overhead not counted).
fn checkpoint_row_bytes(side: &Connection, id: CheckpointId) -> i64 {
    side.query_row(
        "SELECT length(id) + length(session_id) + length(timeline_id) \
              + coalesce(length(parent_checkpoint_id), 0) + length(state_hash) \
              + length(source) + 8 * 3 \
         FROM checkpoints WHERE id = ?1",
        params![id.to_string()],
        |r| r.get(0),
    )
    .unwrap()
}

/// What a series of manual checkpoints at one history length cost.
struct CheckpointCost {
    /// Mean WAL growth per checkpoint.
    wal_bytes: f64,
    /// Mean logical bytes per checkpoint (row payload + new state blob).
    logical_bytes: f64,
    /// Mean bytes of new state blobs per checkpoint (0 when reused).
    blob_bytes: f64,
    /// Median latency of `SessionManager::checkpoint`.
    median: Duration,
    /// Average WAL frames per checkpoint by owning table or index.
    frames: String,
}

/// Takes [`CHECKPOINT_WARMUP`] untimed then [`CHECKPOINT_SAMPLES`] measured
/// manual checkpoints of `id`: each one's WAL growth, logical bytes and
/// latency.
async fn manual_checkpoints(
    m: &Arc<SessionManager>,
    side: &Connection,
    db: &Path,
    id: SessionId,
) -> CheckpointCost {
    for _ in 0..CHECKPOINT_WARMUP {
        m.create_checkpoint(id).await.unwrap();
    }
    let (mut wal, mut logical, mut blobs) = (0u64, 0i64, 0i64);
    let mut times = Vec::with_capacity(CHECKPOINT_SAMPLES);
    let mut pages = Vec::new();
    for _ in 0..CHECKPOINT_SAMPLES {
        let (_, blob_before) = blob_totals(side);
        let wal_before = wal_size(db);
        let start = Instant::now();
        let record = m.create_checkpoint(id).await.unwrap();
        times.push(start.elapsed());
        let wal_after = wal_size(db);
        wal += wal_after - wal_before;
        pages.extend(wal_frame_pages(db, wal_before, wal_after));
        let (_, blob_after) = blob_totals(side);
        let new_blob = (blob_after - blob_before).max(0);
        blobs += new_blob;
        logical += checkpoint_row_bytes(side, record.id) + new_blob;
    }
    let n = CHECKPOINT_SAMPLES as f64;
    CheckpointCost {
        wal_bytes: wal as f64 / n,
        logical_bytes: logical as f64 / n,
        blob_bytes: blobs as f64 / n,
        median: median(&mut times),
        frames: frames_by_btree(side, &pages, CHECKPOINT_SAMPLES),
    }
}

/// Median latency and mean WAL growth of manual checkpoints of each of
/// `ids`, taken alternately in the same database.
async fn interleaved_checkpoints(
    m: &Arc<SessionManager>,
    db: &Path,
    ids: &[SessionId],
) -> Vec<(Duration, f64)> {
    let mut times = vec![Vec::with_capacity(CHECKPOINT_SAMPLES); ids.len()];
    let mut bytes = vec![Vec::with_capacity(CHECKPOINT_SAMPLES); ids.len()];
    for _ in 0..CHECKPOINT_SAMPLES {
        for (i, id) in ids.iter().enumerate() {
            let wal_before = wal_size(db);
            let start = Instant::now();
            m.create_checkpoint(*id).await.unwrap();
            times[i].push(start.elapsed());
            bytes[i].push(wal_size(db) - wal_before);
        }
    }
    times
        .iter_mut()
        .zip(&bytes)
        .map(|(t, b)| (median(t), mean(b)))
        .collect()
}

/// Median latency of building the long session's replayed context
/// (`AgentSession::replay`, a clone of every message) and of one more clone
/// of it (the agent loop copies the context once per provider call).
async fn replay_cost(m: &Arc<SessionManager>, id: SessionId) -> (usize, Duration, Duration) {
    let session = m.get(id).unwrap();
    let guard = session.lock().await;
    let (mut replays, mut clones) = (Vec::new(), Vec::new());
    let mut len = 0;
    for _ in 0..REPLAY_SAMPLES {
        let start = Instant::now();
        let context = guard.replay("default").unwrap();
        replays.push(start.elapsed());
        len = context.len();
        let start = Instant::now();
        let copy = context.clone();
        drop(copy);
        clones.push(start.elapsed());
    }
    (len, median(&mut replays), median(&mut clones))
}

/// Mean of `xs`.
fn mean(xs: &[u64]) -> f64 {
    ratio(xs.iter().sum::<u64>() as f64, xs.len() as f64)
}

/// Median latency of `recover` of each of `ids` (interleaved), each sample
/// through a new manager; `cold` opens a new store (empty SQLite page cache)
/// for every sample, otherwise the manager shares `store`.
async fn recover_medians(
    store: &Store,
    db: &Path,
    ids: &[SessionId],
    samples: usize,
    cold: bool,
) -> Vec<Duration> {
    let mut times = vec![Vec::with_capacity(samples); ids.len()];
    for _ in 0..samples {
        for (i, id) in ids.iter().enumerate() {
            let s = if cold {
                Store::open(db, growing_wal()).unwrap()
            } else {
                store.clone()
            };
            let fresh = manager(s, Arc::new(InstantProvider));
            let start = Instant::now();
            fresh.load(*id).await.unwrap();
            times[i].push(start.elapsed());
        }
    }
    times.iter_mut().map(|t| median(t)).collect()
}

/// Figures 1–3 (checkpoint bytes and time, snapshot size, recovery) and the
/// per-turn latency growth of the long session.
async fn long_session(dir: &Path) {
    let db = dir.join("long.db");
    let store = Store::open(&db, growing_wal()).unwrap();
    let side = side_connection(&db);
    let m = manager(store.clone(), Arc::new(InstantProvider));
    let long = m.create(spec("long", "long")).await.unwrap();
    let short = m.create(spec("long", "short")).await.unwrap();
    for n in 0..SHORT_TURNS {
        m.submit_turn(short, &question(n)).await.unwrap();
    }

    let mut turn_times = Vec::with_capacity(LONG_TURNS as usize);
    let mut turn_wal = Vec::with_capacity(LONG_TURNS as usize);
    let mut at10 = None;
    for n in 0..LONG_TURNS {
        if n == SHORT_TURNS {
            at10 = Some(manual_checkpoints(&m, &side, &db, long).await);
        }
        let wal_before = wal_size(&db);
        let start = Instant::now();
        m.submit_turn(long, &question(n)).await.unwrap();
        turn_times.push(start.elapsed());
        turn_wal.push(wal_size(&db) - wal_before);
    }
    let at10 = at10.unwrap();
    let at1000 = manual_checkpoints(&m, &side, &db, long).await;

    println!(
        "BENCH checkpoint_bytes measure=wal_growth_per_manual_checkpoint samples={CHECKPOINT_SAMPLES} \
         bytes_at_10={:.0} bytes_at_1000={:.0} ratio={:.2} target_ratio<=1.2",
        at10.wal_bytes,
        at1000.wal_bytes,
        ratio(at1000.wal_bytes, at10.wal_bytes)
    );
    println!(
        "BENCH checkpoint_bytes measure=logical_row_plus_new_blob_bytes samples={CHECKPOINT_SAMPLES} \
         bytes_at_10={:.0} bytes_at_1000={:.0} ratio={:.2} new_blob_bytes_at_10={:.0} new_blob_bytes_at_1000={:.0}",
        at10.logical_bytes,
        at1000.logical_bytes,
        ratio(at1000.logical_bytes, at10.logical_bytes),
        at10.blob_bytes,
        at1000.blob_bytes
    );
    println!(
        "BENCH checkpoint_wal_frames measure=avg_frames_per_manual_checkpoint_by_btree at_10={} at_1000={}",
        at10.frames, at1000.frames
    );
    println!(
        "BENCH checkpoint_time measure=median_manual_checkpoint_latency samples={CHECKPOINT_SAMPLES} \
         us_at_10={:.0} us_at_1000={:.0} ratio={:.2}",
        us(at10.median),
        us(at1000.median),
        ratio(us(at1000.median), us(at10.median))
    );

    // Figure 2: the full-JSON export of the same session at turn 1000.
    let start = Instant::now();
    let snapshot = m.export_dialog(long).await.unwrap();
    let json = serde_json::to_vec(&snapshot).unwrap();
    let export_time = start.elapsed();
    let snap_bytes = json.len() as f64;
    println!(
        "BENCH snapshot_vs_checkpoint turns={LONG_TURNS} messages={} snapshot_bytes={snap_bytes:.0} \
         export_us={:.0} checkpoint_wal_bytes={:.0} ratio_vs_wal={:.1} checkpoint_logical_bytes={:.0} \
         ratio_vs_logical={:.1}",
        snapshot.messages.len(),
        us(export_time),
        at1000.wal_bytes,
        ratio(snap_bytes, at1000.wal_bytes),
        at1000.logical_bytes,
        ratio(snap_bytes, at1000.logical_bytes)
    );

    // Figure 3: recovery at 10 vs 1000 turns, after folding the WAL (grown by
    // the no-autocheckpoint setting) back into the database file.
    let _ = side.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
    let warm = recover_medians(&store, &db, &[short, long], RECOVER_WARM, false).await;
    let cold = recover_medians(&store, &db, &[short, long], RECOVER_COLD, true).await;
    println!(
        "BENCH recover cache=warm_store_handle samples={RECOVER_WARM} us_at_10={:.0} us_at_1000={:.0} ratio={:.1}",
        us(warm[0]),
        us(warm[1]),
        ratio(us(warm[1]), us(warm[0]))
    );
    println!(
        "BENCH recover cache=new_store_per_sample samples={RECOVER_COLD} us_at_10={:.0} us_at_1000={:.0} ratio={:.1}",
        us(cold[0]),
        us(cold[1]),
        ratio(us(cold[1]), us(cold[0]))
    );

    let cp = interleaved_checkpoints(&m, &db, &[short, long]).await;
    println!(
        "BENCH checkpoint_bytes measure=wal_growth_per_manual_checkpoint_interleaved_10_vs_1000_turn_sessions_same_db \
         samples={CHECKPOINT_SAMPLES} bytes_at_10={:.0} bytes_at_1000={:.0} ratio={:.2}",
        cp[0].1,
        cp[1].1,
        ratio(cp[1].1, cp[0].1)
    );
    println!(
        "BENCH checkpoint_time measure=median_manual_checkpoint_latency_interleaved_10_vs_1000_turn_sessions_same_db \
         samples={CHECKPOINT_SAMPLES} us_at_10={:.0} us_at_1000={:.0} ratio={:.2}",
        us(cp[0].0),
        us(cp[1].0),
        ratio(us(cp[1].0), us(cp[0].0))
    );

    // Whole turns (messages + state blob + auto-checkpoint) of the long
    // session: its first turns vs its last turns.
    let turn_first = mean(&turn_wal[..TURN_SAMPLES]);
    let turn_last = mean(&turn_wal[turn_wal.len() - TURN_SAMPLES..]);
    println!(
        "BENCH checkpoint_bytes measure=wal_growth_per_turn_with_auto_checkpoint samples={TURN_SAMPLES} \
         bytes_turns_1_{TURN_SAMPLES}={turn_first:.0} bytes_turns_{}_{LONG_TURNS}={turn_last:.0} ratio={:.2}",
        LONG_TURNS as usize - TURN_SAMPLES + 1,
        ratio(turn_last, turn_first)
    );
    let (context_len, replay, clone) = replay_cost(&m, long).await;
    let short_replay = replay_cost(&m, short).await;
    let first = median(&mut turn_times[..100].to_vec());
    let last = median(&mut turn_times[turn_times.len() - 100..].to_vec());
    println!(
        "BENCH turn_latency_growth measure=median_submit_turn turns_1_100_us={:.0} turns_901_1000_us={:.0} ratio={:.2}",
        us(first),
        us(last),
        ratio(us(last), us(first))
    );
    println!(
        "BENCH turn_breakdown measure=median_context_copy context_messages={context_len} replay_us={:.0} \
         loop_clone_us={:.0} replay_us_at_10={:.0}",
        us(replay),
        us(clone),
        us(short_replay.1)
    );
}

/// Figure 4: `turns` turns through `submit_turn` against `commit_turn` of the
/// same rows (the engine's messages, a same-sized state blob, a turn
/// checkpoint) on separate files with the same options, in alternating
/// blocks of [`OVERHEAD_BLOCK`] turns.
async fn turn_overhead(
    dir: &Path,
    label: &str,
    provider: Arc<dyn Provider>,
    turns: u32,
) -> Overhead {
    let engine_store = Store::open(
        dir.join(format!("engine-{label}.db")),
        StoreOptions::default(),
    )
    .unwrap();
    let raw_store =
        Store::open(dir.join(format!("raw-{label}.db")), StoreOptions::default()).unwrap();
    let m = manager(engine_store, provider);
    let id = m.create(spec("overhead", label)).await.unwrap();
    let raw = raw_store
        .create_session(NewSession {
            id: SessionId::new(),
            channel: "bench".into(),
            chat_id: "raw".into(),
            dialog_id: label.into(),
            title: "raw".into(),
            agent_id: Some(AgentId::parse("root").unwrap()),
            parent_id: None,
            delivery_context: None,
            now_ms: keel_core::time::now_ms(),
        })
        .await
        .unwrap()
        .id;
    let (mut engine_time, mut raw_time) = (Duration::ZERO, Duration::ZERO);
    let mut blocks = Vec::new();
    let mut n = 0;
    while n < turns {
        let block = OVERHEAD_BLOCK.min(turns - n);
        let start = Instant::now();
        for i in n..n + block {
            m.submit_turn(id, &question(i)).await.unwrap();
        }
        let engine_block = start.elapsed();
        engine_time += engine_block;
        // The same rows for the raw side, prepared outside the timing.
        let commits: Vec<TurnCommit> = {
            let session = m.get(id).unwrap();
            let guard = session.lock().await;
            let history = guard.history();
            let rows = &history[history.len() - 2 * block as usize..];
            rows.chunks(2)
                .zip(n..)
                .map(|(pair, i)| {
                    let mut state = guard.state().clone();
                    state.turn_index = i + 1;
                    state.cost.requests = u64::from(i) + 1;
                    TurnCommit {
                        calls: None,
                        session_id: raw,
                        messages: pair
                            .iter()
                            .map(|h| {
                                NewMessage::in_slot(&h.slot, keel_core::Message::clone(&h.message))
                            })
                            .collect(),
                        state: state.to_blob().unwrap(),
                        checkpoint: Some(NewCheckpoint {
                            id: CheckpointId::new(),
                            turn_index: u64::from(i) + 1,
                            source: CheckpointSource::Turn,
                        }),
                        visible_user_inputs: 1,
                        answers: Vec::new(),
                        expected_head: None,
                        now_ms: keel_core::time::now_ms(),
                    }
                })
                .collect()
        };
        let start = Instant::now();
        for c in commits {
            raw_store.commit_turn(c).await.unwrap();
        }
        let raw_block = start.elapsed();
        raw_time += raw_block;
        blocks.push((
            us(engine_block) / f64::from(block),
            us(raw_block) / f64::from(block),
        ));
        n += block;
    }
    let first = blocks.first().copied().unwrap_or_default();
    let last = blocks.last().copied().unwrap_or_default();
    Overhead {
        engine_rate: f64::from(turns) / engine_time.as_secs_f64(),
        raw_rate: f64::from(turns) / raw_time.as_secs_f64(),
        first,
        last,
    }
}

/// Result of [`turn_overhead`].
struct Overhead {
    /// Engine turns per second over the whole run.
    engine_rate: f64,
    /// Raw `commit_turn` turns per second over the whole run.
    raw_rate: f64,
    /// (engine, raw) µs per turn in the first block.
    first: (f64, f64),
    /// (engine, raw) µs per turn in the last block.
    last: (f64, f64),
}

impl Overhead {
    /// Prints the figure's line.
    fn print(&self, provider: &str, turns: u32, target: &str) {
        println!(
            "BENCH turn_overhead provider={provider} turns={turns} engine_turns_per_s={:.0} \
             raw_commit_turns_per_s={:.0} ratio={:.2}{target} first_block_us_engine={:.0} first_block_us_raw={:.0} \
             last_block_us_engine={:.0} last_block_us_raw={:.0} block={OVERHEAD_BLOCK}",
            self.engine_rate,
            self.raw_rate,
            ratio(self.raw_rate, self.engine_rate),
            self.first.0,
            self.first.1,
            self.last.0,
            self.last.1
        );
    }
}

/// Current resident set size in bytes (Linux `/proc/self/status`).
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Figure 5, parent side: stores [`IDLE_SESSIONS`] one-turn sessions, then
/// re-runs this binary as a child that loads them (a fresh process, so the
/// allocator holds no memory freed by the other figures).
async fn idle_memory(dir: &Path) {
    if rss_bytes().is_none() {
        println!("BENCH idle_session_memory skipped=no_proc_self_status");
        return;
    }
    let db = dir.join("idle.db");
    let m = manager(
        Store::open(&db, StoreOptions::default()).unwrap(),
        Arc::new(InstantProvider),
    );
    let mut ids = Vec::with_capacity(IDLE_SESSIONS);
    for i in 0..IDLE_SESSIONS {
        let id = m.create(spec("idle", &format!("{i:08x}"))).await.unwrap();
        m.submit_turn(id, &question(0)).await.unwrap();
        ids.push(id.to_string());
    }
    drop(m);
    std::fs::write(dir.join("ids.txt"), ids.join("\n")).unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, dir)
        .status()
        .unwrap();
    if !status.success() {
        println!("BENCH idle_session_memory skipped=child_failed status={status}");
    }
}

/// Figure 5, child side: warms SQLite's page caches with the same reads a
/// recovery does (results dropped one session at a time), then loads every
/// session into one manager and reports the RSS growth per session.
async fn idle_memory_child(dir: &Path) {
    let db = dir.join("idle.db");
    let ids: Vec<SessionId> = std::fs::read_to_string(dir.join("ids.txt"))
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    let store = Store::open(&db, StoreOptions::default()).unwrap();
    for _ in 0..3 {
        for id in &ids {
            let warm = manager(store.clone(), Arc::new(InstantProvider));
            warm.load(*id).await.unwrap();
        }
    }
    let m = manager(store.clone(), Arc::new(InstantProvider));
    let before = rss_bytes().unwrap_or(0);
    for id in &ids {
        m.load(*id).await.unwrap();
    }
    let after = rss_bytes().unwrap_or(0);
    let per = (after.saturating_sub(before)) as f64 / ids.len() as f64;
    println!(
        "BENCH idle_session_memory measure=rss_delta_fresh_process sessions={} messages_per_session=2 \
         loaded={} rss_before_kib={} rss_after_kib={} bytes_per_session={per:.0}",
        ids.len(),
        m.loaded(),
        before / 1024,
        after / 1024
    );
}

/// Runs every figure on a current-thread runtime (the store's writer and
/// reader threads are its own).
/// Turns per side of the delegation comparison.
const DELEGATION_TURNS: u32 = 200;
/// Turns run by one side before the other side runs as many.
const DELEGATION_BLOCK: u32 = 50;

/// The model of the delegation figure, a pure function of the request:
/// the helper answers at once; the root delegates when asked to, answers
/// after a tool result, and otherwise answers directly.
fn delegation_model(request: &ChatRequest) -> keel_core::ScriptedResponse {
    use keel_core::{Role, ScriptedResponse};
    let system = request
        .messages
        .first()
        .map(|m| m.text())
        .unwrap_or_default();
    let last = request.messages.last();
    if system.starts_with("You help") {
        return ScriptedResponse::text("done");
    }
    match last {
        Some(m) if m.role == Role::Tool => ScriptedResponse::text("The helper is done."),
        Some(m) if m.text().starts_with("delegate") => ScriptedResponse::tool_call(
            "delegate",
            serde_json::json!({"tasks": [{"agent": "helper", "task": "say done"}]}),
        ),
        _ => ScriptedResponse::text("Direct answer."),
    }
}

/// Foreground delegation of a trivial child vs a direct turn: turns/s of a
/// root turn that delegates one task (3 model calls, one persisted run)
/// against a root turn answered directly (1 model call), same manager.
async fn delegation_overhead(dir: &Path) {
    use keel_catalog::{AgentCatalog, CatalogInputs};
    use keel_engine::{AgentCoordinator, CoordinatorConfig, ProfileProviders};
    use keel_engine::{ExecutionGate, GateLimits};
    let store = Store::open(dir.join("delegation.db"), StoreOptions::default()).unwrap();
    let model: Arc<dyn Provider> =
        Arc::new(ScriptedProvider::new(Vec::new()).with_fallback(Arc::new(delegation_model)));
    let mut inputs = CatalogInputs::new(["default"], Arc::new(ToolRegistry::new()));
    inputs.root_delegates = vec![AgentId::parse("helper").unwrap()];
    let helper = "---\nid: helper\ndescription: Helps.\nllm_profile: default\n---\nYou help.\n";
    let catalog = AgentCatalog::from_texts([("helper.md", helper)], &inputs, 1).unwrap();
    let gate = Arc::new(ExecutionGate::new(GateLimits::default()));
    let coordinator = AgentCoordinator::new(
        store.clone(),
        Arc::new(catalog),
        Arc::new(ProfileProviders::new().with("default", model.clone())),
        Arc::new(ToolRegistry::new()),
        gate.clone(),
        CoordinatorConfig::default(),
    );
    let mut tools = ToolRegistry::new();
    for t in coordinator.root_tools() {
        tools.register(t).unwrap();
    }
    let root = AgentProfile {
        name: AgentId::parse("root").unwrap(),
        system_prompt: "You are the root.".into(),
        provider: model,
        tools: Arc::new(tools),
        max_iterations: 4,
        max_output_tokens: None,
        context_window_tokens: keel_engine::DEFAULT_CONTEXT_WINDOW_TOKENS,
        approval: keel_engine::ApprovalPolicy::none(),
        prices: None,
    };
    let bundle = RuntimeBundle::new(root)
        .with_loop(keel_engine::AgentLoop::new(gate))
        .with_coordinator(coordinator);
    let config = SessionManagerConfig {
        auto_title_after: 0,
        ..Default::default()
    };
    let m = SessionManager::new(store, bundle, config);
    let direct_id = m.create(spec("delegation", "direct")).await.unwrap();
    let delegating_id = m.create(spec("delegation", "delegating")).await.unwrap();
    let (mut direct, mut delegating) = (Duration::ZERO, Duration::ZERO);
    let mut done = 0;
    while done < DELEGATION_TURNS {
        let started = Instant::now();
        for _ in 0..DELEGATION_BLOCK {
            m.submit_turn(direct_id, "hello").await.unwrap();
        }
        direct += started.elapsed();
        let started = Instant::now();
        for _ in 0..DELEGATION_BLOCK {
            let r = m.submit_turn(delegating_id, "delegate this").await.unwrap();
            assert_eq!(r.output.tool_calls, 1);
        }
        delegating += started.elapsed();
        done += DELEGATION_BLOCK;
    }
    let per = |d: Duration| us(d) / f64::from(DELEGATION_TURNS);
    println!(
        "BENCH delegation_overhead turns={DELEGATION_TURNS} direct_turn_us={:.0} delegating_turn_us={:.0} ratio={:.2} model_calls_direct=1 model_calls_delegating=3 runs_persisted_per_turn=1",
        per(direct),
        per(delegating),
        ratio(per(delegating), per(direct))
    );
}

/// Turns of the compaction benchmark.
const COMPACTION_TURNS: usize = 500;
/// The context window of the compaction benchmark's agent.
const COMPACTION_WINDOW: usize = 4_000;
/// Its output cap per call (the budget is the window less this).
const COMPACTION_OUTPUT: u32 = 500;

/// Answers turns with [`REPLY`] and summary requests with a short summary,
/// each after a simulated model latency of 1 µs per request token; records
/// the estimated tokens of every turn request and the time summaries take.
struct CompactionModel {
    turn_tokens: parking_lot::Mutex<Vec<usize>>,
    summary_time: parking_lot::Mutex<Duration>,
    summaries: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Provider for CompactionModel {
    fn name(&self) -> &str {
        "compaction"
    }

    fn model(&self) -> &str {
        "compaction"
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        _cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let started = Instant::now();
        let tokens = keel_engine::estimate_request_tokens(request);
        std::thread::sleep(Duration::from_micros(tokens as u64));
        let summary = request.messages[0]
            .text()
            .starts_with("Summarize the conversation");
        let text = if summary {
            self.summaries
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            *self.summary_time.lock() += started.elapsed();
            "The user asks numbered questions about the same topic and gets considered answers \
             of a few sentences each, ending with suggestions for next steps."
                .to_owned()
        } else {
            self.turn_tokens.lock().push(tokens);
            REPLY.to_owned()
        };
        let events = vec![
            Ok(StreamEvent::TextDelta { text }),
            Ok(StreamEvent::Finish {
                reason: FinishReason::Stop,
            }),
        ];
        Ok(Box::pin(futures::stream::iter(events)))
    }
}

/// 500 turns through a 4,000-token window with compaction on (summaries
/// after turns, and before a request that would not fit): the estimated
/// request tokens late vs early, and the share of the run spent in summary
/// calls.
async fn compaction(dir: &Path) {
    let store = Store::open(dir.join("compaction.db"), StoreOptions::default()).unwrap();
    let model = Arc::new(CompactionModel {
        turn_tokens: parking_lot::Mutex::new(Vec::new()),
        summary_time: parking_lot::Mutex::new(Duration::ZERO),
        summaries: std::sync::atomic::AtomicUsize::new(0),
    });
    let root = AgentProfile {
        name: AgentId::parse("root").unwrap(),
        system_prompt: "You are a helpful assistant.".into(),
        provider: model.clone(),
        tools: Arc::new(ToolRegistry::new()),
        max_iterations: 4,
        max_output_tokens: Some(COMPACTION_OUTPUT),
        context_window_tokens: COMPACTION_WINDOW,
        approval: keel_engine::ApprovalPolicy::none(),
        prices: None,
    };
    let m = SessionManager::new(
        store,
        RuntimeBundle::new(root),
        SessionManagerConfig {
            auto_title_after: 0,
            ..SessionManagerConfig::default()
        },
    );
    let id = m.create(spec("compaction", "long")).await.unwrap();
    let started = Instant::now();
    for n in 0..COMPACTION_TURNS {
        m.submit_turn(id, &question(n as u32)).await.unwrap();
    }
    m.housekeeping_settled(id).await;
    let total = started.elapsed();
    let tokens = model.turn_tokens.lock().clone();
    assert_eq!(tokens.len(), COMPACTION_TURNS);
    let mean = |r: std::ops::Range<usize>| {
        let n = r.len() as f64;
        tokens[r].iter().sum::<usize>() as f64 / n
    };
    let (at20, at500) = (tokens[19] as f64, tokens[COMPACTION_TURNS - 1] as f64);
    let (early, late) = (mean(10..30), mean(COMPACTION_TURNS - 20..COMPACTION_TURNS));
    let budget = COMPACTION_WINDOW - COMPACTION_OUTPUT as usize;
    let summary_time = *model.summary_time.lock();
    println!(
        "BENCH compaction turns={COMPACTION_TURNS} budget_tokens={budget} request_tokens_at_20={at20:.0} \
         request_tokens_at_500={at500:.0} ratio={:.2} mean_tokens_turns_11_30={early:.0} \
         mean_tokens_turns_481_500={late:.0} mean_ratio={:.2} max_request_tokens={} summaries={} \
         compacting_share={:.3} target_ratio<=1.5",
        at500 / at20,
        late / early,
        tokens.iter().max().unwrap(),
        model.summaries.load(std::sync::atomic::Ordering::Relaxed),
        summary_time.as_secs_f64() / total.as_secs_f64(),
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        rt.block_on(idle_memory_child(&PathBuf::from(dir)));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // `cargo bench -p keel-engine --bench engine -- compaction` runs that figure alone.
    if std::env::args().skip(1).any(|a| a == "compaction") {
        rt.block_on(compaction(dir.path()));
        return;
    }
    // `-- approval` runs the approval figure alone.
    if std::env::args().skip(1).any(|a| a == "approval") {
        rt.block_on(approval::decision_latency(dir.path()));
        return;
    }
    // `-- inbox` runs the two inbox figures alone.
    if std::env::args().skip(1).any(|a| a == "inbox") {
        rt.block_on(async {
            inbox::continuation_latency(dir.path()).await;
            inbox::delivery_rate(dir.path()).await;
        });
        return;
    }
    println!("# keel-engine benchmark. Ratios compare figures measured in this same run.");
    println!("# checkpoint_bytes: one manual SessionManager::checkpoint of one session at turn 10 vs turn 1000;");
    println!("#   wal_growth = growth of <db>-wal (autocheckpoint off, so the WAL only grows; whole 4 KiB pages + 24 B frame headers);");
    println!("#   logical = checkpoint row payload (text lengths + 8 B per integer) + any newly inserted state blob (hash + bytes).");
    println!("#   interleaved_10_vs_1000_turn_sessions_same_db = a 10-turn and the 1000-turn session checkpointed alternately at the end (same database size).");
    println!("# checkpoint_wal_frames: WAL frames per manual checkpoint by owning table/index (SQLite dbstat).");
    println!("# checkpoint_time: median SessionManager::checkpoint latency at turn 10 vs 1000.");
    println!("# snapshot_vs_checkpoint: serde_json bytes of export_snapshot at turn 1000 vs one checkpoint's bytes.");
    println!("# recover: median SessionManager::recover latency on a fresh manager (10-turn vs 1000-turn session, same file).");
    println!("# turn_latency_growth / turn_breakdown: submit_turn latency early vs late in the 1000-turn session; cost of the per-turn context copies.");
    println!("# turn_overhead: turns/s of submit_turn (zero-latency provider, auto-checkpoint on) vs Store::commit_turn of the same rows.");
    println!("# idle_session_memory: RSS growth per loaded one-turn session in a fresh child process (approximate).");
    println!("# delegation_overhead: a root turn that delegates one trivial task in the foreground vs a root turn answered directly.");
    println!("# compaction: estimated request tokens at turn 500 vs turn 20 of a dialog through a 4,000-token window with compaction on");
    println!("#   (model latency simulated at 1 us per request token); compacting_share = time in summary calls / time of the 500 turns.");
    println!("# continuation_latency: a background run's end (its RunUpdated on the feed, after the terminal commit) to the first");
    println!("#   streamed text of the continuation answering it while idle, vs a user turn's send() to its first streamed text.");
    println!("# inbox_delivery: completions consumed per second end to end, 8 dialogs x 16 background runs started at once,");
    println!("#   vs the store's own claim (8 at a time) -> continuation commit of as many events; median of 5 rounds each.");
    println!("# inbox_delivery_only: the engine delivering the same 8 x 16 completions already committed terminal in the inbox");
    println!("#   (wake each dialog -> continuations committed, 0 pending, 0 dead-lettered), vs the same store rate.");
    println!("# approval_resume: decide_approval returned (decision committed) -> the approved tool started, for a root");
    println!("#   turn's gated call and a background run's, vs a user turn's send() -> its first streamed text.");
    rt.block_on(async {
        long_session(dir.path()).await;
        turn_overhead(
            dir.path(),
            "instant",
            Arc::new(InstantProvider),
            OVERHEAD_TURNS,
        )
        .await
        .print("instant", OVERHEAD_TURNS, " target_ratio<=2");
        turn_overhead(
            dir.path(),
            "scripted",
            Arc::new(ScriptedProvider::offline()),
            SCRIPTED_TURNS,
        )
        .await
        .print("scripted_offline", SCRIPTED_TURNS, "");
        idle_memory(dir.path()).await;
        delegation_overhead(dir.path()).await;
        compaction(dir.path()).await;
        inbox::continuation_latency(dir.path()).await;
        inbox::delivery_rate(dir.path()).await;
        approval::decision_latency(dir.path()).await;
    });
}
