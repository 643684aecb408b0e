//! The REST API: dialogs, messages, checkpoints, auth, bad input,
//! pagination under concurrent inserts, catalog reload.

use std::collections::HashSet;

use serde_json::{json, Value};

use keel_gateway::serve::frames::{ClientFrame, ServerFrame};

use super::{Setup, TestServer};

#[tokio::test]
async fn a_dialog_lives_through_messages_checkpoints_rollback_and_fork() {
    let t = TestServer::start(Setup::default()).await;
    let id = t.dialog("Plans").await;
    let r = t
        .post(
            &format!("/api/dialogs/{id}/messages"),
            json!({"text": "first"}),
        )
        .await;
    assert_eq!(r.status(), 202);
    let accepted: Value = r.json().await.unwrap();
    assert_eq!(accepted["session_id"], id.as_str());
    // Turns of one dialog run one after the other: once the second has
    // streamed to its commit, the first is committed too.
    let events = t.send_streamed(&id, "second").await;
    assert!(events.ends_with("turn_committed"), "{events}");
    let checkpoints = t.json(&format!("/api/dialogs/{id}/checkpoints")).await;
    assert_eq!(checkpoints["items"].as_array().unwrap().len(), 2);
    let messages = t.json(&format!("/api/dialogs/{id}/messages")).await;
    let texts: Vec<&str> = messages["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["user", "assistant", "user", "assistant"]);
    // No sub-agent ever ran: the inbox is empty.
    let inbox = t.json(&format!("/api/dialogs/{id}/inbox")).await;
    assert_eq!(
        inbox,
        json!({"pending": 0, "delivered": 0, "dead_lettered": 0, "superseded": 0, "revision": 0})
    );
    let first = checkpoints["items"][1]["id"].as_str().unwrap().to_owned();
    assert_eq!(checkpoints["items"][1]["turn_index"], 1);
    let r = t
        .post(
            &format!("/api/dialogs/{id}/checkpoints/{first}/rollback"),
            json!({}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let messages = t.json(&format!("/api/dialogs/{id}/messages")).await;
    assert_eq!(messages["items"].as_array().unwrap().len(), 2);
    // The abandoned branch stays listed, off the current branch.
    let list = t.json(&format!("/api/dialogs/{id}/checkpoints")).await;
    let off: Vec<bool> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["on_current_branch"].as_bool().unwrap())
        .collect();
    assert_eq!(off.iter().filter(|on| !**on).count(), 1, "{list:#}");
    let r = t
        .post(
            &format!("/api/dialogs/{id}/checkpoints/{first}/fork"),
            json!({"title": "Forked"}),
        )
        .await;
    assert_eq!(r.status(), 201);
    let fork: Value = r.json().await.unwrap();
    assert_eq!(fork["title"], "Forked");
    let fork_id = fork["id"].as_str().unwrap();
    let fork_messages = t.json(&format!("/api/dialogs/{fork_id}/messages")).await;
    assert_eq!(fork_messages["items"].as_array().unwrap().len(), 2);
    // Both count the one user message they show, and the database agrees.
    assert_eq!(fork["message_count"], 1);
    let rolled_back = t.json(&format!("/api/dialogs/{id}")).await;
    assert_eq!(rolled_back["message_count"], 1);
    // What it occupies: two turn checkpoints and the rollback's (the fork's
    // is the fork's), and the bytes the store counts for it.
    let session: keel_core::SessionId = id.parse().unwrap();
    let usage = t.store.dialog_usage(session).await.unwrap();
    assert_eq!(
        rolled_back["storage"],
        json!({"stored_bytes": usage.stored_bytes, "checkpoints": 3})
    );
    assert!(usage.stored_bytes > 0);
    let forked = t.json(&format!("/api/dialogs/{fork_id}")).await;
    assert_eq!(forked["storage"]["checkpoints"], 1);
    let fork_bytes = forked["storage"]["stored_bytes"].as_u64().unwrap();
    assert!(fork_bytes < usage.stored_bytes, "{forked:#}");
    // Listings do not compute it.
    let listed = t.json("/api/dialogs").await;
    let items = listed["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{listed:#}");
    assert!(
        items.iter().all(|d| d.get("storage").is_none()),
        "{listed:#}"
    );
    let report = t
        .store
        .check_invariants(keel_store::CheckOptions {
            owner_alive: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(report.is_clean(), "{report:#?}");
    // Rename, then delete: the dialog is gone from listings and lookups.
    let r = t
        .http
        .patch(format!("{}/api/dialogs/{id}", t.base))
        .json(&json!({"title": "Renamed"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["title"], "Renamed");
    let r = t
        .http
        .delete(format!("{}/api/dialogs/{id}", t.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(t.get(&format!("/api/dialogs/{id}")).await.status(), 404);
    // A message to it is refused, though this server ran its turns.
    let r = t
        .post(
            &format!("/api/dialogs/{id}/messages"),
            json!({"text": "late"}),
        )
        .await;
    assert_eq!(r.status(), 404);
    let mut ws = t.ws().await;
    ws.send(&keel_gateway::serve::frames::ClientFrame::Send {
        id: Some("late".into()),
        session_id: id.parse().unwrap(),
        text: Some("late".into()),
        parts: Vec::new(),
        if_busy: None,
        webhook: None,
    })
    .await;
    let refused = ws.frame().await;
    assert!(
        matches!(
            &refused,
            keel_gateway::serve::frames::ServerFrame::Error { .. }
        ),
        "{refused:?}"
    );
    assert_eq!(
        t.get(&format!("/api/dialogs/{id}/inbox")).await.status(),
        404
    );
    let listed = t.json("/api/dialogs").await;
    let ids: Vec<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [fork_id]);
}

#[tokio::test]
async fn with_a_token_every_route_but_the_probes_needs_it_and_without_one_none_does() {
    let t = TestServer::start(Setup {
        token: Some("s3cret"),
        ..Setup::default()
    })
    .await;
    // Load balancers and orchestrators probe without credentials.
    for path in ["/api/health", "/api/ready"] {
        let r = t
            .http
            .get(format!("{}{path}", t.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    for (header, path) in [
        (None, "/api/agent-runs"),
        (Some("Bearer wrong"), "/api/dialogs"),
        (Some("Basic czNjcmV0"), "/api/openapi.json"),
        (None, "/api/no-such-route"),
    ] {
        let mut rb = t.http.get(format!("{}{path}", t.base));
        if let Some(h) = header {
            rb = rb.header("authorization", h);
        }
        let r = rb.send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        assert!(r.headers().contains_key("www-authenticate"));
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["code"], "unauthorized");
        assert!(!body.to_string().contains("s3cret"));
    }
    assert_eq!(t.get("/api/dialogs").await.status(), 200);
    // A WebSocket without the token is refused; with it (as a browser passes it) accepted.
    let refused = tokio_tungstenite::connect_async(t.ws_url.clone()).await;
    assert!(refused.is_err());
    let _ws = t.ws().await;

    let open = TestServer::start(Setup::default()).await;
    let r = open
        .http
        .get(format!("{}/api/dialogs", open.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn bad_input_is_a_precise_4xx_problem_and_changes_nothing() {
    let t = TestServer::start(Setup::default()).await;
    let id = t.dialog("Kept").await;
    let url = |p: &str| format!("{}{p}", t.base);
    let post_raw = |path: String, ct: &'static str, body: Vec<u8>| {
        t.http
            .post(url(&path))
            .header("content-type", ct)
            .body(body)
            .send()
    };
    let messages = format!("/api/dialogs/{id}/messages");
    let cases: Vec<(&str, reqwest::Response)> = vec![
        (
            "bad json",
            post_raw(messages.clone(), "application/json", b"{\"text\":".to_vec())
                .await
                .unwrap(),
        ),
        (
            "wrong type",
            post_raw(
                messages.clone(),
                "application/json",
                b"{\"text\":5}".to_vec(),
            )
            .await
            .unwrap(),
        ),
        (
            "unknown field",
            post_raw(
                messages.clone(),
                "application/json",
                b"{\"text\":\"a\",\"x\":1}".to_vec(),
            )
            .await
            .unwrap(),
        ),
        (
            "unknown busy policy",
            post_raw(
                messages.clone(),
                "application/json",
                b"{\"text\":\"a\",\"if_busy\":\"rollback\"}".to_vec(),
            )
            .await
            .unwrap(),
        ),
        (
            "empty text",
            post_raw(
                messages.clone(),
                "application/json",
                b"{\"text\":\"\"}".to_vec(),
            )
            .await
            .unwrap(),
        ),
        (
            "an array",
            post_raw(messages.clone(), "application/json", b"[\"a\"]".to_vec())
                .await
                .unwrap(),
        ),
        (
            "not json",
            post_raw(messages.clone(), "text/plain", b"hello".to_vec())
                .await
                .unwrap(),
        ),
        (
            "body too large",
            post_raw(
                messages.clone(),
                "application/json",
                vec![b' '; 2 * 1024 * 1024],
            )
            .await
            .unwrap(),
        ),
        ("bad id", t.get("/api/dialogs/not-a-uuid").await),
        (
            "unknown dialog",
            t.get("/api/dialogs/01a22c8d-cb40-7766-a28d-a872408af176")
                .await,
        ),
        ("bad limit", t.get("/api/dialogs?limit=0").await),
        ("bad cursor", t.get("/api/dialogs?cursor=zzz").await),
        ("unknown query key", t.get("/api/dialogs?colour=red").await),
        (
            "bad status filter",
            t.get("/api/agent-runs?status=finished").await,
        ),
        (
            "bad title",
            t.post("/api/dialogs", json!({"title": "a\u{7}b"})).await,
        ),
        (
            "bidi override in a title",
            t.post("/api/dialogs", json!({"title": "invoice_\u{202e}fdp.exe"}))
                .await,
        ),
        (
            "zero-width character in a rename",
            t.http
                .patch(url(&format!("/api/dialogs/{id}")))
                .json(&json!({"title": "Ke\u{200b}pt"}))
                .send()
                .await
                .unwrap(),
        ),
        (
            "unknown agent",
            t.post("/api/dialogs", json!({"agent": "ghost"})).await,
        ),
        ("no route", t.get("/api/nowhere").await),
        (
            "wrong method",
            t.http.put(url("/api/health")).send().await.unwrap(),
        ),
        (
            "no catalog to reload",
            t.post("/api/admin/reload", json!({})).await,
        ),
    ];
    let mut seen = Vec::new();
    for (what, r) in cases {
        let status = r.status().as_u16();
        assert!((400..500).contains(&status), "{what}: {status}");
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["status"], status, "{what}");
        seen.push(format!(
            "{what}: {status} {} — {}",
            body["code"].as_str().unwrap(),
            body["detail"].as_str().unwrap()
        ));
    }
    insta::assert_snapshot!(seen.join("\n"));
    // Nothing of it was written.
    let dialog = t.json(&format!("/api/dialogs/{id}")).await;
    assert_eq!(dialog["message_count"], 0);
    assert_eq!(dialog["title"], "Kept");
    assert_eq!(
        t.json("/api/dialogs").await["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

/// Reads every page of `path` (a listing with `items` and `next_cursor`),
/// calling `between` after each page.
async fn all_pages(
    t: &TestServer,
    path: &str,
    key: &str,
    mut between: impl AsyncFnMut(),
) -> Vec<String> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let sep = if path.contains('?') { '&' } else { '?' };
        let url = match &cursor {
            Some(c) => format!("{path}{sep}cursor={c}"),
            None => path.to_owned(),
        };
        let page = t.json(&url).await;
        for item in page["items"].as_array().unwrap() {
            out.push(item[key].to_string());
        }
        between().await;
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return out,
        }
    }
}

#[tokio::test]
async fn pages_neither_repeat_nor_skip_while_items_are_inserted() {
    let t = TestServer::start(Setup::default()).await;
    let mut before = Vec::new();
    for i in 0..23 {
        before.push(t.dialog(&format!("d{i}")).await);
    }
    // Three new dialogs after every page: they sort before the first page.
    let listed = all_pages(&t, "/api/dialogs?limit=5", "id", async || {
        for _ in 0..3 {
            t.dialog("new").await;
        }
    })
    .await;
    let expected: Vec<String> = before.iter().rev().map(|id| format!("\"{id}\"")).collect();
    assert_eq!(listed, expected);

    // Messages, oldest first, while turns append more.
    let id = before[0].clone();
    for i in 0..6 {
        t.send_streamed(&id, &format!("m{i}")).await;
    }
    let stable = t
        .json(&format!("/api/dialogs/{id}/messages?limit=200"))
        .await;
    assert_eq!(stable["items"].as_array().unwrap().len(), 12);
    let mut n = 0;
    let seqs = all_pages(
        &t,
        &format!("/api/dialogs/{id}/messages?limit=5"),
        "seq",
        async || {
            n += 1;
            t.post(
                &format!("/api/dialogs/{id}/messages"),
                json!({"text": format!("more{n}")}),
            )
            .await;
        },
    )
    .await;
    let seqs: Vec<i64> = seqs.iter().map(|s| s.parse().unwrap()).collect();
    let unique: HashSet<i64> = seqs.iter().copied().collect();
    assert_eq!(unique.len(), seqs.len(), "no repeats: {seqs:?}");
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let first: Vec<i64> = stable["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(&seqs[..first.len()], first.as_slice(), "nothing skipped");
}

#[tokio::test]
async fn checkpoints_and_run_events_page_every_item_once() {
    let t = TestServer::start(Setup::default()).await;
    let id = t.dialog("Paged").await;
    for i in 0..7 {
        t.send_streamed(&id, &format!("m{i}")).await;
    }
    let whole = t
        .json(&format!("/api/dialogs/{id}/checkpoints?limit=200"))
        .await;
    let expected: Vec<String> = whole["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].to_string())
        .collect();
    assert_eq!(expected.len(), 7, "{whole:#}");
    assert_eq!(whole["next_cursor"], Value::Null);
    let first = t
        .json(&format!("/api/dialogs/{id}/checkpoints?limit=3"))
        .await;
    assert_eq!(first["items"].as_array().unwrap().len(), 3);
    assert!(first["next_cursor"].is_string(), "{first:#}");
    let paged = all_pages(
        &t,
        &format!("/api/dialogs/{id}/checkpoints?limit=3"),
        "id",
        async || {},
    )
    .await;
    assert_eq!(paged, expected);

    // A run with three signals and its completion, read two at a time.
    let session: keel_core::SessionId = id.parse().unwrap();
    let run = run_with_events(&t.store, session, 3).await;
    let whole = t
        .json(&format!("/api/agent-runs/{run}/events?limit=200"))
        .await;
    let expected: Vec<String> = whole["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].to_string())
        .collect();
    assert_eq!(expected.len(), 4, "{whole:#}");
    let first = t
        .json(&format!("/api/agent-runs/{run}/events?limit=2"))
        .await;
    assert_eq!(first["items"].as_array().unwrap().len(), 2);
    assert!(first["next_cursor"].is_string(), "{first:#}");
    let paged = all_pages(
        &t,
        &format!("/api/agent-runs/{run}/events?limit=2"),
        "id",
        async || {},
    )
    .await;
    assert_eq!(paged, expected);

    for path in [
        format!("/api/dialogs/{id}/checkpoints"),
        format!("/api/agent-runs/{run}/events"),
    ] {
        for query in ["cursor=zzz", "cursor=1_2", "limit=0", "limit=201"] {
            let r = t
                .http
                .get(format!("{}{path}?{query}", t.base))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400, "{path}?{query}");
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["code"], "bad_request", "{path}?{query}");
        }
    }
}

/// A background run of `session`, running, with `signals` signals and then
/// its completion in the inbox.
async fn run_with_events(
    store: &keel_store::Store,
    session: keel_core::SessionId,
    signals: usize,
) -> keel_core::RunId {
    use keel_core::{AgentId, Delivery, ExecutionMode, RunId, Usage};
    let id = RunId::new();
    let execution_id = format!("exec-{id}");
    let run = keel_store::NewRun {
        id,
        root_session_id: session,
        root_turn_id: None,
        parent_run_id: None,
        caller_agent_id: AgentId::parse("root").unwrap(),
        caller_scope_id: "root-turn".into(),
        idempotency_key: None,
        agent_id: AgentId::parse("researcher").unwrap(),
        definition_hash: "d".repeat(64),
        provider_profile: "default".into(),
        provider_name: "scripted".into(),
        model_id: "scripted-1".into(),
        mode: ExecutionMode::Background,
        depth: 1,
        plan_item_id: None,
        execution_id: execution_id.clone(),
        task: "look things up".into(),
        context_json: None,
        budget_json: "{}".into(),
        signal_contract_json: None,
        signal_delivery: Some(Delivery::Queue),
        completion_delivery: Some(Delivery::Queue),
        failure_delivery: Some(Delivery::Queue),
        runtime_generation: 1,
        deadline_at_ms: i64::MAX / 2,
    };
    store
        .accept_run(keel_store::AcceptRun {
            run,
            inbox_capacity: 16,
            now_ms: 100,
        })
        .await
        .unwrap();
    store
        .mark_run_running(id, execution_id.clone(), 110)
        .await
        .unwrap();
    for i in 0..signals {
        let now_ms = 200 + i64::try_from(i).unwrap();
        store
            .insert_signal(keel_store::NewSignal {
                run_id: id,
                execution_id: execution_id.clone(),
                dedupe_key: Some(format!("s{i}")),
                delivery: Delivery::Queue,
                severity: None,
                payload_json: format!(r#"{{"summary":"step {i}"}}"#),
                inbox_capacity: 16,
                limits: keel_store::SignalLimits {
                    max_signals: 100,
                    burst: 100,
                    min_interval_ms: 0,
                    dedupe_window_ms: 0,
                },
                now_ms,
            })
            .await
            .unwrap();
    }
    store
        .commit_terminal(
            id,
            execution_id,
            keel_store::TerminalOutcome::Completed {
                result: "done".into(),
                usage: Usage::new(1, 1),
                tool_calls: 0,
                iterations: 1,
                cost: None,
            },
            keel_store::CompletionHandling::Deliver,
            300,
        )
        .await
        .unwrap();
    id
}

#[tokio::test]
async fn a_reload_with_broken_definitions_keeps_the_catalog_in_force() {
    let t = TestServer::start(Setup {
        agents: true,
        ..Setup::default()
    })
    .await;
    assert_eq!(t.json("/api/ready").await["catalog_generation"], 1);
    let agents = t.dir.path().join("agents");
    std::fs::write(
        agents.join("broken.md"),
        "---\nid: broken\nunknown_key: 1\n---\nbody\n",
    )
    .unwrap();
    let r = t.post("/api/admin/reload", json!({})).await;
    assert_eq!(r.status(), 422);
    let problem: Value = r.json().await.unwrap();
    let errors = problem["errors"].as_array().unwrap();
    assert!(
        errors
            .iter()
            .any(|e| e.as_str().unwrap().contains("broken.md")),
        "{problem:#}"
    );
    assert!(problem["detail"]
        .as_str()
        .unwrap()
        .contains("generation 1 stays in force"));
    assert_eq!(t.json("/api/ready").await["catalog_generation"], 1);
    // SIGHUP's path refuses it the same way.
    assert_eq!(t.server().reload().await.unwrap_err().status(), 422);

    std::fs::remove_file(agents.join("broken.md")).unwrap();
    let r = t.post("/api/admin/reload", json!({})).await;
    assert_eq!(r.status(), 200);
    let report: Value = r.json().await.unwrap();
    assert_eq!(report["generation"], 2);
    assert_eq!(
        report["agents"],
        json!(["archivist", "monitor", "researcher", "writer"])
    );
    assert_eq!(t.json("/api/ready").await["catalog_generation"], 2);
}

#[tokio::test]
async fn dialogs_are_listed_by_channel_and_chat() {
    let t = TestServer::start(Setup::default()).await;
    let default_chat = t.dialog("Mine").await;
    let mut created = Vec::new();
    for body in [
        json!({"title": "Team plans", "chat_id": "team"}),
        json!({"title": "Elsewhere", "channel": "slack", "chat_id": "team"}),
    ] {
        let r = t.post("/api/dialogs", body.clone()).await;
        assert_eq!(r.status(), 201, "{body}");
        let dialog: Value = r.json().await.unwrap();
        assert_eq!(dialog["chat_id"], "team");
        created.push(dialog["id"].as_str().unwrap().to_owned());
    }
    let ids = async |query: &str| -> Vec<String> {
        t.json(&format!("/api/dialogs{query}")).await["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(ids("").await, [default_chat]);
    assert_eq!(ids("?chat_id=team").await, [created[0].clone()]);
    assert_eq!(
        ids("?channel=slack&chat_id=team").await,
        [created[1].clone()]
    );
    assert!(ids("?chat_id=nobody").await.is_empty());
}

#[tokio::test]
async fn a_reload_is_seen_by_the_next_request_and_a_removed_agents_dialog_refuses_turns() {
    let t = TestServer::start(Setup {
        agents: true,
        ..Setup::default()
    })
    .await;
    let agents = t.dir.path().join("agents");
    let r = t.post("/api/dialogs", json!({"agent": "monitor"})).await;
    assert_eq!(r.status(), 201);
    let of_monitor: Value = r.json().await.unwrap();
    let of_monitor = of_monitor["id"].as_str().unwrap().to_owned();

    // critic is added (its prompt starts with a stray second frontmatter),
    // monitor removed.
    std::fs::write(
        agents.join("critic.md"),
        "---\nid: critic\ndescription: Criticizes.\nllm_profile: default\n---\n---\ntools: [read_file]\n---\nYou criticize.\n",
    )
    .unwrap();
    std::fs::remove_file(agents.join("monitor.md")).unwrap();
    let r = t.post("/api/admin/reload", json!({})).await;
    assert_eq!(r.status(), 200);
    let report: Value = r.json().await.unwrap();
    insta::assert_json_snapshot!("reload_report_with_a_warning", report);

    assert_eq!(
        t.post("/api/dialogs", json!({"agent": "critic"}))
            .await
            .status(),
        201
    );
    let r = t.post("/api/dialogs", json!({"agent": "monitor"})).await;
    assert_eq!(r.status(), 400);
    let models: Vec<String> = t.json("/v1/models").await["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        models,
        [
            "keel:root",
            "keel:archivist",
            "keel:critic",
            "keel:researcher",
            "keel:writer"
        ]
    );

    let r = t
        .post(
            &format!("/api/dialogs/{of_monitor}/messages"),
            json!({"text": "still there?"}),
        )
        .await;
    assert_eq!(r.status(), 409);
    let problem: Value = r.json().await.unwrap();
    insta::assert_json_snapshot!("a_removed_agents_dialog_refuses_a_turn", problem);
    // Nothing of the refused message was stored; the dialog can still be
    // read and switched.
    let page = t.json(&format!("/api/dialogs/{of_monitor}/messages")).await;
    assert_eq!(page["items"], json!([]));
    let r = t
        .http
        .patch(format!("{}/api/dialogs/{of_monitor}", t.base))
        .json(&json!({"agent": "critic"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = t
        .post(
            &format!("/api/dialogs/{of_monitor}/messages"),
            json!({"text": "and now?"}),
        )
        .await;
    assert_eq!(r.status(), 202);
}

#[tokio::test]
async fn a_dialogs_agent_switches_by_patch_only_while_no_turn_runs() {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let t = TestServer::start(Setup {
        agents: true,
        provider: std::sync::Arc::new(super::GatedProvider { gate: gate.clone() }),
        ..Setup::default()
    })
    .await;
    let id = t.dialog("Switching").await;
    let dialog = format!("/api/dialogs/{id}");
    let patch = |body: Value| {
        t.http
            .patch(format!("{}{dialog}", t.base))
            .json(&body)
            .send()
    };
    let mut ws = t.ws().await;
    ws.send(&ClientFrame::Subscribe {
        id: None,
        session_id: id.parse().unwrap(),
        since_revision: None,
        resume_from: None,
        join: false,
    })
    .await;
    ws.until(|f| matches!(f, ServerFrame::Subscribed { .. }))
        .await;
    let r = t
        .post(&format!("{dialog}/messages"), json!({"text": "work"}))
        .await;
    assert_eq!(r.status(), 202);
    let turn = r.json::<Value>().await.unwrap()["turn_id"]
        .as_str()
        .unwrap()
        .to_owned();
    ws.until(|f| matches!(f, ServerFrame::TextDelta { .. }))
        .await;

    // While the turn runs: refused, naming the turn, and nothing changed.
    let r = patch(json!({"agent": "writer", "title": "Not now"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let problem: Value = r.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains(&turn),
        "{problem}"
    );
    let now = t.json(&dialog).await;
    assert_eq!(
        (&now["agent"], &now["title"]),
        (&json!("root"), &json!("Switching"))
    );

    gate.add_permits(1);
    ws.until(|f| matches!(f, ServerFrame::TurnCommitted { .. }))
        .await;
    let r = patch(json!({"agent": "writer"})).await.unwrap();
    assert_eq!(r.status(), 200);
    let changed: Value = r.json().await.unwrap();
    assert_eq!(
        (&changed["agent"], &changed["title"]),
        (&json!("writer"), &json!("Switching"))
    );
    // Subscribers learn of the new agent.
    ws.until(|f| {
        matches!(f, ServerFrame::DialogUpdated { dialog, .. }
            if dialog.agent.as_deref() == Some("writer"))
    })
    .await;
    // An unknown agent, or a bad name, changes nothing.
    assert_eq!(
        patch(json!({"agent": "ghost", "title": "G"}))
            .await
            .unwrap()
            .status(),
        400
    );
    assert_eq!(
        patch(json!({"agent": "Not A Name"}))
            .await
            .unwrap()
            .status(),
        400
    );
    let now = t.json(&dialog).await;
    assert_eq!(
        (&now["agent"], &now["title"]),
        (&json!("writer"), &json!("Switching"))
    );
    // The stored row is what a restart reads.
    let record = t
        .store
        .get_session(id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        record.agent_id.map(|a| a.to_string()).as_deref(),
        Some("writer")
    );
}

/// `export` with its dialog's ids cleared and every run, timeline and
/// checkpoint id replaced by its kind and position (links following them):
/// two exports of copies of one dialog are equal under it.
fn without_ids(mut export: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    export["dialog"]["id"] = Value::Null;
    export["dialog"]["dialog_id"] = Value::Null;
    let mut names = std::collections::HashMap::new();
    for kind in ["runs", "timelines", "checkpoints"] {
        for (i, item) in export[kind].as_array().into_iter().flatten().enumerate() {
            if let Some(id) = item["id"].as_str() {
                names.insert(id.to_owned(), format!("{kind}-{}", i + 1));
            }
        }
    }
    let rename = |v: &mut Value| {
        if let Some(name) = v.as_str().and_then(|s| names.get(s)) {
            *v = Value::String(name.clone());
        }
    };
    rename(&mut export["head_timeline"]);
    for (kind, fields) in [
        ("runs", &["id", "parent_run_id", "caller_scope"][..]),
        ("timelines", &["id", "parent"][..]),
        ("checkpoints", &["id", "parent_id", "timeline"][..]),
    ] {
        for item in export[kind].as_array_mut().into_iter().flatten() {
            for field in fields {
                rename(&mut item[*field]);
            }
        }
    }
    export
}

#[tokio::test]
async fn a_dialog_exported_and_imported_over_rest_is_a_copy_with_new_ids() {
    let t = TestServer::start(Setup::default()).await;
    let id = t.dialog("Plans").await;
    let events = t.send_streamed(&id, "first").await;
    assert!(events.ends_with("turn_committed"), "{events}");
    let export = t.json(&format!("/api/dialogs/{id}/export")).await;
    assert_eq!(export["format"], "keel.dialog");
    assert_eq!(export["dialog"]["id"], id.as_str());
    let r = t.post("/api/dialogs/import", export.clone()).await;
    assert_eq!(r.status(), 201);
    let copy: Value = r.json().await.unwrap();
    let copy_id = copy["id"].as_str().unwrap();
    assert_ne!(copy_id, id);
    assert_eq!(copy["title"], "Plans");
    assert_eq!(copy["message_count"], 1);
    let again = t.json(&format!("/api/dialogs/{copy_id}/export")).await;
    assert_ne!(
        again["checkpoints"][0]["id"],
        export["checkpoints"][0]["id"]
    );
    assert_eq!(without_ids(again), without_ids(export.clone()));

    // A newer version is refused, naming both versions, and writes nothing.
    let mut newer = export.clone();
    newer["version"] = json!(2);
    let r = t.post("/api/dialogs/import", newer).await;
    assert_eq!(r.status(), 400);
    let problem: Value = r.json().await.unwrap();
    insta::assert_json_snapshot!(problem["detail"]);
    let list = t.json("/api/dialogs").await;
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn an_import_may_be_larger_than_other_bodies_but_not_without_bound() {
    let t = TestServer::start(Setup::default()).await;
    // Larger than every other request may be: accepted, then refused for
    // its content, not its size.
    let big = json!({"format": "keel.dialog", "version": 1, "padding": "x".repeat(4 << 20)});
    let r = t.post("/api/dialogs/import", big).await;
    assert_eq!(r.status(), 400, "{}", r.text().await.unwrap());
    let huge = json!({"padding": "x".repeat(keel_engine::MAX_DIALOG_EXPORT_BYTES)});
    let r = t.post("/api/dialogs/import", huge).await;
    assert_eq!(r.status(), 413);
}
