//! keel's storage boundary and its SQLite backend: schema v17, forward-only
//! migrations, group commit, domain APIs. With keel-store-postgres, the only
//! crates that know SQL.
//!
//! [`Backend`] is the boundary: every transaction the engine and gateway
//! need. [`Store`] is a cheap, cloneable handle over any backend; the engine
//! and gateway hold a `Store` and never learn which database is behind it.
//! This crate's backend is [`SqliteStore`] (the embedded default); the
//! PostgreSQL one lives in keel-store-postgres, so a SQLite-only build links
//! no PostgreSQL client.
//!
//! [`SqliteStore`] holds one write connection and a
//! small pool of read-only ones. With `synchronous=NORMAL` a write that finds
//! the write connection idle commits right on the caller's thread (no
//! hand-off; it never waits on a lock there). Otherwise — contention, a lock
//! held by another connection, a retry, or any commit under `FULL`, which
//! waits for an fsync — a writer thread commits every waiting request in one
//! `BEGIN IMMEDIATE` transaction (group commit), each in its own savepoint;
//! it also checkpoints the WAL, between transactions, so no caller's thread
//! ever pays for a checkpoint. Every request is answered only after
//! `COMMIT`.
//!
//! Every public method is one transaction (a read sees one snapshot), except
//! [`Backend::prune_checkpoints`] and [`Backend::delete_checkpoints`]: they delete
//! in bounded batches, each its own transaction, so other sessions' turns
//! never wait behind one long delete. That is safe because each batch removes
//! only what nothing reaches: a checkpoint the policy selects (its children
//! re-parented in the same transaction), then messages and timelines that no
//! session head or checkpoint reaches. Nothing can come to reach them again
//! (new heads and forks start only from existing checkpoints), so a crash
//! between batches leaves a consistent database with some garbage left for
//! the next prune.
//!
//! ```
//! # async fn demo() -> keel_store::Result<()> {
//! use keel_core::{CheckpointId, Message, SessionId};
//! use keel_store::*;
//!
//! let dir = tempfile::tempdir().expect("tempdir");
//! let store = Store::open(dir.path().join("keel.db"), StoreOptions::default())?;
//! let session = store
//!     .create_session(NewSession {
//!         id: SessionId::new(),
//!         channel: "cli_chat".into(),
//!         chat_id: "me".into(),
//!         dialog_id: "default".into(),
//!         title: "Dialog default".into(),
//!         agent_id: None,
//!         parent_id: None,
//!         delivery_context: None,
//!         now_ms: keel_core::time::now_ms(),
//!     })
//!     .await?;
//! // One turn = one transaction: messages, state blob, checkpoint, counters.
//! let committed = store
//!     .commit_turn(TurnCommit {
//!         session_id: session.id,
//!         calls: None,
//!         messages: vec![
//!             NewMessage::new(Message::user("hi")),
//!             NewMessage::new(Message::assistant("hello")),
//!         ],
//!         state: br#"{"turn":1}"#.to_vec(),
//!         checkpoint: Some(NewCheckpoint {
//!             id: CheckpointId::new(),
//!             turn_index: 1,
//!             source: CheckpointSource::Turn,
//!         }),
//!         visible_user_inputs: 1,
//!         answers: Vec::new(),
//!         expected_head: None,
//!         now_ms: keel_core::time::now_ms(),
//!     })
//!     .await?;
//! assert_eq!(committed.seqs, [1, 2]);
//! let history = store.load_messages(session.id, MessageFilter::default()).await?;
//! assert_eq!(history.len(), 2);
//! # Ok(())
//! # }
//! # tokio::runtime::Builder::new_current_thread().build().expect("rt").block_on(demo()).expect("demo");
//! ```
#![warn(missing_docs)]

/// Marks failpoint `$name` (listed in [`failpoints::FAILPOINTS`]); compiles
/// to nothing without the `failpoints` feature.
macro_rules! failpoint {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        $crate::failpoints::hit($name);
    };
}

mod approvals;
mod backend;
mod backup;
mod calls;
mod check;
mod checkpoints;
mod compact;
mod compress;
#[cfg(feature = "conformance")]
pub mod conformance;
mod constraints;
mod counters;
mod db;
mod error;
#[cfg(feature = "failpoints")]
pub mod failpoints;
mod identify;
mod images;
mod inbox;
mod mcp;
mod messages;
mod metrics;
mod migrations;
mod observe;
#[cfg(feature = "testing")]
mod outline;
mod processes;
mod projection;
mod purge;
mod queued;
mod relay;
mod rows;
mod runs;
mod runtime;
mod sessions;
mod spend;
mod sqlite;
mod tree;
mod util;
mod webhooks;

use std::path::Path;
use std::sync::Arc;

pub use approvals::{
    ApprovalRecord, ApprovalResultCommit, ApprovalSchedule, ApprovalStatus, DecideApproval,
    DecideOutcome, Decision, NewApproval, PausedTurnCommit,
};
pub use backend::{Backend, DialogFilter};
pub use backup::{backup_database, restore_database, CopyProgress, CopyReport, RestoreReport};
pub use calls::{CallKind, CallSpan, TurnCalls, MAX_CALL_SPANS};
pub use check::{
    check_database, AwaitingApproval, CheckOptions, CheckedCounts, Finding, Invariant,
    InvariantReport, StateDecoder,
};
pub use checkpoints::{
    CheckpointCursor, CheckpointRecord, CheckpointSource, NewCheckpoint, PrunePolicy, PruneReport,
};
pub use compact::{compact_database, CompactReport};
pub use counters::{CounterRepair, InboxCounts, InboxUsage};
pub use db::{CommitStats, StoreOptions, Synchronous};
pub use error::{Result, StoreError};
pub use identify::database_version;
pub use images::StoredImage;
pub use inbox::{
    signal_wait_ms, ClaimRequest, ContinuationCommit, ContinuationCommitted, EventStatus,
    EventType, InboxEvent, InboxLease, InboxSchedule, LeasedEvents, NewSignal, NoticeCommit,
    ReleaseReport, ReleaseRequest, ScopeKind, SignalCommit, SignalLimits, MAX_SIGNAL_PAYLOAD_BYTES,
    SIGNAL_KEY_SEPARATOR,
};
pub use mcp::McpManifestRecord;
pub use messages::{
    HistoryDelta, InputState, MessageFilter, MessagePage, NewMessage, OpenTurn, SessionHead,
    StoredMessage, TurnCommit, TurnCommitted, DEFAULT_SLOT,
};
pub use migrations::SCHEMA_VERSION;
pub use observe::{InboxGauges, MAX_TRACE_RUNS};
pub use processes::{ProcessRecovery, SessionLease};
pub use projection::{AgentChanges, EventCursor, RunQuery};
pub use purge::{DialogUsage, PurgeReport};
pub use queued::QueuedInput;
pub use relay::{Relay, Relayed, RELAY_MAX_BYTES};
pub use rows::{
    is_copied, not_empty, read_sqlite_tables, Cell, ChunkBuilder, SqliteLoader, TableChunk,
    CHUNK_BYTES, CHUNK_ROWS, ROW_ORDER, ROW_ORDERED, TABLES,
};
pub use runs::{
    AcceptGroup, AcceptRun, AcceptedGroup, AcceptedRun, CancelReport, CompletionHandling,
    GroupRecord, GroupStatus, NewGroup, NewRun, PausedRunCommit, RecoveryReport, ResumedRun,
    RunCursor, RunRecord, TerminalCommit, TerminalOutcome,
};
pub use runtime::{describe_process, Activation, RuntimeLock};
pub use sessions::{DialogCursor, DialogQuery, NewSession, SessionRecord, TimelineId};
pub use spend::DialogSpend;
pub use sqlite::SqliteStore;
pub use tree::{DialogTree, ImportCheckpoint, ImportTimeline, ImportTree, TreeTimeline};
pub use webhooks::{
    AttemptOutcome, DeliveryStatus, RunCompletedBody, RunCompletedData, TurnCompletedBody,
    TurnCompletedData, WebhookDelivery, WebhookHooks,
};

/// Test seams, compiled only with the `testing` feature: build databases
/// at older schema versions, or run a migration list of the test's own.
#[cfg(feature = "testing")]
pub mod testing {
    pub use crate::compress::{forget_dictionaries, set_compression};
    pub use crate::migrations::{migrate_to, migrate_with, user_version, MIGRATIONS};
    pub use crate::outline::schema_outline;
}

/// A page of a cursor-paginated listing.
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T, C> {
    /// The items, in listing order.
    pub items: Vec<T>,
    /// Where the next page starts; `None` on the last page.
    pub next_cursor: Option<C>,
}

/// Handle to a keel database, whichever its backend: every transaction of
/// [`Backend`] is callable on it. Clone it freely; a SQLite backend's
/// threads stop when the last clone drops.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("location", &self.backend.location())
            .finish_non_exhaustive()
    }
}

impl std::ops::Deref for Store {
    type Target = dyn Backend;

    fn deref(&self) -> &Self::Target {
        &*self.backend
    }
}

impl Store {
    /// Opens (creating if needed) the SQLite database at `path` (see
    /// [`SqliteStore::open`]).
    pub fn open(path: impl AsRef<Path>, options: StoreOptions) -> Result<Self> {
        Ok(Self::new(SqliteStore::open(path, options)?))
    }

    /// A store over `backend`.
    pub fn new(backend: impl Backend) -> Self {
        Self {
            backend: Arc::new(backend),
        }
    }

    /// Sets the URLs every committed turn that answers input, and every
    /// background run's end, is delivered to.
    pub fn set_webhook_urls(&self, urls: Vec<String>) {
        self.backend.hooks().set_urls(urls);
    }

    /// Resolves once webhook deliveries were committed since the last wait
    /// (a permit is kept, so a commit between two waits is not missed).
    pub async fn webhook_committed(&self) {
        self.backend.hooks().committed().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync_clone<T: Send + Sync + Clone + 'static>() {}
    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn store_and_its_futures_can_cross_tasks() {
        assert_send_sync_clone::<Store>();
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path().join("k.db"), StoreOptions::default()).expect("open");
        let id = keel_core::SessionId::new();
        assert_send(&store.get_session(id));
        assert_send(&store.load_messages(id, MessageFilter::default()));
        assert_send(&store.touch_session(id, 1));
    }

    /// Transcripts and tool output are private: nobody but the owner may read
    /// the database, its WAL or its shared-memory file, whatever the umask
    /// and whether the path is the file or a symbolic link to it.
    #[cfg(unix)]
    #[tokio::test]
    async fn the_database_and_its_wal_are_private_to_the_owner() {
        use std::os::unix::fs::{symlink, PermissionsExt};
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        let dir = tempfile::tempdir().expect("tempdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        let old = dir.path().join("keel.db");
        // An older keel left the files world-readable: opening tightens them.
        drop(Store::open(&old, StoreOptions::default()).expect("create"));
        let old_linked = elsewhere.path().join("old-linked.db");
        drop(Store::open(&old_linked, StoreOptions::default()).expect("create"));
        for file in [&old, &old_linked] {
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        }
        let link = |name: &str, target: &Path| {
            let path = dir.path().join(name);
            symlink(target, &path).expect("symlink");
            path
        };
        // (path opened, the file it names)
        let cases = [
            (old.clone(), old.clone()),
            (dir.path().join("new.db"), dir.path().join("new.db")),
            (
                link("to-new.db", &elsewhere.path().join("new-linked.db")),
                elsewhere.path().join("new-linked.db"),
            ),
            (link("to-old.db", &old_linked), old_linked.clone()),
        ];
        for (path, file) in cases {
            let store = Store::open(&path, StoreOptions::default()).expect("open");
            store
                .create_session(NewSession {
                    id: keel_core::SessionId::new(),
                    channel: "c".into(),
                    chat_id: "c".into(),
                    dialog_id: "d".into(),
                    title: "t".into(),
                    agent_id: None,
                    parent_id: None,
                    delivery_context: None,
                    now_ms: 1,
                })
                .await
                .expect("write");
            for suffix in ["", "-wal", "-shm"] {
                let file = std::path::PathBuf::from(format!("{}{suffix}", file.display()));
                assert_eq!(
                    mode(&file),
                    0o600,
                    "{} via {}",
                    file.display(),
                    path.display()
                );
            }
        }
    }
}
