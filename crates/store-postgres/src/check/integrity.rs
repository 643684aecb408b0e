//! The integrity pass on PostgreSQL, in place of SQLite's
//! `integrity_check` and `foreign_key_check`: the server enforces every
//! CHECK, NOT NULL, UNIQUE and foreign key when a row is written, so no
//! row breaks a validated CHECK. What can still be wrong is reported: an
//! index a failed `CREATE INDEX CONCURRENTLY` or `REINDEX` left invalid
//! (queries skip it; a unique one enforces nothing); a row whose reference
//! dangles (foreign keys are triggers, which a restore with triggers
//! disabled or `session_replication_role = replica` skips: every
//! reference is checked, as `foreign_key_check` does); a row breaking a
//! CHECK someone added `NOT VALID`; and, when the `amcheck` extension is
//! installed and this role may run it, a B-tree index whose pages are
//! damaged (`bt_index_check`, what `integrity_check` does for SQLite's
//! b-trees). Only keel's tables are looked at, in the schema the store's
//! unqualified names resolve to.

use crate::store::Tx;
use keel_store::{Invariant, InvariantReport, Result, TABLES};

use crate::store::from_pg;

/// Most rows named per broken constraint.
const MAX_ROWS: i64 = 20;

/// keel's tables: keel-store's and this backend's own version table.
fn keel_tables() -> Vec<&'static str> {
    TABLES.iter().copied().chain(["schema_version"]).collect()
}

/// Reports invalid indexes, rows with dangling references, rows breaking
/// a constraint added `NOT VALID`, and (with `amcheck`) damaged B-trees of
/// keel's tables.
pub(super) async fn integrity(tx: &Tx<'_>, report: &mut InvariantReport) -> Result<()> {
    let tables = keel_tables();
    let invalid = tx
        .query(
            "SELECT i.indexrelid::regclass::text, t.relname::text FROM pg_index i \
             JOIN pg_class t ON t.oid = i.indrelid \
             WHERE t.relnamespace = current_schema()::regnamespace \
               AND t.relname = ANY($1::text[]) \
               AND NOT (i.indisvalid AND i.indisready AND i.indislive) \
             ORDER BY i.indexrelid::regclass::text COLLATE \"C\"",
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
    foreign_keys(tx, &tables, report).await?;
    unvalidated_checks(tx, &tables, report).await?;
    amcheck(tx, &tables, report).await
}

/// `bt_index_check` of every valid B-tree index of keel's tables, when the
/// extension is installed and this role may execute it (keel never
/// installs it: an administrator does, as for any server-wide check).
async fn amcheck(tx: &Tx<'_>, tables: &[&str], report: &mut InvariantReport) -> Result<()> {
    let schema = tx
        .query_opt(
            "SELECT quote_ident(n.nspname) FROM pg_extension e \
             JOIN pg_namespace n ON n.oid = e.extnamespace \
             JOIN pg_proc f ON f.pronamespace = n.oid AND f.proname = 'bt_index_check' \
               AND f.pronargs = 1 \
             WHERE e.extname = 'amcheck' AND has_function_privilege(f.oid, 'EXECUTE')",
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
             ORDER BY i.indexrelid::regclass::text COLLATE \"C\"",
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

/// `name` as an SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// SQL naming a row of `table` (aliased `c`) as SQLite's checks do: its
/// one-column primary key's value, several columns' values in
/// parentheses, or NULL (shown "a row") for a table without a key.
async fn row_key(tx: &Tx<'_>, table: &str) -> Result<String> {
    let key: Vec<String> = tx
        .query(
            "SELECT a.attname::text FROM pg_index i \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
             WHERE i.indrelid = $1::text::regclass AND i.indisprimary \
             ORDER BY array_position(i.indkey::int2[], a.attnum)",
            &[&ident(table)],
        )
        .await
        .map_err(from_pg)?
        .iter()
        .map(|r| format!("c.{}::text", ident(&r.get::<_, String>(0))))
        .collect();
    Ok(match key.len() {
        0 => "NULL::text".to_owned(),
        1 => key[0].clone(),
        _ => format!("'(' || concat_ws(', ', {}) || ')'", key.join(", ")),
    })
}

fn shown_row(key: Option<String>) -> String {
    key.map_or_else(|| "a row".to_owned(), |k| format!("row {k}"))
}

/// Rows whose reference names no row: every foreign key of keel's tables
/// evaluated over its rows (NULL references, MATCH SIMPLE, refer to nothing).
async fn foreign_keys(tx: &Tx<'_>, tables: &[&str], report: &mut InvariantReport) -> Result<()> {
    let keys = tx
        .query(
            "SELECT t.relname::text, p.relname::text, \
                ARRAY(SELECT a.attname::text FROM unnest(c.conkey) WITH ORDINALITY k(n, i) \
                      JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n \
                      ORDER BY k.i), \
                ARRAY(SELECT a.attname::text FROM unnest(c.confkey) WITH ORDINALITY k(n, i) \
                      JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.n \
                      ORDER BY k.i) \
             FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid \
             JOIN pg_class p ON p.oid = c.confrelid \
             WHERE c.contype = 'f' AND t.relnamespace = current_schema()::regnamespace \
               AND t.relname = ANY($1::text[]) \
             ORDER BY t.relname COLLATE \"C\", c.conname COLLATE \"C\"",
            &[&tables],
        )
        .await
        .map_err(from_pg)?;
    for r in keys {
        let (table, parent): (String, String) = (r.get(0), r.get(1));
        let (columns, referenced): (Vec<String>, Vec<String>) = (r.get(2), r.get(3));
        let present: Vec<String> = columns
            .iter()
            .map(|c| format!("c.{} IS NOT NULL", ident(c)))
            .collect();
        let matches: Vec<String> = columns
            .iter()
            .zip(&referenced)
            .map(|(c, p)| format!("p.{} = c.{}", ident(p), ident(c)))
            .collect();
        let key = row_key(tx, &table).await?;
        let dangling = tx
            .query(
                &format!(
                    "SELECT {key} FROM {} c WHERE {} \
                     AND NOT EXISTS (SELECT 1 FROM {} p WHERE {}) \
                     ORDER BY {key} COLLATE \"C\" LIMIT {MAX_ROWS}",
                    ident(&table),
                    present.join(" AND "),
                    ident(&parent),
                    matches.join(" AND ")
                ),
                &[],
            )
            .await
            .map_err(from_pg)?;
        for d in dangling {
            report.add(
                Invariant::ForeignKeys,
                format!(
                    "{table} {} refers to a missing {parent} row",
                    shown_row(d.get(0))
                ),
            );
        }
    }
    Ok(())
}

/// Rows breaking a CHECK added `NOT VALID` (a validated CHECK holds for
/// every row: the server checks each write).
async fn unvalidated_checks(
    tx: &Tx<'_>,
    tables: &[&str],
    report: &mut InvariantReport,
) -> Result<()> {
    let checks = tx
        .query(
            "SELECT t.relname::text, pg_get_expr(c.conbin, c.conrelid) \
             FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid \
             WHERE c.contype = 'c' AND NOT c.convalidated \
               AND t.relnamespace = current_schema()::regnamespace \
               AND t.relname = ANY($1::text[]) \
             ORDER BY t.relname COLLATE \"C\", c.conname COLLATE \"C\"",
            &[&tables],
        )
        .await
        .map_err(from_pg)?;
    for r in checks {
        let (table, check): (String, String) = (r.get(0), r.get(1));
        let key = row_key(tx, &table).await?;
        let broken = tx
            .query(
                &format!(
                    "SELECT {key} FROM {} c WHERE NOT coalesce(({check}), true) \
                     ORDER BY {key} COLLATE \"C\" LIMIT {MAX_ROWS}",
                    ident(&table)
                ),
                &[],
            )
            .await
            .map_err(from_pg)?;
        for b in broken {
            report.add(
                Invariant::Integrity,
                format!(
                    "{table} {} breaks CHECK ({check}), added NOT VALID: a value this keel does \
                     not know",
                    shown_row(b.get(0))
                ),
            );
        }
    }
    Ok(())
}
