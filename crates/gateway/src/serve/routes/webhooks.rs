//! `/api/webhooks/deliveries`: the webhook outbox, and the check of a
//! send's `webhook`.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use keel_store::{DeliveryStatus, WebhookDelivery};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::page_limit;
use crate::serve::api::IfBusy;
use crate::serve::openapi::Errors;
use crate::serve::problem::{ApiError, ApiQuery, ApiResult};
use crate::serve::webhooks::{aims_at, parse_url};
use crate::serve::Shared;

/// Which deliveries to list.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DeliveryListQuery {
    /// Only deliveries in this status.
    pub status: Option<WebhookDeliveryStatus>,
    /// `next_cursor` of the previous page.
    #[param(pattern = r"^[0-9]{1,18}$")]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<usize>,
}

/// Where a webhook delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WebhookDeliveryStatus {
    /// Not delivered yet; another attempt is due at `next_attempt_at_ms`.
    Pending,
    /// A 2xx answered an attempt.
    Delivered,
    /// Every attempt failed (`server.webhook_max_attempts`); no more are made.
    Dead,
}

impl From<WebhookDeliveryStatus> for DeliveryStatus {
    fn from(s: WebhookDeliveryStatus) -> Self {
        match s {
            WebhookDeliveryStatus::Pending => Self::Pending,
            WebhookDeliveryStatus::Delivered => Self::Delivered,
            WebhookDeliveryStatus::Dead => Self::Dead,
        }
    }
}

impl From<DeliveryStatus> for WebhookDeliveryStatus {
    fn from(s: DeliveryStatus) -> Self {
        match s {
            DeliveryStatus::Pending => Self::Pending,
            DeliveryStatus::Delivered => Self::Delivered,
            DeliveryStatus::Dead => Self::Dead,
        }
    }
}

/// One webhook delivery of the outbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookDeliveryView {
    /// The delivery id, sent as `webhook-id` with every attempt (deduplicate by it).
    pub id: String,
    /// Where it is POSTed.
    pub url: String,
    /// The event: `turn.completed` or `run.completed`.
    pub event: String,
    /// The dialog.
    pub session_id: Uuid,
    /// The turn (of a `turn.completed`, or the one that started the run).
    pub turn_id: Option<Uuid>,
    /// The run, of a `run.completed`.
    pub run_id: Option<Uuid>,
    /// Where it stands.
    pub status: WebhookDeliveryStatus,
    /// Attempts made.
    pub attempts: u32,
    /// When the next attempt is due (ms since the epoch), while pending.
    pub next_attempt_at_ms: Option<i64>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When it was created (ms since the epoch).
    pub created_at_ms: i64,
    /// When a 2xx answered (ms since the epoch).
    pub delivered_at_ms: Option<i64>,
    /// The JSON body POSTed (the same bytes at every attempt).
    pub body: serde_json::Value,
}

impl From<&WebhookDelivery> for WebhookDeliveryView {
    fn from(d: &WebhookDelivery) -> Self {
        Self {
            id: d.id.clone(),
            url: d.url.clone(),
            event: d.event.clone(),
            session_id: d.session_id.as_uuid(),
            turn_id: d.turn_id.map(|t| t.as_uuid()),
            run_id: d.run_id.map(|r| r.as_uuid()),
            status: d.status.into(),
            attempts: d.attempts,
            next_attempt_at_ms: d.next_attempt_at_ms,
            last_error: d.last_error.clone(),
            created_at_ms: d.created_at_ms,
            delivered_at_ms: d.delivered_at_ms,
            body: serde_json::from_str(&d.body).unwrap_or(serde_json::Value::Null),
        }
    }
}

/// A page of webhook deliveries, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookDeliveryPage {
    /// The deliveries.
    pub items: Vec<WebhookDeliveryView>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    pub next_cursor: Option<String>,
}

/// Lists the webhook outbox, oldest first: pending, delivered and dead
/// deliveries with their attempts.
#[utoipa::path(get, path = "/api/webhooks/deliveries", tag = "webhooks", operation_id = "list_webhook_deliveries", params(DeliveryListQuery),
    responses((status = 200, description = "A page of webhook deliveries", body = WebhookDeliveryPage), Errors))]
pub(crate) async fn list(
    State(shared): State<Arc<Shared>>,
    ApiQuery(q): ApiQuery<DeliveryListQuery>,
) -> ApiResult<Json<WebhookDeliveryPage>> {
    let limit = page_limit(q.limit)?;
    let cursor = match q.cursor.as_deref() {
        None => None,
        Some(c) => Some(c.parse::<i64>().ok().filter(|c| *c >= 0).ok_or_else(|| {
            ApiError::BadRequest(format!("{c:?} is not a cursor of this listing"))
        })?),
    };
    let rows = shared
        .app
        .store
        .list_webhook_deliveries(q.status.map(Into::into), cursor, limit + 1)
        .await?;
    let more = rows.len() > limit;
    let items: Vec<_> = rows.iter().take(limit).collect();
    Ok(Json(WebhookDeliveryPage {
        next_cursor: more
            .then(|| items.last().map(|d| d.seq.to_string()))
            .flatten(),
        items: items.into_iter().map(WebhookDeliveryView::from).collect(),
    }))
}

impl Shared {
    /// A send's `webhook`, checked: an http(s) URL not aimed at this server,
    /// with a secret to sign it, and not on a steer (which starts no turn).
    pub(crate) fn checked_webhook(
        &self,
        webhook: Option<String>,
        if_busy: IfBusy,
    ) -> ApiResult<Option<String>> {
        let Some(url) = webhook else {
            return Ok(None);
        };
        let parsed = parse_url(&url)
            .map_err(|e| ApiError::BadRequest(format!("webhook {url:?} is refused: {e}")))?;
        if aims_at(&parsed, self.addr) {
            return Err(ApiError::BadRequest(format!(
                "webhook {url:?} is refused: it points at this server"
            )));
        }
        if self.webhooks.secret.is_none() {
            return Err(ApiError::BadRequest(format!(
                "webhooks are off: the environment variable {} (server.webhook_secret_env) \
                 that signs them is unset",
                self.webhooks.secret_env
            )));
        }
        if if_busy == IfBusy::Steer {
            return Err(ApiError::BadRequest(
                "a webhook names the turn a send starts; `if_busy: steer` may start none \
                 (name the webhook on the send that started the running turn)"
                    .to_owned(),
            ));
        }
        Ok(Some(url))
    }
}
