-- 1: dialogs (sessions) and their append-only messages.
-- PostgreSQL translation of keel-store's step 1: INTEGER is BIGINT (keel
-- stores every integer as an i64), TEXT stays TEXT.
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    channel TEXT NOT NULL,
    chat_id TEXT NOT NULL,
    dialog_id TEXT NOT NULL,
    title TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    last_active_at BIGINT NOT NULL,
    message_count BIGINT NOT NULL DEFAULT 0,
    deleted_at BIGINT,
    CHECK (channel <> '' AND chat_id <> '' AND dialog_id <> ''),
    CHECK (message_count >= 0),
    UNIQUE (channel, chat_id, dialog_id)
);

CREATE INDEX idx_sessions_chat ON sessions(channel, chat_id, deleted_at);

CREATE TABLE messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    slot TEXT NOT NULL DEFAULT 'default',
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    tool_call_id TEXT,
    tool_name TEXT,
    created_at BIGINT NOT NULL,
    CHECK (seq >= 1),
    CHECK (slot <> ''),
    CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    PRIMARY KEY (session_id, seq)
);
