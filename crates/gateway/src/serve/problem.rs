//! [`ApiError`]: every way a request to `keel serve` can fail, as an
//! `application/problem+json` response (RFC 9457). Client mistakes are
//! answered precisely and not logged as errors; internal failures answer a
//! generic text with an error id and log the detail under it.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use keel_engine::EngineError;
use keel_store::StoreError;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Media type of every error body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An error body (RFC 9457 problem details).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Problem {
    /// Always `about:blank`: `code` says what went wrong.
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status's reason phrase.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What was wrong, for a person.
    pub detail: String,
    /// What was wrong, for a program (`bad_request`, `not_found` …).
    pub code: String,
    /// Every problem when there are several (a catalog reload lists each definition error).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// Why a request failed; see the module docs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed: bad JSON, a wrong type, an unknown field, a bad id or value.
    #[error("{0}")]
    BadRequest(String),
    /// A dialog title is empty or holds a control or format character (bidi control, zero-width …).
    #[error("{0}")]
    InvalidTitle(String),
    /// No valid bearer token was presented.
    #[error("a valid bearer token is required (Authorization: Bearer <token>)")]
    Unauthorized,
    /// The request was not meant for this server: its `Host` or `Origin` names another site.
    #[error("{0}")]
    Forbidden(String),
    /// The named dialog, checkpoint, run or route does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The route exists but not with this method.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The request conflicts with the current state (e.g. no catalog to reload).
    #[error("{0}")]
    Conflict(String),
    /// The body is larger than the server accepts.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The body is not `application/json`.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The request was understood but what it points at cannot be processed
    /// (a reload found invalid definitions; each is listed).
    #[error("{detail}")]
    Unprocessable {
        /// Summary.
        detail: String,
        /// Every problem.
        errors: Vec<String>,
    },
    /// The server is shutting down, or storage stayed busy; retry later.
    #[error("{0}")]
    Unavailable(String),
    /// A failure of keel itself; the detail is in the log under `id`.
    #[error("internal error (id {id}); the operator can find details in the logs")]
    Internal {
        /// The id of the log line with the detail.
        id: String,
    },
}

/// Result of a request handler.
pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    /// Logs `detail` at error level under a fresh id and returns the generic error.
    pub fn internal(detail: &dyn std::fmt::Display) -> Self {
        let simple = uuid::Uuid::now_v7().simple().to_string();
        let id = simple[simple.len() - 16..].to_owned();
        tracing::error!(error_id = %id, error = %detail, "internal error answered with its id");
        ApiError::Internal { id }
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) | ApiError::InvalidTitle(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Unprocessable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "bad_request",
            ApiError::InvalidTitle(_) => "invalid_title",
            ApiError::Unauthorized => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::Conflict(_) => "conflict",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::Unprocessable { .. } => "unprocessable",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Internal { .. } => "internal",
        }
    }

    /// The problem body.
    pub fn problem(&self) -> Problem {
        let status = self.status();
        Problem {
            kind: "about:blank".to_owned(),
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            status: status.as_u16(),
            detail: self.to_string(),
            code: self.code().to_owned(),
            errors: match self {
                ApiError::Unprocessable { errors, .. } => errors.clone(),
                _ => Vec::new(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
        let mut response = (self.status(), body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        match self {
            ApiError::Unauthorized => {
                headers.insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"keel\""),
                );
            }
            ApiError::Unavailable(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        if let EngineError::Store(store) = e {
            return store.into();
        }
        if e.is_internal() {
            return ApiError::internal(&e);
        }
        match e {
            EngineError::SessionNotFound(_)
            | EngineError::CheckpointNotFound(_)
            | EngineError::RunNotFound(_)
            | EngineError::SlotNotFound(_)
            | EngineError::ApprovalNotFound(_) => ApiError::NotFound(e.to_string()),
            // The body names an agent the catalog lacks: the request is at
            // fault, not its target (a 404 would say the dialog is gone).
            EngineError::UnknownAgent(_) | EngineError::InvalidInput(_) => {
                ApiError::BadRequest(e.to_string())
            }
            EngineError::InvalidTitle(_) => ApiError::InvalidTitle(e.to_string()),
            EngineError::SpawnRejected => ApiError::Unavailable(e.to_string()),
            EngineError::SlotExists(_)
            | EngineError::SlotReadonly(_)
            | EngineError::SlotRule(_)
            | EngineError::SteerFull { .. }
            | EngineError::TurnRunning(_)
            | EngineError::Cancelled
            | EngineError::TimedOut { .. }
            | EngineError::ApprovalDecided { .. } => ApiError::Conflict(e.to_string()),
            EngineError::AgentRemoved(name) => ApiError::Conflict(format!(
                "agent {name:?} of this dialog is no longer defined (a reload of the agent catalog removed it); \
                 switch the dialog to another agent with PATCH /api/dialogs/{{id}} and {{\"agent\": NAME}}, \
                 or restore the definition and reload"
            )),
            other => ApiError::internal(&other),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(what) => ApiError::NotFound(format!("{what} not found")),
            StoreError::InvalidInput(what) => ApiError::BadRequest(what),
            StoreError::DiskFull { .. } => {
                tracing::error!(error = %e, "the disk is full; writes fail until space is freed");
                ApiError::Unavailable(
                    "the server's disk is full: nothing was saved; retry once space is freed"
                        .to_owned(),
                )
            }
            StoreError::Busy { .. } | StoreError::Io { .. } => {
                tracing::warn!(error = %e, "storage unavailable; the client is asked to retry");
                ApiError::Unavailable("storage is busy; retry shortly".to_owned())
            }
            other => ApiError::internal(&other),
        }
    }
}

/// The status and text of an axum extractor rejection as a problem.
fn rejection(status: StatusCode, text: String) -> ApiError {
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(text),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::UnsupportedMediaType(text),
        _ => ApiError::BadRequest(text),
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        rejection(r.status(), r.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        rejection(StatusCode::BAD_REQUEST, r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        rejection(StatusCode::BAD_REQUEST, r.body_text())
    }
}

/// A JSON object body as `T`; any other body is a problem. (serde would
/// also read a struct from a JSON array; the API takes objects only.)
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// Whether the request says its body is JSON (`application/json` or `…+json`).
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

impl<T, S> axum::extract::FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(ApiError::UnsupportedMediaType(
                "Expected request with `Content-Type: application/json`".to_owned(),
            ));
        }
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|r| rejection(r.status(), r.body_text()))?;
        let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
        if first.is_some_and(|b| *b != b'{') {
            return Err(ApiError::BadRequest(
                "the body must be a JSON object".to_owned(),
            ));
        }
        let axum::Json(value) = axum::Json::<T>::from_bytes(&bytes)?;
        Ok(ApiJson(value))
    }
}

/// `Query<T>` whose rejection is a problem.
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct ApiQuery<T>(pub T);

/// `Path<T>` whose rejection is a problem.
#[derive(Debug, axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct ApiPath<T>(pub T);
