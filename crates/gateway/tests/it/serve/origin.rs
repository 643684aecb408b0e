//! Requests not meant for this server — another site's `Origin`, or a
//! `Host` naming another site (DNS rebinding) — are refused, token or not;
//! the server's own pages, clients without `Origin` and
//! `server.allowed_origins` pass.

use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

use super::{Setup, TestServer};

const ATTACKER: &str = "https://attacker.example";

impl TestServer {
    /// The port the server listens on.
    fn port(&self) -> u16 {
        self.server().addr().port()
    }

    /// `method path` with `headers` (and the token, if any); the status and problem code.
    async fn send_with(
        &self,
        method: reqwest::Method,
        path: &str,
        headers: &[(&str, String)],
    ) -> (StatusCode, String) {
        let mut rb = self
            .http
            .request(method.clone(), format!("{}{path}", self.base));
        if let Some(t) = self.token {
            rb = rb.bearer_auth(t);
        }
        for (name, value) in headers {
            rb = rb.header(*name, value);
        }
        if method == reqwest::Method::POST {
            rb = rb.json(&json!({"title": "from a page"}));
        }
        let r = rb.send().await.unwrap();
        let status = r.status();
        let code = if status.is_success() {
            String::new()
        } else {
            assert_eq!(r.headers()["content-type"], "application/problem+json");
            r.json::<Value>().await.unwrap()["code"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        (status, code)
    }

    /// Opens the WebSocket with `headers`; the HTTP status of a refusal.
    async fn ws_with(&self, headers: &[(&'static str, String)]) -> Result<(), u16> {
        let url = match self.token {
            Some(t) => format!("{}?access_token={t}", self.ws_url),
            None => self.ws_url.clone(),
        };
        let mut request = url.into_client_request().unwrap();
        for (name, value) in headers {
            request
                .headers_mut()
                .insert(*name, HeaderValue::from_str(value).unwrap());
        }
        match tokio_tungstenite::connect_async(request).await {
            Ok(_) => Ok(()),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                Err(response.status().as_u16())
            }
            Err(e) => panic!("unexpected WebSocket failure: {e}"),
        }
    }

    async fn dialog_count(&self) -> usize {
        self.json("/api/dialogs").await["items"]
            .as_array()
            .unwrap()
            .len()
    }
}

/// A header, as the helpers above take them.
type Header = (&'static str, String);

fn h(name: &'static str, value: impl Into<String>) -> Header {
    (name, value.into())
}

#[tokio::test]
async fn another_sites_pages_and_rebound_names_are_refused_and_change_nothing() {
    for token in [None, Some("s3cret")] {
        let t = TestServer::start(Setup {
            token,
            ..Setup::default()
        })
        .await;
        let rebound = h("host", format!("attacker.example:{}", t.port()));
        let refused: Vec<(reqwest::Method, &str, Vec<Header>)> = vec![
            // DNS rebinding: the attacker's name, pointed at 127.0.0.1.
            (reqwest::Method::GET, "/", vec![rebound.clone()]),
            (reqwest::Method::GET, "/api/dialogs", vec![rebound.clone()]),
            (reqwest::Method::POST, "/api/dialogs", vec![rebound.clone()]),
            // A cross-site form or fetch.
            (
                reqwest::Method::POST,
                "/api/dialogs",
                vec![h("origin", ATTACKER)],
            ),
            (
                reqwest::Method::POST,
                "/api/dialogs",
                vec![h("origin", "null")],
            ),
            (
                reqwest::Method::POST,
                "/api/dialogs",
                vec![h("origin", format!("http://localhost:{}", t.port()))],
            ),
        ];
        for (method, path, headers) in refused {
            let what = format!("{method} {path} {headers:?} (token {token:?})");
            assert_eq!(
                t.send_with(method, path, &headers).await,
                (StatusCode::FORBIDDEN, "forbidden".to_owned()),
                "{what}"
            );
        }
        // A cross-site WebSocket, and one through a rebound name.
        assert_eq!(t.ws_with(&[h("origin", ATTACKER)]).await, Err(403));
        assert_eq!(t.ws_with(&[rebound]).await, Err(403));
        assert_eq!(t.dialog_count().await, 0, "nothing was created");
    }
}

#[tokio::test]
async fn the_servers_own_pages_and_clients_without_an_origin_are_served() {
    let t = TestServer::start(Setup::default()).await;
    let port = t.port();
    let own = h("origin", format!("http://127.0.0.1:{port}"));
    let by_name = [
        h("host", format!("localhost:{port}")),
        h("origin", format!("http://localhost:{port}")),
    ];
    let ipv6_host = h("host", format!("[::1]:{port}"));
    for (method, path, headers) in [
        (reqwest::Method::GET, "/", vec![ipv6_host.clone()]),
        (reqwest::Method::GET, "/", by_name.to_vec()),
        (reqwest::Method::POST, "/api/dialogs", vec![]),
        (reqwest::Method::POST, "/api/dialogs", vec![own.clone()]),
        (reqwest::Method::POST, "/api/dialogs", by_name.to_vec()),
        // A cross-site GET is answered (the browser keeps it from the page: no CORS).
        (reqwest::Method::GET, "/api/health", vec![]),
    ] {
        let (status, code) = t.send_with(method.clone(), path, &headers).await;
        assert!(
            status.is_success(),
            "{method} {path} {headers:?}: {status} {code}"
        );
    }
    assert_eq!(t.dialog_count().await, 3);
    assert_eq!(t.ws_with(&[own]).await, Ok(()));
    assert_eq!(t.ws_with(&by_name).await, Ok(()));
    assert_eq!(t.ws_with(&[]).await, Ok(()));
}

#[tokio::test]
async fn allowed_origins_admit_a_proxys_name_and_its_pages_only() {
    let t = TestServer::start(Setup {
        token: Some("s3cret"),
        config: "[server]\nallowed_origins = [\"https://keel.example.com\"]\n".to_owned(),
        ..Setup::default()
    })
    .await;
    let proxied = [
        h("host", "keel.example.com"),
        h("origin", "https://keel.example.com"),
    ];
    // A proxy that keeps the Host, and one that rewrites it to the bound address.
    let rewritten = [h("origin", "https://keel.example.com")];
    for headers in [&proxied[..], &rewritten[..]] {
        let (status, code) = t
            .send_with(reqwest::Method::POST, "/api/dialogs", headers)
            .await;
        assert_eq!(status, StatusCode::CREATED, "{headers:?}: {code}");
        assert_eq!(t.ws_with(headers).await, Ok(()), "{headers:?}");
    }
    let elsewhere = [h("host", "keel.example.com"), h("origin", ATTACKER)];
    assert_eq!(
        t.send_with(reqwest::Method::POST, "/api/dialogs", &elsewhere)
            .await,
        (StatusCode::FORBIDDEN, "forbidden".to_owned())
    );
    assert_eq!(t.ws_with(&elsewhere).await, Err(403));
    assert_eq!(t.dialog_count().await, 2);
}
