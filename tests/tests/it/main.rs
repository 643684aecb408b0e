//! End-to-end tests of keel, linked into one binary: the `keel` binary run
//! as a user runs it — chat transcripts over stdin/stdout, and crash safety
//! under `kill -9` — against a real data directory, with a
//! ScriptedProvider script standing in for the model.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

mod chat;
#[cfg(unix)]
mod crash;

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
