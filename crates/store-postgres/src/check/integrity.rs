//! The integrity pass on PostgreSQL, in place of SQLite's
//! `integrity_check` and `foreign_key_check`: the server enforces every
//! CHECK, NOT NULL, UNIQUE and foreign key when a row is written, so no
//! row breaks a validated constraint. What can still be wrong is reported:
//! an index a failed `CREATE INDEX CONCURRENTLY` or `REINDEX` left invalid
//! (queries skip it; a unique one enforces nothing), a constraint someone
//! added `NOT VALID` (rows written before it were never checked), and,
//! when the `amcheck` extension is installed and this role may run it, a
//! B-tree index whose pages are damaged (`bt_index_check`, what SQLite's
//! `integrity_check` does for its b-trees). Only keel's tables are looked
//! at, in the schema the store's unqualified names resolve to.

use keel_store::{Invariant, InvariantReport, Result, TABLES};
use tokio_postgres::Transaction;

use crate::store::from_pg;

/// keel's tables: keel-store's and this backend's own version table.
fn keel_tables() -> Vec<&'static str> {
    TABLES.iter().copied().chain(["schema_version"]).collect()
}

/// Reports invalid indexes, unvalidated constraints and (with `amcheck`)
/// damaged B-trees of keel's tables.
pub(super) async fn integrity(tx: &Transaction<'_>, report: &mut InvariantReport) -> Result<()> {
    let tables = keel_tables();
    let invalid = tx
        .query(
            "SELECT i.indexrelid::regclass::text, t.relname::text FROM pg_index i \
             JOIN pg_class t ON t.oid = i.indrelid \
             WHERE t.relnamespace = current_schema()::regnamespace \
               AND t.relname = ANY($1::text[]) \
               AND NOT (i.indisvalid AND i.indisready AND i.indislive) \
             ORDER BY 1 COLLATE \"C\"",
            &[&tables],
        )
        .await
        .map_err(from_pg)?;
    for r in invalid {
        let (index, table): (String, String) = (r.get(0), r.get(1));
        report.push(
            Invariant::Integrity,
            false,
            format!(
                "index {index} of {table} is invalid (a build or REINDEX that did not finish): \
                 queries do not use it and a uniqueness it adds is not enforced; \
                 REINDEX INDEX {index} rebuilds it"
            ),
        );
    }
    let unvalidated = tx
        .query(
            "SELECT t.relname::text, c.conname::text, c.contype = 'f' FROM pg_constraint c \
             JOIN pg_class t ON t.oid = c.conrelid \
             WHERE t.relnamespace = current_schema()::regnamespace \
               AND t.relname = ANY($1::text[]) AND NOT c.convalidated \
             ORDER BY 1 COLLATE \"C\", 2 COLLATE \"C\"",
            &[&tables],
        )
        .await
        .map_err(from_pg)?;
    for r in unvalidated {
        let (table, name, foreign): (String, String, bool) = (r.get(0), r.get(1), r.get(2));
        let (invariant, rows) = if foreign {
            (Invariant::ForeignKeys, "may refer to rows that do not exist")
        } else {
            (Invariant::Integrity, "may break it")
        };
        report.push(
            invariant,
            false,
            format!(
                "constraint {name} of {table} was added NOT VALID: rows written before it {rows}; \
                 ALTER TABLE {table} VALIDATE CONSTRAINT {name} checks them"
            ),
        );
    }
    amcheck(tx, &tables, report).await
}

/// `bt_index_check` of every valid B-tree index of keel's tables, when the
/// extension is installed and this role may execute it (keel never
/// installs it: an administrator does, as for any server-wide check).
async fn amcheck(
    tx: &Transaction<'_>,
    tables: &[&str],
    report: &mut InvariantReport,
) -> Result<()> {
    let schema = tx
        .query_opt(
            "SELECT quote_ident(n.nspname) FROM pg_extension e \
             JOIN pg_namespace n ON n.oid = e.extnamespace \
             WHERE e.extname = 'amcheck' \
               AND has_function_privilege(quote_ident(n.nspname) || '.bt_index_check(regclass)', \
                                          'EXECUTE')",
            &[],
        )
        .await
        .map_err(from_pg)?;
    let Some(schema) = schema.map(|r| r.get::<_, String>(0)) else {
        return Ok(());
    };
    let indexes = tx
        .query(
            "SELECT i.indexrelid::regclass::text, i.indexrelid::oid FROM pg_index i \
             JOIN pg_class t ON t.oid = i.indrelid \
             JOIN pg_class ic ON ic.oid = i.indexrelid \
             JOIN pg_am am ON am.oid = ic.relam \
             WHERE t.relnamespace = current_schema()::regnamespace \
               AND t.relname = ANY($1::text[]) AND am.amname = 'btree' AND i.indisvalid \
             ORDER BY 1 COLLATE \"C\"",
            &[&tables],
        )
        .await
        .map_err(from_pg)?;
    let check = format!("SELECT {schema}.bt_index_check($1::oid::regclass)");
    for r in indexes {
        let (index, oid): (String, u32) = (r.get(0), r.get(1));
        // A damaged index raises an error, which aborts only its savepoint.
        tx.batch_execute("SAVEPOINT keel_amcheck")
            .await
            .map_err(from_pg)?;
        match tx.execute(&check, &[&oid]).await {
            Ok(_) => tx.batch_execute("RELEASE SAVEPOINT keel_amcheck").await,
            Err(e) => {
                report.push(
                    Invariant::Integrity,
                    false,
                    format!("index {index} is damaged (amcheck): {}", from_pg(e)),
                );
                tx.batch_execute("ROLLBACK TO SAVEPOINT keel_amcheck").await
            }
        }
        .map_err(from_pg)?;
    }
    Ok(())
}
