//! What the store reports to the `metrics` facade (a no-op until a
//! recorder is installed; `keel serve` installs the Prometheus one).

use std::time::Duration;

/// One write transaction ended: how long it held the write lock (BEGIN to
/// COMMIT or ROLLBACK) and how many requests it carried.
pub(crate) fn transaction(elapsed: Duration, requests: usize) {
    metrics::histogram!("keel_store_commit_duration_seconds").record(elapsed.as_secs_f64());
    // Exact for any batch the writer forms (at most `max_batch`, 256 by default).
    #[allow(clippy::cast_precision_loss)]
    metrics::histogram!("keel_store_commit_batch_size").record(requests as f64);
}
