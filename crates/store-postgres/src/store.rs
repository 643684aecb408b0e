//! [`PgStore`]: the pool, transactions with their retries, the fence.
//!
//! A write runs in one `SERIALIZABLE` transaction ([`PgStore::write`]):
//! PostgreSQL then guarantees what SQLite's single writer does (the result
//! is that of some serial order of the transactions), so each domain
//! transaction keeps the shape of keel-store's SQLite one; a dialog's turn
//! path runs at `READ COMMITTED` behind the dialog's lock instead
//! ([`PgStore::write_committed`]). Transactions are opened by hand on a
//! pooled connection, so `BEGIN` travels with the first statements; one
//! that does not end is never handed to another caller. A transaction
//! PostgreSQL aborts to keep that promise (serialization failure, deadlock)
//! is retried from the start with backoff, and so is one whose connection
//! broke before `COMMIT` was sent; a constraint violation never is.
//! Every read runs in one `REPEATABLE READ READ ONLY` transaction
//! ([`PgStore::read`]): one snapshot, as on SQLite.
//!
//! An answer is returned only after `COMMIT` succeeded. A connection lost
//! during `COMMIT` is not retried (the commit may have happened): it surfaces
//! as [`StoreError::Io`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Pool, PoolError};
use futures::future::BoxFuture;
use keel_store::{CommitStats, Result, StoreError, WebhookHooks};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{IsolationLevel, Row, Statement};

use crate::migrations::{self, MigrationReport};

/// Tuning of a [`PgStore`].
#[derive(Debug, Clone)]
pub struct PgOptions {
    /// Most connections the pool opens.
    pub max_connections: usize,
    /// Delays between attempts of a transaction PostgreSQL aborted to keep
    /// it serializable (or a deadlock victim); its length is the retry count.
    pub retry_delays: Vec<Duration>,
    /// How long a process's registration lasts unless renewed: a process
    /// that stops renewing is recovered by another this long after its
    /// last renewal (`storage.lease_secs`).
    pub lease: Duration,
}

/// The pool's size unless configured: twice the machine's CPUs and two,
/// at most 16. More connections than a server's cores can run only make
/// its backends take turns: on 2 cores that also ran the server, 6
/// served about 15 % more turns than 16 (docs/BENCHMARKS.md).
pub fn default_max_connections() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (2 * cpus + 2).min(16)
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            // Conflicts clear as the other transaction commits: short waits
            // first, then backing off so a hot page's writers spread out
            // (about 15 s in all before a request is refused as busy:
            // several processes on one database conflict more).
            retry_delays: [
                1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 800, 1000, 1000, 1000, 1500, 2000, 2000,
                2000, 2000, 2000,
            ]
            .into_iter()
            .map(Duration::from_millis)
            .collect(),
            lease: Duration::from_secs(10),
        }
    }
}

/// The PostgreSQL backend of keel's store. Cheap to clone.
#[derive(Clone)]
pub struct PgStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: Pool,
    pub(crate) hooks: WebhookHooks,
    /// Where the database is, without credentials (for messages).
    pub(crate) location: String,
    retry_delays: Vec<Duration>,
    /// How long a registration lasts unless renewed.
    pub(crate) lease: Duration,
    /// The connection holding this process's presence lock (see `runtime.rs`).
    pub(crate) presence: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    /// The runtime generation this store writes for (0 until activated).
    fence: Arc<AtomicU64>,
    /// The connection string (the relay's listener connects outside the pool).
    pub(crate) config: tokio_postgres::Config,
    /// Messages to and from the other processes, from activation on.
    pub(crate) relay: std::sync::OnceLock<Arc<crate::relay::PgRelay>>,
    transactions: AtomicU64,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("location", &self.inner.location)
            .finish_non_exhaustive()
    }
}

/// What [`PgStore::write_statement`] tells its body.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StatementAttempt {
    /// The generation the write is fenced to (0: none).
    pub(crate) generation: i64,
    /// Whether an attempt before may have committed.
    pub(crate) again: bool,
}

/// The body of a transaction: may run more than once (each attempt in a
/// fresh transaction), so it must not have effects outside `tx`.
pub(crate) type TxBody<'a, T> = BoxFuture<'a, Result<T>>;

/// Where a body's statements run: a pooled connection, inside the
/// transaction `write` or `read` opened on it, or (`one_statement`) with no
/// transaction around it, the statement its own snapshot. Statements are
/// prepared once per connection (the pool keeps them): one round trip a
/// statement instead of two (parse, then execute), which also keeps
/// transactions short. Statements whose futures are polled together are
/// pipelined: sent at once, answered in order.
pub(crate) struct Tx<'a>(&'a deadpool_postgres::Client);

impl Tx<'_> {
    /// `sql` prepared on this connection (kept after the first time).
    pub(crate) async fn prepare(
        &self,
        sql: &str,
    ) -> std::result::Result<Statement, tokio_postgres::Error> {
        self.0.prepare_cached(sql).await
    }

    /// The rows `sql` returns.
    pub(crate) async fn query(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Vec<Row>, tokio_postgres::Error> {
        let stmt = self.prepare(sql).await?;
        self.0.query(&stmt, params).await
    }

    /// The one row `sql` returns.
    pub(crate) async fn query_one(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Row, tokio_postgres::Error> {
        let stmt = self.prepare(sql).await?;
        self.0.query_one(&stmt, params).await
    }

    /// The row `sql` returns, if any.
    pub(crate) async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Option<Row>, tokio_postgres::Error> {
        let stmt = self.prepare(sql).await?;
        self.0.query_opt(&stmt, params).await
    }

    /// Runs `sql`; the rows it changed.
    pub(crate) async fn execute(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<u64, tokio_postgres::Error> {
        let stmt = self.prepare(sql).await?;
        self.0.execute(&stmt, params).await
    }

    /// Runs statements without parameters (savepoints).
    pub(crate) async fn batch_execute(
        &self,
        sql: &str,
    ) -> std::result::Result<(), tokio_postgres::Error> {
        self.0.batch_execute(sql).await
    }
}

impl PgStore {
    /// Connects to `url` (a `postgres://` URL or libpq key=value string) and
    /// migrates the database to [`crate::SCHEMA_VERSION`]; a newer database
    /// is refused untouched ([`StoreError::NewerSchema`]).
    pub async fn connect(url: &str, options: PgOptions) -> Result<(Self, MigrationReport)> {
        let pool = crate::pool(url, options.max_connections.max(1)).map_err(from_pg_store)?;
        let client = pool.get().await.map_err(from_pool)?;
        let report = migrations::migrate(&client).await.map_err(from_pg_store)?;
        drop(client);
        Ok((Self::over(pool, url, options)?, report))
    }

    /// Connects to a database already at [`crate::SCHEMA_VERSION`] without
    /// writing anything (for checks); an older one is refused with what to
    /// run, a newer one with [`StoreError::NewerSchema`].
    pub async fn attach(url: &str, options: PgOptions) -> Result<Self> {
        let pool = crate::pool(url, options.max_connections.max(1)).map_err(from_pg_store)?;
        let client = pool.get().await.map_err(from_pool)?;
        let found = migrations::schema_version(&client)
            .await
            .map_err(from_pg_store)?;
        drop(client);
        match found.cmp(&crate::SCHEMA_VERSION) {
            std::cmp::Ordering::Equal => Self::over(pool, url, options),
            std::cmp::Ordering::Greater => Err(StoreError::NewerSchema {
                found,
                supported: crate::SCHEMA_VERSION,
            }),
            std::cmp::Ordering::Less => Err(StoreError::InvalidInput(format!(
                "the database is at schema version {found}, older than this keel's {}; \
                 run `keel migrate` first",
                crate::SCHEMA_VERSION
            ))),
        }
    }

    fn over(pool: Pool, url: &str, options: PgOptions) -> Result<Self> {
        let config = crate::pool::config(url).map_err(from_pg_store)?;
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                hooks: WebhookHooks::default(),
                location: crate::redacted(url),
                retry_delays: options.retry_delays,
                lease: options.lease,
                presence: tokio::sync::Mutex::new(None),
                fence: Arc::new(AtomicU64::new(0)),
                config,
                relay: std::sync::OnceLock::new(),
                transactions: AtomicU64::new(0),
            }),
        })
    }

    /// Where the database is (the connection string without its password).
    pub fn location(&self) -> &str {
        &self.inner.location
    }

    /// The pool (for the runtime's own long-lived connections).
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// Fences every later write to `generation` (see `activate_runtime`).
    pub(crate) fn set_fence(&self, generation: u64) {
        self.inner.fence.store(generation, Ordering::Release);
    }

    /// The generation this store's writes are fenced to (0: not activated).
    pub(crate) fn fence(&self) -> u64 {
        self.inner.fence.load(Ordering::Acquire)
    }

    /// The fence itself, shared with the relay (which tells this process's
    /// own messages by it).
    pub(crate) fn fence_cell(&self) -> Arc<AtomicU64> {
        self.inner.fence.clone()
    }

    /// Write transactions committed so far.
    pub(crate) fn commit_stats(&self) -> CommitStats {
        let n = self.inner.transactions.load(Ordering::Relaxed);
        CommitStats {
            transactions: n,
            requests: n,
            on_caller: 0,
            checkpoints: 0,
        }
    }

    /// Runs `body` in a `SERIALIZABLE` transaction, fenced to this store's
    /// runtime generation, and answers after `COMMIT`. Serialization
    /// failures and deadlocks are retried from the start.
    pub(crate) async fn write<T, F>(&self, body: F) -> Result<T>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>) -> TxBody<'a, T> + Send,
    {
        self.write_at(IsolationLevel::Serializable, body).await
    }

    /// Runs `body` in a `READ COMMITTED` transaction whose fence check
    /// locks this process's registration (`FOR KEY SHARE`), for writes
    /// that serialize on the row locks they take first: a dialog's writes
    /// (its sessions row, `lock_session`) and session leases. They take
    /// part in no serializable conflict, so dialogs never conflict with
    /// each other; a takeover of this process waits for them. Deadlocks are
    /// retried.
    pub(crate) async fn write_committed<T, F>(&self, body: F) -> Result<T>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>) -> TxBody<'a, T> + Send,
    {
        self.write_at(IsolationLevel::ReadCommitted, body).await
    }

    /// Runs `body` as [`Self::write_committed`] does, except that the body
    /// checks the fence itself, in the statement that locks what it writes:
    /// it is given the generation to fence to (0: none) and must lock that
    /// registration (`fence_cte!`) and fail with
    /// [`StoreError::TakenOver`] when it is gone. One statement fewer.
    pub(crate) async fn write_committed_fenced<T, F>(&self, mut body: F) -> Result<T>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>, i64) -> TxBody<'a, T> + Send,
    {
        let fence = self.inner.fence.load(Ordering::Acquire);
        let generation = crate::util::to_i64("generation", fence)?;
        self.write_attempts(IsolationLevel::ReadCommitted, 0, move |tx| {
            body(tx, generation)
        })
        .await
    }

    /// A fenced write at `isolation`, retried while it may succeed.
    async fn write_at<T, F>(&self, isolation: IsolationLevel, body: F) -> Result<T>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>) -> TxBody<'a, T> + Send,
    {
        let fence = self.inner.fence.load(Ordering::Acquire);
        self.write_attempts(isolation, fence, body).await
    }

    /// Attempts at a write at `isolation`, fenced to `fence` (0: by nothing
    /// here), until one commits or fails for good.
    async fn write_attempts<T, F>(
        &self,
        isolation: IsolationLevel,
        fence: u64,
        mut body: F,
    ) -> Result<T>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>) -> TxBody<'a, T> + Send,
    {
        let mut attempt = 0usize;
        loop {
            attempt += 1;
            match self.attempt(isolation, false, fence, &mut body).await {
                Err(Attempt::Retry(e)) => self.back_off(attempt, e).await?,
                Err(Attempt::Failed(e)) => return Err(e),
                Ok(v) => {
                    self.inner.transactions.fetch_add(1, Ordering::Relaxed);
                    return Ok(v);
                }
            }
        }
    }

    /// Runs `body` in a read-only transaction that sees one snapshot.
    pub(crate) async fn read<T, F>(&self, mut body: F) -> Result<T>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>) -> TxBody<'a, T> + Send,
    {
        let mut attempt = 0usize;
        loop {
            attempt += 1;
            match self
                .attempt(IsolationLevel::RepeatableRead, true, 0, &mut body)
                .await
            {
                Err(Attempt::Retry(e)) => self.back_off(attempt, e).await?,
                Err(Attempt::Failed(e)) => return Err(e),
                Ok(v) => return Ok(v),
            }
        }
    }

    /// Runs `body`, one statement — a read, or a write that may run twice
    /// and needs no fence — on a pooled connection without a transaction
    /// around it (the statement is its own snapshot and commit): two round
    /// trips fewer than `read` or `write`, for what every turn does. Lost
    /// connections are retried as transactions are.
    pub(crate) async fn one_statement<T, F>(&self, mut body: F) -> Result<T>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>) -> TxBody<'a, T> + Send,
    {
        let mut attempt = 0usize;
        loop {
            attempt += 1;
            let result = match self.inner.pool.get().await {
                Ok(client) => body(&Tx(&client)).await,
                Err(e) => Err(from_pool(e)),
            };
            match result {
                Err(e @ (StoreError::Busy { .. } | StoreError::Io { .. })) => {
                    self.back_off(attempt, e).await?;
                }
                result => return result,
            }
        }
    }

    /// Runs `body`, one write statement that checks this store's fence
    /// itself, on a pooled connection without a transaction around it: the
    /// statement is its own transaction, one round trip instead of two
    /// and one statement instead of four (`BEGIN`, the fence check, the
    /// write, `COMMIT`). `body` is given the generation to fence to (0:
    /// none), which it gates its writes on (`fence_holds!`), and whether
    /// an attempt before may have committed: a connection lost while the
    /// statement ran leaves that unknown, so the body is run again and
    /// must answer as if that attempt had committed (an idempotent write).
    /// It answers `None` when it wrote nothing, which is then told apart
    /// from a takeover by reading the registration. Deadlocks and
    /// serialization failures are retried too (the server rolled the
    /// statement back).
    pub(crate) async fn write_statement<T, F>(&self, mut body: F) -> Result<Option<T>>
    where
        T: Send,
        F: for<'a> FnMut(&'a Tx<'a>, StatementAttempt) -> TxBody<'a, Option<T>> + Send,
    {
        let fence = self.inner.fence.load(Ordering::Acquire);
        let generation = crate::util::to_i64("generation", fence)?;
        let (mut attempt, mut again) = (0usize, false);
        loop {
            attempt += 1;
            let client = match self.inner.pool.get().await {
                Ok(client) => client,
                Err(e) => {
                    self.back_off(attempt, from_pool(e)).await?;
                    continue;
                }
            };
            let tx = Tx(&client);
            match body(&tx, StatementAttempt { generation, again }).await {
                Err(e @ StoreError::Busy { .. }) => self.back_off(attempt, e).await?,
                Err(e @ StoreError::Io { .. }) => {
                    again = true;
                    self.back_off(attempt, e).await?;
                }
                Err(e) => return Err(e),
                Ok(Some(value)) => {
                    self.inner.transactions.fetch_add(1, Ordering::Relaxed);
                    return Ok(Some(value));
                }
                Ok(None) => {
                    if fence != 0 {
                        crate::runtime::check_fence(&tx, fence, false).await?;
                    }
                    return Ok(None);
                }
            }
        }
    }

    /// Waits before attempt `attempt + 1` after `e`, or gives `e` back
    /// when the retries are used up.
    async fn back_off(&self, attempt: usize, e: StoreError) -> Result<()> {
        match self.inner.retry_delays.get(attempt - 1) {
            Some(delay) => {
                tracing::debug!(attempt, error = %e, "retried");
                tokio::time::sleep(jittered(*delay)).await;
                Ok(())
            }
            None => Err(with_attempts(e, attempt)),
        }
    }

    /// One attempt at `body` in a transaction at `isolation`. `BEGIN`, the
    /// fence check and the body's first statements travel together (one
    /// round trip, not three): the fence is decided before `COMMIT`, which
    /// is all it needs — at `READ COMMITTED` its lock holds a takeover
    /// back from then to the commit, and a takeover committed earlier fails
    /// it; a serializable transaction sees one snapshot whatever the order.
    async fn attempt<T, F>(
        &self,
        isolation: IsolationLevel,
        read_only: bool,
        fence: u64,
        body: &mut F,
    ) -> std::result::Result<T, Attempt>
    where
        F: for<'a> FnMut(&'a Tx<'a>) -> TxBody<'a, T> + Send,
    {
        let client = self
            .inner
            .pool
            .get()
            .await
            .map_err(|e| Attempt::before_commit(from_pool(e)))?;
        let mut open = OpenTransaction(Some(client));
        let client = open.client();
        let tx = Tx(client);
        let fenced = async {
            if fence == 0 {
                return Ok(());
            }
            let locked = matches!(isolation, IsolationLevel::ReadCommitted);
            crate::runtime::check_fence(&tx, fence, locked).await
        };
        // Polled in this order, so `BEGIN` is sent first.
        let (begun, fenced, value) = futures::join!(
            client.batch_execute(begin(isolation, read_only)),
            fenced,
            body(&tx)
        );
        let value = match begun.map_err(from_pg).and(fenced).and(value) {
            Ok(value) => value,
            Err(e) => {
                open.roll_back().await;
                return Err(Attempt::before_commit(e));
            }
        };
        let committed = client.batch_execute("COMMIT").await;
        match committed {
            Ok(()) => {
                open.done();
                Ok(value)
            }
            Err(e) => match e.code() {
                // Rolled back by the server: nothing happened, try again.
                Some(code) if is_retryable(code) => {
                    open.done();
                    Err(Attempt::Retry(from_pg(e)))
                }
                // Lost during COMMIT: it may have committed; never redo it.
                _ => Err(Attempt::Failed(from_pg(e))),
            },
        }
    }
}

/// The statement that opens a transaction at `isolation`. It fails only
/// with its connection (no `READ WRITE`, which a standby refuses), so the
/// statements sent behind it never run outside the transaction.
fn begin(isolation: IsolationLevel, read_only: bool) -> &'static str {
    match (isolation, read_only) {
        (IsolationLevel::Serializable, _) => "START TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        (IsolationLevel::ReadCommitted, _) => "START TRANSACTION ISOLATION LEVEL READ COMMITTED",
        (_, true) => "START TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY",
        (_, false) => "START TRANSACTION ISOLATION LEVEL REPEATABLE READ",
    }
}

/// A pooled connection inside a transaction `attempt` opened. Unless the
/// transaction ended (committed or rolled back) the connection never goes
/// back to the pool: dropped mid-way (the caller gave up on the answer),
/// it is closed, and the server rolls the transaction back.
struct OpenTransaction(Option<deadpool_postgres::Client>);

impl OpenTransaction {
    fn client(&self) -> &deadpool_postgres::Client {
        self.0
            .as_ref()
            .expect("the connection is held until the end")
    }

    /// The transaction ended: the connection may serve others again.
    fn done(&mut self) {
        self.0 = None;
    }

    /// Rolls the transaction back; a connection that cannot is closed.
    async fn roll_back(&mut self) {
        if self.client().batch_execute("ROLLBACK").await.is_ok() {
            self.done();
        }
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            // Out of the pool: closing the connection rolls back.
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

/// How one attempt at a transaction ended, when it did not commit.
enum Attempt {
    /// PostgreSQL rolled it back to keep the transactions serializable, or
    /// chose it as a deadlock victim: run it again.
    Retry(StoreError),
    /// Anything else: the answer.
    Failed(StoreError),
}

impl Attempt {
    /// A failure before `COMMIT` was sent: nothing of the attempt is
    /// kept, so a conflict or a lost connection (the pool hands the next
    /// attempt another) is worth another attempt.
    fn before_commit(e: StoreError) -> Self {
        match e {
            StoreError::Busy { .. } | StoreError::Io { .. } => Attempt::Retry(e),
            e => Attempt::Failed(e),
        }
    }
}

fn is_retryable(code: &SqlState) -> bool {
    *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
}

/// A delay of between half and all of `delay`, so retries of transactions
/// that conflicted with each other do not collide again.
fn jittered(delay: Duration) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let r = RandomState::new().hash_one(std::time::Instant::now()) % 1000;
    delay / 2 + delay.mul_f64(r as f64 / 2000.0)
}

fn with_attempts(e: StoreError, attempts: usize) -> StoreError {
    let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
    match e {
        StoreError::Busy { message, .. } => StoreError::Busy { attempts, message },
        StoreError::Io { message, .. } => StoreError::Io { attempts, message },
        other => other,
    }
}

/// Maps a PostgreSQL error onto the store's: serialization failures and
/// deadlocks are [`StoreError::Busy`] (the store retried them), constraint
/// violations [`StoreError::Constraint`], a lost connection
/// [`StoreError::Io`], a full disk [`StoreError::DiskFull`].
pub(crate) fn from_pg(e: tokio_postgres::Error) -> StoreError {
    let Some(db) = e.as_db_error() else {
        let io = std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>());
        return if e.is_closed() || io {
            // No server answer: the connection is closed or broke.
            StoreError::Io {
                attempts: 1,
                message: format!("PostgreSQL connection: {e}"),
            }
        } else {
            // A request the client could not even send (a bug here).
            StoreError::Postgres(e.to_string())
        };
    };
    let message = match db.detail() {
        Some(detail) => format!("{} ({detail})", db.message()),
        None => db.message().to_owned(),
    };
    let code = db.code();
    match code.code() {
        "40001" | "40P01" => StoreError::Busy {
            attempts: 1,
            message,
        },
        "53100" => StoreError::DiskFull {
            attempts: 1,
            message,
        },
        "25006" => StoreError::ReadOnly(message),
        c if c.starts_with("23") => StoreError::Constraint(message),
        c if c.starts_with("08") || c.starts_with("57P") => StoreError::Io {
            attempts: 1,
            message,
        },
        _ => StoreError::Postgres(message),
    }
}

/// A pool failure: no connection could be had.
pub(crate) fn from_pool(e: PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => from_pg(e),
        PoolError::Closed => StoreError::Closed,
        other => StoreError::Io {
            attempts: 1,
            message: format!("PostgreSQL pool: {other}"),
        },
    }
}

/// The crate's own setup errors (pool, migrations) as the store's.
pub(crate) fn from_pg_store(e: crate::PgStoreError) -> StoreError {
    use crate::PgStoreError as E;
    match e {
        E::NewerSchema { found, supported } => StoreError::NewerSchema { found, supported },
        E::Migration { version, message } => StoreError::Migration { version, message },
        E::Corruption { what, value } => StoreError::corrupt(what, value),
        E::Config(message) => StoreError::InvalidInput(message),
        E::Postgres(e) => from_pg(e),
    }
}

impl PgStore {
    /// SQLite trains a zstd dictionary from its own rows; PostgreSQL stores
    /// values plain and compresses large ones itself (TOAST), so there is
    /// never a dictionary to train.
    pub(crate) async fn train_dictionary_if_due(&self, now_ms: i64) -> Result<Option<u32>> {
        let _ = now_ms;
        Ok(None)
    }
}
