//! Integration tests of keel-store, linked into one binary (one link on CI
//! instead of one per file).
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

mod backup;
mod check;
mod common;
mod compression;
mod history;
mod migrations;
mod orchestration;
mod runtime;
mod spend;
mod stored_enums;
mod write_cache;
mod writer;
mod sqlite {
    //! The conformance suite (`keel_store::conformance`) on SQLite.

    use keel_store::conformance::{Harness, TestDb};
    use keel_store::Store;

    use crate::common::{db_path, fast_options};

    /// Fresh databases in temporary directories.
    pub struct Sqlite;

    #[async_trait::async_trait]
    impl Harness for Sqlite {
        async fn create(&self) -> TestDb {
            let dir = tempfile::tempdir().unwrap();
            let path = db_path(&dir);
            let store = Store::open(&path, fast_options()).unwrap();
            let reopen = Box::new({
                let path = path.clone();
                move || {
                    let path = path.clone();
                    Box::pin(async move { Store::open(&path, fast_options()).unwrap() })
                        as std::pin::Pin<Box<dyn std::future::Future<Output = Store> + Send>>
                }
            });
            let scalar = Box::new(move |sql: String| {
                let conn = rusqlite::Connection::open_with_flags(
                    &path,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                )
                .unwrap();
                let n: i64 = conn
                    .query_row(&sql, [], |r| r.get(0))
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
                Box::pin(async move { n })
                    as std::pin::Pin<Box<dyn std::future::Future<Output = i64> + Send>>
            });
            TestDb::new(store, reopen, scalar, dir)
        }
    }

    pub async fn harness() -> Option<Sqlite> {
        Some(Sqlite)
    }

    keel_store::conformance_suite!(crate::sqlite::harness);
}
