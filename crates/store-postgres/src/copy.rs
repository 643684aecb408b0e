//! The PostgreSQL ends of moving a whole database between backends
//! (`keel copy`): reading every table in one snapshot as keel-store's
//! neutral [`TableChunk`]s, and loading them into an empty database in one
//! transaction. Rows keep their order (`row_order` is assigned in it);
//! identity keys keep their values and their sequences move past them.

use std::collections::HashMap;

use futures::future::BoxFuture;
use keel_store::{is_copied, Cell, Result, StoreError, TableChunk, COPY_TABLES};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{IsolationLevel, Row};

use crate::store::{from_pg, from_pg_store, from_pool};

/// Tables whose listings follow insertion order (`row_order`).
const ORDERED: [&str; 5] = [
    "sessions",
    "timelines",
    "checkpoints",
    "agent_run_groups",
    "agent_runs",
];

/// Identity keys copied with their values (their sequences advanced after).
const IDENTITIES: [(&str, &str); 2] = [("queued_inputs", "seq"), ("webhook_deliveries", "seq")];

/// Session columns set after every row is in: they refer to rows that come
/// later (a head timeline) or to sessions in any order (a parent).
const SESSION_LATE: [&str; 2] = ["head_timeline_id", "parent_id"];

/// A dedicated connection (outside any pool) to `url`.
async fn connect(url: &str) -> Result<deadpool_postgres::ClientWrapper> {
    let pool = crate::pool(url, 1).map_err(from_pg_store)?;
    let client = pool.get().await.map_err(from_pool)?;
    Ok(deadpool_postgres::Object::take(client))
}

/// The query whose columns [`columns`] lists.
fn all_columns(table: &str) -> String {
    format!("SELECT * FROM {table} LIMIT 0")
}

/// The columns of a table (prepared [`all_columns`]) in the order SQLite
/// lists them, with their types (`row_order` is this backend's own and
/// stays behind).
fn columns(stmt: &tokio_postgres::Statement) -> Vec<(String, Type)> {
    stmt.columns()
        .iter()
        .filter(|c| c.name() != "row_order")
        .map(|c| (c.name().to_owned(), c.type_().clone()))
        .collect()
}

fn cell(row: &Row, i: usize, ty: &Type, what: &str) -> Result<Cell> {
    let cell = match *ty {
        Type::INT8 => row.get::<_, Option<i64>>(i).map(Cell::Integer),
        Type::FLOAT8 => row.get::<_, Option<f64>>(i).map(Cell::Real),
        Type::TEXT => row.get::<_, Option<String>>(i).map(Cell::Text),
        Type::BYTEA => row.get::<_, Option<Vec<u8>>>(i).map(Cell::Blob),
        ref other => {
            return Err(StoreError::corrupt(
                what,
                format!("unexpected type {other}"),
            ));
        }
    };
    Ok(cell.unwrap_or(Cell::Null))
}

/// Where [`read_postgres_tables`] hands each chunk.
pub type ChunkSink = dyn FnMut(TableChunk) -> BoxFuture<'static, Result<()>> + Send;

/// Reads every copied table of the database at `url` in one snapshot,
/// oldest rows first, `chunk_rows` at a time; `each` gets every chunk.
pub async fn read_postgres_tables(
    url: &str,
    chunk_rows: usize,
    each: &mut ChunkSink,
) -> Result<()> {
    let mut client = connect(url).await?;
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(from_pg)?;
    let chunk_rows = i32::try_from(chunk_rows.max(1)).unwrap_or(i32::MAX);
    for table in COPY_TABLES.into_iter().filter(|t| is_copied(t)) {
        let cols = columns(&tx.prepare(&all_columns(table)).await.map_err(from_pg)?);
        let names: Vec<String> = cols.iter().map(|(n, _)| n.clone()).collect();
        let order = if ORDERED.contains(&table) {
            "row_order".to_owned()
        } else {
            // Any order satisfies the references within these tables.
            names.join(", ")
        };
        let stmt = tx
            .prepare(&format!(
                "SELECT {} FROM {table} ORDER BY {order}",
                names.join(", ")
            ))
            .await
            .map_err(from_pg)?;
        let portal = tx.bind(&stmt, &[]).await.map_err(from_pg)?;
        loop {
            let rows = tx
                .query_portal(&portal, chunk_rows)
                .await
                .map_err(from_pg)?;
            if rows.is_empty() {
                break;
            }
            let mut chunk = Vec::with_capacity(rows.len());
            for r in &rows {
                let mut row = Vec::with_capacity(cols.len());
                for (i, (name, ty)) in cols.iter().enumerate() {
                    row.push(cell(r, i, ty, &format!("{table}.{name}"))?);
                }
                chunk.push(row);
            }
            let last = rows.len() < usize::try_from(chunk_rows).unwrap_or(usize::MAX);
            each(TableChunk {
                table,
                columns: names.clone(),
                rows: chunk,
            })
            .await?;
            if last {
                break;
            }
        }
    }
    tx.commit().await.map_err(from_pg)
}

/// A copy into an empty PostgreSQL database: everything in one
/// transaction, committed by [`PgLoader::commit`] (dropped before, nothing
/// stays).
pub struct PgLoader {
    client: deadpool_postgres::ClientWrapper,
    types: HashMap<&'static str, HashMap<String, Type>>,
    /// (session id, column, value) set at commit.
    late: Vec<(String, &'static str, String)>,
}

impl PgLoader {
    /// Migrates the database at `url`, refuses it unless every table is
    /// empty, and begins the transaction. Hold its runtime lock
    /// ([`crate::PgRuntimeLock`]) first, so no keel starts on it meanwhile.
    pub async fn create(url: &str) -> Result<Self> {
        let client = connect(url).await?;
        crate::migrate(&client).await.map_err(from_pg_store)?;
        let mut types = HashMap::new();
        for table in COPY_TABLES {
            let rows: i64 = client
                .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                .await
                .map_err(from_pg)?
                .get(0);
            if rows > 0 {
                return Err(StoreError::Conflict(format!(
                    "the target database is not empty ({table} holds {rows} row(s)); \
                     copy into a new one"
                )));
            }
            let cols = columns(&client.prepare(&all_columns(table)).await.map_err(from_pg)?);
            types.insert(table, cols.into_iter().collect());
        }
        client
            .batch_execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
            .await
            .map_err(from_pg)?;
        Ok(Self {
            client,
            types,
            late: Vec::new(),
        })
    }

    /// Inserts `chunk`'s rows.
    pub async fn insert(&mut self, chunk: &TableChunk) -> Result<()> {
        let table = chunk.table;
        let types = self
            .types
            .get(table)
            .ok_or_else(|| StoreError::InvalidInput(format!("no table {table} to copy into")))?;
        let mut tys = Vec::with_capacity(chunk.columns.len());
        for name in &chunk.columns {
            tys.push(types.get(name).cloned().ok_or_else(|| {
                StoreError::InvalidInput(format!(
                    "{table}.{name} is not a column of the target's schema"
                ))
            })?);
        }
        let late_at: Vec<(usize, &'static str)> = if table == "sessions" {
            SESSION_LATE
                .iter()
                .filter_map(|c| chunk.columns.iter().position(|n| n == c).map(|i| (i, *c)))
                .collect()
        } else {
            Vec::new()
        };
        let id_at = chunk.columns.iter().position(|n| n == "id");
        let marks: Vec<String> = (1..=chunk.columns.len()).map(|i| format!("${i}")).collect();
        let stmt = self
            .client
            .prepare(&format!(
                "INSERT INTO {table} ({}) VALUES ({})",
                chunk.columns.join(", "),
                marks.join(", ")
            ))
            .await
            .map_err(from_pg)?;
        for row in &chunk.rows {
            let mut values: Vec<Box<dyn ToSql + Sync + Send>> = Vec::with_capacity(row.len());
            for (i, (c, ty)) in row.iter().zip(&tys).enumerate() {
                let what = || format!("{table}.{}", chunk.columns[i]);
                if let Some((_, column)) = late_at.iter().find(|(at, _)| *at == i) {
                    if let (Cell::Text(v), Some(Cell::Text(id))) =
                        (c, id_at.and_then(|at| row.get(at)))
                    {
                        self.late.push((id.clone(), column, v.clone()));
                    }
                    values.push(Box::new(None::<String>));
                    continue;
                }
                values.push(bind(c, ty, &what)?);
            }
            let refs: Vec<&(dyn ToSql + Sync)> = values
                .iter()
                .map(|v| v.as_ref() as &(dyn ToSql + Sync))
                .collect();
            self.client.execute(&stmt, &refs).await.map_err(from_pg)?;
        }
        Ok(())
    }

    /// Sets what was held back, moves identity sequences past the copied
    /// keys, and commits.
    pub async fn commit(self) -> Result<()> {
        for (session, column, value) in &self.late {
            self.client
                .execute(
                    &format!("UPDATE sessions SET {column} = $1 WHERE id = $2"),
                    &[value, session],
                )
                .await
                .map_err(from_pg)?;
        }
        for (table, column) in IDENTITIES {
            self.client
                .execute(
                    &format!(
                        "SELECT setval(pg_get_serial_sequence('{table}', '{column}'), \
                         max({column})) FROM {table} HAVING count(*) > 0"
                    ),
                    &[],
                )
                .await
                .map_err(from_pg)?;
        }
        self.client.batch_execute("COMMIT").await.map_err(from_pg)
    }
}

/// `cell` as a parameter of PostgreSQL type `ty`.
fn bind(cell: &Cell, ty: &Type, what: &dyn Fn() -> String) -> Result<Box<dyn ToSql + Sync + Send>> {
    let wrong =
        || StoreError::InvalidInput(format!("{}: a {cell:?} cannot be stored as {ty}", what()));
    Ok(match (ty, cell) {
        (&Type::INT8, Cell::Integer(i)) => Box::new(Some(*i)),
        (&Type::INT8, Cell::Null) => Box::new(None::<i64>),
        (&Type::FLOAT8, Cell::Real(f)) => Box::new(Some(*f)),
        // SQLite keeps a whole REAL as an integer when it can.
        (&Type::FLOAT8, Cell::Integer(i)) => Box::new(Some(*i as f64)),
        (&Type::FLOAT8, Cell::Null) => Box::new(None::<f64>),
        (&Type::TEXT, Cell::Text(t)) => Box::new(Some(t.clone())),
        (&Type::TEXT, Cell::Null) => Box::new(None::<String>),
        (&Type::BYTEA, Cell::Blob(b)) => Box::new(Some(b.clone())),
        (&Type::BYTEA, Cell::Null) => Box::new(None::<Vec<u8>>),
        _ => return Err(wrong()),
    })
}
