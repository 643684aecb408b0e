//! Which rows break their table's CHECK constraints, named row by row:
//! each constraint's expression is read from the schema and evaluated over
//! the table. SQLite's `integrity_check` says only "CHECK constraint failed
//! in `<table>`", and on a read-only connection (which does not even parse
//! CHECK constraints) nothing at all.

use std::fmt;

use rusqlite::Connection;

use crate::error::Result;

/// Most rows reported per constraint.
const MAX_ROWS: usize = 20;

/// Longest value shown; longer ones are cut.
const MAX_VALUE_CHARS: usize = 80;

/// A row that breaks one of its table's CHECK constraints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    table: String,
    /// The row's key, as `column = value` (its primary key, else its rowid).
    row: String,
    /// Each column the constraint reads, as `column = value`.
    values: String,
    /// The constraint's expression, as the schema writes it.
    check: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} row {}: {} breaks CHECK ({}), a value this keel does not know",
            self.table, self.row, self.values, self.check
        )
    }
}

/// Every row of `table` (up to [`MAX_ROWS`] per constraint) that breaks one
/// of its CHECK constraints.
pub(crate) fn violations(conn: &Connection, table: &str) -> Result<Vec<Violation>> {
    let sql: Option<String> = conn
        .prepare_cached("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?1")?
        .query_row([table], |r| r.get(0))?;
    let Some(sql) = sql else {
        return Ok(Vec::new());
    };
    let columns: Vec<(String, i64)> = conn
        .prepare(&format!("PRAGMA table_info({})", quote_ident(table)))?
        .query_map([], |r| Ok((r.get::<_, String>(1)?, r.get::<_, i64>(5)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut key: Vec<(i64, &str)> = columns
        .iter()
        .filter(|(_, pk)| *pk > 0)
        .map(|(name, pk)| (*pk, name.as_str()))
        .collect();
    key.sort_unstable();
    let key: Vec<&str> = if key.is_empty() {
        vec!["rowid"]
    } else {
        key.into_iter().map(|(_, name)| name).collect()
    };
    let mut found = Vec::new();
    for check in check_expressions(&sql) {
        let read: Vec<&str> = columns
            .iter()
            .map(|(name, _)| name.as_str())
            .filter(|name| mentions(&check, name))
            .collect();
        let shown: Vec<String> = key.iter().chain(&read).map(|c| shown_value(c)).collect();
        let query = format!(
            "SELECT {} FROM {} WHERE NOT ifnull(({check}), 1) LIMIT {MAX_ROWS}",
            shown.join(", "),
            quote_ident(table)
        );
        let mut stmt = conn.prepare(&query)?;
        let rows = stmt.query_map([], |r| {
            (0..key.len() + read.len())
                .map(|i| r.get::<_, String>(i))
                .collect::<rusqlite::Result<Vec<_>>>()
        })?;
        for row in rows {
            let row = row?;
            let pairs = |names: &[&str], values: &[String]| {
                names
                    .iter()
                    .zip(values)
                    .map(|(n, v)| format!("{n} = {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let (keys, values) = row.split_at(key.len());
            found.push(Violation {
                table: table.to_owned(),
                row: pairs(&key, keys),
                values: pairs(&read, values),
                check: check.clone(),
            });
        }
    }
    Ok(found)
}

/// SQL that shows column `name`'s value as an SQL literal (a blob by its size), cut short.
fn shown_value(name: &str) -> String {
    let c = quote_ident(name);
    format!(
        "CASE WHEN typeof({c}) = 'blob' THEN 'a blob of ' || length({c}) || ' bytes' \
         WHEN length(quote({c})) > {MAX_VALUE_CHARS} \
         THEN substr(quote({c}), 1, {MAX_VALUE_CHARS}) || '…' ELSE quote({c}) END"
    )
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `sql` with the content of every string literal, quoted identifier and
/// comment blanked (one space per character), so that a scan for keywords,
/// names and parentheses skips them.
fn blank_literals(sql: &str) -> String {
    #[derive(Clone, Copy, PartialEq)]
    enum In {
        Code,
        Quoted(char),
        LineComment,
        BlockComment,
    }
    let chars: Vec<char> = sql.chars().collect();
    let mut out = String::with_capacity(sql.len());
    let mut state = In::Code;
    for (i, &c) in chars.iter().enumerate() {
        let next = chars.get(i + 1).copied();
        // Delimiters stay (a quote pair still shows where a literal was); content goes.
        let keep = match state {
            In::Code => true,
            In::Quoted(end) => c == end,
            In::LineComment | In::BlockComment => false,
        };
        out.push(if keep { c } else { ' ' });
        state = match (state, c, next) {
            (In::Code, '-', Some('-')) => In::LineComment,
            (In::Code, '/', Some('*')) => In::BlockComment,
            (In::Code, '\'' | '"' | '`', _) => In::Quoted(c),
            (In::Code, '[', _) => In::Quoted(']'),
            (In::Quoted(end), _, _) if c == end => In::Code,
            (In::LineComment, '\n', _) => In::Code,
            (In::BlockComment, '/', _) if i > 0 && chars[i - 1] == '*' => In::Code,
            (other, _, _) => other,
        };
    }
    out
}

/// The expression of every `CHECK (...)` in a `CREATE TABLE` statement.
fn check_expressions(sql: &str) -> Vec<String> {
    let blank = blank_literals(sql);
    let bytes = blank.as_bytes();
    let upper = blank.to_ascii_uppercase();
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = upper[from..].find("CHECK").map(|i| i + from) {
        from = at + 5;
        let word_start = at == 0 || !is_ident_byte(bytes[at - 1]);
        let word_end = bytes.get(from).is_none_or(|b| !is_ident_byte(*b));
        if !(word_start && word_end) {
            continue;
        }
        let Some(open) = blank[from..]
            .find(|c: char| !c.is_whitespace())
            .map(|i| i + from)
            .filter(|&i| bytes[i] == b'(')
        else {
            continue;
        };
        let mut depth = 0usize;
        for (i, &b) in bytes.iter().enumerate().skip(open) {
            match b {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        // The original text, literals and all.
                        let text = slice_like(sql, &blank, open + 1, i);
                        // One line, however the schema wraps it.
                        let lines: Vec<&str> = text.lines().map(str::trim).collect();
                        found.push(lines.join(" ").trim().to_owned());
                        from = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    found
}

/// The part of `original` that `blank[start..end]` blanked.
fn slice_like(original: &str, blank: &str, start: usize, end: usize) -> String {
    let chars_before = blank[..start].chars().count();
    let chars_len = blank[start..end].chars().count();
    original
        .chars()
        .skip(chars_before)
        .take(chars_len)
        .collect()
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Whether expression `expr` names column `name` (outside string literals).
fn mentions(expr: &str, name: &str) -> bool {
    let blank = blank_literals(expr);
    blank
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|word| word.eq_ignore_ascii_case(name))
        || expr.contains(&format!("\"{name}\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_expressions_are_found_outside_literals() {
        let sql = "CREATE TABLE t (id TEXT PRIMARY KEY, \
                   status TEXT NOT NULL CHECK (status IN ('a', 'check (x)')), \
                   n INTEGER CHECK(n >= 0 AND (n < 10)), \"checked\" INTEGER, \
                   CHECK ((n IS NULL) = (status IS NULL)))";
        assert_eq!(
            check_expressions(sql),
            [
                "status IN ('a', 'check (x)')",
                "n >= 0 AND (n < 10)",
                "(n IS NULL) = (status IS NULL)"
            ]
        );
        assert!(mentions("status IN ('n')", "status"));
        assert!(!mentions("status IN ('n')", "n"));
    }

    #[test]
    fn each_breaking_row_is_named_with_its_key_column_and_value() {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch(
            "CREATE TABLE runs (id TEXT PRIMARY KEY, \
               status TEXT NOT NULL CHECK (status IN ('queued', 'done')), \
               depth INTEGER NOT NULL CHECK (depth >= 1)); \
             CREATE TABLE plain (x INTEGER CHECK (x <> 0)); \
             PRAGMA ignore_check_constraints = ON; \
             INSERT INTO runs VALUES ('r1', 'queued', 1), ('r2', 'paused', 1), ('r3', 'done', 0); \
             INSERT INTO plain VALUES (1), (0);",
        )
        .expect("schema");
        let shown = |table: &str| -> Vec<String> {
            violations(&conn, table)
                .expect("violations")
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        insta::assert_snapshot!([shown("runs"), shown("plain")].concat().join("\n"), @r"
        runs row id = 'r2': status = 'paused' breaks CHECK (status IN ('queued', 'done')), a value this keel does not know
        runs row id = 'r3': depth = 0 breaks CHECK (depth >= 1), a value this keel does not know
        plain row rowid = 2: x = 0 breaks CHECK (x <> 0), a value this keel does not know
        ");
    }
}
