//! Integration tests of keel-engine, linked into one binary (one link on CI
//! instead of one per file).
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

mod agent_loop;
mod approvals;
mod budgets;
mod common;
mod compaction;
mod coordinator;
mod exports;
mod gate;
mod housekeeping;
mod inbox;
mod memory;
mod reload;
mod sessions;
mod worker;
