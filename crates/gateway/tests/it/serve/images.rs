//! Images in user messages over REST and WebSocket: stored once by hash,
//! resolved to their bytes for the provider, served back behind the token,
//! refused precisely (limits, types, a text-only model) with nothing stored.

use std::sync::Arc;

use base64::Engine as _;
use keel_core::{ContentPart, Provider, ScriptedProvider, ScriptedResponse};
use keel_gateway::serve::Limits;
use serde_json::{json, Value};

use super::{Setup, TestServer};

/// The smallest PNG header the sniffing recognises, and a tail.
const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01";

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

async fn image_rows(t: &TestServer) -> usize {
    let mut n = 0;
    for b in [PNG] {
        let hash = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(b));
        n += usize::from(t.store.image(&hash).await.unwrap().is_some());
    }
    n
}

/// Sends `body` streamed and waits for the turn's end; returns the event names.
async fn send_streamed(t: &TestServer, id: &str, body: Value) -> String {
    let r = t
        .http
        .post(format!("{}/api/dialogs/{id}/messages", t.base))
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let body = r.text().await.unwrap();
    body.lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn an_image_reaches_the_provider_as_bytes_is_stored_once_and_is_served() {
    let scripted = Arc::new(ScriptedProvider::offline());
    scripted.push([
        ScriptedResponse::text("a tiny png"),
        ScriptedResponse::text("again"),
    ]);
    let provider: Arc<dyn Provider> = scripted.clone();
    let t = TestServer::start(Setup {
        provider,
        ..Setup::default()
    })
    .await;
    let id = t.dialog("Pictures").await;
    let body = json!({"text": "what is this?", "parts": [
        {"type": "image", "data": b64(PNG), "mime_type": "image/png"},
        {"type": "image", "url": "https://example.com/cat.png"},
        {"type": "text", "text": " and this?"},
    ]});
    let events = send_streamed(&t, &id, body.clone()).await;
    assert!(events.ends_with("turn_committed"), "{events}");
    let request = scripted.requests().pop().expect("the provider was called");
    let user = request.messages.last().unwrap();
    let expected = format!("data:image/png;base64,{}", b64(PNG));
    assert_eq!(
        user.content,
        vec![
            ContentPart::Text {
                text: "what is this?".into()
            },
            ContentPart::ImageRef {
                uri: expected,
                mime_type: Some("image/png".into())
            },
            ContentPart::ImageRef {
                uri: "https://example.com/cat.png".into(),
                mime_type: None
            },
            ContentPart::Text {
                text: " and this?".into()
            },
        ]
    );
    // The same bytes again: one row.
    let events = send_streamed(&t, &id, body).await;
    assert!(events.ends_with("turn_committed"), "{events}");
    assert_eq!(image_rows(&t).await, 1);
    let page = t.json(&format!("/api/dialogs/{id}/messages")).await;
    let first = &page["items"][0];
    assert_eq!(first["text"], "what is this? and this?");
    let hash = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(PNG));
    assert_eq!(
        first["images"],
        json!([
            {"url": format!("/api/images/{hash}"), "mime_type": "image/png"},
            {"url": "https://example.com/cat.png"},
        ])
    );
    let r = t.get(&format!("/api/images/{hash}")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "image/png");
    assert_eq!(r.bytes().await.unwrap().as_ref(), PNG);
    let r = t.get(&format!("/api/images/{}", "0".repeat(64))).await;
    assert_eq!(r.status(), 404);
    let r = t.get("/api/images/not-a-hash").await;
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn the_image_route_needs_the_token() {
    let t = TestServer::start(Setup {
        token: Some("s3cret"),
        ..Setup::default()
    })
    .await;
    let hash = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(PNG));
    t.store.put_image(PNG.to_vec()).await.unwrap();
    let anonymous = t
        .http
        .get(format!("{}/api/images/{hash}", t.base))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    assert_eq!(t.get(&format!("/api/images/{hash}")).await.status(), 200);
}

#[tokio::test]
async fn bad_images_are_precise_problems_and_store_nothing() {
    let t = TestServer::start(Setup {
        limits: Limits::with_images(PNG.len(), 2),
        ..Setup::default()
    })
    .await;
    let id = t.dialog("Refusals").await;
    let image = |bytes: &[u8]| json!({"type": "image", "data": b64(bytes)});
    let mut too_big = PNG.to_vec();
    too_big.push(0);
    let cases = [
        ("empty", json!({"parts": []})),
        (
            "too many",
            json!({"parts": [image(PNG), image(PNG), image(PNG)]}),
        ),
        ("too large", json!({"parts": [image(&too_big)]})),
        (
            "not an image",
            json!({"parts": [image(b"<svg xmlns='x'/>")]}),
        ),
        (
            "declared otherwise",
            json!({"parts": [{"type": "image", "data": b64(PNG), "mime_type": "image/jpeg"}]}),
        ),
        (
            "bad base64",
            json!({"parts": [{"type": "image", "data": "!!!"}]}),
        ),
        (
            "http url",
            json!({"parts": [{"type": "image", "url": "http://example.com/a.png"}]}),
        ),
        (
            "data and url",
            json!({"parts": [{"type": "image", "data": b64(PNG), "url": "https://example.com/a.png"}]}),
        ),
        ("neither", json!({"parts": [{"type": "image"}]})),
        (
            "unknown part",
            json!({"parts": [{"type": "audio", "data": ""}]}),
        ),
    ];
    let mut out = String::new();
    for (name, body) in cases {
        let r = t.post(&format!("/api/dialogs/{id}/messages"), body).await;
        let status = r.status().as_u16();
        let problem: Value = r.json().await.unwrap();
        out.push_str(&format!(
            "{name}: {status} {}\n",
            problem["detail"].as_str().unwrap()
        ));
    }
    insta::assert_snapshot!(out);
    assert_eq!(image_rows(&t).await, 0);
    let page = t.json(&format!("/api/dialogs/{id}/messages")).await;
    assert_eq!(page["items"], json!([]));
}

#[tokio::test]
async fn a_text_only_model_refuses_images_before_anything_is_stored() {
    let scripted: Arc<dyn Provider> = Arc::new(ScriptedProvider::offline());
    let t = TestServer::start(Setup {
        provider: keel_providers::TextOnly::wrap("local", scripted),
        ..Setup::default()
    })
    .await;
    let id = t.dialog("Text only").await;
    let r = t
        .post(
            &format!("/api/dialogs/{id}/messages"),
            json!({"text": "look", "parts": [{"type": "image", "data": b64(PNG)}]}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let problem: Value = r.json().await.unwrap();
    insta::assert_snapshot!(problem["detail"].as_str().unwrap(), @"this dialog's model takes text only (its profile has images = false); send the message without images");
    assert_eq!(image_rows(&t).await, 0);
    let page = t.json(&format!("/api/dialogs/{id}/messages")).await;
    assert_eq!(page["items"], json!([]));
    // Text alone still goes through.
    let events = send_streamed(&t, &id, json!({"text": "hello"})).await;
    assert!(events.ends_with("turn_committed"), "{events}");
    // The OpenAI and AG-UI endpoints refuse it before placing a dialog.
    let placed = |channel: &'static str, chat: &'static str| {
        let t = &t;
        async move {
            let page = t
                .json(&format!("/api/dialogs?channel={channel}&chat_id={chat}"))
                .await;
            page["items"].as_array().unwrap().len()
        }
    };
    let openai = t
        .post(
            "/v1/chat/completions",
            json!({"model": "keel:root", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(PNG))}},
            ]}]}),
        )
        .await;
    assert_eq!(openai.status(), 400, "{}", openai.text().await.unwrap());
    let agui = t
        .post(
            "/ag-ui/root",
            json!({"threadId": "t-text-only", "runId": "r1", "state": {}, "tools": [],
                   "context": [], "forwardedProps": {}, "messages": [{"id": "m1", "role": "user",
                   "content": [{"type": "text", "text": "look"},
                               {"type": "binary", "mimeType": "image/png", "data": b64(PNG)}]}]}),
        )
        .await;
    assert_eq!(agui.status(), 400, "{}", agui.text().await.unwrap());
    assert_eq!(
        placed("openai", "default").await,
        0,
        "an OpenAI dialog was placed"
    );
    assert_eq!(
        placed("ag-ui", "t-text-only").await,
        0,
        "an AG-UI dialog was placed"
    );
    assert_eq!(image_rows(&t).await, 0);
}
