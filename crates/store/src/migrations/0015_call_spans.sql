-- The timing of each model call and tool call of a root turn or a run:
-- what the trace view draws under a turn or run. Written in the same
-- transaction as the turn's commit (or the run's terminal or paused
-- commit), at most `MAX_CALL_SPANS` rows per commit.
CREATE TABLE call_spans (
    -- The root dialog the turn or run belongs to (a purge deletes by it).
    session_id TEXT NOT NULL,
    -- Exactly one owner: a root turn of the dialog, or a run.
    turn_id TEXT,
    run_id TEXT,
    -- Order within its owner's commit (0-based).
    seq INTEGER NOT NULL CHECK (seq >= 0),
    kind TEXT NOT NULL CHECK (kind IN ('model', 'tool')),
    -- The model (`profile/model`) or the tool.
    name TEXT NOT NULL,
    -- The tool call's id (`null` for a model call).
    call_id TEXT,
    started_at INTEGER NOT NULL,
    ended_at INTEGER NOT NULL CHECK (ended_at >= started_at),
    input_tokens INTEGER CHECK (input_tokens >= 0),
    output_tokens INTEGER CHECK (output_tokens >= 0),
    -- `ok` or `error` (a model call's finish reason when it has one).
    status TEXT NOT NULL,
    CHECK ((turn_id IS NULL) <> (run_id IS NULL))
);
CREATE INDEX call_spans_session ON call_spans(session_id);
CREATE INDEX call_spans_turn ON call_spans(turn_id, seq) WHERE turn_id IS NOT NULL;
CREATE INDEX call_spans_run ON call_spans(run_id, seq) WHERE run_id IS NOT NULL;
