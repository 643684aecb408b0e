//! The contract: the OpenAPI document as served (snapshot), and every
//! frame example of docs/PROTOCOL.md read back through the frame types.

use std::collections::BTreeSet;

use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use serde_json::Value;

use super::{Setup, TestServer};

#[tokio::test]
async fn the_openapi_document_is_served_and_reviewed() {
    let t = TestServer::start(Setup::default()).await;
    let doc = t.json("/api/openapi.json").await;
    assert_eq!(doc["openapi"], "3.1.0");
    let mut served = doc.clone();
    served["info"]["version"] = "<version>".into();
    insta::assert_json_snapshot!(served);
    // Every route it lists answers (with a problem at worst, never 404 for the route).
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let concrete = path
                .replace("{id}", "01a22c8d-cb40-7766-a28d-a872408af176")
                .replace("{checkpoint_id}", "01a22c8d-cb40-7766-a28d-a872408af176");
            let r = t
                .http
                .request(
                    method.to_uppercase().parse().unwrap(),
                    format!("{}{concrete}", t.base),
                )
                .send()
                .await
                .unwrap();
            let body = r.text().await.unwrap();
            assert!(!body.contains("no route"), "{method} {path}: {body}");
        }
    }
}

/// The ```json client / ```json server blocks of docs/PROTOCOL.md.
fn examples(kind: &str) -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/PROTOCOL.md"
    ))
    .unwrap();
    let fence = format!("```json {kind}\n");
    doc.split(&fence)
        .skip(1)
        .map(|rest| rest.split("\n```").next().unwrap().to_owned())
        .collect()
}

#[test]
fn every_frame_in_protocol_md_is_a_frame_and_every_frame_has_an_example() {
    let mut client_kinds = BTreeSet::new();
    for text in examples("client") {
        let written: Value = serde_json::from_str(&text).unwrap();
        let frame: ClientFrame = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{e}: not a client frame:\n{text}"));
        assert_eq!(serde_json::to_value(&frame).unwrap(), written, "{text}");
        client_kinds.insert(written["type"].as_str().unwrap().to_owned());
    }
    let mut server_kinds = BTreeSet::new();
    for text in examples("server") {
        let written: Value = serde_json::from_str(&text).unwrap();
        let frame: ServerFrame = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{e}: not a server frame:\n{text}"));
        assert_eq!(serde_json::to_value(&frame).unwrap(), written, "{text}");
        server_kinds.insert(frame.kind().to_owned());
    }
    assert_eq!(
        client_kinds.into_iter().collect::<Vec<_>>(),
        [
            "get_agent_runs",
            "send",
            "steer",
            "stop",
            "subscribe",
            "unsubscribe"
        ]
    );
    assert_eq!(
        server_kinds.into_iter().collect::<Vec<_>>(),
        [
            "agent_event_updated",
            "agent_run_updated",
            "agent_runs",
            "approval_decided",
            "approval_requested",
            "dialog_updated",
            "error",
            "model_call_finished",
            "notice",
            "replay_gap",
            "resync",
            "steered",
            "stopped",
            "subscribed",
            "text_delta",
            "tool_finished",
            "tool_started",
            "turn_accepted",
            "turn_committed",
            "turn_failed",
            "turn_started",
            "unsubscribed",
        ]
    );
}
