-- 19: a session's checkpoints in the order they were written. A turn's
-- checkpoint names the session's newest one as its parent, and listings
-- and pruning walk them newest first: with the index on `session_id`
-- alone each of those read and sorted every checkpoint of the session, so
-- a turn cost more the longer its dialog. The index now ends with
-- `row_order` (SQLite's index on `session_id` ends with the rowid
-- already), so the newest is one index step away.
DROP INDEX idx_checkpoints_session;
CREATE INDEX idx_checkpoints_session ON checkpoints(session_id, row_order);
