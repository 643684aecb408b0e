//! Integration tests of keel-store, linked into one binary (one link on CI
//! instead of one per file).
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

mod backup;
mod check;
mod common;
mod compression;
mod history;
mod mcp;
mod migrations;
mod observe;
mod orchestration;
mod projection;
mod purge;
mod runtime;
mod sessions;
mod spend;
mod stored_enums;
mod timelines;
mod webhooks;
mod write_cache;
mod writer;
