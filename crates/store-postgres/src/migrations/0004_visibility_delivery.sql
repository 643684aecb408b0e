-- 4: hidden messages (continuation triggers), turn origin, and the durable
-- delivery context of a session.
ALTER TABLE messages ADD COLUMN client_visibility TEXT NOT NULL DEFAULT 'visible'
    CHECK (client_visibility IN ('visible', 'hidden'));
ALTER TABLE messages ADD COLUMN turn_origin TEXT NOT NULL DEFAULT 'user'
    CHECK (turn_origin IN ('user', 'agent_continuation', 'system'));

ALTER TABLE sessions ADD COLUMN delivery_context TEXT;
ALTER TABLE sessions ADD COLUMN delivery_context_updated_at BIGINT;
