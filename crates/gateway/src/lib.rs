//! The `keel` binary's library: configuration, the HTTP/WebSocket server,
//! the terminal chat with its slash commands, the offline demo, `doctor`,
//! `prune`, `backup`/`restore`, `export`/`import`, `agents check`, the MCP
//! client and the trace exporter.
//!
//! Architecture invariant: keel-gateway is the only crate that talks to
//! users — the terminal, HTTP, WebSocket and wire DTOs (converted from
//! engine types by hand) belong here and nowhere else. It wires the other
//! crates together and owns no domain logic of its own.

#![deny(missing_docs)]

pub mod agents;
pub mod app;
pub mod backup;
pub mod chat;
pub mod cli;
pub mod config;
pub mod copy_cmd;
pub mod demo;
pub mod doctor;
mod error;
pub mod export;
pub mod mcp;
pub mod mcp_cmd;
pub mod metrics;
pub mod migrate_cmd;
mod profiles;
pub mod prune;
pub mod serve;
pub mod storage;
pub mod telemetry;
pub mod terminal;
pub mod trace_cmd;

pub use error::{io_err, AppError, Result};
