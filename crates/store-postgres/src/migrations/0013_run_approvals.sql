-- 13: a background run can wait for a person ('waiting_approval', a new
-- non-terminal status); what it did so far is kept in agent_run_pauses;
-- its approvals name it (run_id, and uniqueness per turn and run). SQLite
-- rebuilds agent_runs and tool_approvals; here they are altered to the
-- same end schema (run_id is tool_approvals' last column).
ALTER TABLE agent_runs DROP CONSTRAINT agent_runs_status_check;
ALTER TABLE agent_runs ADD CONSTRAINT agent_runs_status_check
    CHECK (status IN ('queued', 'running', 'waiting_children', 'completed',
                      'failed', 'timed_out', 'cancelled', 'interrupted',
                      'budget_exhausted', 'waiting_approval'));

ALTER TABLE tool_approvals ADD COLUMN run_id TEXT REFERENCES agent_runs(id);
ALTER TABLE tool_approvals DROP CONSTRAINT tool_approvals_call_key;

CREATE UNIQUE INDEX idx_tool_approvals_call
    ON tool_approvals(session_id, turn_id, coalesce(run_id, ''), tool_call_id);
CREATE INDEX idx_tool_approvals_run ON tool_approvals(run_id) WHERE run_id IS NOT NULL;

-- What a paused run did so far.
CREATE TABLE agent_run_pauses (
    run_id TEXT PRIMARY KEY REFERENCES agent_runs(id),
    session_id TEXT NOT NULL REFERENCES sessions(id),
    messages TEXT NOT NULL CHECK (keel_json_valid(messages)),
    prompt_tokens BIGINT NOT NULL CHECK (prompt_tokens >= 0),
    completion_tokens BIGINT NOT NULL CHECK (completion_tokens >= 0),
    iterations BIGINT NOT NULL CHECK (iterations >= 0),
    tool_calls BIGINT NOT NULL CHECK (tool_calls >= 0),
    remaining_ms BIGINT NOT NULL CHECK (remaining_ms >= 0),
    paused_at BIGINT NOT NULL
);
CREATE INDEX idx_agent_run_pauses_session ON agent_run_pauses(session_id);
