//! Small conversions shared by the domain modules: text on disk to typed
//! values (unknown text is corruption, never a default), integer casts,
//! hashing, fresh ids.

use std::str::FromStr;

use keel_store::{Result, StoreError};
use sha2::{Digest, Sha256};

/// Parses text read from column `what`; anything unparseable is corruption.
pub(crate) fn parse<T>(what: &str, text: &str) -> Result<T>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    text.parse().map_err(|e| StoreError::corrupt(what, e))
}

/// Like [`parse`] for a nullable column.
pub(crate) fn parse_opt<T>(what: &str, text: Option<String>) -> Result<Option<T>>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    text.map(|t| parse(what, &t)).transpose()
}

/// A non-negative integer column as `u64`.
pub(crate) fn non_negative(what: &str, v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| StoreError::corrupt(what, format!("negative value {v}")))
}

/// A caller's count as PostgreSQL's BIGINT.
pub(crate) fn to_i64(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| StoreError::InvalidInput(format!("{what} {v} is too large")))
}

/// A token count as a BIGINT: absurd usage saturates rather than failing the commit.
pub(crate) fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Hex SHA-256 of `bytes`: the key of a state blob.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// A fresh opaque id for store-internal rows (timelines, lease tokens).
pub(crate) fn fresh_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// Rows to fetch for a page of `limit` (one more tells whether a next page
/// exists); a limit outside 1..=1000 is refused.
pub(crate) fn page_fetch(limit: usize) -> Result<i64> {
    if limit == 0 || limit > 1000 {
        return Err(StoreError::InvalidInput(format!(
            "limit {limit} is outside 1..=1000"
        )));
    }
    Ok(i64::try_from(limit + 1).unwrap_or(i64::MAX))
}
