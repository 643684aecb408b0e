//! Sessions and dialogs: the `sessions` table keyed by id and by
//! (channel, chat_id, dialog_id), the session tree, soft deletion and
//! cursor-paginated listings.

use keel_core::{AgentId, SessionId};
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::error::{Result, StoreError};
use crate::messages::{commit_turn_tx, encode, TurnCommit, TurnCommitted};
use crate::util::{fresh_id, non_negative, parse, parse_opt};
use crate::{Page, SqliteStore};

/// Identifies one linear run of a session's history (see the checkpoint design).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimelineId(
    /// The id as text (public so that other backends build it from their rows).
    pub String,
);

impl TimelineId {
    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for TimelineId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A session to create (or update, with [`Backend::upsert_session`](crate::Backend::upsert_session)).
#[derive(Debug, Clone, PartialEq)]
pub struct NewSession {
    /// Its id.
    pub id: SessionId,
    /// Channel of the dialog (`cli_chat`, `feishu` …).
    pub channel: String,
    /// Chat within the channel.
    pub chat_id: String,
    /// Dialog within the chat (`default` for the first one).
    pub dialog_id: String,
    /// Title shown in dialog lists.
    pub title: String,
    /// The agent definition running this session, if any.
    pub agent_id: Option<AgentId>,
    /// The parent session of a child session.
    pub parent_id: Option<SessionId>,
    /// Durable private delivery context (JSON), if any.
    pub delivery_context: Option<String>,
    /// Creation time (ms).
    pub now_ms: i64,
}

/// A stored session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    /// Its id.
    pub id: SessionId,
    /// Channel of the dialog.
    pub channel: String,
    /// Chat within the channel.
    pub chat_id: String,
    /// Dialog within the chat.
    pub dialog_id: String,
    /// Title.
    pub title: String,
    /// Agent definition, if any.
    pub agent_id: Option<AgentId>,
    /// Parent session, if any (None for roots and orphans).
    pub parent_id: Option<SessionId>,
    /// Creation time (ms).
    pub created_at_ms: i64,
    /// Last activity (ms).
    pub last_active_at_ms: i64,
    /// Visible user inputs so far.
    pub message_count: u64,
    /// Soft-deletion time, if deleted.
    pub deleted_at_ms: Option<i64>,
    /// Durable private delivery context (JSON).
    pub delivery_context: Option<String>,
    /// The timeline new messages are appended to.
    pub head_timeline_id: TimelineId,
    /// Hash of the live state blob, if any state was ever committed.
    pub state_hash: Option<String>,
}

/// Where a dialog listing continues: the (created_at, id) of the last item seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DialogCursor {
    /// `created_at_ms` of the last item of the previous page.
    pub created_at_ms: i64,
    /// `id` of the last item of the previous page.
    pub id: SessionId,
}

/// A listing of the dialogs of one chat, most recently created first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DialogQuery {
    /// Channel.
    pub channel: String,
    /// Chat.
    pub chat_id: String,
    /// Include soft-deleted dialogs.
    pub include_deleted: bool,
    /// Page size (1..=1000).
    pub limit: usize,
    /// Continue after this item.
    pub cursor: Option<DialogCursor>,
}

const SESSION_COLUMNS: &str = "id, channel, chat_id, dialog_id, title, agent_id, parent_id, \
     created_at, last_active_at, message_count, deleted_at, delivery_context, \
     head_timeline_id, state_hash";

fn session_from_row(r: &Row<'_>) -> Result<SessionRecord> {
    let id: String = r.get(0)?;
    let head: Option<String> = r.get(12)?;
    Ok(SessionRecord {
        id: parse("sessions.id", &id)?,
        channel: r.get(1)?,
        chat_id: r.get(2)?,
        dialog_id: r.get(3)?,
        title: r.get(4)?,
        agent_id: parse_opt("sessions.agent_id", r.get(5)?)?,
        parent_id: parse_opt("sessions.parent_id", r.get(6)?)?,
        created_at_ms: r.get(7)?,
        last_active_at_ms: r.get(8)?,
        message_count: non_negative("sessions.message_count", r.get(9)?)?,
        deleted_at_ms: r.get(10)?,
        delivery_context: r.get(11)?,
        head_timeline_id: TimelineId(
            head.ok_or_else(|| StoreError::corrupt("sessions.head_timeline_id", "NULL"))?,
        ),
        state_hash: r.get(13)?,
    })
}

pub(crate) fn get_session_tx(conn: &Connection, id: &SessionId) -> Result<Option<SessionRecord>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?1"
    ))?;
    let mut rows = stmt.query([id.to_string()])?;
    match rows.next()? {
        Some(r) => Ok(Some(session_from_row(r)?)),
        None => Ok(None),
    }
}

pub(crate) fn require_session(conn: &Connection, id: &SessionId) -> Result<SessionRecord> {
    get_session_tx(conn, id)?.ok_or_else(|| StoreError::NotFound(format!("session {id}")))
}

fn query_sessions(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<SessionRecord>> {
    let mut stmt = conn.prepare_cached(sql)?;
    let mut rows = stmt.query(params)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(session_from_row(r)?);
    }
    Ok(out)
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

/// One page of a chat's dialogs (see [`Backend::list_dialogs`](crate::Backend::list_dialogs)).
pub(crate) fn list_dialogs_tx(
    c: &Connection,
    query: &DialogQuery,
) -> Result<Page<SessionRecord, DialogCursor>> {
    let (cursor_at, cursor_id) = match &query.cursor {
        Some(cur) => (cur.created_at_ms, cur.id.to_string()),
        None => (i64::MAX, String::new()),
    };
    let first_page = query.cursor.is_none();
    let sql = format!(
        "SELECT {SESSION_COLUMNS} FROM sessions \
         WHERE channel = ?1 AND chat_id = ?2 \
           AND (?3 OR deleted_at IS NULL) \
           AND (?4 OR (created_at, id) < (?5, ?6)) \
         ORDER BY created_at DESC, id DESC LIMIT ?7"
    );
    let limit = i64::try_from(query.limit + 1).unwrap_or(i64::MAX);
    let mut items = query_sessions(
        c,
        &sql,
        params![
            query.channel,
            query.chat_id,
            query.include_deleted,
            first_page,
            cursor_at,
            cursor_id,
            limit
        ],
    )?;
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
pub(crate) fn insert_session_tx(
    conn: &Connection,
    s: &NewSession,
    fork_of: Option<(&str, i64)>,
    state_hash: Option<&str>,
) -> Result<SessionRecord> {
    validate(s)?;
    if get_session_tx(conn, &s.id)?.is_some() {
        return Err(StoreError::Conflict(format!(
            "session {} already exists",
            s.id
        )));
    }
    let clash: Option<String> = conn
        .query_row(
            "SELECT id FROM sessions WHERE channel = ?1 AND chat_id = ?2 AND dialog_id = ?3",
            params![s.channel, s.chat_id, s.dialog_id],
            |r| r.get(0),
        )
        .optional()?;
    if let Some(other) = clash {
        return Err(StoreError::Conflict(format!(
            "dialog {}:{}:{} already belongs to session {other}",
            s.channel, s.chat_id, s.dialog_id
        )));
    }
    let timeline = fresh_id();
    // A fork starts with the history it shares, and counts its inputs.
    let message_count = match fork_of {
        Some((parent, seq)) => crate::messages::visible_inputs(conn, parent, seq)?,
        None => 0,
    };
    conn.execute(
        "INSERT INTO sessions (id, channel, chat_id, dialog_id, title, agent_id, parent_id, \
         created_at, last_active_at, message_count, delivery_context, \
         delivery_context_updated_at, state_hash) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8, ?12, ?9, ?10, ?11)",
        params![
            s.id.to_string(),
            s.channel,
            s.chat_id,
            s.dialog_id,
            s.title,
            s.agent_id.as_ref().map(|a| a.as_str().to_owned()),
            s.parent_id.map(|p| p.to_string()),
            s.now_ms,
            s.delivery_context,
            s.delivery_context.as_ref().map(|_| s.now_ms),
            state_hash,
            message_count,
        ],
    )?;
    conn.execute(
        "INSERT INTO timelines (id, session_id, parent_timeline_id, fork_seq, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![
            timeline,
            s.id.to_string(),
            fork_of.map(|f| f.0),
            fork_of.map(|f| f.1),
            s.now_ms
        ],
    )?;
    conn.execute(
        "UPDATE sessions SET head_timeline_id = ?1 WHERE id = ?2",
        params![timeline, s.id.to_string()],
    )?;
    require_session(conn, &s.id)
}

fn touch_tx(conn: &Connection, id: &SessionId, now_ms: i64) -> Result<()> {
    let n = conn.execute(
        "UPDATE sessions SET last_active_at = max(last_active_at, ?1) WHERE id = ?2",
        params![now_ms, id.to_string()],
    )?;
    if n == 0 {
        return Err(StoreError::NotFound(format!("session {id}")));
    }
    Ok(())
}

pub(crate) fn bump_activity(
    conn: &Connection,
    id: &SessionId,
    now_ms: i64,
    inputs: u32,
) -> Result<()> {
    let n = conn.execute(
        "UPDATE sessions SET last_active_at = max(last_active_at, ?1), \
         message_count = message_count + ?2 WHERE id = ?3",
        params![now_ms, inputs, id.to_string()],
    )?;
    if n == 0 {
        return Err(StoreError::NotFound(format!("session {id}")));
    }
    Ok(())
}

impl SqliteStore {
    pub(crate) async fn create_session(&self, session: NewSession) -> Result<SessionRecord> {
        self.db
            .write(move |c| insert_session_tx(c, &session, None, None))
            .await
    }

    pub(crate) async fn import_session(
        &self,
        session: NewSession,
        turn: TurnCommit,
        runs: Vec<crate::RunRecord>,
    ) -> Result<TurnCommitted> {
        if turn.session_id != session.id {
            return Err(StoreError::Conflict(format!(
                "the imported history belongs to session {}, not {}",
                turn.session_id, session.id
            )));
        }
        let encoded = encode(self.path(), &turn.messages)?;
        self.db
            .write(move |c| {
                insert_session_tx(c, &session, None, None)?;
                let committed = commit_turn_tx(c, &turn, &encoded, None, &[])?;
                crate::runs::import_runs_tx(c, &session, &runs)?;
                Ok(committed)
            })
            .await
    }

    pub(crate) async fn upsert_session(&self, session: NewSession) -> Result<SessionRecord> {
        self.db
            .write(move |c| {
                let Some(existing) = get_session_tx(c, &session.id)? else {
                    return insert_session_tx(c, &session, None, None);
                };
                if (&existing.channel, &existing.chat_id, &existing.dialog_id)
                    != (&session.channel, &session.chat_id, &session.dialog_id)
                {
                    return Err(StoreError::Conflict(format!(
                        "session {} belongs to another dialog",
                        session.id
                    )));
                }
                c.execute(
                    "UPDATE sessions SET title = ?1, agent_id = ?2, parent_id = ?3, \
                     delivery_context = ?4, \
                     delivery_context_updated_at = CASE WHEN delivery_context IS ?4 \
                       THEN delivery_context_updated_at ELSE ?5 END, \
                     last_active_at = max(last_active_at, ?5) WHERE id = ?6",
                    params![
                        session.title,
                        session.agent_id.as_ref().map(|a| a.as_str().to_owned()),
                        session.parent_id.map(|p| p.to_string()),
                        session.delivery_context,
                        session.now_ms,
                        session.id.to_string()
                    ],
                )?;
                require_session(c, &session.id)
            })
            .await
    }

    pub(crate) async fn get_session(&self, id: SessionId) -> Result<Option<SessionRecord>> {
        self.db.read(move |c| get_session_tx(c, &id)).await
    }

    pub(crate) async fn get_dialog(
        &self,
        channel: &str,
        chat_id: &str,
        dialog_id: &str,
    ) -> Result<Option<SessionRecord>> {
        let key = (channel.to_owned(), chat_id.to_owned(), dialog_id.to_owned());
        self.db
            .read(move |c| {
                let sql = format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions \
                     WHERE channel = ?1 AND chat_id = ?2 AND dialog_id = ?3"
                );
                Ok(query_sessions(c, &sql, params![key.0, key.1, key.2])?.pop())
            })
            .await
    }

    pub(crate) async fn list_dialogs(
        &self,
        query: DialogQuery,
    ) -> Result<Page<SessionRecord, DialogCursor>> {
        check_limit(&query)?;
        self.db.read(move |c| list_dialogs_tx(c, &query)).await
    }

    pub(crate) async fn latest_active_dialog(
        &self,
        channel: &str,
        chat_id: &str,
    ) -> Result<Option<SessionRecord>> {
        let key = (channel.to_owned(), chat_id.to_owned());
        self.db
            .read(move |c| {
                let sql = format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions \
                     WHERE channel = ?1 AND chat_id = ?2 AND deleted_at IS NULL \
                     ORDER BY last_active_at DESC, id DESC LIMIT 1"
                );
                Ok(query_sessions(c, &sql, params![key.0, key.1])?.pop())
            })
            .await
    }

    pub(crate) async fn rename_session(
        &self,
        id: SessionId,
        title: String,
        now_ms: i64,
    ) -> Result<()> {
        self.db
            .write(move |c| {
                let n = c.execute(
                    "UPDATE sessions SET title = ?1, last_active_at = max(last_active_at, ?2) \
                     WHERE id = ?3",
                    params![title, now_ms, id.to_string()],
                )?;
                if n == 0 {
                    return Err(StoreError::NotFound(format!("session {id}")));
                }
                Ok(())
            })
            .await
    }

    pub(crate) async fn soft_delete_session(&self, id: SessionId, now_ms: i64) -> Result<bool> {
        self.db
            .write(move |c| {
                require_session(c, &id)?;
                let n = c.execute(
                    "UPDATE sessions SET deleted_at = ?1 WHERE id = ?2 AND deleted_at IS NULL",
                    params![now_ms, id.to_string()],
                )?;
                c.execute(
                    "DELETE FROM queued_inputs WHERE session_id = ?1",
                    [id.to_string()],
                )?;
                c.execute(
                    "DELETE FROM webhook_subscriptions WHERE session_id = ?1",
                    [id.to_string()],
                )?;
                Ok(n == 1)
            })
            .await
    }

    pub(crate) async fn touch_session(&self, id: SessionId, now_ms: i64) -> Result<()> {
        self.db.write(move |c| touch_tx(c, &id, now_ms)).await
    }

    pub(crate) async fn set_delivery_context(
        &self,
        id: SessionId,
        context: Option<String>,
        now_ms: i64,
    ) -> Result<()> {
        self.db
            .write(move |c| {
                let n = c.execute(
                    "UPDATE sessions SET delivery_context = ?1, delivery_context_updated_at = ?2 \
                     WHERE id = ?3",
                    params![context, now_ms, id.to_string()],
                )?;
                if n == 0 {
                    return Err(StoreError::NotFound(format!("session {id}")));
                }
                Ok(())
            })
            .await
    }

    pub(crate) async fn child_sessions(&self, parent: SessionId) -> Result<Vec<SessionRecord>> {
        self.db
            .read(move |c| {
                let sql = format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE parent_id = ?1 \
                     ORDER BY created_at, id"
                );
                query_sessions(c, &sql, [parent.to_string()])
            })
            .await
    }
}
