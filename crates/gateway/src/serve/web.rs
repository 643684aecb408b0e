//! The web page at `/`: static files compiled into the binary from
//! `crates/gateway/web/` (plain ES modules, no build step; third-party
//! libraries vendored from npm under `web/vendor/`, see its `vendor.json`).
//!
//! Files are served under `/assets/<build>/…`, where `<build>` is a digest
//! of every file: a new binary with changed files has new URLs, so they are
//! cached as immutable, while `/` itself is revalidated on every load (its
//! ETag is the build). Every answer carries a strict Content-Security-Policy
//! (scripts only from this origin, no inline script or style, Trusted Types
//! for HTML sinks) as defence in depth behind the page's Markdown sanitizer.

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::problem::ApiError;

/// One embedded file.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    /// Path below `web/` (and below `/assets/<build>/` in URLs).
    pub path: &'static str,
    /// Its `Content-Type`.
    pub content_type: &'static str,
    /// Its bytes.
    pub bytes: &'static [u8],
}

macro_rules! asset {
    ($path:literal, $type:expr) => {
        Asset {
            path: $path,
            content_type: $type,
            bytes: include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/web/", $path)),
        }
    };
}

const JS: &str = "text/javascript; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// Every file of the page but `index.html` (a test checks that each file of
/// `web/` is listed here or deliberately left out).
pub const ASSETS: &[Asset] = &[
    asset!("app.css", "text/css; charset=utf-8"),
    asset!("icon.svg", "image/svg+xml"),
    asset!("js/main.js", JS),
    asset!("js/api.js", JS),
    asset!("js/dom.js", JS),
    asset!("js/format.js", JS),
    asset!("js/markdown.js", JS),
    asset!("js/chat.js", JS),
    asset!("js/dialogs.js", JS),
    asset!("js/runs.js", JS),
    asset!("js/timeline.js", JS),
    asset!("js/approvals.js", JS),
    asset!("js/trace.js", JS),
    asset!("vendor/marked.esm.js", JS),
    asset!("vendor/purify.min.js", JS),
    asset!("vendor/LICENSE-marked.txt", TEXT),
    asset!("vendor/LICENSE-dompurify.txt", TEXT),
];

/// The page's HTML; `{{ASSETS}}` stands for the assets' URL prefix.
const INDEX: &str = include_str!("../../web/index.html");

/// The Content-Security-Policy of the page and its files. `connect-src
/// 'self'` covers the WebSocket of the same origin; `img-src` keeps images
/// a model writes into Markdown from reaching other hosts.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'; require-trusted-types-for 'script'; \
    trusted-types dompurify";

/// The build: the first 16 hex digits of a SHA-256 over every file.
pub fn build_id() -> &'static str {
    static BUILD: LazyLock<String> = LazyLock::new(|| {
        let mut hash = Sha256::new();
        hash.update(INDEX.as_bytes());
        for a in ASSETS {
            hash.update(a.path.as_bytes());
            hash.update((a.bytes.len() as u64).to_le_bytes());
            hash.update(a.bytes);
        }
        hash.finalize()
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect()
    });
    &BUILD
}

/// The page with its asset URLs filled in.
fn index_html() -> &'static str {
    static PAGE: LazyLock<String> =
        LazyLock::new(|| INDEX.replace("{{ASSETS}}", &format!("assets/{}", build_id())));
    &PAGE
}

/// Headers every page answer carries.
fn security_headers(headers: &mut HeaderMap) {
    let set = |h: &mut HeaderMap, name: HeaderName, value: &'static str| {
        h.insert(name, HeaderValue::from_static(value));
    };
    set(
        headers,
        header::CONTENT_SECURITY_POLICY,
        CONTENT_SECURITY_POLICY,
    );
    set(headers, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(headers, header::REFERRER_POLICY, "no-referrer");
    set(headers, header::X_FRAME_OPTIONS, "DENY");
    set(
        headers,
        HeaderName::from_static("cross-origin-opener-policy"),
        "same-origin",
    );
    set(
        headers,
        HeaderName::from_static("cross-origin-resource-policy"),
        "same-origin",
    );
}

/// Whether `If-None-Match` names `etag`.
fn not_modified(request: &HeaderMap, etag: &str) -> bool {
    request
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            let t = t.trim();
            t == "*" || t.trim_start_matches("W/") == etag
        })
}

/// A page answer: `body` with its type, caching and security headers, or
/// 304 when the client has it.
fn page_response(
    request: &HeaderMap,
    content_type: &'static str,
    cache: &'static str,
    body: &'static [u8],
) -> Response {
    let etag = format!("\"{}\"", build_id());
    let mut response = if not_modified(request, &etag) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, content_type)], body).into_response()
    };
    let headers = response.headers_mut();
    security_headers(headers);
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    if let Ok(v) = HeaderValue::from_str(&etag) {
        headers.insert(header::ETAG, v);
    }
    response
}

/// `GET /`: the page; revalidated on every load.
pub(crate) async fn index(request: HeaderMap) -> Response {
    page_response(
        &request,
        "text/html; charset=utf-8",
        "no-cache",
        index_html().as_bytes(),
    )
}

/// `GET /assets/{build}/{*path}`: an embedded file of the current build,
/// cached for a year; another build's URL is not found.
pub(crate) async fn asset(
    Path((build, path)): Path<(String, String)>,
    request: HeaderMap,
) -> Response {
    let found = (build == build_id())
        .then(|| ASSETS.iter().find(|a| a.path == path))
        .flatten();
    match found {
        Some(a) => page_response(
            &request,
            a.content_type,
            "public, max-age=31536000, immutable",
            a.bytes,
        ),
        None => {
            let mut response =
                ApiError::NotFound(format!("no asset {path} in build {build}")).into_response();
            security_headers(response.headers_mut());
            response
        }
    }
}
