-- 8: durable user input (see keel-store's step 8): input_state is the one
-- column of a message row that changes, once, from 'open' to 'answered' or
-- 'unanswered'; NULL for every other message.
ALTER TABLE messages ADD COLUMN input_state TEXT
    CHECK (input_state IS NULL OR input_state IN ('open', 'answered', 'unanswered'));

-- Only open inputs are indexed (one per running turn at most).
CREATE INDEX idx_messages_open_inputs ON messages(session_id) WHERE input_state = 'open';
