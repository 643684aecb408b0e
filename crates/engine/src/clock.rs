//! The time the orchestration paths stamp and compare (leases, backoff, the
//! inbox's fairness and time-to-live, signal rates): Unix milliseconds that
//! advance with tokio's clock. In production that is the wall clock read once
//! plus monotonic time since; under `tokio::time::pause` it advances with the
//! paused clock, so a test of a one-hour backoff takes no time and stays
//! deterministic.

use std::sync::OnceLock;

use tokio::time::Instant;

/// The wall clock and tokio's clock, read together once per process.
fn anchor() -> &'static (i64, std::time::Instant) {
    static ANCHOR: OnceLock<(i64, std::time::Instant)> = OnceLock::new();
    ANCHOR.get_or_init(|| (keel_core::time::now_ms(), std::time::Instant::now()))
}

/// Unix milliseconds now, advancing with tokio's clock.
pub(crate) fn now_ms() -> i64 {
    let (wall, at) = *anchor();
    let since = Instant::now()
        .into_std()
        .saturating_duration_since(at)
        .as_millis();
    wall.saturating_add(i64::try_from(since).unwrap_or(i64::MAX))
}

/// The tokio instant at Unix milliseconds `unix_ms` (now if it is past).
pub(crate) fn instant_at(unix_ms: i64) -> Instant {
    let ahead = u64::try_from(unix_ms.saturating_sub(now_ms())).unwrap_or(0);
    Instant::now() + std::time::Duration::from_millis(ahead)
}
