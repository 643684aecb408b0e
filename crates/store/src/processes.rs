//! Several processes on one database: what [`Backend::lease_session`] and
//! [`Backend::recover_expired_runtimes`] answer. A backend that several
//! processes may serve at once ([`Backend::shared`], PostgreSQL) keeps a
//! row per live process, renewed while it runs, and a lease per session
//! whose turns run; SQLite is owned by one process (its runtime lock), so
//! there every lease is this process's and no other process expires.
//!
//! [`Backend::lease_session`]: crate::Backend::lease_session
//! [`Backend::recover_expired_runtimes`]: crate::Backend::recover_expired_runtimes
//! [`Backend::shared`]: crate::Backend::shared

use crate::RecoveryReport;

/// A session's turn lease, as [`crate::Backend::lease_session`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionLease {
    /// This process holds the lease now. With `moved`, another process
    /// held it since this one last did (or this one never held it): what
    /// this process remembers of the session may be stale, reload it.
    Held {
        /// Another process may have written the session meanwhile.
        moved: bool,
    },
    /// Another live process holds it; ask again after its turn.
    Busy {
        /// The holder, as it registered (command, host, pid).
        holder: String,
    },
}

/// What [`crate::Backend::recover_expired_runtimes`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessRecovery {
    /// The processes whose lease expired, now recovered: (generation, holder).
    pub processes: Vec<(u64, String)>,
    /// What their recovery changed (their runs interrupted with their
    /// completions, their inbox leases and open inputs released).
    pub recovery: RecoveryReport,
    /// Sessions with acknowledged inputs that no live process will run
    /// (take them with [`crate::Backend::queued_inputs`]).
    pub sessions_with_queued_inputs: Vec<keel_core::SessionId>,
}
