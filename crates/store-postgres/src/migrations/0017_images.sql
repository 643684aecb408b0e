-- 17: images of user messages, stored once by content hash (keel-store's
-- 0017_images.sql says how they are used).
CREATE TABLE images (
    sha256 TEXT PRIMARY KEY NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    media_type TEXT NOT NULL
        CHECK (media_type IN ('image/png', 'image/jpeg', 'image/gif', 'image/webp')),
    byte_size BIGINT NOT NULL CHECK (byte_size > 0 AND byte_size = octet_length(bytes)),
    bytes BYTEA NOT NULL,
    created_at BIGINT NOT NULL
);
