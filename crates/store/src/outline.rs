//! The schema outline of a database file, backend-neutral, for the parity
//! test against keel-store-postgres (which prints its own the same way).
//!
//! One line per fact, sorted: `T column C TYPE null|not null` (TYPE is
//! `integer`, `real`, `text` or `blob`), `T primary key (C, …)`,
//! `T unique (C, …)`, `T foreign key (C, …) references T2 (C, …) on
//! delete ACTION` and `T index NAME (C, …)[ unique][ partial]`, where
//! an expression key is `<expr>` and a descending one ends in ` DESC`.
//! Columns of the primary key count as not null: keel never writes NULL
//! there, and SQLite's `TEXT PRIMARY KEY` allows it only by a quirk.

use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use crate::error::Result;

/// The outline of the SQLite database at `path` (opened read-only).
pub fn schema_outline(path: &Path) -> Result<Vec<String>> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    let mut lines = Vec::new();
    let tables: Vec<String> = conn
        .prepare(
            "SELECT name FROM sqlite_schema WHERE type = 'table' \
             AND name NOT LIKE 'sqlite_%' ORDER BY name",
        )?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    for table in &tables {
        columns(&conn, table, &mut lines)?;
        indexes(&conn, table, &mut lines)?;
        foreign_keys(&conn, table, &mut lines)?;
    }
    lines.sort();
    Ok(lines)
}

fn columns(conn: &Connection, table: &str, lines: &mut Vec<String>) -> Result<()> {
    let mut stmt = conn.prepare("SELECT name, type, \"notnull\", pk FROM pragma_table_info(?1)")?;
    let mut key: Vec<(i64, String)> = Vec::new();
    let rows = stmt.query_map([table], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, bool>(2)?,
            r.get::<_, i64>(3)?,
        ))
    })?;
    for row in rows {
        let (name, ty, not_null, pk) = row?;
        let null = if not_null || pk > 0 {
            "not null"
        } else {
            "null"
        };
        lines.push(format!(
            "{table} column {name} {} {null}",
            ty.to_ascii_lowercase()
        ));
        if pk > 0 {
            key.push((pk, name));
        }
    }
    key.sort();
    if !key.is_empty() {
        let cols: Vec<_> = key.into_iter().map(|(_, c)| c).collect();
        lines.push(format!("{table} primary key ({})", cols.join(", ")));
    }
    Ok(())
}

fn indexes(conn: &Connection, table: &str, lines: &mut Vec<String>) -> Result<()> {
    let list: Vec<(String, bool, String, bool)> = conn
        .prepare("SELECT name, \"unique\", origin, partial FROM pragma_index_list(?1)")?
        .query_map([table], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })?
        .collect::<rusqlite::Result<_>>()?;
    for (name, unique, origin, partial) in list {
        if origin == "pk" {
            continue;
        }
        let cols: Vec<String> = conn
            .prepare("SELECT name, \"desc\" FROM pragma_index_xinfo(?1) WHERE key ORDER BY seqno")?
            .query_map([&name], |r| {
                let col: Option<String> = r.get(0)?;
                let desc: bool = r.get(1)?;
                let col = col.unwrap_or_else(|| "<expr>".to_owned());
                Ok(if desc { format!("{col} DESC") } else { col })
            })?
            .collect::<rusqlite::Result<_>>()?;
        let cols = cols.join(", ");
        if origin == "u" {
            lines.push(format!("{table} unique ({cols})"));
            continue;
        }
        let unique = if unique { " unique" } else { "" };
        let partial = if partial { " partial" } else { "" };
        lines.push(format!("{table} index {name} ({cols}){unique}{partial}"));
    }
    Ok(())
}

fn foreign_keys(conn: &Connection, table: &str, lines: &mut Vec<String>) -> Result<()> {
    let rows: Vec<(i64, String, String, Option<String>, String)> = conn
        .prepare(
            "SELECT id, \"table\", \"from\", \"to\", on_delete \
             FROM pragma_foreign_key_list(?1) ORDER BY id, seq",
        )?
        .query_map([table], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect::<rusqlite::Result<_>>()?;
    let mut i = 0;
    while i < rows.len() {
        let id = rows[i].0;
        let group: Vec<_> = rows[i..].iter().take_while(|r| r.0 == id).collect();
        i += group.len();
        let from: Vec<&str> = group.iter().map(|r| r.2.as_str()).collect();
        let to: Vec<&str> = group
            .iter()
            .map(|r| r.3.as_deref().unwrap_or("<primary key>"))
            .collect();
        lines.push(format!(
            "{table} foreign key ({}) references {} ({}) on delete {}",
            from.join(", "),
            group[0].1,
            to.join(", "),
            group[0].4.to_ascii_lowercase()
        ));
    }
    Ok(())
}
