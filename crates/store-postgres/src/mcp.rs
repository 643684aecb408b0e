//! The last tool manifest of each MCP server on PostgreSQL: committed at
//! activation when keel reached the server, read by the gateway to validate
//! `mcp:` tool references offline. The manifest is opaque JSON to the store.

use keel_store::{McpManifestRecord, Result, StoreError};
use tokio_postgres::Row;

use crate::store::from_pg;
use crate::PgStore;

fn manifest_from_row(r: &Row) -> McpManifestRecord {
    McpManifestRecord {
        server: r.get(0),
        hash: r.get(1),
        manifest: r.get(2),
        committed_at_ms: r.get(3),
    }
}

impl PgStore {
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
        self.write(move |tx| {
            let record = record.clone();
            Box::pin(async move {
                let previous = tx
                    .query_opt(
                        "SELECT server, hash, manifest, committed_at FROM mcp_manifests \
                         WHERE server = $1",
                        &[&record.server],
                    )
                    .await
                    .map_err(from_pg)?
                    .map(|r| manifest_from_row(&r));
                if previous.as_ref().is_some_and(|p| p.hash == record.hash) {
                    return Ok(previous);
                }
                tx.execute(
                    "INSERT INTO mcp_manifests (server, hash, manifest, committed_at) \
                     VALUES ($1, $2, $3, $4) ON CONFLICT (server) DO UPDATE SET \
                     hash = EXCLUDED.hash, manifest = EXCLUDED.manifest, \
                     committed_at = EXCLUDED.committed_at",
                    &[
                        &record.server,
                        &record.hash,
                        &record.manifest,
                        &record.committed_at_ms,
                    ],
                )
                .await
                .map_err(from_pg)?;
                Ok(previous)
            })
        })
        .await
    }

    pub(crate) async fn mcp_manifests(&self) -> Result<Vec<McpManifestRecord>> {
        self.read(|tx| {
            Box::pin(async move {
                Ok(tx
                    .query(
                        "SELECT server, hash, manifest, committed_at FROM mcp_manifests \
                         ORDER BY server COLLATE \"C\"",
                        &[],
                    )
                    .await
                    .map_err(from_pg)?
                    .iter()
                    .map(manifest_from_row)
                    .collect())
            })
        })
        .await
    }
}
