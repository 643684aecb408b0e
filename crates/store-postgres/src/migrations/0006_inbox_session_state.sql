-- 6: the durable agent inbox and the per-root-session capacity/revision row.
CREATE TABLE agent_session_state (
    root_session_id TEXT PRIMARY KEY,
    revision BIGINT NOT NULL DEFAULT 0,
    pending_event_count BIGINT NOT NULL DEFAULT 0,
    reserved_completion_slots BIGINT NOT NULL DEFAULT 0,
    updated_at BIGINT NOT NULL,
    CHECK (revision >= 0),
    CHECK (pending_event_count >= 0),
    CHECK (reserved_completion_slots >= 0)
);

CREATE TABLE agent_inbox_events (
    id TEXT PRIMARY KEY,
    root_session_id TEXT NOT NULL,
    scope_kind TEXT NOT NULL,
    scope_id TEXT NOT NULL,
    run_id TEXT,
    group_id TEXT,
    event_type TEXT NOT NULL,
    event_key TEXT NOT NULL,
    delivery TEXT NOT NULL,
    requires_continuation BIGINT NOT NULL DEFAULT 1,
    severity TEXT,
    payload_json TEXT NOT NULL,
    status TEXT NOT NULL,
    attempt_count BIGINT NOT NULL DEFAULT 0,
    lease_token TEXT,
    lease_until BIGINT,
    next_attempt_at BIGINT,
    admitted_turn_id TEXT,
    last_error TEXT,
    revision BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    consumed_at BIGINT,
    superseded_at BIGINT,
    dead_lettered_at BIGINT,
    fallback_notified_at BIGINT,
    fallback_suppressed_reason TEXT,
    CHECK (scope_kind IN ('run', 'group')),
    CHECK (event_type IN ('signal', 'completion', 'group_completion')),
    CHECK (delivery IN ('queue', 'steer')),
    CHECK (requires_continuation IN (0, 1)),
    CHECK (status IN ('pending', 'leased', 'admitted', 'consumed',
                      'superseded', 'dead_letter')),
    CHECK (
        (scope_kind = 'run' AND run_id IS NOT NULL AND group_id IS NULL
            AND scope_id = run_id) OR
        (scope_kind = 'group' AND group_id IS NOT NULL AND run_id IS NULL
            AND scope_id = group_id)
    ),
    CHECK (attempt_count >= 0),
    CHECK (status NOT IN ('leased', 'admitted')
           OR (lease_token IS NOT NULL AND lease_until IS NOT NULL)),
    UNIQUE (scope_kind, scope_id, event_type, event_key),
    FOREIGN KEY (run_id) REFERENCES agent_runs(id) ON DELETE RESTRICT,
    FOREIGN KEY (group_id) REFERENCES agent_run_groups(id) ON DELETE RESTRICT
);

CREATE INDEX idx_agent_inbox_claim
    ON agent_inbox_events(root_session_id, status, next_attempt_at, created_at);
CREATE INDEX idx_agent_inbox_lease ON agent_inbox_events(status, lease_until);
CREATE INDEX idx_agent_inbox_revision ON agent_inbox_events(root_session_id, revision);
