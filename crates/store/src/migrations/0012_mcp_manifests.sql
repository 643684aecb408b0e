-- 12: the last tool manifest of each configured MCP server, committed at
-- activation when keel reached the server. The catalog validates
-- `mcp:NAME/TOOL` references against these rows, so a check needs no
-- server running. One row per server name, replaced when the hash changes.
CREATE TABLE mcp_manifests (
    server TEXT PRIMARY KEY NOT NULL CHECK (length(server) BETWEEN 1 AND 64),
    hash TEXT NOT NULL CHECK (length(hash) = 64),
    manifest TEXT NOT NULL CHECK (json_valid(manifest)),
    committed_at INTEGER NOT NULL
);
