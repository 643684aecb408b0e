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

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

use rusqlite::types::{Value, ValueRef};

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

/// One thread's zstd contexts and the buffer values are decompressed into.
struct Codec {
    compress: zstd::bulk::Compressor<'static>,
    decompress: zstd::bulk::Decompressor<'static>,
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
            scratch: Vec::new(),
        },
    };
    let out = f(&mut codec);
    CODEC.with(|cell| *cell.borrow_mut() = Some(codec));
    Ok(out)
}

/// `bytes`' zstd frame when compression is on, `bytes` is long enough and
/// the frame is smaller.
fn compress(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < MIN_PACKED_BYTES || !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    match with_codec(|c| c.compress.compress(bytes)).and_then(|r| r) {
        Ok(frame) if frame.len() < bytes.len() => Some(frame),
        Ok(_) => None,
        Err(e) => {
            // Compressing memory does not fail in practice; the value is kept as it is.
            tracing::warn!(error = %e, "compressing a value failed; it is stored uncompressed");
            None
        }
    }
}

/// The stored form of `text`: its zstd frame when that is smaller, else the text.
pub(crate) fn pack(text: String) -> Value {
    match compress(text.as_bytes()) {
        Some(frame) => Value::Blob(frame),
        None => Value::Text(text),
    }
}

/// [`pack`] of an optional text (NULL stays NULL).
pub(crate) fn pack_opt(text: Option<&str>) -> Value {
    text.map_or(Value::Null, |t| pack(t.to_owned()))
}

/// The stored form of opaque `bytes` with its codec ([`RAW`] or [`ZSTD`]).
pub(crate) fn pack_bytes(bytes: &[u8]) -> (i64, Vec<u8>) {
    match compress(bytes) {
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
    with_codec(|c| {
        c.scratch.clear();
        c.scratch.reserve(size);
        match c.decompress.decompress_to_buffer(frame, &mut c.scratch) {
            Ok(n) if n == size => Ok(f(&c.scratch)),
            Ok(n) => Err(format!("a frame of {n} bytes claiming {size}")),
            Err(e) => Err(e.to_string()),
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
        let packed = pack(long.clone());
        let Value::Blob(frame) = &packed else {
            panic!("{packed:?}")
        };
        assert!(frame.len() < long.len() / 4);
        assert_eq!(unpack("t", ValueRef::Blob(frame)).unwrap(), long);
        assert_eq!(pack("short".into()), Value::Text("short".into()));
        assert_eq!(unpack("t", ValueRef::Text(b"old row")).unwrap(), "old row");
        assert_eq!(unpack_opt("t", ValueRef::Null).unwrap(), None);
        assert_eq!(pack_opt(None), Value::Null);
        let err = unpack("messages.content", ValueRef::Blob(b"not zstd")).unwrap_err();
        assert!(matches!(err, StoreError::Corruption { .. }), "{err:?}");
    }

    #[test]
    fn opaque_bytes_round_trip_with_their_codec_and_a_bad_frame_or_codec_is_corruption() {
        let state = br#"{"turn_index":7,"memory":{"project":"keel"}}"#.repeat(8);
        let (codec, stored) = pack_bytes(&state);
        assert_eq!(codec, ZSTD);
        assert!(stored.len() < state.len());
        assert_eq!(unpack_bytes("s", codec, stored).unwrap(), state);
        assert_eq!(pack_bytes(b"{}"), (RAW, b"{}".to_vec()));
        assert_eq!(unpack_bytes("s", RAW, b"{}".to_vec()).unwrap(), b"{}");
        for (codec, bytes) in [(ZSTD, b"{}".to_vec()), (7, b"{}".to_vec())] {
            let err = unpack_bytes("state_blobs.bytes", codec, bytes).unwrap_err();
            assert!(matches!(err, StoreError::Corruption { .. }), "{err:?}");
        }
        // A frame cut short is refused, not read as a shorter value.
        let (_, mut frame) = pack_bytes(&state);
        frame.truncate(frame.len() - 4);
        let err = unpack_bytes("state_blobs.bytes", ZSTD, frame).unwrap_err();
        assert!(matches!(err, StoreError::Corruption { .. }), "{err:?}");
    }
}
