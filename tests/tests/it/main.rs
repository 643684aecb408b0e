//! End-to-end tests of keel, linked into one binary: the `keel` binary run
//! as a user runs it — chat transcripts over stdin/stdout, `keel serve`
//! under SIGTERM and SIGHUP, and crash safety under `kill -9` — against a
//! real data directory, with a ScriptedProvider script standing in for the
//! model.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

#[cfg(unix)]
mod backup;
mod chat;
#[cfg(unix)]
mod crash;
#[cfg(target_os = "linux")]
mod data_dir;
#[cfg(target_os = "linux")]
mod disk_full;
#[cfg(unix)]
mod doctor;
#[cfg(unix)]
mod export;
#[cfg(unix)]
mod failpoints;
#[cfg(unix)]
mod foreign;
#[cfg(target_os = "linux")]
mod mcp;
#[cfg(target_os = "linux")]
mod mcp_external;
#[cfg(unix)]
mod metrics;
#[cfg(unix)]
mod multiprocess;
#[cfg(unix)]
mod prune;
#[cfg(unix)]
mod serve;
#[cfg(target_os = "linux")]
mod slowloris;
#[cfg(unix)]
mod telemetry;
#[cfg(unix)]
mod webhooks;

/// A command running the `keel` binary.
///
/// Cargo builds it for these tests as keel-e2e's bin target `keel-e2e`,
/// compiled from the gateway's own `src/main.rs` (Cargo hands integration
/// tests the path of their own package's binaries only). It is built by the
/// same `cargo test` / `cargo nextest` invocation as the tests, with the
/// same features, so it is never stale and needs no nested cargo.
pub fn keel() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_keel-e2e"))
}

/// A data directory whose keel.toml loads `agents/` with one agent, `id`
/// (`description`, on the `default` profile), that the root agent may
/// delegate to when `root_delegate`.
pub fn data_dir_with_agent(
    data: &std::path::Path,
    id: &str,
    description: &str,
    root_delegate: bool,
) {
    std::fs::create_dir_all(data.join("agents")).unwrap();
    let delegates = if root_delegate {
        format!("root_delegates = [\"{id}\"]\n")
    } else {
        String::new()
    };
    std::fs::write(
        data.join("keel.toml"),
        format!("agents_dir = \"agents\"\n{delegates}"),
    )
    .unwrap();
    std::fs::write(
        data.join(format!("agents/{id}.md")),
        format!(
            "---\nid: {id}\ndescription: {description}\nllm_profile: default\n---\nYou are {id}.\n"
        ),
    )
    .unwrap();
}
