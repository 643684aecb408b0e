//! What clients read about a root session's sub-agent work, on PostgreSQL
//! (keel-store's `projection.rs`): runs filtered and paginated, the inbox
//! events of one run, and everything that changed after a client revision,
//! each in one snapshot.

// Pages order and compare ids in the database's collation, not `COLLATE
// "C"`: every id here is canonical UUID text (lowercase hex, hyphens at the
// same places), which the libc and ICU collations sort in byte order, as
// SQLite does, and the default collation lets `(root_session_id,
// created_at DESC, id DESC)` serve a page of runs in order.

use keel_core::{RunId, SessionId};
use keel_store::{
    AgentChanges, EventCursor, InboxEvent, Page, Result, RunCursor, RunQuery, RunRecord,
};

use crate::counters::usage_tx;
use crate::inbox::query_events;
use crate::runs::query_runs;
use crate::util::page_fetch;
use crate::PgStore;

impl PgStore {
    pub(crate) async fn query_runs(&self, query: RunQuery) -> Result<Page<RunRecord, RunCursor>> {
        let fetch = page_fetch(query.limit)?;
        self.read(move |tx| {
            let query = query.clone();
            Box::pin(async move {
                let (at, id) = match &query.cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MAX, String::new()),
                };
                let statuses = (!query.statuses.is_empty()).then(|| {
                    query
                        .statuses
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                });
                let mut items = query_runs(
                    tx,
                    "WHERE ($1::text IS NULL OR root_session_id = $1) \
                       AND ($2::text[] IS NULL OR status = ANY($2)) \
                       AND ($3::text IS NULL OR agent_id = $3) \
                       AND ($4::text IS NULL OR group_id = $4) \
                       AND ($5::text IS NULL OR parent_run_id = $5) \
                       AND ($6 OR (created_at, id) < ($7, $8)) \
                     ORDER BY created_at DESC, id DESC LIMIT $9",
                    &[
                        &query.root_session_id.map(|s| s.to_string()),
                        &statuses,
                        &query.agent_id.as_ref().map(|a| a.as_str()),
                        &query.group_id.map(|g| g.to_string()),
                        &query.parent_run_id.map(|r| r.to_string()),
                        &query.cursor.is_none(),
                        &at,
                        &id,
                        &fetch,
                    ],
                )
                .await?;
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
        self.read(move |tx| {
            Box::pin(async move {
                let (at, id) = match &cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MAX, String::new()),
                };
                let items = query_events(
                    tx,
                    "WHERE root_session_id = $1 AND ($2 OR (created_at, id) < ($3, $4)) \
                     ORDER BY created_at DESC, id DESC LIMIT $5",
                    &[
                        &root_session_id.to_string(),
                        &cursor.is_none(),
                        &at,
                        &id,
                        &fetch,
                    ],
                )
                .await?;
                Ok(event_page(items, limit))
            })
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
        self.read(move |tx| {
            Box::pin(async move {
                let (at, id) = match &cursor {
                    Some(cur) => (cur.created_at_ms, cur.id.to_string()),
                    None => (i64::MIN, String::new()),
                };
                let items = query_events(
                    tx,
                    "WHERE run_id = $1 AND ($2 OR (created_at, id) > ($3, $4)) \
                     ORDER BY created_at, id LIMIT $5",
                    &[&run_id.to_string(), &cursor.is_none(), &at, &id, &fetch],
                )
                .await?;
                Ok(event_page(items, limit))
            })
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
        self.read(move |tx| {
            Box::pin(async move {
                let root = root_session_id.to_string();
                let runs = query_runs(
                    tx,
                    "WHERE root_session_id = $1 AND revision > $2 ORDER BY revision, id LIMIT $3",
                    &[&root, &since, &fetch],
                )
                .await?;
                let events = query_events(
                    tx,
                    "WHERE root_session_id = $1 AND revision > $2 ORDER BY revision, id LIMIT $3",
                    &[&root, &since, &fetch],
                )
                .await?;
                let revision = usage_tx(tx, &root_session_id).await?.revision;
                Ok(AgentChanges {
                    revision,
                    runs,
                    events,
                })
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
