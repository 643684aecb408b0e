-- 4: hidden messages (continuation triggers), turn origin, and the durable
-- delivery context of a session.
ALTER TABLE messages ADD COLUMN client_visibility TEXT NOT NULL DEFAULT 'visible'
    CHECK (client_visibility IN ('visible', 'hidden'));
ALTER TABLE messages ADD COLUMN turn_origin TEXT NOT NULL DEFAULT 'user'
    CHECK (turn_origin IN ('user', 'agent_continuation', 'system'));

-- No index on client_visibility: visible-only loads walk the primary key
-- (timeline_id, seq) like every other load, and hidden rows are few. An
-- index here would only add a page to every append's commit.

ALTER TABLE sessions ADD COLUMN delivery_context TEXT;
ALTER TABLE sessions ADD COLUMN delivery_context_updated_at INTEGER;
