//! keel-store-postgres on a real PostgreSQL (see `keel_store_postgres::testing`): one test binary.

mod check;
mod checks;
mod copy;
mod dialogs;
mod inbox;
mod lock;
mod messages;
mod pool;
mod processes;
mod relay;
mod retries;
mod runs;
mod schema;

mod postgres {
    //! The conformance suite (`keel_store::conformance`) on PostgreSQL: a
    //! fresh database per test on the server `keel_store_postgres::testing`
    //! finds (skipped, and saying so, when there is none).

    use keel_store::conformance::{Harness, TestDb};
    use keel_store::Store;
    use keel_store_postgres::testing::{self, Availability};
    use keel_store_postgres::{PgOptions, PgStore};

    /// Fresh databases on a real server.
    pub struct Postgres;

    async fn open(conninfo: &str) -> Store {
        let options = PgOptions {
            max_connections: 4,
            ..PgOptions::default()
        };
        let (store, _) = PgStore::connect(conninfo, options)
            .await
            .expect("connect to the test database");
        Store::new(store)
    }

    #[async_trait::async_trait]
    impl Harness for Postgres {
        async fn create(&self) -> TestDb {
            let db = testing::TestDb::start()
                .await
                .expect("a server (the harness said one is available)");
            let store = open(&db.conninfo).await;
            let conninfo = db.conninfo.clone();
            let reopen = Box::new(move || {
                let conninfo = conninfo.clone();
                Box::pin(async move { open(&conninfo).await })
                    as std::pin::Pin<Box<dyn std::future::Future<Output = Store> + Send>>
            });
            let client = std::sync::Arc::new(db.connect().await);
            let scalar = Box::new(move |sql: String| {
                let client = std::sync::Arc::clone(&client);
                Box::pin(async move {
                    let row = client
                        .query_one(&sql, &[])
                        .await
                        .unwrap_or_else(|e| panic!("{sql}: {e}"));
                    row.get::<_, i64>(0)
                })
                    as std::pin::Pin<Box<dyn std::future::Future<Output = i64> + Send>>
            });
            TestDb::new(store, reopen, scalar, db)
        }
    }

    pub async fn harness() -> Option<Postgres> {
        match testing::available() {
            Availability::None => testing::TestDb::start().await.map(|_| Postgres),
            _ => Some(Postgres),
        }
    }

    keel_store::conformance_suite!(crate::postgres::harness);
}
