//! [`Hub`]: fans each dialog's frames out to everyone watching it
//! (WebSocket subscriptions, streamed sends). One bounded broadcast channel
//! per watched dialog: a subscriber that falls behind by more than its
//! capacity loses the oldest frames and is told so (`Lagged`), so a slow
//! client never makes the server hold more than `capacity` frames per dialog.

use std::collections::HashMap;
use std::sync::Arc;

use keel_core::SessionId;
use parking_lot::Mutex;
use tokio::sync::broadcast;

use super::frames::ServerFrame;

/// A frame as every subscriber of a dialog receives it.
pub type SharedFrame = Arc<ServerFrame>;

/// Per-dialog broadcast of server frames; see the module docs.
#[derive(Debug)]
pub struct Hub {
    capacity: usize,
    dialogs: Mutex<HashMap<SessionId, broadcast::Sender<SharedFrame>>>,
}

impl Hub {
    /// A hub keeping at most `capacity` unread frames per dialog.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            dialogs: Mutex::new(HashMap::new()),
        }
    }

    /// Starts receiving `session`'s frames published from now on.
    pub fn subscribe(&self, session: SessionId) -> broadcast::Receiver<SharedFrame> {
        self.dialogs
            .lock()
            .entry(session)
            .or_insert_with(|| broadcast::channel(self.capacity).0)
            .subscribe()
    }

    /// Sends `frame` to `session`'s subscribers; with none, it is dropped
    /// (and the dialog's channel with it).
    pub fn publish(&self, session: SessionId, frame: ServerFrame) {
        let mut dialogs = self.dialogs.lock();
        let Some(sender) = dialogs.get(&session) else {
            return;
        };
        if sender.send(Arc::new(frame)).is_err() {
            dialogs.remove(&session);
        }
    }

    /// Whether anyone watches `session`.
    pub fn is_watched(&self, session: SessionId) -> bool {
        let mut dialogs = self.dialogs.lock();
        match dialogs.get(&session) {
            Some(sender) if sender.receiver_count() > 0 => true,
            Some(_) => {
                dialogs.remove(&session);
                false
            }
            None => false,
        }
    }
}
