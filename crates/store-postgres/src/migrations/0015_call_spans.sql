-- 15: the timing of each model call and tool call of a root turn or a run.
CREATE TABLE call_spans (
    session_id TEXT NOT NULL,
    turn_id TEXT,
    run_id TEXT,
    seq BIGINT NOT NULL CHECK (seq >= 0),
    kind TEXT NOT NULL CHECK (kind IN ('model', 'tool')),
    name TEXT NOT NULL,
    call_id TEXT,
    started_at BIGINT NOT NULL,
    ended_at BIGINT NOT NULL CHECK (ended_at >= started_at),
    input_tokens BIGINT CHECK (input_tokens >= 0),
    output_tokens BIGINT CHECK (output_tokens >= 0),
    status TEXT NOT NULL,
    CHECK ((turn_id IS NULL) <> (run_id IS NULL))
);
CREATE INDEX call_spans_session ON call_spans(session_id);
CREATE INDEX call_spans_turn ON call_spans(turn_id, seq) WHERE turn_id IS NOT NULL;
CREATE INDEX call_spans_run ON call_spans(run_id, seq) WHERE run_id IS NOT NULL;
