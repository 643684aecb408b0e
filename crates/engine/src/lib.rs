//! The keel engine: agent loop, built-in tools, sessions with context slots,
//! incremental checkpoints, dialogs, and (later) sub-agent orchestration.
//!
//! Architecture invariant: the engine never writes SQL (it calls keel-store's
//! domain API) and never speaks HTTP (providers come in as `Arc<dyn Provider>`).

pub mod agent_loop;
pub mod coordinator;
pub mod dialog_id;
pub mod error;
pub mod gate;
pub mod manager;
pub mod session;
pub mod snapshot;
pub mod state;
pub mod tools;

pub use agent_loop::{AgentLoop, EventSink, TurnEvent, TurnHooks, TurnOutput, TurnRequest};
pub use error::{AgentError, EngineError};
