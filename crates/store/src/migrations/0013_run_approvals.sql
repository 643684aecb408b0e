-- 13: a background run can wait for a person. A run whose model called a
-- tool needing approval ends its runner and waits as 'waiting_approval', a
-- new non-terminal status (agent_runs is rebuilt with the wider CHECK, rows,
-- ids and indexes unchanged); what it did so far is kept in
-- agent_run_pauses until it resumes or ends; its approvals name it
-- (tool_approvals is rebuilt: run_id, and uniqueness per turn and run).
-- keel: foreign keys off for this step (checked before it commits)
CREATE TABLE agent_runs_v13 (
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
                      'budget_exhausted', 'waiting_approval')),
    CHECK (depth >= 1),
    CHECK (completion_slot_reserved IN (0, 1)),
    CHECK (signal_delivery IS NULL OR signal_delivery IN ('queue', 'steer')),
    CHECK (completion_delivery IS NULL OR completion_delivery IN ('queue', 'steer')),
    CHECK (failure_delivery IS NULL OR failure_delivery IN ('queue', 'steer')),
    FOREIGN KEY (group_id) REFERENCES agent_run_groups(id) ON DELETE RESTRICT,
    FOREIGN KEY (parent_run_id) REFERENCES agent_runs(id) ON DELETE RESTRICT
);

INSERT INTO agent_runs_v13 (id, group_id, root_session_id, root_turn_id, parent_run_id, caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, task, context_json, budget_json, signal_contract_json, signal_delivery, completion_delivery, failure_delivery, status, result, error, prompt_tokens, completion_tokens, cost, tool_calls_count, iterations, runtime_generation, attempt, completion_slot_reserved, deadline_at, revision, started_at, finished_at, created_at, updated_at)
SELECT id, group_id, root_session_id, root_turn_id, parent_run_id, caller_agent_id, caller_scope_id, idempotency_key, agent_id, definition_hash, provider_profile, provider_name, model_id, mode, depth, plan_item_id, execution_id, task, context_json, budget_json, signal_contract_json, signal_delivery, completion_delivery, failure_delivery, status, result, error, prompt_tokens, completion_tokens, cost, tool_calls_count, iterations, runtime_generation, attempt, completion_slot_reserved, deadline_at, revision, started_at, finished_at, created_at, updated_at
FROM agent_runs;

DROP TABLE agent_runs;
ALTER TABLE agent_runs_v13 RENAME TO agent_runs;

CREATE UNIQUE INDEX idx_agent_runs_execution ON agent_runs(execution_id);

CREATE UNIQUE INDEX idx_agent_runs_idempotency
    ON agent_runs(root_session_id, caller_scope_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE INDEX idx_agent_runs_session_created ON agent_runs(root_session_id, created_at DESC, id DESC);
CREATE INDEX idx_agent_runs_parent ON agent_runs(parent_run_id, created_at);
CREATE INDEX idx_agent_runs_group ON agent_runs(group_id);
CREATE INDEX idx_agent_runs_recovery ON agent_runs(runtime_generation, status, deadline_at);
CREATE INDEX idx_agent_runs_revision ON agent_runs(root_session_id, revision);

CREATE TABLE tool_approvals_v13 (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    turn_id TEXT NOT NULL,
    run_id TEXT REFERENCES agent_runs(id),
    agent_id TEXT NOT NULL,
    tool_call_id TEXT NOT NULL,
    tool_name TEXT NOT NULL,
    arguments TEXT NOT NULL,
    status TEXT NOT NULL,
    always INTEGER NOT NULL DEFAULT 0,
    reason TEXT,
    revision INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    decided_at INTEGER,
    executing_at INTEGER,
    settled_at INTEGER,
    CHECK (status IN ('pending', 'approved', 'denied', 'expired', 'superseded')),
    CHECK (always IN (0, 1)),
    CHECK ((status = 'pending') = (decided_at IS NULL)),
    CHECK (executing_at IS NULL OR status = 'approved')
);

INSERT INTO tool_approvals_v13 (id, session_id, turn_id, run_id, agent_id, tool_call_id, tool_name, arguments, status, always, reason, revision, created_at, expires_at, decided_at, executing_at, settled_at)
SELECT id, session_id, turn_id, NULL, agent_id, tool_call_id, tool_name, arguments, status, always, reason, revision, created_at, expires_at, decided_at, executing_at, settled_at
FROM tool_approvals;

DROP TABLE tool_approvals;
ALTER TABLE tool_approvals_v13 RENAME TO tool_approvals;

CREATE UNIQUE INDEX idx_tool_approvals_call
    ON tool_approvals(session_id, turn_id, coalesce(run_id, ''), tool_call_id);
CREATE INDEX idx_tool_approvals_session ON tool_approvals(session_id, status, created_at);
CREATE INDEX idx_tool_approvals_unsettled ON tool_approvals(session_id, settled_at);
CREATE INDEX idx_tool_approvals_run ON tool_approvals(run_id) WHERE run_id IS NOT NULL;

-- What a paused run did so far: its conversation after the system prompt
-- (JSON messages), what its model calls spent and how long it had left.
CREATE TABLE agent_run_pauses (
    run_id TEXT PRIMARY KEY REFERENCES agent_runs(id),
    session_id TEXT NOT NULL REFERENCES sessions(id),
    messages TEXT NOT NULL CHECK (json_valid(messages)),
    prompt_tokens INTEGER NOT NULL CHECK (prompt_tokens >= 0),
    completion_tokens INTEGER NOT NULL CHECK (completion_tokens >= 0),
    iterations INTEGER NOT NULL CHECK (iterations >= 0),
    tool_calls INTEGER NOT NULL CHECK (tool_calls >= 0),
    remaining_ms INTEGER NOT NULL CHECK (remaining_ms >= 0),
    paused_at INTEGER NOT NULL
);
CREATE INDEX idx_agent_run_pauses_session ON agent_run_pauses(session_id);
