//! The `keel` binary's library: configuration, the terminal chat with its
//! slash commands, the offline demo and `agents check`.
//!
//! Architecture invariant: keel-gateway is the only crate that knows HTTP
//! servers, WebSocket and wire DTOs; it converts engine types to DTOs by hand.

#![deny(missing_docs)]

pub mod agents;
pub mod app;
pub mod chat;
pub mod cli;
pub mod config;
pub mod demo;
pub mod terminal;
