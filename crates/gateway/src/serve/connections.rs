//! The accept loop of `keel serve`: HTTP/1.1 and HTTP/2 (h2c) connections
//! served by hyper under bounds a hostile client cannot outlast.
//!
//! - At most [`ConnectionLimits::max_connections`] connections are open,
//!   below the open-file limit. When all are taken, the oldest connection
//!   with no request in flight (one that never finished its request head,
//!   or an idle keep-alive) is closed to make room, and the loop accepts
//!   no more until its socket is, so that open sockets never exceed the
//!   bound; when every one is busy the new connection is closed at once. A slowloris therefore evicts its
//!   own connections, never a client being served.
//! - A request head must arrive within the header timeout (HTTP/1; it
//!   also bounds an HTTP/1 keep-alive waiting for its next request), a
//!   request body within the body timeout of its head.
//! - A connection with no request in flight for the idle timeout is closed.
//!
//! A WebSocket keeps its connection's slot, and counts as busy, until it closes.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Bounds on connections and on how long a client may take to send a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Time to receive a request head.
    pub header_timeout: Duration,
    /// Time to receive a request body, from its head.
    pub body_timeout: Duration,
    /// Time a connection may stay open with no request in flight.
    pub idle_timeout: Duration,
}

/// How long the loop waits after a failed accept (out of file descriptors,
/// say) before it tries again, so that it does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` until `stop` is cancelled, then lets every
/// open connection finish its requests and returns once all have closed.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    stop: CancellationToken,
) {
    let slots = Arc::new(Slots::new(limits.max_connections));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let connections = TaskTracker::new();
    loop {
        let tcp = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let Some(slot) = slots.admit().await else {
            tracing::debug!("connection closed at once: every connection is busy");
            continue;
        };
        // Streamed answers are many small writes: without TCP_NODELAY each
        // one waits for the client's delayed ACK (40 ms on Linux).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY on a connection");
        }
        connections.spawn(serve_connection(
            builder.clone(),
            tcp,
            router.clone(),
            slot,
            limits.clone(),
            stop.clone(),
        ));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Serves one connection until it ends, is evicted, idles out or the server stops.
async fn serve_connection(
    builder: Arc<auto::Builder<TokioExecutor>>,
    tcp: TcpStream,
    router: Router,
    slot: Arc<Slot>,
    limits: ConnectionLimits,
    stop: CancellationToken,
) {
    let activity = slot.activity.clone();
    let body_timeout = limits.body_timeout;
    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        let busy = Busy::new(slot.clone());
        let mut request = request.map(|body| Body::new(Deadline::new(body, body_timeout)));
        request.extensions_mut().insert(busy.clone());
        let response = tower_service::Service::call(&mut router.clone(), request);
        async move {
            let response = response.await?;
            Ok::<_, std::convert::Infallible>(
                response.map(|inner| Body::new(Held { inner, _busy: busy })),
            )
        }
    });
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(tcp), service);
    tokio::pin!(connection);
    let stopping = tokio::select! {
        ended = connection.as_mut() => {
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            return;
        }
        () = activity.evicted.cancelled() => {
            tracing::debug!("idle connection closed to make room for a new one");
            return;
        }
        () = activity.idle_for(limits.idle_timeout) => {
            tracing::debug!("idle connection closed");
            return;
        }
        () = stop.cancelled() => true,
    };
    if stopping {
        connection.as_mut().graceful_shutdown();
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "connection ended with an error while shutting down");
        }
    }
}

/// The open connections, oldest first, each with its activity.
struct Slots {
    max: usize,
    state: Mutex<SlotState>,
    /// Notified whenever a connection's socket is closed.
    freed: Notify,
}

struct SlotState {
    next_id: u64,
    /// Sockets open, evicted ones included until they are closed.
    sockets: usize,
    /// Connections not evicted, by age.
    open: BTreeMap<u64, Arc<Activity>>,
}

impl Slots {
    fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            state: Mutex::new(SlotState {
                next_id: 0,
                sockets: 0,
                open: BTreeMap::new(),
            }),
            freed: Notify::new(),
        }
    }

    /// A slot for a new connection. When all are taken, the oldest idle
    /// connection is evicted and its socket awaited, so that the sockets
    /// open never exceed the bound (nor the file descriptors reserved for
    /// them); `None` when every open connection is busy.
    async fn admit(self: &Arc<Self>) -> Option<Arc<Slot>> {
        loop {
            // Created before the count is read: a socket closed in between wakes it.
            let freed = self.freed.notified();
            {
                let mut state = self.state.lock();
                if state.sockets < self.max {
                    return Some(self.insert(&mut state));
                }
                let oldest_idle = state
                    .open
                    .iter()
                    .find(|(_, a)| a.busy.load(Ordering::Acquire) == 0)
                    .map(|(id, _)| *id);
                match oldest_idle.and_then(|id| state.open.remove(&id)) {
                    Some(activity) => activity.evicted.cancel(),
                    // Nothing to evict and nothing being evicted: all are busy.
                    None if state.sockets == state.open.len() => return None,
                    None => {}
                }
            }
            freed.await;
        }
    }

    fn insert(self: &Arc<Self>, state: &mut SlotState) -> Arc<Slot> {
        let id = state.next_id;
        state.next_id += 1;
        state.sockets += 1;
        let activity = Arc::new(Activity::default());
        state.open.insert(id, activity.clone());
        Arc::new(Slot {
            id,
            slots: self.clone(),
            activity,
        })
    }
}

/// A connection's place among the open ones, freed when the connection and
/// every request and WebSocket of it have ended.
struct Slot {
    id: u64,
    slots: Arc<Slots>,
    activity: Arc<Activity>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut state = self.slots.state.lock();
            state.sockets -= 1;
            state.open.remove(&self.id);
        }
        self.slots.freed.notify_waiters();
    }
}

/// What a connection is doing: requests in flight, and whether it was evicted.
#[derive(Default)]
struct Activity {
    busy: AtomicUsize,
    changed: Notify,
    evicted: CancellationToken,
}

impl Activity {
    /// Completes once no request has been in flight for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            // Created before the count is read: a change in between wakes it.
            let changed = self.changed.notified();
            if self.busy.load(Ordering::Acquire) == 0 {
                if tokio::time::timeout(idle, changed).await.is_err() {
                    return;
                }
            } else {
                changed.await;
            }
        }
    }
}

/// A request (or WebSocket) in flight on a connection; it keeps the
/// connection's slot and makes it busy until dropped.
pub(crate) struct Busy(Arc<Slot>);

impl Busy {
    fn new(slot: Arc<Slot>) -> Self {
        slot.activity.busy.fetch_add(1, Ordering::AcqRel);
        slot.activity.changed.notify_waiters();
        Self(slot)
    }
}

impl Clone for Busy {
    fn clone(&self) -> Self {
        Self::new(self.0.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.activity.busy.fetch_sub(1, Ordering::AcqRel);
        self.0.activity.changed.notify_waiters();
    }
}

/// A response body that keeps its request [`Busy`] until it is sent or dropped.
struct Held {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that fails once its deadline has passed.
struct Deadline {
    inner: hyper::body::Incoming,
    timeout: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl Deadline {
    fn new(inner: hyper::body::Incoming, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(std::io::Error::other)));
        }
        match this.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the request body did not arrive within {} s (server.body_timeout_secs)",
                    this.timeout.as_secs()
                ),
            )))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
