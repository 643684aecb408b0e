-- 3: copy-on-write history. Messages move from (session, seq) to
-- (timeline, seq); every existing session gets a root timeline whose id is
-- the session id, and its messages move there unchanged. SQLite rebuilds
-- `messages`; here it is altered to the same end schema (timeline_id is
-- the last column; session_id no longer references sessions).
CREATE TABLE timelines (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    parent_timeline_id TEXT REFERENCES timelines(id),
    fork_seq BIGINT,
    created_at BIGINT NOT NULL,
    CHECK ((parent_timeline_id IS NULL) = (fork_seq IS NULL)),
    CHECK (fork_seq IS NULL OR fork_seq >= 0)
);

CREATE INDEX idx_timelines_session ON timelines(session_id);
CREATE INDEX idx_timelines_parent ON timelines(parent_timeline_id);

INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, created_at)
SELECT id, id, NULL, NULL, created_at FROM sessions;

ALTER TABLE sessions ADD COLUMN head_timeline_id TEXT REFERENCES timelines(id);
UPDATE sessions SET head_timeline_id = id;

ALTER TABLE messages ADD COLUMN timeline_id TEXT REFERENCES timelines(id);
UPDATE messages SET timeline_id = session_id;
ALTER TABLE messages ALTER COLUMN timeline_id SET NOT NULL;
ALTER TABLE messages DROP CONSTRAINT messages_pkey;
ALTER TABLE messages ADD CONSTRAINT messages_pkey PRIMARY KEY (timeline_id, seq);
ALTER TABLE messages DROP CONSTRAINT messages_session_id_fkey;

CREATE TABLE checkpoints (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    timeline_id TEXT NOT NULL REFERENCES timelines(id),
    seq BIGINT NOT NULL,
    parent_checkpoint_id TEXT REFERENCES checkpoints(id) ON DELETE SET NULL,
    turn_index BIGINT NOT NULL,
    state_hash TEXT NOT NULL REFERENCES state_blobs(hash),
    source TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    CHECK (seq >= 0),
    CHECK (turn_index >= 0),
    CHECK (source IN ('turn', 'manual', 'rollback', 'fork'))
);

CREATE INDEX idx_checkpoints_session ON checkpoints(session_id);
CREATE INDEX idx_checkpoints_timeline ON checkpoints(timeline_id, seq);
CREATE INDEX idx_checkpoints_parent ON checkpoints(parent_checkpoint_id);
