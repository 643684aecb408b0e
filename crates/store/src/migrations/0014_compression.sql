-- 14: compression of opaque values, and shared dictionaries.
-- State blobs may be stored compressed. Their bytes are opaque (the
-- storage class cannot tell a frame from a state), so each row says how it
-- is stored: 0 = as they are (every row written before this step), 1 = a
-- zstd frame of them. The hash stays the hash of the state's own bytes.
-- Adding a column with a constant default rewrites no row.
ALTER TABLE state_blobs ADD COLUMN codec INTEGER NOT NULL DEFAULT 0 CHECK (codec IN (0, 1));

-- zstd dictionaries trained from the database's own rows. A frame names
-- the dictionary it was made with (its zstd id, in the frame header); a
-- dictionary is never deleted while the database exists.
CREATE TABLE zstd_dictionaries (
    id INTEGER PRIMARY KEY,
    bytes BLOB NOT NULL,
    created_at INTEGER NOT NULL,
    CHECK (id > 0 AND id < 4294967296)
);
