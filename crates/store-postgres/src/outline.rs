//! The schema outline of a PostgreSQL database, in keel-store's
//! backend-neutral format (`keel_store::testing::schema_outline`), and the
//! full definitions (CHECKs, foreign keys, index definitions) for a snapshot.

use tokio_postgres::Client;

use crate::error::Result;

/// Tables of the current schema, less the migrations' own bookkeeping.
const TABLES: &str = "SELECT table_name::text FROM information_schema.tables \
     WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' \
     AND table_name <> 'schema_version' ORDER BY 1";

/// The neutral outline: one sorted line per column, key and index.
pub async fn schema_outline(client: &Client) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for row in client.query(TABLES, &[]).await? {
        let table: String = row.get(0);
        columns(client, &table, &mut lines).await?;
        keys(client, &table, &mut lines).await?;
        indexes(client, &table, &mut lines).await?;
        foreign_keys(client, &table, &mut lines).await?;
    }
    lines.sort();
    Ok(lines)
}

/// Every constraint and index as PostgreSQL prints it, sorted.
pub async fn schema_definitions(client: &Client) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for row in client.query(TABLES, &[]).await? {
        let table: String = row.get(0);
        let rows = client
            .query(
                "SELECT conname::text, pg_get_constraintdef(oid, true) FROM pg_constraint \
                 WHERE conrelid = $1::text::regclass",
                &[&table],
            )
            .await?;
        for r in rows {
            let (name, def): (String, String) = (r.get(0), r.get(1));
            lines.push(format!("{table} constraint {name}: {def}"));
        }
        let rows = client
            .query(
                "SELECT pg_get_indexdef(indexrelid, 0, true) FROM pg_index \
                 WHERE indrelid = $1::text::regclass",
                &[&table],
            )
            .await?;
        for r in rows {
            let def: String = r.get(0);
            lines.push(format!("{table} {def}"));
        }
    }
    lines.sort();
    Ok(lines)
}

/// The insertion-order column of the tables keel reads in the order their
/// rows were written: SQLite's implicit `rowid`, which the SQLite outline
/// does not list either.
const ROW_ORDER: &str = "row_order";

async fn columns(client: &Client, table: &str, lines: &mut Vec<String>) -> Result<()> {
    let rows = client
        .query(
            "SELECT column_name::text, data_type::text, is_nullable = 'YES' \
             FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = $1",
            &[&table],
        )
        .await?;
    for r in rows {
        let (name, ty, nullable): (String, String, bool) = (r.get(0), r.get(1), r.get(2));
        if name == ROW_ORDER {
            continue;
        }
        let ty = match ty.as_str() {
            "bigint" => "integer",
            "double precision" => "real",
            "bytea" => "blob",
            "text" => "text",
            other => other,
        };
        let null = if nullable { "null" } else { "not null" };
        lines.push(format!("{table} column {name} {ty} {null}"));
    }
    Ok(())
}

async fn keys(client: &Client, table: &str, lines: &mut Vec<String>) -> Result<()> {
    let rows = client
        .query(
            "SELECT c.contype = 'p', array(SELECT a.attname::text \
                 FROM unnest(c.conkey) WITH ORDINALITY AS k(num, ord) \
                 JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.num \
                 ORDER BY k.ord) \
             FROM pg_constraint c \
             WHERE c.conrelid = $1::text::regclass AND c.contype IN ('p', 'u')",
            &[&table],
        )
        .await?;
    for r in rows {
        let (primary, cols): (bool, Vec<String>) = (r.get(0), r.get(1));
        let kind = if primary { "primary key" } else { "unique" };
        lines.push(format!("{table} {kind} ({})", cols.join(", ")));
    }
    Ok(())
}

async fn indexes(client: &Client, table: &str, lines: &mut Vec<String>) -> Result<()> {
    let rows = client
        .query(
            "SELECT i.relname::text, x.indisunique, x.indpred IS NOT NULL, \
                 array(SELECT CASE WHEN x.indkey[k - 1] = 0 THEN '<expr>' \
                                   ELSE pg_get_indexdef(x.indexrelid, k, true) END \
                              || CASE WHEN x.indoption[k - 1] & 1 = 1 THEN ' DESC' ELSE '' END \
                       FROM generate_series(1, x.indnkeyatts) AS k ORDER BY k) \
             FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid \
             WHERE x.indrelid = $1::text::regclass AND NOT EXISTS ( \
                 SELECT 1 FROM pg_constraint c \
                 WHERE c.conindid = x.indexrelid AND c.contype IN ('p', 'u'))",
            &[&table],
        )
        .await?;
    for r in rows {
        let (name, unique, partial, mut cols): (String, bool, bool, Vec<String>) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        // SQLite's indexes end with the rowid without listing it.
        if cols.last().is_some_and(|c| c == ROW_ORDER) {
            cols.pop();
        }
        let unique = if unique { " unique" } else { "" };
        let partial = if partial { " partial" } else { "" };
        lines.push(format!(
            "{table} index {name} ({}){unique}{partial}",
            cols.join(", ")
        ));
    }
    Ok(())
}

async fn foreign_keys(client: &Client, table: &str, lines: &mut Vec<String>) -> Result<()> {
    let rows = client
        .query(
            "SELECT c.confrelid::regclass::text, \
                 array(SELECT a.attname::text FROM unnest(c.conkey) WITH ORDINALITY AS k(num, ord) \
                       JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.num \
                       ORDER BY k.ord), \
                 array(SELECT a.attname::text FROM unnest(c.confkey) WITH ORDINALITY AS k(num, ord) \
                       JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.num \
                       ORDER BY k.ord), \
                 CASE c.confdeltype WHEN 'a' THEN 'no action' WHEN 'r' THEN 'restrict' \
                      WHEN 'c' THEN 'cascade' WHEN 'n' THEN 'set null' ELSE 'set default' END \
             FROM pg_constraint c \
             WHERE c.conrelid = $1::text::regclass AND c.contype = 'f'",
            &[&table],
        )
        .await?;
    for r in rows {
        let (to_table, from, to, on_delete): (String, Vec<String>, Vec<String>, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        lines.push(format!(
            "{table} foreign key ({}) references {to_table} ({}) on delete {on_delete}",
            from.join(", "),
            to.join(", ")
        ));
    }
    Ok(())
}
