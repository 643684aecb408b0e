//! Wall-clock timestamps as Unix milliseconds, the one time unit keel stores.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        // A clock before 1970 is a misconfigured machine; 0 keeps ordering sane.
        .unwrap_or(0)
}
