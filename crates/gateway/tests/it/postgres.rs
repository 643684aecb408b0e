//! The whole runtime on PostgreSQL (`[storage] url`), in-process: a dialog
//! answered and found again after a restart, the checker clean on the
//! server's database, and two processes serving one dialog together.

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

/// Two runtimes (two `keel serve` processes, say) on one database serve
/// one dialog together: turns sent to either, even at once, run one at a
/// time and each sees the other's (the second reloads what the first
/// wrote); a command that needs the database alone is refused meanwhile,
/// naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_serve_one_dialog_turn_by_turn() {
    let db = require_postgres!();
    let (a_dir, b_dir) = (data_dir(&db.conninfo), data_dir(&db.conninfo));
    let a = open(&a_dir, "keel serve").await.unwrap();
    let b = open(&b_dir, "keel serve").await.unwrap();
    assert_ne!(a.generation, b.generation);
    let id = a
        .manager
        .create_dialog("test", "shared", None, None)
        .await
        .unwrap();
    a.manager.submit_turn(id, "first, to a").await.unwrap();
    // B never saw the dialog's turn: it takes the lease and reads it.
    b.manager.submit_turn(id, "second, to b").await.unwrap();
    // A remembers the dialog as it was: the lease tells it to reload.
    a.manager.submit_turn(id, "third, to a").await.unwrap();
    // Both at once: one waits for the other's turn.
    let (x, y) = tokio::join!(
        a.manager.submit_turn(id, "fourth, to a"),
        b.manager.submit_turn(id, "fourth, to b")
    );
    x.unwrap();
    y.unwrap();
    let history = b
        .store
        .load_messages(id, keel_store::MessageFilter::default())
        .await
        .unwrap();
    let users: Vec<String> = history
        .iter()
        .filter(|m| m.message.role == keel_core::Role::User)
        .map(|m| m.message.text())
        .collect();
    assert_eq!(users.len(), 5, "{users:?}");
    assert_eq!(users[..3], ["first, to a", "second, to b", "third, to a"]);
    // Every input answered, each right after its question: no two turns interleaved.
    assert_eq!(history.len(), 10, "{history:#?}");
    for pair in history.chunks(2) {
        assert_eq!(pair[0].message.role, keel_core::Role::User, "{history:#?}");
        assert_eq!(
            pair[1].message.role,
            keel_core::Role::Assistant,
            "{history:#?}"
        );
        assert_eq!(
            pair[0].input_state,
            Some(keel_store::InputState::Answered),
            "{history:#?}"
        );
    }
    // A command that needs the database alone is refused, naming the runtimes.
    let err = keel_gateway::storage::open_exclusive("keel prune", &a.config.config)
        .await
        .unwrap_err();
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
    let report = a
        .store
        .check_invariants(CheckOptions {
            owner_alive: true,
            ..CheckOptions::default()
        })
        .await
        .unwrap();
    assert!(report.is_clean(), "{report:?}");
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
