//! The PostgreSQL half of `cargo xtask ci`: keel-store-postgres' tests
//! (the store's conformance suite among them) on a real server —
//! `KEEL_TEST_DATABASE_URL`, else one throwaway cluster this process
//! starts from `/usr/lib/postgresql/*/bin` for the whole run (on a unix
//! socket in a temporary directory, stopped at the end) and hands to every
//! step through that variable — and the summary line that says which, or
//! that there was none (never a silent pass). `cargo xtask soak --postgres`
//! and the PostgreSQL benchmarks find their server the same way.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use crate::{cargo_cmd, root, run};

/// The crate whose tests need a server.
const CRATE: &str = "keel-store-postgres";

/// The variable the tests read the server from.
const URL_VAR: &str = "KEEL_TEST_DATABASE_URL";

/// Where the tests will find a server, and how many ran on it.
#[derive(Debug, Clone)]
pub struct Postgres {
    /// "PostgreSQL 15.14", "the server at KEEL_TEST_DATABASE_URL", or `None`.
    server: Option<String>,
    tests: Arc<Mutex<Option<usize>>>,
    /// The cluster this process started, stopped when the last clone drops.
    _cluster: Option<Arc<Cluster>>,
}

impl Postgres {
    /// Finds a server: `KEEL_TEST_DATABASE_URL`, else a cluster started now
    /// from the installed binaries (its URL then set in this process's
    /// environment, so every step's tests reach it), else none.
    pub fn start() -> Result<Postgres, String> {
        if std::env::var(URL_VAR).is_ok_and(|u| !u.is_empty()) {
            return Ok(Postgres {
                server: Some("the server at KEEL_TEST_DATABASE_URL".to_owned()),
                tests: Arc::new(Mutex::new(None)),
                _cluster: None,
            });
        }
        let Some(postgres) = newest_postgres() else {
            return Ok(Postgres {
                server: None,
                tests: Arc::new(Mutex::new(None)),
                _cluster: None,
            });
        };
        let cluster = Cluster::start(postgres.parent().unwrap_or(&postgres))?;
        // Set before any step spawns a process; nothing else runs yet.
        std::env::set_var(URL_VAR, cluster.url());
        Ok(Postgres {
            server: version(&postgres),
            tests: Arc::new(Mutex::new(None)),
            _cluster: Some(Arc::new(cluster)),
        })
    }

    /// The server's connection string, when there is one: what every
    /// step reads from `KEEL_TEST_DATABASE_URL`.
    pub fn url(&self) -> Option<String> {
        self.server.as_ref()?;
        std::env::var(URL_VAR).ok().filter(|u| !u.is_empty())
    }

    /// Runs the crate's tests; with a server, each must run on it
    /// (`KEEL_TEST_REQUIRE_POSTGRES=1`); without, they print SKIP.
    pub fn step(&self) -> Result<(), String> {
        let mut cmd = cargo_cmd(&["nextest", "run", "--locked", "-p", CRATE]);
        if self.server.is_some() {
            cmd.env("KEEL_TEST_REQUIRE_POSTGRES", "1");
        }
        run(&mut cmd)?;
        let out = cargo_cmd(&[
            "nextest",
            "list",
            "--locked",
            "-p",
            CRATE,
            "--message-format",
            "oneline",
        ])
        .current_dir(root())
        .output()
        .map_err(|e| format!("cannot list {CRATE}'s tests: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "nextest list -p {CRATE} exited with {}",
                out.status
            ));
        }
        let n = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count();
        *self.tests.lock().map_err(|_| "poisoned".to_owned())? = Some(n);
        Ok(())
    }

    /// The summary line: `postgres: N tests on PostgreSQL 15.x` or `postgres: skipped (no server)`.
    pub fn summary(&self) -> String {
        let n = self.tests.lock().ok().and_then(|n| *n);
        match (&self.server, n) {
            (Some(server), Some(n)) => format!("postgres: {n} tests on {server}"),
            (Some(_), None) => "postgres: not run".to_owned(),
            (None, _) => "postgres: skipped (no server: set KEEL_TEST_DATABASE_URL or install \
                          postgresql; .ci/run installs it)"
                .to_owned(),
        }
    }
}

/// `cargo xtask postgres`: the ci step on its own, then its summary line.
pub fn run_alone() -> Result<(), String> {
    let pg = Postgres::start()?;
    pg.step()?;
    println!("xtask: {}", pg.summary());
    Ok(())
}

/// A throwaway cluster: trust authentication on a unix socket only, no
/// fsync (it does not outlive the run); stopped, and its directory
/// removed, when dropped.
#[derive(Debug)]
struct Cluster {
    dir: PathBuf,
    bindir: PathBuf,
    as_postgres: bool,
}

impl Cluster {
    fn start(bindir: &std::path::Path) -> Result<Cluster, String> {
        let dir = std::env::temp_dir().join(format!("keel-ci-pg-{}", std::process::id()));
        // A directory left by a killed earlier run of this pid: start over.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        if as_postgres {
            run(Command::new("chown").arg("postgres:").arg(&dir))?;
        }
        let cluster = Cluster {
            dir,
            bindir: bindir.to_owned(),
            as_postgres,
        };
        let data = cluster.dir.join("data");
        let socket = cluster.dir.display().to_string();
        run(cluster
            .server_cmd("initdb")
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "keel",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .stdout(std::process::Stdio::null()))?;
        run(cluster
            .server_cmd("pg_ctl")
            .args(["start", "-w", "-D"])
            .arg(&data)
            .arg("-l")
            .arg(cluster.dir.join("server.log"))
            .arg("-o")
            .arg(format!(
                "-c listen_addresses='' -k {socket} -c fsync=off -c full_page_writes=off \
                 -c max_connections=300"
            ))
            .stdout(std::process::Stdio::null()))?;
        println!("ci: started a throwaway PostgreSQL cluster in {socket}");
        Ok(cluster)
    }

    fn url(&self) -> String {
        format!(
            "host={} port=5432 user=keel dbname=postgres",
            self.dir.display()
        )
    }

    /// A server binary, run as `postgres` when we are root (initdb refuses root).
    fn server_cmd(&self, bin: &str) -> Command {
        let exe = self.bindir.join(bin);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let stopped = self
            .server_cmd("pg_ctl")
            .args(["stop", "-m", "immediate", "-w", "-D"])
            .arg(self.dir.join("data"))
            .stdout(std::process::Stdio::null())
            .status();
        if !stopped.is_ok_and(|s| s.success()) {
            eprintln!("ci: pg_ctl stop of the throwaway cluster failed");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The newest `/usr/lib/postgresql/N/bin/postgres`.
fn newest_postgres() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            ["initdb", "pg_ctl", "postgres"]
                .iter()
                .all(|b| bin.join(b).is_file())
                .then(|| (major, bin.join("postgres")))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p)
}

/// "PostgreSQL 15.14" from `postgres --version` ("postgres (PostgreSQL) 15.14 (Debian …)").
fn version(postgres: &PathBuf) -> Option<String> {
    let out = Command::new(postgres).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text.split_whitespace().nth(2)?;
    Some(format!("PostgreSQL {v}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(server: Option<&str>, tests: Option<usize>) -> Postgres {
        Postgres {
            server: server.map(str::to_owned),
            tests: Arc::new(Mutex::new(tests)),
            _cluster: None,
        }
    }

    #[test]
    fn the_summary_names_the_server_and_the_count_or_says_skipped() {
        assert_eq!(
            with(Some("PostgreSQL 15.18"), Some(9)).summary(),
            "postgres: 9 tests on PostgreSQL 15.18"
        );
        assert_eq!(
            with(Some("PostgreSQL 15.18"), None).summary(),
            "postgres: not run"
        );
        assert!(with(None, Some(9))
            .summary()
            .starts_with("postgres: skipped (no server"));
    }
}
