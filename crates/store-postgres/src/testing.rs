//! The test harness: a fresh PostgreSQL database per test.
//!
//! The server is `KEEL_TEST_DATABASE_URL` when set (a libpq URL or
//! key=value string of a role that may create databases), else a throwaway
//! cluster started from the newest installed PostgreSQL
//! (`/usr/lib/postgresql/*/bin`, Debian's layout) — run as the `postgres`
//! user when the tests run as root, listening only on a unix socket in a
//! temporary directory, with `fsync=off` (a test cluster does not outlive
//! its test) — and stopped with `pg_ctl stop -m immediate` on drop.
//! Without either, [`TestDb::start`] returns `None` and the test prints a
//! `SKIP` line (use [`require_postgres!`](crate::require_postgres)); with
//! `KEEL_TEST_REQUIRE_POSTGRES=1` it panics instead, so a CI that promised
//! PostgreSQL cannot pass without it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio_postgres::{Client, NoTls};

/// The variable naming an existing server to test against.
pub const DATABASE_URL_VAR: &str = "KEEL_TEST_DATABASE_URL";
/// With this variable set to 1, a missing PostgreSQL fails the test.
pub const REQUIRE_VAR: &str = "KEEL_TEST_REQUIRE_POSTGRES";

/// Where the tests would get a server from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// `KEEL_TEST_DATABASE_URL` is set.
    Url(String),
    /// Installed server binaries (their `bin` directory).
    Binaries(PathBuf),
    /// Neither.
    None,
}

/// Where a server would come from, without starting anything.
pub fn available() -> Availability {
    if let Ok(url) = std::env::var(DATABASE_URL_VAR) {
        if !url.is_empty() {
            return Availability::Url(url);
        }
    }
    match installed_bindir() {
        Some(dir) => Availability::Binaries(dir),
        None => Availability::None,
    }
}

/// The newest `/usr/lib/postgresql/N/bin` that has initdb, pg_ctl and postgres.
pub fn installed_bindir() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            ["initdb", "pg_ctl", "postgres"]
                .iter()
                .all(|b| bin.join(b).is_file())
                .then_some((major, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin)
}

/// A throwaway cluster, stopped (and its directory removed) on drop.
#[derive(Debug)]
struct Cluster {
    dir: tempfile::TempDir,
    bindir: PathBuf,
    as_postgres: bool,
}

impl Cluster {
    fn start(bindir: &Path) -> Cluster {
        let as_postgres = running_as_root();
        let dir = tempfile::Builder::new()
            .prefix("keel-pg-")
            .tempdir()
            .expect("a temporary directory for the test cluster");
        if as_postgres {
            let ok = Command::new("chown")
                .arg("postgres:")
                .arg(dir.path())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "chown postgres {} failed", dir.path().display());
        }
        let cluster = Cluster {
            dir,
            bindir: bindir.to_owned(),
            as_postgres,
        };
        let data = cluster.data();
        cluster.run(
            "initdb",
            &[
                "-D",
                path_str(&data),
                "-U",
                "keel",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
        );
        let opts = format!(
            "-c listen_addresses='' -k {} -c fsync=off -c full_page_writes=off",
            path_str(cluster.dir.path())
        );
        let log = cluster.dir.path().join("server.log");
        cluster.run(
            "pg_ctl",
            &[
                "start",
                "-w",
                "-D",
                path_str(&data),
                "-l",
                path_str(&log),
                "-o",
                &opts,
            ],
        );
        cluster
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn conninfo(&self, dbname: &str) -> String {
        format!(
            "host={} port=5432 user=keel dbname={dbname}",
            path_str(self.dir.path())
        )
    }

    /// Runs a server binary (as `postgres` when root); panics with its output on failure.
    fn run(&self, bin: &str, args: &[&str]) {
        let exe = self.bindir.join(bin);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let out = cmd
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
        if !out.status.success() {
            let log =
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
            panic!(
                "{bin} {args:?} failed ({}):\n{}{}\n{log}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.data();
        let exe = self.bindir.join("pg_ctl");
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        match cmd
            .args(["stop", "-m", "immediate", "-w", "-D"])
            .arg(&data)
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "keel-store-postgres: pg_ctl stop failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("keel-store-postgres: cannot run pg_ctl stop: {e}"),
        }
    }
}

fn running_as_root() -> bool {
    // `id -u` rather than libc: the crate forbids unsafe code.
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

/// A fresh, empty database of its own for one test.
#[derive(Debug)]
pub struct TestDb {
    /// Connection string of the database (libpq key=value or URL form).
    pub conninfo: String,
    /// `SHOW server_version`, e.g. "15.14".
    pub server_version: String,
    admin: String,
    name: String,
    // Dropped last: the cluster outlives the database's own drop.
    cluster: Option<Cluster>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl TestDb {
    /// Starts (or reaches) a server and creates a database; `None` when no
    /// PostgreSQL is available (a panic instead under `KEEL_TEST_REQUIRE_POSTGRES=1`).
    pub async fn start() -> Option<TestDb> {
        let (admin, cluster) = match available() {
            Availability::Url(url) => (url, None),
            Availability::Binaries(bin) => {
                let cluster = tokio::task::spawn_blocking(move || Cluster::start(&bin))
                    .await
                    .expect("the cluster start does not panic");
                (cluster.conninfo("postgres"), Some(cluster))
            }
            Availability::None => {
                assert!(
                    std::env::var(REQUIRE_VAR).as_deref() != Ok("1"),
                    "{REQUIRE_VAR}=1 but no PostgreSQL: set {DATABASE_URL_VAR} or install postgresql"
                );
                return None;
            }
        };
        let name = format!(
            "keel_test_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let client = connect(&admin).await;
        // One statement each: neither may run inside a transaction block.
        for sql in [
            format!("DROP DATABASE IF EXISTS {name}"),
            format!("CREATE DATABASE {name}"),
        ] {
            client
                .batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
        let server_version: String = client
            .query_one("SHOW server_version", &[])
            .await
            .expect("SHOW server_version")
            .get(0);
        let conninfo = with_dbname(&admin, &name);
        Some(TestDb {
            conninfo,
            server_version,
            admin,
            name,
            cluster,
        })
    }

    /// A new connection to the test database (its driver task spawned on the current runtime).
    pub async fn connect(&self) -> Client {
        connect(&self.conninfo).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if self.cluster.is_some() {
            return; // the whole cluster goes
        }
        // A shared server keeps nothing of the test: drop its database.
        let admin = self.admin.clone();
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let (client, conn) = tokio_postgres::connect(&admin, NoTls)
                    .await
                    .map_err(|e| e.to_string())?;
                tokio::spawn(conn);
                client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
                    .map_err(|e| e.to_string())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("keel-store-postgres: DROP DATABASE {}: {e}", self.name),
            Err(_) => eprintln!("keel-store-postgres: DROP DATABASE {} panicked", self.name),
        }
    }
}

/// `conninfo` with its database replaced by `dbname` (URL or key=value form).
fn with_dbname(conninfo: &str, dbname: &str) -> String {
    if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        let (base, query) = match conninfo.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (conninfo, None),
        };
        let scheme_end = base.find("://").map_or(0, |i| i + 3);
        let host_end = base[scheme_end..]
            .find('/')
            .map_or(base.len(), |i| scheme_end + i);
        let mut url = format!("{}/{dbname}", &base[..host_end]);
        if let Some(q) = query {
            url.push('?');
            url.push_str(q);
        }
        url
    } else {
        // Later keys win in a key=value string.
        format!("{conninfo} dbname={dbname}")
    }
}

/// Connects without TLS (a test server is local) and spawns the connection's driver.
async fn connect(conninfo: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(conninfo, NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to the test PostgreSQL: {e}"));
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            eprintln!("keel-store-postgres: test connection ended: {e}");
        }
    });
    client
}

/// `let db = require_postgres!();`: a [`TestDb`], or prints a SKIP line and returns.
#[macro_export]
macro_rules! require_postgres {
    () => {
        match $crate::testing::TestDb::start().await {
            Some(db) => db,
            None => {
                eprintln!(
                    "SKIP {}: no PostgreSQL (set KEEL_TEST_DATABASE_URL or install postgresql)",
                    module_path!()
                );
                return;
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::with_dbname;

    #[test]
    fn the_database_of_a_url_or_key_value_string_is_replaced() {
        assert_eq!(
            with_dbname("postgres://u:p@h:5/postgres?sslmode=disable", "t1"),
            "postgres://u:p@h:5/t1?sslmode=disable"
        );
        assert_eq!(with_dbname("postgresql://h", "t1"), "postgresql://h/t1");
        assert_eq!(
            with_dbname("host=/tmp user=k", "t1"),
            "host=/tmp user=k dbname=t1"
        );
    }
}
