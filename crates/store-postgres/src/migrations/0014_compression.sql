-- 14: compression of opaque values (codec 0 = as they are, 1 = a zstd
-- frame), and the zstd dictionaries trained from the database's own rows.
ALTER TABLE state_blobs ADD COLUMN codec BIGINT NOT NULL DEFAULT 0 CHECK (codec IN (0, 1));

CREATE TABLE zstd_dictionaries (
    id BIGINT PRIMARY KEY,
    bytes BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    CHECK (id > 0 AND id < 4294967296)
);
