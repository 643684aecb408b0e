-- 3: copy-on-write history. Messages move from (session, seq) to
-- (timeline, seq); every existing session gets a root timeline whose id is
-- the session id, and its messages move there unchanged.
CREATE TABLE timelines (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    parent_timeline_id TEXT REFERENCES timelines(id),
    fork_seq INTEGER,
    created_at INTEGER NOT NULL,
    CHECK ((parent_timeline_id IS NULL) = (fork_seq IS NULL)),
    CHECK (fork_seq IS NULL OR fork_seq >= 0)
);

CREATE INDEX idx_timelines_session ON timelines(session_id);
CREATE INDEX idx_timelines_parent ON timelines(parent_timeline_id);

INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, created_at)
SELECT id, id, NULL, NULL, created_at FROM sessions;

ALTER TABLE sessions ADD COLUMN head_timeline_id TEXT REFERENCES timelines(id);
UPDATE sessions SET head_timeline_id = id;

CREATE TABLE messages_v3 (
    timeline_id TEXT NOT NULL REFERENCES timelines(id),
    seq INTEGER NOT NULL,
    session_id TEXT NOT NULL,
    slot TEXT NOT NULL DEFAULT 'default',
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    tool_call_id TEXT,
    tool_name TEXT,
    created_at INTEGER NOT NULL,
    CHECK (seq >= 1),
    CHECK (slot <> ''),
    CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    PRIMARY KEY (timeline_id, seq)
);

INSERT INTO messages_v3 (timeline_id, seq, session_id, slot, role, content,
                         tool_call_id, tool_name, created_at)
SELECT session_id, seq, session_id, slot, role, content, tool_call_id, tool_name, created_at
FROM messages;

DROP TABLE messages;
ALTER TABLE messages_v3 RENAME TO messages;

CREATE TABLE checkpoints (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    timeline_id TEXT NOT NULL REFERENCES timelines(id),
    seq INTEGER NOT NULL,
    parent_checkpoint_id TEXT REFERENCES checkpoints(id) ON DELETE SET NULL,
    turn_index INTEGER NOT NULL,
    state_hash TEXT NOT NULL REFERENCES state_blobs(hash),
    source TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    CHECK (seq >= 0),
    CHECK (turn_index >= 0),
    CHECK (source IN ('turn', 'manual', 'rollback', 'fork'))
);

CREATE INDEX idx_checkpoints_session ON checkpoints(session_id);
CREATE INDEX idx_checkpoints_timeline ON checkpoints(timeline_id, seq);
CREATE INDEX idx_checkpoints_parent ON checkpoints(parent_checkpoint_id);
