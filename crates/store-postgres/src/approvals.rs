//! Tool approvals on PostgreSQL (ported by `approvals`; this is a stub so
//! that the runs port compiles until then).
#![allow(unused_variables, dead_code)]

use keel_store::{ApprovalRecord, Result};
use tokio_postgres::types::ToSql;
use tokio_postgres::Transaction;

pub(crate) async fn query(
    tx: &Transaction<'_>,
    filter: &str,
    args: &[&(dyn ToSql + Sync)],
) -> Result<Vec<ApprovalRecord>> {
    todo!("ported by approvals")
}
