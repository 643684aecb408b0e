-- 8: durable user input. A user turn's input commits on its own, before the
-- model is called, with input_state 'open'; the turn's commit marks it
-- 'answered'; a failed or cancelled turn, or recovery after a crash, marks
-- it 'unanswered'. NULL: every other message (outputs, continuation
-- triggers, and every row of v7, whose inputs committed with their answer).
-- input_state is the one column of a message row that changes, once, from
-- 'open' to 'answered' or 'unanswered'.
ALTER TABLE messages ADD COLUMN input_state TEXT
    CHECK (input_state IS NULL OR input_state IN ('open', 'answered', 'unanswered'));

-- Only open inputs are indexed (one per running turn at most), so appends of
-- every other message never touch this index; recovery finds them at once.
CREATE INDEX idx_messages_open_inputs ON messages(session_id) WHERE input_state = 'open';
