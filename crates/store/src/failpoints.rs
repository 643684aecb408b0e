//! Failpoints: named places on the commit paths where a test build stops
//! the process dead, so crash tests can kill keel exactly between two steps
//! of a transaction's life (inside it before COMMIT, or after COMMIT before
//! anyone was told). Compiled only with the `failpoints` feature, which only
//! the keel-e2e copy of the binary turns on.
//!
//! They are configured by the `FAILPOINTS` environment variable in the
//! syntax of the `fail` crate, `name=action;name=action`. The action
//! `return` kills the process with SIGKILL (no destructor, no flush: the
//! same as `kill -9`); the crate's other actions (`panic`, `sleep(ms)`,
//! `pause`, counts such as `2*off->return`) behave as it documents.

/// Every failpoint, with where it sits. Crash tests iterate this list, so a
/// point added to the code without a test here fails them.
pub const FAILPOINTS: &[(&str, &str)] = &[
    (
        "store::migration::before_commit",
        "a migration step ran its SQL, before its COMMIT",
    ),
    (
        "store::migration::after_commit",
        "a migration step committed, before the next one starts",
    ),
    (
        "store::writer::before_commit",
        "the writer ran every request of a batch, before COMMIT",
    ),
    (
        "store::wal_checkpoint::before",
        "a WAL checkpoint is due, before it copies pages",
    ),
    (
        "store::wal_checkpoint::after",
        "a WAL checkpoint copied pages, before the next batch",
    ),
    (
        "store::activate::before_commit",
        "activation recovered older generations, before COMMIT",
    ),
    (
        "store::open_turn::before_commit",
        "a user turn's input is written (open), before COMMIT",
    ),
    (
        "store::open_turn::after_commit",
        "a user turn's input committed, before the model is called",
    ),
    (
        "store::commit_turn::before_commit",
        "a turn's messages, state and checkpoint are written, before COMMIT",
    ),
    (
        "store::commit_turn::after_commit",
        "a turn committed, before the engine applies or acknowledges it",
    ),
    (
        "store::commit_terminal::before_commit",
        "a run's terminal state and completion are written, before COMMIT",
    ),
    (
        "store::commit_terminal::after_commit",
        "a run's terminal commit is durable, before the runner learns it",
    ),
    (
        "store::insert_signal::before_commit",
        "a signal event is written, before COMMIT",
    ),
    (
        "store::insert_signal::after_commit",
        "a signal committed, before the emitting run is told",
    ),
    (
        "store::claim_inbox::after_commit",
        "inbox events were leased, before the claimer holds the lease",
    ),
    (
        "store::admit_inbox::before_commit",
        "steer admission wrote leased → admitted, before COMMIT",
    ),
    (
        "store::admit_inbox::after_commit",
        "steer admission committed, before the mailbox activates the events",
    ),
    (
        "store::release_lease::before_commit",
        "a lease release (backoff or dead letter) is written, before COMMIT",
    ),
    (
        "store::release_lease::after_commit",
        "a lease release committed, before the releaser is told",
    ),
    (
        "store::commit_continuation::before_commit",
        "a continuation turn and its event consumption are written, before COMMIT",
    ),
    (
        "store::commit_continuation::after_commit",
        "a continuation turn committed, before the engine applies or acknowledges it",
    ),
];

/// Evaluates failpoint `name`: with the `return` action the process is
/// killed on the spot; the `fail` crate runs any other action.
pub fn hit(name: &str) {
    debug_assert!(
        FAILPOINTS.iter().any(|(n, _)| *n == name),
        "failpoint {name} is not listed in FAILPOINTS"
    );
    if fail::eval(name, |_| ()).is_some() {
        die(name);
    }
}

/// Reads `FAILPOINTS` from the environment and configures them; returns
/// the names set. An invalid entry is an error naming it.
pub fn configure_from_env() -> Result<Vec<String>, String> {
    let Ok(spec) = std::env::var("FAILPOINTS") else {
        return Ok(Vec::new());
    };
    let mut names = Vec::new();
    for entry in spec.split(';').filter(|e| !e.trim().is_empty()) {
        let (name, actions) = entry
            .split_once('=')
            .ok_or_else(|| format!("FAILPOINTS entry {entry:?} is not name=actions"))?;
        let name = name.trim();
        if !FAILPOINTS.iter().any(|(n, _)| *n == name) {
            return Err(format!("FAILPOINTS names {name:?}, which is no failpoint"));
        }
        fail::cfg(name, actions.trim()).map_err(|e| format!("FAILPOINTS entry {entry:?}: {e}"))?;
        names.push(name.to_owned());
    }
    Ok(names)
}

/// Ends the process as `kill -9` would: no unwinding, no destructor, no flush.
fn die(name: &str) -> ! {
    eprintln!("keel: failpoint {name} fired: killing the process");
    #[cfg(unix)]
    {
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    }
    std::process::abort()
}
