-- 18: several processes on one database. Each live process has a row
-- here, keyed by the runtime generation it activated (its fencing epoch),
-- renewed while it runs; a process whose row expired is recovered by
-- another, which deletes the row, and from then on every write of the dead
-- one is refused. A session's turns run under its lease (one holder at a
-- time); `last_generation` tells a process that takes the lease whether
-- another wrote the session since it last held it. Acknowledged inputs
-- carry the generation that will run them, so a live process's queue is
-- never taken by another.
--
-- On SQLite one process owns the file (its runtime lock) and serializes
-- the turns itself: the two tables stay empty there and only the queue's
-- generation is written. PostgreSQL uses all three.
CREATE TABLE runtime_processes (
    generation INTEGER PRIMARY KEY CHECK (generation >= 1),
    holder TEXT NOT NULL,
    started_at INTEGER NOT NULL,
    -- Unix ms (the database server's clock on PostgreSQL).
    expires_at INTEGER NOT NULL,
    -- An advisory lock key the process holds while its connection to the
    -- server lives (PostgreSQL): a process killed outright is known dead
    -- at once, not only when its registration expires.
    presence INTEGER
);

CREATE TABLE session_leases (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
    -- The process holding it now; NULL when free.
    generation INTEGER,
    -- The process that held it last (the holder, while held).
    last_generation INTEGER NOT NULL,
    acquired_at INTEGER NOT NULL
);

CREATE INDEX idx_session_leases_generation ON session_leases(generation);

ALTER TABLE queued_inputs ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
