//! Large values stored compressed, per row, transparently to every reader.
//!
//! Text (message bodies, run results): a value of at least
//! [`MIN_PACKED_BYTES`] is stored as its zstd frame (a BLOB) when that is
//! smaller; anything else stays TEXT, as every row written before
//! compression existed. Readers take either: the storage class says which
//! (no flag column, no rewrite on upgrade).
//!
//! Bytes (state blobs) are opaque, so the storage class cannot tell: their
//! row has a `codec` column ([`RAW`] or [`ZSTD`], migration 14; rows
//! written before it read as [`RAW`]).
//!
//! A database may hold a zstd dictionary trained from its own rows
//! (`zstd_dictionaries`, [`train_dictionary`]): a short message or state
//! shares most of its words and JSON with others, so frames made with it
//! are ~30 % smaller and decompress ~2× faster. Each frame names its
//! dictionary in its header; dictionaries are never deleted, so every
//! frame stays readable. Dictionaries are registered per process, by id
//! (for reading) and per database file (the one new values use).

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::RwLock;
use rusqlite::types::{Value, ValueRef};
use rusqlite::{Connection, OptionalExtension};
use zstd::zstd_safe::{CCtx, CDict, DCtx, DDict};

use crate::error::{Result, StoreError};

/// Values shorter than this stay as they are: a frame's header would eat the gain.
pub(crate) const MIN_PACKED_BYTES: usize = 128;

/// `state_blobs.codec` of bytes stored as they are.
pub(crate) const RAW: i64 = 0;
/// `state_blobs.codec` of bytes stored as their zstd frame.
pub(crate) const ZSTD: i64 = 1;

/// zstd level: measured against 1 and -3 (docs/BENCHMARKS.md): 1 saves
/// nothing, -3 reads 3× faster but stores ~30 % more.
const LEVEL: i32 = 3;

/// The most a stored frame may hold (far beyond any message keel accepts).
const MAX_UNPACKED_BYTES: usize = 64 << 20;

/// Whether new values are compressed (always, but for a benchmark's baseline).
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns compression of new values on or off for the whole process (a
/// benchmark's uncompressed baseline; readers take both forms regardless).
#[cfg(feature = "testing")]
pub fn set_compression(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Size of a trained dictionary (measured: 16 KiB saves ~470 bytes a turn).
pub(crate) const DICTIONARY_BYTES: usize = 16 * 1024;

/// A trained dictionary, prepared for both directions.
pub(crate) struct Dictionary {
    cdict: CDict<'static>,
    ddict: DDict<'static>,
}

/// Every dictionary this process has loaded, by its zstd id.
static BY_ID: LazyLock<RwLock<HashMap<u32, Arc<Dictionary>>>> = LazyLock::new(Default::default);
/// The dictionary new values of each database file are compressed with.
static CURRENT: LazyLock<RwLock<HashMap<PathBuf, Newest>>> = LazyLock::new(Default::default);

/// A database's newest dictionary: its id and itself.
type Newest = (u32, Arc<Dictionary>);

/// Prepares `bytes` (a dictionary whose header names `id`) and registers it.
fn register(id: u32, bytes: &[u8]) -> Result<Arc<Dictionary>> {
    if let Some(d) = BY_ID.read().get(&id) {
        return Ok(d.clone());
    }
    let bad = || {
        StoreError::corrupt(
            "zstd_dictionaries.bytes",
            format!("dictionary {id} does not load"),
        )
    };
    if zstd::zstd_safe::get_dict_id_from_dict(bytes).map(u32::from) != Some(id) {
        return Err(bad());
    }
    let dict = Arc::new(Dictionary {
        cdict: CDict::try_create(bytes, LEVEL).ok_or_else(bad)?,
        ddict: DDict::try_create(bytes).ok_or_else(bad)?,
    });
    BY_ID.write().insert(id, dict.clone());
    Ok(dict)
}

/// Loads every dictionary of `conn`'s database; the newest becomes the one
/// new values of that file (`db`) are compressed with.
pub(crate) fn load_dictionaries(conn: &Connection, db: &Path) -> Result<()> {
    let newest = register_dictionaries(conn)?;
    let mut current = CURRENT.write();
    for key in keys(conn, db) {
        match &newest {
            Some(d) => current.insert(key, d.clone()),
            None => current.remove(&key),
        };
    }
    Ok(())
}

/// Registers every dictionary of `conn`'s database for reading; returns
/// the newest.
pub(crate) fn register_dictionaries(conn: &Connection) -> Result<Option<Newest>> {
    let mut stmt =
        conn.prepare("SELECT id, bytes FROM zstd_dictionaries ORDER BY created_at, rowid")?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))?;
    let mut newest = None;
    for row in rows {
        let (id, bytes) = row?;
        let id = u32::try_from(id).map_err(|_| StoreError::corrupt("zstd_dictionaries.id", id))?;
        newest = Some((id, register(id, &bytes)?));
    }
    Ok(newest)
}

/// Forgets every registered dictionary, as a new process would not know
/// them (tests of reading them back from the database).
#[cfg(feature = "testing")]
pub fn forget_dictionaries() {
    BY_ID.write().clear();
    CURRENT.write().clear();
}

/// The names `db` is known by: the store's path and the one SQLite gives
/// its connections (writers inside a transaction know only the latter).
fn keys(conn: &Connection, db: &Path) -> Vec<PathBuf> {
    let mut out = vec![db.to_path_buf()];
    if let Some(p) = conn.path().filter(|p| Path::new(p) != db) {
        out.push(PathBuf::from(p));
    }
    out
}

/// The database file `conn` writes, as [`pack`] wants it.
pub(crate) fn db_of(conn: &Connection) -> Option<&Path> {
    conn.path().map(Path::new)
}

/// The id of the dictionary new values of `db` are compressed with.
pub(crate) fn current_dictionary(db: &Path) -> Option<u32> {
    CURRENT.read().get(db).map(|(id, _)| *id)
}

/// A dictionary trained on `samples` (values as stored, decompressed): its
/// zstd id and bytes. CPU only: run it off the writer.
pub(crate) fn train_dictionary(samples: &[Vec<u8>]) -> Result<(u32, Vec<u8>)> {
    let bytes = zstd::dict::from_samples(samples, DICTIONARY_BYTES)
        .map_err(|e| StoreError::InvalidInput(format!("training a dictionary failed: {e}")))?;
    let id = zstd::zstd_safe::get_dict_id_from_dict(&bytes)
        .map(u32::from)
        .ok_or_else(|| StoreError::InvalidInput("the trained dictionary has no id".into()))?;
    Ok((id, bytes))
}

/// Stores dictionary `id` in `conn`'s database (the caller's transaction)
/// and makes it the one new values of `db` use.
pub(crate) fn store_dictionary(
    conn: &Connection,
    db: &Path,
    id: u32,
    bytes: &[u8],
    now_ms: i64,
) -> Result<()> {
    let taken: Option<i64> = conn
        .prepare_cached("SELECT id FROM zstd_dictionaries WHERE id = ?1")?
        .query_row([i64::from(id)], |r| r.get(0))
        .optional()?;
    if taken.is_some() {
        return Err(StoreError::Conflict(format!(
            "dictionary id {id} exists; train again"
        )));
    }
    conn.prepare_cached(
        "INSERT INTO zstd_dictionaries (id, bytes, created_at) VALUES (?1, ?2, ?3)",
    )?
    .execute(rusqlite::params![i64::from(id), bytes, now_ms])?;
    let dict = register(id, bytes)?;
    let mut current = CURRENT.write();
    for key in keys(conn, db) {
        current.insert(key, (id, dict.clone()));
    }
    Ok(())
}

/// One thread's zstd contexts and the buffer values are decompressed into.
struct Codec {
    compress: zstd::bulk::Compressor<'static>,
    decompress: zstd::bulk::Decompressor<'static>,
    cctx: CCtx<'static>,
    dctx: DCtx<'static>,
    scratch: Vec<u8>,
}

thread_local! {
    /// Each thread's codec: creating a context costs more than compressing a message.
    static CODEC: RefCell<Option<Codec>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's codec (made on first use). Reentrant calls
/// (none are expected) get a codec of their own.
fn with_codec<T>(f: impl FnOnce(&mut Codec) -> T) -> std::io::Result<T> {
    let taken = CODEC.with(|cell| cell.borrow_mut().take());
    let mut codec = match taken {
        Some(c) => c,
        None => Codec {
            compress: zstd::bulk::Compressor::new(LEVEL)?,
            decompress: zstd::bulk::Decompressor::new()?,
            cctx: CCtx::try_create().ok_or_else(|| std::io::Error::other("no zstd context"))?,
            dctx: DCtx::try_create().ok_or_else(|| std::io::Error::other("no zstd context"))?,
            scratch: Vec::new(),
        },
    };
    let out = f(&mut codec);
    CODEC.with(|cell| *cell.borrow_mut() = Some(codec));
    Ok(out)
}

/// `bytes`' zstd frame (with `db`'s dictionary if it has one) when
/// compression is on, `bytes` is long enough and the frame is smaller.
fn compress(bytes: &[u8], db: Option<&Path>) -> Option<Vec<u8>> {
    if bytes.len() < MIN_PACKED_BYTES || !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    let dict = db.and_then(|p| CURRENT.read().get(p).map(|(_, d)| d.clone()));
    let made = with_codec(|c| match &dict {
        Some(d) => {
            let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(bytes.len()));
            c.cctx
                .compress_using_cdict(&mut out, bytes, &d.cdict)
                .map(|_| out)
                .map_err(|code| std::io::Error::other(zstd::zstd_safe::get_error_name(code)))
        }
        None => c.compress.compress(bytes),
    });
    match made.and_then(|r| r) {
        Ok(frame) if frame.len() < bytes.len() => Some(frame),
        Ok(_) => None,
        Err(e) => {
            // Compressing memory does not fail in practice; the value is kept as it is.
            tracing::warn!(error = %e, "compressing a value failed; it is stored uncompressed");
            None
        }
    }
}

/// The stored form of `text` in database `db`: its zstd frame when that
/// is smaller, else the text.
pub(crate) fn pack(text: String, db: Option<&Path>) -> Value {
    match compress(text.as_bytes(), db) {
        Some(frame) => Value::Blob(frame),
        None => Value::Text(text),
    }
}

/// [`pack`] of an optional text (NULL stays NULL).
pub(crate) fn pack_opt(text: Option<&str>, db: Option<&Path>) -> Value {
    text.map_or(Value::Null, |t| pack(t.to_owned(), db))
}

/// The stored form of opaque `bytes` in database `db` with its codec ([`RAW`] or [`ZSTD`]).
pub(crate) fn pack_bytes(bytes: &[u8], db: Option<&Path>) -> (i64, Vec<u8>) {
    match compress(bytes, db) {
        Some(frame) => (ZSTD, frame),
        None => (RAW, bytes.to_vec()),
    }
}

/// The size `frame`'s header states (every frame [`pack`] writes does), bounded.
fn frame_size(frame: &[u8]) -> std::result::Result<usize, String> {
    let size = zstd::zstd_safe::get_frame_content_size(frame)
        .map_err(|_| "not a zstd frame".to_owned())?
        .ok_or_else(|| "a zstd frame without its size".to_owned())?;
    // A corrupt header must not make the reader allocate without bound.
    usize::try_from(size)
        .ok()
        .filter(|n| *n <= MAX_UNPACKED_BYTES)
        .ok_or_else(|| format!("a frame claiming {size} bytes"))
}

/// Runs `f` on the decompressed bytes of `frame`, held in this thread's
/// reused buffer (no allocation per value once it has grown).
fn with_decompressed<T>(
    frame: &[u8],
    f: impl FnOnce(&[u8]) -> T,
) -> std::result::Result<T, String> {
    let size = frame_size(frame)?;
    let dict = match zstd::zstd_safe::get_dict_id_from_frame(frame) {
        None => None,
        Some(id) => Some(BY_ID.read().get(&u32::from(id)).cloned().ok_or_else(|| {
            format!("made with dictionary {id}, which the database does not hold")
        })?),
    };
    with_codec(|c| {
        c.scratch.clear();
        c.scratch.reserve(size);
        let made = match &dict {
            Some(d) => c
                .dctx
                .decompress_using_ddict(&mut c.scratch, frame, &d.ddict)
                .map_err(|code| zstd::zstd_safe::get_error_name(code).to_owned()),
            None => c
                .decompress
                .decompress_to_buffer(frame, &mut c.scratch)
                .map_err(|e| e.to_string()),
        };
        match made {
            Ok(n) if n == size => Ok(f(&c.scratch)),
            Ok(n) => Err(format!("a frame of {n} bytes claiming {size}")),
            Err(e) => Err(e),
        }
    })
    .map_err(|e| e.to_string())?
}

/// Runs `parse` on the bytes of a stored text value (`what` names the
/// column for a corruption error): TEXT as it is, a BLOB decompressed into
/// a reused buffer. `parse` must validate UTF-8 (serde_json's readers do).
pub(crate) fn with_text<T>(
    what: &str,
    value: ValueRef<'_>,
    parse: impl FnOnce(&[u8]) -> Result<T>,
) -> Result<T> {
    match value {
        ValueRef::Text(t) => parse(t),
        ValueRef::Blob(b) => with_decompressed(b, parse)
            .map_err(|e| StoreError::corrupt(what, format!("compressed value: {e}")))?,
        other => Err(StoreError::corrupt(
            what,
            format!("a {:?} where text was expected", other.data_type()),
        )),
    }
}

/// The text of a stored value (`what` names the column for a corruption
/// error): TEXT as it is, a BLOB decompressed.
pub(crate) fn unpack(what: &str, value: ValueRef<'_>) -> Result<String> {
    with_text(what, value, |bytes| {
        String::from_utf8(bytes.to_vec()).map_err(|e| StoreError::corrupt(what, e.to_string()))
    })
}

/// [`unpack`] of a nullable column (NULL is `None`).
pub(crate) fn unpack_opt(what: &str, value: ValueRef<'_>) -> Result<Option<String>> {
    match value {
        ValueRef::Null => Ok(None),
        v => unpack(what, v).map(Some),
    }
}

/// The bytes of a stored opaque value of `codec`.
pub(crate) fn unpack_bytes(what: &str, codec: i64, stored: Vec<u8>) -> Result<Vec<u8>> {
    match codec {
        RAW => Ok(stored),
        ZSTD => with_decompressed(&stored, <[u8]>::to_vec)
            .map_err(|e| StoreError::corrupt(what, format!("compressed value: {e}"))),
        other => Err(StoreError::corrupt(what, format!("unknown codec {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_round_trips_through_a_smaller_frame_and_short_text_stays_text() {
        let long = "keel keeps every message durable. ".repeat(40);
        let packed = pack(long.clone(), None);
        let Value::Blob(frame) = &packed else {
            panic!("{packed:?}")
        };
        assert!(frame.len() < long.len() / 4);
        assert_eq!(unpack("t", ValueRef::Blob(frame)).unwrap(), long);
        assert_eq!(pack("short".into(), None), Value::Text("short".into()));
        assert_eq!(unpack("t", ValueRef::Text(b"old row")).unwrap(), "old row");
        assert_eq!(unpack_opt("t", ValueRef::Null).unwrap(), None);
        assert_eq!(pack_opt(None, None), Value::Null);
        let err = unpack("messages.content", ValueRef::Blob(b"not zstd")).unwrap_err();
        assert!(matches!(err, StoreError::Corruption { .. }), "{err:?}");
    }

    #[test]
    fn opaque_bytes_round_trip_with_their_codec_and_a_bad_frame_or_codec_is_corruption() {
        let state = br#"{"turn_index":7,"memory":{"project":"keel"}}"#.repeat(8);
        let (codec, stored) = pack_bytes(&state, None);
        assert_eq!(codec, ZSTD);
        assert!(stored.len() < state.len());
        assert_eq!(unpack_bytes("s", codec, stored).unwrap(), state);
        assert_eq!(pack_bytes(b"{}", None), (RAW, b"{}".to_vec()));
        assert_eq!(unpack_bytes("s", RAW, b"{}".to_vec()).unwrap(), b"{}");
        for (codec, bytes) in [(ZSTD, b"{}".to_vec()), (7, b"{}".to_vec())] {
            let err = unpack_bytes("state_blobs.bytes", codec, bytes).unwrap_err();
            assert!(matches!(err, StoreError::Corruption { .. }), "{err:?}");
        }
        // A frame cut short is refused, not read as a shorter value.
        let (_, mut frame) = pack_bytes(&state, None);
        frame.truncate(frame.len() - 4);
        let err = unpack_bytes("state_blobs.bytes", ZSTD, frame).unwrap_err();
        assert!(matches!(err, StoreError::Corruption { .. }), "{err:?}");
    }
}
