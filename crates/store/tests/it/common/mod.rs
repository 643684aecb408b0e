//! Helpers shared by the keel-store integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

pub use keel_store::conformance::fixtures::*;
use keel_store::{Store, StoreOptions};
use tempfile::TempDir;

/// A store in a fresh temporary directory (kept alive by the returned guard).
pub fn temp_store() -> (TempDir, Store) {
    temp_store_with(fast_options())
}

/// Like [`temp_store`] with the given options.
pub fn temp_store_with(options: StoreOptions) -> (TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(db_path(&dir), options).unwrap();
    (dir, store)
}

/// Options with short retry delays so failing tests fail fast.
pub fn fast_options() -> StoreOptions {
    StoreOptions {
        retry_delays: vec![Duration::from_millis(5); 3],
        readers: 2,
        ..StoreOptions::default()
    }
}

pub fn db_path(dir: &TempDir) -> PathBuf {
    dir.path().join("keel.db")
}
