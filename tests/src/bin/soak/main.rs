//! `keel-soak --keel PATH --kills N --seconds S`: `keel serve` under
//! loopback WebSocket load, killed with SIGKILL at random instants, N
//! times. Each life: start the server (the time from spawn to its listening
//! line after a kill is the recovery time; the same on an empty data
//! directory, measured in the same run, is the baseline), run `keel doctor`
//! on the live directory (it must exit 0), check that every user message
//! acknowledged so far (its turn's `turn_committed` arrived) is stored
//! exactly once and no user message twice, then load it — clients sending
//! messages that delegate foreground and background runs (whose results
//! come back as continuation turns; the background agents emit signals,
//! one delivered as `queue`, one as `steer`), and steering running turns —
//! for a random time up to S seconds, and kill it.
//!
//! A user message counts as acknowledged when its turn's `turn_committed`
//! frame arrived: `turn_accepted` only says the turn was queued. A signal
//! counts as acknowledged when its `agent_event_updated` frame arrived (it
//! is published after the signal's commit). After every restart, in one
//! read snapshot: every acknowledged signal is stored, and every stored
//! signal is in the root agent's history exactly once if it is consumed
//! and not at all otherwise (a delivery not marked consumed would be
//! delivered again).
//!
//! With `--postgres URL` keel keeps its database on that PostgreSQL
//! server instead of in the data directory (which still holds keel.toml,
//! the agents and the scripts): the soak creates a database of its own
//! there, `keel_soak_<pid>`, empty, points every `keel serve` and `keel
//! doctor` at it with `KEEL_DATABASE_URL`, reads its audits from it, and
//! drops it at the end (the empty-start baseline gets its own,
//! `keel_soak_<pid>_empty`, each time). No failpoint is armed there: only
//! the SQLite store has them.
//!
//! It prints one summary line per 10 kills and a final report; exit 1 when
//! anything was lost, duplicated, or found by the checker. `cargo xtask
//! soak` builds and runs it.
#![allow(clippy::unwrap_used)] // a test driver: any failure is the run's failure

mod database;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use parking_lot::Mutex;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use database::{Database, Snapshot};

const USAGE: &str =
    "usage: keel-soak --keel PATH [--kills N] [--seconds S] [--clients C] [--seed X] \
                     [--data DIR] [--postgres URL]";

struct Args {
    keel: PathBuf,
    kills: u32,
    seconds: f64,
    clients: usize,
    seed: u64,
    data: Option<PathBuf>,
    /// A PostgreSQL server (a URL or a libpq `key=value` string) to keep
    /// the database on instead of SQLite.
    postgres: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        keel: PathBuf::new(),
        kills: 20,
        seconds: 2.0,
        clients: 3,
        seed: keel_core::time::now_ms().unsigned_abs(),
        data: None,
        postgres: None,
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
            "--postgres" => args.postgres = Some(value),
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
             - tool_calls: [{{name: delegate, arguments: {{mode: background, tasks: [{{agent: watcher, task: \"watch report {i}\"}}, {{agent: lookout, task: \"look out for {i}\"}}]}}}}]\n\
             - {{text: \"report {i} is being watched in the background while this answer streams on\", chunk_delay_ms: 20}}\n"
        ));
    }
    out
}

/// The script of a background agent (its own model): a signal, the same
/// signal again under its dedupe key (deduplicated when one run gets both),
/// then its result. Runs interleave on the one script, so a run may send
/// several signals, each with its own key.
fn signal_script(agent: &str, severity: &str) -> String {
    let mut out = String::from("when_exhausted: echo\nresponses:\n");
    for i in 0..400 {
        let call = format!(
            "- tool_calls: [{{name: emit_signal, arguments: {{severity: {severity}, summary: \"{agent} note {i}\", dedupe_key: \"{agent}-{i}\"}}}}]\n"
        );
        out.push_str(&call);
        out.push_str(&call);
        out.push_str(&format!("- {{text: \"{agent} done {i}\", delay_ms: 30}}\n"));
    }
    out
}

fn prepare(data: &Path) {
    std::fs::create_dir_all(data.join("agents")).unwrap();
    std::fs::write(
        data.join("keel.toml"),
        "agents_dir = \"agents\"\nroot_delegates = [\"helper\", \"watcher\", \"lookout\"]\n\n\
         [providers.default]\nkind = \"scripted\"\nscript = \"soak.yaml\"\n\
         [providers.watcher]\nkind = \"scripted\"\nscript = \"watcher.yaml\"\n\
         [providers.lookout]\nkind = \"scripted\"\nscript = \"lookout.yaml\"\n",
    )
    .unwrap();
    std::fs::write(
        data.join("agents/helper.md"),
        "---\nid: helper\ndescription: Checks things.\nllm_profile: default\n---\nYou help.\n",
    )
    .unwrap();
    for (agent, delivery, severity) in [
        ("watcher", "queue", "info"),
        ("lookout", "steer", "warning"),
    ] {
        std::fs::write(
            data.join(format!("agents/{agent}.md")),
            format!(
                "---\nid: {agent}\ndescription: Watches a report in the background.\n\
                 llm_profile: {agent}\nlimits:\n  max_iterations: 4\n\
                 signal:\n  delivery: {delivery}\n---\nYou watch.\n"
            ),
        )
        .unwrap();
        std::fs::write(
            data.join(format!("{agent}.yaml")),
            signal_script(agent, severity),
        )
        .unwrap();
    }
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
    "store::insert_signal::before_commit",
    "store::insert_signal::after_commit",
    "store::claim_inbox::after_commit",
    "store::admit_inbox::before_commit",
    "store::admit_inbox::after_commit",
    "store::release_lease::before_commit",
    "store::release_lease::after_commit",
    "store::commit_continuation::before_commit",
    "store::commit_continuation::after_commit",
];

/// Starts `keel serve` on `data` and `db` (with `failpoints` armed);
/// returns it, its address and how long it took from spawn to its
/// listening line, or None when it died before listening (at an armed
/// failpoint).
fn start(
    keel: &Path,
    data: &Path,
    db: &Database,
    failpoints: Option<&str>,
) -> Option<(Child, String, Duration)> {
    let started = Instant::now();
    let mut command = Command::new(keel);
    if let Some(spec) = failpoints {
        command.env("FAILPOINTS", spec);
    }
    db.point(&mut command);
    let mut child = command
        .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .env("KEEL_LOG", "error")
        .stdout(Stdio::piped())
        // The soak's own: a panic of the server is the first thing to read.
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    if stdout.read_line(&mut line).unwrap() == 0 {
        let status = child.wait().unwrap();
        if failpoints.is_some() {
            return None;
        }
        panic!("keel serve exited with {status} before listening (its stderr is above)");
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

/// `keel doctor` on the live directory and `db`: its number of findings.
fn doctor(keel: &Path, data: &Path, db: &Database) -> usize {
    let mut command = Command::new(keel);
    db.point(&mut command);
    let out = command
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
fn stored_user_texts(snapshot: &Snapshot) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for text in &snapshot.user_texts {
        if text.starts_with("life ") {
            *counts.entry(text.clone()).or_insert(0) += 1;
        }
    }
    counts
}

/// What one read snapshot of the database says about signals.
#[derive(Default)]
struct SignalAudit {
    /// Signals stored, by delivery.
    queue: usize,
    steer: usize,
    /// Signals consumed (delivered in a committed turn).
    consumed: usize,
    /// Of those, delivered into a running turn (a steer admission).
    into_running: usize,
    /// Acknowledged signals not stored.
    lost: usize,
    /// Signals in the root agent's history more than once.
    doubled: usize,
    /// Consumed signals not in the history, or signals in the history that
    /// are not consumed (they would be delivered again).
    unmarked: usize,
}

/// Audits the signals of one read snapshot against `acknowledged` (event
/// ids whose frames arrived): each is stored, and each stored signal is in
/// a user message of its root's history ("N. Signal from run R (…):"
/// followed by its summary in a keel:data fence) once if consumed, never
/// otherwise.
fn audit_signals(snapshot: &Snapshot, acknowledged: &HashSet<String>) -> SignalAudit {
    let mut in_history: HashMap<(&str, &str), usize> = HashMap::new();
    let mut into_running = 0;
    for text in &snapshot.user_texts {
        if !text.contains("Signal from run ") {
            continue;
        }
        let running = text.starts_with("[Sub-agent news while you work.");
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            let Some((_, rest)) = line.split_once(". Signal from run ") else {
                continue;
            };
            let run = rest.split(' ').next().unwrap_or("");
            // The summary is the first line inside the signal's data fence.
            let summary = lines
                .by_ref()
                .skip_while(|l| !l.starts_with("<<<keel:data "))
                .nth(1)
                .unwrap_or("");
            *in_history.entry((run, summary)).or_insert(0) += 1;
            into_running += usize::from(running);
        }
    }
    let mut audit = SignalAudit {
        into_running,
        ..SignalAudit::default()
    };
    let mut stored = HashSet::new();
    for signal in &snapshot.signals {
        let n = in_history
            .get(&(signal.run.as_str(), signal.summary.as_str()))
            .copied()
            .unwrap_or(0);
        let consumed = signal.status == "consumed";
        match signal.delivery.as_str() {
            "steer" => audit.steer += 1,
            _ => audit.queue += 1,
        }
        audit.consumed += usize::from(consumed);
        if n > 1 {
            audit.doubled += 1;
        }
        if (consumed && n == 0) || (!consumed && n > 0) {
            eprintln!(
                "keel-soak: signal {} of run {} ({:?}) is {} and in the history {n} times",
                signal.id, signal.run, signal.summary, signal.status
            );
            audit.unmarked += 1;
        }
        stored.insert(signal.id.as_str());
    }
    audit.lost = acknowledged
        .iter()
        .filter(|id| !stored.contains(id.as_str()))
        .count();
    audit
}

/// What the clients saw, across lives.
#[derive(Default)]
struct Ledger {
    acknowledged: Vec<String>,
    /// Ids of the signals whose `agent_event_updated` frame arrived.
    signals: HashSet<String>,
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
                "agent_event_updated" if v["event"]["type"] == "signal" => {
                    if let Some(id) = v["event"]["id"].as_str() {
                        ledger.lock().signals.insert(id.to_owned());
                    }
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
    let soak_db = format!("keel_soak_{}", std::process::id());
    let db = Database::create(args.postgres.as_deref(), &data, &soak_db);
    println!(
        "keel-soak: {} kills, up to {} s of load each, {} clients, seed {}, data {}, database {}",
        args.kills,
        args.seconds,
        args.clients,
        args.seed,
        data.display(),
        db.describe()
    );
    let mut rng = Rng(args.seed | 1);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let (mut recovery, mut empty_open) = (Vec::new(), Vec::new());
    let (mut findings, mut lost, mut duplicated) = (0usize, 0usize, 0usize);
    let (mut signal_lost, mut signal_doubled, mut signal_unmarked) = (0usize, 0usize, 0usize);
    let mut dialogs: Vec<String> = Vec::new();
    let mut failpoint_deaths = 0u32;
    let started = Instant::now();
    for life in 0..=args.kills {
        // The baseline, interleaved with the kills: an empty data directory
        // and database (dropped once the server is dead).
        if life % 10 == 0 {
            let empty = scratch.path().join(format!("empty-{life}"));
            prepare(&empty);
            let empty_db = Database::create(
                args.postgres.as_deref(),
                &empty,
                &format!("{soak_db}_empty"),
            );
            let (mut child, _, took) = start(&args.keel, &empty, &empty_db, None).unwrap();
            empty_open.push(took.as_secs_f64() * 1000.0);
            kill(&mut child);
            let _ = std::fs::remove_dir_all(&empty);
        }
        // Drawn on either backend, so that a seed loads both alike.
        let armed = (life < args.kills && rng.unit() < 0.25)
            .then(|| {
                let name = RUNTIME_FAILPOINTS[rng.next() as usize % RUNTIME_FAILPOINTS.len()];
                format!("{name}=10%return")
            })
            .filter(|_| db.has_failpoints());
        let Some((mut child, addr, took)) = start(&args.keel, &data, &db, armed.as_deref()) else {
            failpoint_deaths += 1;
            continue;
        };
        if life > 0 {
            recovery.push(took.as_secs_f64() * 1000.0);
            findings += doctor(&args.keel, &data, &db);
            let snapshot = db.snapshot();
            let stored = stored_user_texts(&snapshot);
            let acked = ledger.lock().acknowledged.clone();
            let now_lost = acked.iter().filter(|t| !stored.contains_key(*t)).count();
            let now_doubled = stored.values().filter(|n| **n > 1).count();
            if now_lost + now_doubled > 0 {
                eprintln!("keel-soak: after kill {life}: {now_lost} acknowledged messages lost, {now_doubled} stored twice");
            }
            lost = lost.max(now_lost);
            duplicated = duplicated.max(now_doubled);
            let audit = audit_signals(&snapshot, &ledger.lock().signals.clone());
            if audit.lost + audit.doubled + audit.unmarked > 0 {
                eprintln!(
                    "keel-soak: after kill {life}: {} acknowledged signals lost, {} delivered twice, {} delivered but not consumed or consumed but not delivered",
                    audit.lost, audit.doubled, audit.unmarked
                );
            }
            signal_lost = signal_lost.max(audit.lost);
            signal_doubled = signal_doubled.max(audit.doubled);
            signal_unmarked = signal_unmarked.max(audit.unmarked);
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
                "keel-soak: {} kills, {} sent, {} acknowledged, {} signals acknowledged, {} lost, {} duplicated, {} findings ({:.0} s)",
                life + 1,
                l.sent,
                l.acknowledged.len(),
                l.signals.len(),
                lost + signal_lost,
                duplicated + signal_doubled + signal_unmarked,
                findings,
                started.elapsed().as_secs_f64()
            );
        }
    }
    recovery.sort_by(f64::total_cmp);
    empty_open.sort_by(f64::total_cmp);
    let l = ledger.lock();
    let snapshot = db.snapshot();
    let runs = snapshot.runs;
    let signals = audit_signals(&snapshot, &l.signals);
    signal_lost = signal_lost.max(signals.lost);
    signal_doubled = signal_doubled.max(signals.doubled);
    signal_unmarked = signal_unmarked.max(signals.unmarked);
    println!("keel-soak report (seed {}, {}):", args.seed, db.backend());
    if db.has_failpoints() {
        println!(
            "  kills                  {} ({failpoint_deaths} of them at an armed failpoint)",
            args.kills
        );
    } else {
        println!(
            "  kills                  {} (no failpoint armed: {} has none)",
            args.kills,
            db.backend()
        );
    }
    println!("  messages sent          {}", l.sent);
    println!("  turns acknowledged     {}", l.acknowledged.len());
    println!("  turns failed/refused   {}", l.failed);
    println!("  steers sent            {}", l.steered);
    println!(
        "  sub-agent runs         {} ({} background)",
        runs.0, runs.1
    );
    println!(
        "  signals                {} stored ({} queue, {} steer), {} acknowledged, {} delivered ({} into a running turn)",
        signals.queue + signals.steer,
        signals.queue,
        signals.steer,
        l.signals.len(),
        signals.consumed,
        signals.into_running
    );
    println!("  lost                   {lost} messages, {signal_lost} signals");
    println!("  duplicated             {duplicated} messages, {signal_doubled} signals");
    println!(
        "  signal status wrong    {signal_unmarked} (delivered, not consumed, or the reverse)"
    );
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
    let bad = lost + duplicated + findings + signal_lost + signal_doubled + signal_unmarked;
    // A soak that acknowledged no turn, or delivered no signal of either
    // delivery, tested nothing.
    let idle = args.kills > 0
        && (l.acknowledged.is_empty()
            || signals.consumed == 0
            || signals.queue == 0
            || signals.steer == 0);
    if bad > 0 || idle {
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}
