-- 11: spend budgets. A run a budget stopped ends 'budget_exhausted', a new
-- terminal status. SQLite rebuilds agent_runs for the wider CHECK; here the
-- constraint is replaced, rows, ids and indexes unchanged.
ALTER TABLE agent_runs DROP CONSTRAINT agent_runs_status_check;
ALTER TABLE agent_runs ADD CONSTRAINT agent_runs_status_check
    CHECK (status IN ('queued', 'running', 'waiting_children', 'completed',
                      'failed', 'timed_out', 'cancelled', 'interrupted',
                      'budget_exhausted'));

-- What a dialog spent on model calls; never rolled back.
CREATE TABLE dialog_spend (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
    model_calls BIGINT NOT NULL DEFAULT 0,
    updated_at BIGINT NOT NULL,
    CHECK (prompt_tokens >= 0 AND completion_tokens >= 0 AND model_calls >= 0),
    CHECK (cost_usd >= 0)
);
