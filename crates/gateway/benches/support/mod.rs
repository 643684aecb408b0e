//! What the benchmarks that drive a live `keel serve` share: starting this
//! package's release binary on a loopback port and stopping it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// `keel serve` (this package's binary, built with the bench profile) on a
/// free loopback port with `dir` as its data directory (the offline
/// provider unless `dir/keel.toml` names another). Returns the process and
/// its `host:port`. Its log goes to `dir/server.log` (a pipe nobody reads
/// until the end could fill and stall it).
pub fn start_server(dir: &Path) -> (Child, String) {
    let log = std::fs::File::create(dir.join("server.log")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .env("KEEL_LOG", "warn")
        .env_remove("KEEL_TOKEN")
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    (child, addr)
}

/// Stops the server with SIGTERM (a graceful shutdown) and returns its log.
pub fn stop_server(mut child: Child, dir: &Path) -> String {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    std::fs::read_to_string(dir.join("server.log")).unwrap()
}
