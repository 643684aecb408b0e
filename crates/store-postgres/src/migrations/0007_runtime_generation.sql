-- 7: the runtime generation. Each process that activates a runtime on this
-- database bumps it in its activation transaction, so the runs, leases and
-- commits of an earlier process are told apart from the current one's.
CREATE TABLE runtime_state (
    id BIGINT PRIMARY KEY CHECK (id = 1),
    generation BIGINT NOT NULL CHECK (generation >= 1),
    holder TEXT NOT NULL,
    activated_at BIGINT NOT NULL
);

-- A client that follows a root session reads what changed since the
-- revision it last saw.
CREATE INDEX idx_agent_runs_revision ON agent_runs(root_session_id, revision);
