//! A file where keel.db should be that is not a usable keel database —
//! random bytes, an empty file, another application's SQLite database, a
//! keel database with a value keel does not know — is refused with an
//! error naming the file and what is wrong, a non-zero exit, and the file
//! left byte for byte as it was.

use std::io::Write;
use std::path::Path;
use std::process::Stdio;

/// Deterministic bytes that are no SQLite header.
fn noise(n: usize) -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()[0]
        })
        .collect()
}

fn sqlite_file(path: &Path, sql: &str) {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.execute_batch(sql).unwrap();
}

/// A keel database with a row holding a run status no keel writes.
fn keel_db_with_unknown_status(dir: &Path, data: &Path) {
    crate::data_dir_with_agent(data, "helper", "Answers small questions.", true);
    let script = dir.join("delegate.yaml");
    std::fs::write(
        &script,
        "- tool_calls: [{name: delegate, arguments: {tasks: [{agent: helper, task: hi}]}}]\n\
         - text: hi from the helper\n\
         - text: done\n",
    )
    .unwrap();
    let out = chat(data, &script, "ask the helper\n");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    sqlite_file(
        &data.join("keel.db"),
        "PRAGMA ignore_check_constraints = ON; UPDATE agent_runs SET status = 'paused';",
    );
}

/// The ids of the runs in a keel database (none in anything else).
fn run_ids(db: &Path) -> Vec<String> {
    let read = || -> rusqlite::Result<Vec<String>> {
        let conn =
            rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        let mut stmt = conn.prepare("SELECT id FROM agent_runs")?;
        let ids = stmt.query_map([], |r| r.get(0))?.collect();
        ids
    };
    read().unwrap_or_default()
}

fn chat(data: &Path, script: &Path, stdin: &str) -> std::process::Output {
    let mut child = crate::keel()
        .args(["chat", "--chat", "hal", "--data-dir"])
        .arg(data)
        .arg("--script")
        .arg(script)
        .env("KEEL_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn a_file_that_is_not_a_usable_keel_database_is_refused_and_left_untouched() {
    type Make = fn(&Path, &Path);
    let cases: [(&str, Make); 5] = [
        ("random bytes", |_, data| {
            std::fs::write(data.join("keel.db"), noise(8192)).unwrap()
        }),
        ("an empty file", |_, data| {
            std::fs::write(data.join("keel.db"), b"").unwrap()
        }),
        ("another application's database", |_, data| {
            sqlite_file(
                &data.join("keel.db"),
                "CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT); \
                 INSERT INTO moz_places (url) VALUES ('https://example.org'); \
                 PRAGMA user_version = 53;",
            )
        }),
        ("a database stamped by another application", |_, data| {
            sqlite_file(
                &data.join("keel.db"),
                "PRAGMA application_id = 252006674; CREATE TABLE blob (rid INTEGER PRIMARY KEY);",
            )
        }),
        ("a keel database with an unknown enum value", |dir, data| {
            keel_db_with_unknown_status(dir, data)
        }),
    ];
    let mut seen = Vec::new();
    for (name, make) in cases {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        make(dir.path(), &data);
        let db = data.join("keel.db");
        let before = std::fs::read(&db).unwrap();
        let echo = dir.path().join("echo.yaml");
        std::fs::write(&echo, "when_exhausted: echo\n").unwrap();

        let out = chat(&data, &echo, "hello\n");
        assert!(!out.status.success(), "{name}: keel chat accepted it");
        let err = String::from_utf8_lossy(&out.stderr);
        let path = db.display().to_string();
        assert!(
            err.contains(&path),
            "{name}: the error names no file: {err}"
        );
        assert!(out.stdout.is_empty(), "{name}: nothing ran");
        assert_eq!(
            std::fs::read(&db).unwrap(),
            before,
            "{name}: the file changed"
        );

        let doctor = crate::keel()
            .args(["doctor", "--data-dir"])
            .arg(&data)
            .env("KEEL_LOG", "error")
            .output()
            .unwrap();
        let doctor_err = String::from_utf8_lossy(&doctor.stderr);
        assert_eq!(doctor.status.code(), Some(1), "{name}: {doctor_err}");
        assert_eq!(
            std::fs::read(&db).unwrap(),
            before,
            "{name}: doctor changed it"
        );
        // Run ids are random; the messages name them.
        let redact = |text: &str| {
            run_ids(&db)
                .iter()
                .fold(text.replace(&path, "<data>/keel.db"), |t, id| {
                    t.replace(id.as_str(), "<run>")
                })
        };
        let chat_line = redact(err.trim());
        let doctor_text = format!(
            "{}{}",
            String::from_utf8_lossy(&doctor.stdout),
            doctor_err.trim()
        );
        let doctor_text = redact(&doctor_text);
        seen.push(format!(
            "{name}:\n  chat:   {chat_line}\n  doctor: {doctor_text}"
        ));
    }
    insta::assert_snapshot!(seen.join("\n"));
}
