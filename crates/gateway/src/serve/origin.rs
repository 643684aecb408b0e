//! Which requests are meant for this server, token or not. A web page on
//! another site can make the user's browser send requests here: a
//! cross-site WebSocket or form post carries that site's `Origin`, and DNS
//! rebinding (the site's name re-pointed at 127.0.0.1) carries its name in
//! `Host`. So:
//!
//! - `Host` (or HTTP/2's `:authority`) must be an IP address, `localhost`,
//!   or the host of a `server.allowed_origins` entry. An IP address cannot
//!   be rebound: the browser reached it directly, so the page's origin is
//!   this server's. Two `Host` headers, or one that disagrees with an
//!   absolute-form target, are a bad request: a proxy and this server must
//!   not disagree about which site a request is for.
//! - A request that carries `Origin` must come from the server's own
//!   origin (the scheme and the `Host` it was sent to) or an allowed one;
//!   `Origin: null` (sandboxed frames, `file:` pages) is refused. Clients
//!   other than browsers send no `Origin` and pass.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::uri::Authority;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::problem::ApiError;
use super::Shared;
use crate::config::{host_of, AllowedOrigin};

/// Whether `host` (from [`host_of`]) names this server.
fn host_allowed(host: &str, allowed: &[AllowedOrigin]) -> bool {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse::<IpAddr>().is_ok()
        || host == "localhost"
        || allowed.iter().any(|o| o.host() == host)
}

/// Why `request` is not meant for this server, if it is not.
pub(crate) fn refusal(request: &Request, allowed: &[AllowedOrigin]) -> Option<ApiError> {
    // Inside a nested router the URI has lost its prefix, not its authority;
    // the original is read all the same, as the client sent it.
    let uri = request
        .extensions()
        .get::<axum::extract::OriginalUri>()
        .map_or(request.uri(), |o| &o.0);
    check(uri.authority(), request.headers(), allowed)
}

/// [`refusal`] of a request whose target names `target` (HTTP/2's
/// `:authority`, or an absolute-form target) and carries `headers`.
fn check(
    target: Option<&Authority>,
    headers: &HeaderMap,
    allowed: &[AllowedOrigin],
) -> Option<ApiError> {
    let mut hosts = headers.get_all(header::HOST).iter().map(|v| v.to_str());
    let (first, second) = (hosts.next(), hosts.next());
    // More than one Host, or a Host that disagrees with the target, is a
    // bad request: serving either would let a proxy and this server
    // disagree about which site a request is for.
    if second.is_some() {
        return Some(ApiError::BadRequest(
            "the request has more than one Host header".to_owned(),
        ));
    }
    let host = match (first, target) {
        (Some(Ok(value)), Some(target)) if !value.trim().eq_ignore_ascii_case(target.as_str()) => {
            return Some(ApiError::BadRequest(format!(
                "the request target names {:?} but its Host header {value:?}",
                target.as_str()
            )))
        }
        (Some(Ok(value)), _) => value.trim().to_ascii_lowercase(),
        (None, Some(target)) => target.as_str().to_ascii_lowercase(),
        (Some(Err(_)), _) | (None, None) => {
            return Some(ApiError::Forbidden(
                "the request has no readable Host header (nor an authority in its target)"
                    .to_owned(),
            ))
        }
    };
    match host_of(&host) {
        Some(name) if host_allowed(&name, allowed) => {}
        _ => {
            return Some(ApiError::Forbidden(format!(
                "Host {host:?} does not name this server: it answers to IP addresses, localhost \
                 and the hosts of server.allowed_origins"
            )))
        }
    }
    let origin = headers.get(header::ORIGIN)?;
    let text = origin.to_str().unwrap_or("").trim().to_ascii_lowercase();
    let own = text
        .strip_prefix("http://")
        .or_else(|| text.strip_prefix("https://"))
        .is_some_and(|authority| authority == host);
    if own || allowed.iter().any(|o| o.as_str() == text) {
        return None;
    }
    Some(ApiError::Forbidden(format!(
        "requests from origin {text:?} are refused: only pages of this server (http://{host}) \
         and of server.allowed_origins may use it"
    )))
}

/// Middleware: answers 403 to a request whose `Host` or `Origin` shows it
/// was not meant for this server (see the module docs).
pub async fn require_own_origin(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    match refusal(&request, &shared.allowed_origins) {
        None => next.run(request).await,
        Some(refused) => {
            tracing::info!(reason = %refused, "request refused");
            refused.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(host: Option<&str>, origin: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = host {
            h.insert(header::HOST, HeaderValue::from_str(v).unwrap());
        }
        if let Some(v) = origin {
            h.insert(header::ORIGIN, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn verdict(host: Option<&str>, origin: Option<&str>, allowed: &[&str]) -> String {
        let allowed: Vec<AllowedOrigin> = allowed
            .iter()
            .map(|a| AllowedOrigin::parse(a).unwrap())
            .collect();
        match check(None, &headers(host, origin), &allowed) {
            None => "accepted".to_owned(),
            Some(e) => e.to_string(),
        }
    }

    #[test]
    fn hosts_that_name_this_server_are_accepted_and_other_names_refused() {
        let proxy = ["https://keel.example.com"];
        let cases: &[(&str, &[&str])] = &[
            ("127.0.0.1:7420", &[]),
            ("127.0.0.2", &[]),
            ("[::1]:7420", &[]),
            ("192.168.1.5:7420", &[]),
            ("LOCALHOST:7420", &[]),
            ("keel.example.com", &proxy),
            ("keel.example.com:8443", &proxy),
            ("attacker.example:7420", &[]),
            ("attacker.example:7420", &proxy),
            ("localhost.attacker.example", &[]),
            ("sub.localhost:7420", &[]),
            ("user@127.0.0.1", &[]),
            ("", &[]),
        ];
        let out: Vec<String> = cases
            .iter()
            .map(|(host, allowed)| {
                format!("{host} {allowed:?}: {}", verdict(Some(host), None, allowed))
            })
            .chain([format!("no Host: {}", verdict(None, None, &[]))])
            .collect();
        insta::assert_snapshot!(out.join("\n"));
    }

    #[test]
    fn two_hosts_or_a_target_that_disagrees_with_host_are_bad_requests() {
        let verdict = |target: Option<&str>, hosts: &[&str]| {
            let mut h = HeaderMap::new();
            for host in hosts {
                h.append(header::HOST, HeaderValue::from_str(host).unwrap());
            }
            let target: Option<Authority> = target.map(|t| t.parse().unwrap());
            let out = match check(target.as_ref(), &h, &[]) {
                None => "accepted".to_owned(),
                Some(e) => format!("{} {e}", e.status().as_u16()),
            };
            format!("{target:?} {hosts:?}: {out}")
        };
        let out = [
            verdict(None, &["127.0.0.1:7420", "attacker.example"]),
            verdict(None, &["127.0.0.1:7420", "127.0.0.1:7420"]),
            verdict(Some("attacker.example"), &["127.0.0.1:7420"]),
            verdict(Some("127.0.0.1:7421"), &["127.0.0.1:7420"]),
            verdict(Some("127.0.0.1:7420"), &["127.0.0.1:7420"]),
            verdict(Some("LOCALHOST:7420"), &["localhost:7420"]),
            // HTTP/2: `:authority` and no Host.
            verdict(Some("127.0.0.1:7420"), &[]),
            verdict(Some("attacker.example:7420"), &[]),
        ];
        insta::assert_snapshot!(out.join("\n"));
    }

    #[test]
    fn only_the_servers_own_origin_and_allowed_ones_pass() {
        let host = Some("127.0.0.1:7420");
        let cases: &[(Option<&str>, &[&str])] = &[
            (None, &[]),
            (Some("http://127.0.0.1:7420"), &[]),
            (Some("HTTP://127.0.0.1:7420"), &[]),
            (
                Some("https://keel.example.com"),
                &["https://keel.example.com"],
            ),
            (Some("http://localhost:7420"), &[]),
            (Some("http://127.0.0.1:7421"), &[]),
            (Some("https://attacker.example"), &[]),
            (
                Some("http://keel.example.com"),
                &["https://keel.example.com"],
            ),
            (Some("null"), &[]),
        ];
        let out: Vec<String> = cases
            .iter()
            .map(|(origin, allowed)| {
                format!(
                    "{origin:?} {allowed:?}: {}",
                    verdict(host, *origin, allowed)
                )
            })
            .collect();
        insta::assert_snapshot!(out.join("\n"));
    }
}
