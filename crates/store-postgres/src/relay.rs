//! [`PgRelay`]: keel-store's `Relay` over PostgreSQL `LISTEN`/`NOTIFY` on
//! one channel, [`CHANNEL`].
//!
//! A message is `pg_notify` run on a pool connection, so it reaches the
//! listeners once that statement commits; one sender's messages arrive in
//! the order it sent them as long as it waits for each before the next.
//! Its text names the sender's generation, so a process skips its own:
//! `m<generation> <session> <payload>`, or `o<generation> <session>` for a
//! payload longer than [`RELAY_MAX_BYTES`] (PostgreSQL refuses a
//! notification of 8000 bytes or more), which receivers get as
//! [`Relayed::Oversized`].
//!
//! Each process listens on one connection of its own, outside the pool
//! (a pooled connection would be recycled, and with it the `LISTEN`). When
//! it breaks, it is opened again with backoff; once listening again the
//! receivers get [`Relayed::Lost`], since whatever was sent meanwhile is gone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keel_core::SessionId;
use keel_store::{Relay, Relayed, Result, RELAY_MAX_BYTES};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;

use crate::store::{from_pg, from_pool};

/// The notification channel every keel process on a database listens on.
pub const CHANNEL: &str = "keel_frames";

/// Messages received and not yet read, per subscriber, before it lags.
const RECEIVED_CAPACITY: usize = 4096;

/// First and longest wait before the listening connection is opened again.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(10));

/// The relay of one [`crate::PgStore`]; see the module docs.
pub(crate) struct PgRelay {
    pool: deadpool_postgres::Pool,
    /// This process's generation (the store's fence).
    generation: Arc<AtomicU64>,
    /// Messages sent so far (each carries its number).
    sent: AtomicU64,
    received: broadcast::Sender<Relayed>,
    listener: JoinHandle<()>,
}

impl Drop for PgRelay {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

/// A message's notification text (the header, and the payload when it fits).
fn encode(generation: u64, n: u64, session: SessionId, payload: &str) -> String {
    // `n` numbers the process's messages: PostgreSQL delivers identical
    // notifications of one transaction once, and a batch may repeat one.
    if payload.len() > RELAY_MAX_BYTES {
        format!("o{generation}.{n} {session}")
    } else {
        format!("m{generation}.{n} {session} {payload}")
    }
}

/// What a notification says, unless `own` sent it; `None` also for text
/// no keel sent (logged).
fn decode(text: &str, own: u64) -> Option<Relayed> {
    let parsed = (|| {
        let (kind, rest) = text.split_at_checked(1)?;
        let (generation, rest) = rest.split_once(' ')?;
        let generation: u64 = generation.split('.').next()?.parse().ok()?;
        let (session, payload) = match rest.split_once(' ') {
            Some((session, payload)) => (session, Some(payload)),
            None => (rest, None),
        };
        let session: SessionId = session.parse().ok()?;
        let relayed = match (kind, payload) {
            ("m", Some(payload)) => Relayed::Message {
                session,
                payload: payload.to_owned(),
            },
            ("o", None) => Relayed::Oversized { session },
            _ => return None,
        };
        Some((generation, relayed))
    })();
    match parsed {
        Some((generation, _)) if generation == own => None,
        Some((_, relayed)) => Some(relayed),
        None => {
            let start: String = text.chars().take(60).collect();
            tracing::warn!(
                channel = CHANNEL,
                start,
                "a notification keel did not send is ignored"
            );
            None
        }
    }
}

impl PgRelay {
    /// Starts listening with `config` and returns once the first attempt
    /// is listening or has failed (and is retried in the background).
    pub(crate) async fn start(
        pool: deadpool_postgres::Pool,
        config: tokio_postgres::Config,
        generation: Arc<AtomicU64>,
    ) -> Result<Self> {
        let tls = crate::pool::tls().map_err(crate::store::from_pg_store)?;
        let (received, _) = broadcast::channel(RECEIVED_CAPACITY);
        let (ready, first) = oneshot::channel();
        let listener = tokio::spawn(listen(
            config,
            tls,
            received.clone(),
            generation.clone(),
            ready,
        ));
        // Err: the task ended before trying (it cannot; it loops).
        let _ = first.await;
        Ok(Self {
            pool,
            generation,
            sent: AtomicU64::new(0),
            received,
            listener,
        })
    }
}

#[async_trait::async_trait]
impl Relay for PgRelay {
    async fn publish(&self, notes: Vec<(SessionId, String)>) -> Result<()> {
        if notes.is_empty() {
            return Ok(());
        }
        let generation = self.generation.load(Ordering::Acquire);
        let texts: Vec<String> = notes
            .iter()
            .map(|(session, payload)| {
                let n = self.sent.fetch_add(1, Ordering::Relaxed);
                encode(generation, n, *session, payload)
            })
            .collect();
        let client = self.pool.get().await.map_err(from_pool)?;
        // One statement, one transaction: the notes go out together, in order.
        let statement = client
            .prepare_cached("SELECT pg_notify($1, t) FROM unnest($2::text[]) AS t")
            .await
            .map_err(from_pg)?;
        client
            .execute(&statement, &[&CHANNEL, &texts])
            .await
            .map_err(from_pg)?;
        Ok(())
    }

    fn subscribe(&self) -> broadcast::Receiver<Relayed> {
        self.received.subscribe()
    }
}

/// Listens until aborted: a connection, `LISTEN`, every notification
/// delivered; after a break, again with backoff. `ready` is told once the
/// first attempt listens or fails.
async fn listen(
    config: tokio_postgres::Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    received: broadcast::Sender<Relayed>,
    generation: Arc<AtomicU64>,
    ready: oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    let mut delay = BACKOFF.0;
    let mut broke = false;
    loop {
        let outcome = listen_once(
            &config,
            &tls,
            |listening| {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(());
                }
                if listening {
                    delay = BACKOFF.0;
                    if broke {
                        // What was sent while nobody listened is gone.
                        let _ = received.send(Relayed::Lost);
                    }
                }
            },
            &received,
            &generation,
        )
        .await;
        broke = true;
        match outcome {
            Ok(()) => tracing::warn!(
                channel = CHANNEL,
                "the relay's listening connection closed; opening it again"
            ),
            Err(e) => {
                tracing::warn!(channel = CHANNEL, error = %e, retry_in_ms = delay.as_millis() as u64, "the relay's listening connection failed; opening it again")
            }
        }
        if let Some(ready) = ready.take() {
            let _ = ready.send(());
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(BACKOFF.1);
    }
}

/// One listening connection, until it ends; `listening(true)` once its
/// `LISTEN` holds, `listening(false)` if it never got there.
async fn listen_once(
    config: &tokio_postgres::Config,
    tls: &tokio_postgres_rustls::MakeRustlsConnect,
    mut listening: impl FnMut(bool),
    received: &broadcast::Sender<Relayed>,
    generation: &AtomicU64,
) -> std::result::Result<(), tokio_postgres::Error> {
    let (client, mut connection) = match config.connect(tls.clone()).await {
        Ok(pair) => pair,
        Err(e) => {
            listening(false);
            return Err(e);
        }
    };
    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
    let deliver = |message: AsyncMessage| {
        if let AsyncMessage::Notification(n) = message {
            if let Some(relayed) = decode(n.payload(), generation.load(Ordering::Acquire)) {
                // Fails only when nobody subscribes: nobody to tell.
                let _ = received.send(relayed);
            }
        }
    };
    // The connection is driven while LISTEN runs on it.
    let command = format!("LISTEN {CHANNEL}");
    let mut subscribed = Box::pin(client.batch_execute(&command));
    let listened = loop {
        tokio::select! {
            done = &mut subscribed => break done,
            message = messages.next() => match message {
                Some(Ok(message)) => deliver(message),
                Some(Err(e)) => break Err(e),
                None => {
                    listening(false);
                    return Ok(());
                }
            },
        }
    };
    drop(subscribed);
    if let Err(e) = listened {
        listening(false);
        return Err(e);
    }
    listening(true);
    while let Some(message) = messages.next().await {
        deliver(message?);
    }
    // The client is kept until here: dropping it would close the connection.
    drop(client);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_round_trips_and_its_sender_skips_it() {
        let session = SessionId::new();
        let text = encode(7, 3, session, "{\"a\": \"b c\"}");
        assert_eq!(
            decode(&text, 8),
            Some(Relayed::Message {
                session,
                payload: "{\"a\": \"b c\"}".to_owned()
            })
        );
        assert_eq!(decode(&text, 7), None);
        let long = "x".repeat(RELAY_MAX_BYTES + 1);
        let text = encode(7, 4, session, &long);
        assert!(text.len() < 100, "{text}");
        assert_eq!(decode(&text, 8), Some(Relayed::Oversized { session }));
        assert_eq!(decode("hello", 8), None);
        assert_eq!(decode(&format!("m7 {session}"), 8), None);
    }
}
