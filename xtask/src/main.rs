//! `cargo xtask <cmd>`: the project's automation, in Rust, with no heavy
//! dependencies. `ci` is exactly what CI runs.

mod deps;
mod live;
mod postgres;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

const USAGE: &str = "usage: cargo xtask <command>

commands:
  ci                         fmt, clippy, deps, tests, docs, the browser test, the OpenAI/AG-UI
                             Python clients (cargo-deny and schemathesis when installed)
  web                        the web page's browser test (headless Chromium, Playwright)
  deps                       check the crate layering
  postgres                   keel-store-postgres' tests on a real PostgreSQL (the ci step)
  schemathesis               schemathesis against a live keel serve's OpenAPI document (the ci step)
  tidy                       file and function sizes, dead public API, unread config keys
  bench [store|catalog|engine|serve|...]
                             run benchmarks (all when no name is given)
  fuzz <target> [--seconds N]  run a cargo-fuzz target (catalog)
  interop                    the official OpenAI and AG-UI Python clients against a live keel serve
  mcp-server-conformance     the MCP conformance suite's server scenarios against a live /mcp
  soak [--kills N] [--seconds S] [--release] [--seed X] [--postgres]
                             keel serve under WebSocket load, SIGKILLed N times (at
                             most S s of load each), keel doctor after every restart;
                             --postgres: its database on PostgreSQL (a throwaway cluster
                             as ci's, or KEEL_TEST_DATABASE_URL's server), not SQLite";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("deps") => deps_cmd(),
        Some("postgres") => postgres::run_alone(),
        Some("schemathesis") => schemathesis(),
        Some("web") => web_prerequisites().and_then(|()| web_test()),
        Some("tidy") => tidy_cmd(),
        Some("bench") => bench(&args[1..]),
        Some("fuzz") => fuzz(&args[1..]),
        Some("interop") => interop_prerequisites().and_then(|()| interop_clients()),
        Some("soak") => soak(&args[1..]),
        Some("mcp-server-conformance") => match mcp_conformance() {
            Some(bin) => mcp_server_conformance(&bin),
            None => Err(format!(
                "@modelcontextprotocol/conformance {MCP_CONFORMANCE_VERSION} is not installed; \
                 .ci/run installs it"
            )),
        },
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(format!("unknown or missing command\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let status = cmd
        .current_dir(root())
        .status()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} exited with {status}"))
    }
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.output().map(|o| o.status.success()).unwrap_or(false)
}

fn cargo_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(cargo());
    c.args(args);
    c
}

/// `cargo metadata` of the workspace with the whole resolved dependency
/// graph (every platform).
pub(crate) fn cargo_metadata() -> Result<serde_json::Value, String> {
    let mut cmd = Command::new(cargo());
    cmd.args(["metadata", "--format-version", "1", "--locked"]);
    let out = cmd
        .current_dir(root())
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata output: {e}"))
}

/// The `keel` that `cargo build --release` builds (the gateway alone, its
/// features resolved without keel-e2e's) links no failpoint: neither the
/// `fail` crate nor keel-store's `failpoints` feature is in its graph.
fn release_has_no_failpoints() -> Result<(), String> {
    let out = Command::new(cargo())
        .args(["tree", "-p", "keel-gateway", "-e", "normal", "--locked"])
        .args(["--prefix", "none", "-f", "{p} [{f}]"])
        .current_dir(root())
        .output()
        .map_err(|e| format!("cannot run cargo tree: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo tree failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let tree = String::from_utf8_lossy(&out.stdout);
    let offending: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("fail v") || l.contains("failpoints"))
        .collect();
    if offending.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the release keel would link failpoints: {}",
            offending.join("; ")
        ))
    }
}

fn deps_cmd() -> Result<(), String> {
    release_has_no_failpoints()?;
    let graph = deps::graph_from_metadata(&cargo_metadata()?)?;
    let violations = deps::check(&graph);
    if violations.is_empty() {
        let members = graph.values().filter(|p| p.workspace).count();
        println!(
            "deps: {members} workspace crates, layering ok, no failpoints in the release keel"
        );
        return Ok(());
    }
    for v in &violations {
        eprintln!("deps: {v}");
    }
    Err(format!("{} layering violation(s)", violations.len()))
}

/// The tidy checks also run as tests of this crate (so `ci` runs them);
/// this prints every problem at once.
fn tidy_cmd() -> Result<(), String> {
    let ws = tidy::Workspace::load(&root())?;
    let md = std::fs::read_to_string(root().join("docs/CONFIG.md"))
        .map_err(|e| format!("cannot read docs/CONFIG.md: {e}"))?;
    let problems = tidy::check_all(&ws, &md);
    if problems.is_empty() {
        println!("tidy: {} files ok", ws.files.len());
        return Ok(());
    }
    for p in &problems {
        eprintln!("tidy: {p}");
    }
    Err(format!("{} tidy problem(s)", problems.len()))
}

/// Set to `1` to leave the browser test out of `ci` on a machine that
/// cannot run it (CI itself never sets it: `.ci/run` installs what it needs).
const SKIP_BROWSER_TEST: &str = "KEEL_SKIP_BROWSER_TEST";
/// The browser the test drives (Debian's `chromium`, unless overridden).
const CHROMIUM_ENV: &str = "KEEL_CHROMIUM";

fn chromium() -> PathBuf {
    std::env::var_os(CHROMIUM_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"))
}

/// Whether the browser test can run here; the error says how to make it so.
fn web_prerequisites() -> Result<(), String> {
    let mut missing = Vec::new();
    if !chromium().is_file() {
        missing.push(format!(
            "Chromium at {} (apt-get install chromium, or set {CHROMIUM_ENV})",
            chromium().display()
        ));
    }
    if !succeeds(Command::new("python3").args(["-c", "import playwright.sync_api"])) {
        missing.push("Playwright for Python (python3 -m pip install playwright)".to_owned());
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the web page's browser test needs {}. .ci/run installs both; to leave the test \
         out on purpose, set {SKIP_BROWSER_TEST}=1",
        missing.join(" and ")
    ))
}

/// The target directory (`CARGO_TARGET_DIR`, else `target/`).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Builds the `keel` binary (debug) and returns its path.
fn build_keel() -> Result<PathBuf, String> {
    run(&mut cargo_cmd(&[
        "build",
        "--locked",
        "-p",
        "keel-gateway",
        "--bin",
        "keel",
    ]))?;
    Ok(target_dir().join("debug").join("keel"))
}

/// Builds `keel` and runs tests/web/test_page.py against it; screenshots
/// go to `<target>/web-screenshots`.
fn web_test() -> Result<(), String> {
    let keel = build_keel()?;
    let out = target_dir().join("web-screenshots");
    run(Command::new("python3")
        .arg("crates/gateway/tests/web/test_page.py")
        .arg("--keel")
        .arg(&keel)
        .arg("--out")
        .arg(&out)
        .arg("--chromium")
        .arg(chromium()))
}

fn ci() -> Result<(), String> {
    // Snapshots are reviewed locally; in CI a changed snapshot is a failure.
    std::env::set_var("INSTA_UPDATE", "no");
    let browser = std::env::var(SKIP_BROWSER_TEST).as_deref() != Ok("1");
    if browser {
        // Checked first: a missing browser fails at once, not after the tests.
        web_prerequisites()?;
    } else {
        println!("ci: {SKIP_BROWSER_TEST}=1: the browser test is left out");
    }
    interop_prerequisites()?;
    telemetry_prerequisites()?;
    mcp_servers_prerequisites()?;
    let nextest = succeeds(cargo_cmd(&["nextest", "--version"]).current_dir(root()));
    let deny = succeeds(cargo_cmd(&["deny", "--version"]).current_dir(root()));
    let postgres = postgres::Postgres::start()?;
    type Step = (&'static str, Box<dyn Fn() -> Result<(), String>>);
    let mut steps: Vec<Step> = vec![
        (
            "fmt",
            Box::new(|| run(&mut cargo_cmd(&["fmt", "--all", "--", "--check"]))),
        ),
        (
            "clippy",
            Box::new(|| {
                run(&mut cargo_cmd(&[
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--locked",
                    "--",
                    "-D",
                    "warnings",
                ]))
            }),
        ),
        ("deps", Box::new(deps_cmd)),
    ];
    if nextest {
        steps.push((
            "test (nextest)",
            Box::new(|| {
                run(&mut cargo_cmd(&[
                    "nextest",
                    "run",
                    "--workspace",
                    "--exclude=keel-store-postgres",
                    "--locked",
                    "--no-fail-fast",
                ]))
            }),
        ));
        let pg = postgres.clone();
        steps.push(("postgres", Box::new(move || pg.step())));
        steps.push((
            "doctests",
            Box::new(|| {
                run(&mut cargo_cmd(&[
                    "test",
                    "--workspace",
                    "--locked",
                    "--doc",
                ]))
            }),
        ));
    } else {
        steps.push((
            "test",
            Box::new(|| run(&mut cargo_cmd(&["test", "--workspace", "--locked"]))),
        ));
    }
    // A short soak: 20 kills of a loaded `keel serve`, a checker after each.
    steps.push((
        "soak",
        Box::new(|| {
            soak(&[
                "--kills".into(),
                "20".into(),
                "--seconds".into(),
                "2".into(),
            ])
        }),
    ));
    // The same on PostgreSQL, shorter, when there is a server.
    if postgres.url().is_some() {
        steps.push((
            "soak (postgres)",
            Box::new(|| {
                soak(&[
                    "--postgres".into(),
                    "--kills".into(),
                    "8".into(),
                    "--seconds".into(),
                    "2".into(),
                ])
            }),
        ));
    }
    steps.push((
        "doc",
        Box::new(|| {
            run(cargo_cmd(&["doc", "--workspace", "--no-deps", "--locked"])
                .env("RUSTDOCFLAGS", "-D warnings"))
        }),
    ));
    if succeeds(Command::new("schemathesis").arg("--version")) {
        steps.push(("schemathesis", Box::new(schemathesis)));
    } else {
        println!("ci: schemathesis not installed, skipping the API fuzz run (.ci/run installs it)");
    }
    if browser {
        steps.push(("web (browser test)", Box::new(web_test)));
    }
    steps.push(("interop clients", Box::new(interop_clients)));
    match mcp_conformance() {
        Some(bin) => {
            let client = bin.clone();
            steps.push((
                "mcp conformance (server)",
                Box::new(move || mcp_server_conformance(&bin)),
            ));
            steps.push((
                "mcp conformance (client)",
                Box::new(move || mcp_client_conformance(&client)),
            ));
        }
        None => println!(
            "ci: the MCP conformance suite is not installed, skipping its server scenarios \
             (.ci/run installs it)"
        ),
    }
    if deny {
        steps.push((
            "deny",
            Box::new(|| {
                run(&mut cargo_cmd(&[
                    "deny", "check", "bans", "licenses", "sources",
                ]))
            }),
        ));
    } else {
        println!("ci: cargo-deny not installed, skipping the license/ban check");
    }
    let total = Instant::now();
    for (name, step) in &steps {
        println!("ci: ── {name} ──");
        let started = Instant::now();
        let result = step();
        let secs = started.elapsed().as_secs_f64();
        match result {
            Ok(()) => println!("ci: {name} ok ({secs:.1} s)"),
            Err(e) => return Err(format!("step `{name}` failed after {secs:.1} s: {e}")),
        }
    }
    println!(
        "ci: all {} steps passed in {:.1} s",
        steps.len(),
        total.elapsed().as_secs_f64()
    );
    println!("ci: {}", postgres.summary());
    Ok(())
}

/// Runs schemathesis against a live `keel serve` (offline model, a token,
/// a fresh data directory) from the OpenAPI document it serves: every
/// check, a fixed seed; any server error or schema violation fails.
fn schemathesis() -> Result<(), String> {
    live::with_live_server("schemathesis", None, |server| {
        run(Command::new("schemathesis").args([
            "--config-file",
            "xtask/schemathesis.toml",
            "run",
            &format!("{}/api/openapi.json", server.url),
            "--header",
            &format!("Authorization: Bearer {}", server.token),
            "--checks",
            "all",
            "--max-examples",
            "50",
            "--seed",
            "1",
        ]))
    })
}

/// Fails unless the MCP servers keel-e2e's `mcp_external` tests run
/// (`.ci/mcp-servers` installs them) are there, or the tests are left out
/// on purpose with `KEEL_SKIP_EXTERNAL_MCP=1`.
fn mcp_servers_prerequisites() -> Result<(), String> {
    if std::env::var("KEEL_SKIP_EXTERNAL_MCP").as_deref() == Ok("1") {
        println!("ci: KEEL_SKIP_EXTERNAL_MCP=1: the external MCP server tests are left out");
        return Ok(());
    }
    let dir = std::env::var_os("KEEL_MCP_SERVERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target").join("mcp-servers"));
    let everything =
        dir.join("npm/node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    if everything.is_file() && dir.join("venv/bin/python").is_file() {
        return Ok(());
    }
    Err(format!(
        "the MCP client tests need the MCP servers in {}; run .ci/mcp-servers (.ci/run does), \
         or set KEEL_SKIP_EXTERNAL_MCP=1 to leave those tests out",
        dir.display()
    ))
}

/// Fails unless the official OpenAI and AG-UI Python clients are importable.
fn interop_prerequisites() -> Result<(), String> {
    if succeeds(Command::new("python3").args(["-c", "import openai, ag_ui.core"])) {
        return Ok(());
    }
    Err(
        "the interop check needs the openai and ag-ui-protocol Python packages; .ci/run \
         installs them"
            .to_owned(),
    )
}

/// Fails unless the `opentelemetry-proto` Python package, which keel-e2e's
/// OTLP receiver (tests/telemetry) decodes exports with, is importable.
fn telemetry_prerequisites() -> Result<(), String> {
    let import = "from opentelemetry.proto.collector.trace.v1 import trace_service_pb2";
    if succeeds(Command::new("python3").args(["-c", import])) {
        return Ok(());
    }
    Err(
        "the telemetry tests need the opentelemetry-proto Python package; .ci/run installs it"
            .to_owned(),
    )
}

/// Runs the official OpenAI and AG-UI Python clients (tests/interop)
/// against a live `keel serve` on tests/interop/fixture.
fn interop_clients() -> Result<(), String> {
    let dir = root().join("tests").join("interop");
    live::with_live_server("interop", Some(&dir.join("fixture")), |server| {
        run(Command::new("python3")
            .arg(dir.join("clients.py"))
            .env("KEEL_URL", &server.url)
            .env("KEEL_TOKEN", &server.token))
    })
}

/// The version of npm's `@modelcontextprotocol/conformance` CI runs (the
/// last that runs on Node 20); `.ci/run` installs it.
const MCP_CONFORMANCE_VERSION: &str = "0.1.13";

/// The MCP conformance suite's command, when the pinned version is
/// installed where `.ci/run` puts it (`~/.cache/keel/mcp-conformance`).
fn mcp_conformance() -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    let bin = Path::new(&home).join(".cache/keel/mcp-conformance/node_modules/.bin/conformance");
    let version = Command::new(&bin).arg("--version").output().ok()?;
    (String::from_utf8_lossy(&version.stdout).trim() == MCP_CONFORMANCE_VERSION).then_some(bin)
}

/// Runs the MCP conformance suite's server scenarios (the active suite,
/// and server-sse-polling of the pending one) against `/mcp` of a live
/// `keel serve` without a token (the suite cannot send one). The
/// scenarios that need the SDK test server's fixture tools, resources and
/// prompts are the expected failures listed in
/// tests/mcp-conformance/server-expected-failures.yml, with why: a new
/// failure, or a listed one that passes, fails the step.
fn mcp_server_conformance(bin: &Path) -> Result<(), String> {
    let dir = root().join("tests").join("mcp-conformance");
    let out = std::env::temp_dir().join(format!("keel-mcp-conformance-{}", std::process::id()));
    let result = live::with_open_live_server("mcp-conformance", |server| {
        let url = format!("{}/mcp", server.url);
        run(Command::new(bin)
            .args(["server", "--url", &url, "--expected-failures"])
            .arg(dir.join("server-expected-failures.yml"))
            .arg("--output-dir")
            .arg(&out))?;
        run(Command::new(bin)
            .args(["server", "--url", &url, "--scenario", "server-sse-polling"])
            .arg("--output-dir")
            .arg(&out))
    });
    let _ = std::fs::remove_dir_all(&out);
    result
}

/// Client scenarios keel's MCP client claims (no OAuth, no elicitation),
/// each driven by tests/mcp-conformance/client.sh through `keel mcp`.
const MCP_CLIENT_SCENARIOS: [&str; 3] = ["initialize", "tools_call", "sse-retry"];

/// Runs the MCP conformance suite's client scenarios that keel's client
/// claims against the suite's test servers; each must pass.
fn mcp_client_conformance(bin: &Path) -> Result<(), String> {
    let keel = build_keel()?;
    let driver = root()
        .join("tests")
        .join("mcp-conformance")
        .join("client.sh");
    let out = std::env::temp_dir().join(format!("keel-mcp-client-{}", std::process::id()));
    let scenario = |name: &str| {
        let mut c = Command::new(bin);
        c.args(["client", "--scenario", name, "--command"])
            .arg(&driver)
            .arg("--output-dir")
            .arg(&out)
            .env("KEEL_BIN", &keel)
            .env("KEEL_LOG", "error");
        c
    };
    let mut result = Ok(());
    for name in MCP_CLIENT_SCENARIOS {
        if let Err(e) = run(&mut scenario(name)) {
            result = Err(format!("client scenario {name}: {e}"));
            break;
        }
    }
    let _ = std::fs::remove_dir_all(&out);
    result
}

/// Every `crates/<dir>/benches/<name>.rs`, as (name, package `keel-<dir>`), sorted by name.
fn benches() -> Result<Vec<(String, String)>, String> {
    let mut found = Vec::new();
    for krate in std::fs::read_dir(root().join("crates"))
        .map_err(|e| format!("cannot list crates/: {e}"))?
        .filter_map(|e| e.ok())
    {
        let dir = krate.file_name().to_string_lossy().into_owned();
        let Ok(files) = std::fs::read_dir(krate.path().join("benches")) else {
            continue;
        };
        for file in files.filter_map(|e| e.ok()) {
            let path = file.path();
            if path.extension().is_some_and(|x| x == "rs") {
                if let Some(stem) = path.file_stem() {
                    found.push((stem.to_string_lossy().into_owned(), format!("keel-{dir}")));
                }
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Builds the soak driver and the `keel` it kills, then runs the driver
/// (`tests/src/bin/soak/`). The `keel` is keel-e2e's copy of the binary:
/// the failpoints are compiled in but none is armed, and the tests' build
/// has already compiled it. With `--postgres` the driver gets the server
/// `ci`'s PostgreSQL step would use (started here, stopped at the end).
fn soak(args: &[String]) -> Result<(), String> {
    let release = args.iter().any(|a| a == "--release");
    let on_postgres = args.iter().any(|a| a == "--postgres");
    let mut forwarded: Vec<String> = args
        .iter()
        .filter(|a| *a != "--release" && *a != "--postgres")
        .cloned()
        .collect();
    let mut build = cargo_cmd(&["build", "--locked", "-p", "keel-e2e", "--bin", "keel-e2e"]);
    build.args(["--bin", "keel-soak"]);
    if release {
        build.arg("--release");
    }
    run(&mut build)?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
        .join(if release { "release" } else { "debug" });
    forwarded.splice(
        0..0,
        [
            "--keel".to_owned(),
            target.join("keel-e2e").display().to_string(),
        ],
    );
    // Held until the driver is done: dropping it stops the cluster.
    let _postgres = if on_postgres {
        let postgres = postgres::Postgres::start()?;
        let url = postgres.url().ok_or(
            "soak --postgres needs a PostgreSQL server: install postgresql (.ci/run does) \
             or set KEEL_TEST_DATABASE_URL",
        )?;
        forwarded.extend(["--postgres".to_owned(), url]);
        Some(postgres)
    } else {
        None
    };
    run(Command::new(target.join("keel-soak")).args(&forwarded))
}

fn bench(args: &[String]) -> Result<(), String> {
    let available = benches()?;
    // The PostgreSQL benchmarks (`postgres`, and `serve`'s last part) need
    // a server: a throwaway cluster unless KEEL_TEST_DATABASE_URL names one
    // (stopped when this returns).
    let _postgres = if args.is_empty() || args.iter().any(|a| a == "postgres" || a == "serve") {
        Some(postgres::Postgres::start()?)
    } else {
        None
    };
    let names: Vec<&str> = available.iter().map(|(n, _)| n.as_str()).collect();
    for a in args {
        if !names.contains(&a.as_str()) {
            return Err(format!(
                "no benchmark {a:?}; available: {}",
                names.join(", ")
            ));
        }
    }
    for (name, package) in &available {
        if !args.is_empty() && !args.contains(name) {
            continue;
        }
        println!("bench: ── {name} ──");
        run(&mut cargo_cmd(&[
            "bench", "--locked", "-p", package, "--bench", name,
        ]))?;
    }
    Ok(())
}

/// Seconds one fuzz input may run before libFuzzer reports it as a timeout.
const FUZZ_INPUT_TIMEOUT_SECS: u32 = 5;

fn fuzz(args: &[String]) -> Result<(), String> {
    let target = match args.first().map(String::as_str) {
        Some("catalog") => "catalog_frontmatter",
        other => return Err(format!("unknown fuzz target {other:?}; available: catalog")),
    };
    let seconds = match args.get(1).map(String::as_str) {
        None => "60".to_owned(),
        Some("--seconds") => args
            .get(2)
            .filter(|s| s.parse::<u64>().is_ok())
            .cloned()
            .ok_or("--seconds needs a whole number")?,
        Some(other) => return Err(format!("unexpected argument {other:?}")),
    };
    if !succeeds(Command::new(cargo()).args(["fuzz", "--version"])) {
        println!("fuzz: installing cargo-fuzz (once)");
        run(&mut cargo_cmd(&["install", "--locked", "cargo-fuzz"]))?;
    }
    // New inputs go to the (ignored) corpus; the committed seeds, regressions
    // included, are read from fuzz/seeds/<target> on every run.
    let corpus = format!("corpus/{target}");
    let seeds = format!("seeds/{target}");
    std::fs::create_dir_all(root().join("fuzz").join(&corpus))
        .map_err(|e| format!("cannot create fuzz/{corpus}: {e}"))?;
    let status = Command::new("cargo")
        .args([
            "+nightly",
            "fuzz",
            "run",
            target,
            &corpus,
            &seeds,
            "--",
            &format!("-max_total_time={seconds}"),
            // A parse that takes this long is a hang: report it as a finding.
            &format!("-timeout={FUZZ_INPUT_TIMEOUT_SECS}"),
        ])
        .current_dir(root().join("fuzz"))
        .status()
        .map_err(|e| format!("cannot start cargo fuzz: {e}"))?;
    if status.success() {
        println!("fuzz: {target} ran {seconds} s without a crash");
        Ok(())
    } else {
        Err(format!("cargo fuzz exited with {status}"))
    }
}
