//! Sessions and dialogs on PostgreSQL: the `sessions` table keyed by id and
//! by (channel, chat_id, dialog_id), the session tree, soft deletion and
//! cursor-paginated listings (keel-store's `sessions.rs`, the same rules).

use std::sync::Arc;

use keel_core::SessionId;
use keel_store::{
    DialogCursor, DialogQuery, NewSession, Page, Result, RunRecord, SessionRecord, StoreError,
    TimelineId, TurnCommit, TurnCommitted,
};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::store::Tx;

use crate::messages::{commit_turn_tx, encode};
use crate::store::from_pg;
use crate::util::{fresh_id, non_negative, parse, parse_opt};
use crate::PgStore;

// Text keys are compared and ordered `COLLATE "C"` (byte order, as SQLite's
// BINARY), whatever the database's collation, so listings and cursors
// follow SQLite's order exactly.
const SESSION_COLUMNS: &str = session_columns!();

fn session_from_row(r: &Row) -> Result<SessionRecord> {
    let id: String = r.get(0);
    let head: Option<String> = r.get(12);
    Ok(SessionRecord {
        id: parse("sessions.id", &id)?,
        channel: r.get(1),
        chat_id: r.get(2),
        dialog_id: r.get(3),
        title: r.get(4),
        agent_id: parse_opt("sessions.agent_id", r.get(5))?,
        parent_id: parse_opt("sessions.parent_id", r.get(6))?,
        created_at_ms: r.get(7),
        last_active_at_ms: r.get(8),
        message_count: non_negative("sessions.message_count", r.get(9))?,
        deleted_at_ms: r.get(10),
        delivery_context: r.get(11),
        head_timeline_id: TimelineId(
            head.ok_or_else(|| StoreError::corrupt("sessions.head_timeline_id", "NULL"))?,
        ),
        state_hash: r.get(13),
    })
}

pub(crate) async fn get_session_tx(tx: &Tx<'_>, id: &SessionId) -> Result<Option<SessionRecord>> {
    let sql = format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1");
    tx.query_opt(&sql, &[&id.to_string()])
        .await
        .map_err(from_pg)?
        .map(|r| session_from_row(&r))
        .transpose()
}

/// The session `id`, its row locked (`FOR NO KEY UPDATE`) until the
/// transaction ends: the writes of one dialog's history, inputs and
/// checkpoints take it first, so they run one at a time whatever their
/// isolation level, and writes to other dialogs never wait for them.
pub(crate) async fn lock_session(tx: &Tx<'_>, id: &SessionId) -> Result<SessionRecord> {
    let row = tx
        .query_opt(LOCK_SESSION, &[&id.to_string()])
        .await
        .map_err(from_pg)?;
    locked_session(row, id)
}

/// The statement of [`lock_session`]: session `$1`, its row locked.
pub(crate) const LOCK_SESSION: &str = concat!(
    "SELECT ",
    session_columns!(),
    " FROM sessions WHERE id = $1 FOR NO KEY UPDATE"
);

/// The session [`LOCK_SESSION`] returned, if it found `id`.
pub(crate) fn locked_session(row: Option<Row>, id: &SessionId) -> Result<SessionRecord> {
    row.map(|r| session_from_row(&r))
        .transpose()?
        .ok_or_else(|| StoreError::NotFound(format!("session {id}")))
}

pub(crate) async fn require_session(tx: &Tx<'_>, id: &SessionId) -> Result<SessionRecord> {
    get_session_tx(tx, id)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("session {id}")))
}

async fn query_sessions(
    tx: &Tx<'_>,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<SessionRecord>> {
    tx.query(sql, params)
        .await
        .map_err(from_pg)?
        .iter()
        .map(session_from_row)
        .collect()
}

fn validate(s: &NewSession) -> Result<()> {
    for (what, v) in [
        ("channel", &s.channel),
        ("chat_id", &s.chat_id),
        ("dialog_id", &s.dialog_id),
    ] {
        if v.is_empty() {
            return Err(StoreError::InvalidInput(format!("{what} is empty")));
        }
    }
    Ok(())
}

/// Refuses a page size outside 1..=1000.
pub(crate) fn check_limit(query: &DialogQuery) -> Result<()> {
    if query.limit == 0 || query.limit > 1000 {
        return Err(StoreError::InvalidInput(format!(
            "limit {} is outside 1..=1000",
            query.limit
        )));
    }
    Ok(())
}

/// One page of a chat's dialogs (see `Backend::list_dialogs`).
pub(crate) async fn list_dialogs_tx(
    tx: &Tx<'_>,
    query: &DialogQuery,
) -> Result<Page<SessionRecord, DialogCursor>> {
    let (cursor_at, cursor_id) = match &query.cursor {
        Some(cur) => (cur.created_at_ms, cur.id.to_string()),
        None => (i64::MAX, String::new()),
    };
    let first_page = query.cursor.is_none();
    let sql = format!(
        "SELECT {SESSION_COLUMNS} FROM sessions \
         WHERE channel = $1 AND chat_id = $2 \
           AND ($3::boolean OR deleted_at IS NULL) \
           AND ($4::boolean OR (created_at, id COLLATE \"C\") < ($5::bigint, $6::text)) \
         ORDER BY created_at DESC, id COLLATE \"C\" DESC LIMIT $7"
    );
    let limit = i64::try_from(query.limit + 1).unwrap_or(i64::MAX);
    let mut items = query_sessions(
        tx,
        &sql,
        &[
            &query.channel,
            &query.chat_id,
            &query.include_deleted,
            &first_page,
            &cursor_at,
            &cursor_id,
            &limit,
        ],
    )
    .await?;
    let next_cursor = if items.len() > query.limit {
        items.truncate(query.limit);
        items.last().map(|s| DialogCursor {
            created_at_ms: s.created_at_ms,
            id: s.id,
        })
    } else {
        None
    };
    Ok(Page { items, next_cursor })
}

/// Inserts a session row and its timeline (root, or forked from `fork_of`).
pub(crate) async fn insert_session_tx(
    tx: &Tx<'_>,
    s: &NewSession,
    fork_of: Option<(&str, i64)>,
    state_hash: Option<&str>,
) -> Result<SessionRecord> {
    validate(s)?;
    if get_session_tx(tx, &s.id).await?.is_some() {
        return Err(StoreError::Conflict(format!(
            "session {} already exists",
            s.id
        )));
    }
    let clash = tx
        .query_opt(
            "SELECT id FROM sessions WHERE channel = $1 AND chat_id = $2 AND dialog_id = $3",
            &[&s.channel, &s.chat_id, &s.dialog_id],
        )
        .await
        .map_err(from_pg)?;
    if let Some(other) = clash {
        let other: String = other.get(0);
        return Err(StoreError::Conflict(format!(
            "dialog {}:{}:{} already belongs to session {other}",
            s.channel, s.chat_id, s.dialog_id
        )));
    }
    let timeline = fresh_id();
    // A fork starts with the history it shares, and counts its inputs.
    let message_count = match fork_of {
        Some((parent, seq)) => crate::messages::visible_inputs(tx, parent, seq).await?,
        None => 0,
    };
    let id = s.id.to_string();
    tx.execute(
        "INSERT INTO sessions (id, channel, chat_id, dialog_id, title, agent_id, parent_id, \
         created_at, last_active_at, message_count, delivery_context, \
         delivery_context_updated_at, state_hash) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $12, $9, $10, $11)",
        &[
            &id,
            &s.channel,
            &s.chat_id,
            &s.dialog_id,
            &s.title,
            &s.agent_id.as_ref().map(|a| a.as_str().to_owned()),
            &s.parent_id.map(|p| p.to_string()),
            &s.now_ms,
            &s.delivery_context,
            &s.delivery_context.as_ref().map(|_| s.now_ms),
            &state_hash,
            &message_count,
        ],
    )
    .await
    .map_err(from_pg)?;
    tx.execute(
        "INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, created_at) \
         VALUES ($1, $2, $3, $4, $5)",
        &[
            &timeline,
            &id,
            &fork_of.map(|f| f.0),
            &fork_of.map(|f| f.1),
            &s.now_ms,
        ],
    )
    .await
    .map_err(from_pg)?;
    tx.execute(
        "UPDATE sessions SET head_timeline_id = $1 WHERE id = $2",
        &[&timeline, &id],
    )
    .await
    .map_err(from_pg)?;
    require_session(tx, &s.id).await
}

async fn touch_tx(tx: &Tx<'_>, id: &SessionId, now_ms: i64) -> Result<()> {
    let n = tx
        .execute(
            "UPDATE sessions SET last_active_at = GREATEST(last_active_at, $1) WHERE id = $2",
            &[&now_ms, &id.to_string()],
        )
        .await
        .map_err(from_pg)?;
    if n == 0 {
        return Err(StoreError::NotFound(format!("session {id}")));
    }
    Ok(())
}

impl PgStore {
    pub(crate) async fn create_session(&self, session: NewSession) -> Result<SessionRecord> {
        self.write(move |tx| {
            let session = session.clone();
            Box::pin(async move { insert_session_tx(tx, &session, None, None).await })
        })
        .await
    }

    pub(crate) async fn import_session(
        &self,
        session: NewSession,
        turn: TurnCommit,
        runs: Vec<RunRecord>,
    ) -> Result<TurnCommitted> {
        if turn.session_id != session.id {
            return Err(StoreError::Conflict(format!(
                "the imported history belongs to session {}, not {}",
                turn.session_id, session.id
            )));
        }
        let encoded = Arc::new(encode(&turn.messages)?);
        let (session, turn, runs) = (Arc::new(session), Arc::new(turn), Arc::new(runs));
        self.write(move |tx| {
            let (session, turn, runs, encoded) =
                (session.clone(), turn.clone(), runs.clone(), encoded.clone());
            Box::pin(async move {
                insert_session_tx(tx, &session, None, None).await?;
                let committed = commit_turn_tx(tx, &turn, &encoded, &[]).await?;
                crate::runs::import_runs_tx(tx, &session, &runs).await?;
                Ok(committed)
            })
        })
        .await
    }

    pub(crate) async fn upsert_session(&self, session: NewSession) -> Result<SessionRecord> {
        self.write(move |tx| {
            let session = session.clone();
            Box::pin(async move {
                let Some(existing) = get_session_tx(tx, &session.id).await? else {
                    return insert_session_tx(tx, &session, None, None).await;
                };
                if (&existing.channel, &existing.chat_id, &existing.dialog_id)
                    != (&session.channel, &session.chat_id, &session.dialog_id)
                {
                    return Err(StoreError::Conflict(format!(
                        "session {} belongs to another dialog",
                        session.id
                    )));
                }
                tx.execute(
                    "UPDATE sessions SET title = $1, agent_id = $2, parent_id = $3, \
                     delivery_context = $4, \
                     delivery_context_updated_at = CASE \
                       WHEN delivery_context IS NOT DISTINCT FROM $4 \
                       THEN delivery_context_updated_at ELSE $5 END, \
                     last_active_at = GREATEST(last_active_at, $5) WHERE id = $6",
                    &[
                        &session.title,
                        &session.agent_id.as_ref().map(|a| a.as_str().to_owned()),
                        &session.parent_id.map(|p| p.to_string()),
                        &session.delivery_context,
                        &session.now_ms,
                        &session.id.to_string(),
                    ],
                )
                .await
                .map_err(from_pg)?;
                require_session(tx, &session.id).await
            })
        })
        .await
    }

    pub(crate) async fn get_session(&self, id: SessionId) -> Result<Option<SessionRecord>> {
        self.one_statement(move |tx| Box::pin(async move { get_session_tx(tx, &id).await }))
            .await
    }

    pub(crate) async fn get_dialog(
        &self,
        channel: &str,
        chat_id: &str,
        dialog_id: &str,
    ) -> Result<Option<SessionRecord>> {
        let key = Arc::new((channel.to_owned(), chat_id.to_owned(), dialog_id.to_owned()));
        self.read(move |tx| {
            let key = key.clone();
            Box::pin(async move {
                let sql = format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions \
                     WHERE channel = $1 AND chat_id = $2 AND dialog_id = $3"
                );
                Ok(query_sessions(tx, &sql, &[&key.0, &key.1, &key.2])
                    .await?
                    .pop())
            })
        })
        .await
    }

    pub(crate) async fn list_dialogs(
        &self,
        query: DialogQuery,
    ) -> Result<Page<SessionRecord, DialogCursor>> {
        check_limit(&query)?;
        self.read(move |tx| {
            let query = query.clone();
            Box::pin(async move { list_dialogs_tx(tx, &query).await })
        })
        .await
    }

    pub(crate) async fn latest_active_dialog(
        &self,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<SessionRecord>> {
        let key = Arc::new((channel.to_owned(), chat_id.to_owned()));
        self.read(move |tx| {
            let key = key.clone();
            Box::pin(async move {
                let sql = format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions \
                     WHERE channel = $1 AND chat_id = $2 AND deleted_at IS NULL \
                     ORDER BY last_active_at DESC, id COLLATE \"C\" DESC LIMIT 1"
                );
                Ok(query_sessions(tx, &sql, &[&key.0, &key.1]).await?.pop())
            })
        })
        .await
    }

    pub(crate) async fn rename_session(
        &self,
        id: SessionId,
        title: String,
        now_ms: i64,
    ) -> Result<()> {
        self.write(move |tx| {
            let title = title.clone();
            Box::pin(async move {
                let n = tx
                    .execute(
                        "UPDATE sessions SET title = $1, \
                         last_active_at = GREATEST(last_active_at, $2) WHERE id = $3",
                        &[&title, &now_ms, &id.to_string()],
                    )
                    .await
                    .map_err(from_pg)?;
                if n == 0 {
                    return Err(StoreError::NotFound(format!("session {id}")));
                }
                Ok(())
            })
        })
        .await
    }

    pub(crate) async fn soft_delete_session(&self, id: SessionId, now_ms: i64) -> Result<bool> {
        self.write(move |tx| {
            Box::pin(async move {
                require_session(tx, &id).await?;
                let key = id.to_string();
                let n = tx
                    .execute(
                        "UPDATE sessions SET deleted_at = $1 WHERE id = $2 AND deleted_at IS NULL",
                        &[&now_ms, &key],
                    )
                    .await
                    .map_err(from_pg)?;
                tx.execute("DELETE FROM queued_inputs WHERE session_id = $1", &[&key])
                    .await
                    .map_err(from_pg)?;
                tx.execute(
                    "DELETE FROM webhook_subscriptions WHERE session_id = $1",
                    &[&key],
                )
                .await
                .map_err(from_pg)?;
                Ok(n == 1)
            })
        })
        .await
    }

    pub(crate) async fn touch_session(&self, id: SessionId, now_ms: i64) -> Result<()> {
        self.write(move |tx| Box::pin(async move { touch_tx(tx, &id, now_ms).await }))
            .await
    }

    pub(crate) async fn set_delivery_context(
        &self,
        id: SessionId,
        context: Option<String>,
        now_ms: i64,
    ) -> Result<()> {
        self.write(move |tx| {
            let context = context.clone();
            Box::pin(async move {
                let n = tx
                    .execute(
                        "UPDATE sessions SET delivery_context = $1, \
                         delivery_context_updated_at = $2 WHERE id = $3",
                        &[&context, &now_ms, &id.to_string()],
                    )
                    .await
                    .map_err(from_pg)?;
                if n == 0 {
                    return Err(StoreError::NotFound(format!("session {id}")));
                }
                Ok(())
            })
        })
        .await
    }

    pub(crate) async fn child_sessions(&self, parent: SessionId) -> Result<Vec<SessionRecord>> {
        self.read(move |tx| {
            Box::pin(async move {
                let sql = format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE parent_id = $1 \
                     ORDER BY created_at, id COLLATE \"C\""
                );
                query_sessions(tx, &sql, &[&parent.to_string()]).await
            })
        })
        .await
    }
}
