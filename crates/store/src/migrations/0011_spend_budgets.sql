-- 11: spend budgets. A run a budget stopped ends 'budget_exhausted', a
-- new terminal status: agent_runs is rebuilt with the wider CHECK (SQLite
-- cannot alter a constraint), rows, ids and indexes unchanged. Inbox
-- events and child runs point at the table while it is swapped, so:
-- keel: foreign keys off for this step (checked before it commits)
-- The 10th step is reserved for tool-call approvals (another branch).
CREATE TABLE agent_runs_v11 (
    id TEXT PRIMARY KEY,
    group_id TEXT,
    root_session_id TEXT NOT NULL,
    root_turn_id TEXT,
    parent_run_id TEXT,
    caller_agent_id TEXT NOT NULL,
    caller_scope_id TEXT NOT NULL,
    idempotency_key TEXT,
    agent_id TEXT NOT NULL,
    definition_hash TEXT NOT NULL,
    provider_profile TEXT NOT NULL,
    provider_name TEXT NOT NULL,
    model_id TEXT NOT NULL,
    mode TEXT NOT NULL,
    depth INTEGER NOT NULL,
    plan_item_id TEXT,
    execution_id TEXT NOT NULL,
    task TEXT NOT NULL,
    context_json TEXT,
    budget_json TEXT NOT NULL,
    signal_contract_json TEXT,
    signal_delivery TEXT,
    completion_delivery TEXT,
    failure_delivery TEXT,
    status TEXT NOT NULL,
    result TEXT,
    error TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    cost REAL,
    tool_calls_count INTEGER NOT NULL DEFAULT 0,
    iterations INTEGER NOT NULL DEFAULT 0,
    runtime_generation INTEGER NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 1,
    completion_slot_reserved INTEGER NOT NULL DEFAULT 0,
    deadline_at INTEGER NOT NULL,
    revision INTEGER NOT NULL,
    started_at INTEGER,
    finished_at INTEGER,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    CHECK (mode IN ('foreground', 'background')),
    CHECK (status IN ('queued', 'running', 'waiting_children', 'completed',
                      'failed', 'timed_out', 'cancelled', 'interrupted',
                      'budget_exhausted')),
    CHECK (depth >= 1),
    CHECK (completion_slot_reserved IN (0, 1)),
    CHECK (signal_delivery IS NULL OR signal_delivery IN ('queue', 'steer')),
    CHECK (completion_delivery IS NULL OR completion_delivery IN ('queue', 'steer')),
    CHECK (failure_delivery IS NULL OR failure_delivery IN ('queue', 'steer')),
    FOREIGN KEY (group_id) REFERENCES agent_run_groups(id) ON DELETE RESTRICT,
    FOREIGN KEY (parent_run_id) REFERENCES agent_runs(id) ON DELETE RESTRICT
);

INSERT INTO agent_runs_v11 (id, group_id, root_session_id, root_turn_id, parent_run_id, caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, task, context_json, budget_json, signal_contract_json, signal_delivery, completion_delivery, failure_delivery, status, result, error, prompt_tokens, completion_tokens, cost, tool_calls_count, iterations, runtime_generation, attempt, completion_slot_reserved, deadline_at, revision, started_at, finished_at, created_at, updated_at)
SELECT id, group_id, root_session_id, root_turn_id, parent_run_id, caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, task, context_json, budget_json, signal_contract_json, signal_delivery, completion_delivery, failure_delivery, status, result, error, prompt_tokens, completion_tokens, cost, tool_calls_count, iterations, runtime_generation, attempt, completion_slot_reserved, deadline_at, revision, started_at, finished_at, created_at, updated_at
FROM agent_runs;

DROP TABLE agent_runs;
ALTER TABLE agent_runs_v11 RENAME TO agent_runs;

CREATE UNIQUE INDEX idx_agent_runs_execution ON agent_runs(execution_id);

CREATE UNIQUE INDEX idx_agent_runs_idempotency
    ON agent_runs(root_session_id, caller_scope_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE INDEX idx_agent_runs_session_created ON agent_runs(root_session_id, created_at DESC, id DESC);
CREATE INDEX idx_agent_runs_parent ON agent_runs(parent_run_id, created_at);
CREATE INDEX idx_agent_runs_group ON agent_runs(group_id);
CREATE INDEX idx_agent_runs_recovery ON agent_runs(runtime_generation, status, deadline_at);
CREATE INDEX idx_agent_runs_revision ON agent_runs(root_session_id, revision);

-- What a dialog spent on model calls: every call's reported usage and its
-- cost at its profile's prices, added when the call returns (a failed or
-- cancelled turn's calls count too). It is never rolled back: a rollback or
-- a restart does not give a dialog its budget back.
CREATE TABLE dialog_spend (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cost_usd REAL NOT NULL DEFAULT 0,
    model_calls INTEGER NOT NULL DEFAULT 0,
    updated_at INTEGER NOT NULL,
    CHECK (prompt_tokens >= 0 AND completion_tokens >= 0 AND model_calls >= 0),
    CHECK (cost_usd >= 0)
);
