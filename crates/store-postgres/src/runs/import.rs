//! Runs written back by an import (ported by `runs`; a stub until then).
#![allow(unused_variables)]

use keel_store::{NewSession, Result, RunRecord};
use tokio_postgres::Transaction;

pub(crate) async fn import_runs_tx(
    tx: &Transaction<'_>,
    session: &NewSession,
    runs: &[RunRecord],
) -> Result<()> {
    todo!("ported by runs")
}
