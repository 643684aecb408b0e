//! Signals of background runs as the session sees them: the list of a
//! dialog's signals, and those with `steer` delivery admitted into the
//! running root turn.
//!
//! Admission has four steps so the store and the mailbox never disagree:
//! claim the session's pending steer events under a lease, reserve their
//! place in the turn's mailbox (invisible to the loop), admit them in the
//! store bound to that turn, then activate the reservation — the model reads
//! them at its next call and the turn's commit consumes them. Any failure
//! gives the events back (no attempt counted) and wakes the inbox, so they
//! are answered by a continuation turn instead. With no turn running, they
//! go that way at once.

use std::sync::Arc;

use keel_core::{Delivery, Message, SessionId, TurnOrigin};
use keel_store::{ClaimRequest, InboxEvent, LeasedEvents};

use crate::coordinator::SignalView;
use crate::error::Result;

use super::continuation::render_events;
use super::SessionManager;
use crate::clock;
use crate::mailbox::WakeSource;

/// How long admitted steer events stay leased before recovery may take them back.
const STEER_LEASE_MS: i64 = 10 * 60 * 1000;

/// The hidden message that carries steered signals into a running turn.
pub(crate) fn steer_message(events: &[InboxEvent], result_bytes: usize) -> Message {
    let text = render_events(
        "[Sub-agent news while you work. This message is written by keel, not by the user: \
         sub-agents you started sent news; take it into account in what you are doing.",
        events,
        result_bytes,
    );
    Message::user(text)
        .hidden()
        .with_origin(TurnOrigin::AgentContinuation)
}

impl SessionManager {
    /// The signals background runs of `session` emitted, newest first, at
    /// most `limit` (1..=1000), with their delivery status.
    pub async fn signals(&self, session: SessionId, limit: usize) -> Result<Vec<SignalView>> {
        let events = self
            .store
            .list_signals(session, limit.clamp(1, 1000))
            .await?;
        Ok(events.iter().filter_map(SignalView::from_event).collect())
    }

    /// Admits `session`'s pending steer signals into its running turn; with
    /// none running (or on any failure) they wait for a continuation.
    pub(crate) async fn steer_signals(self: &Arc<Self>, session: SessionId) {
        let Some(active) = self.active_turn(session) else {
            self.wake_inbox(session);
            return;
        };
        let claimed = self
            .store
            .claim_inbox_batch(ClaimRequest {
                root_session_id: session,
                now_ms: clock::now_ms(),
                lease_ms: STEER_LEASE_MS,
                max_events: self.config.mailbox.agent.max(1),
                max_bytes: self.config.inbox.batch_bytes,
                delivery: Some(Delivery::Steer),
            })
            .await;
        let lease = match claimed {
            Ok(Some(lease)) => lease,
            // A continuation or an earlier admission took them.
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(session_id = %session, error = %e, "claiming steer signals failed; they wait for a continuation");
                self.wake_inbox(session);
                return;
            }
        };
        let held = LeasedEvents {
            lease_token: lease.token.clone(),
            event_ids: lease.events.iter().map(|e| e.id).collect(),
        };
        let first = &lease.events[0];
        let wake = WakeSource::AgentSteer {
            run_id: first.run_id,
            preview: serde_json::from_str::<serde_json::Value>(&first.payload_json)
                .ok()
                .and_then(|p| p.get("summary").and_then(|s| s.as_str()).map(str::to_owned))
                .map(|s| keel_core::truncate_with_note(s, 200))
                .unwrap_or_default(),
        };
        let message = steer_message(&lease.events, self.config.inbox.result_bytes);
        let reservation = match active.mailbox.reserve(held, message, wake) {
            Ok(r) => r,
            Err((_, held)) => {
                // The turn is ending or its agent lane is full.
                self.release_unread(session, vec![held]).await;
                self.wake_inbox(session);
                return;
            }
        };
        let admitted = self
            .store
            .admit_inbox_events(
                lease.events.iter().map(|e| e.id).collect(),
                lease.token.clone(),
                active.turn_id,
                clock::now_ms(),
            )
            .await;
        let all = lease.events.len() as u64;
        match admitted {
            Ok(n) if n == all => {
                // False when the turn closed meanwhile: its closer released them.
                if !active.mailbox.activate(reservation) {
                    self.wake_inbox(session);
                }
                self.events.project(session).await;
            }
            other => {
                if let Err(e) = other {
                    tracing::warn!(session_id = %session, error = %e, "admitting steer signals failed; they wait for a continuation");
                }
                if let Some(held) = active.mailbox.withdraw(reservation) {
                    self.release_unread(session, vec![held]).await;
                }
                self.wake_inbox(session);
            }
        }
    }
}
