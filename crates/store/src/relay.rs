//! [`Relay`]: messages between the processes that serve one database, for
//! what is live rather than stored (the frames of a turn another process
//! runs). Nothing relayed is durable: a receiver that was not listening, or
//! whose connection broke, misses it and is told so ([`Relayed::Lost`]).

use keel_core::SessionId;
use tokio::sync::broadcast;

use crate::Result;

/// Longest payload [`Relay::publish`] relays whole, in bytes; a longer one
/// reaches the other processes as [`Relayed::Oversized`].
pub const RELAY_MAX_BYTES: usize = 7000;

/// What a [`Relay`] delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Relayed {
    /// Another process published `payload` about `session`.
    Message {
        /// The session it is about.
        session: SessionId,
        /// What the sender published.
        payload: String,
    },
    /// Another process published a payload about `session` longer than
    /// [`RELAY_MAX_BYTES`]: what it said is lost.
    Oversized {
        /// The session it was about.
        session: SessionId,
    },
    /// Messages about any session may have been lost (the receiving
    /// connection broke and was restored, or this receiver fell behind).
    Lost,
}

/// Messages between the processes that share a database (not durable).
#[async_trait::async_trait]
pub trait Relay: Send + Sync {
    /// Sends each `(session, payload)` to the other processes, in order, in
    /// one round trip (a payload longer than [`RELAY_MAX_BYTES`]: they learn
    /// only that it was too long).
    async fn publish(&self, notes: Vec<(SessionId, String)>) -> Result<()>;
    /// What other processes publish from now on (not this process's own).
    fn subscribe(&self) -> broadcast::Receiver<Relayed>;
}
