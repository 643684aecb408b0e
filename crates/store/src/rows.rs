//! A whole database as plain rows, for moving it between backends
//! (`keel copy`): the tables in an order that satisfies their references,
//! each as chunks of [`Cell`]s any backend reads and writes, and the
//! SQLite ends of the move — reading every table in one snapshot, values
//! decompressed, and loading them into a new database in one transaction.

use std::path::Path;

use rusqlite::types::{Value, ValueRef};
use rusqlite::Connection;

use crate::error::{Result, StoreError};

/// The tables a copy moves, parents before children (`sessions` refers to
/// its head timeline too: a loader sets that reference once the timelines
/// are in). zstd dictionaries stay behind: copied values are plain.
pub const COPY_TABLES: [&str; 21] = [
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
];

/// Whether `table` is copied (the dictionaries are listed for the
/// emptiness check of a target only).
pub fn is_copied(table: &str) -> bool {
    table != "zstd_dictionaries"
}

/// One value, as both backends store it.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// SQL NULL.
    Null,
    /// An integer (SQLite INTEGER, PostgreSQL BIGINT).
    Integer(i64),
    /// A float (SQLite REAL, PostgreSQL DOUBLE PRECISION).
    Real(f64),
    /// Text.
    Text(String),
    /// Bytes (SQLite BLOB, PostgreSQL BYTEA).
    Blob(Vec<u8>),
}

/// Some rows of one table, in the order they were written.
#[derive(Debug, Clone, PartialEq)]
pub struct TableChunk {
    /// The table.
    pub table: &'static str,
    /// Its columns, in the order of each row's cells.
    pub columns: Vec<String>,
    /// The rows.
    pub rows: Vec<Vec<Cell>>,
}

/// Columns whose values keel-store may have stored as a zstd frame.
fn compressed_text(table: &str, column: &str) -> bool {
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
    if compressed_text(table, column) {
        return Ok(match value {
            ValueRef::Null => Cell::Null,
            v => Cell::Text(crate::compress::unpack(&format!("{table}.{column}"), v)?),
        });
    }
    Ok(match value {
        ValueRef::Null => Cell::Null,
        ValueRef::Integer(i) => Cell::Integer(i),
        ValueRef::Real(f) => Cell::Real(f),
        ValueRef::Text(t) => Cell::Text(
            std::str::from_utf8(t)
                .map_err(|e| StoreError::corrupt(&format!("{table}.{column}"), e))?
                .to_owned(),
        ),
        ValueRef::Blob(b) => Cell::Blob(b.to_vec()),
    })
}

/// Reads every copied table of the SQLite database at `path` (never
/// writing it, also while a keel runs on it) in one snapshot, oldest rows
/// first, `chunk_rows` rows at a time, values decompressed (state blobs
/// with codec 0); `each` gets every chunk.
pub fn read_sqlite_tables(
    path: &Path,
    chunk_rows: usize,
    each: &mut dyn FnMut(TableChunk) -> Result<()>,
) -> Result<()> {
    let path = crate::identify::resolve(path)?;
    if crate::identify::identify(&path, false)? == crate::identify::Found::Missing {
        return Err(StoreError::NotFound(format!("database {}", path.display())));
    }
    let conn = crate::identify::inspector(&path)?;
    // Frames name the dictionary they were made with.
    crate::compress::register_dictionaries(&conn)?;
    let tx = conn.unchecked_transaction()?;
    let chunk_rows = chunk_rows.max(1);
    for table in COPY_TABLES.into_iter().filter(|t| is_copied(t)) {
        let columns = columns(&tx, table)?;
        let mut stmt = tx.prepare(&format!(
            "SELECT {} FROM {table} ORDER BY rowid",
            columns.join(", ")
        ))?;
        let mut rows = stmt.query([])?;
        let mut chunk = Vec::new();
        while let Some(r) = rows.next()? {
            let mut row = Vec::with_capacity(columns.len());
            for (i, column) in columns.iter().enumerate() {
                row.push(cell(table, column, r.get_ref(i)?)?);
            }
            if table == "state_blobs" {
                unpack_state(&columns, &mut row)?;
            }
            chunk.push(row);
            if chunk.len() == chunk_rows {
                each(TableChunk {
                    table,
                    columns: columns.clone(),
                    rows: std::mem::take(&mut chunk),
                })?;
            }
        }
        if !chunk.is_empty() {
            each(TableChunk {
                table,
                columns: columns.clone(),
                rows: chunk,
            })?;
        }
    }
    Ok(())
}

/// A state blob row with its bytes as they are (codec 0).
fn unpack_state(columns: &[String], row: &mut [Cell]) -> Result<()> {
    let at = |name: &str| columns.iter().position(|c| c == name);
    let (Some(b), Some(c)) = (at("bytes"), at("codec")) else {
        return Ok(());
    };
    if let (Cell::Blob(bytes), Cell::Integer(codec)) = (&row[b], &row[c]) {
        let plain = crate::compress::unpack_bytes("state_blobs.bytes", *codec, bytes.clone())?;
        row[b] = Cell::Blob(plain);
        row[c] = Cell::Integer(0);
    }
    Ok(())
}

/// A copy into a new SQLite database: everything in one transaction,
/// committed by [`SqliteLoader::commit`] (dropped before, nothing stays).
pub struct SqliteLoader {
    conn: Connection,
}

impl SqliteLoader {
    /// Creates (or opens, and migrates) the database at `path`, refuses it
    /// unless every table is empty, and begins the transaction. Take the
    /// data directory's runtime lock first, so no keel starts on it meanwhile.
    pub fn create(path: &Path) -> Result<Self> {
        drop(crate::SqliteStore::open(
            path,
            crate::StoreOptions::default(),
        )?);
        let conn = crate::db::open_writer(&crate::identify::resolve(path)?, &Default::default())?;
        for table in COPY_TABLES {
            let rows: i64 =
                conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))?;
            if rows > 0 {
                return Err(StoreError::Conflict(format!(
                    "the target database is not empty ({table} holds {rows} row(s)); \
                     copy into a new one"
                )));
            }
        }
        // References are checked at COMMIT: sessions name their head
        // timeline, which comes after them.
        conn.execute_batch("BEGIN IMMEDIATE; PRAGMA defer_foreign_keys = ON;")?;
        Ok(Self { conn })
    }

    /// Inserts `chunk`'s rows.
    pub fn insert(&mut self, chunk: &TableChunk) -> Result<()> {
        let marks: Vec<String> = (1..=chunk.columns.len()).map(|i| format!("?{i}")).collect();
        let mut stmt = self.conn.prepare_cached(&format!(
            "INSERT INTO {} ({}) VALUES ({})",
            chunk.table,
            chunk.columns.join(", "),
            marks.join(", ")
        ))?;
        for row in &chunk.rows {
            let values = row.iter().map(|c| match c {
                Cell::Null => Value::Null,
                Cell::Integer(i) => Value::Integer(*i),
                Cell::Real(f) => Value::Real(*f),
                Cell::Text(t) => Value::Text(t.clone()),
                Cell::Blob(b) => Value::Blob(b.clone()),
            });
            stmt.execute(rusqlite::params_from_iter(values))?;
        }
        Ok(())
    }

    /// Commits everything inserted (refused, nothing kept, if a reference dangles).
    pub fn commit(self) -> Result<()> {
        self.conn.execute_batch("COMMIT")?;
        Ok(())
    }
}
