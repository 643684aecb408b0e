//! Webhooks of the real `keel serve`: a delivery whose attempt was in
//! flight when the process was killed (`kill -9`) is delivered by the next
//! start, with the same `webhook-id` (at least once, deduplicable); and a
//! server with `webhook_urls` but no secret to sign them refuses to start.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tokio::sync::mpsc;

use crate::keel;
use crate::serve::Served;

const SECRET: &str = "whsec_c2VjcmV0LW9mLXRoZS10ZXN0";

struct Receiver {
    /// While set, a request is held unanswered (the attempt stays in flight).
    hang: std::sync::atomic::AtomicBool,
    tx: mpsc::UnboundedSender<(String, String)>,
}

async fn hook(State(r): State<Arc<Receiver>>, headers: HeaderMap, body: String) -> StatusCode {
    let id = headers
        .get("webhook-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let _ = r.tx.send((id, body));
    if r.hang.load(std::sync::atomic::Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    StatusCode::OK
}

fn write_config(data: &std::path::Path, url: &str) {
    std::fs::write(data.join("script.yaml"), "- text: \"done\"\n").unwrap();
    std::fs::write(
        data.join("keel.toml"),
        format!(
            "[providers.default]\nkind = \"scripted\"\nscript = \"script.yaml\"\n\n\
             [server]\nwebhook_urls = [\"{url}\"]\n"
        ),
    )
    .unwrap();
}

#[test]
fn kill_9_with_a_delivery_in_flight_delivers_it_after_restart() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let receiver = Arc::new(Receiver {
        hang: true.into(),
        tx,
    });
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/hook", post(hook))
        .with_state(receiver.clone());
    rt.spawn(async move { axum::serve(listener, app).await.unwrap() });
    let data = tempfile::tempdir().unwrap();
    write_config(data.path(), &url);
    let secret = [("KEEL_WEBHOOK_SECRET", SECRET)];
    let mut served = Served::start_with(data.path(), &secret);
    let http = reqwest::Client::new();
    let wait = Duration::from_secs(60);
    let (first_id, first_body) = rt.block_on(async {
        let dialog: serde_json::Value = http
            .post(served.url("/api/dialogs"))
            .json(&serde_json::json!({"title": "Hooked"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = dialog["id"].as_str().unwrap();
        let r = http
            .post(served.url(&format!("/api/dialogs/{id}/messages")))
            .json(&serde_json::json!({"text": "hello"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        // The attempt reached the receiver, which holds it unanswered.
        tokio::time::timeout(wait, rx.recv())
            .await
            .unwrap()
            .unwrap()
    });
    served.signal("KILL");
    served.child.wait().unwrap();
    receiver
        .hang
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let served = Served::start_with(data.path(), &secret);
    let (again_id, again_body) = rt
        .block_on(async { tokio::time::timeout(wait, rx.recv()).await })
        .expect("the pending delivery after the restart")
        .unwrap();
    assert_eq!(
        again_id, first_id,
        "the same delivery, deduplicable by its id"
    );
    assert_eq!(again_body, first_body);
    let body: serde_json::Value = serde_json::from_str(&again_body).unwrap();
    assert_eq!(body["data"]["answer"], "done");
    // Recorded as delivered (the listing is read until the row says so).
    let page = rt.block_on(async {
        tokio::time::timeout(wait, async {
            loop {
                let page: serde_json::Value = http
                    .get(served.url("/api/webhooks/deliveries?status=delivered"))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                if !page["items"].as_array().unwrap().is_empty() {
                    return page;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap()
    });
    assert_eq!(page["items"][0]["id"], first_id.as_str());
    served.signal("TERM");
}

#[test]
fn webhook_urls_without_the_secret_are_refused_at_start() {
    let data = tempfile::tempdir().unwrap();
    write_config(data.path(), "http://127.0.0.1:9/hook");
    let out = keel()
        .args(["serve", "--bind", "127.0.0.1:0", "--data-dir"])
        .arg(data.path())
        .env_remove("KEEL_TOKEN")
        .env_remove("KEEL_WEBHOOK_SECRET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    let refusal = stderr
        .lines()
        .last()
        .unwrap()
        .replace(&data.path().display().to_string(), "<data>");
    insta::assert_snapshot!(refusal);
}
