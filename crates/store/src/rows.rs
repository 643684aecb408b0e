//! A whole database as plain rows, for moving it between backends
//! (`keel copy`): keel's tables in an order that satisfies their
//! references, each read as chunks of [`Cell`]s any backend can write, and
//! the SQLite ends of the move — reading every table in one snapshot with
//! values decompressed, and loading rows into an empty database in one
//! transaction. The PostgreSQL ends are keel-store-postgres's `copy.rs`.
//!
//! The rows carry everything a backend's behaviour depends on: the
//! insertion order of the tables whose listings follow it ([`ROW_ORDER`],
//! SQLite's rowid, PostgreSQL's `row_order` identity) and the keys of the
//! identity tables (`queued_inputs.seq`, `webhook_deliveries.seq`).

use std::path::Path;

use rusqlite::types::{Value, ValueRef};
use rusqlite::Connection;

use crate::error::{Result, StoreError};
use crate::migrations::SCHEMA_VERSION;

/// Every table of keel's schema, parents before children, so rows loaded
/// in this order satisfy every reference but two: a session's head
/// timeline (timelines come after sessions, which they belong to) and its
/// parent session (sessions are not ordered by it). A loader whose
/// references are checked per row sets those two once every row is in.
pub const TABLES: [&str; 23] = [
    "state_blobs",
    "sessions",
    "timelines",
    "messages",
    "checkpoints",
    "agent_run_groups",
    "agent_runs",
    "agent_inbox_events",
    "agent_session_state",
    "agent_run_pauses",
    "tool_approvals",
    "tool_approval_grants",
    "queued_inputs",
    "webhook_subscriptions",
    "webhook_deliveries",
    "call_spans",
    "dialog_spend",
    "mcp_manifests",
    "images",
    "runtime_state",
    "zstd_dictionaries",
    "runtime_processes",
    "session_leases",
];

/// Whether `table` is copied. zstd dictionaries stay behind: copied values
/// are plain, and a dictionary only ever helps the database that trained
/// it (`keel compact` trains one for the new database). The processes and
/// session leases of the source's running keels stay behind too: no process
/// of the source runs on the target (its queued inputs are taken by the
/// target's first process). They are in [`TABLES`] so that a target
/// holding any is not taken for empty.
pub fn is_copied(table: &str) -> bool {
    !matches!(
        table,
        "zstd_dictionaries" | "runtime_processes" | "session_leases"
    )
}

/// The column that carries a row's insertion order, in the tables whose
/// listings follow it ([`ROW_ORDERED`]): SQLite's rowid, PostgreSQL's
/// `row_order` identity.
pub const ROW_ORDER: &str = "row_order";

/// The tables whose insertion order is part of their data (listings and
/// "the newest" follow it).
pub const ROW_ORDERED: [&str; 5] = [
    "sessions",
    "timelines",
    "checkpoints",
    "agent_run_groups",
    "agent_runs",
];

/// Most rows a chunk holds.
pub const CHUNK_ROWS: usize = 1000;

/// A chunk is handed on once its values hold this many bytes, however few
/// rows that is (images, long messages): a copy's memory stays bounded.
pub const CHUNK_BYTES: usize = 8 << 20;

/// One value, as both backends store it.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// SQL NULL.
    Null,
    /// An integer (SQLite INTEGER, PostgreSQL BIGINT).
    Integer(i64),
    /// A float (SQLite REAL, PostgreSQL DOUBLE PRECISION).
    Real(f64),
    /// Text, never compressed.
    Text(String),
    /// Bytes (SQLite BLOB, PostgreSQL BYTEA), never compressed.
    Blob(Vec<u8>),
}

impl Cell {
    /// About how much memory the value holds.
    pub fn size(&self) -> usize {
        match self {
            Cell::Text(t) => t.len(),
            Cell::Blob(b) => b.len(),
            Cell::Null | Cell::Integer(_) | Cell::Real(_) => 8,
        }
    }
}

/// Some rows of one table, in the order they were written.
#[derive(Debug, Clone, PartialEq)]
pub struct TableChunk {
    /// The table (one of [`TABLES`]).
    pub table: &'static str,
    /// Its columns, in the order of each row's cells; [`ROW_ORDER`] among
    /// them for the [`ROW_ORDERED`] tables.
    pub columns: Vec<String>,
    /// The rows.
    pub rows: Vec<Vec<Cell>>,
}

/// Gathers one table's rows into chunks of at most [`CHUNK_ROWS`] rows or
/// about [`CHUNK_BYTES`] bytes.
#[derive(Debug)]
pub struct ChunkBuilder {
    table: &'static str,
    columns: Vec<String>,
    rows: Vec<Vec<Cell>>,
    bytes: usize,
    max_rows: usize,
}

impl ChunkBuilder {
    /// An empty chunk of `table` with these columns, handed on after
    /// `max_rows` rows (or [`CHUNK_BYTES`]).
    pub fn new(table: &'static str, columns: Vec<String>, max_rows: usize) -> Self {
        Self {
            table,
            columns,
            rows: Vec::new(),
            bytes: 0,
            max_rows: max_rows.max(1),
        }
    }

    /// Adds a row; returns the chunk when it is full.
    pub fn push(&mut self, row: Vec<Cell>) -> Option<TableChunk> {
        self.bytes += row.iter().map(Cell::size).sum::<usize>();
        self.rows.push(row);
        (self.rows.len() >= self.max_rows || self.bytes >= CHUNK_BYTES).then(|| self.take())
    }

    /// What is left (`None` when nothing is).
    pub fn finish(mut self) -> Option<TableChunk> {
        (!self.rows.is_empty()).then(|| self.take())
    }

    fn take(&mut self) -> TableChunk {
        self.bytes = 0;
        TableChunk {
            table: self.table,
            columns: self.columns.clone(),
            rows: std::mem::take(&mut self.rows),
        }
    }
}

/// Columns whose values keel-store stores as a zstd frame when that is smaller.
fn packed_text(table: &str, column: &str) -> bool {
    matches!(
        (table, column),
        ("messages", "content") | ("agent_runs", "result")
    )
}

fn columns(conn: &Connection, table: &str) -> Result<Vec<String>> {
    let mut stmt = conn.prepare(&format!("PRAGMA table_info({table})"))?;
    let names = stmt
        .query_map([], |r| r.get::<_, String>(1))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(names)
}

fn cell(table: &str, column: &str, value: ValueRef<'_>) -> Result<Cell> {
    let what = || format!("{table}.{column}");
    if packed_text(table, column) {
        return Ok(match value {
            ValueRef::Null => Cell::Null,
            v => Cell::Text(crate::compress::unpack(&what(), v)?),
        });
    }
    Ok(match value {
        ValueRef::Null => Cell::Null,
        ValueRef::Integer(i) => Cell::Integer(i),
        ValueRef::Real(f) => Cell::Real(f),
        ValueRef::Text(t) => Cell::Text(
            std::str::from_utf8(t)
                .map_err(|e| StoreError::corrupt(&what(), e))?
                .to_owned(),
        ),
        ValueRef::Blob(b) => Cell::Blob(b.to_vec()),
    })
}

/// A state blob row with its bytes plain (codec 0).
fn unpack_state(columns: &[String], row: &mut [Cell]) -> Result<()> {
    let at = |name: &str| columns.iter().position(|c| c == name);
    let (Some(b), Some(c)) = (at("bytes"), at("codec")) else {
        return Err(StoreError::corrupt(
            "state_blobs",
            "no bytes or codec column",
        ));
    };
    if let (Cell::Blob(bytes), Cell::Integer(codec)) = (&row[b], &row[c]) {
        let what = "state_blobs.bytes";
        let plain = crate::compress::unpack_bytes(what, *codec, bytes.clone())?;
        row[b] = Cell::Blob(plain);
        row[c] = Cell::Integer(crate::compress::RAW);
    }
    Ok(())
}

/// Reads every copied table of the SQLite database at `path` in one
/// snapshot (never writing it: safe beside a running keel, though what it
/// commits later is not in the snapshot), oldest rows first, in chunks of
/// at most `max_rows` rows, values decompressed; `each` gets every chunk
/// and may stop the read with an error. The database must be at this
/// build's schema version.
pub fn read_sqlite_tables(
    path: &Path,
    max_rows: usize,
    each: &mut dyn FnMut(TableChunk) -> Result<()>,
) -> Result<()> {
    let path = crate::identify::resolve(path)?;
    match crate::identify::identify(&path, false)? {
        crate::identify::Found::Missing => {
            return Err(StoreError::NotFound(format!("database {}", path.display())));
        }
        crate::identify::Found::Keel { version } if version < SCHEMA_VERSION => {
            return Err(StoreError::InvalidInput(format!(
                "the database is at schema version {version}, older than this keel's \
                 {SCHEMA_VERSION}; run `keel migrate` on it first"
            )));
        }
        crate::identify::Found::Keel { .. } => {}
    }
    let conn = crate::identify::inspector(&path)?;
    // Frames name the dictionary they were made with.
    crate::compress::register_dictionaries(&conn)?;
    let tx = conn.unchecked_transaction()?;
    for table in TABLES.into_iter().filter(|t| is_copied(t)) {
        let stored = columns(&tx, table)?;
        let ordered = ROW_ORDERED.contains(&table);
        let mut names = Vec::with_capacity(stored.len() + 1);
        if ordered {
            names.push(ROW_ORDER.to_owned());
        }
        names.extend(stored.iter().cloned());
        let select = if ordered {
            format!("rowid, {}", stored.join(", "))
        } else {
            stored.join(", ")
        };
        let mut stmt = tx.prepare(&format!("SELECT {select} FROM {table} ORDER BY rowid"))?;
        let mut rows = stmt.query([])?;
        let mut chunk = ChunkBuilder::new(table, names.clone(), max_rows);
        while let Some(r) = rows.next()? {
            let mut row = Vec::with_capacity(names.len());
            for (i, column) in names.iter().enumerate() {
                row.push(cell(table, column, r.get_ref(i)?)?);
            }
            if table == "state_blobs" {
                unpack_state(&names, &mut row)?;
            }
            if let Some(full) = chunk.push(row) {
                each(full)?;
            }
        }
        if let Some(rest) = chunk.finish() {
            each(rest)?;
        }
    }
    Ok(())
}

/// A copy into an empty SQLite database: every row in one transaction,
/// committed by [`SqliteLoader::commit`] (dropped before that, nothing
/// stays but an empty, migrated database). Values are stored as keel
/// stores them (large text and state compressed, without a dictionary).
pub struct SqliteLoader {
    conn: Connection,
}

impl std::fmt::Debug for SqliteLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteLoader").finish_non_exhaustive()
    }
}

impl SqliteLoader {
    /// Creates the database at `path` (or opens and migrates a keel
    /// database there), begins the transaction, and refuses the database
    /// unless every table is empty ([`StoreError::Conflict`]). Take the
    /// database's runtime lock first, so no keel starts on it meanwhile.
    pub fn create(path: &Path) -> Result<Self> {
        drop(crate::SqliteStore::open(
            path,
            crate::StoreOptions::default(),
        )?);
        let conn = crate::db::open_writer(&crate::identify::resolve(path)?, &Default::default())?;
        // References are checked at COMMIT: sessions name their head
        // timeline, which comes after them.
        conn.execute_batch("BEGIN IMMEDIATE; PRAGMA defer_foreign_keys = ON;")?;
        for table in TABLES {
            let rows: i64 =
                conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))?;
            if rows > 0 {
                return Err(not_empty(table, rows));
            }
        }
        Ok(Self { conn })
    }

    /// Inserts `chunk`'s rows ([`ROW_ORDER`] becomes the rowid).
    pub fn insert(&mut self, chunk: &TableChunk) -> Result<()> {
        let table = chunk.table;
        if !TABLES.contains(&table) || !is_copied(table) {
            return Err(StoreError::InvalidInput(format!(
                "{table} is not a table to copy"
            )));
        }
        let columns: Vec<&str> = chunk
            .columns
            .iter()
            .map(|c| if c == ROW_ORDER { "rowid" } else { c.as_str() })
            .collect();
        let marks: Vec<String> = (1..=columns.len()).map(|i| format!("?{i}")).collect();
        let mut stmt = self.conn.prepare_cached(&format!(
            "INSERT INTO {table} ({}) VALUES ({})",
            columns.join(", "),
            marks.join(", ")
        ))?;
        let at = |name: &str| chunk.columns.iter().position(|c| c == name);
        let codec = (table == "state_blobs").then(|| at("codec")).flatten();
        for row in &chunk.rows {
            if row.len() != columns.len() {
                return Err(StoreError::InvalidInput(format!(
                    "a row of {table} has {} values for {} columns",
                    row.len(),
                    columns.len()
                )));
            }
            let mut values: Vec<Value> = Vec::with_capacity(row.len());
            let mut packed_codec = None;
            for (cell, column) in row.iter().zip(&chunk.columns) {
                values.push(match cell {
                    Cell::Text(t) if packed_text(table, column) => {
                        crate::compress::pack(t.clone(), None)
                    }
                    Cell::Blob(b) if codec.is_some() && column == "bytes" => {
                        let (c, stored) = crate::compress::pack_bytes(b, None);
                        packed_codec = Some(c);
                        Value::Blob(stored)
                    }
                    Cell::Null => Value::Null,
                    Cell::Integer(i) => Value::Integer(*i),
                    Cell::Real(f) => Value::Real(*f),
                    Cell::Text(t) => Value::Text(t.clone()),
                    Cell::Blob(b) => Value::Blob(b.clone()),
                });
            }
            if let (Some(at), Some(c)) = (codec, packed_codec) {
                values[at] = Value::Integer(c);
            }
            stmt.execute(rusqlite::params_from_iter(values))?;
        }
        Ok(())
    }

    /// Commits every row inserted (refused, and nothing kept, when a
    /// reference dangles).
    pub fn commit(self) -> Result<()> {
        self.conn.execute_batch("COMMIT")?;
        Ok(())
    }
}

/// The refusal of a target database that holds rows.
pub fn not_empty(table: &str, rows: i64) -> StoreError {
    StoreError::Conflict(format!(
        "the database is not empty ({table} holds {rows} row(s)); \
         keel copy writes only into a new, empty database"
    ))
}
