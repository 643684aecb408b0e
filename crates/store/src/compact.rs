//! [`compact_database`]: `keel compact-storage`, for a database no keel runs on.
//!
//! Two steps. First, rows written before compression existed (or while it
//! was off) are compressed where that makes them smaller: message bodies,
//! run results and state blobs, in bounded batches, each batch its own
//! transaction (an interrupted run leaves every row readable, the next run
//! carries on). Then the file is rebuilt with `VACUUM`: survivors that
//! deletes left spread over half-empty pages are packed together, and a
//! database created with 4 KiB pages or without incremental auto-vacuum
//! gets the layout new databases have. `VACUUM` is one atomic step under a
//! rollback journal (the database returns to WAL after it); it needs free
//! disk space about the size of the database.

use std::path::Path;

use rusqlite::types::{Value, ValueRef};
use rusqlite::{params, Connection, TransactionBehavior};

use crate::compress;
use crate::error::{Result, StoreError};
use crate::identify::{self, sibling, PAGE_SIZE};
use crate::runtime::RuntimeLock;

/// What [`compact_database`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CompactReport {
    /// Message bodies stored compressed that were text.
    pub messages: u64,
    /// Run results stored compressed that were text.
    pub run_results: u64,
    /// State blobs stored compressed that were raw.
    pub state_blobs: u64,
    /// File size (with its WAL) before, in bytes.
    pub bytes_before: u64,
    /// File size after, in bytes.
    pub bytes_after: u64,
    /// Page size before and after.
    pub page_size_before: u32,
    /// Page size after (that of a new database).
    pub page_size_after: u32,
}

/// Compresses old rows in batches of `batch` (one transaction each), then
/// rebuilds the file. `lock` (on `path`) proves no keel runs on it; the
/// database must be at the current schema (open it with a `Store` first).
pub fn compact_database(path: &Path, lock: &RuntimeLock, batch: usize) -> Result<CompactReport> {
    let path = identify::resolve(path)?;
    if lock.path() != sibling(&path, ".lock") {
        return Err(StoreError::InvalidInput(format!(
            "the lock {} is not {}'s",
            lock.path().display(),
            path.display()
        )));
    }
    let found = match identify::identify(&path, false)? {
        identify::Found::Missing => {
            return Err(StoreError::NotFound(format!("database {}", path.display())))
        }
        identify::Found::Keel { version } => version,
    };
    if found != crate::SCHEMA_VERSION {
        return Err(StoreError::InvalidInput(format!(
            "the database is at schema version {found}, not {}: open it with this keel first",
            crate::SCHEMA_VERSION
        )));
    }
    let batch = batch.max(1);
    let bytes_before = file_bytes(&path);
    let mut conn = Connection::open(&path)?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    let page_size_before = page_size(&conn)?;
    compress::load_dictionaries(&conn, &path)?;
    let mut report = CompactReport {
        bytes_before,
        page_size_before,
        ..CompactReport::default()
    };
    report.messages = recompress_text(&mut conn, &path, "messages", "content", batch)?;
    report.run_results = recompress_text(&mut conn, &path, "agent_runs", "result", batch)?;
    report.state_blobs = recompress_blobs(&mut conn, &path, batch)?;
    // Page size and auto-vacuum mode change only in a VACUUM, and the page
    // size only outside WAL mode.
    let mode: String = conn.query_row("PRAGMA journal_mode=DELETE", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("delete") {
        return Err(StoreError::Sqlite(format!(
            "could not leave WAL mode to rebuild the file (journal_mode is {mode})"
        )));
    }
    conn.execute_batch(&format!(
        "PRAGMA page_size = {PAGE_SIZE}; PRAGMA auto_vacuum = INCREMENTAL; VACUUM;"
    ))?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Sqlite(format!(
            "could not return to WAL (journal_mode is {mode})"
        )));
    }
    report.page_size_after = page_size(&conn)?;
    conn.close().map_err(|(_, e)| StoreError::from(e))?;
    report.bytes_after = file_bytes(&path);
    Ok(report)
}

fn page_size(conn: &Connection) -> Result<u32> {
    let n: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
    u32::try_from(n).map_err(|_| StoreError::corrupt("page_size", n))
}

/// The database file and its WAL, in bytes.
fn file_bytes(path: &Path) -> u64 {
    [path.to_path_buf(), sibling(path, "-wal")]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// Stores `table.column`'s long text values compressed, `batch` rows a
/// transaction, walking the table by rowid; returns how many changed.
fn recompress_text(
    conn: &mut Connection,
    db: &Path,
    table: &str,
    column: &str,
    batch: usize,
) -> Result<u64> {
    let select = format!(
        "SELECT rowid, {column} FROM {table} WHERE rowid > ?1 AND typeof({column}) = 'text' \
         AND length(CAST({column} AS BLOB)) >= ?2 ORDER BY rowid LIMIT ?3"
    );
    let update = format!("UPDATE {table} SET {column} = ?1 WHERE rowid = ?2");
    let what = format!("{table}.{column}");
    let (mut after, mut changed) = (i64::MIN, 0u64);
    loop {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let rows: Vec<(i64, String)> = {
            let mut stmt = tx.prepare_cached(&select)?;
            let rows = stmt.query_map(
                params![after, compress::MIN_PACKED_BYTES as i64, batch as i64],
                |r| Ok((r.get(0)?, r.get::<_, String>(1)?)),
            )?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        for (rowid, text) in &rows {
            if let Value::Blob(frame) = compress::pack(text.clone(), Some(db)) {
                // What is stored must read back as what was there.
                if compress::unpack(&what, ValueRef::Blob(&frame))? != *text {
                    return Err(StoreError::corrupt(&what, "a frame did not round-trip"));
                }
                tx.prepare_cached(&update)?.execute(params![frame, rowid])?;
                changed += 1;
            }
        }
        tx.commit()?;
        match rows.last() {
            Some((rowid, _)) if rows.len() == batch => after = *rowid,
            _ => return Ok(changed),
        }
    }
}

/// Stores raw state blobs compressed where smaller, `batch` a transaction.
fn recompress_blobs(conn: &mut Connection, db: &Path, batch: usize) -> Result<u64> {
    let (mut after, mut changed) = (i64::MIN, 0u64);
    loop {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let rows: Vec<(i64, Vec<u8>)> = {
            let mut stmt = tx.prepare_cached(
                "SELECT rowid, bytes FROM state_blobs WHERE rowid > ?1 AND codec = 0 \
                 ORDER BY rowid LIMIT ?2",
            )?;
            let rows =
                stmt.query_map(params![after, batch as i64], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        for (rowid, bytes) in &rows {
            let (codec, stored) = compress::pack_bytes(bytes, Some(db));
            if codec == compress::ZSTD {
                if compress::unpack_bytes("state_blobs.bytes", codec, stored.clone())? != *bytes {
                    return Err(StoreError::corrupt(
                        "state_blobs.bytes",
                        "a frame did not round-trip",
                    ));
                }
                tx.prepare_cached(
                    "UPDATE state_blobs SET bytes = ?1, codec = ?2 WHERE rowid = ?3",
                )?
                .execute(params![stored, codec, rowid])?;
                changed += 1;
            }
        }
        tx.commit()?;
        match rows.last() {
            Some((rowid, _)) if rows.len() == batch => after = *rowid,
            _ => return Ok(changed),
        }
    }
}

/// Bytes of values a database holds before its dictionary is trained (8×
/// the dictionary: less teaches it too little).
const TRAIN_AFTER_BYTES: usize = 8 * compress::DICTIONARY_BYTES;
/// Newest message bodies and state blobs read to train on.
const TRAIN_SAMPLES: i64 = 2000;

impl crate::SqliteStore {
    pub(crate) async fn train_dictionary_if_due(&self, now_ms: i64) -> Result<Option<u32>> {
        let db = self.path().to_path_buf();
        if compress::current_dictionary(&db).is_some() {
            return Ok(None);
        }
        let samples = self
            .db
            .read(|c| {
                let mut out = Vec::new();
                let mut stmt =
                    c.prepare_cached("SELECT content FROM messages ORDER BY rowid DESC LIMIT ?1")?;
                let mut rows = stmt.query([TRAIN_SAMPLES])?;
                while let Some(r) = rows.next()? {
                    let text = compress::unpack("messages.content", r.get_ref(0)?)?;
                    out.push(text.into_bytes());
                }
                let mut stmt = c.prepare_cached(
                    "SELECT bytes, codec FROM state_blobs ORDER BY rowid DESC LIMIT ?1",
                )?;
                let mut rows = stmt.query([TRAIN_SAMPLES / 4])?;
                while let Some(r) = rows.next()? {
                    out.push(compress::unpack_bytes(
                        "state_blobs.bytes",
                        r.get(1)?,
                        r.get(0)?,
                    )?);
                }
                Ok(out)
            })
            .await?;
        if samples.iter().map(Vec::len).sum::<usize>() < TRAIN_AFTER_BYTES {
            return Ok(None);
        }
        // A thread of its own: training takes milliseconds of CPU.
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("keel-store-dict".into())
            .spawn(move || {
                // The receiver only goes away when the caller stopped waiting.
                let _ = tx.send(compress::train_dictionary(&samples));
            })
            .map_err(|e| StoreError::Sqlite(format!("cannot start the dictionary trainer: {e}")))?;
        let (id, bytes) = rx
            .await
            .map_err(|_| StoreError::Sqlite("the dictionary trainer stopped".into()))??;
        self.db
            .write(move |c| compress::store_dictionary(c, &db, id, &bytes, now_ms))
            .await?;
        tracing::info!(
            dictionary = id,
            "trained the database's compression dictionary"
        );
        Ok(Some(id))
    }
}
