//! Connections and threads: one writer thread that owns the write connection
//! and commits whatever requests are waiting in one transaction (group
//! commit), and a small pool of read-only connections on their own threads.
//! Transient failures (BUSY/LOCKED/IO) are retried here, nowhere else.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use keel_core::SessionId;
use parking_lot::Mutex;
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
    /// How long SQLite itself waits on a lock before reporting BUSY.
    pub busy_timeout: Duration,
    /// Delays between retries of a transient failure (BUSY/LOCKED/IO); its length is the retry count.
    pub retry_delays: Vec<Duration>,
    /// Number of read-only connections (at least 1).
    pub readers: usize,
    /// Most write requests committed in one transaction.
    pub max_batch: usize,
    /// WAL pages after which SQLite checkpoints automatically (0 disables it).
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
    Ok(())
}

/// Opens the write connection: refuses a newer schema before writing
/// anything, then switches to WAL and migrates.
pub(crate) fn open_writer(path: &Path, opts: &StoreOptions) -> Result<Connection> {
    let mut conn = Connection::open(path)?;
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
    conn.pragma_update(None, "wal_autocheckpoint", opts.wal_autocheckpoint_pages)?;
    migrations::migrate(&mut conn)?;
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
            (None, None) => Err(StoreError::Sqlite("write request never ran".into())),
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
}

#[derive(Default)]
struct Counters {
    transactions: AtomicU64,
    requests: AtomicU64,
}

/// The threads and channels behind a [`crate::Store`]; dropped with the last clone.
pub(crate) struct Db {
    path: PathBuf,
    writer_tx: Mutex<Option<mpsc::Sender<Box<dyn WriteJob>>>>,
    reader_tx: Mutex<Option<mpsc::Sender<ReadJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    retry_delays: Arc<Vec<Duration>>,
    counters: Arc<Counters>,
}

impl Db {
    /// Opens (creating and migrating if needed) the database at `path`.
    pub(crate) fn open(path: &Path, opts: StoreOptions) -> Result<Self> {
        let conn = open_writer(path, &opts)?;
        let retry_delays = Arc::new(opts.retry_delays.clone());
        let mut threads = Vec::new();

        let (wtx, wrx) = mpsc::channel::<Box<dyn WriteJob>>();
        let delays = Arc::clone(&retry_delays);
        let max_batch = opts.max_batch.max(1);
        let counters = Arc::new(Counters::default());
        let writer_counters = Arc::clone(&counters);
        threads.push(
            std::thread::Builder::new()
                .name("keel-store-writer".into())
                .spawn(move || writer_loop(conn, wrx, &delays, max_batch, &writer_counters))
                .map_err(|e| StoreError::Io {
                    attempts: 1,
                    message: e.to_string(),
                })?,
        );

        let (rtx, rrx) = mpsc::channel::<ReadJob>();
        let rrx = Arc::new(Mutex::new(rrx));
        for i in 0..opts.readers.max(1) {
            let conn = open_reader(path, &opts)?;
            let rrx = Arc::clone(&rrx);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("keel-store-reader-{i}"))
                    .spawn(move || reader_loop(conn, &rrx))
                    .map_err(|e| StoreError::Io {
                        attempts: 1,
                        message: e.to_string(),
                    })?,
            );
        }
        Ok(Self {
            path: path.to_owned(),
            writer_tx: Mutex::new(Some(wtx)),
            reader_tx: Mutex::new(Some(rtx)),
            threads: Mutex::new(threads),
            retry_delays,
            counters,
        })
    }

    /// Transactions and requests the writer has handled.
    pub(crate) fn commit_stats(&self) -> CommitStats {
        CommitStats {
            transactions: self.counters.transactions.load(Ordering::Relaxed),
            requests: self.counters.requests.load(Ordering::Relaxed),
        }
    }

    /// The database file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in the writer's transaction (group-committed with whatever
    /// else is waiting) and answers after COMMIT. `f` may run more than once
    /// if the batch is retried, so it must not have effects outside `conn`.
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

    async fn submit<T, F>(&self, f: F, maintains_cache: bool) -> Result<T>
    where
        T: Send + 'static,
        F: FnMut(&Connection, &mut WriteCache) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job = Box::new(TypedJob {
            f,
            maintains_cache,
            out: None,
            tx,
        });
        {
            let guard = self.writer_tx.lock();
            let sender = guard.as_ref().ok_or(StoreError::Closed)?;
            sender.send(job).map_err(|_| StoreError::Closed)?;
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
            let _ = tx.send(with_retries(&delays, || {
                let tx = conn.unchecked_transaction()?;
                let out = f(&tx);
                drop(tx);
                out
            }));
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
        // Closing the channels lets the threads finish what is queued and exit.
        self.writer_tx.lock().take();
        self.reader_tx.lock().take();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
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

fn writer_loop(
    conn: Connection,
    rx: mpsc::Receiver<Box<dyn WriteJob>>,
    delays: &[Duration],
    max_batch: usize,
    counters: &Counters,
) {
    let mut cache = WriteCache::default();
    let mut batch: Vec<Box<dyn WriteJob>> = Vec::new();
    while let Ok(first) = rx.recv() {
        batch.push(first);
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let outcome = with_retries(delays, || {
            let result = run_batch(&conn, &mut batch, &mut cache);
            if result.is_err() {
                // Whatever happened to the transaction, forget rather than guess.
                cache.clear();
            }
            result
        });
        let error = outcome.err();
        counters.transactions.fetch_add(1, Ordering::Relaxed);
        counters
            .requests
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        for job in batch.drain(..) {
            job.finish(error.clone());
        }
    }
}

/// Runs one cached statement that returns no rows (transaction control).
fn exec(conn: &Connection, sql: &str) -> Result<()> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

/// One attempt at committing `batch` in a single IMMEDIATE transaction.
fn run_batch(
    conn: &Connection,
    batch: &mut [Box<dyn WriteJob>],
    cache: &mut WriteCache,
) -> Result<()> {
    cache.begin_attempt();
    exec(conn, "BEGIN IMMEDIATE")?;
    let result = data_version(conn).and_then(|version| {
        cache.check_data_version(version);
        run_jobs(conn, batch, cache)
    });
    let result = match result {
        Ok(true) => exec(conn, "COMMIT").map(|()| cache.committed()),
        // A lone request failed on its own: nothing else to keep (and nothing staged).
        Ok(false) => exec(conn, "ROLLBACK").map(|()| cache.begin_attempt()),
        Err(e) => Err(e),
    };
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    result
}

/// `PRAGMA data_version`: changes when another connection commits.
fn data_version(conn: &Connection) -> Result<i64> {
    Ok(conn
        .prepare_cached("PRAGMA data_version")?
        .query_row([], |r| r.get(0))?)
}

/// Runs the requests; `Ok(false)` only when a lone request failed (roll back instead of commit).
fn run_jobs(
    conn: &Connection,
    batch: &mut [Box<dyn WriteJob>],
    cache: &mut WriteCache,
) -> Result<bool> {
    if let [only] = batch {
        // No neighbours to protect: the transaction itself is the savepoint.
        let ok = only.run(conn, cache)?;
        cache.end_job(ok, only.maintains_cache());
        return Ok(ok);
    }
    // Each request runs in its own savepoint so that one failing request
    // (a constraint, a stale execution id) does not fail its neighbours.
    for job in batch.iter_mut() {
        exec(conn, "SAVEPOINT job")?;
        let ok = job.run(conn, cache)?;
        cache.end_job(ok, job.maintains_cache());
        if ok {
            exec(conn, "RELEASE job")?;
        } else {
            exec(conn, "ROLLBACK TO job")?;
            exec(conn, "RELEASE job")?;
        }
    }
    Ok(true)
}
