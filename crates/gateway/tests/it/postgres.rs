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

/// Every row of every copied table of the SQLite database at `path`, as
/// sorted text (a copy keeps rows, not their physical order).
fn rows_of(path: &std::path::Path) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    keel_store::read_sqlite_tables(path, 100, &mut |chunk| {
        let rows = out.entry(chunk.table.to_owned()).or_default();
        rows.extend(chunk.rows.iter().map(|r| format!("{r:?}")));
        Ok(())
    })
    .unwrap();
    for rows in out.values_mut() {
        rows.sort();
    }
    out
}

/// `keel copy` SQLite → PostgreSQL → SQLite keeps every row of a data
/// directory with dialogs, turns, checkpoints and a rollback, and the
/// checker is clean on each target; a target that is not empty is refused
/// with nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_to_postgres_and_back_keeps_every_row() {
    let db = require_postgres!();
    let source = tempfile::tempdir().unwrap();
    {
        let app = App::open("keel test", None, Some(source.path()), None)
            .await
            .unwrap();
        for dialog in ["a", "b"] {
            let id = app
                .manager
                .create_dialog("test", dialog, None, None)
                .await
                .unwrap();
            for n in 0..3 {
                app.manager
                    .submit_turn(id, &format!("{dialog} question {n}"))
                    .await
                    .unwrap();
            }
            let first = app.store.list_checkpoints(id).await.unwrap().pop().unwrap();
            app.store
                .rollback(id, first.id, keel_core::CheckpointId::new(), 10)
                .await
                .unwrap();
        }
    }
    let original = source.path().join("keel.db");
    let pg = db.conninfo.clone();
    let copy =
        |from: String, to: String| async move { keel_gateway::copy_cmd::run(&from, &to).await };
    let code = copy(format!("sqlite:{}", original.display()), pg.clone())
        .await
        .unwrap();
    assert_eq!(code, std::process::ExitCode::SUCCESS);
    let back = tempfile::tempdir().unwrap();
    let returned = back.path().join("keel.db");
    let code = copy(pg.clone(), format!("sqlite:{}", returned.display()))
        .await
        .unwrap();
    assert_eq!(code, std::process::ExitCode::SUCCESS);
    let (before, after) = (rows_of(&original), rows_of(&returned));
    assert!(before["messages"].len() >= 12, "{before:?}");
    assert_eq!(before, after);

    // Into a database that already holds rows: refused, nothing changed.
    let err = copy(format!("sqlite:{}", original.display()), pg.clone())
        .await
        .unwrap_err();
    let shown = err
        .to_string()
        .replace(&keel_store_postgres::redacted(&pg), "<target>");
    let held = before["state_blobs"].len().to_string();
    insta::assert_snapshot!(
        shown.replace(&held, "<n>"),
        @"<target>: conflict: the database is not empty (state_blobs holds <n> row(s)); keel copy writes only into a new, empty database"
    );
    let err = copy(
        format!("sqlite:{}", original.display()),
        format!("sqlite:{}", returned.display()),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("is not empty"), "{err}");
    assert_eq!(rows_of(&returned), after);
}
