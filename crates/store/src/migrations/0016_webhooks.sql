-- 16: webhooks. A send that names a webhook commits its subscription with
-- its queued input (Store::queue_input); the turn's start binds it to the
-- input's seq (Store::open_turn); the commit that answers the input turns it
-- into a delivery (Store::commit_turn), with one delivery per configured
-- server-wide URL, in the same transaction: no crash window loses one.
-- The subscription stays (`used_at` set) so that the background runs that
-- turn started notify the same URL when they end (in their terminal
-- commit's transaction).
CREATE TABLE webhook_subscriptions (
    turn_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    url TEXT NOT NULL,
    timeline_id TEXT,
    input_seq INTEGER,
    created_at INTEGER NOT NULL,
    used_at INTEGER,
    CHECK ((timeline_id IS NULL) = (input_seq IS NULL)),
    CHECK (used_at IS NULL OR timeline_id IS NOT NULL)
);

CREATE INDEX idx_webhook_subscriptions_input
    ON webhook_subscriptions(timeline_id, input_seq) WHERE timeline_id IS NOT NULL;

-- The outbox: one row per (event, URL), its body rendered once and fixed.
-- The gateway's worker POSTs due rows, at least once; `id` is the
-- `webhook-id` a receiver deduplicates by.
CREATE TABLE webhook_deliveries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    url TEXT NOT NULL,
    event TEXT NOT NULL CHECK (event IN ('turn.completed', 'run.completed')),
    session_id TEXT NOT NULL,
    turn_id TEXT,
    run_id TEXT,
    body TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at INTEGER,
    last_error TEXT,
    created_at INTEGER NOT NULL,
    delivered_at INTEGER,
    CHECK ((status = 'pending') = (next_attempt_at IS NOT NULL)),
    CHECK ((status = 'delivered') = (delivered_at IS NOT NULL))
);

CREATE INDEX idx_webhook_deliveries_due
    ON webhook_deliveries(next_attempt_at) WHERE status = 'pending';
CREATE INDEX idx_webhook_deliveries_status ON webhook_deliveries(status, seq);
