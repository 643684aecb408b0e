//! `keel serve` in-process: a real server on an ephemeral loopback port,
//! driven by real clients (reqwest, tokio-tungstenite).

mod approvals;
mod busy;
mod doc;
mod hostile;
mod images;
mod mcp;
mod origin;
mod relay;
mod rest;
mod resume;
mod shutdown;
mod stop;
mod web;
mod webhooks;
mod ws;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::{SinkExt, StreamExt};
use keel_core::provider::{ChatRequest, FinishReason, ProviderError, ProviderStream, StreamEvent};
use keel_core::{CancellationToken, Provider, ScriptedProvider, ScriptedResponse};
use keel_gateway::app::App;
use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use keel_gateway::serve::{Limits, ServeOptions, Server};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::Message as WsMessage;

/// How a test server is set up.
pub struct Setup {
    pub token: Option<&'static str>,
    pub provider: Arc<dyn Provider>,
    pub limits: Limits,
    pub grace: Duration,
    /// keel.toml text, written to the data directory.
    pub config: String,
    /// Agent definitions copied from the demo.
    pub agents: bool,
    /// The webhook signing secret (`KEEL_WEBHOOK_SECRET`).
    pub webhook_secret: Option<&'static str>,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            token: None,
            provider: Arc::new(ScriptedProvider::offline()),
            limits: Limits::default(),
            grace: Duration::from_secs(30),
            config: String::new(),
            agents: false,
            webhook_secret: None,
        }
    }
}

pub struct TestServer {
    pub server: Option<Server>,
    /// The server's database, readable after it stopped.
    pub store: keel_store::Store,
    pub base: String,
    pub ws_url: String,
    pub dir: tempfile::TempDir,
    pub http: reqwest::Client,
    pub token: Option<&'static str>,
}

pub const DEMO_AGENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/demo/agents");

pub fn copy_agents(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(DEMO_AGENTS).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

impl TestServer {
    pub async fn start(setup: Setup) -> Self {
        Self::start_in(tempfile::tempdir().unwrap(), setup).await
    }

    /// A server on the data directory `dir` (one an earlier server left).
    pub async fn start_in(dir: tempfile::TempDir, setup: Setup) -> Self {
        let mut config = setup.config.clone();
        if setup.agents {
            copy_agents(&dir.path().join("agents"));
            config.push_str("\nroot_delegates = [\"researcher\", \"writer\", \"archivist\"]\n");
        }
        std::fs::write(dir.path().join("keel.toml"), config).unwrap();
        let app =
            App::open_with_provider("keel test", None, Some(dir.path()), Some(setup.provider))
                .await
                .unwrap();
        // `[server]` of the config as `keel serve` reads it, on an ephemeral port.
        let token = setup.token;
        let secret = setup.webhook_secret;
        let env = |name: &str| match name {
            "KEEL_WEBHOOK_SECRET" => secret.map(str::to_owned),
            _ => token.map(str::to_owned),
        };
        let options = ServeOptions {
            shutdown_grace: setup.grace,
            limits: setup.limits,
            ..ServeOptions::from_config(&app.config, Some("127.0.0.1:0".parse().unwrap()), &env)
                .unwrap()
        };
        let store = app.store.clone();
        let server = Server::start(app, options).await.unwrap();
        let addr = server.addr();
        Self {
            server: Some(server),
            store,
            base: format!("http://{addr}"),
            ws_url: format!("ws://{addr}/api/ws"),
            dir,
            http: reqwest::Client::new(),
            token: setup.token,
        }
    }

    pub fn server(&self) -> &Server {
        self.server.as_ref().unwrap()
    }

    fn authed(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.authed(self.http.get(format!("{}{path}", self.base)))
            .send()
            .await
            .unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.authed(self.http.post(format!("{}{path}", self.base)).json(&body))
            .send()
            .await
            .unwrap()
    }

    pub async fn json(&self, path: &str) -> Value {
        let r = self.get(path).await;
        assert_eq!(r.status(), 200, "GET {path}");
        r.json().await.unwrap()
    }

    /// Sends `text` to dialog `id` as a streamed send; returns the SSE
    /// event names, space-separated, once the turn ended.
    pub async fn send_streamed(&self, id: &str, text: &str) -> String {
        let r = self
            .authed(
                self.http
                    .post(format!("{}/api/dialogs/{id}/messages", self.base))
                    .header("accept", "text/event-stream")
                    .json(&serde_json::json!({"text": text})),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let body = r.text().await.unwrap();
        let names: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .collect();
        names.join(" ")
    }

    /// A new dialog's id.
    pub async fn dialog(&self, title: &str) -> String {
        let r = self
            .post("/api/dialogs", serde_json::json!({"title": title}))
            .await;
        assert_eq!(r.status(), 201);
        r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub async fn ws(&self) -> Ws {
        let url = match self.token {
            Some(t) => format!("{}?access_token={t}", self.ws_url),
            None => self.ws_url.clone(),
        };
        let (socket, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        Ws { socket }
    }

    pub async fn shutdown(&mut self) -> keel_gateway::serve::DrainReport {
        self.server.take().unwrap().shutdown().await
    }
}

pub struct Ws {
    pub socket: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
}

impl Ws {
    pub async fn send(&mut self, frame: &ClientFrame) {
        let text = serde_json::to_string(frame).unwrap();
        self.socket.send(WsMessage::text(text)).await.unwrap();
    }

    pub async fn send_raw(&mut self, message: WsMessage) {
        self.socket.send(message).await.unwrap();
    }

    /// The next message, whatever it is (`None` at the end of the stream).
    pub async fn next_message(&mut self) -> Option<WsMessage> {
        tokio::time::timeout(Duration::from_secs(30), self.socket.next())
            .await
            .expect("a frame within 30 s")
            .map(|m| m.unwrap())
    }

    /// The next server frame (pings skipped).
    pub async fn frame(&mut self) -> ServerFrame {
        loop {
            match self.next_message().await {
                Some(WsMessage::Text(t)) => return serde_json::from_str(&t).unwrap(),
                Some(WsMessage::Ping(_) | WsMessage::Pong(_)) => continue,
                other => panic!("expected a text frame, got {other:?}"),
            }
        }
    }

    /// Frames up to and including the first for which `done` holds.
    pub async fn until(&mut self, done: impl Fn(&ServerFrame) -> bool) -> Vec<ServerFrame> {
        let mut out = Vec::new();
        loop {
            let f = self.frame().await;
            let stop = done(&f);
            out.push(f);
            if stop {
                return out;
            }
        }
    }
}

/// A provider whose answer streams "partial " and then waits for a permit
/// of `gate` (or its cancellation) before finishing with "done.".
pub struct GatedProvider {
    pub gate: Arc<Semaphore>,
}

#[async_trait]
impl Provider for GatedProvider {
    fn name(&self) -> &str {
        "gated"
    }

    fn model(&self) -> &str {
        "gated"
    }

    async fn stream(
        &self,
        _request: &ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ProviderStream, ProviderError> {
        let gate = self.gate.clone();
        let first = futures::stream::iter([Ok(StreamEvent::TextDelta {
            text: "partial ".into(),
        })]);
        let rest = futures::stream::once(async move {
            tokio::select! {
                _ = cancel.cancelled() => vec![Err(ProviderError::Cancelled)],
                permit = gate.acquire_owned() => {
                    permit.unwrap().forget();
                    vec![
                        Ok(StreamEvent::TextDelta { text: "done.".into() }),
                        Ok(StreamEvent::Finish { reason: FinishReason::Stop }),
                    ]
                }
            }
        })
        .flat_map(futures::stream::iter);
        Ok(first.chain(rest).boxed())
    }
}

/// A scripted provider answering `responses` in order, then echoing.
pub fn scripted(responses: Vec<ScriptedResponse>) -> Arc<dyn Provider> {
    let p = ScriptedProvider::offline();
    p.push(responses);
    Arc::new(p)
}

/// A root turn that delegates "file it" to the archivist in the background
/// and answers "filed", then the continuation turn that answers the
/// archivist's result with `continuation`.
pub fn background_filing(continuation: &str) -> Vec<ScriptedResponse> {
    vec![
        ScriptedResponse {
            tool_calls: vec![keel_core::ScriptedToolCall {
                id: None,
                name: "delegate".into(),
                arguments: serde_json::json!({"mode": "background",
                    "tasks": [{"agent": "archivist", "task": "file it"}]}),
            }],
            ..ScriptedResponse::default()
        },
        // The root's answer and the archivist's result, in either order.
        ScriptedResponse::text("filed"),
        ScriptedResponse::text("filed"),
        ScriptedResponse::text(continuation),
    ]
}
