//! Webhooks against a real loopback receiver: the signature verifies with
//! Python's own `hmac` (not keel's code), a receiver down for the first 3
//! attempts still gets each delivery once it is up (same `webhook-id` every
//! attempt), a delivery is dead after `webhook_max_attempts`, the
//! server-wide URLs get every turn, a background run of a hooked turn
//! notifies the same URL, and refused URLs are 400.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{Setup, TestServer};

const SECRET: &str = "whsec_c2VjcmV0LW9mLXRoZS10ZXN0";
const WAIT: Duration = Duration::from_secs(20);

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    id: String,
    timestamp: String,
    signature: String,
    body: String,
    /// What the receiver answered.
    status: u16,
}

struct Receiver {
    /// Answers 503 to this many requests first.
    fail_first: usize,
    seen: AtomicUsize,
    tx: mpsc::UnboundedSender<Received>,
}

async fn hook(State(r): State<Arc<Receiver>>, headers: HeaderMap, body: String) -> StatusCode {
    let n = r.seen.fetch_add(1, Ordering::SeqCst);
    let status = if n < r.fail_first {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::NO_CONTENT
    };
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let _ = r.tx.send(Received {
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body,
        status: status.as_u16(),
    });
    status
}

/// A receiver on loopback answering 503 to its first `fail_first` requests.
async fn receiver(fail_first: usize) -> (String, mpsc::UnboundedReceiver<Received>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let state = Arc::new(Receiver {
        fail_first,
        seen: AtomicUsize::new(0),
        tx,
    });
    let app = axum::Router::new()
        .route("/hook", post(hook))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/hook"), rx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Received>) -> Received {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("a webhook request within the wait")
        .unwrap()
}

fn setup(config: &str) -> Setup {
    Setup {
        webhook_secret: Some(SECRET),
        // Inline, so that keys the harness appends stay top-level.
        config: format!(
            "server = {{ webhook_retry_base_ms = 1{} }}\n",
            if config.is_empty() {
                String::new()
            } else {
                format!(", {config}")
            }
        ),
        ..Setup::default()
    }
}

/// Verifies a Standard Webhooks signature with Python's `hmac` and `base64`.
fn python_verifies(r: &Received) -> bool {
    let script = r#"
import base64, hashlib, hmac, sys
secret, msg_id, ts, sig = sys.argv[1:5]
body = sys.stdin.read()
key = base64.b64decode(secret.removeprefix("whsec_"))
mac = hmac.new(key, f"{msg_id}.{ts}.{body}".encode(), hashlib.sha256).digest()
expected = "v1," + base64.b64encode(mac).decode()
sys.exit(0 if any(hmac.compare_digest(expected, s) for s in sig.split(" ")) else 1)
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script, SECRET, &r.id, &r.timestamp, &r.signature])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(r.body.as_bytes())
        .unwrap();
    child.wait().unwrap().success()
}

/// Sends `text` to dialog `id` naming `webhook`; returns the turn id.
async fn send(t: &TestServer, id: &str, text: &str, webhook: &str) -> String {
    let r = t
        .post(
            &format!("/api/dialogs/{id}/messages"),
            json!({"text": text, "webhook": webhook}),
        )
        .await;
    assert_eq!(r.status(), 202);
    r.json::<Value>().await.unwrap()["turn_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Polls the listing (each poll a request; no sleep) until `done` holds.
async fn deliveries_until(t: &TestServer, query: &str, done: impl Fn(&Value) -> bool) -> Value {
    tokio::time::timeout(WAIT, async {
        loop {
            let page = t.json(&format!("/api/webhooks/deliveries{query}")).await;
            if done(&page) {
                return page;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the deliveries within the wait")
}

#[tokio::test]
async fn a_turn_s_webhook_is_signed_and_its_payload_names_the_turn() {
    let (url, mut rx) = receiver(0).await;
    let t = TestServer::start(setup("")).await;
    let id = t.dialog("Hooked").await;
    let turn = send(&t, &id, "hello", &url).await;
    let got = next(&mut rx).await;
    assert!(python_verifies(&got), "{got:?}");
    // A changed body does not verify.
    let forged = Received {
        body: got.body.replace("committed", "forged"),
        ..got.clone()
    };
    assert!(!python_verifies(&forged));
    let body: Value = serde_json::from_str(&got.body).unwrap();
    assert_eq!(body["data"]["turn_id"], turn.as_str());
    assert_eq!(body["data"]["dialog_id"], id.as_str());
    assert!(got.id.starts_with("msg_"), "{}", got.id);
    let ts: i64 = got.timestamp.parse().unwrap();
    assert!((ts - keel_core::time::now_ms() / 1000).abs() < 300);
    insta::assert_json_snapshot!("webhook_turn_completed", body, {
        ".timestamp_ms" => "[ms]",
        ".data.dialog_id" => "[dialog]",
        ".data.turn_id" => "[turn]",
    });
    let page = deliveries_until(&t, "?status=delivered", |p| {
        p["items"].as_array().is_some_and(|i| i.len() == 1)
    })
    .await;
    let item = &page["items"][0];
    assert_eq!(item["id"], got.id.as_str());
    assert_eq!(item["attempts"], 1);
    assert_eq!(item["url"], url.as_str());
    assert_eq!(item["body"], body);
    assert!(page["next_cursor"].is_null());
}

#[tokio::test]
async fn a_receiver_down_for_three_attempts_gets_each_delivery_once_it_is_up() {
    let (url, mut rx) = receiver(3).await;
    let t = TestServer::start(setup("webhook_max_attempts = 8")).await;
    let id = t.dialog("Flaky").await;
    send(&t, &id, "one", &url).await;
    let mut attempts = Vec::new();
    loop {
        let r = next(&mut rx).await;
        let ok = r.status == 204;
        attempts.push(r);
        if ok {
            break;
        }
    }
    assert_eq!(
        attempts.iter().map(|r| r.status).collect::<Vec<_>>(),
        [503, 503, 503, 204]
    );
    // The same delivery every time: one id, one body, each signed.
    assert!(attempts
        .iter()
        .all(|r| r.id == attempts[0].id && r.body == attempts[0].body));
    assert!(attempts.iter().all(python_verifies));
    // Up now: a second turn's delivery arrives at the first attempt, with its own id.
    send(&t, &id, "two", &url).await;
    let second = next(&mut rx).await;
    assert_eq!(second.status, 204);
    assert_ne!(second.id, attempts[0].id);
    let page = deliveries_until(&t, "?status=delivered", |p| {
        p["items"].as_array().is_some_and(|i| i.len() == 2)
    })
    .await;
    let counts: Vec<_> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["attempts"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, [4, 1]);
    // Nothing more is sent: every delivery is delivered, none pending.
    let pending = t.json("/api/webhooks/deliveries?status=pending").await;
    assert_eq!(pending["items"], json!([]));
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn a_delivery_is_dead_after_the_last_attempt() {
    let (url, mut rx) = receiver(usize::MAX).await;
    let t = TestServer::start(setup("webhook_max_attempts = 2")).await;
    let id = t.dialog("Down").await;
    send(&t, &id, "one", &url).await;
    for _ in 0..2 {
        assert_eq!(next(&mut rx).await.status, 503);
    }
    let page = deliveries_until(&t, "?status=dead", |p| {
        p["items"].as_array().is_some_and(|i| i.len() == 1)
    })
    .await;
    let dead = &page["items"][0];
    assert_eq!(dead["attempts"], 2);
    assert_eq!(
        dead["last_error"],
        "the receiver answered 503 Service Unavailable"
    );
    assert!(dead["next_attempt_at_ms"].is_null());
    assert!(rx.try_recv().is_err(), "no third attempt");
}

#[tokio::test]
async fn server_wide_urls_get_every_turn_and_a_page_continues_by_cursor() {
    let (url, mut rx) = receiver(0).await;
    let t = TestServer::start(setup(&format!("webhook_urls = [\"{url}\"]"))).await;
    let id = t.dialog("Everything").await;
    // No per-send webhook: the server-wide URL still gets both turns.
    for text in ["one", "two"] {
        t.send_streamed(&id, text).await;
    }
    let (a, b) = (next(&mut rx).await, next(&mut rx).await);
    assert_ne!(a.id, b.id);
    let first = deliveries_until(&t, "?status=delivered&limit=1", |p| {
        !p["next_cursor"].is_null()
    })
    .await;
    let cursor = first["next_cursor"].as_str().unwrap();
    let rest = t
        .json(&format!("/api/webhooks/deliveries?limit=1&cursor={cursor}"))
        .await;
    assert_eq!(rest["items"].as_array().unwrap().len(), 1);
    assert_ne!(rest["items"][0]["id"], first["items"][0]["id"]);
}

#[tokio::test]
async fn refused_webhooks_are_400_and_start_no_turn() {
    let t = TestServer::start(setup("")).await;
    let id = t.dialog("Refused").await;
    let own = format!("{}/api/health", t.base);
    let mut out = Vec::new();
    for (webhook, if_busy) in [
        ("ftp://example.com/hook", "enqueue"),
        ("not a url", "enqueue"),
        (own.as_str(), "enqueue"),
        ("http://user:pw@example.com/hook", "enqueue"),
        ("http://example.com/hook", "steer"),
    ] {
        let r = t
            .post(
                &format!("/api/dialogs/{id}/messages"),
                json!({"text": "x", "webhook": webhook, "if_busy": if_busy}),
            )
            .await;
        assert_eq!(r.status(), 400, "{webhook}");
        let p: Value = r.json().await.unwrap();
        out.push(
            p["detail"]
                .as_str()
                .unwrap()
                .replace(&t.base, "http://[own]"),
        );
    }
    insta::assert_snapshot!("webhook_refused", out.join("\n"));
    let messages = t.json(&format!("/api/dialogs/{id}/messages")).await;
    assert_eq!(messages["items"], json!([]), "nothing was stored");

    // Without a secret a webhook cannot be signed.
    let plain = TestServer::start(Setup::default()).await;
    let id = plain.dialog("Unsigned").await;
    let r = plain
        .post(
            &format!("/api/dialogs/{id}/messages"),
            json!({"text": "x", "webhook": "http://example.com/hook"}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let p: Value = r.json().await.unwrap();
    insta::assert_snapshot!("webhook_without_secret", p["detail"].as_str().unwrap());
}

#[tokio::test]
async fn a_background_run_started_by_a_hooked_turn_notifies_the_same_url() {
    let (url, mut rx) = receiver(0).await;
    let t = TestServer::start(Setup {
        provider: super::scripted(super::background_filing("the archivist filed it")),
        agents: true,
        ..setup("")
    })
    .await;
    let id = t.dialog("Delegating").await;
    let turn = send(&t, &id, "file today's decisions", &url).await;
    let mut events = Vec::new();
    for _ in 0..2 {
        let got = next(&mut rx).await;
        assert!(python_verifies(&got));
        events.push(serde_json::from_str::<Value>(&got.body).unwrap());
    }
    events.sort_by_key(|e| e["type"].as_str().unwrap().to_owned());
    let (run, turn_done) = (&events[0], &events[1]);
    assert_eq!(turn_done["type"], "turn.completed");
    assert_eq!(turn_done["data"]["turn_id"], turn.as_str());
    assert_eq!(run["type"], "run.completed");
    assert_eq!(run["data"]["turn_id"], turn.as_str());
    assert_eq!(run["data"]["agent"], "archivist");
    assert_eq!(run["data"]["status"], "completed");
    assert_eq!(run["data"]["result"], "filed");
    insta::assert_json_snapshot!("webhook_run_completed", run, {
        ".timestamp_ms" => "[ms]",
        ".data.dialog_id" => "[dialog]",
        ".data.turn_id" => "[turn]",
        ".data.run_id" => "[run]",
    });
}
