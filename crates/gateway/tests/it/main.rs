//! Integration tests of keel-gateway, linked into one binary: the
//! configuration, the `keel` binary's own commands (`demo`, `agents
//! check`, `--help`), the shell tool confined through it, and `keel serve`
//! in-process with real clients. The chat transcripts and crash tests, which drive the
//! binary across crates, are in keel-e2e.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

mod agents_check;
mod cli;
mod config;
mod demo;
mod interop;
mod postgres;
mod serve;
mod shell_sandbox;
