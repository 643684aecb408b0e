-- 2: the session tree (parent/child sessions, agent) and the session's
-- mutable state ("session memory"), stored content-addressed.
CREATE TABLE state_blobs (
    hash TEXT PRIMARY KEY,
    bytes BYTEA NOT NULL,
    CHECK (length(hash) = 64)
);

ALTER TABLE sessions ADD COLUMN agent_id TEXT;
ALTER TABLE sessions ADD COLUMN parent_id TEXT REFERENCES sessions(id) ON DELETE SET NULL;
ALTER TABLE sessions ADD COLUMN state_hash TEXT REFERENCES state_blobs(hash);

CREATE INDEX idx_sessions_parent ON sessions(parent_id, created_at);
