//! Connections and threads: the write connection, held by whoever commits —
//! a requester finding it idle (NORMAL only), or the writer thread, which
//! commits whatever requests are waiting in one transaction (group commit)
//! and checkpoints the WAL — and a small pool of read-only connections on
//! their own threads.
//! Transient failures (BUSY/LOCKED/IO) are retried here, nowhere else.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel_core::SessionId;
use parking_lot::{Condvar, Mutex};
use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

use crate::error::{Result, StoreError};
use crate::migrations;

/// How durable a commit is before it is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// WAL + `synchronous=NORMAL`: a commit survives a process crash; a power
    /// loss may drop the last few commits, never corrupt the file.
    #[default]
    Normal,
    /// `synchronous=FULL`: every commit is fsynced before it is acknowledged.
    Full,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        }
    }
}

/// Tuning of a [`crate::Store`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Durability of commits.
    pub synchronous: Synchronous,
    /// How long a writer-thread or reader attempt waits on another connection's lock before BUSY (a commit on the caller's thread never waits: it moves to the writer thread).
    pub busy_timeout: Duration,
    /// Delays between retries of a transient failure (BUSY/LOCKED/IO); its length is the retry count.
    pub retry_delays: Vec<Duration>,
    /// Number of read-only connections (at least 1).
    pub readers: usize,
    /// Most write requests committed in one transaction.
    pub max_batch: usize,
    /// WAL pages after which the writer thread checkpoints, between transactions (0 disables it).
    pub wal_autocheckpoint_pages: u32,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            synchronous: Synchronous::Normal,
            busy_timeout: Duration::from_secs(5),
            retry_delays: vec![
                Duration::from_millis(100),
                Duration::from_millis(200),
                Duration::from_millis(300),
            ],
            readers: 4,
            max_batch: 256,
            wal_autocheckpoint_pages: 1000,
        }
    }
}

/// Applies the per-connection pragmas shared by every connection.
fn configure(conn: &Connection, opts: &StoreOptions) -> Result<()> {
    conn.busy_timeout(opts.busy_timeout)?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.pragma_update(None, "synchronous", opts.synchronous.pragma())?;
    // Savepoint journals and temporary b-trees stay in memory, never in a temp file.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    // One plan per statement whatever its parameters: otherwise every new
    // value bound to a `LIMIT ?` re-parses and re-plans the cached statement.
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    // Room for every statement the store prepares, so none is re-parsed.
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE_CAPACITY);
    Ok(())
}

/// Cached prepared statements per connection (the store has fewer distinct ones).
const STATEMENT_CACHE_CAPACITY: usize = 256;

/// Opens the write connection: refuses a newer schema before writing
/// anything, then switches to WAL and migrates.
pub(crate) fn open_writer(path: &Path, opts: &StoreOptions) -> Result<Connection> {
    let mut conn = Connection::open(path)?;
    // SQLite opens a file it may not write read-only, without a word.
    if conn.is_readonly(rusqlite::MAIN_DB)? {
        return Err(StoreError::ReadOnly(
            "SQLite can open it only for reading (a read-only file, directory or mount)".into(),
        ));
    }
    // Read the version before any pragma that writes (journal_mode writes the header).
    let found = migrations::user_version(&conn)?;
    if found > migrations::SCHEMA_VERSION {
        return Err(StoreError::NewerSchema {
            found,
            supported: migrations::SCHEMA_VERSION,
        });
    }
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Sqlite(format!(
            "could not enable WAL (journal_mode is {mode})"
        )));
    }
    configure(&conn, opts)?;
    // Checkpoints never run inside a commit (see [`Writer::checkpoint_if_due`]).
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    migrations::migrate(&mut conn)?;
    // Databases created before keel stamped its id get it now.
    let id: i32 = conn.query_row("PRAGMA application_id", [], |r| r.get(0))?;
    if id != crate::identify::APPLICATION_ID {
        conn.pragma_update(None, "application_id", crate::identify::APPLICATION_ID)?;
    }
    Ok(conn)
}

fn open_reader(path: &Path, opts: &StoreOptions) -> Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    configure(&conn, opts)?;
    conn.pragma_update(None, "query_only", "ON")?;
    Ok(conn)
}

/// Where appends continue in a session: its head timeline and the last seq
/// visible from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeadState {
    /// `sessions.head_timeline_id`.
    pub(crate) timeline: String,
    /// `last_seq(timeline)`.
    pub(crate) last_seq: i64,
}

/// Most sessions whose head state the writer remembers (cleared when full).
const HEAD_CACHE_CAPACITY: usize = 4096;

/// The writer's memory of [`HeadState`] per session, so that an append does
/// not look up the head timeline and its last seq every time.
///
/// Exactly coherent with the database, because:
/// - only the writer thread touches it, and every write of this handle goes
///   through that thread;
/// - values written by a request are staged and become visible to later
///   requests of the batch only when the request succeeded, and to later
///   batches only once the batch COMMITted (a failed request, a rolled back
///   or retried batch discards what it staged);
/// - any request that does not maintain the cache (rollback, fork, prune, run
///   and inbox bookkeeping …) clears it entirely, whatever its outcome;
/// - at the start of every transaction `PRAGMA data_version` tells whether
///   another connection (another `Store` on the same file, another process)
///   committed since: if so the cache is cleared.
#[derive(Debug, Default)]
pub(crate) struct WriteCache {
    committed: HashMap<SessionId, HeadState>,
    batch: HashMap<SessionId, HeadState>,
    job: HashMap<SessionId, HeadState>,
    data_version: Option<i64>,
}

impl WriteCache {
    /// The head state as of the current point of the transaction, if known.
    pub(crate) fn get(&self, session: &SessionId) -> Option<&HeadState> {
        self.job
            .get(session)
            .or_else(|| self.batch.get(session))
            .or_else(|| self.committed.get(session))
    }

    /// Records the head state the running request leaves behind.
    pub(crate) fn stage(&mut self, session: SessionId, state: HeadState) {
        self.job.insert(session, state);
    }

    fn clear(&mut self) {
        self.committed.clear();
        self.batch.clear();
        self.job.clear();
    }

    /// A new attempt at a batch: nothing staged yet.
    fn begin_attempt(&mut self) {
        self.batch.clear();
        self.job.clear();
    }

    /// The transaction now sees `version` of `PRAGMA data_version`; a change
    /// means another connection committed since this one last looked.
    fn check_data_version(&mut self, version: i64) {
        if self.data_version != Some(version) {
            self.committed.clear();
            self.data_version = Some(version);
        }
    }

    /// Ends a request: keeps what it staged if it succeeded and maintains the cache.
    fn end_job(&mut self, succeeded: bool, maintains_cache: bool) {
        if !maintains_cache {
            self.clear();
        } else if succeeded {
            self.batch.extend(self.job.drain());
        } else {
            self.job.clear();
        }
    }

    /// The batch committed: what its requests staged is now the database's state.
    fn committed(&mut self) {
        self.job.clear();
        if self.committed.len() + self.batch.len() > HEAD_CACHE_CAPACITY {
            self.committed.clear();
        }
        self.committed.extend(self.batch.drain());
    }
}

/// One write request: runs inside the batch transaction, possibly several
/// times when the batch is retried, and is answered only after COMMIT.
trait WriteJob: Send {
    /// Runs the request. `Ok(false)`: the request failed on its own (its
    /// savepoint is rolled back, neighbours go on); `Err`: a transient failure
    /// that aborts and retries the whole batch.
    fn run(&mut self, conn: &Connection, cache: &mut WriteCache) -> Result<bool>;
    /// Whether the request keeps [`WriteCache`] up to date (else it is cleared after it).
    fn maintains_cache(&self) -> bool;
    /// Sends the answer: the stored outcome, or `batch_error` if the batch did not commit.
    fn finish(self: Box<Self>, batch_error: Option<StoreError>);
}

struct TypedJob<T, F> {
    f: F,
    maintains_cache: bool,
    out: Option<Result<T>>,
    tx: oneshot::Sender<Result<T>>,
}

impl<T, F> WriteJob for TypedJob<T, F>
where
    T: Send,
    F: FnMut(&Connection, &mut WriteCache) -> Result<T> + Send,
{
    fn maintains_cache(&self) -> bool {
        self.maintains_cache
    }

    fn run(&mut self, conn: &Connection, cache: &mut WriteCache) -> Result<bool> {
        match (self.f)(conn, cache) {
            Ok(v) => {
                self.out = Some(Ok(v));
                Ok(true)
            }
            Err(e) if e.is_transient() => Err(e),
            Err(e) => {
                self.out = Some(Err(e));
                Ok(false)
            }
        }
    }

    fn finish(self: Box<Self>, batch_error: Option<StoreError>) {
        let answer = match (batch_error, self.out) {
            (Some(e), _) => Err(e),
            (None, Some(out)) => out,
            (None, None) => Err(StoreError::Sqlite(
                "write request panicked; its changes were rolled back".into(),
            )),
        };
        // The requester may have gone away (dropped future); nothing to tell.
        let _ = self.tx.send(answer);
    }
}

type ReadJob = Box<dyn FnOnce(&Connection) + Send>;

/// How the writer has batched requests so far (shows group commit at work).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Write transactions committed (or failed for good).
    pub transactions: u64,
    /// Write requests answered.
    pub requests: u64,
    /// Transactions committed on the requesting task's own thread (no hand-off).
    pub on_caller: u64,
    /// WAL checkpoints run by the writer thread.
    pub checkpoints: u64,
}

/// The live counters behind [`CommitStats`].
#[derive(Default)]
struct CommitCounters {
    transactions: AtomicU64,
    requests: AtomicU64,
    on_caller: AtomicU64,
    checkpoints: AtomicU64,
}

/// The write connection and the state only its holder may touch.
struct Writer {
    conn: Connection,
    /// Set by the connection's WAL hook when a commit left the WAL past the threshold.
    checkpoint_due: Arc<AtomicBool>,
    cache: WriteCache,
    /// Whether SQLite currently waits `busy_timeout` on a lock (else it fails at once).
    waits_on_lock: bool,
    busy_timeout: Duration,
}

/// Makes `conn` flag a checkpoint as due whenever a commit leaves at least
/// `threshold` pages in the WAL (0: never). SQLite's own auto-checkpoint,
/// which would run it inside that commit, stays off.
fn watch_wal(conn: &mut Connection, threshold: u32) -> Result<Arc<AtomicBool>> {
    let due = Arc::new(AtomicBool::new(false));
    if threshold > 0 {
        let threshold = i32::try_from(threshold).unwrap_or(i32::MAX);
        let flag = Arc::clone(&due);
        conn.wal_hook(Some(move |_: &mut rusqlite::hooks::Wal, pages: i32| {
            if pages >= threshold {
                flag.store(true, Ordering::Release);
            }
            Ok(())
        }))?;
    }
    Ok(due)
}

impl Writer {
    /// Whether the next holder of the connection should checkpoint the WAL.
    fn checkpoint_due(&self) -> bool {
        self.checkpoint_due.load(Ordering::Acquire)
    }

    /// Copies the WAL into the database file if a commit asked for it. Runs
    /// on the writer thread only, between transactions: no caller's thread
    /// ever pays for it (a checkpoint copies up to a thousand pages and
    /// fsyncs twice — milliseconds), and since no write can interleave, it
    /// completes and the next transaction starts the WAL over.
    fn checkpoint_if_due(&mut self, counters: &CommitCounters) {
        if !self.checkpoint_due.swap(false, Ordering::AcqRel) {
            return;
        }
        failpoint!("store::wal_checkpoint::before");
        let outcome = self
            .conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
                Ok((r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
            });
        counters.checkpoints.fetch_add(1, Ordering::Relaxed);
        failpoint!("store::wal_checkpoint::after");
        match outcome {
            Ok((wal_pages, copied)) => tracing::debug!(wal_pages, copied, "WAL checkpoint"),
            // Not fatal: the WAL grows until the next commit past the threshold asks again.
            Err(e) => tracing::warn!(error = %e, "WAL checkpoint failed; will retry"),
        }
    }

    /// Makes SQLite wait on a lock held by another connection, or fail at once.
    fn wait_on_lock(&mut self, wait: bool) -> Result<()> {
        if self.waits_on_lock != wait {
            let timeout = if wait {
                self.busy_timeout
            } else {
                Duration::ZERO
            };
            self.conn.busy_timeout(timeout)?;
            self.waits_on_lock = wait;
        }
        Ok(())
    }
}

/// The waiting write requests and who holds the write connection.
///
/// Invariant: whenever `jobs` is non-empty with the lock released, the
/// connection is not `idle`: its holder (a caller or the writer thread) will
/// see the jobs before giving it back.
struct WriteQueue {
    jobs: VecDeque<Box<dyn WriteJob>>,
    /// The connection while nobody commits: the next request takes it.
    idle: Option<Writer>,
    /// The connection handed to the writer thread (more requests, a retry or a due checkpoint).
    for_thread: Option<Writer>,
    /// While the writer thread waits for a batch to fill: the size at which
    /// the request that reaches it wakes the thread.
    gathering: Option<usize>,
    /// Set when the store is dropped: the writer thread exits once idle.
    closed: bool,
}

/// What requesters and the writer thread share.
struct WriteShared {
    queue: Mutex<WriteQueue>,
    thread_wake: Condvar,
    max_batch: usize,
    /// Whether an idle connection commits on the requester's thread (NORMAL:
    /// a commit is CPU and page-cache work) or always on the writer thread
    /// (FULL: a commit waits for an fsync, which must not block an async runtime).
    commit_on_caller: bool,
    /// Whether the writer thread waits for requests to join an open transaction (see [`GATHER_WINDOW`]).
    gathers: bool,
    retry_delays: Arc<Vec<Duration>>,
    counters: CommitCounters,
}

/// With `synchronous=FULL` every commit pays an fsync (~0.2 ms here), so
/// before committing, the writer thread waits up to this long for its open
/// transaction to reach the size of the previous batch (the requesters it
/// just answered, coming back) and runs the newcomers in it: one fsync then
/// covers all of them. With NORMAL a commit costs about what its pages
/// cost, so there is nothing to amortize and it never waits.
const GATHER_WINDOW: Duration = Duration::from_micros(500);

/// Most requests committed in one transaction on a requester's thread (its
/// own and those that join it), so that an async runtime's thread is never
/// held for long by other tasks' writes.
const CALLER_BATCH: usize = 16;

/// The gather wait also ends when no request arrived for this long.
const GATHER_GAP: Duration = Duration::from_micros(100);

/// How the writer thread fills the open transaction of one batch.
struct Gather {
    /// How many requests to wait for.
    fill_to: usize,
    /// End of the wait, from the batch's start.
    deadline: Instant,
}

impl WriteShared {
    /// Takes what is waiting (up to `max`), or gives `writer` back
    /// (idle) if nothing is.
    fn take_batch(&self, writer: &mut Option<Writer>, max: usize) -> Vec<Box<dyn WriteJob>> {
        let mut q = self.queue.lock();
        if q.jobs.is_empty() {
            q.idle = writer.take();
            return Vec::new();
        }
        let n = q.jobs.len().min(max);
        q.jobs.drain(..n).collect()
    }

    /// Requests that may join a transaction already holding `have` (of at
    /// most `max`): what is queued, after waiting (with `gather`) while they
    /// keep arriving.
    fn join_batch(
        &self,
        have: usize,
        max: usize,
        gather: Option<&Gather>,
    ) -> Vec<Box<dyn WriteJob>> {
        let mut q = self.queue.lock();
        if let Some(g) = gather {
            let want = g.fill_to.min(max).saturating_sub(have);
            let mut seen = q.jobs.len();
            let mut quiet_until = Instant::now() + GATHER_GAP;
            q.gathering = Some(want);
            while q.jobs.len() < want {
                let now = Instant::now();
                if q.jobs.len() != seen {
                    seen = q.jobs.len();
                    quiet_until = now + GATHER_GAP;
                }
                if now >= g.deadline || now >= quiet_until {
                    break;
                }
                self.thread_wake
                    .wait_until(&mut q, quiet_until.min(g.deadline));
            }
            q.gathering = None;
        }
        let n = q.jobs.len().min(max.saturating_sub(have));
        q.jobs.drain(..n).collect()
    }

    /// Gives the connection to the writer thread, after putting `retry` back
    /// at the head of the queue in its order.
    fn hand_to_thread(&self, writer: Writer, retry: Vec<Box<dyn WriteJob>>) {
        let mut q = self.queue.lock();
        for job in retry.into_iter().rev() {
            q.jobs.push_front(job);
        }
        q.for_thread = Some(writer);
        drop(q);
        self.thread_wake.notify_one();
    }

    /// Answers every request of a batch that is over (committed or failed for good).
    fn finish(&self, batch: Vec<Box<dyn WriteJob>>, error: Option<StoreError>) {
        self.counters.transactions.fetch_add(1, Ordering::Relaxed);
        self.counters
            .requests
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        for job in batch {
            job.finish(error.clone());
        }
    }

    /// Commits on the requester's thread: the batch holding the requester's
    /// own job (requests queued meanwhile may join, up to [`CALLER_BATCH`]),
    /// attempted once without waiting on a lock. Requests still waiting, a
    /// due WAL checkpoint, or a transient failure, go to the writer thread.
    fn commit_on_caller(&self, writer: Writer) {
        let mut holder = Some(writer);
        let mut batch = self.take_batch(&mut holder, CALLER_BATCH);
        let Some(mut writer) = holder else {
            return; // Unreachable: the requester's own job is queued.
        };
        let outcome = writer.wait_on_lock(false).and_then(|()| {
            run_batch(&writer.conn, &mut batch, &mut writer.cache, &mut |have| {
                self.join_batch(have, CALLER_BATCH, None)
            })
        });
        match outcome {
            Err(e) if e.is_transient() => {
                writer.cache.clear();
                tracing::debug!(error = %e, "write deferred to the writer thread");
                self.hand_to_thread(writer, batch);
                return;
            }
            outcome => {
                if outcome.is_err() {
                    writer.cache.clear();
                }
                self.counters.on_caller.fetch_add(1, Ordering::Relaxed);
                self.finish(batch, outcome.err());
            }
        }
        let mut q = self.queue.lock();
        if q.jobs.is_empty() && !writer.checkpoint_due() {
            q.idle = Some(writer);
        } else {
            q.for_thread = Some(writer);
            drop(q);
            self.thread_wake.notify_one();
        }
    }

    /// The writer thread: whenever it is handed the connection, checkpoints
    /// the WAL if due and commits batches (waiting on locks, retrying
    /// transient failures, letting new requests join the open transaction)
    /// until nothing is waiting, then leaves the connection idle.
    fn thread_loop(&self) {
        while let Some(writer) = self.wait_for_connection() {
            let mut holder = Some(writer);
            let mut previous = 0;
            loop {
                if let Some(writer) = holder.as_mut() {
                    writer.checkpoint_if_due(&self.counters);
                }
                let mut batch = self.take_batch(&mut holder, self.max_batch);
                let Some(writer) = holder.as_mut() else {
                    break;
                };
                let gather = (self.gathers && previous > 1).then(|| Gather {
                    fill_to: previous,
                    deadline: Instant::now() + GATHER_WINDOW,
                });
                let outcome = writer.wait_on_lock(true).and_then(|()| {
                    with_retries(&self.retry_delays, || {
                        let result =
                            run_batch(&writer.conn, &mut batch, &mut writer.cache, &mut |have| {
                                self.join_batch(have, self.max_batch, gather.as_ref())
                            });
                        if result.is_err() {
                            // Whatever happened to the transaction, forget rather than guess.
                            writer.cache.clear();
                        }
                        result
                    })
                });
                previous = batch.len();
                self.finish(batch, outcome.err());
            }
        }
    }

    /// Blocks until the connection is handed to the writer thread; `None` once the store is dropped.
    fn wait_for_connection(&self) -> Option<Writer> {
        let mut q = self.queue.lock();
        loop {
            if let Some(w) = q.for_thread.take() {
                return Some(w);
            }
            if q.closed {
                return None;
            }
            self.thread_wake.wait(&mut q);
        }
    }
}

/// The threads and channels behind a [`crate::Store`]; dropped with the last clone.
pub(crate) struct Db {
    path: PathBuf,
    write: Arc<WriteShared>,
    reader_tx: Mutex<Option<mpsc::Sender<ReadJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    retry_delays: Arc<Vec<Duration>>,
    /// The runtime generation this store writes for (0 until activated):
    /// once set, a write finding a newer generation on disk is refused.
    fence: Arc<AtomicU64>,
}

impl Db {
    /// Opens (creating and migrating if needed) the database at `path`,
    /// following symbolic links: the database, its WAL and shared-memory
    /// files are created beside the file the links lead to, private to
    /// the owner.
    pub(crate) fn open(path: &Path, opts: StoreOptions) -> Result<Self> {
        let path = &crate::identify::resolve(path)?;
        // Nothing is written to a file that is not keel's (not even its mode).
        if crate::identify::identify(path, true)? == crate::identify::Found::Missing {
            crate::identify::create(path)?;
        }
        restrict_to_owner(path)?;
        let mut conn = open_writer(path, &opts)?;
        crate::compress::load_dictionaries(&conn, path)?;
        let checkpoint_due = watch_wal(&mut conn, opts.wal_autocheckpoint_pages)?;
        let retry_delays = Arc::new(opts.retry_delays.clone());
        let mut threads = Vec::new();

        let write = Arc::new(WriteShared {
            queue: Mutex::new(WriteQueue {
                jobs: VecDeque::new(),
                idle: Some(Writer {
                    conn,
                    checkpoint_due,
                    cache: WriteCache::default(),
                    waits_on_lock: true,
                    busy_timeout: opts.busy_timeout,
                }),
                for_thread: None,
                gathering: None,
                closed: false,
            }),
            thread_wake: Condvar::new(),
            max_batch: opts.max_batch.max(1),
            commit_on_caller: opts.synchronous == Synchronous::Normal,
            gathers: opts.synchronous == Synchronous::Full,
            retry_delays: Arc::clone(&retry_delays),
            counters: CommitCounters::default(),
        });
        let shared = Arc::clone(&write);
        threads.push(spawn("keel-store-writer", move || shared.thread_loop())?);

        let (rtx, rrx) = mpsc::channel::<ReadJob>();
        let rrx = Arc::new(Mutex::new(rrx));
        for i in 0..opts.readers.max(1) {
            let conn = open_reader(path, &opts)?;
            let rrx = Arc::clone(&rrx);
            threads.push(spawn(&format!("keel-store-reader-{i}"), move || {
                reader_loop(conn, &rrx);
            })?);
        }
        Ok(Self {
            path: path.to_owned(),
            write,
            reader_tx: Mutex::new(Some(rtx)),
            threads: Mutex::new(threads),
            retry_delays,
            fence: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Fences every later write to `generation` (see [`crate::runtime`]).
    pub(crate) fn set_fence(&self, generation: u64) {
        self.fence.store(generation, Ordering::Release);
    }

    /// The runtime generation this store's writes are fenced to (0: none).
    pub(crate) fn fence(&self) -> u64 {
        self.fence.load(Ordering::Acquire)
    }

    /// Transactions and requests the writer has handled.
    pub(crate) fn commit_stats(&self) -> CommitStats {
        let c = &self.write.counters;
        CommitStats {
            transactions: c.transactions.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            on_caller: c.on_caller.load(Ordering::Relaxed),
            checkpoints: c.checkpoints.load(Ordering::Relaxed),
        }
    }

    /// The database file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in a write transaction (group-committed with whatever else is
    /// waiting) and answers after COMMIT. `f` may run more than once if the
    /// batch is retried, so it must not have effects outside `conn`.
    pub(crate) async fn write<T, F>(&self, mut f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&Connection) -> Result<T> + Send + 'static,
    {
        self.submit(move |c: &Connection, _: &mut WriteCache| f(c), false)
            .await
    }

    /// Like [`Db::write`] for a request that keeps the writer's [`WriteCache`]
    /// exact: whatever head timeline or last seq of a session it changes, it
    /// stages with [`WriteCache::stage`] (and it never changes anything else
    /// the cache depends on).
    pub(crate) async fn write_cached<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&Connection, &mut WriteCache) -> Result<T> + Send + 'static,
    {
        self.submit(f, true).await
    }

    /// Queues the request; if the connection is idle, commits right here on
    /// the caller's thread (no hand-off), else the holder commits it.
    async fn submit<T, F>(&self, mut f: F, maintains_cache: bool) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&Connection, &mut WriteCache) -> Result<T> + Send + 'static,
    {
        let fence = Arc::clone(&self.fence);
        let f = move |c: &Connection, cache: &mut WriteCache| {
            crate::runtime::check_fence(c, fence.load(Ordering::Acquire))?;
            f(c, cache)
        };
        let (tx, rx) = oneshot::channel();
        let job = Box::new(TypedJob {
            f,
            maintains_cache,
            out: None,
            tx,
        });
        let idle = {
            let mut q = self.write.queue.lock();
            q.jobs.push_back(job);
            if q.gathering.is_some_and(|fill_to| q.jobs.len() >= fill_to) {
                self.write.thread_wake.notify_one();
            }
            q.idle.take()
        };
        if let Some(writer) = idle {
            if self.write.commit_on_caller {
                self.write.commit_on_caller(writer);
            } else {
                self.write.hand_to_thread(writer, Vec::new());
            }
        }
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Runs `f` on a read-only connection, retrying transient failures.
    pub(crate) async fn read<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&Connection) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let delays = Arc::clone(&self.retry_delays);
        let mut f = f;
        let job: ReadJob = Box::new(move |conn: &Connection| {
            // A panic fails this read alone; the reader thread (and its
            // connection) must survive it, or each one would shrink the pool.
            let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                with_retries(&delays, || {
                    let tx = conn.unchecked_transaction()?;
                    let out = f(&tx);
                    drop(tx);
                    out
                })
            }))
            .unwrap_or_else(|_| {
                tracing::error!("a read request panicked");
                Err(StoreError::Sqlite("read request panicked".into()))
            });
            let _ = tx.send(answer);
        });
        {
            let guard = self.reader_tx.lock();
            let sender = guard.as_ref().ok_or(StoreError::Closed)?;
            sender.send(job).map_err(|_| StoreError::Closed)?;
        }
        rx.await.map_err(|_| StoreError::Closed)?
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        // No request is in flight (each holds the Db): the writer thread
        // finishes what is queued, and the readers drain their channel, then exit.
        self.write.queue.lock().closed = true;
        self.write.thread_wake.notify_all();
        self.reader_tx.lock().take();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

/// Tightens the database file (created 0600), its WAL and shared-memory
/// files to their owner; SQLite creates the WAL and shared-memory files
/// with the database file's mode.
#[cfg(unix)]
fn restrict_to_owner(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let io = |what: &Path, e: std::io::Error| {
        let message = format!("cannot restrict {} to its owner: {e}", what.display());
        if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem {
            StoreError::ReadOnly(message)
        } else {
            StoreError::Io {
                attempts: 1,
                message,
            }
        }
    };
    for suffix in ["", "-wal", "-shm"] {
        let file = crate::identify::sibling(path, suffix);
        let Ok(meta) = std::fs::metadata(&file) else {
            continue;
        };
        if meta.permissions().mode() & 0o077 != 0 {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| io(&file, e))?;
        }
    }
    Ok(())
}

#[cfg(not(unix))]
fn restrict_to_owner(_path: &Path) -> Result<()> {
    Ok(())
}

/// Starts a named thread of the store.
fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(|e| StoreError::ThreadSpawn {
            name: name.to_owned(),
            message: e.to_string(),
        })
}

/// Runs `op`, retrying transient failures after each of `delays`.
pub(crate) fn with_retries<T>(delays: &[Duration], mut op: impl FnMut() -> Result<T>) -> Result<T> {
    let mut attempt = 0usize;
    loop {
        match op() {
            Err(e) if e.is_transient() => {
                let Some(delay) = delays.get(attempt) else {
                    return Err(e.with_attempts(u32::try_from(attempt + 1).unwrap_or(u32::MAX)));
                };
                tracing::warn!(error = %e, attempt = attempt + 1, "transient SQLite failure, retrying");
                std::thread::sleep(*delay);
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn reader_loop(conn: Connection, rx: &Mutex<mpsc::Receiver<ReadJob>>) {
    loop {
        let job = {
            let guard = rx.lock();
            guard.recv()
        };
        match job {
            Ok(job) => job(&conn),
            Err(_) => return,
        }
    }
}

/// Runs one cached statement that returns no rows (transaction control).
fn exec(conn: &Connection, sql: &str) -> Result<()> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

/// Requests joining an open transaction: given how many it holds, returns
/// the newcomers (none: commit now).
type Join<'a> = &'a mut dyn FnMut(usize) -> Vec<Box<dyn WriteJob>>;

/// One attempt at committing `batch`, and whatever `join` adds to it, in a
/// single IMMEDIATE transaction.
fn run_batch(
    conn: &Connection,
    batch: &mut Vec<Box<dyn WriteJob>>,
    cache: &mut WriteCache,
    join: Join<'_>,
) -> Result<()> {
    cache.begin_attempt();
    let started = Instant::now();
    exec(conn, "BEGIN IMMEDIATE")?;
    let result = data_version(conn).and_then(|version| {
        cache.check_data_version(version);
        run_jobs(conn, batch, cache, join)
    });
    let result = match result {
        Ok(true) => {
            failpoint!("store::writer::before_commit");
            exec(conn, "COMMIT").map(|()| cache.committed())
        }
        // A lone request failed on its own: nothing else to keep (and nothing staged).
        Ok(false) => exec(conn, "ROLLBACK").map(|()| cache.begin_attempt()),
        Err(e) => Err(e),
    };
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    crate::metrics::transaction(started.elapsed(), batch.len());
    result
}

/// `PRAGMA data_version`: changes when another connection commits.
fn data_version(conn: &Connection) -> Result<i64> {
    Ok(conn
        .prepare_cached("PRAGMA data_version")?
        .query_row([], |r| r.get(0))?)
}

/// Runs one request; a panic fails that request alone (the committer must
/// survive it, or the connection would be lost with it).
fn run_job(job: &mut dyn WriteJob, conn: &Connection, cache: &mut WriteCache) -> Result<bool> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run(conn, cache))).unwrap_or_else(
        |_| {
            tracing::error!("a write request panicked; rolling it back");
            Ok(false)
        },
    )
}

/// Runs the requests, then those that join; `Ok(false)` only when a lone
/// request failed (roll back instead of commit).
fn run_jobs(
    conn: &Connection,
    batch: &mut Vec<Box<dyn WriteJob>>,
    cache: &mut WriteCache,
    join: Join<'_>,
) -> Result<bool> {
    let mut ran = 0;
    if let [only] = batch.as_mut_slice() {
        // No neighbours to protect: the transaction itself is the savepoint.
        let ok = run_job(only.as_mut(), conn, cache)?;
        cache.end_job(ok, only.maintains_cache());
        if !ok {
            return Ok(false);
        }
        ran = 1;
    }
    loop {
        // Each request runs in its own savepoint so that one failing request
        // (a constraint, a stale execution id) does not fail its neighbours.
        for job in &mut batch[ran..] {
            exec(conn, "SAVEPOINT job")?;
            let ok = run_job(job.as_mut(), conn, cache)?;
            cache.end_job(ok, job.maintains_cache());
            if ok {
                exec(conn, "RELEASE job")?;
            } else {
                exec(conn, "ROLLBACK TO job")?;
                exec(conn, "RELEASE job")?;
            }
        }
        ran = batch.len();
        let joined = join(ran);
        if joined.is_empty() {
            return Ok(true);
        }
        batch.extend(joined);
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::Poll;

    use super::*;

    fn open(dir: &tempfile::TempDir, synchronous: Synchronous) -> Db {
        let opts = StoreOptions {
            synchronous,
            readers: 1,
            ..StoreOptions::default()
        };
        Db::open(&dir.path().join("k.db"), opts).expect("open")
    }

    fn count(conn: &Connection) -> Result<i64> {
        Ok(conn.query_row("SELECT count(*) FROM sessions", [], |r| r.get(0))?)
    }

    fn insert(conn: &Connection, id: &str) -> Result<()> {
        conn.execute(
            "INSERT INTO sessions (id, channel, chat_id, dialog_id, title, created_at, last_active_at) \
             VALUES (?1, 'c', 'c', ?1, 't', 1, 1)",
            [id],
        )?;
        Ok(())
    }

    /// A write request that inserts a row, says it started, then holds its
    /// transaction open until released (so that others queue behind it).
    fn held_insert() -> (
        impl FnMut(&Connection) -> Result<()> + Send + 'static,
        oneshot::Receiver<()>,
        mpsc::Sender<()>,
    ) {
        let (started_tx, started) = oneshot::channel();
        let (go, go_rx) = mpsc::channel::<()>();
        let mut started_tx = Some(started_tx);
        let job = move |c: &Connection| {
            insert(c, "first")?;
            if let Some(tx) = started_tx.take() {
                let _ = tx.send(());
            }
            go_rx.recv().map_err(|e| StoreError::Sqlite(e.to_string()))
        };
        (job, started, go)
    }

    /// Sends a request that inserts `id`, then panics; checks it failed as one.
    async fn panicking_insert(db: &Db, id: &'static str) {
        let err = db
            .write(move |c| -> Result<()> {
                insert(c, id)?;
                panic!("bug in a write request")
            })
            .await
            .unwrap_err();
        assert!(err.to_string().contains("panicked"), "{err}");
    }

    #[tokio::test]
    async fn a_panicking_request_fails_alone_and_the_writer_survives() {
        let dir = tempfile::tempdir().expect("tempdir");
        for sync in [Synchronous::Normal, Synchronous::Full] {
            let db = open(&dir, sync);
            panicking_insert(&db, "doomed").await;
            // The connection is still usable and the panicking insert left nothing.
            db.write(move |c| insert(c, &format!("after-{sync:?}")))
                .await
                .expect("write after the panic");
            let ids: Vec<String> = db
                .read(|c| {
                    let mut s = c.prepare("SELECT id FROM sessions ORDER BY id")?;
                    let rows = s.query_map([], |r| r.get(0))?;
                    Ok(rows.collect::<rusqlite::Result<_>>()?)
                })
                .await
                .expect("read");
            assert!(!ids.iter().any(|id| id == "doomed"), "{ids:?}");
            drop(db);
        }
    }

    #[tokio::test]
    async fn a_panicking_read_fails_alone_and_the_reader_survives() {
        let dir = tempfile::tempdir().expect("tempdir");
        // One reader: had the panic taken it down, every later read would fail.
        let db = open(&dir, Synchronous::Normal);
        for _ in 0..3 {
            let err = db
                .read(|_| -> Result<()> { panic!("bug in a read request") })
                .await
                .unwrap_err();
            assert!(err.to_string().contains("panicked"), "{err}");
        }
        assert_eq!(db.read(count).await.expect("read after panics"), 0);
    }

    /// With FULL every write goes to the writer thread; a request that
    /// arrives while a transaction is open joins it (one fsync for both).
    #[tokio::test]
    async fn a_request_arriving_during_a_transaction_joins_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Arc::new(open(&dir, Synchronous::Full));
        let (held, started, go) = held_insert();
        let first = tokio::spawn({
            let db = Arc::clone(&db);
            async move { db.write(held).await }
        });
        started.await.expect("first request started");
        let before = db.commit_stats();

        let mut second = Box::pin(db.write(|c| {
            insert(c, "second")?;
            count(c)
        }));
        // One poll queues the request behind the open transaction.
        std::future::poll_fn(|cx| {
            assert!(second.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        go.send(()).expect("release the first request");

        first.await.expect("task").expect("first");
        assert_eq!(second.await.expect("second"), 2, "saw the first insert");
        let after = db.commit_stats();
        assert_eq!(after.requests - before.requests, 2);
        assert_eq!(after.transactions - before.transactions, 1, "one commit");
        assert_eq!(after.on_caller, 0, "FULL never commits on the caller");
    }

    /// A requester's thread commits its own request and at most
    /// [`CALLER_BATCH`] in all; the rest of the queue goes to the writer thread.
    #[tokio::test]
    async fn a_callers_thread_commits_a_bounded_batch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Arc::new(open(&dir, Synchronous::Normal));
        let (held, started, go) = held_insert();
        // The first request commits on this other thread's runtime.
        let first = std::thread::spawn({
            let db = Arc::clone(&db);
            move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .expect("runtime");
                rt.block_on(db.write(held))
            }
        });
        started.await.expect("first request started");
        let before = db.commit_stats();
        let extra = CALLER_BATCH + 4;
        let mut waiting: Vec<_> = (0..extra)
            .map(|i| Box::pin(db.write(move |c| insert(c, &format!("queued-{i:02}")))))
            .collect();
        std::future::poll_fn(|cx| {
            for w in &mut waiting {
                assert!(w.as_mut().poll(cx).is_pending());
            }
            Poll::Ready(())
        })
        .await;
        go.send(()).expect("release the first request");
        first.join().expect("thread").expect("first");
        for w in waiting {
            w.await.expect("queued request");
        }
        let after = db.commit_stats();
        assert_eq!(after.requests - before.requests, extra as u64 + 1);
        assert_eq!(
            (
                after.transactions - before.transactions,
                after.on_caller - before.on_caller
            ),
            (2, 1),
            "one caller batch of {CALLER_BATCH}, then one writer-thread batch of the rest"
        );
        let n = db.read(count).await.expect("count");
        assert_eq!(n, extra as i64 + 1);
    }

    fn file_len(path: &Path) -> u64 {
        std::fs::metadata(path).map(|m| m.len()).expect("metadata")
    }

    fn open_with_checkpoints(dir: &tempfile::TempDir, pages: u32) -> (PathBuf, Db) {
        let path = dir.path().join("k.db");
        let opts = StoreOptions {
            wal_autocheckpoint_pages: pages,
            readers: 1,
            ..StoreOptions::default()
        };
        let db = Db::open(&path, opts).expect("open");
        (path, db)
    }

    /// Commits never checkpoint inline (with NORMAL they run on the caller's
    /// thread): SQLite's own auto-checkpoint is off on the write connection,
    /// and with the threshold off nothing ever copies the WAL out.
    #[tokio::test]
    async fn commits_never_checkpoint_the_wal_themselves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (_, db) = open_with_checkpoints(&dir, 8);
        let inline: i64 = db
            .write(|c| Ok(c.query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0))?))
            .await
            .expect("pragma");
        assert_eq!(
            inline, 0,
            "the write connection's own auto-checkpoint is off"
        );
        drop(db);

        let dir = tempfile::tempdir().expect("tempdir");
        let (path, db) = open_with_checkpoints(&dir, 0);
        let before = file_len(&path);
        for i in 0..50 {
            db.write(move |c| insert(c, &format!("s{i:02}")))
                .await
                .expect("write");
        }
        assert_eq!(file_len(&path), before, "nothing was copied out of the WAL");
        let stats = db.commit_stats();
        assert_eq!((stats.on_caller, stats.checkpoints), (50, 0));
    }

    /// Past the threshold the writer thread checkpoints between
    /// transactions; as no write can interleave, the checkpoint completes
    /// and the WAL starts over instead of growing.
    #[tokio::test]
    async fn the_writer_thread_checkpoints_past_the_threshold_and_the_wal_stays_small() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, db) = open_with_checkpoints(&dir, 8);
        let wal = path.with_extension("db-wal");
        let before = file_len(&path);
        // The WAL file keeps the size the migrations gave it (the first
        // checkpoint comes a threshold later); however many commits follow,
        // it must not grow past that by more than a few thresholds.
        let at_open = file_len(&wal);
        let big = "x".repeat(2000);
        for i in 0..400 {
            let big = big.clone();
            db.write(move |c| {
                insert(c, &format!("s{i:03}"))?;
                c.execute(
                    "UPDATE sessions SET title = ?1 WHERE id = ?2",
                    [&big, &format!("s{i:03}")],
                )?;
                Ok(())
            })
            .await
            .expect("write");
        }
        // A write queued behind a due checkpoint is answered after it.
        db.write(|c| insert(c, "last")).await.expect("write");
        let stats = db.commit_stats();
        assert!(stats.checkpoints >= 10, "{stats:?}");
        assert!(
            file_len(&path) > before,
            "pages were copied into the main file"
        );
        // 400 commits of ~1 page each went through a WAL restarted every 8
        // pages or so: it stays within a few thresholds (a new database is
        // migrated aside, so its WAL starts empty).
        assert!(
            file_len(&wal) <= at_open + 32 * u64::from(crate::identify::PAGE_SIZE),
            "the WAL grew to {} bytes ({at_open} after the migrations)",
            file_len(&wal)
        );
        assert_eq!(db.read(count).await.expect("count"), 401);
    }

    /// Many writers on several threads, with failing and panicking requests
    /// mixed in, a tiny batch limit and a checkpoint every few pages, in both
    /// modes: every request is answered with its own outcome, nothing is
    /// lost or doubled, and the connection always finds its way back.
    #[test]
    fn a_storm_of_mixed_requests_is_answered_exactly() {
        for synchronous in [Synchronous::Normal, Synchronous::Full] {
            let dir = tempfile::tempdir().expect("tempdir");
            let opts = StoreOptions {
                synchronous,
                max_batch: 3,
                wal_autocheckpoint_pages: 4,
                readers: 1,
                ..StoreOptions::default()
            };
            let db = Arc::new(Db::open(&dir.path().join("k.db"), opts).expect("open"));
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(3)
                .build()
                .expect("runtime");
            let (tasks, per_task) = (24u64, 25u64);
            let inserted: u64 = rt.block_on(async {
                let handles: Vec<_> = (0..tasks)
                    .map(|t| {
                        let db = Arc::clone(&db);
                        tokio::spawn(async move {
                            let mut state = t * 7919 + 1;
                            let mut ok = 0u64;
                            for i in 0..per_task {
                                // xorshift: a reproducible mix of request kinds.
                                state ^= state << 13;
                                state ^= state >> 7;
                                state ^= state << 17;
                                let id = format!("t{t:02}-{i:02}");
                                match state % 10 {
                                    0 => panicking_insert(&db, "never").await,
                                    1 | 2 => {
                                        // Inserts, then violates the primary key: fails alone.
                                        let e = db
                                            .write(move |c| {
                                                insert(c, &format!("{id}-a"))?;
                                                insert(c, &format!("{id}-a"))
                                            })
                                            .await
                                            .unwrap_err();
                                        assert!(matches!(e, StoreError::Constraint(_)), "{e}");
                                    }
                                    _ => {
                                        db.write(move |c| insert(c, &id)).await.expect("insert");
                                        ok += 1;
                                    }
                                }
                                if state % 3 == 0 {
                                    tokio::task::yield_now().await;
                                }
                            }
                            ok
                        })
                    })
                    .collect();
                let mut ok = 0;
                for h in handles {
                    ok += h.await.expect("task");
                }
                ok
            });
            let rows = rt.block_on(db.read(count)).expect("count");
            assert_eq!(
                rows,
                i64::try_from(inserted).expect("fits"),
                "{synchronous:?}"
            );
            let stats = db.commit_stats();
            assert_eq!(
                stats.requests,
                tasks * per_task,
                "{synchronous:?}: {stats:?}"
            );
            assert!(stats.checkpoints > 0, "{synchronous:?}: {stats:?}");
            drop(rt);
        }
    }
}
