//! Three `keel serve` processes on one PostgreSQL database, one of them
//! SIGKILLed mid-run and started again: the acceptance test of several
//! processes sharing a database (registrations, session leases, takeover).
//!
//! 30 dialogs, each with a client that sends its messages, one at a time,
//! to a random live process over the HTTP API (waiting for the answer,
//! read back by polling, after every other message); the root agent's
//! scripted model starts four background runs every other call, so the
//! dialogs run a few hundred background runs whose completions come back
//! as hidden continuation turns. Once a quarter of the messages are
//! acknowledged and the victim (process 0) is running a turn and a
//! background run, it is SIGKILLed and a new process 0 starts. When
//! everything settled, the database is read directly and checked:
//!
//! - every acknowledged (HTTP 2xx) input is stored once and answered once,
//!   but for at most one input per dialog whose turn the victim was running
//!   (its lease), marked unanswered; an input whose send failed (the victim
//!   died under it) is stored at most once;
//! - every background run is terminal, interrupted only if the victim ran
//!   it; each has one completion event, consumed, and delivered to its
//!   dialog in exactly one continuation;
//! - no two turns of one dialog overlap: along a dialog's history the
//!   stored times never go back, and every turn's rows are its input and
//!   its own answer (one final answer for every answered input and every
//!   continuation, none for an unanswered input);
//! - `keel doctor` finds nothing, while the processes run and after they
//!   stopped.
//!
//! It needs PostgreSQL (`KEEL_TEST_DATABASE_URL`, or an installed server
//! the harness starts); without one it prints SKIP.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio_postgres::{Client, IsolationLevel};

const PROCESSES: usize = 3;
const DIALOGS: usize = 30;
const MESSAGES_PER_DIALOG: usize = 12;
/// `storage.lease_secs`: the smallest allowed, so a takeover comes soon.
const LEASE_SECS: u64 = 3;
/// Delegations in each process's root script (four background runs each).
const DELEGATIONS_PER_LIFE: usize = 130;
/// The process that is killed.
const VICTIM: usize = 0;
/// The longest a client waits for one answer, and the test for the
/// database to settle once the clients are done.
const ANSWER_DEADLINE: Duration = Duration::from_secs(40);
const SETTLE_DEADLINE: Duration = Duration::from_secs(60);
/// How long a process may take to exit after SIGTERM once idle.
const STOP_DEADLINE: Duration = Duration::from_secs(20);
/// Between two polls of an HTTP API or the database for a condition.
const POLL: Duration = Duration::from_millis(25);

/// The root agent's model, per process life: four background runs (each
/// result its own completion), then a streamed answer (so a turn lasts
/// long enough to be caught running), over and over; then echoes.
fn root_script() -> String {
    let mut out = String::from("when_exhausted: echo\nresponses:\n");
    for i in 0..DELEGATIONS_PER_LIFE {
        out.push_str(&format!(
            "- tool_calls: [{{name: delegate, arguments: {{mode: background, completion_policy: each, \
             tasks: [{{agent: bg, task: \"job {i} a\"}}, {{agent: bg, task: \"job {i} b\"}}, \
             {{agent: bg, task: \"job {i} c\"}}, {{agent: bg, task: \"job {i} d\"}}]}}}}]\n\
             - {{text: \"answer {i} arrives a few words at a time\", chunk_delay_ms: 15}}\n"
        ));
    }
    out
}

/// The background agent's model: slow answers, so runs are in flight
/// when the victim dies.
fn bg_script() -> String {
    let mut out = String::from("when_exhausted: echo\nresponses:\n");
    for i in 0..1500 {
        out.push_str(&format!("- {{text: \"bg result {i}\", delay_ms: 200}}\n"));
    }
    out
}

fn prepare(data: &Path) {
    std::fs::create_dir_all(data.join("agents")).unwrap();
    std::fs::write(
        data.join("keel.toml"),
        format!(
            "agents_dir = \"agents\"\nroot_delegates = [\"bg\"]\n\n\
             [providers.default]\nkind = \"scripted\"\nscript = \"root.yaml\"\n\
             [providers.bg]\nkind = \"scripted\"\nscript = \"bg.yaml\"\n\n\
             [session]\nauto_title_after_n_messages = 0\n\
             [session.summary]\nenabled = false\n\n\
             [storage]\nlease_secs = {LEASE_SECS}\n"
        ),
    )
    .unwrap();
    std::fs::write(
        data.join("agents/bg.md"),
        "---\nid: bg\ndescription: Works in the background.\nllm_profile: bg\n---\nYou work.\n",
    )
    .unwrap();
    std::fs::write(data.join("root.yaml"), root_script()).unwrap();
    std::fs::write(data.join("bg.yaml"), bg_script()).unwrap();
}

/// A running `keel serve` on the test database.
struct Server {
    child: Child,
    addr: String,
    /// Its stderr so far (read on, so the pipe never fills).
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(data: &Path, url: &str) -> Server {
        let mut child = crate::keel()
            .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
            .arg(data)
            .env_remove("KEEL_TOKEN")
            .env("KEEL_DATABASE_URL", url)
            .env("KEEL_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().unwrap();
        let lines = Arc::clone(&log);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                lines.lock().push(line);
            }
        });
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).unwrap();
        if !line.starts_with("keel serve: listening on http://127.0.0.1:") {
            let _ = child.kill();
            let status = child.wait().unwrap();
            let _ = reader.join(); // its stderr, whole
            panic!(
                "keel serve did not start ({status}): {line:?}\n{}",
                log.lock().join("\n")
            );
        }
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap()
            .to_owned();
        Server { child, addr, log }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }

    /// SIGTERM, then its exit within [`STOP_DEADLINE`] (SIGKILL after):
    /// `None` when it exited 0, else what happened.
    async fn stop(&mut self) -> Option<String> {
        if let Some(status) = self.child.try_wait().unwrap() {
            return Some(format!("it had exited already ({status})"));
        }
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let until = Instant::now() + STOP_DEADLINE;
        loop {
            match self.child.try_wait().unwrap() {
                Some(status) if status.success() => return None,
                Some(status) => return Some(format!("it exited with {status} on SIGTERM")),
                None if Instant::now() > until => {
                    self.kill();
                    return Some(format!(
                        "it had not exited {} s after SIGTERM (killed)",
                        STOP_DEADLINE.as_secs()
                    ));
                }
                None => tokio::time::sleep(POLL).await,
            }
        }
    }
}

impl Drop for Server {
    /// A failed test leaves no server running.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// xorshift64*: the clients' choices of process, reproducible from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The processes' addresses by slot; `None` while a slot's process is dead.
type Addrs = Arc<Mutex<Vec<Option<String>>>>;

/// A random live process: its slot and address.
fn pick(addrs: &Addrs, rng: &mut Rng) -> (usize, String) {
    let live: Vec<(usize, String)> = addrs
        .lock()
        .iter()
        .enumerate()
        .filter_map(|(slot, a)| a.clone().map(|a| (slot, a)))
        .collect();
    live[rng.next() as usize % live.len()].clone()
}

/// One input a client sent, and what the server said.
#[derive(Debug, Clone)]
struct Sent {
    dialog: String,
    text: String,
    /// The slot of the process it was sent to.
    slot: usize,
    /// Sent to the victim's first life.
    to_victim: bool,
}

/// What the clients saw.
#[derive(Default)]
struct Ledger {
    /// Answered 2xx.
    acknowledged: Vec<Sent>,
    /// The request failed without an answer (the process died under it):
    /// the input may or may not be stored.
    unknown: Vec<Sent>,
    /// Answered with an error status.
    refused: Vec<(Sent, String)>,
    /// What went wrong on the clients' side (an answer that never came).
    problems: Vec<String>,
    /// Whether the victim has been killed (sends to it from then on are
    /// to its second life).
    victim_dead: bool,
}

async fn create_dialog(http: &reqwest::Client, addr: &str, title: &str) -> String {
    let response = http
        .post(format!("http://{addr}/api/dialogs"))
        .json(&serde_json::json!({"title": title}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "creating dialog {title}");
    let body: serde_json::Value = response.json().await.unwrap();
    body["id"].as_str().unwrap().to_owned()
}

/// Whether `text`'s turn in `dialog` ended, as the dialog's messages on a
/// random live process show it: answered (an assistant text of a user
/// turn follows it before the next user message) or marked unanswered.
async fn turn_ended(http: &reqwest::Client, addr: &str, dialog: &str, text: &str) -> bool {
    let Ok(response) = http
        .get(format!(
            "http://{addr}/api/dialogs/{dialog}/messages?limit=200"
        ))
        .send()
        .await
    else {
        return false; // that process died; ask another
    };
    let Ok(page) = response.json::<serde_json::Value>().await else {
        return false;
    };
    let items = page["items"].as_array().cloned().unwrap_or_default();
    let Some(at) = items
        .iter()
        .position(|m| m["role"] == "user" && m["text"] == text)
    else {
        return false;
    };
    if items[at]["unanswered"] == true {
        return true;
    }
    for m in &items[at + 1..] {
        let user_turn = m["turn_origin"] == "user";
        if user_turn && m["role"] == "user" {
            return false; // the next input, and ours unanswered so far
        }
        let has_calls = m["tool_calls"].as_array().is_some_and(|c| !c.is_empty());
        if user_turn && m["role"] == "assistant" && !has_calls {
            return true;
        }
    }
    false
}

/// One dialog's client: sends its messages one after another, each to a
/// random live process; waits for every other answer.
async fn client(index: usize, dialog: String, addrs: Addrs, ledger: Arc<Mutex<Ledger>>) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (index as u64 + 1).wrapping_mul(0x1000_0001));
    let mut gave_up = false;
    for n in 0..MESSAGES_PER_DIALOG {
        let text = format!("dialog {index} message {n}");
        let (slot, addr) = pick(&addrs, &mut rng);
        let sent = Sent {
            dialog: dialog.clone(),
            text: text.clone(),
            slot,
            to_victim: slot == VICTIM && !ledger.lock().victim_dead,
        };
        let response = http
            .post(format!("http://{addr}/api/dialogs/{dialog}/messages"))
            .json(&serde_json::json!({"text": text}))
            .send()
            .await;
        let acknowledged = match response {
            Ok(r) if r.status().is_success() => {
                ledger.lock().acknowledged.push(sent.clone());
                true
            }
            Ok(r) => {
                let why = format!("{} {}", r.status(), r.text().await.unwrap_or_default());
                ledger.lock().refused.push((sent.clone(), why));
                false
            }
            Err(_) => {
                ledger.lock().unknown.push(sent.clone());
                false
            }
        };
        // After one answer never came, the client only sends: the test
        // reports it, and waiting again would only add to the run's time.
        if !acknowledged || n % 2 == 1 || gave_up {
            continue;
        }
        let deadline = Instant::now() + ANSWER_DEADLINE;
        loop {
            let (_, addr) = pick(&addrs, &mut rng);
            if turn_ended(&http, &addr, &dialog, &text).await {
                break;
            }
            if Instant::now() > deadline {
                ledger.lock().problems.push(format!(
                    "{text:?} (dialog {dialog}, acknowledged by process {slot}) was neither \
                     answered nor marked unanswered within {} s",
                    ANSWER_DEADLINE.as_secs()
                ));
                gave_up = true;
                break;
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Polls `check` until it returns `Some`, failing with `what` after `deadline`.
async fn poll_until<T, F, Fut>(deadline: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + deadline;
    loop {
        if let Some(t) = check().await {
            return t;
        }
        assert!(
            Instant::now() < until,
            "timed out after {} s waiting for {what}",
            deadline.as_secs()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// The generation process `pid` registered under.
async fn generation_of(db: &Client, pid: u32) -> i64 {
    let pattern = format!("keel serve (pid {pid} on %");
    poll_until(
        Duration::from_secs(10),
        "the process's registration",
        || {
            let pattern = pattern.clone();
            async move {
                db.query_opt(
                    "SELECT generation FROM runtime_processes WHERE holder LIKE $1",
                    &[&pattern],
                )
                .await
                .unwrap()
                .map(|r| r.get(0))
            }
        },
    )
    .await
}

/// What the victim held when it died, read right after the kill (nothing
/// else touches its leases before its registration expires).
#[derive(Debug)]
struct AtKill {
    /// Dialogs whose lease it held: a turn of each was running there.
    sessions: BTreeSet<String>,
    /// Its background runs still running.
    running_runs: i64,
    /// Inputs it acknowledged but had not started.
    queued_inputs: i64,
}

async fn at_kill(db: &Client, generation: i64) -> AtKill {
    let sessions = db
        .query(
            "SELECT session_id FROM session_leases WHERE generation = $1",
            &[&generation],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let running_runs = db
        .query_one(
            "SELECT count(*) FROM agent_runs WHERE runtime_generation = $1 \
             AND mode = 'background' AND status = 'running'",
            &[&generation],
        )
        .await
        .unwrap()
        .get(0);
    let queued_inputs = db
        .query_one(
            "SELECT count(*) FROM queued_inputs WHERE generation = $1",
            &[&generation],
        )
        .await
        .unwrap()
        .get(0);
    AtKill {
        sessions,
        running_runs,
        queued_inputs,
    }
}

/// What is still in flight anywhere, or `None` when everything settled:
/// no input open or queued, every run terminal, every inbox event done,
/// no session lease held.
async fn in_flight(db: &Client) -> Option<String> {
    let row = db
        .query_one(
            "SELECT \
               (SELECT count(*) FROM messages WHERE input_state = 'open'), \
               (SELECT count(*) FROM queued_inputs), \
               (SELECT count(*) FROM agent_runs WHERE status IN ('queued', 'running', 'waiting_children')), \
               (SELECT count(*) FROM agent_inbox_events WHERE status IN ('pending', 'leased', 'admitted')), \
               (SELECT count(*) FROM session_leases WHERE generation IS NOT NULL)",
            &[],
        )
        .await
        .unwrap();
    let counts: Vec<i64> = (0..5).map(|i| row.get(i)).collect();
    if counts.iter().all(|c| *c == 0) {
        return None;
    }
    Some(format!(
        "{} open inputs, {} queued inputs, {} runs not terminal, {} inbox events not done, \
         {} session leases held",
        counts[0], counts[1], counts[2], counts[3], counts[4]
    ))
}

/// The database server's clock in Unix ms, as keel's registrations use it.
const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// The last stderr lines of each process.
fn logs(servers: &[Server]) -> String {
    servers
        .iter()
        .enumerate()
        .map(|(slot, s)| {
            let lines = s.log.lock();
            let tail = lines.len().saturating_sub(30);
            format!(
                "--- process {slot} (pid {}) stderr, last lines ---\n{}",
                s.pid(),
                lines[tail..].join("\n")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The rows behind [`in_flight`]'s counts, and the registrations.
async fn stuck(db: &Client) -> String {
    let mut out = Vec::new();
    for r in db
        .query(
            &format!("SELECT generation, holder, expires_at - {NOW_MS} FROM runtime_processes"),
            &[],
        )
        .await
        .unwrap()
    {
        out.push(format!(
            "registered: generation {} ({}), expires in {} ms",
            r.get::<_, i64>(0),
            r.get::<_, String>(1),
            r.get::<_, i64>(2)
        ));
    }
    for r in db
        .query(
            "SELECT turn_id, session_id, generation, queued_at FROM queued_inputs ORDER BY seq",
            &[],
        )
        .await
        .unwrap()
    {
        out.push(format!(
            "queued input: turn {} of dialog {}, generation {}, queued at {}",
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, i64>(2),
            r.get::<_, i64>(3)
        ));
    }
    for r in db
        .query(
            &format!(
                "SELECT e.id, e.root_session_id, e.event_type, e.status, e.attempt_count, \
                 e.lease_until - {NOW_MS}, e.next_attempt_at - {NOW_MS}, e.last_error, \
                 r.status, r.runtime_generation \
                 FROM agent_inbox_events e LEFT JOIN agent_runs r ON r.id = e.run_id \
                 WHERE e.status IN ('pending', 'leased', 'admitted') ORDER BY e.created_at"
            ),
            &[],
        )
        .await
        .unwrap()
    {
        out.push(format!(
            "inbox event {} of dialog {}: {} {}, {} attempts, lease ends in {:?} ms, next \
             attempt in {:?} ms, last error {:?}; its run is {:?} (generation {:?})",
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, String>(2),
            r.get::<_, String>(3),
            r.get::<_, i64>(4),
            r.get::<_, Option<i64>>(5),
            r.get::<_, Option<i64>>(6),
            r.get::<_, Option<String>>(7),
            r.get::<_, Option<String>>(8),
            r.get::<_, Option<i64>>(9)
        ));
    }
    for r in db
        .query(
            "SELECT session_id, generation, last_generation FROM session_leases \
             WHERE generation IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
    {
        out.push(format!(
            "session lease: dialog {} held by generation {:?} (last {})",
            r.get::<_, String>(0),
            r.get::<_, Option<i64>>(1),
            r.get::<_, i64>(2)
        ));
    }
    out.join("\n")
}

/// One stored message of a dialog.
#[derive(Debug)]
struct Row {
    seq: i64,
    role: String,
    text: String,
    has_tool_calls: bool,
    input_state: Option<String>,
    origin: String,
    created_at: i64,
}

impl Row {
    /// The first row of a turn: a user's input, or a continuation's trigger.
    fn starts_turn(&self) -> bool {
        self.role == "user" && (self.input_state.is_some() || self.origin == "agent_continuation")
    }

    fn is_final_answer(&self) -> bool {
        self.role == "assistant" && !self.has_tool_calls
    }
}

/// A completion event: its id, its run, its status.
type Completion = (String, Option<String>, String);

/// Everything the checks read, in one read snapshot.
struct Snapshot {
    /// By dialog, then timeline: rows in `seq` order.
    histories: BTreeMap<String, BTreeMap<String, Vec<Row>>>,
    /// Background runs: id, dialog, status, generation.
    runs: Vec<(String, String, String, i64)>,
    completions: Vec<Completion>,
}

async fn snapshot(db: &mut Client, dialogs: &[String]) -> Snapshot {
    let tx = db
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .unwrap();
    let mut histories: BTreeMap<String, BTreeMap<String, Vec<Row>>> = BTreeMap::new();
    for r in tx
        .query(
            "SELECT session_id, timeline_id, seq, role, content, input_state, turn_origin, \
             created_at FROM messages WHERE session_id = ANY($1) \
             ORDER BY session_id, timeline_id, seq",
            &[&dialogs],
        )
        .await
        .unwrap()
    {
        let message: keel_core::Message = serde_json::from_str(r.get(4)).unwrap();
        histories
            .entry(r.get(0))
            .or_default()
            .entry(r.get(1))
            .or_default()
            .push(Row {
                seq: r.get(2),
                role: r.get(3),
                text: message.text(),
                has_tool_calls: !message.tool_calls.is_empty(),
                input_state: r.get(5),
                origin: r.get(6),
                created_at: r.get(7),
            });
    }
    let runs = tx
        .query(
            "SELECT id, root_session_id, status, runtime_generation FROM agent_runs \
             WHERE mode = 'background'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let completions = tx
        .query(
            "SELECT id, run_id, status FROM agent_inbox_events \
             WHERE event_type IN ('completion', 'group_completion')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    tx.commit().await.unwrap();
    Snapshot {
        histories,
        runs,
        completions,
    }
}

/// `keel doctor` on the test database: `None` when clean, else its output.
fn doctor(data: &Path, url: &str) -> Option<String> {
    let out = crate::keel()
        .args(["doctor", "--data-dir"])
        .arg(data)
        .env("KEEL_DATABASE_URL", url)
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    if out.status.success() {
        return None;
    }
    Some(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// What the checks found, and what they counted.
#[derive(Default)]
struct Findings {
    problems: Vec<String>,
    unanswered: Vec<String>,
    answered: usize,
    continuations: usize,
}

impl Findings {
    fn fail(&mut self, what: String) {
        self.problems.push(what);
    }
}

/// The inputs: every acknowledged one stored once and answered, or (in
/// a dialog whose turn the victim ran, one at most) unanswered; the
/// others stored at most once.
fn check_inputs(snap: &Snapshot, ledger: &Ledger, victim: &AtKill, found: &mut Findings) {
    let mut stored: HashMap<(&str, &str), Vec<&Row>> = HashMap::new();
    for (dialog, timelines) in &snap.histories {
        for row in timelines.values().flatten() {
            if row.role == "user" && row.origin == "user" {
                stored
                    .entry((dialog.as_str(), row.text.as_str()))
                    .or_default()
                    .push(row);
            }
        }
    }
    let mut unanswered_per_dialog: HashMap<&str, usize> = HashMap::new();
    for sent in &ledger.acknowledged {
        let rows = stored
            .get(&(sent.dialog.as_str(), sent.text.as_str()))
            .map_or(&[][..], Vec::as_slice);
        match rows {
            [] => found.fail(format!(
                "acknowledged input {:?} (dialog {}, process {}) is not stored",
                sent.text, sent.dialog, sent.slot
            )),
            [row] => match row.input_state.as_deref() {
                Some("answered") => found.answered += 1,
                Some("unanswered") => {
                    found.unanswered.push(format!(
                        "{:?} (dialog {}, seq {}, sent to process {}{})",
                        sent.text,
                        sent.dialog,
                        row.seq,
                        sent.slot,
                        if sent.to_victim { ", the victim" } else { "" }
                    ));
                    *unanswered_per_dialog.entry(&sent.dialog).or_default() += 1;
                    if !victim.sessions.contains(&sent.dialog) {
                        found.fail(format!(
                            "input {:?} (dialog {}, seq {}) is unanswered, but the victim ran \
                             no turn of that dialog when it died",
                            sent.text, sent.dialog, row.seq
                        ));
                    }
                }
                other => found.fail(format!(
                    "input {:?} (dialog {}, seq {}) has input_state {other:?} after everything \
                     settled",
                    sent.text, sent.dialog, row.seq
                )),
            },
            many => found.fail(format!(
                "acknowledged input {:?} (dialog {}) is stored {} times (seqs {:?})",
                sent.text,
                sent.dialog,
                many.len(),
                many.iter().map(|r| r.seq).collect::<Vec<_>>()
            )),
        }
    }
    for (dialog, n) in unanswered_per_dialog {
        if n > 1 {
            found.fail(format!(
                "dialog {dialog} has {n} unanswered inputs: the victim ran one turn there"
            ));
        }
    }
    for sent in ledger
        .unknown
        .iter()
        .chain(ledger.refused.iter().map(|(s, _)| s))
    {
        let n = stored
            .get(&(sent.dialog.as_str(), sent.text.as_str()))
            .map_or(0, Vec::len);
        if n > 1 {
            found.fail(format!(
                "input {:?} (dialog {}), whose send got no acknowledgement, is stored {n} times",
                sent.text, sent.dialog
            ));
        }
    }
}

/// The turns of every dialog: times never go back along the history (a
/// turn opens only after the previous one committed), and each turn is
/// its start and its own answer.
fn check_turns(snap: &Snapshot, found: &mut Findings) {
    for (dialog, timelines) in &snap.histories {
        for (timeline, rows) in timelines {
            for pair in rows.windows(2) {
                if pair[1].created_at < pair[0].created_at {
                    found.fail(format!(
                        "dialog {dialog} (timeline {timeline}): seq {} was stored at {} ms, \
                         before seq {} at {} ms: two turns overlapped",
                        pair[1].seq, pair[1].created_at, pair[0].seq, pair[0].created_at
                    ));
                }
            }
            let starts: Vec<usize> = (0..rows.len()).filter(|i| rows[*i].starts_turn()).collect();
            if let Some(first) = starts.first() {
                if *first != 0 {
                    found.fail(format!(
                        "dialog {dialog}: seq {} comes before any turn started",
                        rows[0].seq
                    ));
                }
            }
            for (k, start) in starts.iter().enumerate() {
                let end = starts.get(k + 1).copied().unwrap_or(rows.len());
                let turn = &rows[*start..end];
                let answers = turn.iter().filter(|r| r.is_final_answer()).count();
                let input = &turn[0];
                let expected = match input.input_state.as_deref() {
                    Some("unanswered") => 0,
                    _ => 1,
                };
                if input.origin == "agent_continuation" {
                    found.continuations += 1;
                }
                if answers != expected {
                    found.fail(format!(
                        "dialog {dialog}: the turn of seq {} ({} {:?}, {:?}) has {answers} \
                         final answers in seqs {}..={} (expected {expected})",
                        input.seq,
                        input.origin,
                        input.input_state,
                        input.text.chars().take(60).collect::<String>(),
                        input.seq,
                        turn[turn.len() - 1].seq
                    ));
                }
                if expected == 1 && !turn[turn.len() - 1].is_final_answer() {
                    found.fail(format!(
                        "dialog {dialog}: the turn of seq {} does not end with its answer \
                         (seq {} is a {} message)",
                        input.seq,
                        turn[turn.len() - 1].seq,
                        turn[turn.len() - 1].role
                    ));
                }
            }
        }
    }
}

/// Background runs: terminal, interrupted only when the victim ran them;
/// one completion event each, consumed, in exactly one continuation.
fn check_runs(snap: &Snapshot, victim_generation: i64, found: &mut Findings) {
    let mut triggers: HashMap<&str, Vec<&str>> = HashMap::new();
    for (dialog, timelines) in &snap.histories {
        for row in timelines.values().flatten() {
            if row.role == "user" && row.origin != "user" {
                triggers.entry(dialog).or_default().push(&row.text);
            }
        }
    }
    let mut events: HashMap<&str, Vec<&Completion>> = HashMap::new();
    for e in &snap.completions {
        if let Some(run) = &e.1 {
            events.entry(run).or_default().push(e);
        }
    }
    for (run, dialog, status, generation) in &snap.runs {
        let terminal = [
            "completed",
            "failed",
            "timed_out",
            "cancelled",
            "interrupted",
        ];
        if !terminal.contains(&status.as_str()) {
            found.fail(format!(
                "background run {run} is {status} after everything settled"
            ));
        }
        if status == "interrupted" && *generation != victim_generation {
            found.fail(format!(
                "background run {run} of live process generation {generation} was interrupted"
            ));
        }
        match events.get(run.as_str()).map_or(&[][..], Vec::as_slice) {
            [(id, _, event_status)] if event_status != "consumed" => found.fail(format!(
                "the completion {id} of run {run} is {event_status}, not consumed"
            )),
            [_] => {}
            other => found.fail(format!(
                "run {run} has {} completion events: {other:?}",
                other.len()
            )),
        }
        let needle = format!("Completed run {run} (");
        let delivered: usize = triggers.get(dialog.as_str()).map_or(0, |texts| {
            texts.iter().map(|t| t.matches(&needle).count()).sum()
        });
        if delivered != 1 {
            found.fail(format!(
                "the completion of run {run} ({status}) is in {delivered} continuation \
                 messages of dialog {dialog} (expected 1)"
            ));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_on_one_database_survive_a_kill_without_losing_or_doubling_work() {
    let test_db = keel_store_postgres::require_postgres!();
    let url = test_db.conninfo.clone();
    let mut db = test_db.connect().await;
    let started = Instant::now();
    let scratch = tempfile::tempdir().unwrap();
    let data: Vec<PathBuf> = (0..PROCESSES)
        .map(|slot| {
            let dir = scratch.path().join(format!("process-{slot}"));
            prepare(&dir);
            dir
        })
        .collect();
    let start = |slot: usize| {
        let (dir, url) = (data[slot].clone(), url.clone());
        async move {
            tokio::task::spawn_blocking(move || Server::start(&dir, &url))
                .await
                .unwrap()
        }
    };
    let mut servers = Vec::new();
    for slot in 0..PROCESSES {
        servers.push(start(slot).await);
    }
    let addrs: Addrs = Arc::new(Mutex::new(
        servers.iter().map(|s| Some(s.addr.clone())).collect(),
    ));
    let mut generations = Vec::new();
    for server in &servers {
        generations.push(generation_of(&db, server.pid()).await);
    }
    let victim_generation = generations[VICTIM];

    let http = reqwest::Client::new();
    let mut dialogs = Vec::new();
    for d in 0..DIALOGS {
        let addr = servers[d % PROCESSES].addr.clone();
        dialogs.push(create_dialog(&http, &addr, &format!("dialog {d}")).await);
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let clients: Vec<_> = dialogs
        .iter()
        .enumerate()
        .map(|(d, dialog)| {
            tokio::spawn(client(
                d,
                dialog.clone(),
                Arc::clone(&addrs),
                Arc::clone(&ledger),
            ))
        })
        .collect();

    // Mid-run: a quarter of the messages acknowledged, and the victim
    // running a turn (its session lease held) and a background run.
    let quarter = DIALOGS * MESSAGES_PER_DIALOG / 4;
    poll_until(
        Duration::from_secs(60),
        "a quarter of the messages acknowledged",
        || {
            let n = ledger.lock().acknowledged.len();
            async move { (n >= quarter).then_some(()) }
        },
    )
    .await;
    let db_ref = &db;
    poll_until(
        Duration::from_secs(30),
        "the victim running a turn and a background run at once",
        || async move {
            let held = at_kill(db_ref, victim_generation).await;
            (!held.sessions.is_empty() && held.running_runs > 0).then_some(())
        },
    )
    .await;
    servers[VICTIM].kill();
    let killed_at = Instant::now();
    eprintln!(
        "multiprocess: killed process {VICTIM} (generation {victim_generation}) {:.1} s in",
        started.elapsed().as_secs_f64()
    );
    addrs.lock()[VICTIM] = None;
    ledger.lock().victim_dead = true;
    let victim = at_kill(&db, victim_generation).await;
    let victim_log = servers[VICTIM].log.lock().clone();
    servers[VICTIM] = start(VICTIM).await;
    addrs.lock()[VICTIM] = Some(servers[VICTIM].addr.clone());
    generations[VICTIM] = generation_of(&db, servers[VICTIM].pid()).await;
    // Its registration expires and a live process takes its work over.
    let until = killed_at + Duration::from_secs(4 * LEASE_SECS);
    while db
        .query_opt(
            "SELECT 1 FROM runtime_processes WHERE generation = $1",
            &[&victim_generation],
        )
        .await
        .unwrap()
        .is_some()
    {
        if Instant::now() > until {
            let registered: Vec<String> = db
                .query(
                    &format!(
                        "SELECT generation, holder, expires_at - {NOW_MS} FROM runtime_processes"
                    ),
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    format!(
                        "generation {} ({}) expires in {} ms",
                        r.get::<_, i64>(0),
                        r.get::<_, String>(1),
                        r.get::<_, i64>(2)
                    )
                })
                .collect();
            panic!(
                "the victim (generation {victim_generation}) is still registered {} s after \
                 the kill; registrations: {registered:#?}\n{}",
                killed_at.elapsed().as_secs(),
                logs(&servers)
            );
        }
        tokio::time::sleep(POLL).await;
    }
    let taken_over_after = killed_at.elapsed();
    eprintln!(
        "multiprocess: its registration was taken over {:.1} s after the kill",
        taken_over_after.as_secs_f64()
    );

    for c in clients {
        c.await.unwrap();
    }
    eprintln!(
        "multiprocess: the clients are done, {:.1} s in; waiting for the work to settle",
        started.elapsed().as_secs_f64()
    );
    let settled = Instant::now() + SETTLE_DEADLINE;
    loop {
        let Some(left) = in_flight(&db).await else {
            break;
        };
        if Instant::now() > settled {
            panic!(
                "nothing settled {} s after the clients finished: {left}\n{}\n{}",
                SETTLE_DEADLINE.as_secs(),
                stuck(&db).await,
                logs(&servers)
            );
        }
        tokio::time::sleep(POLL).await;
    }

    let snap = snapshot(&mut db, &dialogs).await;
    let ledger = std::mem::take(&mut *ledger.lock());
    let mut found = Findings::default();
    found.problems.extend(ledger.problems.iter().cloned());
    check_inputs(&snap, &ledger, &victim, &mut found);
    check_turns(&snap, &mut found);
    check_runs(&snap, victim_generation, &mut found);
    if let Some(report) = doctor(&data[1], &url) {
        found.fail(format!("keel doctor, processes running:\n{report}"));
    }
    // No live process was taken over: each is still registered.
    let registered: BTreeSet<i64> = db
        .query("SELECT generation FROM runtime_processes", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for (slot, server) in servers.iter().enumerate() {
        let generation = generations[slot];
        if !registered.contains(&generation) {
            found.fail(format!(
                "process {slot} (pid {}, generation {generation}) is alive but no longer \
                 registered: another process took its work over",
                server.pid()
            ));
        }
    }
    for (slot, server) in servers.iter_mut().enumerate() {
        if let Some(why) = server.stop().await {
            let lines = server.log.lock();
            let tail = lines.len().saturating_sub(40);
            found.fail(format!(
                "process {slot} did not stop cleanly: {why}; its stderr, last lines:\n{}",
                lines[tail..].join("\n")
            ));
        }
    }
    if let Some(report) = doctor(&data[1], &url) {
        found.fail(format!("keel doctor, processes stopped:\n{report}"));
    }

    let interrupted = snap.runs.iter().filter(|r| r.2 == "interrupted").count();
    println!(
        "multiprocess: {} dialogs, {} inputs acknowledged ({} answered, {} unanswered), \
         {} sends without an answer, {} refused; {} background runs ({interrupted} \
         interrupted), {} continuation turns; the victim held {} dialogs, {} running runs \
         and {} queued inputs when killed; taken over {:.1} s after the kill; took {:.1} s",
        DIALOGS,
        ledger.acknowledged.len(),
        found.answered,
        found.unanswered.len(),
        ledger.unknown.len(),
        ledger.refused.len(),
        snap.runs.len(),
        found.continuations,
        victim.sessions.len(),
        victim.running_runs,
        victim.queued_inputs,
        taken_over_after.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    for u in &found.unanswered {
        println!("multiprocess: unanswered (its turn ran in the victim): {u}");
    }
    for (sent, why) in &ledger.refused {
        println!(
            "multiprocess: refused: {:?} by process {}: {why}",
            sent.text, sent.slot
        );
    }
    if !found.problems.is_empty() {
        let logs: Vec<String> = std::iter::once(("victim", victim_log))
            .chain(servers.iter().map(|s| ("process", s.log.lock().clone())))
            .map(|(who, lines)| {
                let tail = lines.len().saturating_sub(30);
                format!(
                    "--- {who} stderr (last lines) ---\n{}",
                    lines[tail..].join("\n")
                )
            })
            .collect();
        panic!(
            "{} problems:\n{}\n{}",
            found.problems.len(),
            found.problems.join("\n"),
            logs.join("\n")
        );
    }
    // A run that tested nothing is no pass.
    assert!(
        snap.runs.len() >= 300,
        "only {} background runs",
        snap.runs.len()
    );
    assert!(
        interrupted > 0,
        "the victim was killed with runs running, yet none ended interrupted"
    );
    assert!(
        ledger.refused.is_empty(),
        "no send should be refused: {:?}",
        ledger.refused
    );
}
