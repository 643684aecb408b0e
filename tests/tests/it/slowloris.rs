//! `keel serve` under `ulimit -n 1024` against 1,500 connections that
//! hold half a request line or trickle a long declared body: a normal
//! request is still answered within a second, and the server closes every
//! hostile connection once its timeouts pass.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Hostile connections in all, and how many of them trickle a body.
const HOSTILE: usize = 1500;
const SLOW_BODIES: usize = 100;
/// The `[server]` timeouts the test runs with.
const HEADER_TIMEOUT_SECS: u64 = 2;
const BODY_TIMEOUT_SECS: u64 = 2;

/// Starts `keel serve` through `sh -c 'ulimit -n 1024; exec …'`; the child and its address.
fn serve_under_ulimit(data: &std::path::Path) -> (Child, String) {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 1024 && exec \"$0\" serve --bind 127.0.0.1:0 --data-dir \"$1\"")
        .arg(env!("CARGO_BIN_EXE_keel-e2e"))
        .arg(data)
        .env_remove("KEEL_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
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

/// `GET /api/health` on a fresh connection: the status line, and how long it took.
fn health(addr: &str) -> (String, Duration) {
    let started = Instant::now();
    let mut tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        tcp,
        "GET /api/health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).unwrap();
    let status = answer.lines().next().unwrap_or("").to_owned();
    (status, started.elapsed())
}

/// Whether the server has closed `tcp` (EOF or reset) before `deadline`.
fn closed_by(mut tcp: &TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        tcp.set_read_timeout(Some(left)).unwrap();
        match tcp.read(&mut buf) {
            Ok(0) => return true,
            // The answer to a late body (400), then the close.
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn a_normal_request_is_answered_within_a_second_while_1500_connections_hold_half_requests() {
    // This process holds the 1,500 sockets itself.
    raise_own_fd_limit(HOSTILE as u64 + 256);
    let data = tempfile::tempdir().unwrap();
    std::fs::write(
        data.path().join("keel.toml"),
        format!(
            "[server]\nheader_timeout_secs = {HEADER_TIMEOUT_SECS}\n\
             body_timeout_secs = {BODY_TIMEOUT_SECS}\n"
        ),
    )
    .unwrap();
    let (mut child, addr) = serve_under_ulimit(data.path());
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(open_files[3..5], ["1024", "1024"], "{limits}");

    let started = Instant::now();
    let mut hostile = Vec::with_capacity(HOSTILE);
    for i in 0..HOSTILE {
        let mut tcp = TcpStream::connect(&addr).unwrap();
        if i % (HOSTILE / SLOW_BODIES) == 0 {
            write!(
                tcp,
                "POST /api/dialogs HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\n\
                 content-length: 1000000\r\n\r\n{{"
            )
            .unwrap();
        } else {
            tcp.write_all(b"GET /api/hea").unwrap();
        }
        hostile.push(tcp);
    }
    // The slow bodies keep trickling, a byte at a time, until they are refused.
    let mut trickling: Vec<TcpStream> = hostile
        .iter()
        .step_by(HOSTILE / SLOW_BODIES)
        .map(|t| t.try_clone().unwrap())
        .collect();
    let trickle = std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(BODY_TIMEOUT_SECS * 5);
        while Instant::now() < until && !trickling.is_empty() {
            trickling.retain_mut(|t| t.write_all(b" ").is_ok());
            std::thread::sleep(Duration::from_millis(100));
        }
    });

    let (status, took) = health(&addr);
    eprintln!("answered in {took:?} with {HOSTILE} hostile connections open");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(took < Duration::from_secs(1), "answered in {took:?}");

    // Every hostile connection is closed by the server: evicted for newer
    // ones, or at its header or body timeout.
    let deadline = started + Duration::from_secs(HEADER_TIMEOUT_SECS.max(BODY_TIMEOUT_SECS) + 10);
    let open = hostile
        .iter()
        .filter(|tcp| !closed_by(tcp, deadline))
        .count();
    assert_eq!(open, 0, "hostile connections still open");
    trickle.join().unwrap();
    let (status, took) = health(&addr);
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(took < Duration::from_secs(1), "answered in {took:?}");

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(child.wait().unwrap().success());
}

/// Raises this process's soft open-file limit to the hard one if it is below `want`.
fn raise_own_fd_limit(want: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current.is_some_and(|c| c < want) {
        limit.current = limit.maximum;
        setrlimit(Resource::Nofile, limit).unwrap();
    }
}
