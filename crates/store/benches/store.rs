//! `cargo bench -p keel-store --bench store`: keel-store against raw rusqlite
//! baselines measured in the same run. Prints one `BENCH <name> key=value …`
//! line per figure.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_core::{CheckpointId, Message, SessionId};
use keel_store::{
    AcceptRun, CheckpointSource, ClaimRequest, CompletionHandling, ContinuationCommit,
    LeasedEvents, MessageFilter, NewCheckpoint, NewMessage, NewRun, NewSession, Store,
    StoreOptions, Synchronous, TerminalOutcome, TurnCommit,
};
use rusqlite::{params, Connection};

const APPENDS: usize = 4000;
const WRITERS: usize = 16;
const REPLAY_TURNS: u64 = 1000;
const INBOX_EVENTS: usize = 2000;
/// Interleaved chunks per append benchmark.
const CHUNKS: usize = 10;

fn session(dialog: &str) -> NewSession {
    NewSession {
        id: SessionId::new(),
        channel: "bench".into(),
        chat_id: "chat".into(),
        dialog_id: dialog.into(),
        title: dialog.into(),
        agent_id: None,
        parent_id: None,
        delivery_context: None,
        now_ms: 1,
    }
}

fn text(i: usize) -> String {
    format!("message {i}: {}", "lorem ipsum dolor sit amet ".repeat(8))
}

fn options(sync: Synchronous) -> StoreOptions {
    StoreOptions {
        synchronous: sync,
        ..StoreOptions::default()
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Ids of the raw baseline's session and timeline, shaped like the store's
/// (36-character UUIDs), so that both write the same bytes per row.
const SINGLE_SESSION: &str = "01900000-0000-7000-8000-5e5510000000";
const SINGLE_TIMELINE: &str = "01900000-0000-7000-8000-714e11000000";

/// Raw rusqlite: one row per transaction, same pragmas and schema as the store.
struct RawAppender {
    conn: Connection,
    next: i64,
}

impl RawAppender {
    fn open(path: &Path, sync: Synchronous) -> Self {
        drop(Store::open(path, options(sync)).expect("open"));
        let conn = Connection::open(path).expect("open raw");
        conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0))
            .expect("wal");
        conn.pragma_update(None, "foreign_keys", "ON").expect("fk");
        let sync_text = match sync {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync_text)
            .expect("sync");
        conn.execute_batch(&format!(
            "INSERT INTO sessions (id, channel, chat_id, dialog_id, title, created_at, last_active_at) \
               VALUES ('{SINGLE_SESSION}', 'raw', 'raw', 'raw', 'raw', 1, 1);
             INSERT INTO timelines (id, session_id, created_at) VALUES ('{SINGLE_TIMELINE}', '{SINGLE_SESSION}', 1);
             UPDATE sessions SET head_timeline_id = '{SINGLE_TIMELINE}';",
        ))
        .expect("seed");
        Self { conn, next: 1 }
    }

    fn append(&mut self, n: usize) -> Duration {
        let start = Instant::now();
        for i in 0..n {
            let content = serde_json::to_string(&Message::user(text(i))).expect("json");
            self.conn.execute_batch("BEGIN IMMEDIATE").expect("begin");
            self.conn
                .prepare_cached(
                    "INSERT INTO messages (timeline_id, seq, session_id, slot, role, content, created_at) \
                     VALUES (?1, ?2, ?3, 'default', 'user', ?4, 1)",
                )
                .expect("prepare")
                .execute(params![SINGLE_TIMELINE, self.next, SINGLE_SESSION, content])
                .expect("insert");
            self.conn.execute_batch("COMMIT").expect("commit");
            self.next += 1;
        }
        start.elapsed()
    }
}

/// Raw rusqlite doing ideal group commit: `writers` sessions (own timelines),
/// one row per session per transaction, no savepoints, no lookups, no threads.
/// Not a target, an upper bound: what the schema and SQLite allow for this workload.
struct RawGrouped {
    conn: Connection,
    writers: usize,
    next: i64,
}

impl RawGrouped {
    fn open(path: &Path, sync: Synchronous, writers: usize) -> Self {
        let raw = RawAppender::open(path, sync);
        for w in 0..writers {
            raw.conn
                .execute_batch(&format!(
                    "INSERT INTO sessions (id, channel, chat_id, dialog_id, title, created_at, last_active_at) \
                       VALUES ('{}', 'raw', 'raw', 'g{w}', 'raw', 1, 1);
                     INSERT INTO timelines (id, session_id, created_at) VALUES ('{}', '{}', 1);",
                    session_like(w),
                    uuid_like(w),
                    session_like(w)
                ))
                .expect("seed");
        }
        Self {
            conn: raw.conn,
            writers,
            next: 1,
        }
    }

    fn append(&mut self, n: usize) -> Duration {
        let start = Instant::now();
        for _ in 0..n / self.writers {
            self.conn.execute_batch("BEGIN IMMEDIATE").expect("begin");
            for w in 0..self.writers {
                let content = serde_json::to_string(&Message::user(text(w))).expect("json");
                self.conn
                    .prepare_cached(
                        "INSERT INTO messages (timeline_id, seq, session_id, slot, role, content, created_at) \
                         VALUES (?1, ?2, ?3, 'default', 'user', ?4, 1)",
                    )
                    .expect("prepare")
                    .execute(params![uuid_like(w), self.next, session_like(w), content])
                    .expect("insert");
            }
            self.conn.execute_batch("COMMIT").expect("commit");
            self.next += 1;
        }
        start.elapsed()
    }
}

/// Timeline ids shaped like the store's (36 characters, time-ordered).
fn uuid_like(w: usize) -> String {
    format!("01900000-0000-7000-8000-{w:012}")
}

/// Session ids shaped like the store's.
fn session_like(w: usize) -> String {
    format!("01900000-0000-7000-9000-{w:012}")
}

async fn store_append(store: &Store, sid: SessionId, n: usize) -> Duration {
    let start = Instant::now();
    for i in 0..n {
        store
            .append_message(sid, NewMessage::new(Message::user(text(i))), 1)
            .await
            .expect("append");
    }
    start.elapsed()
}

async fn store_append_concurrent(store: &Store, sessions: &[SessionId], n: usize) -> Duration {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for sid in sessions.iter().copied() {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store_append(&store, sid, n / sessions_len()).await
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    start.elapsed()
}

fn sessions_len() -> usize {
    WRITERS
}

/// Raw single-row baseline, store single writer and store with 16 writers,
/// interleaved chunk by chunk so that load from other processes hits all three alike.
fn appends(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    sync: Synchronous,
    label: &str,
    n: usize,
) -> f64 {
    let chunk = n / CHUNKS;
    let mut raw = RawAppender::open(&dir.join(format!("raw-{label}.db")), sync);
    let single = Store::open(dir.join(format!("single-{label}.db")), options(sync)).expect("open");
    let multi = Store::open(dir.join(format!("multi-{label}.db")), options(sync)).expect("open");
    let (single_sid, multi_sids) = rt.block_on(async {
        let s = single
            .create_session(session("single"))
            .await
            .expect("session")
            .id;
        let mut v = Vec::new();
        for w in 0..WRITERS {
            v.push(
                multi
                    .create_session(session(&format!("w{w}")))
                    .await
                    .expect("session")
                    .id,
            );
        }
        (s, v)
    });
    let mut grouped = RawGrouped::open(&dir.join(format!("grouped-{label}.db")), sync, WRITERS);
    let mut t_grouped = Duration::ZERO;
    let (mut t_raw, mut t_single, mut t_multi) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let before = multi.commit_stats();
    for _ in 0..CHUNKS {
        t_raw += raw.append(chunk);
        t_single += rt.block_on(store_append(&single, single_sid, chunk));
        t_multi += rt.block_on(store_append_concurrent(&multi, &multi_sids, chunk));
        t_grouped += grouped.append(chunk);
    }
    let after = multi.commit_stats();
    let per_txn = (after.requests - before.requests) as f64
        / (after.transactions - before.transactions).max(1) as f64;
    let rows = chunk * CHUNKS;
    let multi_rows = chunk / WRITERS * WRITERS * CHUNKS;
    let (raw_rate, single_rate, multi_rate) = (
        rate(rows, t_raw),
        rate(rows, t_single),
        rate(multi_rows, t_multi),
    );
    println!(
        "BENCH append_single_writer sync={label} rows={rows} store_rows_per_s={single_rate:.0} raw_rows_per_s={raw_rate:.0} ratio={:.2}",
        single_rate / raw_rate
    );
    let grouped_rate = rate(multi_rows, t_grouped);
    println!(
        "BENCH append_{WRITERS}_writers sync={label} rows={multi_rows} store_rows_per_s={multi_rate:.0} raw_single_row_per_s={raw_rate:.0} ratio={:.2} requests_per_txn={per_txn:.1} \
         raw_ideal_group_commit_rows_per_s={grouped_rate:.0} ideal_ratio={:.2}",
        multi_rate / raw_rate,
        grouped_rate / raw_rate
    );
    raw_rate
}

fn turn(s: SessionId, n: u64, checkpoint: bool) -> TurnCommit {
    TurnCommit {
        calls: None,
        session_id: s,
        messages: vec![
            NewMessage::new(Message::user(format!(
                "question {n:06} {}",
                "x".repeat(200)
            ))),
            NewMessage::new(Message::assistant(format!(
                "answer {n:06} {}",
                "y".repeat(400)
            ))),
        ],
        state: format!(r#"{{"turn":{n:06},"cost":{{"prompt":{:09}}}}}"#, n * 17).into_bytes(),
        checkpoint: checkpoint.then(|| NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: n,
            source: CheckpointSource::Turn,
        }),
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 1000 + n as i64,
    }
}

fn wal_size(path: &Path) -> u64 {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

/// Average WAL bytes and time of a committed turn with its checkpoint, after `history` turns.
async fn checkpoint_cost(
    store: &Store,
    path: &Path,
    s: SessionId,
    from: u64,
    samples: u64,
) -> (f64, f64, f64) {
    let mut bytes = 0u64;
    let mut row_bytes = 0u64;
    let mut time = Duration::ZERO;
    for n in from..from + samples {
        let before = wal_size(path);
        let start = Instant::now();
        let c = store.commit_turn(turn(s, n, true)).await.expect("turn");
        time += start.elapsed();
        bytes += wal_size(path) - before;
        let cp = c.checkpoint.expect("checkpoint");
        // Logical bytes of the checkpoint row itself (ids, hash, numbers as text).
        row_bytes += (cp.id.to_string().len()
            + cp.session_id.to_string().len()
            + cp.timeline_id.as_str().len()
            + cp.state_hash.len()
            + cp.parent_id.map(|p| p.to_string().len()).unwrap_or(0)
            + 8 * 4
            + cp.source.as_str().len()) as u64;
    }
    (
        bytes as f64 / samples as f64,
        row_bytes as f64 / samples as f64,
        time.as_secs_f64() * 1e6 / samples as f64,
    )
}

/// Average WAL bytes of a manual checkpoint (new state each time) at the current head.
async fn manual_checkpoint_cost(
    store: &Store,
    path: &Path,
    s: SessionId,
    tag: u64,
    samples: u64,
) -> f64 {
    let mut bytes = 0u64;
    for i in 0..samples {
        let before = wal_size(path);
        store
            .create_checkpoint(
                s,
                NewCheckpoint {
                    id: CheckpointId::new(),
                    turn_index: tag,
                    source: CheckpointSource::Manual,
                },
                format!(r#"{{"turn":{tag:06},"manual":{i:06}}}"#).into_bytes(),
                1,
            )
            .await
            .expect("checkpoint");
        bytes += wal_size(path) - before;
    }
    bytes as f64 / samples as f64
}

async fn checkpoints(path: &Path) {
    let store = Store::open(
        path,
        StoreOptions {
            wal_autocheckpoint_pages: 0,
            ..StoreOptions::default()
        },
    )
    .expect("open");
    let s = store.create_session(session("cp")).await.expect("session");
    let samples = 50;
    for n in 0..10 {
        store.commit_turn(turn(s.id, n, true)).await.expect("turn");
    }
    let manual10 = manual_checkpoint_cost(&store, path, s.id, 10, samples).await;
    let (wal10, row10, us10) = checkpoint_cost(&store, path, s.id, 10, samples).await;
    for n in 10 + samples..100 {
        store.commit_turn(turn(s.id, n, true)).await.expect("turn");
    }
    let manual100 = manual_checkpoint_cost(&store, path, s.id, 100, samples).await;
    for n in 100..1000 {
        store.commit_turn(turn(s.id, n, true)).await.expect("turn");
    }
    let manual1000 = manual_checkpoint_cost(&store, path, s.id, 1000, samples).await;
    let (wal1000, row1000, us1000) = checkpoint_cost(&store, path, s.id, 1000, samples).await;
    println!(
        "BENCH checkpoint_bytes measure=checkpoint_row_bytes turn10={row10:.0} turn1000={row1000:.0} ratio={:.2}",
        row1000 / row10
    );
    println!(
        "BENCH checkpoint_bytes measure=wal_growth_manual_checkpoint samples={samples} turn10={manual10:.0} turn100={manual100:.0} turn1000={manual1000:.0} ratio={:.2} ratio_1000_vs_100={:.2}",
        manual1000 / manual10,
        manual1000 / manual100
    );
    println!(
        "BENCH checkpoint_bytes measure=wal_growth_turn_with_checkpoint samples={samples} turn10={wal10:.0} turn1000={wal1000:.0} ratio={:.2}",
        wal1000 / wal10
    );
    println!(
        "BENCH checkpoint_time measure=turn_commit_with_checkpoint turn10_us={us10:.0} turn1000_us={us1000:.0} ratio={:.2}",
        us1000 / us10
    );
}

/// Bytes of the checkpoint tables and their indexes (SQLite's dbstat).
fn checkpoint_table_bytes(path: &Path) -> i64 {
    let conn = rusqlite::Connection::open(path).expect("open");
    conn.query_row(
        "SELECT sum(pgsize) FROM dbstat WHERE name IN \
         (SELECT name FROM sqlite_master WHERE tbl_name IN ('checkpoints', 'state_blobs'))",
        [],
        |r| r.get(0),
    )
    .expect("dbstat")
}

/// Retention keeping 100 turn checkpoints, applied every 10 turns as the
/// background pass would: the checkpoint tables stop growing past turn 100.
async fn retention(path: &Path) {
    let store = Store::open(path, StoreOptions::default()).expect("open");
    let s = store
        .create_session(session("retention"))
        .await
        .expect("session");
    let policy = keel_store::PrunePolicy {
        keep_latest: Some(100),
        older_than_ms: None,
    };
    let mut at200 = 0;
    let mut pass = Duration::ZERO;
    for n in 1..=1000 {
        store.commit_turn(turn(s.id, n, true)).await.expect("turn");
        if n % 10 == 0 {
            let start = Instant::now();
            store.prune_checkpoints(s.id, policy).await.expect("prune");
            while store.reclaim_pages(1024).await.expect("reclaim") == 1024 {}
            pass += start.elapsed();
        }
        if n == 200 {
            at200 = checkpoint_table_bytes(path);
        }
    }
    let at1000 = checkpoint_table_bytes(path);
    println!(
        "BENCH retention measure=checkpoint_table_bytes keep=100 turn200={at200} turn1000={at1000} ratio={:.3} pass_avg_us={:.0}",
        at1000 as f64 / at200 as f64,
        pass.as_secs_f64() * 1e6 / 100.0
    );
}

/// keel's own docs and source (`benches/data`, fixed copies): the text of
/// the bytes-per-turn figure.
const PROSE: &str = include_str!("data/prose.md");
const CODE: &str = include_str!("data/code.rs.txt");

/// About `len` bytes of `text` from a position derived from `at` (on char boundaries).
fn excerpt(text: &str, at: usize, len: usize) -> &str {
    let mut start = at % (text.len() - len);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let mut end = start + len;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[start..end]
}

/// A turn of realistic text: a ~300-byte question of prose, a ~1.9 KB
/// answer of prose or source code (alternately), a state blob shaped like
/// the engine's; returns it with the bytes of its two texts.
fn realistic_turn(s: SessionId, n: u64) -> (TurnCommit, usize) {
    let i = n as usize;
    let question = excerpt(PROSE, i * 7_919, 300);
    let answer = if n % 2 == 0 {
        excerpt(PROSE, i * 104_729, 1_900)
    } else {
        excerpt(CODE, i * 104_729, 1_900)
    };
    let raw = question.len() + answer.len();
    let state = format!(
        r#"{{"turn_index":{n},"cost":{{"prompt_tokens":{},"completion_tokens":{},"requests":{n},"cost_usd":0.0}},"current_slot":"default","slots":{{"default":{{"mode":"full","summary":null,"summary_upto":null}}}},"memory":[{{"key":"project","value":"keel, a durable runtime for LLM agents","updated_turn":3}}],"agent_id":"root"}}"#,
        n * 1_234,
        n * 321
    );
    let mut turn = turn(s, n, true);
    turn.messages = vec![
        NewMessage::new(Message::user(question)),
        NewMessage::new(Message::assistant(answer)),
    ];
    turn.state = state.into_bytes();
    (turn, raw)
}

/// Bytes of the database (its pages, the WAL's newer ones included) and of
/// the `messages` table: (file, messages pages, unused bytes in them).
fn database_bytes(path: &Path) -> (i64, i64, i64) {
    let conn = rusqlite::Connection::open(path).expect("open");
    let file = conn
        .query_row(
            "SELECT (SELECT page_count FROM pragma_page_count()) * \
                    (SELECT page_size FROM pragma_page_size())",
            [],
            |r| r.get(0),
        )
        .expect("size");
    let (pages, unused) = conn
        .query_row(
            "SELECT sum(pgsize), sum(unused) FROM dbstat WHERE name = 'messages'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("dbstat");
    (file, pages, unused)
}

/// Where the bytes are: each table's and index's pages per turn, with the
/// share of them unused (SQLite's dbstat), largest first.
fn bytes_by_object(path: &Path, turns: u64) -> String {
    let conn = rusqlite::Connection::open(path).expect("open");
    let mut stmt = conn
        .prepare(
            "SELECT name, sum(pgsize), sum(unused) FROM dbstat GROUP BY name \
             HAVING sum(pgsize) > 16384 ORDER BY sum(pgsize) DESC",
        )
        .expect("dbstat");
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })
        .expect("query");
    let mut out = String::new();
    for row in rows {
        let (name, size, unused) = row.expect("row");
        out.push_str(&format!(
            " {name}={:.0}B/turn({:.0}%unused)",
            size as f64 / turns as f64,
            unused as f64 * 100.0 / size as f64
        ));
    }
    out
}

/// Database bytes per turn (growth over the empty database) against the
/// raw bytes of the text the turns stored, at turn 10, 100 and 1000;
/// with `keep`, retention keeps that many turn checkpoints, applied every
/// 10 turns as the background pass does (prune, blob sweep, page reclaim).
async fn bytes_per_turn(path: &Path, keep: Option<usize>) {
    let store = Store::open(path, StoreOptions::default()).expect("open");
    let s = store
        .create_session(session("bytes"))
        .await
        .expect("session")
        .id;
    let (empty, _, _) = database_bytes(path);
    let mut raw = 0usize;
    let mut line = String::new();
    let mut ratio1000 = 0.0;
    for n in 1..=1000u64 {
        let (turn, bytes) = realistic_turn(s, n);
        raw += bytes;
        store.commit_turn(turn).await.expect("turn");
        if n % 10 == 0 {
            // As the background pass does.
            store
                .train_dictionary_if_due(n as i64)
                .await
                .expect("train");
        }
        if let (Some(keep), true) = (keep, n % 10 == 0) {
            let policy = keel_store::PrunePolicy {
                keep_latest: Some(keep),
                older_than_ms: None,
            };
            store.prune_checkpoints(s, policy).await.expect("prune");
            store.sweep_state_blobs().await.expect("sweep");
            while store.reclaim_pages(1024).await.expect("reclaim") == 1024 {}
        }
        if n == 10 || n == 100 || n == 1000 {
            let (file, pages, unused) = database_bytes(path);
            let per_turn = (file - empty) as f64 / n as f64;
            let raw_per_turn = raw as f64 / n as f64;
            let ratio = per_turn / raw_per_turn;
            if n == 1000 {
                ratio1000 = ratio;
            }
            line.push_str(&format!(
                " turn{n}_db_per_turn={per_turn:.0} turn{n}_raw_per_turn={raw_per_turn:.0} turn{n}_ratio={ratio:.2} turn{n}_messages_unused={:.0}%",
                unused as f64 * 100.0 / pages as f64
            ));
        }
    }
    let keep = keep.map_or("off".to_owned(), |k| k.to_string());
    println!(
        "BENCH bytes_per_turn corpus=prose+code retention_keep={keep} ratio={ratio1000:.2}{line}"
    );
    println!(
        "BENCH bytes_by_object retention_keep={keep} turn=1000{}",
        bytes_by_object(path, 1000)
    );
}

/// Whether a shared dictionary would pay: one trained (zstd's trainer, 16
/// KiB) on 100 turns of the bytes-per-turn corpus's shape cut from the
/// first half of its texts, then the frames of 900 turns cut from the
/// second half with and without it (bytes, and the median time to
/// decompress them all).
fn dictionary() {
    // Trained on the first half of each text, measured on the second (the
    // corpus's excerpts overlap: the same text on both sides would flatter it).
    let half = |t: &'static str, second: bool| {
        let mut at = t.len() / 2;
        while !t.is_char_boundary(at) {
            at += 1;
        }
        if second {
            &t[at..]
        } else {
            &t[..at]
        }
    };
    let turn_values = |n: u64, second: bool| {
        let i = n as usize;
        let (prose, code) = (half(PROSE, second), half(CODE, second));
        let question = excerpt(prose, i * 7_919, 300);
        let answer = if n % 2 == 0 {
            excerpt(prose, i * 104_729, 1_900)
        } else {
            excerpt(code, i * 104_729, 1_900)
        };
        let (turn, _) = realistic_turn(SessionId::new(), n);
        vec![
            serde_json::to_vec(&Message::user(question)).expect("json"),
            serde_json::to_vec(&Message::assistant(answer)).expect("json"),
            turn.state,
        ]
    };
    let training: Vec<Vec<u8>> = (1..=100).flat_map(|n| turn_values(n, false)).collect();
    let dict = zstd::dict::from_samples(&training, 16 * 1024).expect("train");
    let values: Vec<Vec<u8>> = (101..=1000).flat_map(|n| turn_values(n, true)).collect();
    let mut plain = zstd::bulk::Compressor::new(3).expect("cctx");
    let mut with = zstd::bulk::Compressor::with_dictionary(3, &dict).expect("cctx");
    let (mut bytes_plain, mut bytes_dict) = (0usize, 0usize);
    let (mut frames_plain, mut frames_dict) = (Vec::new(), Vec::new());
    for v in &values {
        let (a, b) = (
            plain.compress(v).expect("zstd"),
            with.compress(v).expect("zstd"),
        );
        bytes_plain += a.len().min(v.len());
        bytes_dict += b.len().min(v.len());
        frames_plain.push(a);
        frames_dict.push(b);
    }
    let time = |frames: &[Vec<u8>], d: &mut zstd::bulk::Decompressor<'_>| {
        let mut buf = Vec::with_capacity(1 << 16);
        let mut times = Vec::new();
        for _ in 0..11 {
            let start = Instant::now();
            for f in frames {
                buf.clear();
                d.decompress_to_buffer(&f[..], &mut buf).expect("frame");
            }
            times.push(start.elapsed());
        }
        median(times)
    };
    let t_plain = time(
        &frames_plain,
        &mut zstd::bulk::Decompressor::new().expect("dctx"),
    );
    let t_dict = time(
        &frames_dict,
        &mut zstd::bulk::Decompressor::with_dictionary(&dict).expect("dctx"),
    );
    let raw: usize = values.iter().map(Vec::len).sum();
    println!(
        "BENCH dictionary values={} raw={raw} zstd3={bytes_plain} zstd3_with_16k_dict={bytes_dict} saved_per_turn={:.0} \
         dict_bytes={} decompress_us={:.0} decompress_with_dict_us={:.0}",
        values.len(),
        (bytes_plain as f64 - bytes_dict as f64) / 900.0,
        dict.len(),
        t_plain.as_secs_f64() * 1e6,
        t_dict.as_secs_f64() * 1e6,
    );
}

/// Median of `times`.
fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// What compression costs, each figure against a baseline in the same
/// run: the same 1000 realistic turns committed into two stores turn by
/// turn, one compressing and one not (`set_compression`), then both
/// replayed alternately (`load_messages`, 21 times each).
async fn compression(dir: &Path) {
    let (packed, plain) = (dir.join("compressed.db"), dir.join("plain.db"));
    let a = Store::open(&packed, StoreOptions::default()).expect("open");
    let b = Store::open(&plain, StoreOptions::default()).expect("open");
    let sa = a
        .create_session(session("compression"))
        .await
        .expect("session")
        .id;
    let sb = b
        .create_session(session("compression"))
        .await
        .expect("session")
        .id;
    let (mut commit_packed, mut commit_plain) = (Vec::new(), Vec::new());
    for n in 1..=1000u64 {
        for (store, s, on) in [(&a, sa, true), (&b, sb, false)] {
            let (turn, _) = realistic_turn(s, n);
            keel_store::testing::set_compression(on);
            let start = Instant::now();
            store.commit_turn(turn).await.expect("turn");
            let took = start.elapsed();
            if on && n % 10 == 0 {
                store
                    .train_dictionary_if_due(n as i64)
                    .await
                    .expect("train");
            }
            if on {
                commit_packed.push(took);
            } else {
                commit_plain.push(took);
            }
        }
    }
    keel_store::testing::set_compression(true);
    let mean = |t: &[Duration]| t.iter().sum::<Duration>().as_secs_f64() * 1e6 / t.len() as f64;
    let (mean_packed, mean_plain) = (mean(&commit_packed), mean(&commit_plain));
    let (cp, cq) = (median(commit_packed), median(commit_plain));
    let (t_packed, t_plain) = {
        let (mut tp, mut tq) = (Vec::new(), Vec::new());
        for _ in 0..21 {
            for (store, s, times) in [(&a, sa, &mut tp), (&b, sb, &mut tq)] {
                let start = Instant::now();
                let n = store
                    .load_messages(s, MessageFilter::default())
                    .await
                    .expect("load")
                    .len();
                assert_eq!(n, 2000);
                times.push(start.elapsed());
            }
        }
        (median(tp), median(tq))
    };
    drop((a, b));
    let decompress_only = {
        let conn = Connection::open(&packed).expect("raw");
        let frames: Vec<Vec<u8>> = conn
            .prepare("SELECT content FROM messages WHERE typeof(content) = 'blob'")
            .expect("prepare")
            .query_map([], |r| r.get(0))
            .expect("query")
            .map(|r| r.expect("row"))
            .collect();
        // The database's dictionary (trained during the run), for the frames made with it.
        let dict: Vec<u8> = conn
            .query_row("SELECT bytes FROM zstd_dictionaries", [], |r| r.get(0))
            .expect("a dictionary was trained");
        let mut d = zstd::bulk::Decompressor::new().expect("dctx");
        let mut dd = zstd::bulk::Decompressor::with_dictionary(&dict).expect("dctx");
        let mut buf = Vec::with_capacity(1 << 16);
        let mut times = Vec::new();
        for _ in 0..21 {
            let start = Instant::now();
            for f in &frames {
                buf.clear();
                let d = match zstd::zstd_safe::get_dict_id_from_frame(f) {
                    Some(_) => &mut dd,
                    None => &mut d,
                };
                d.decompress_to_buffer(&f[..], &mut buf).expect("frame");
                std::hint::black_box(&buf);
            }
            times.push(start.elapsed());
        }
        median(times)
    };
    let compress_only = {
        let mut c = zstd::bulk::Compressor::new(3).expect("cctx");
        let mut times = Vec::new();
        for n in 1..=1000u64 {
            let (turn, _) = realistic_turn(sa, n);
            let start = Instant::now();
            for m in &turn.messages {
                let json = serde_json::to_string(&m.message).expect("json");
                std::hint::black_box(c.compress(json.as_bytes()).expect("zstd"));
            }
            std::hint::black_box(c.compress(&turn.state).expect("zstd"));
            times.push(start.elapsed());
        }
        median(times)
    };
    println!(
        "BENCH compression_floor zstd_decompress_only_us={:.0} (the frames of the replay, reused contexts, the dictionary prepared) \
         zstd_compress_turn_median_us={:.1} (a turn's two messages and its state, level 3, one reused context)",
        decompress_only.as_secs_f64() * 1e6,
        compress_only.as_secs_f64() * 1e6
    );
    println!(
        "BENCH compression turns=1000 replay_compressed_us={:.0} replay_text_us={:.0} replay_ratio={:.2} \
         commit_median_compressed_us={:.1} commit_median_text_us={:.1} commit_ratio={:.3} \
         commit_mean_compressed_us={mean_packed:.1} commit_mean_text_us={mean_plain:.1} file_compressed={} file_text={} \
         target_replay<=1.2 target_commit<=1.1",
        t_packed.as_secs_f64() * 1e6,
        t_plain.as_secs_f64() * 1e6,
        t_packed.as_secs_f64() / t_plain.as_secs_f64(),
        cp.as_secs_f64() * 1e6,
        cq.as_secs_f64() * 1e6,
        cp.as_secs_f64() / cq.as_secs_f64(),
        file_bytes(&packed),
        file_bytes(&plain),
    );
}

/// File size after a WAL checkpoint that truncates the log.
fn file_bytes(store_path: &Path) -> u64 {
    let conn = rusqlite::Connection::open(store_path).expect("open");
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
    drop(conn);
    std::fs::metadata(store_path).expect("size").len()
}

/// 100 deleted dialogs of 300 turns purged (as retention does: each dialog
/// in bounded batches, then the blob sweep and the page reclaim), against
/// a database that only ever held the one live dialog. Turns of all 101
/// dialogs are committed round robin, as dialogs that live side by side.
async fn purge(dir: &Path) {
    const DIALOGS: usize = 100;
    const TURNS: u64 = 300;
    let held = dir.join("purge-held.db");
    let never = dir.join("purge-never.db");
    let store = Store::open(&held, StoreOptions::default()).expect("open");
    let live = store
        .create_session(session("live"))
        .await
        .expect("session")
        .id;
    let mut deleted = Vec::new();
    for d in 0..DIALOGS {
        let id = store
            .create_session(session(&format!("deleted-{d}")))
            .await
            .expect("session")
            .id;
        deleted.push(id);
    }
    for n in 1..=TURNS {
        store.commit_turn(turn(live, n, true)).await.expect("turn");
        for id in &deleted {
            store.commit_turn(turn(*id, n, true)).await.expect("turn");
        }
    }
    for id in &deleted {
        store.soft_delete_session(*id, 10).await.expect("delete");
    }
    let before = file_bytes(&held);
    let start = Instant::now();
    let mut messages = 0;
    for id in store.deleted_sessions_before(10).await.expect("list") {
        messages += store.purge_session(id).await.expect("purge").messages;
    }
    store.sweep_state_blobs().await.expect("sweep");
    let mut pages = 0;
    loop {
        let n = store.reclaim_pages(1024).await.expect("reclaim");
        pages += n;
        if n < 1024 {
            break;
        }
    }
    let took = start.elapsed();
    drop(store);
    let after = file_bytes(&held);
    // `keel compact-storage` afterwards: the survivors packed together.
    let start = Instant::now();
    let lock = keel_store::RuntimeLock::acquire(&held, "bench").expect("lock");
    keel_store::compact_database(&held, &lock, 500).expect("compact");
    drop(lock);
    let compact_took = start.elapsed();
    let compacted = file_bytes(&held);

    let store = Store::open(&never, StoreOptions::default()).expect("open");
    let live = store
        .create_session(session("live"))
        .await
        .expect("session")
        .id;
    for n in 1..=TURNS {
        store.commit_turn(turn(live, n, true)).await.expect("turn");
    }
    drop(store);
    let baseline = file_bytes(&never);
    println!(
        "BENCH purge dialogs={DIALOGS} turns={TURNS} messages={messages} file_before={before} file_after={after} never_held={baseline} ratio={:.3} pages_reclaimed={pages} purge_ms={:.0} per_dialog_ms={:.1} \
         after_compact_storage={compacted} ratio_compacted={:.3} compact_ms={:.0}",
        after as f64 / baseline as f64,
        took.as_secs_f64() * 1e3,
        took.as_secs_f64() * 1e3 / DIALOGS as f64,
        compacted as f64 / baseline as f64,
        compact_took.as_secs_f64() * 1e3,
    );
}

async fn replay(path: &Path) {
    let store = Store::open(path, StoreOptions::default()).expect("open");
    let s = store
        .create_session(session("replay"))
        .await
        .expect("session");
    for n in 0..REPLAY_TURNS {
        store.commit_turn(turn(s.id, n, true)).await.expect("turn");
    }
    // Put the head on a branch so the replay really walks an ancestor.
    let cps = store.list_checkpoints(s.id).await.expect("list");
    store
        .rollback(s.id, cps[0].id, CheckpointId::new(), 5000)
        .await
        .expect("rollback");
    let root_timeline = cps[0].timeline_id.clone();
    let conn = Connection::open(path).expect("raw");
    let raw_load = || -> usize {
        let mut stmt = conn
            .prepare_cached("SELECT content FROM messages WHERE timeline_id = ?1 ORDER BY seq")
            .expect("prepare");
        let msgs: Vec<Message> = stmt
            .query_map([root_timeline.as_str()], |r| {
                // Text, or a compressed frame (long messages).
                Ok(match r.get_ref(0)? {
                    rusqlite::types::ValueRef::Blob(b) => {
                        String::from_utf8(zstd::stream::decode_all(b).expect("frame"))
                            .expect("utf-8")
                    }
                    _ => r.get::<_, String>(0)?,
                })
            })
            .expect("query")
            .map(|c| serde_json::from_str(&c.expect("row")).expect("json"))
            .collect();
        msgs.len()
    };
    // Alternate store and raw loads so both see the same machine load; report medians.
    let rounds = 31;
    let (mut t_store, mut t_raw) = (Vec::new(), Vec::new());
    let (mut n, mut raw_n) = (0, 0);
    for _ in 0..rounds {
        let start = Instant::now();
        n = store
            .load_messages(s.id, MessageFilter::default())
            .await
            .expect("load")
            .len();
        t_store.push(start.elapsed());
        let start = Instant::now();
        raw_n = raw_load();
        t_raw.push(start.elapsed());
    }
    t_store.sort();
    t_raw.sort();
    let store_ms = t_store[rounds / 2].as_secs_f64() * 1e3;
    let raw_ms = t_raw[rounds / 2].as_secs_f64() * 1e3;
    assert_eq!(n, raw_n);
    println!(
        "BENCH replay_1000_turns messages={n} store_ms={store_ms:.2} raw_select_ms={raw_ms:.2} ratio={:.2} \
         stat=median_of_31 baseline=raw_select_plus_json_decode",
        store_ms / raw_ms
    );
}

fn bench_run(root: SessionId) -> NewRun {
    let id = keel_core::RunId::new();
    NewRun {
        id,
        root_session_id: root,
        root_turn_id: None,
        parent_run_id: None,
        caller_agent_id: keel_core::AgentId::parse("root").expect("id"),
        caller_scope_id: "scope".into(),
        idempotency_key: None,
        agent_id: keel_core::AgentId::parse("worker").expect("id"),
        definition_hash: "h".into(),
        provider_profile: "default".into(),
        provider_name: "scripted".into(),
        model_id: "m".into(),
        mode: keel_core::ExecutionMode::Background,
        depth: 1,
        plan_item_id: None,
        execution_id: id.to_string(),
        task: "t".into(),
        context_json: None,
        budget_json: "{}".into(),
        signal_contract_json: None,
        signal_delivery: None,
        completion_delivery: None,
        failure_delivery: None,
        runtime_generation: 1,
        deadline_at_ms: i64::MAX,
    }
}

async fn inbox(path: &Path, raw_txn_rate: f64) {
    let store = Store::open(path, StoreOptions::default()).expect("open");
    let s = store
        .create_session(session("inbox"))
        .await
        .expect("session");
    let mut tasks = Vec::new();
    for _ in 0..INBOX_EVENTS {
        let store = store.clone();
        let root = s.id;
        tasks.push(tokio::spawn(async move {
            let run = bench_run(root);
            store
                .accept_run(AcceptRun {
                    run: run.clone(),
                    inbox_capacity: u32::MAX,
                    now_ms: 1,
                })
                .await
                .expect("accept");
            store
                .commit_terminal(
                    run.id,
                    run.execution_id,
                    TerminalOutcome::Completed {
                        result: "done".into(),
                        usage: keel_core::Usage::default(),
                        tool_calls: 0,
                        iterations: 1,
                        cost: None,
                    },
                    CompletionHandling::Deliver,
                    2,
                )
                .await
                .expect("terminal");
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let start = Instant::now();
    let mut consumed = 0u64;
    let mut turns = 0u64;
    while let Some(lease) = store
        .claim_inbox_batch(ClaimRequest {
            root_session_id: s.id,
            now_ms: 10,
            lease_ms: 60_000,
            max_events: 8,
            max_bytes: 32 * 1024,
            delivery: None,
        })
        .await
        .expect("claim")
    {
        let ids = lease.events.iter().map(|e| e.id).collect();
        let done = store
            .commit_continuation_turn(ContinuationCommit {
                turn: TurnCommit {
                    calls: None,
                    session_id: s.id,
                    messages: vec![
                        NewMessage::new(Message::user("[results]").hidden()),
                        NewMessage::new(Message::assistant("noted")),
                    ],
                    state: turns.to_string().into_bytes(),
                    checkpoint: None,
                    visible_user_inputs: 0,
                    answers: Vec::new(),
                    expected_head: None,
                    now_ms: 11,
                },
                consumed: vec![LeasedEvents {
                    lease_token: lease.token,
                    event_ids: ids,
                }],
            })
            .await
            .expect("commit");
        consumed += done.consumed;
        turns += 1;
    }
    let elapsed = start.elapsed();
    let events_per_s = consumed as f64 / elapsed.as_secs_f64();
    println!(
        "BENCH inbox_claim_consume events={consumed} continuation_turns={turns} events_per_s={events_per_s:.0} \
         raw_single_row_txn_per_s={raw_txn_rate:.0} ratio={:.2}",
        events_per_s / raw_txn_rate
    );
}

/// A task that yields in a loop on the same current-thread runtime as the
/// appender: the longest gap between its polls is how long appends kept the
/// runtime's only thread from everything else.
struct Ticker {
    done: Arc<AtomicBool>,
    max_gap_us: Arc<AtomicU64>,
    /// Gaps of 1 ms or more.
    long_gaps: Arc<AtomicU64>,
    handle: tokio::task::JoinHandle<()>,
}

impl Ticker {
    fn start() -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let max_gap_us = Arc::new(AtomicU64::new(0));
        let long_gaps = Arc::new(AtomicU64::new(0));
        let handle = tokio::spawn({
            let (done, max_gap_us) = (Arc::clone(&done), Arc::clone(&max_gap_us));
            let long_gaps = Arc::clone(&long_gaps);
            async move {
                let mut last = Instant::now();
                while !done.load(Ordering::Relaxed) {
                    tokio::task::yield_now().await;
                    let gap = u64::try_from(last.elapsed().as_micros()).unwrap_or(u64::MAX);
                    max_gap_us.fetch_max(gap, Ordering::Relaxed);
                    if gap >= 1000 {
                        long_gaps.fetch_add(1, Ordering::Relaxed);
                    }
                    last = Instant::now();
                }
            }
        });
        Self {
            done,
            max_gap_us,
            long_gaps,
            handle,
        }
    }

    /// (longest gap in µs, gaps of 1 ms or more).
    async fn stop(self) -> (u64, u64) {
        self.done.store(true, Ordering::Relaxed);
        self.handle.await.expect("ticker");
        (
            self.max_gap_us.load(Ordering::Relaxed),
            self.long_gaps.load(Ordering::Relaxed),
        )
    }
}

/// Longest stall of a current-thread runtime while one of its tasks appends
/// `n` rows: through keel-store vs raw rusqlite (whose commits, with SQLite's
/// auto-checkpoint, sometimes copy the WAL into the database right there).
fn runtime_stall(dir: &Path, n: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = Store::open(dir.join("stall.db"), StoreOptions::default()).expect("open");
    let mut raw = RawAppender::open(&dir.join("stall-raw.db"), Synchronous::Normal);
    let ((keel_us, keel_long), (raw_us, raw_long)) = rt.block_on(async {
        let sid = store
            .create_session(session("stall"))
            .await
            .expect("session")
            .id;
        let ticker = Ticker::start();
        tokio::task::yield_now().await;
        // Both loops yield after every append (an uncontended append
        // completes without yielding), so a gap is one append's doing.
        for i in 0..n {
            store
                .append_message(sid, NewMessage::new(Message::user(text(i))), 1)
                .await
                .expect("append");
            tokio::task::yield_now().await;
        }
        let keel = ticker.stop().await;
        let ticker = Ticker::start();
        tokio::task::yield_now().await;
        for _ in 0..n {
            raw.append(1);
            tokio::task::yield_now().await;
        }
        (keel, ticker.stop().await)
    });
    println!(
        "BENCH runtime_stall rows={n} store_stalls_over_1ms={keel_long} raw_stalls_over_1ms={raw_long} \
         store_max_stall_us={keel_us} raw_max_stall_us={raw_us}"
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let p = |name: &str| dir.path().join(name);

    // `cargo bench -p keel-store --bench store -- append_normal replay`: run only
    // the groups whose name contains one of the words (all of them without words).
    // KEEL_BENCH_SCALE=N multiplies the appended rows (for profiling).
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted =
        |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()));
    let scale: usize = std::env::var("KEEL_BENCH_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);

    let mut raw_normal = None;
    if wanted("append_normal") || wanted("inbox") {
        raw_normal = Some(appends(
            &rt,
            dir.path(),
            Synchronous::Normal,
            "normal",
            APPENDS * scale,
        ));
    }
    if wanted("append_full") {
        appends(&rt, dir.path(), Synchronous::Full, "full", APPENDS * scale);
    }
    if let (true, Some(raw)) = (wanted("inbox"), raw_normal) {
        rt.block_on(inbox(&p("inbox.db"), raw));
    }
    if wanted("stall") {
        runtime_stall(dir.path(), 5 * APPENDS * scale);
    }
    if wanted("replay") {
        rt.block_on(replay(&p("replay.db")));
    }
    if wanted("checkpoint") {
        rt.block_on(checkpoints(&p("checkpoint.db")));
    }
    if wanted("retention") {
        rt.block_on(retention(&p("retention.db")));
    }
    if wanted("bytes") {
        rt.block_on(bytes_per_turn(&p("bytes.db"), None));
        rt.block_on(bytes_per_turn(&p("bytes-retained.db"), Some(100)));
    }
    if wanted("purge") {
        rt.block_on(purge(dir.path()));
    }
    if wanted("compression") {
        rt.block_on(compression(dir.path()));
    }
    if wanted("dictionary") {
        dictionary();
    }
}
