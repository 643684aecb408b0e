//! Bearer-token authentication of `/api`, `/mcp` and `/metrics`: when a token is configured,
//! every request must present it (`Authorization: Bearer <token>`; a
//! browser's WebSocket, which cannot set headers, may pass
//! `?access_token=<token>` to `/api/ws`, form-urlencoded as the web page's
//! `URLSearchParams` writes it). The probes `/api/health` and `/api/ready`
//! are outside this layer. Tokens are compared in constant time through
//! their SHA-256 digests, and never logged.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::problem::ApiError;
use super::Shared;

/// The bearer token clients must present.
#[derive(Clone)]
pub struct Token {
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

impl Token {
    /// The token `text` (surrounding whitespace is not part of it); `None` when empty.
    pub fn new(text: &str) -> Option<Self> {
        let text = text.trim();
        (!text.is_empty()).then(|| Self {
            digest: digest(text),
        })
    }

    /// Whether `presented` is this token, in time independent of where they differ.
    pub fn matches(&self, presented: &str) -> bool {
        bool::from(self.digest.ct_eq(&digest(presented)))
    }
}

/// The token a request presents: the `Authorization: Bearer` header, or
/// for the WebSocket route the `access_token` query parameter, decoded
/// (`%2B` is `+`, `+` a space): tokens of `openssl rand -base64` hold `+/=`.
fn presented(request: &Request) -> Option<String> {
    if let Some(value) = request.headers().get(header::AUTHORIZATION) {
        let value = value.to_str().ok()?;
        let (scheme, token) = value.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| token.trim().to_owned());
    }
    // Inside the nested `/api` router the path has lost its prefix.
    let uri = request
        .extensions()
        .get::<axum::extract::OriginalUri>()
        .map_or(request.uri(), |o| &o.0);
    if uri.path() != "/api/ws" {
        return None;
    }
    uri.query().and_then(|q| {
        form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == "access_token")
            .map(|(_, v)| v.into_owned())
    })
}

/// Whether `request` may pass: no token is configured, or it presents it.
pub(crate) fn authorized(shared: &Shared, request: &Request) -> bool {
    match &shared.token {
        None => true,
        Some(token) => presented(request).is_some_and(|p| token.matches(&p)),
    }
}

/// Middleware: lets a request through when no token is configured or it
/// presents the token; otherwise answers 401.
pub async fn require_token(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    if authorized(&shared, &request) {
        next.run(request).await
    } else {
        ApiError::Unauthorized.into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_exactly_and_never_show() {
        let token = Token::new("  s3cret \n").expect("a token");
        assert!(token.matches("s3cret"));
        assert!(!token.matches("s3cre"));
        assert!(!token.matches("s3cret "));
        assert!(!token.matches(""));
        assert!(Token::new(" \t").is_none());
        assert_eq!(format!("{token:?}"), "Token(<redacted>)");
    }
}
