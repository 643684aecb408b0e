//! The data directory's edges, through the binary: two data directories
//! whose keel.db link one file take one lock; a keel.db or keel.toml that
//! is not a regular file is refused promptly with an error naming it; a
//! database where nothing may be written (a read-only mount) is checked by
//! `keel doctor`, which refuses only `--repair`.
//!
//! The read-only cases bind-mount a directory read-only, which needs root
//! (CI runs as root; root ignores file modes, so a mount is the only way to
//! make a file unwritable for it). Where mounting is impossible they fail,
//! saying why, unless KEEL_SKIP_MOUNTS=1 is set, in which case they print
//! loudly that the read-only behaviour was NOT tested.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::keel;

/// How long a refusal may take: it happens before anything is served.
const PROMPTLY: Duration = Duration::from_secs(30);

/// Waits for `child` to exit on its own within [`PROMPTLY`]; kills it and
/// fails if it does not (a process blocked forever, say on a FIFO, gives
/// nothing else to wait on).
fn exits_promptly(mut child: Child, what: &str) -> Output {
    let deadline = Instant::now() + PROMPTLY;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what}: still running after {PROMPTLY:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn serve(data: &Path) -> Command {
    let mut cmd = keel();
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .env_remove("KEEL_TOKEN")
        .env("KEEL_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn doctor(data: &Path, repair: bool) -> Output {
    let mut cmd = keel();
    cmd.args(["doctor", "--data-dir"])
        .arg(data)
        .env("KEEL_LOG", "error");
    if repair {
        cmd.arg("--repair");
    }
    cmd.output().unwrap()
}

/// A data directory with a keel database holding one answered turn.
fn chatted(data: &Path) {
    let echo = data.with_extension("echo.yaml");
    std::fs::write(&echo, "when_exhausted: echo\n").unwrap();
    let mut child = keel()
        .args(["chat", "--chat", "hal", "--data-dir"])
        .arg(data)
        .arg("--script")
        .arg(&echo)
        .env("KEEL_LOG", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().to_owned()
}

#[test]
fn two_data_directories_linking_one_database_take_one_lock() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for data in [&a, &b] {
        std::fs::create_dir(data).unwrap();
        // Not created yet: the first keel creates it through its link.
        symlink(real.join("keel.db"), data.join("keel.db")).unwrap();
    }
    let mut first = serve(&a).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(first.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("keel serve: listening on "), "{line}");

    let second = exits_promptly(serve(&b).spawn().unwrap(), "the second keel serve");
    let _ = first.kill();
    first.wait().unwrap();
    let err = stderr(&second);
    assert_eq!(second.status.code(), Some(1), "{err}");
    let holder = format!("keel serve (pid {} on ", first.id());
    assert!(err.contains(&holder), "the holder is not named: {err}");
    let shown = err
        .replace(&dir.path().display().to_string(), "<dir>")
        .replace(&format!("pid {}", first.id()), "pid <pid>");
    let host_at = shown.find(" on ").unwrap();
    let host_end = shown[host_at..].find(')').unwrap() + host_at;
    let shown = format!("{}<host>{}", &shown[..host_at + 4], &shown[host_end..]);
    insta::assert_snapshot!(shown, @"keel: storage: <dir>/b/keel.db (the file <dir>/real/keel.db) is in use by another keel process (keel serve (pid <pid> on <host>)); stop it first, or use another data directory");
    assert!(
        real.join("keel.db.lock").is_file(),
        "one lock, beside the real file"
    );
    assert!(!a.join("keel.db.lock").exists() && !b.join("keel.db.lock").exists());
}

fn mkfifo(path: &Path) {
    let status = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(status.success(), "mkfifo {}", path.display());
}

#[test]
fn a_keel_db_or_keel_toml_that_is_not_a_file_is_refused_promptly_naming_it() {
    type Make = fn(&Path);
    let cases: [(&str, Make); 5] = [
        ("keel.db is a FIFO", |data| mkfifo(&data.join("keel.db"))),
        ("keel.db is a directory", |data| {
            std::fs::create_dir(data.join("keel.db")).unwrap()
        }),
        ("keel.toml is a FIFO", |data| {
            mkfifo(&data.join("keel.toml"))
        }),
        ("keel.toml is a directory", |data| {
            std::fs::create_dir(data.join("keel.toml")).unwrap()
        }),
        ("keel.toml is a dangling symlink", |data| {
            symlink(data.join("gone.toml"), data.join("keel.toml")).unwrap()
        }),
    ];
    let mut seen = Vec::new();
    for (name, make) in cases {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        make(&data);
        let served = exits_promptly(serve(&data).spawn().unwrap(), name);
        let err = stderr(&served);
        assert_eq!(served.status.code(), Some(1), "{name}: {err}");
        assert!(served.stdout.is_empty(), "{name}: it served");
        let checked = exits_promptly(
            keel()
                .args(["doctor", "--data-dir"])
                .arg(&data)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
            name,
        );
        assert_eq!(checked.status.code(), Some(1), "{name}");
        let path = data.display().to_string();
        seen.push(format!(
            "{name}:\n  serve:  {}\n  doctor: {}",
            err.replace(&path, "<data>"),
            stderr(&checked).replace(&path, "<data>")
        ));
    }
    insta::assert_snapshot!(seen.join("\n"));
}

/// A read-only bind mount of a directory or file, unmounted when dropped.
struct ReadOnly {
    at: PathBuf,
}

impl ReadOnly {
    /// Mounts `source` read-only at `at` (created), or `None` when skipped.
    fn mount(source: &Path, at: &Path) -> Option<Self> {
        if source.is_dir() {
            std::fs::create_dir_all(at).unwrap();
        } else {
            std::fs::write(at, b"").unwrap();
        }
        let run = |args: &[&str]| {
            Command::new("mount")
                .args(args)
                .arg(source)
                .arg(at)
                .output()
        };
        let why = match run(&["--bind"]) {
            Ok(o) if o.status.success() => {
                let ro = Command::new("mount")
                    .args(["-o", "remount,bind,ro"])
                    .arg(at)
                    .output();
                let mounted = Self { at: at.to_owned() };
                match ro {
                    Ok(o) if o.status.success() => return Some(mounted),
                    Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
                    Err(e) => e.to_string(),
                }
            }
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        };
        let message = format!(
            "cannot bind-mount {} read-only ({why}); run the tests as root, \
             or set KEEL_SKIP_MOUNTS=1 to skip it knowingly",
            source.display()
        );
        if std::env::var_os("KEEL_SKIP_MOUNTS").is_some() {
            eprintln!("\n!!!!!!!! READ-ONLY DATABASE TEST NOT RUN: {message}\n");
            return None;
        }
        panic!("{message}");
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.at).status();
    }
}

#[test]
fn doctor_checks_a_read_only_database_and_refuses_only_to_repair_it() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source");
    chatted(&source);
    // A finding `--repair` would fix, so that it has something to write.
    let conn = rusqlite::Connection::open(source.join("keel.db")).unwrap();
    conn.execute("UPDATE sessions SET message_count = 9", [])
        .unwrap();
    let session: String = conn
        .query_row("SELECT id FROM sessions", [], |r| r.get(0))
        .unwrap();
    drop(conn);
    assert!(
        !source.join("keel.db-wal").exists(),
        "the last connection removes the WAL"
    );
    // The whole directory read-only (no lock, no -shm can be made), then
    // only the database file (the lock and -shm can be made beside it).
    let whole = dir.path().join("whole");
    let Some(_whole) = ReadOnly::mount(&source, &whole) else {
        return;
    };
    let file_only = dir.path().join("file-only");
    std::fs::create_dir(&file_only).unwrap();
    let Some(_file) = ReadOnly::mount(&source.join("keel.db"), &file_only.join("keel.db")) else {
        return;
    };
    let before = std::fs::read(source.join("keel.db")).unwrap();
    let mut seen = Vec::new();
    for data in [&whole, &file_only] {
        let path = data.display().to_string();
        let shown = |out: &Output| {
            format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(out))
                .replace(&path, "<data>")
                .replace(&session, "<session>")
        };
        let checked = doctor(data, false);
        assert!(
            shown(&checked).contains("1 finding(s), 1 fixed by `keel doctor --repair`"),
            "{}",
            shown(&checked)
        );
        let repaired = doctor(data, true);
        assert_eq!(repaired.status.code(), Some(1), "{}", shown(&repaired));
        let served = exits_promptly(serve(data).spawn().unwrap(), "keel serve");
        assert_eq!(served.status.code(), Some(1), "{}", shown(&served));
        assert_eq!(std::fs::read(data.join("keel.db")).unwrap(), before);
        seen.push(format!(
            "{}:\ndoctor:\n{}\ndoctor --repair:\n{}\nserve:\n{}",
            data.file_name().unwrap().to_string_lossy(),
            shown(&checked),
            shown(&repaired),
            shown(&served)
        ));
    }
    insta::assert_snapshot!(seen.join("\n\n"));
}

/// Commits still in a WAL can be read only through a `-shm` file; where
/// SQLite cannot create one, doctor says so instead of reading the main
/// file alone (which would miss them).
#[test]
fn doctor_on_a_read_only_database_with_commits_in_its_wal_says_it_cannot_read_them() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source");
    chatted(&source);
    let copy = dir.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    // A commit that stays in the WAL, copied while its connection is open
    // (its last close would checkpoint it and remove the WAL).
    let conn = rusqlite::Connection::open(source.join("keel.db")).unwrap();
    conn.execute_batch("PRAGMA wal_autocheckpoint = 0; UPDATE sessions SET title = 'renamed'")
        .unwrap();
    for name in ["keel.db", "keel.db-wal"] {
        std::fs::copy(source.join(name), copy.join(name)).unwrap();
    }
    drop(conn);
    let data = dir.path().join("data");
    let Some(_mounted) = ReadOnly::mount(&copy, &data) else {
        return;
    };
    let out = doctor(&data, false);
    assert_eq!(out.status.code(), Some(1));
    insta::assert_snapshot!(stderr(&out).replace(&data.display().to_string(), "<data>"), @"keel: <data>/keel.db: read-only: its WAL <data>/keel.db-wal holds commits that SQLite can read only through <data>/keel.db-shm, which it cannot create here; copy the data directory somewhere writable and check the copy");
}
