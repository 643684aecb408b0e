//! What clients read about a root session's sub-agent work: runs filtered
//! and paginated, the inbox events of one run, and everything that changed
//! after a client revision (one snapshot, so a reconnecting client catches
//! up without a gap).

use keel_core::{AgentId, EventId, GroupId, RunId, RunStatus, SessionId};
use rusqlite::params;

use crate::counters::usage_tx;
use crate::error::{Result, StoreError};
use crate::inbox::{query_events, InboxEvent};
use crate::runs::{query_runs, RunCursor, RunRecord};
use crate::{Page, SqliteStore};

/// A filtered listing of runs, newest first, paginated by (created_at, id).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunQuery {
    /// Only runs of this root session.
    pub root_session_id: Option<SessionId>,
    /// Only runs in one of these statuses (any status when empty).
    pub statuses: Vec<RunStatus>,
    /// Only runs of this agent.
    pub agent_id: Option<AgentId>,
    /// Only runs of this group.
    pub group_id: Option<GroupId>,
    /// Only children of this run.
    pub parent_run_id: Option<RunId>,
    /// Page size (1..=1000).
    pub limit: usize,
    /// Continue after this item.
    pub cursor: Option<RunCursor>,
}

/// Where an event listing continues: the (created_at, id) of the last item seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventCursor {
    /// `created_at_ms` of the last item of the previous page.
    pub created_at_ms: i64,
    /// `id` of the last item of the previous page.
    pub id: EventId,
}

/// Runs and inbox events of a root session changed after a client revision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentChanges {
    /// The session's revision when read: every change up to it is included.
    pub revision: u64,
    /// Runs whose last change has a revision above the one asked for, by revision.
    pub runs: Vec<RunRecord>,
    /// Events whose last change has a revision above the one asked for, by revision.
    pub events: Vec<InboxEvent>,
}

/// The rows to fetch for a page of `limit` (1..=1000): one more, to tell
/// whether another page follows.
pub(crate) fn page_fetch(limit: usize) -> Result<i64> {
    if limit == 0 || limit > 1000 {
        return Err(StoreError::InvalidInput(format!(
            "limit {limit} is outside 1..=1000"
        )));
    }
    Ok(i64::try_from(limit + 1).unwrap_or(i64::MAX))
}

impl SqliteStore {
    pub(crate) async fn query_runs(&self, query: RunQuery) -> Result<Page<RunRecord, RunCursor>> {
        let fetch = page_fetch(query.limit)?;
        self.db
            .read(move |c| {
                let (at, id) = match &query.cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MAX, String::new()),
                };
                // Statuses as ",a,b," so one parameter filters any subset.
                let statuses = (!query.statuses.is_empty()).then(|| {
                    let names: Vec<&str> = query.statuses.iter().map(|s| s.as_str()).collect();
                    format!(",{},", names.join(","))
                });
                let mut items = query_runs(
                    c,
                    "WHERE (?1 IS NULL OR root_session_id = ?1) \
                       AND (?2 IS NULL OR instr(?2, ',' || status || ',') > 0) \
                       AND (?3 IS NULL OR agent_id = ?3) \
                       AND (?4 IS NULL OR group_id = ?4) \
                       AND (?5 IS NULL OR parent_run_id = ?5) \
                       AND (?6 OR (created_at, id) < (?7, ?8)) \
                     ORDER BY created_at DESC, id DESC LIMIT ?9",
                    params![
                        query.root_session_id.map(|s| s.to_string()),
                        statuses,
                        query.agent_id.as_ref().map(|a| a.as_str().to_owned()),
                        query.group_id.map(|g| g.to_string()),
                        query.parent_run_id.map(|r| r.to_string()),
                        query.cursor.is_none(),
                        at,
                        id,
                        fetch
                    ],
                )?;
                let next_cursor = if items.len() > query.limit {
                    items.truncate(query.limit);
                    items.last().map(|r| RunCursor {
                        created_at_ms: r.created_at_ms,
                        id: r.spec.id,
                    })
                } else {
                    None
                };
                Ok(Page { items, next_cursor })
            })
            .await
    }

    pub(crate) async fn query_session_events(
        &self,
        root_session_id: SessionId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        let fetch = page_fetch(limit)?;
        self.db
            .read(move |c| {
                let (at, id) = match &cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MAX, String::new()),
                };
                let items = query_events(
                    c,
                    "WHERE root_session_id = ?1 AND (?2 OR (created_at, id) < (?3, ?4)) \
                     ORDER BY created_at DESC, id DESC LIMIT ?5",
                    params![root_session_id.to_string(), cursor.is_none(), at, id, fetch],
                )?;
                Ok(event_page(items, limit))
            })
            .await
    }

    pub(crate) async fn run_events(
        &self,
        run_id: RunId,
        cursor: Option<EventCursor>,
        limit: usize,
    ) -> Result<Page<InboxEvent, EventCursor>> {
        let fetch = page_fetch(limit)?;
        self.db
            .read(move |c| {
                let (at, id) = match &cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MIN, String::new()),
                };
                let items = query_events(
                    c,
                    "WHERE run_id = ?1 AND (?2 OR (created_at, id) > (?3, ?4)) \
                     ORDER BY created_at, id LIMIT ?5",
                    params![run_id.to_string(), cursor.is_none(), at, id, fetch],
                )?;
                Ok(event_page(items, limit))
            })
            .await
    }

    pub(crate) async fn agent_changes_since(
        &self,
        root_session_id: SessionId,
        since_revision: u64,
        limit: usize,
    ) -> Result<AgentChanges> {
        let fetch = page_fetch(limit)? - 1;
        let since = i64::try_from(since_revision).unwrap_or(i64::MAX);
        self.db
            .read(move |c| {
                let root = root_session_id.to_string();
                let runs = query_runs(
                    c,
                    "WHERE root_session_id = ?1 AND revision > ?2 ORDER BY revision, id LIMIT ?3",
                    params![root, since, fetch],
                )?;
                let events = query_events(
                    c,
                    "WHERE root_session_id = ?1 AND revision > ?2 ORDER BY revision, id LIMIT ?3",
                    params![root, since, fetch],
                )?;
                let revision = usage_tx(c, &root_session_id)?.revision;
                Ok(AgentChanges {
                    revision,
                    runs,
                    events,
                })
            })
            .await
    }
}

/// The page of `limit` events out of `items` (fetched with one extra row).
fn event_page(mut items: Vec<InboxEvent>, limit: usize) -> Page<InboxEvent, EventCursor> {
    let next_cursor = if items.len() > limit {
        items.truncate(limit);
        items.last().map(|e| EventCursor {
            created_at_ms: e.created_at_ms,
            id: e.id,
        })
    } else {
        None
    };
    Page { items, next_cursor }
}
