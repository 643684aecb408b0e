//! `keel-soak --keel PATH --kills N --seconds S`: `keel serve` under
//! loopback WebSocket load, killed with SIGKILL at random instants, N
//! times. Each life: start the server (the time from spawn to its listening
//! line after a kill is the recovery time; the same on an empty data
//! directory, measured in the same run, is the baseline), run `keel doctor`
//! on the live directory (it must exit 0), check that every user message
//! acknowledged so far (its turn's `turn_committed` arrived) is stored
//! exactly once and no user message twice, then load it — clients sending
//! messages that delegate foreground and background runs (whose results
//! come back as continuation turns), and steering running turns — for a
//! random time up to S seconds, and kill it. No signals are sent: no agent
//! can emit one from the binary yet.
//!
//! A user message counts as acknowledged when its turn's `turn_committed`
//! frame arrived: `turn_accepted` only says the turn was queued.
//!
//! It prints one summary line per 10 kills and a final report; exit 1 when
//! anything was lost, duplicated, or found by the checker. `cargo xtask
//! soak` builds and runs it.
#![allow(clippy::unwrap_used)] // a test driver: any failure is the run's failure

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;
use tokio_tungstenite::tungstenite::Message as WsMessage;

const USAGE: &str =
    "usage: keel-soak --keel PATH [--kills N] [--seconds S] [--clients C] [--seed X] [--data DIR]";

struct Args {
    keel: PathBuf,
    kills: u32,
    seconds: f64,
    clients: usize,
    seed: u64,
    data: Option<PathBuf>,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        keel: PathBuf::new(),
        kills: 20,
        seconds: 2.0,
        clients: 3,
        seed: keel_core::time::now_ms().unsigned_abs(),
        data: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--keel" => args.keel = PathBuf::from(&value),
            "--kills" => args.kills = value.parse().map_err(|e| bad(&e))?,
            "--seconds" => args.seconds = value.parse().map_err(|e| bad(&e))?,
            "--clients" => args.clients = value.parse().map_err(|e| bad(&e))?,
            "--seed" => args.seed = value.parse().map_err(|e| bad(&e))?,
            "--data" => args.data = Some(PathBuf::from(&value)),
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    if args.keel.as_os_str().is_empty() {
        return Err(USAGE.to_owned());
    }
    if args.seconds < 0.3 {
        return Err("--seconds must be at least 0.3".into());
    }
    Ok(args)
}

/// xorshift64*: reproducible kill instants and client choices from `--seed`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The model's script for one server life: streamed answers (so kills land
/// mid-turn), foreground and background delegations, the helper's answers.
fn script() -> String {
    let mut out = String::from("when_exhausted: echo\nresponses:\n");
    for i in 0..400 {
        out.push_str(&format!(
            "- {{text: \"streamed answer {i} arriving one word at a time so that a kill can land in the middle of it\", chunk_delay_ms: 8}}\n\
             - tool_calls: [{{name: delegate, arguments: {{tasks: [{{agent: helper, task: \"check item {i}\"}}, {{agent: helper, task: \"check item {i}b\"}}]}}}}]\n\
             - {{text: \"helper checked {i}\", chunk_delay_ms: 5}}\n\
             - {{text: \"helper checked {i}b\", chunk_delay_ms: 5}}\n\
             - {{text: \"both checks of {i} are done\", chunk_delay_ms: 5}}\n\
             - tool_calls: [{{name: delegate, arguments: {{mode: background, tasks: [{{agent: helper, task: \"file report {i}\"}}]}}}}]\n\
             - {{text: \"report {i} is being filed in the background\", chunk_delay_ms: 5}}\n\
             - {{text: \"filed report {i}\", delay_ms: 50}}\n"
        ));
    }
    out
}

fn prepare(data: &Path) {
    std::fs::create_dir_all(data.join("agents")).unwrap();
    std::fs::write(
        data.join("keel.toml"),
        "agents_dir = \"agents\"\nroot_delegates = [\"helper\"]\n\n\
         [providers.default]\nkind = \"scripted\"\nscript = \"soak.yaml\"\n",
    )
    .unwrap();
    std::fs::write(
        data.join("agents/helper.md"),
        "---\nid: helper\ndescription: Checks and files things.\nllm_profile: default\n---\nYou help.\n",
    )
    .unwrap();
    std::fs::write(data.join("soak.yaml"), script()).unwrap();
}

/// The failpoints a loaded server passes through; a quarter of the lives
/// arm one of them, so the process also dies exactly between two steps of
/// a commit, not only wherever a SIGKILL happens to land.
const RUNTIME_FAILPOINTS: &[&str] = &[
    "store::writer::before_commit",
    "store::wal_checkpoint::before",
    "store::wal_checkpoint::after",
    "store::commit_turn::before_commit",
    "store::commit_turn::after_commit",
    "store::commit_terminal::before_commit",
    "store::commit_terminal::after_commit",
    "store::claim_inbox::after_commit",
    "store::admit_inbox::before_commit",
    "store::admit_inbox::after_commit",
    "store::release_lease::before_commit",
    "store::release_lease::after_commit",
    "store::commit_continuation::before_commit",
    "store::commit_continuation::after_commit",
];

/// Starts `keel serve` on `data` (with `failpoints` armed); returns it, its
/// address and how long it took from spawn to its listening line, or None
/// when it died before listening (at an armed failpoint).
fn start(keel: &Path, data: &Path, failpoints: Option<&str>) -> Option<(Child, String, Duration)> {
    let started = Instant::now();
    let mut command = Command::new(keel);
    if let Some(spec) = failpoints {
        command.env("FAILPOINTS", spec);
    }
    let mut child = command
        .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .env("KEEL_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    if stdout.read_line(&mut line).unwrap() == 0 && failpoints.is_some() {
        child.wait().unwrap();
        return None;
    }
    let took = started.elapsed();
    // Keep reading: a closed pipe would fail the server's next print.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("keel serve printed no address: {line:?}"))
        .to_owned();
    Some((child, addr, took))
}

/// SIGKILLs `child`; false when it had already died (at a failpoint).
fn kill(child: &mut Child) -> bool {
    if child.try_wait().unwrap().is_some() {
        return false;
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    true
}

/// `keel doctor` on the live directory: its number of findings.
fn doctor(keel: &Path, data: &Path) -> usize {
    let out = Command::new(keel)
        .args(["doctor", "--data-dir"])
        .arg(data)
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    if out.status.success() {
        return 0;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!(
        "keel-soak: keel doctor found:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .filter(|l| l.starts_with("FINDING"))
        .count()
        .max(1)
}

/// How often each user message text the soak wrote (sends and steers, all
/// starting with `life `) is stored, in every dialog and branch. Sub-agent
/// tasks are user messages too, but the script repeats them in every life.
fn stored_user_texts(db: &Path) -> HashMap<String, usize> {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let mut stmt = conn
        .prepare("SELECT content FROM messages WHERE role = 'user'")
        .unwrap();
    let mut counts = HashMap::new();
    let rows = stmt.query_map([], |r| r.get::<_, String>(0)).unwrap();
    for content in rows {
        let message: keel_core::Message = serde_json::from_str(&content.unwrap()).unwrap();
        let text = message.text();
        if text.starts_with("life ") {
            *counts.entry(text).or_insert(0) += 1;
        }
    }
    counts
}

/// What the clients saw, across lives.
#[derive(Default)]
struct Ledger {
    acknowledged: Vec<String>,
    sent: u64,
    steered: u64,
    failed: u64,
}

/// One client's life: connects, then sends messages to its dialog one
/// after another, steering some of the turns, until the server dies.
async fn client(addr: String, dialog: String, name: String, ledger: Arc<Mutex<Ledger>>, seed: u64) {
    let Ok((mut ws, _)) = tokio_tungstenite::connect_async(format!("ws://{addr}/api/ws")).await
    else {
        return;
    };
    let mut rng = Rng(seed | 1);
    let mut steers = 0u64;
    for n in 0.. {
        let text = format!("{name} message {n}");
        let send = serde_json::json!({"type": "send", "id": format!("m{n}"), "session_id": dialog, "text": text});
        if ws.send(WsMessage::text(send.to_string())).await.is_err() {
            return;
        }
        ledger.lock().sent += 1;
        let mut turn: Option<String> = None;
        loop {
            let frame = match ws.next().await {
                Some(Ok(WsMessage::Text(t))) => t,
                Some(Ok(_)) => continue,
                _ => return, // the server died
            };
            let v: serde_json::Value = serde_json::from_str(&frame).unwrap();
            let kind = v["type"].as_str().unwrap_or("");
            let same_turn = turn.is_some() && v["turn_id"].as_str() == turn.as_deref();
            match kind {
                "turn_accepted" if v["id"] == format!("m{n}") => {
                    turn = v["turn_id"].as_str().map(str::to_owned);
                }
                "error" if v["id"] == format!("m{n}") => {
                    ledger.lock().failed += 1;
                    break;
                }
                "text_delta" if same_turn && rng.next() % 40 == 0 => {
                    steers += 1;
                    let steer = serde_json::json!({"type": "steer", "id": format!("t{n}"), "session_id": dialog, "text": format!("{name} steer {steers}")});
                    if ws.send(WsMessage::text(steer.to_string())).await.is_err() {
                        return;
                    }
                    ledger.lock().steered += 1;
                }
                "turn_committed" if same_turn => {
                    ledger.lock().acknowledged.push(text.clone());
                    break;
                }
                "turn_failed" if same_turn => {
                    ledger.lock().failed += 1;
                    break;
                }
                _ => {}
            }
        }
    }
}

/// Creates a dialog; None when the server died first (an armed failpoint).
async fn create_dialog(addr: &str, title: &str) -> Option<String> {
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/api/dialogs"))
        .json(&serde_json::json!({"title": title}))
        .send()
        .await
        .ok()?;
    let body: serde_json::Value = response.error_for_status().ok()?.json().await.ok()?;
    Some(body["id"].as_str()?.to_owned())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn main() -> std::process::ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("keel-soak: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let data = args
        .data
        .clone()
        .unwrap_or_else(|| scratch.path().join("data"));
    prepare(&data);
    let db = data.join("keel.db");
    println!(
        "keel-soak: {} kills, up to {} s of load each, {} clients, seed {}, data {}",
        args.kills,
        args.seconds,
        args.clients,
        args.seed,
        data.display()
    );
    let mut rng = Rng(args.seed | 1);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let (mut recovery, mut empty_open) = (Vec::new(), Vec::new());
    let (mut findings, mut lost, mut duplicated) = (0usize, 0usize, 0usize);
    let mut dialogs: Vec<String> = Vec::new();
    let mut failpoint_deaths = 0u32;
    let started = Instant::now();
    for life in 0..=args.kills {
        // The baseline, interleaved with the kills: an empty data directory.
        if life % 10 == 0 {
            let empty = scratch.path().join(format!("empty-{life}"));
            prepare(&empty);
            let (mut child, _, took) = start(&args.keel, &empty, None).unwrap();
            empty_open.push(took.as_secs_f64() * 1000.0);
            kill(&mut child);
            let _ = std::fs::remove_dir_all(&empty);
        }
        let armed = (life < args.kills && rng.unit() < 0.25).then(|| {
            let name = RUNTIME_FAILPOINTS[rng.next() as usize % RUNTIME_FAILPOINTS.len()];
            format!("{name}=10%return")
        });
        let Some((mut child, addr, took)) = start(&args.keel, &data, armed.as_deref()) else {
            failpoint_deaths += 1;
            continue;
        };
        if life > 0 {
            recovery.push(took.as_secs_f64() * 1000.0);
            findings += doctor(&args.keel, &data);
            let stored = stored_user_texts(&db);
            let acked = ledger.lock().acknowledged.clone();
            let now_lost = acked.iter().filter(|t| !stored.contains_key(*t)).count();
            let now_doubled = stored.values().filter(|n| **n > 1).count();
            if now_lost + now_doubled > 0 {
                eprintln!("keel-soak: after kill {life}: {now_lost} acknowledged messages lost, {now_doubled} stored twice");
            }
            lost = lost.max(now_lost);
            duplicated = duplicated.max(now_doubled);
        }
        if life == args.kills {
            // The last life ends gracefully: SIGTERM, exit 0.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let status = child.wait().unwrap();
            if !status.success() {
                eprintln!("keel-soak: keel serve exited with {status} after SIGTERM");
                findings += 1;
            }
            break;
        }
        let load = Duration::from_secs_f64(0.3 + rng.unit() * (args.seconds - 0.3));
        rt.block_on(async {
            while dialogs.len() < args.clients {
                let title = format!("soak {}", dialogs.len());
                let Some(dialog) = create_dialog(&addr, &title).await else {
                    break;
                };
                dialogs.push(dialog);
            }
            let tasks: Vec<_> = dialogs
                .iter()
                .enumerate()
                .map(|(c, dialog)| {
                    tokio::spawn(client(
                        addr.clone(),
                        dialog.clone(),
                        format!("life {life} client {c}"),
                        ledger.clone(),
                        rng.next(),
                    ))
                })
                .collect();
            tokio::time::sleep(load).await;
            if !kill(&mut child) {
                failpoint_deaths += 1;
            }
            for t in tasks {
                let _ = t.await;
            }
        });
        if (life + 1) % 10 == 0 {
            let l = ledger.lock();
            println!(
                "keel-soak: {} kills, {} sent, {} acknowledged, {} lost, {} duplicated, {} findings ({:.0} s)",
                life + 1,
                l.sent,
                l.acknowledged.len(),
                lost,
                duplicated,
                findings,
                started.elapsed().as_secs_f64()
            );
        }
    }
    recovery.sort_by(f64::total_cmp);
    empty_open.sort_by(f64::total_cmp);
    let l = ledger.lock();
    let runs =
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| {
                c.query_row(
                    "SELECT count(*), count(*) FILTER (WHERE mode = 'background') FROM agent_runs",
                    [],
                    |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)),
                )
            })
            .unwrap_or((0, 0));
    println!("keel-soak report (seed {}):", args.seed);
    println!(
        "  kills                  {} ({failpoint_deaths} of them at an armed failpoint)",
        args.kills
    );
    println!("  messages sent          {}", l.sent);
    println!("  turns acknowledged     {}", l.acknowledged.len());
    println!("  turns failed/refused   {}", l.failed);
    println!("  steers sent            {}", l.steered);
    println!(
        "  sub-agent runs         {} ({} background)",
        runs.0, runs.1
    );
    println!("  lost                   {lost}");
    println!("  duplicated             {duplicated}");
    println!("  checker findings       {findings}");
    println!(
        "  recovery after a kill  p50 {:.0} ms, p99 {:.0} ms ({} restarts)",
        percentile(&recovery, 50.0),
        percentile(&recovery, 99.0),
        recovery.len()
    );
    println!(
        "  empty database open    p50 {:.0} ms, p99 {:.0} ms ({} starts)",
        percentile(&empty_open, 50.0),
        percentile(&empty_open, 99.0),
        empty_open.len()
    );
    println!(
        "  recovery / empty open  {:.2} (p50)",
        percentile(&recovery, 50.0) / percentile(&empty_open, 50.0)
    );
    println!(
        "  took                   {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if lost + duplicated + findings > 0 || (args.kills > 0 && l.acknowledged.is_empty()) {
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}
