//! Background runs on PostgreSQL (ported by `runs`; this is a stub so that
//! the history port compiles until then).

mod import;

pub(crate) use import::import_runs_tx;
