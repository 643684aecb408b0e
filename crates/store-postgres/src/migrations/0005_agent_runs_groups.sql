-- 5: durable sub-agent runs and the groups of a batch delegation.
CREATE TABLE agent_run_groups (
    id TEXT PRIMARY KEY,
    root_session_id TEXT NOT NULL,
    caller_run_id TEXT,
    caller_scope_id TEXT NOT NULL,
    idempotency_key TEXT,
    mode TEXT NOT NULL,
    completion_policy TEXT NOT NULL,
    expected_runs BIGINT NOT NULL,
    terminal_runs BIGINT NOT NULL DEFAULT 0,
    abnormal_runs BIGINT NOT NULL DEFAULT 0,
    completion_slot_reserved BIGINT NOT NULL DEFAULT 0,
    completion_delivery TEXT,
    failure_delivery TEXT,
    deadline_at BIGINT NOT NULL,
    status TEXT NOT NULL,
    runtime_generation BIGINT NOT NULL,
    revision BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    finished_at BIGINT,
    CHECK (mode IN ('foreground', 'background')),
    CHECK (completion_policy IN ('all', 'each')),
    CHECK (status IN ('queued', 'running', 'completed', 'partial', 'failed',
                      'timed_out', 'cancelled', 'interrupted')),
    CHECK (expected_runs > 0),
    CHECK (terminal_runs >= 0 AND terminal_runs <= expected_runs),
    CHECK (abnormal_runs >= 0 AND abnormal_runs <= terminal_runs),
    CHECK (completion_slot_reserved IN (0, 1)),
    CHECK (completion_delivery IS NULL OR completion_delivery IN ('queue', 'steer')),
    CHECK (failure_delivery IS NULL OR failure_delivery IN ('queue', 'steer'))
);

CREATE INDEX idx_agent_groups_session_created
    ON agent_run_groups(root_session_id, created_at DESC);

CREATE UNIQUE INDEX idx_agent_groups_idempotency
    ON agent_run_groups(root_session_id, caller_scope_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE TABLE agent_runs (
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
    depth BIGINT NOT NULL,
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
    prompt_tokens BIGINT,
    completion_tokens BIGINT,
    cost DOUBLE PRECISION,
    tool_calls_count BIGINT NOT NULL DEFAULT 0,
    iterations BIGINT NOT NULL DEFAULT 0,
    runtime_generation BIGINT NOT NULL,
    attempt BIGINT NOT NULL DEFAULT 1,
    completion_slot_reserved BIGINT NOT NULL DEFAULT 0,
    deadline_at BIGINT NOT NULL,
    revision BIGINT NOT NULL,
    started_at BIGINT,
    finished_at BIGINT,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    CHECK (mode IN ('foreground', 'background')),
    CONSTRAINT agent_runs_status_check
        CHECK (status IN ('queued', 'running', 'waiting_children', 'completed',
                          'failed', 'timed_out', 'cancelled', 'interrupted')),
    CHECK (depth >= 1),
    CHECK (completion_slot_reserved IN (0, 1)),
    CHECK (signal_delivery IS NULL OR signal_delivery IN ('queue', 'steer')),
    CHECK (completion_delivery IS NULL OR completion_delivery IN ('queue', 'steer')),
    CHECK (failure_delivery IS NULL OR failure_delivery IN ('queue', 'steer')),
    FOREIGN KEY (group_id) REFERENCES agent_run_groups(id) ON DELETE RESTRICT,
    FOREIGN KEY (parent_run_id) REFERENCES agent_runs(id) ON DELETE RESTRICT
);

CREATE UNIQUE INDEX idx_agent_runs_execution ON agent_runs(execution_id);

CREATE UNIQUE INDEX idx_agent_runs_idempotency
    ON agent_runs(root_session_id, caller_scope_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE INDEX idx_agent_runs_session_created ON agent_runs(root_session_id, created_at DESC, id DESC);
CREATE INDEX idx_agent_runs_parent ON agent_runs(parent_run_id, created_at);
CREATE INDEX idx_agent_runs_group ON agent_runs(group_id);
CREATE INDEX idx_agent_runs_recovery ON agent_runs(runtime_generation, status, deadline_at);
