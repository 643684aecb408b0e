//! `cargo bench -p keel-gateway --bench serve` (`cargo xtask bench serve`):
//! `keel serve` under 100 concurrent WebSocket clients sending 50 turns each
//! with the offline provider, against the same turns driven in-process
//! through `SessionManager::submit_turn` in the same run. Prints `BENCH
//! serve_… key=value` lines: turns/s and their ratio, p50/p99 turn latency,
//! errors, "database is locked" lines in the server's log, and the
//! server's resident memory at the end. Each round also runs the served
//! side with the replay window off (`server.stream_replay_secs = 0`): the
//! ratio of server CPU per turn is what keeping the window costs. Last, the
//! catch-up rate: frames per second a client reconnecting with
//! `Last-Event-ID` gets replayed from a committed turn of 5000 deltas. Then,
//! with a PostgreSQL server at hand, the same load on a server whose
//! database is PostgreSQL against one on SQLite (`serve_postgres_ratio`;
//! `-- postgres` runs only that part), with keel's CPU per turn and the
//! whole machine's (clients, keel and PostgreSQL's backends); and three
//! `keel serve` processes on one PostgreSQL database against one, then the
//! time from killing a process mid-turn to its dialog answering through
//! another (`serve_processes_ratio`, `serve_kill_to_answer`; `-- processes`
//! runs only that part).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use keel_core::{Provider, ScriptedProvider, SessionId};
use keel_gateway::app::App;
use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use tokio_tungstenite::tungstenite::Message as WsMessage;

mod support;
use support::{start_server, stop_server};

/// WebSocket frames the clients received.
static FRAMES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Concurrent clients (each on its own dialog).
const CLIENTS: usize = 100;
/// Turns each client sends, one after the other.
const TURNS: usize = 50;
/// Rounds of both sides, interleaved (the machine's load drifts; the median ratio is reported).
const ROUNDS: usize = 3;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if std::env::args().skip(1).any(|a| a == "postgres") {
        runtime.block_on(on_postgres());
        return;
    }
    if std::env::args().skip(1).any(|a| a == "processes") {
        runtime.block_on(on_processes());
        return;
    }
    runtime.block_on(async {
        println!(
            "# {CLIENTS} clients x {TURNS} turns, offline provider; {ROUNDS} rounds of in-process then keel serve"
        );
        let mut ratios = Vec::new();
        let mut window_costs = Vec::new();
        for round in 1..=ROUNDS {
            let base = in_process().await;
            report(&format!("serve_in_process round={round}"), &base);
            let unkept = over_websocket(NO_REPLAY).await;
            report(&format!("serve_websocket_no_replay round={round}"), &unkept.run);
            println!(
                "BENCH serve_server_no_replay round={round} rss_end_mib={:.1} rss_peak_mib={:.1}",
                unkept.rss_kib as f64 / 1024.0,
                unkept.hwm_kib as f64 / 1024.0
            );
            let served = over_websocket("").await;
            window_costs.push(served.server_cpu_per_turn / unkept.server_cpu_per_turn);
            report(&format!("serve_websocket round={round}"), &served.run);
            println!(
                "BENCH serve_server round={round} errors={} database_locked_lines={} rss_end_mib={:.1} rss_peak_mib={:.1}",
                served.run.errors,
                served.locked_lines,
                served.rss_kib as f64 / 1024.0,
                served.hwm_kib as f64 / 1024.0
            );
            ratios.push(served.run.turns_per_s() / base.turns_per_s());
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "BENCH serve_ratio turns_per_s_ratio_median={:.2} min={:.2} max={:.2} (goal >= 0.6)",
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1]
        );
        window_costs.sort_by(f64::total_cmp);
        println!(
            "BENCH serve_replay_window server_cpu_per_turn_ratio_median={:.3} min={:.3} max={:.3} (goal <= 1.05)",
            window_costs[window_costs.len() / 2],
            window_costs[0],
            window_costs[window_costs.len() - 1]
        );
        catch_up().await;
        on_postgres().await;
        on_processes().await;
    });
}

/// The same load on one `keel serve` with its database on PostgreSQL
/// against one on SQLite, round by round (skipped, saying so, without a
/// server: `cargo xtask bench serve` starts one). Server CPU per turn
/// counts PostgreSQL's own processes too.
async fn on_postgres() {
    use keel_store_postgres::testing::{available, Availability, TestDb};
    if available() == Availability::None {
        println!("BENCH serve_postgres skipped (no PostgreSQL server)");
        return;
    }
    let mut ratios = Vec::new();
    for round in 1..=ROUNDS {
        let machine = machine_cpu_secs();
        let sqlite = over_websocket("").await;
        let sqlite_machine = machine_cpu_secs() - machine;
        report(&format!("serve_sqlite round={round}"), &sqlite.run);
        let db = TestDb::start().await.unwrap();
        let machine = machine_cpu_secs();
        let pg = over_websocket(&format!("[storage]\nurl = {:?}\n", db.conninfo)).await;
        let pg_machine = machine_cpu_secs() - machine;
        report(&format!("serve_postgres round={round}"), &pg.run);
        let per_turn = |secs: f64, run: &Run| secs * 1000.0 / run.latencies.len().max(1) as f64;
        println!(
            "BENCH serve_postgres_cpu round={round} keel_cpu_ms_per_turn={:.3} machine_cpu_ms_per_turn={:.3} \
             sqlite_keel_cpu_ms_per_turn={:.3} sqlite_machine_cpu_ms_per_turn={:.3}",
            pg.server_cpu_per_turn * 1000.0,
            per_turn(pg_machine, &pg.run),
            sqlite.server_cpu_per_turn * 1000.0,
            per_turn(sqlite_machine, &sqlite.run),
        );
        ratios.push(pg.run.turns_per_s() / sqlite.run.turns_per_s());
        drop(db);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "BENCH serve_postgres_ratio turns_per_s_ratio_median={:.2} min={:.2} max={:.2} (goal >= 0.5)",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
}

/// The same load on three `keel serve` processes sharing one PostgreSQL
/// database against one process on it, round by round: turns/s, and CPU
/// per turn of the servers and of the whole machine (PostgreSQL's
/// backends included). Then the time from killing a process that runs a
/// dialog's turn to that dialog answering through another.
async fn on_processes() {
    use keel_store_postgres::testing::{available, Availability, TestDb};
    if available() == Availability::None {
        println!("BENCH serve_processes skipped (no PostgreSQL server)");
        return;
    }
    let mut ratios = Vec::new();
    for round in 1..=ROUNDS {
        let mut runs = Vec::new();
        for processes in [1, 3] {
            let db = TestDb::start().await.unwrap();
            let machine = machine_cpu_secs();
            // The same 16 connections on the server in all, shared out.
            let config = format!(
                "[storage]\nurl = {:?}\nmax_connections = {}\n",
                db.conninfo,
                16 / processes
            );
            let served = over_processes(&config, processes).await;
            let machine = machine_cpu_secs() - machine;
            let turns = served.run.latencies.len().max(1) as f64;
            report(
                &format!("serve_processes_{processes} round={round}"),
                &served.run,
            );
            println!(
                "BENCH serve_processes_{processes}_cpu round={round} keel_cpu_ms_per_turn={:.3} machine_cpu_ms_per_turn={:.3}",
                served.server_cpu_per_turn * 1000.0,
                machine * 1000.0 / turns,
            );
            runs.push(served.run.turns_per_s());
            drop(db);
        }
        ratios.push(runs[1] / runs[0]);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "BENCH serve_processes_ratio three_over_one_turns_per_s_median={:.2} min={:.2} max={:.2} (goal >= 1.0)",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
    kill_to_answer().await;
}

/// Kills (SIGKILL) a process while it runs a dialog's turn, then sends the
/// dialog a message through another: the time from the kill to that
/// answer, with the default `storage.lease_secs` (10 s).
async fn kill_to_answer() {
    use keel_store_postgres::testing::TestDb;
    const REPEATS: usize = 5;
    let mut took = Vec::new();
    for _ in 0..REPEATS {
        let db = TestDb::start().await.unwrap();
        let dirs: Vec<tempfile::TempDir> = [
            // The victim's model takes a minute: its turn is running when it dies.
            "responses:\n- {text: \"slow\", delay_ms: 60000}\nwhen_exhausted: echo\n",
            "responses: []\nwhen_exhausted: echo\n",
        ]
        .iter()
        .map(|script| {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("model.yaml"), script).unwrap();
            std::fs::write(
                dir.path().join("keel.toml"),
                format!(
                    "default_profile = \"model\"\n[providers.model]\nkind = \"scripted\"\nscript = \"model.yaml\"\n\
                     [session]\nauto_title_after_n_messages = 0\n[storage]\nurl = {:?}\n",
                    db.conninfo
                ),
            )
            .unwrap();
            dir
        })
        .collect();
        let (mut victim, victim_addr) = start_server(dirs[0].path());
        let (other, other_addr) = start_server(dirs[1].path());
        let http = reqwest::Client::new();
        let id = create_dialog(&http, &other_addr, serde_json::json!({})).await;
        let send = |addr: String| {
            let (http, id) = (http.clone(), id.clone());
            async move {
                http.post(format!("http://{addr}/api/dialogs/{id}/messages"))
                    .header("accept", "text/event-stream")
                    .json(&serde_json::json!({"text": "hello"}))
                    .send()
                    .await?
                    .text()
                    .await
            }
        };
        let slow = tokio::spawn(send(victim_addr));
        // The victim holds the dialog's lease once its turn runs.
        let client = db.connect().await;
        loop {
            let held = client
                .query_opt(
                    "SELECT 1 FROM session_leases WHERE session_id = $1 AND generation IS NOT NULL",
                    &[&id],
                )
                .await
                .unwrap()
                .is_some();
            if held {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let killed = Instant::now();
        victim.kill().unwrap();
        victim.wait().unwrap();
        let answer = send(other_addr).await.unwrap();
        assert!(answer.contains("turn_committed"), "{answer}");
        took.push(killed.elapsed());
        let _ = slow.await;
        stop_server(other, dirs[1].path());
        drop(db);
    }
    took.sort();
    println!(
        "BENCH serve_kill_to_answer lease_secs=10 p50_ms={:.0} max_ms={:.0} repeats={REPEATS} (goal <= 20000)",
        took[took.len() / 2].as_secs_f64() * 1000.0,
        took[took.len() - 1].as_secs_f64() * 1000.0,
    );
}

/// CPU seconds the whole machine spent so far (every core, every process:
/// the clients, keel serve and PostgreSQL's backends alike), from /proc/stat.
fn machine_cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = stat.lines().next() else {
        return 0.0;
    };
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let ticks: Vec<f64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let busy: f64 = ticks
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .take(8)
        .map(|(_, t)| t)
        .sum();
    busy / 100.0
}

/// Words of the answer the catch-up bench replays.
const CATCH_UP_WORDS: usize = 5000;
/// Replays the catch-up bench reads.
const CATCH_UP_READS: usize = 20;

/// A committed turn of [`CATCH_UP_WORDS`] deltas, then [`CATCH_UP_READS`]
/// clients reconnecting with the id of its first frame: replayed frames per second.
async fn catch_up() {
    let dir = tempfile::tempdir().unwrap();
    let words: Vec<String> = (0..CATCH_UP_WORDS).map(|i| format!("w{i}")).collect();
    std::fs::create_dir_all(dir.path().join("scripts")).unwrap();
    std::fs::write(
        dir.path().join("scripts/long.yaml"),
        format!("responses:\n  - text: \"{}\"\n", words.join(" ")),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("keel.toml"),
        "default_profile = \"long\"\n[providers.long]\nkind = \"scripted\"\nscript = \"scripts/long.yaml\"\n\
         [session]\nauto_title_after_n_messages = 0\n[server]\nstream_replay_bytes = 16777216\n",
    )
    .unwrap();
    let (child, addr) = start_server(dir.path());
    let http = reqwest::Client::new();
    let id = create_dialog(&http, &addr, serde_json::json!({})).await;
    let body = http
        .post(format!("http://{addr}/api/dialogs/{id}/messages"))
        .header("accept", "text/event-stream")
        .json(&serde_json::json!({"text": "go"}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let first = body
        .lines()
        .find_map(|l| l.strip_prefix("id: "))
        .unwrap()
        .to_owned();
    let sent = body.lines().filter(|l| l.starts_with("id: ")).count();
    let mut rates = Vec::new();
    for _ in 0..CATCH_UP_READS {
        let started = Instant::now();
        let replayed = http
            .get(format!("http://{addr}/api/dialogs/{id}/stream"))
            .header("last-event-id", &first)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let elapsed = started.elapsed();
        let frames = replayed.lines().filter(|l| l.starts_with("id: ")).count();
        assert_eq!(frames, sent - 1, "every frame after the first, once");
        rates.push(frames as f64 / elapsed.as_secs_f64());
    }
    stop_server(child, dir.path());
    rates.sort_by(f64::total_cmp);
    println!(
        "BENCH serve_catch_up frames={} frames_per_s_median={:.0} min={:.0} max={:.0}",
        sent - 1,
        rates[rates.len() / 2],
        rates[0],
        rates[rates.len() - 1]
    );
}

/// Latencies and errors of one side.
struct Run {
    elapsed: Duration,
    latencies: Vec<Duration>,
    errors: usize,
    /// CPU seconds the turns cost (server and client for the WebSocket side).
    cpu: f64,
}

impl Run {
    fn turns_per_s(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile(&self, p: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted.get(i).copied().unwrap_or_default()
    }
}

fn report(name: &str, run: &Run) {
    println!(
        "BENCH {name} turns={} secs={:.2} turns_per_s={:.0} p50_ms={:.2} p99_ms={:.2} cpu_ms_per_turn={:.3} errors={}",
        run.latencies.len(),
        run.elapsed.as_secs_f64(),
        run.turns_per_s(),
        run.percentile(0.5).as_secs_f64() * 1000.0,
        run.percentile(0.99).as_secs_f64() * 1000.0,
        run.cpu * 1000.0 / run.latencies.len().max(1) as f64,
        run.errors
    );
}

/// The baseline: the same App `keel serve` builds, its turns submitted directly.
async fn in_process() -> Run {
    let dir = tempfile::tempdir().unwrap();
    let provider: Arc<dyn Provider> = Arc::new(ScriptedProvider::offline());
    let app = App::open_with_provider("keel bench", None, Some(dir.path()), Some(provider))
        .await
        .unwrap();
    let mut sessions = Vec::new();
    for i in 0..CLIENTS {
        let id = app
            .manager
            .create_dialog("bench", "bench", Some(format!("d{i}")), None)
            .await
            .unwrap();
        sessions.push(id);
    }
    let cpu_before = cpu_secs("self");
    let started = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|id: SessionId| {
            let manager = app.manager.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0;
                for t in 0..TURNS {
                    let at = Instant::now();
                    match manager.submit_turn(id, &format!("turn {t}")).await {
                        Ok(_) => latencies.push(at.elapsed()),
                        Err(_) => errors += 1,
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut run = collect(started, tasks).await;
    run.cpu = cpu_secs("self") - cpu_before;
    run
}

async fn collect(
    started: Instant,
    tasks: Vec<tokio::task::JoinHandle<(Vec<Duration>, usize)>>,
) -> Run {
    let mut run = Run {
        elapsed: Duration::ZERO,
        latencies: Vec::new(),
        errors: 0,
        cpu: 0.0,
    };
    for task in tasks {
        let (latencies, errors) = task.await.unwrap();
        run.latencies.extend(latencies);
        run.errors += errors;
    }
    run.elapsed = started.elapsed();
    run
}

struct Served {
    run: Run,
    /// Server CPU seconds per turn.
    server_cpu_per_turn: f64,
    locked_lines: usize,
    rss_kib: u64,
    hwm_kib: u64,
}

/// CPU seconds (user + system) process `pid` ("self" for this one) used so far.
fn cpu_secs(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at the state.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// `keel.toml` of a server without the replay window.
const NO_REPLAY: &str = "[server]\nstream_replay_secs = 0\n";

/// The turns over WebSocket to a server configured by `config` (keel.toml).
async fn over_websocket(config: &str) -> Served {
    over_processes(config, 1).await
}

/// Creates a dialog through the server at `addr`; its id.
async fn create_dialog(http: &reqwest::Client, addr: &str, body: serde_json::Value) -> String {
    let dialog: serde_json::Value = http
        .post(format!("http://{addr}/api/dialogs"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    dialog["id"].as_str().unwrap().to_owned()
}

/// The load on `processes` `keel serve` processes with one `config` (one
/// database): client `i` creates its dialog through process `i + 1` and
/// sends its turns through process `i` (modulo their number), so with
/// several, every dialog is served by a process that did not create it.
async fn over_processes(config: &str, processes: usize) -> Served {
    let dirs: Vec<tempfile::TempDir> = (0..processes)
        .map(|_| {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("keel.toml"), config).unwrap();
            dir
        })
        .collect();
    let servers: Vec<(std::process::Child, String)> =
        dirs.iter().map(|d| start_server(d.path())).collect();
    let http = reqwest::Client::new();
    let mut sessions = Vec::new();
    for i in 0..CLIENTS {
        let addr = &servers[(i + 1) % processes].1;
        let body =
            serde_json::json!({"channel": "bench", "chat_id": "bench", "title": format!("d{i}")});
        let id = create_dialog(&http, addr, body).await;
        sessions.push(id.parse::<uuid::Uuid>().unwrap());
    }
    let mut sockets = Vec::new();
    for i in 0..CLIENTS {
        let addr = &servers[i % processes].1;
        let (ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/api/ws"))
            .await
            .unwrap();
        sockets.push(ws);
    }
    let pids: Vec<String> = servers.iter().map(|(c, _)| c.id().to_string()).collect();
    let servers_cpu = || pids.iter().map(|p| cpu_secs(p)).sum::<f64>();
    let cpu_before = cpu_secs("self") + servers_cpu();
    let started = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .zip(sockets)
        .map(|(session_id, mut ws)| {
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0;
                for t in 0..TURNS {
                    let at = Instant::now();
                    let frame = ClientFrame::Send {
                        id: None,
                        session_id,
                        text: Some(format!("turn {t}")),
                        parts: Vec::new(),
                        if_busy: None,
                        webhook: None,
                    };
                    let text = serde_json::to_string(&frame).unwrap();
                    if ws.send(WsMessage::text(text)).await.is_err() {
                        errors += TURNS - t;
                        break;
                    }
                    loop {
                        let Some(Ok(WsMessage::Text(text))) = ws.next().await else {
                            errors += 1;
                            break;
                        };
                        FRAMES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        // Only the frames that end a turn are decoded: the
                        // client should not be what the two cores spend on.
                        if !text.contains(r#""type":"turn_"#) && !text.contains(r#""type":"error""#)
                        {
                            continue;
                        }
                        match serde_json::from_str::<ServerFrame>(&text) {
                            Ok(ServerFrame::TurnCommitted { .. }) => {
                                latencies.push(at.elapsed());
                                break;
                            }
                            Ok(ServerFrame::TurnFailed { .. } | ServerFrame::Error { .. })
                            | Err(_) => {
                                errors += 1;
                                break;
                            }
                            Ok(_) => {}
                        }
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let server_before = servers_cpu();
    let mut run = collect(started, tasks).await;
    let server_cpu = servers_cpu() - server_before;
    run.cpu = cpu_secs("self") + servers_cpu() - cpu_before;
    println!(
        "# server cpu_ms_per_turn={:.3} frames_per_turn={:.1}",
        server_cpu * 1000.0 / run.latencies.len().max(1) as f64,
        FRAMES.swap(0, std::sync::atomic::Ordering::Relaxed) as f64
            / run.latencies.len().max(1) as f64
    );
    let (rss_kib, hwm_kib) = memory_kib(servers[0].0.id());
    let mut locked_lines = 0;
    for ((child, _), dir) in servers.into_iter().zip(&dirs) {
        let log = stop_server(child, dir.path());
        locked_lines += log
            .lines()
            .filter(|l| l.contains("database is locked"))
            .count();
    }
    Served {
        server_cpu_per_turn: server_cpu / run.latencies.len().max(1) as f64,
        run,
        locked_lines,
        rss_kib,
        hwm_kib,
    }
}
