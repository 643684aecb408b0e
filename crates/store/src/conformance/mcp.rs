//! MCP manifests: one row per server, replaced only when the hash changes,
//! kept across reopening.
#![allow(missing_docs)] // a test's name is its documentation

use crate::{McpManifestRecord, StoreError};

use super::TestDb;

fn record(server: &str, hash_char: char, manifest: &str, at: i64) -> McpManifestRecord {
    McpManifestRecord {
        server: server.to_owned(),
        hash: hash_char.to_string().repeat(64),
        manifest: manifest.to_owned(),
        committed_at_ms: at,
    }
}

pub async fn a_manifest_is_replaced_only_when_its_hash_changes_and_survives_a_reopen(db: TestDb) {
    let store = db.store.clone();
    assert!(store.mcp_manifests().await.unwrap().is_empty());
    let first = record("files", 'a', r#"{"tools":[]}"#, 1);
    assert_eq!(
        store.commit_mcp_manifest(first.clone()).await.unwrap(),
        None
    );
    // Same hash: nothing written, the first commit time stays.
    let same = record("files", 'a', r#"{"tools":[]}"#, 2);
    assert_eq!(
        store.commit_mcp_manifest(same).await.unwrap(),
        Some(first.clone())
    );
    let changed = record("files", 'b', r#"{"tools":[{"name":"x"}]}"#, 3);
    assert_eq!(
        store.commit_mcp_manifest(changed.clone()).await.unwrap(),
        Some(first)
    );
    store
        .commit_mcp_manifest(record("web", 'c', "{}", 4))
        .await
        .unwrap();
    drop(store);
    let store = db.reopen().await;
    let all = store.mcp_manifests().await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0], changed);
    assert_eq!(all[1].server, "web");
}

pub async fn a_manifest_that_is_not_json_or_has_a_bad_hash_is_refused(db: TestDb) {
    let store = db.store.clone();
    let err = store
        .commit_mcp_manifest(record("files", 'a', "not json", 1))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidInput(_)), "{err:?}");
    let mut short = record("files", 'a', "{}", 1);
    short.hash = "abc".to_owned();
    assert!(store.commit_mcp_manifest(short).await.is_err());
    assert!(store.mcp_manifests().await.unwrap().is_empty());
}
