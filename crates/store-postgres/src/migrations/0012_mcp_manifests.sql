-- 12: the last tool manifest of each configured MCP server. SQLite's
-- json_valid() has no PostgreSQL 15 equivalent that returns false (IS JSON
-- is 16+), so keel_json_valid() tries the cast.
CREATE FUNCTION keel_json_valid(doc TEXT) RETURNS BOOLEAN
    LANGUAGE plpgsql IMMUTABLE STRICT AS $$
BEGIN
    PERFORM doc::json;
    RETURN TRUE;
EXCEPTION WHEN others THEN
    RETURN FALSE;
END;
$$;

CREATE TABLE mcp_manifests (
    server TEXT PRIMARY KEY NOT NULL CHECK (length(server) BETWEEN 1 AND 64),
    hash TEXT NOT NULL CHECK (length(hash) = 64),
    manifest TEXT NOT NULL CHECK (keel_json_valid(manifest)),
    committed_at BIGINT NOT NULL
);
