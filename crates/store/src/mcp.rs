//! The last tool manifest of each MCP server: committed at activation when
//! keel reached the server, read by the gateway to validate `mcp:` tool
//! references offline. The manifest is opaque JSON to the store.

use rusqlite::{params, OptionalExtension};

use crate::error::{Result, StoreError};
use crate::SqliteStore;

/// One server's committed manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpManifestRecord {
    /// The server's name (`[mcp.NAME]`).
    pub server: String,
    /// SHA-256 of the manifest, lowercase hex.
    pub hash: String,
    /// The manifest, JSON.
    pub manifest: String,
    /// When it was committed (ms).
    pub committed_at_ms: i64,
}

impl SqliteStore {
    pub(crate) async fn commit_mcp_manifest(
        &self,
        record: McpManifestRecord,
    ) -> Result<Option<McpManifestRecord>> {
        if serde_json::from_str::<serde_json::Value>(&record.manifest).is_err() {
            return Err(StoreError::InvalidInput(format!(
                "the manifest of MCP server {:?} is not JSON",
                record.server
            )));
        }
        self.db
            .write(move |c| {
                let previous = c
                    .prepare_cached(
                        "SELECT server, hash, manifest, committed_at FROM mcp_manifests \
                         WHERE server = ?1",
                    )?
                    .query_row([&record.server], |r| {
                        Ok(McpManifestRecord {
                            server: r.get(0)?,
                            hash: r.get(1)?,
                            manifest: r.get(2)?,
                            committed_at_ms: r.get(3)?,
                        })
                    })
                    .optional()?;
                if previous.as_ref().is_some_and(|p| p.hash == record.hash) {
                    return Ok(previous);
                }
                c.prepare_cached(
                    "INSERT INTO mcp_manifests (server, hash, manifest, committed_at) \
                     VALUES (?1, ?2, ?3, ?4) ON CONFLICT (server) DO UPDATE SET \
                     hash = excluded.hash, manifest = excluded.manifest, \
                     committed_at = excluded.committed_at",
                )?
                .execute(params![
                    record.server,
                    record.hash,
                    record.manifest,
                    record.committed_at_ms
                ])?;
                Ok(previous)
            })
            .await
    }

    pub(crate) async fn mcp_manifests(&self) -> Result<Vec<McpManifestRecord>> {
        self.db
            .read(|c| {
                let mut stmt = c.prepare_cached(
                    "SELECT server, hash, manifest, committed_at FROM mcp_manifests \
                     ORDER BY server",
                )?;
                let rows = stmt.query_map([], |r| {
                    Ok(McpManifestRecord {
                        server: r.get(0)?,
                        hash: r.get(1)?,
                        manifest: r.get(2)?,
                        committed_at_ms: r.get(3)?,
                    })
                })?;
                Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
            })
            .await
    }
}
