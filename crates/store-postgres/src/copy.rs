//! Moving a whole database between backends (`keel copy`): the PostgreSQL
//! ends — reading every table in one snapshot as keel-store's neutral
//! [`TableChunk`]s, and loading them into an empty database in one
//! transaction — and [`copy_database`], which joins either end of either
//! backend. Rows keep their insertion order (`row_order` is copied) and
//! identity keys their values; the sequences behind both move past them.

use std::collections::HashMap;
use std::path::PathBuf;

use keel_store::{
    is_copied, not_empty, read_sqlite_tables, Cell, ChunkBuilder, Result, SqliteLoader, StoreError,
    TableChunk, CHUNK_BYTES, CHUNK_ROWS, ROW_ORDER, ROW_ORDERED, TABLES,
};
use tokio::sync::mpsc;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{IsolationLevel, Row};

use crate::store::{from_pg, from_pg_store, from_pool};

/// Identity keys copied with their values (their sequences advanced after),
/// besides the [`ROW_ORDER`] of the [`ROW_ORDERED`] tables.
const IDENTITIES: [(&str, &str); 2] = [("queued_inputs", "seq"), ("webhook_deliveries", "seq")];

/// Rows a reader asks PostgreSQL for first, before it knows their size.
const FIRST_FETCH: usize = 16;

/// Session columns set after every row is in: they refer to rows that come
/// later (a head timeline) or to sessions in any order (a parent), and the
/// server checks references row by row.
const SESSION_LATE: [&str; 2] = ["head_timeline_id", "parent_id"];

/// A database either end of a copy can be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL connection string (URL or key=value).
    Postgres(String),
}

/// How far the copy of one table is: reported after each chunk committed
/// to the target's transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableProgress {
    /// The table.
    pub table: &'static str,
    /// Its rows copied so far.
    pub rows: u64,
}

/// What a copy moved: every copied table, in copy order, with its rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopySummary {
    /// (table, rows), empty tables included.
    pub tables: Vec<(&'static str, u64)>,
}

impl CopySummary {
    fn new() -> Self {
        Self {
            tables: TABLES
                .into_iter()
                .filter(|t| is_copied(t))
                .map(|t| (t, 0))
                .collect(),
        }
    }

    fn add(&mut self, table: &'static str, rows: usize) -> TableProgress {
        let rows = u64::try_from(rows).unwrap_or(u64::MAX);
        let at = match self.tables.iter().position(|(t, _)| *t == table) {
            Some(at) => at,
            None => {
                self.tables.push((table, 0));
                self.tables.len() - 1
            }
        };
        self.tables[at].1 += rows;
        TableProgress {
            table,
            rows: self.tables[at].1,
        }
    }

    /// Every row copied.
    pub fn total_rows(&self) -> u64 {
        self.tables.iter().map(|(_, n)| n).sum()
    }
}

/// Which end of a copy failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Reading the source.
    Source,
    /// Writing the target.
    Target,
}

/// A copy that failed, and at which end (the target is left as it was).
#[derive(Debug, thiserror::Error)]
pub struct CopyError {
    /// The end that failed.
    pub side: Side,
    /// The table being written when the target failed.
    pub table: Option<&'static str>,
    /// Why.
    #[source]
    pub error: StoreError,
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.side, self.table) {
            (Side::Source, _) => write!(f, "the source: {}", self.error),
            (Side::Target, None) => write!(f, "the target: {}", self.error),
            (Side::Target, Some(table)) => {
                write!(f, "the target, copying {table}: {}", self.error)
            }
        }
    }
}

fn at(side: Side) -> impl FnOnce(StoreError) -> CopyError {
    move |error| CopyError {
        side,
        table: None,
        error,
    }
}

/// Copies every row of `from` into `to`, which is created (SQLite) or
/// migrated (PostgreSQL) and must hold no row ([`StoreError::Conflict`]
/// otherwise). The source is read in one snapshot and never written; the
/// target is written in one transaction, so a copy that fails leaves it as
/// empty as it was. `progress` hears of every chunk written. Hold both
/// databases' runtime locks meanwhile: a keel writing the source would
/// write what the snapshot does not hold, one starting on the target would
/// find it half full.
pub async fn copy_database(
    from: &Database,
    to: &Database,
    progress: &mut (dyn FnMut(TableProgress) + Send),
) -> std::result::Result<CopySummary, CopyError> {
    // The target is refused before anything is read.
    let mut target = Target::create(to).await.map_err(at(Side::Target))?;
    let (chunks, mut received) = mpsc::channel::<TableChunk>(2);
    let reader = match from.clone() {
        Database::Sqlite(path) => tokio::task::spawn_blocking(move || {
            read_sqlite_tables(&path, CHUNK_ROWS, &mut |chunk| {
                chunks.blocking_send(chunk).map_err(|_| target_stopped())
            })
        }),
        Database::Postgres(url) => {
            tokio::spawn(async move { read_postgres_tables(&url, CHUNK_ROWS, &chunks).await })
        }
    };
    let mut summary = CopySummary::new();
    while let Some(chunk) = received.recv().await {
        let (table, rows) = (chunk.table, chunk.rows.len());
        if let Err(e) = target.insert(chunk).await {
            // The reader stops at its next chunk; the target rolls back.
            drop(received);
            let _ = reader.await;
            return Err(CopyError {
                side: Side::Target,
                table: Some(table),
                error: e,
            });
        }
        progress(summary.add(table, rows));
    }
    // The channel closes when the reader ends: only a reader that read
    // everything lets the target commit.
    match reader.await {
        Ok(read) => read.map_err(at(Side::Source))?,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => return Err(at(Side::Source)(StoreError::Closed)),
    }
    target.commit().await.map_err(at(Side::Target))?;
    Ok(summary)
}

fn target_stopped() -> StoreError {
    StoreError::Closed
}

/// The target's side of a copy.
enum Target {
    /// Moved onto a blocking thread for each step (rusqlite blocks).
    Sqlite(Option<SqliteLoader>),
    Postgres(PgLoader),
}

impl Target {
    async fn create(to: &Database) -> Result<Self> {
        Ok(match to {
            Database::Sqlite(path) => {
                let path = path.clone();
                Target::Sqlite(Some(blocking(move || SqliteLoader::create(&path)).await?))
            }
            Database::Postgres(url) => Target::Postgres(PgLoader::create(url).await?),
        })
    }

    async fn insert(&mut self, chunk: TableChunk) -> Result<()> {
        match self {
            Target::Sqlite(slot) => {
                let mut loader = slot.take().ok_or(StoreError::Closed)?;
                // On failure the loader is dropped there: the transaction rolls back.
                let loader = blocking(move || loader.insert(&chunk).map(|()| loader)).await?;
                *slot = Some(loader);
                Ok(())
            }
            Target::Postgres(loader) => loader.insert(&chunk).await,
        }
    }

    async fn commit(self) -> Result<()> {
        match self {
            Target::Sqlite(slot) => {
                let loader = slot.ok_or(StoreError::Closed)?;
                blocking(move || loader.commit()).await
            }
            Target::Postgres(loader) => loader.commit().await,
        }
    }
}

/// Runs `f` on tokio's blocking threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(done) => done,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(StoreError::Closed),
    }
}

/// A dedicated connection (outside any pool) to `url`.
async fn connect(url: &str) -> Result<deadpool_postgres::ClientWrapper> {
    let pool = crate::pool(url, 1).map_err(from_pg_store)?;
    let client = pool.get().await.map_err(from_pool)?;
    Ok(deadpool_postgres::Object::take(client))
}

/// The columns of `table` with their types, in the table's order.
async fn table_columns(
    client: &impl tokio_postgres::GenericClient,
    table: &str,
) -> Result<Vec<(String, Type)>> {
    let stmt = client
        .prepare(&format!("SELECT * FROM {table} LIMIT 0"))
        .await
        .map_err(from_pg)?;
    Ok(stmt
        .columns()
        .iter()
        .map(|c| (c.name().to_owned(), c.type_().clone()))
        .collect())
}

/// The primary key columns of `table`, in key order (none for a table without one).
async fn primary_key(
    client: &impl tokio_postgres::GenericClient,
    table: &str,
) -> Result<Vec<String>> {
    let rows = client
        .query(
            "SELECT a.attname::text FROM pg_index i \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
             WHERE i.indrelid = $1::text::regclass AND i.indisprimary \
             ORDER BY array_position(i.indkey::int2[], a.attnum)",
            &[&table],
        )
        .await
        .map_err(from_pg)?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

fn cell(row: &Row, i: usize, ty: &Type, what: impl Fn() -> String) -> Result<Cell> {
    let cell = match *ty {
        Type::INT8 => row
            .try_get::<_, Option<i64>>(i)
            .map(|v| v.map(Cell::Integer)),
        Type::FLOAT8 => row.try_get::<_, Option<f64>>(i).map(|v| v.map(Cell::Real)),
        Type::TEXT => row
            .try_get::<_, Option<String>>(i)
            .map(|v| v.map(Cell::Text)),
        Type::BYTEA => row
            .try_get::<_, Option<Vec<u8>>>(i)
            .map(|v| v.map(Cell::Blob)),
        ref other => {
            return Err(StoreError::corrupt(
                &what(),
                format!("a column of type {other}, which keel's schema never has"),
            ));
        }
    };
    Ok(cell
        .map_err(|e| StoreError::corrupt(&what(), e))?
        .unwrap_or(Cell::Null))
}

/// Reads every copied table of the PostgreSQL database at `url` in one
/// snapshot (never writing it), oldest rows first — [`ROW_ORDER`] for the
/// tables that have it, else the primary key — in chunks of at most
/// `max_rows` rows, each sent to `sink` (a closed sink stops the read).
/// The database must be at this build's schema version.
pub async fn read_postgres_tables(
    url: &str,
    max_rows: usize,
    sink: &mpsc::Sender<TableChunk>,
) -> Result<()> {
    let mut client = connect(url).await?;
    let found = crate::schema_version(&client)
        .await
        .map_err(from_pg_store)?;
    match found.cmp(&crate::SCHEMA_VERSION) {
        std::cmp::Ordering::Equal => {}
        std::cmp::Ordering::Greater => {
            return Err(StoreError::NewerSchema {
                found,
                supported: crate::SCHEMA_VERSION,
            })
        }
        std::cmp::Ordering::Less => {
            return Err(StoreError::InvalidInput(format!(
                "the database is at schema version {found}, older than this keel's {}; \
                 run `keel migrate` on it first",
                crate::SCHEMA_VERSION
            )))
        }
    }
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(from_pg)?;
    let max_rows = max_rows.max(1);
    for table in TABLES.into_iter().filter(|t| is_copied(t)) {
        let columns = table_columns(&*tx, table).await?;
        let names: Vec<String> = columns.iter().map(|(n, _)| n.clone()).collect();
        let order = if ROW_ORDERED.contains(&table) {
            vec![ROW_ORDER.to_owned()]
        } else {
            match primary_key(&*tx, table).await? {
                key if key.is_empty() => names.clone(),
                key => key,
            }
        };
        // Text keys in SQLite's (byte) order, whatever the database's collation.
        let order: Vec<String> = order
            .iter()
            .map(|c| match columns.iter().find(|(n, _)| n == c) {
                Some((_, ty)) if *ty == Type::TEXT => format!("{c} COLLATE \"C\""),
                _ => c.clone(),
            })
            .collect();
        let stmt = tx
            .prepare(&format!(
                "SELECT {} FROM {table} ORDER BY {}",
                names.join(", "),
                order.join(", ")
            ))
            .await
            .map_err(from_pg)?;
        let portal = tx.bind(&stmt, &[]).await.map_err(from_pg)?;
        let mut chunk = ChunkBuilder::new(table, names.clone(), max_rows);
        // A few rows first, then about a chunk's bytes per round trip (at
        // most a chunk's rows): a table of large images never arrives whole.
        let mut fetch = FIRST_FETCH.min(max_rows);
        loop {
            let asked = i32::try_from(fetch).unwrap_or(i32::MAX);
            let rows = tx.query_portal(&portal, asked).await.map_err(from_pg)?;
            let mut bytes = 0;
            for r in &rows {
                let mut row = Vec::with_capacity(columns.len());
                for (i, (name, ty)) in columns.iter().enumerate() {
                    row.push(cell(r, i, ty, || format!("{table}.{name}"))?);
                }
                bytes += row.iter().map(Cell::size).sum::<usize>();
                if let Some(full) = chunk.push(row) {
                    sink.send(full).await.map_err(|_| target_stopped())?;
                }
            }
            if rows.len() < fetch {
                break;
            }
            let per_row = (bytes / rows.len()).max(1);
            fetch = (CHUNK_BYTES / per_row).clamp(1, max_rows);
        }
        if let Some(rest) = chunk.finish() {
            sink.send(rest).await.map_err(|_| target_stopped())?;
        }
    }
    tx.commit().await.map_err(from_pg)
}

/// A copy into an empty PostgreSQL database: every row in one transaction,
/// committed by [`PgLoader::commit`] (dropped before that, the connection
/// closes and the server rolls everything back).
pub struct PgLoader {
    client: deadpool_postgres::ClientWrapper,
    types: HashMap<&'static str, HashMap<String, Type>>,
    /// (session, head timeline, parent session), set at commit.
    late: Vec<(String, Option<String>, Option<String>)>,
}

impl std::fmt::Debug for PgLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgLoader").finish_non_exhaustive()
    }
}

impl PgLoader {
    /// Migrates the database at `url`, begins the transaction, locks
    /// keel's tables against other writers until it ends, and refuses the
    /// database unless every table is empty ([`StoreError::Conflict`]).
    /// Hold its runtime lock ([`crate::PgRuntimeLock`]) first, so no keel
    /// starts on it meanwhile.
    pub async fn create(url: &str) -> Result<Self> {
        let client = connect(url).await?;
        crate::migrate(&client).await.map_err(from_pg_store)?;
        client.batch_execute("BEGIN").await.map_err(from_pg)?;
        // Readers may read (an empty database); no one else may write
        // until the copy commits, so it is empty until then.
        client
            .batch_execute(&format!(
                "LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE",
                TABLES.join(", ")
            ))
            .await
            .map_err(from_pg)?;
        let mut types = HashMap::new();
        for table in TABLES {
            let rows: i64 = client
                .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                .await
                .map_err(from_pg)?
                .get(0);
            if rows > 0 {
                return Err(not_empty(table, rows));
            }
            let columns = table_columns(&*client, table).await?;
            types.insert(table, columns.into_iter().collect());
        }
        Ok(Self {
            client,
            types,
            late: Vec::new(),
        })
    }

    /// Inserts `chunk`'s rows (one binary `COPY`).
    pub async fn insert(&mut self, chunk: &TableChunk) -> Result<()> {
        let table = chunk.table;
        let types = self
            .types
            .get(table)
            .filter(|_| is_copied(table))
            .ok_or_else(|| StoreError::InvalidInput(format!("{table} is not a table to copy")))?;
        let mut tys = Vec::with_capacity(chunk.columns.len());
        for name in &chunk.columns {
            tys.push(types.get(name).cloned().ok_or_else(|| {
                StoreError::InvalidInput(format!(
                    "{table}.{name} is not a column of the target's schema"
                ))
            })?);
        }
        let position = |name: &str| chunk.columns.iter().position(|c| c == name);
        let late_at: Vec<usize> = if table == "sessions" {
            SESSION_LATE.iter().filter_map(|c| position(c)).collect()
        } else {
            Vec::new()
        };
        let sink = self
            .client
            .copy_in(&format!(
                "COPY {table} ({}) FROM STDIN (FORMAT binary)",
                chunk.columns.join(", ")
            ))
            .await
            .map_err(from_pg)?;
        let writer = BinaryCopyInWriter::new(sink, &tys);
        futures::pin_mut!(writer);
        for row in &chunk.rows {
            if row.len() != tys.len() {
                return Err(StoreError::InvalidInput(format!(
                    "a row of {table} has {} values for {} columns",
                    row.len(),
                    tys.len()
                )));
            }
            if !late_at.is_empty() {
                self.late.push(late_values(&chunk.columns, row)?);
            }
            let mut values: Vec<Box<dyn ToSql + Sync + Send>> = Vec::with_capacity(row.len());
            for (i, (c, ty)) in row.iter().zip(&tys).enumerate() {
                if late_at.contains(&i) {
                    values.push(Box::new(None::<String>));
                    continue;
                }
                values.push(bind(c, ty, || format!("{table}.{}", chunk.columns[i]))?);
            }
            let refs: Vec<&(dyn ToSql + Sync)> = values
                .iter()
                .map(|v| v.as_ref() as &(dyn ToSql + Sync))
                .collect();
            writer.as_mut().write(&refs).await.map_err(from_pg)?;
        }
        writer.finish().await.map_err(from_pg)?;
        Ok(())
    }

    /// Sets what was held back, moves the identity sequences past the
    /// copied keys, and commits.
    pub async fn commit(self) -> Result<()> {
        if !self.late.is_empty() {
            let mut ids = Vec::with_capacity(self.late.len());
            let mut heads = Vec::with_capacity(self.late.len());
            let mut parents = Vec::with_capacity(self.late.len());
            for (id, head, parent) in self.late {
                ids.push(id);
                heads.push(head);
                parents.push(parent);
            }
            self.client
                .execute(
                    "UPDATE sessions s SET head_timeline_id = l.head, parent_id = l.parent \
                     FROM unnest($1::text[], $2::text[], $3::text[]) AS l(id, head, parent) \
                     WHERE s.id = l.id",
                    &[&ids, &heads, &parents],
                )
                .await
                .map_err(from_pg)?;
        }
        let identities = ROW_ORDERED
            .iter()
            .map(|t| (*t, ROW_ORDER))
            .chain(IDENTITIES);
        for (table, column) in identities {
            // Not transactional, so a failed COMMIT leaves a gap in the
            // keys of an empty table: harmless.
            self.client
                .execute(
                    &format!(
                        "SELECT setval(pg_get_serial_sequence('{table}', '{column}'), \
                         max({column})) FROM {table} HAVING count(*) > 0"
                    ),
                    &[],
                )
                .await
                .map_err(from_pg)?;
        }
        self.client.batch_execute("COMMIT").await.map_err(from_pg)
    }
}

/// A session row's id and the references set at commit.
fn late_values(
    columns: &[String],
    row: &[Cell],
) -> Result<(String, Option<String>, Option<String>)> {
    let text = |name: &str| -> Result<Option<String>> {
        match columns.iter().position(|c| c == name).map(|at| &row[at]) {
            None | Some(Cell::Null) => Ok(None),
            Some(Cell::Text(t)) => Ok(Some(t.clone())),
            Some(other) => Err(StoreError::InvalidInput(format!(
                "sessions.{name}: a {other:?} where text was expected"
            ))),
        }
    };
    let id = text("id")?
        .ok_or_else(|| StoreError::InvalidInput("a session row without its id".into()))?;
    Ok((id, text("head_timeline_id")?, text("parent_id")?))
}

/// `cell` as a parameter of PostgreSQL type `ty`.
fn bind(cell: &Cell, ty: &Type, what: impl Fn() -> String) -> Result<Box<dyn ToSql + Sync + Send>> {
    Ok(match (ty, cell) {
        (&Type::INT8, Cell::Integer(i)) => Box::new(Some(*i)),
        (&Type::INT8, Cell::Null) => Box::new(None::<i64>),
        (&Type::FLOAT8, Cell::Real(f)) => Box::new(Some(*f)),
        // SQLite stores a REAL column's whole value as an integer when it was given one.
        #[allow(clippy::cast_precision_loss)]
        (&Type::FLOAT8, Cell::Integer(i)) => Box::new(Some(*i as f64)),
        (&Type::FLOAT8, Cell::Null) => Box::new(None::<f64>),
        (&Type::TEXT, Cell::Text(t)) => Box::new(Some(t.clone())),
        (&Type::TEXT, Cell::Null) => Box::new(None::<String>),
        (&Type::BYTEA, Cell::Blob(b)) => Box::new(Some(b.clone())),
        (&Type::BYTEA, Cell::Null) => Box::new(None::<Vec<u8>>),
        _ => {
            return Err(StoreError::InvalidInput(format!(
                "{}: a {} cannot be stored as {ty}",
                what(),
                kind(cell)
            )))
        }
    })
}

/// What kind of value a cell is, for messages (never the value: it may be private).
fn kind(cell: &Cell) -> &'static str {
    match cell {
        Cell::Null => "NULL",
        Cell::Integer(_) => "integer",
        Cell::Real(_) => "real",
        Cell::Text(_) => "text",
        Cell::Blob(_) => "blob",
    }
}
