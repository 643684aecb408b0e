//! Approvals over the API: a gated `write_file` call pauses the turn, the
//! WebSocket announces it with the dialog's revision, REST lists and
//! decides it (409 twice, 404 unknown), and the resumed turn writes the
//! file exactly once.
use keel_core::ScriptedResponse;
use keel_gateway::serve::frames::{ClientFrame, ServerFrame};
use serde_json::json;

use super::*;

fn uuid(s: &str) -> uuid::Uuid {
    s.parse().unwrap()
}

#[tokio::test]
async fn a_gated_call_is_announced_listed_and_decided_once() {
    let ws_dir = tempfile::tempdir().unwrap();
    let workspace = ws_dir.path().canonicalize().unwrap();
    let t = TestServer::start(Setup {
        config: format!(
            "workspace_root = {:?}\n[tools]\nenable_write = true\n",
            workspace.display().to_string()
        ),
        provider: scripted(vec![
            ScriptedResponse::tool_call(
                "write_file",
                json!({"path": "note.txt", "content": "<b>hi</b>"}),
            ),
            ScriptedResponse::text("I wrote note.txt"),
        ]),
        ..Setup::default()
    })
    .await;
    let id = t.dialog("Approvals").await;
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Send {
        id: None,
        session_id: uuid(&id),
        text: Some("write a note".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let frames = ws
        .until(|f| matches!(f, ServerFrame::ApprovalRequested { .. }))
        .await;
    let Some(ServerFrame::ApprovalRequested {
        revision, approval, ..
    }) = frames.last().cloned()
    else {
        panic!("{frames:?}")
    };
    assert!(revision > 0);
    assert_eq!(approval.tool, "write_file");
    assert_eq!(approval.arguments["content"], "<b>hi</b>");
    assert!(
        !workspace.join("note.txt").exists(),
        "nothing runs undecided"
    );

    let list = t.json(&format!("/api/dialogs/{id}/approvals")).await;
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(list["items"][0]["status"], "pending");

    let r = t
        .post(
            &format!("/api/approvals/{}", approval.id),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let decided: serde_json::Value = r.json().await.unwrap();
    assert_eq!(decided["status"], "approved");
    let frames = ws
        .until(|f| {
            matches!(f, ServerFrame::TurnCommitted { turn_origin, .. }
                if format!("{turn_origin:?}") == "AgentContinuation")
        })
        .await;
    assert!(
        frames
            .iter()
            .any(|f| matches!(f, ServerFrame::ApprovalDecided { .. })),
        "{frames:?}"
    );
    let history = t.json(&format!("/api/dialogs/{id}/messages")).await;
    assert!(history.to_string().contains("wrote 9 bytes"), "{history}");
    assert_eq!(
        std::fs::read_to_string(workspace.join("note.txt")).unwrap(),
        "<b>hi</b>"
    );

    let again = t
        .post(
            &format!("/api/approvals/{}", approval.id),
            json!({"decision": "deny", "reason": "too late"}),
        )
        .await;
    assert_eq!(again.status(), 409);
    assert_eq!(again.headers()["content-type"], "application/problem+json");
    let unknown = t
        .post(
            &format!("/api/approvals/{}", uuid::Uuid::now_v7()),
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(unknown.status(), 404);
    let bad = t
        .post(
            &format!("/api/approvals/{}", approval.id),
            json!({"decision": "maybe"}),
        )
        .await;
    assert_eq!(bad.status(), 400);
    let all = t
        .json(&format!("/api/dialogs/{id}/approvals?status=all"))
        .await;
    assert_eq!(all["items"][0]["status"], "approved");
    assert!(
        t.json(&format!("/api/dialogs/{id}/approvals")).await["items"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}
