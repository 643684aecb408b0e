-- Images of user messages, stored once by content hash: a message refers
-- to one as `keel-image:sha256:<hex>` and never carries its bytes, so
-- replays stay small. Written (idempotently) and committed before the
-- input that refers to it is accepted. Nothing deletes them yet: a purged
-- dialog's images stay.
CREATE TABLE images (
    -- SHA-256 of `bytes`, 64 lowercase hex digits.
    sha256 TEXT PRIMARY KEY NOT NULL CHECK (length(sha256) = 64 AND sha256 NOT GLOB '*[^0-9a-f]*'),
    -- Read from the bytes' magic numbers, never from a declared type.
    media_type TEXT NOT NULL
        CHECK (media_type IN ('image/png', 'image/jpeg', 'image/gif', 'image/webp')),
    byte_size INTEGER NOT NULL CHECK (byte_size > 0 AND byte_size = length(bytes)),
    bytes BLOB NOT NULL,
    created_at INTEGER NOT NULL
);
