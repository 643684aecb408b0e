-- 14: state blobs may be stored compressed. Their bytes are opaque (the
-- storage class cannot tell a frame from a state), so each row says how it
-- is stored: 0 = as they are (every row written before this step), 1 = a
-- zstd frame of them. The hash stays the hash of the state's own bytes.
-- Adding a column with a constant default rewrites no row.
ALTER TABLE state_blobs ADD COLUMN codec INTEGER NOT NULL DEFAULT 0 CHECK (codec IN (0, 1));
