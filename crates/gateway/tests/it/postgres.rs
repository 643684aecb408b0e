//! The whole runtime on PostgreSQL (`[storage] url`), in-process: a dialog
//! answered and found again after a restart, the checker clean on the
//! server's database, and one process at a time — a second is refused
//! naming the first, before it writes anything.

use keel_gateway::app::App;
use keel_store::{CheckOptions, StoreError};
use keel_store_postgres::require_postgres;

/// A data directory whose keel.toml points at `conninfo`.
fn data_dir(conninfo: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("keel.toml"),
        format!("[storage]\nurl = {:?}\nmax_connections = 4\n", conninfo),
    )
    .unwrap();
    dir
}

async fn open(dir: &tempfile::TempDir, command: &str) -> Result<App, keel_gateway::AppError> {
    App::open(command, None, Some(dir.path()), None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialog_on_postgres_is_answered_and_survives_a_restart() {
    let db = require_postgres!();
    let dir = data_dir(&db.conninfo);
    let app = open(&dir, "keel test").await.unwrap();
    let id = app
        .manager
        .create_dialog("test", "chat", None, None)
        .await
        .unwrap();
    let report = app
        .manager
        .submit_turn(id, "hello on postgres")
        .await
        .unwrap();
    assert!(
        !report.output.messages.is_empty(),
        "the offline model answered"
    );
    let before = app
        .store
        .load_messages(id, keel_store::MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(before.len(), 2, "{before:?}");
    assert!(
        !dir.path().join("keel.db").exists(),
        "no SQLite file beside a PostgreSQL database"
    );
    drop(app);

    let app = open(&dir, "keel test").await.unwrap();
    let after = app
        .store
        .load_messages(id, keel_store::MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(
        after.iter().map(|m| m.message.text()).collect::<Vec<_>>(),
        before.iter().map(|m| m.message.text()).collect::<Vec<_>>()
    );
    let report = app
        .store
        .check_invariants(CheckOptions::default())
        .await
        .unwrap();
    assert!(report.is_clean(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_on_the_same_database_is_refused_naming_the_first() {
    let db = require_postgres!();
    let first_dir = data_dir(&db.conninfo);
    let _first = open(&first_dir, "keel serve").await.unwrap();
    // Another data directory, the same database.
    let second_dir = data_dir(&db.conninfo);
    let err = match open(&second_dir, "keel chat").await {
        Ok(_) => panic!("a second process was let in"),
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(
        matches!(
            err,
            keel_gateway::AppError::Database {
                source: StoreError::InUse { .. },
                ..
            }
        ),
        "{text}"
    );
    assert!(text.contains("keel serve (pid "), "{text}");
}
