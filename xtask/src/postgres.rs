//! The PostgreSQL half of `cargo xtask ci`: keel-store-postgres' tests on
//! a real server — `KEEL_TEST_DATABASE_URL`, else a throwaway cluster the
//! tests start from `/usr/lib/postgresql/*/bin` — and the summary line
//! that says which, or that there was none (never a silent pass).

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use crate::{cargo_cmd, root, run};

/// The crate whose tests need a server.
const CRATE: &str = "keel-store-postgres";

/// Where the tests will find a server, and how many ran on it.
#[derive(Debug, Clone)]
pub struct Postgres {
    /// "PostgreSQL 15.14", "the server at KEEL_TEST_DATABASE_URL", or `None`.
    server: Option<String>,
    tests: Arc<Mutex<Option<usize>>>,
}

impl Postgres {
    /// Looks for a server without starting one.
    pub fn detect() -> Postgres {
        let server = if std::env::var("KEEL_TEST_DATABASE_URL").is_ok_and(|u| !u.is_empty()) {
            Some("the server at KEEL_TEST_DATABASE_URL".to_owned())
        } else {
            newest_postgres().and_then(|bin| version(&bin))
        };
        Postgres {
            server,
            tests: Arc::new(Mutex::new(None)),
        }
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
    let pg = Postgres::detect();
    pg.step()?;
    println!("xtask: {}", pg.summary());
    Ok(())
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
