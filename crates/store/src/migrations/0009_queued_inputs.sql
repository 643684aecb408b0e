-- 9: acknowledged user input waiting for its turn. A message sent while the
-- dialog's turn runs commits here before it is acknowledged; its turn's
-- start moves it into the history ('open', at the head: after the answer of
-- the turn it waited for) in the same transaction as Store::open_turn. A
-- row a dead process left is run by the next one, in `seq` order.
CREATE TABLE queued_inputs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL REFERENCES sessions(id),
    message TEXT NOT NULL,
    queued_at INTEGER NOT NULL
);

CREATE INDEX idx_queued_inputs_session ON queued_inputs(session_id, seq);
