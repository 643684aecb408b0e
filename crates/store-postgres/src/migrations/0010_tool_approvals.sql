-- 10: tool calls waiting for a person's decision, and the tools a dialog
-- approved for good. A paused root turn inserts one 'pending' row per gated
-- call in the transaction that commits what the turn did so far. A decision
-- (approved, denied, expired) is committed on the row; the turn's work
-- resumes once every row of that turn is decided: `executing_at` is set
-- before an approved tool runs (so it never runs twice) and `settled_at`
-- when its result is in the history. 'superseded' rows were pending when
-- the user sent new input; their denial is in the history already.
CREATE TABLE tool_approvals (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    turn_id TEXT NOT NULL,
    agent_id TEXT NOT NULL,
    tool_call_id TEXT NOT NULL,
    tool_name TEXT NOT NULL,
    arguments TEXT NOT NULL,
    status TEXT NOT NULL,
    always BIGINT NOT NULL DEFAULT 0,
    reason TEXT,
    revision BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    decided_at BIGINT,
    executing_at BIGINT,
    settled_at BIGINT,
    CHECK (status IN ('pending', 'approved', 'denied', 'expired', 'superseded')),
    CHECK (always IN (0, 1)),
    CHECK ((status = 'pending') = (decided_at IS NULL)),
    CHECK (executing_at IS NULL OR status = 'approved'),
    CONSTRAINT tool_approvals_call_key UNIQUE (session_id, turn_id, tool_call_id)
);

CREATE INDEX idx_tool_approvals_session ON tool_approvals(session_id, status, created_at);
CREATE INDEX idx_tool_approvals_unsettled ON tool_approvals(session_id, settled_at);

CREATE TABLE tool_approval_grants (
    session_id TEXT NOT NULL REFERENCES sessions(id),
    tool_name TEXT NOT NULL,
    approval_id TEXT NOT NULL REFERENCES tool_approvals(id),
    granted_at BIGINT NOT NULL,
    PRIMARY KEY (session_id, tool_name)
);
