//! Large text stored compressed, per row, transparently to every reader.
//!
//! A value of at least [`MIN_PACKED_BYTES`] is stored as its zstd frame (a
//! BLOB) when that is smaller; anything else stays TEXT, as every row
//! written before compression existed. Readers take either: the storage
//! class says which (no flag column, no rewrite on upgrade).

use rusqlite::types::{Value, ValueRef};

use crate::error::{Result, StoreError};

/// Values shorter than this stay text: a frame's header would eat the gain.
pub(crate) const MIN_PACKED_BYTES: usize = 128;

/// zstd level: fast to write, most of the ratio of higher levels on prose.
const LEVEL: i32 = 3;

/// The most a stored frame may hold (far beyond any message keel accepts).
const MAX_UNPACKED_BYTES: usize = 64 << 20;

thread_local! {
    /// Each thread's compression and decompression contexts: creating one
    /// costs more than compressing a message.
    static CODEC: std::cell::RefCell<Option<(zstd::bulk::Compressor<'static>, zstd::bulk::Decompressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's contexts (made on first use).
fn with_codec<T>(
    f: impl FnOnce(
        &mut zstd::bulk::Compressor<'static>,
        &mut zstd::bulk::Decompressor<'static>,
    ) -> std::io::Result<T>,
) -> std::io::Result<T> {
    CODEC.with(|cell| {
        let mut codec = cell.borrow_mut();
        if codec.is_none() {
            *codec = Some((
                zstd::bulk::Compressor::new(LEVEL)?,
                zstd::bulk::Decompressor::new()?,
            ));
        }
        let (c, d) = codec.as_mut().expect("made above");
        f(c, d)
    })
}

/// The stored form of `text`: its zstd frame when that is smaller, else the text.
pub(crate) fn pack(text: String) -> Value {
    if text.len() < MIN_PACKED_BYTES {
        return Value::Text(text);
    }
    match with_codec(|c, _| c.compress(text.as_bytes())) {
        Ok(frame) if frame.len() < text.len() => Value::Blob(frame),
        Ok(_) => Value::Text(text),
        Err(e) => {
            // Compressing memory does not fail in practice; the text is kept.
            tracing::warn!(error = %e, "compressing a value failed; it is stored as text");
            Value::Text(text)
        }
    }
}

/// The decompressed bytes of `frame`, whose header states their size
/// (every frame [`pack`] writes does).
fn decompress(frame: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let size = zstd::zstd_safe::get_frame_content_size(frame)
        .map_err(|_| "not a zstd frame".to_owned())?
        .ok_or_else(|| "a zstd frame without its size".to_owned())?;
    // A corrupt header must not make the reader allocate without bound.
    let size = usize::try_from(size)
        .ok()
        .filter(|n| *n <= MAX_UNPACKED_BYTES)
        .ok_or_else(|| format!("a frame claiming {size} bytes"))?;
    with_codec(|_, d| d.decompress(frame, size)).map_err(|e| e.to_string())
}

/// The text of a stored value (`what` names the column for a corruption
/// error): TEXT as it is, a BLOB decompressed.
pub(crate) fn unpack(what: &str, value: ValueRef<'_>) -> Result<String> {
    match value {
        ValueRef::Text(t) => {
            String::from_utf8(t.to_vec()).map_err(|e| StoreError::corrupt(what, e.to_string()))
        }
        ValueRef::Blob(b) => {
            let bytes = decompress(b)
                .map_err(|e| StoreError::corrupt(what, format!("compressed value: {e}")))?;
            String::from_utf8(bytes).map_err(|e| StoreError::corrupt(what, e.to_string()))
        }
        other => Err(StoreError::corrupt(
            what,
            format!("a {:?} where text was expected", other.data_type()),
        )),
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
        let err = unpack("messages.content", ValueRef::Blob(b"not zstd")).unwrap_err();
        assert!(matches!(err, StoreError::Corruption { .. }), "{err:?}");
    }
}
