-- 7: the runtime generation. Each process that activates a runtime on this
-- database bumps it in its activation transaction, so the runs, leases and
-- commits of an earlier process are told apart from the current one's.
CREATE TABLE runtime_state (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    generation INTEGER NOT NULL CHECK (generation >= 1),
    holder TEXT NOT NULL,
    activated_at INTEGER NOT NULL
);
