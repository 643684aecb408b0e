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

/// The stored form of `text`: its zstd frame when that is smaller, else the text.
pub(crate) fn pack(text: String) -> Value {
    if text.len() < MIN_PACKED_BYTES {
        return Value::Text(text);
    }
    match zstd::bulk::compress(text.as_bytes(), LEVEL) {
        Ok(frame) if frame.len() < text.len() => Value::Blob(frame),
        Ok(_) => Value::Text(text),
        Err(e) => {
            // Compressing memory does not fail in practice; the text is kept.
            tracing::warn!(error = %e, "compressing a value failed; it is stored as text");
            Value::Text(text)
        }
    }
}

/// The text of a stored value (`what` names the column for a corruption
/// error): TEXT as it is, a BLOB decompressed.
pub(crate) fn unpack(what: &str, value: ValueRef<'_>) -> Result<String> {
    match value {
        ValueRef::Text(t) => {
            String::from_utf8(t.to_vec()).map_err(|e| StoreError::corrupt(what, e.to_string()))
        }
        ValueRef::Blob(b) => {
            let bytes = zstd::stream::decode_all(b)
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
