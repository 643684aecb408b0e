//! Approval of tool calls: a gated call pauses the root turn durably and
//! nothing runs until a person decides; approve, approve always, deny (the
//! model reads the reason), expiry on the worker's timer (paused time), a
//! second decision refused, new input superseding, and a restart with a
//! decision pending. Synchronized through the feed, never a sleep.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use async_trait::async_trait;
use keel_core::{
    ApprovalId, Message, Role, ScriptedProvider, ScriptedResponse, SessionId, Tool, ToolError,
    ToolExecutionContext, ToolOutput, ToolRegistry, TurnOrigin,
};
use keel_engine::{
    ApprovalPolicy, EngineError, RuntimeBundle, SessionEvent, SessionManager, SessionManagerConfig,
    SessionSubscription,
};
use keel_store::{ApprovalStatus, Decision, Store};
use serde_json::json;

/// A tool that counts its runs.
struct Counted(&'static str, Arc<AtomicUsize>);

#[async_trait]
impl Tool for Counted {
    fn name(&self) -> &str {
        self.0
    }
    fn description(&self) -> &str {
        "counts its runs"
    }
    fn parameters(&self) -> serde_json::Value {
        json!({"type": "object"})
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        _: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let n = self.1.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(ToolOutput::text(format!(
            "{} ran ({n}) with {args}",
            self.0
        )))
    }
}

struct Setup {
    provider: ScriptedProvider,
    /// Runs of the gated `write` tool.
    writes: Arc<AtomicUsize>,
    /// Runs of the ungated `look` tool.
    looks: Arc<AtomicUsize>,
}

impl Setup {
    fn new() -> Self {
        Self {
            provider: ScriptedProvider::new(Vec::<ScriptedResponse>::new()),
            writes: Arc::new(AtomicUsize::new(0)),
            looks: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn manager(&self, store: Store, config: SessionManagerConfig) -> Arc<SessionManager> {
        let mut tools = ToolRegistry::new();
        tools
            .register(Arc::new(Counted("write", self.writes.clone())))
            .unwrap();
        tools
            .register(Arc::new(Counted("look", self.looks.clone())))
            .unwrap();
        let mut root = profile("root", &self.provider, tools);
        root.approval = ApprovalPolicy::tools(["write"]);
        SessionManager::new(store, RuntimeBundle::new(root), config)
    }
}

/// Waits on `feed` for the next approval request.
async fn requested(feed: &mut SessionSubscription) -> keel_store::ApprovalRecord {
    loop {
        if let SessionEvent::ApprovalRequested(a) = feed.recv().await.unwrap().as_ref() {
            return (**a).clone();
        }
    }
}

/// Waits on `feed` for the next continuation turn's commit.
async fn continued(feed: &mut SessionSubscription) {
    loop {
        match feed.recv().await.unwrap().as_ref() {
            SessionEvent::TurnCommitted {
                origin: TurnOrigin::AgentContinuation,
                ..
            } => return,
            SessionEvent::TurnFailed {
                origin: TurnOrigin::AgentContinuation,
                message,
                ..
            } => panic!("the continuation failed: {message}"),
            _ => {}
        }
    }
}

/// The tool results the model saw in its last request.
fn last_tool_results(provider: &ScriptedProvider) -> Vec<String> {
    let requests = provider.requests();
    requests
        .last()
        .unwrap()
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.text())
        .collect()
}

async fn pause(
    s: &Setup,
    manager: &Arc<SessionManager>,
    id: SessionId,
    feed: &mut SessionSubscription,
) -> ApprovalId {
    s.provider.push([ScriptedResponse::tool_call(
        "write",
        json!({"path": "a.txt"}),
    )]);
    let report = manager
        .send(id, Message::user("write a.txt"))
        .await
        .unwrap()
        .outcome()
        .await
        .unwrap();
    assert_eq!(report.approvals.len(), 1, "the turn paused for one call");
    let asked = requested(feed).await;
    assert_eq!(asked.id, report.approvals[0]);
    assert_eq!(asked.tool_name, "write");
    assert_eq!(asked.arguments, r#"{"path":"a.txt"}"#);
    assert_eq!(asked.status, ApprovalStatus::Pending);
    asked.id
}

#[tokio::test]
async fn a_gated_call_waits_for_approval_then_runs_once_and_the_model_goes_on() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
    let id = manager.create(spec("d")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    // One batch: an ungated call runs at once, the gated one waits.
    s.provider.push([ScriptedResponse {
        tool_calls: vec![
            keel_core::ScriptedToolCall {
                id: None,
                name: "look".into(),
                arguments: json!({}),
            },
            keel_core::ScriptedToolCall {
                id: None,
                name: "write".into(),
                arguments: json!({"path": "a.txt"}),
            },
        ],
        ..Default::default()
    }]);
    let report = manager
        .send(id, Message::user("write a.txt"))
        .await
        .unwrap()
        .outcome()
        .await
        .unwrap();
    assert_eq!(report.approvals.len(), 1);
    let asked = requested(&mut feed).await;
    assert_eq!(s.looks.load(Ordering::SeqCst), 1, "the ungated call ran");
    assert_eq!(
        s.writes.load(Ordering::SeqCst),
        0,
        "nothing gated runs undecided"
    );
    let pending = manager.approvals(id, true).await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].id, asked.id);

    s.provider.push([ScriptedResponse::text("written")]);
    let decided = manager
        .decide_approval(asked.id, Some(id), Decision::Approve, None)
        .await
        .unwrap();
    assert_eq!(decided.status, ApprovalStatus::Approved);
    continued(&mut feed).await;
    assert_eq!(s.writes.load(Ordering::SeqCst), 1);
    let results = last_tool_results(&s.provider);
    assert!(results[0].starts_with("look ran"), "{results:?}");
    assert!(results[1].starts_with("write ran (1)"), "{results:?}");
    assert_eq!(visible_texts(&manager, id).await.last().unwrap(), "written");
    assert!(manager.approvals(id, true).await.unwrap().is_empty());

    // Deciding again is refused, and runs nothing.
    let again = manager
        .decide_approval(asked.id, Some(id), Decision::Approve, None)
        .await
        .unwrap_err();
    assert!(
        matches!(&again, EngineError::ApprovalDecided { status, .. } if status == "approved"),
        "{again:?}"
    );
    assert_eq!(s.writes.load(Ordering::SeqCst), 1);
    // Unknown, and another dialog's, are not found.
    let other = manager.create(spec("other")).await.unwrap();
    assert!(matches!(
        manager
            .decide_approval(ApprovalId::new(), None, Decision::Deny, None)
            .await,
        Err(EngineError::ApprovalNotFound(_))
    ));
    assert!(matches!(
        manager
            .decide_approval(asked.id, Some(other), Decision::Deny, None)
            .await,
        Err(EngineError::ApprovalNotFound(_))
    ));
}

#[tokio::test]
async fn an_approval_wait_is_a_span_from_the_pause_to_the_decision() {
    use tracing_subscriber::layer::SubscriberExt;
    let recorder = SpanRecorder::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(recorder.clone()));
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
    let id = manager.create(spec("d")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let asked = pause(&s, &manager, id, &mut feed).await;
    let open = |name: &str| recorder.spans().iter().filter(|(n, _)| n == name).count();
    assert_eq!(open("await_approval write"), 0, "the wait is still open");
    s.provider.push([ScriptedResponse::text("written")]);
    manager
        .decide_approval(asked, Some(id), Decision::Deny, None)
        .await
        .unwrap();
    continued(&mut feed).await;
    let spans = recorder.spans();
    let wait = spans
        .iter()
        .find(|(n, _)| n == "await_approval write")
        .expect("the wait ended with the decision");
    assert_eq!(wait.1["keel.approval.outcome"], "denied");
    assert_eq!(wait.1["keel.approval.id"], asked.to_string());
    assert_eq!(wait.1["gen_ai.tool.name"], "write");
    let origins: Vec<&str> = spans
        .iter()
        .filter(|(n, _)| n == "invoke_agent root")
        .map(|(_, f)| f["keel.turn.origin"].as_str())
        .collect();
    assert_eq!(origins, ["user", "agent_continuation"]);
    // Each turn's commit appends one message: the call, then the answer.
    let rows: Vec<&str> = spans
        .iter()
        .filter(|(n, _)| n == "keel.store commit_turn")
        .map(|(_, f)| f["keel.store.rows"].as_str())
        .collect();
    assert_eq!(rows, ["1", "1"]);
}

#[tokio::test]
async fn approve_always_is_sticky_for_the_dialog_and_deny_tells_the_model_why() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
    let id = manager.create(spec("d")).await.unwrap();
    let other = manager.create(spec("other")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let first = pause(&s, &manager, id, &mut feed).await;
    s.provider.push([ScriptedResponse::text("ok")]);
    manager
        .decide_approval(first, Some(id), Decision::ApproveAlways, None)
        .await
        .unwrap();
    continued(&mut feed).await;
    assert_eq!(s.writes.load(Ordering::SeqCst), 1);

    // The second call in this dialog is not asked.
    s.provider.push([
        ScriptedResponse::tool_call("write", json!({"path": "b.txt"})),
        ScriptedResponse::text("done again"),
    ]);
    let report = manager
        .send(id, Message::user("again"))
        .await
        .unwrap()
        .outcome()
        .await
        .unwrap();
    assert!(report.approvals.is_empty());
    assert_eq!(report.output.final_text(), "done again");
    assert_eq!(s.writes.load(Ordering::SeqCst), 2);

    // Another dialog still asks; a denial's reason reaches the model.
    let mut other_feed = manager.events().subscribe(other).await.unwrap();
    let asked = pause(&s, &manager, other, &mut other_feed).await;
    s.provider
        .push([ScriptedResponse::text("I was not allowed to")]);
    manager
        .decide_approval(asked, Some(other), Decision::Deny, Some("not today".into()))
        .await
        .unwrap();
    continued(&mut other_feed).await;
    assert_eq!(
        s.writes.load(Ordering::SeqCst),
        2,
        "a denied call never runs"
    );
    let results = last_tool_results(&s.provider);
    assert!(
        results.last().unwrap().contains("reason: not today"),
        "{results:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_undecided_approval_expires_on_the_workers_timer_as_a_denial() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let manager = s.manager(
        open_store(dir.path()),
        SessionManagerConfig {
            approval_timeout: Duration::from_secs(60),
            ..SessionManagerConfig::default()
        },
    );
    let id = manager.create(spec("d")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let asked = pause(&s, &manager, id, &mut feed).await;
    s.provider.push([ScriptedResponse::text("it expired")]);
    // No traffic: the worker's timer (paused time auto-advances) expires it.
    let expired = loop {
        if let SessionEvent::ApprovalDecided(a) = feed.recv().await.unwrap().as_ref() {
            break (**a).clone();
        }
    };
    assert_eq!(expired.id, asked);
    assert_eq!(expired.status, ApprovalStatus::Expired);
    continued(&mut feed).await;
    assert_eq!(s.writes.load(Ordering::SeqCst), 0);
    assert!(last_tool_results(&s.provider)[0].contains("nobody decided in time"));
    let late = manager
        .decide_approval(asked, Some(id), Decision::Approve, None)
        .await
        .unwrap_err();
    assert!(matches!(&late, EngineError::ApprovalDecided { status, .. } if status == "expired"));
}

#[tokio::test]
async fn a_new_user_message_supersedes_a_pending_approval() {
    supersedes_with(SessionManagerConfig::default(), "superseded by new input").await;
}

#[tokio::test]
async fn the_supersede_reason_the_model_reads_is_the_configured_one() {
    let config = SessionManagerConfig {
        supersede_reason: "the user changed the subject".to_owned(),
        ..SessionManagerConfig::default()
    };
    supersedes_with(config, "the user changed the subject").await;
}

/// A new message while a call waits: it is denied with `reason`, which the
/// model reads before the message, and nothing runs.
async fn supersedes_with(config: SessionManagerConfig, reason: &str) {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let manager = s.manager(open_store(dir.path()), config);
    let id = manager.create(spec("d")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let asked = pause(&s, &manager, id, &mut feed).await;
    s.provider.push([ScriptedResponse::text("never mind then")]);
    let report = manager
        .send(id, Message::user("forget it"))
        .await
        .unwrap()
        .outcome()
        .await
        .unwrap();
    assert_eq!(report.output.final_text(), "never mind then");
    let all = manager.approvals(id, false).await.unwrap();
    assert_eq!(all[0].id, asked);
    assert_eq!(all[0].status, ApprovalStatus::Superseded);
    assert_eq!(all[0].reason.as_deref(), Some(reason));
    // The model read the denial before the new message, in order.
    let request = s.provider.requests().last().unwrap().clone();
    let tail: Vec<(Role, String)> = request
        .messages
        .iter()
        .rev()
        .take(2)
        .map(|m| (m.role, m.text()))
        .collect();
    assert_eq!(tail[0], (Role::User, "forget it".to_owned()));
    assert_eq!(tail[1].0, Role::Tool);
    assert!(
        tail[1].1.ends_with(&format!("(reason: {reason})")),
        "{}",
        tail[1].1
    );
    // The denial is stored as a failed call (the web page shows it so).
    let page = keel_store::MessagePage {
        visible_only: true,
        newest_first: true,
        cursor: None,
        limit: 10,
    };
    let stored = manager.store().load_message_page(id, page).await.unwrap();
    let denial = stored
        .iter()
        .find(|m| m.message.role == Role::Tool)
        .unwrap();
    assert!(denial.message.is_error);
    let late = manager
        .decide_approval(asked, Some(id), Decision::Approve, None)
        .await
        .unwrap_err();
    assert!(matches!(late, EngineError::ApprovalDecided { .. }));
    assert_eq!(s.writes.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_pending_approval_survives_a_restart_and_resumes_exactly_once() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let asked = {
        let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
        let id = manager.create(spec("d")).await.unwrap();
        let mut feed = manager.events().subscribe(id).await.unwrap();
        let asked = pause(&s, &manager, id, &mut feed).await;
        manager.shutdown();
        (id, asked)
    };
    let (id, asked) = asked;
    let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
    let pending = manager.approvals(id, true).await.unwrap();
    assert_eq!(pending.len(), 1, "still pending after the restart");
    let mut feed = manager.events().subscribe(id).await.unwrap();
    s.provider
        .push([ScriptedResponse::text("written after restart")]);
    manager
        .decide_approval(asked, None, Decision::Approve, None)
        .await
        .unwrap();
    continued(&mut feed).await;
    assert_eq!(s.writes.load(Ordering::SeqCst), 1);
    assert!(manager
        .decide_approval(asked, None, Decision::Approve, None)
        .await
        .is_err());
    assert_eq!(s.writes.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_approved_call_a_crash_interrupted_is_never_run_again() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let (id, asked) = {
        let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
        let id = manager.create(spec("d")).await.unwrap();
        let mut feed = manager.events().subscribe(id).await.unwrap();
        let asked = pause(&s, &manager, id, &mut feed).await;
        manager.shutdown();
        (id, asked)
    };
    // A process approved it and started the tool, then died before its
    // result was committed.
    let store = open_store(dir.path());
    store
        .decide_approval(keel_store::DecideApproval {
            id: asked,
            session_id: Some(id),
            decision: Decision::Approve,
            reason: None,
            now_ms: keel_core::time::now_ms(),
        })
        .await
        .unwrap();
    assert!(store
        .begin_approved_execution(asked, keel_core::time::now_ms())
        .await
        .unwrap());
    let manager = s.manager(store, SessionManagerConfig::default());
    let mut feed = manager.events().subscribe(id).await.unwrap();
    s.provider.push([ScriptedResponse::text("unknown outcome")]);
    manager.wake_inbox(id);
    continued(&mut feed).await;
    assert_eq!(s.writes.load(Ordering::SeqCst), 0, "not run a second time");
    assert!(last_tool_results(&s.provider)[0].contains("outcome is unknown"));
}

#[tokio::test]
async fn a_decision_for_a_deleted_dialog_is_not_found_and_runs_nothing() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
    let id = manager.create(spec("d")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let asked = pause(&s, &manager, id, &mut feed).await;
    manager.delete_dialog(id).await.unwrap();
    let err = manager
        .decide_approval(asked, None, Decision::Approve, None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, EngineError::ApprovalNotFound(a) if a == asked),
        "{err:?}"
    );
    assert_eq!(s.writes.load(Ordering::SeqCst), 0);
    assert_eq!(
        manager
            .store()
            .get_approval(asked)
            .await
            .unwrap()
            .unwrap()
            .status,
        ApprovalStatus::Pending,
        "nothing was decided"
    );
    let schedule = manager
        .store()
        .approval_schedule(id, keel_core::time::now_ms() + 48 * 3600 * 1000)
        .await
        .unwrap();
    assert_eq!(schedule, Default::default(), "no timer, no resume for it");
}

#[tokio::test]
async fn a_decision_racing_a_stop_runs_the_call_exactly_once_and_one_racing_a_delete_at_most_once()
{
    for delete in [false, true] {
        let s = Setup {
            provider: ScriptedProvider::new(Vec::<ScriptedResponse>::new()).with_fallback(
                Arc::new(|_: &keel_core::ChatRequest| ScriptedResponse::text("ok")),
            ),
            ..Setup::new()
        };
        let dir = tempfile::tempdir().unwrap();
        let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
        let id = manager.create(spec("d")).await.unwrap();
        let mut feed = manager.events().subscribe(id).await.unwrap();
        let asked = pause(&s, &manager, id, &mut feed).await;
        let decide = manager.decide_approval(asked, Some(id), Decision::Approve, None);
        let end = async {
            if delete {
                manager.delete_dialog(id).await
            } else {
                manager.stop(id).await.map(|_| ())
            }
        };
        let (decided, ended) = tokio::join!(decide, end);
        ended.unwrap();
        if delete {
            // Either order: the decision came first (and its call may run),
            // or the dialog was gone and nothing runs.
            if decided.is_err() {
                assert_eq!(s.writes.load(Ordering::SeqCst), 0);
            }
            assert!(s.writes.load(Ordering::SeqCst) <= 1);
            continue;
        }
        // A stop ends the running turn, not a decision: the call runs once,
        // before the next user turn, and its result is in the history once.
        decided.unwrap();
        manager
            .send(id, Message::user("next"))
            .await
            .unwrap()
            .outcome()
            .await
            .unwrap();
        assert_eq!(s.writes.load(Ordering::SeqCst), 1);
        let results = manager
            .store()
            .load_messages(id, keel_store::MessageFilter::default())
            .await
            .unwrap()
            .iter()
            .filter(|m| m.message.role == Role::Tool && m.message.text().starts_with("write ran"))
            .count();
        assert_eq!(results, 1);
        assert!(manager.approvals(id, true).await.unwrap().is_empty());
    }
}

#[tokio::test]
async fn a_paused_turn_stores_its_model_call_and_the_calls_that_ran_with_the_pause() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let manager = s.manager(open_store(dir.path()), SessionManagerConfig::default());
    let id = manager.create(spec("d")).await.unwrap();
    s.provider.push([ScriptedResponse {
        tool_calls: vec![
            keel_core::ScriptedToolCall {
                id: None,
                name: "look".into(),
                arguments: json!({}),
            },
            keel_core::ScriptedToolCall {
                id: None,
                name: "write".into(),
                arguments: json!({"path": "a.txt"}),
            },
        ],
        ..Default::default()
    }]);
    let ticket = manager
        .send(id, Message::user("write a.txt"))
        .await
        .unwrap();
    let turn = ticket.turn_id();
    let report = ticket.outcome().await.unwrap();
    assert_eq!(report.approvals.len(), 1);
    let calls = manager.store().turn_calls(Some(id), turn).await.unwrap();
    let kinds: Vec<_> = calls.iter().map(|c| (c.kind, c.name.as_str())).collect();
    // The gated call waits for a person: not run, so not a span (yet).
    let model = keel_core::Provider::model(&s.provider).to_owned();
    assert_eq!(
        kinds,
        [
            (keel_store::CallKind::Model, model.as_str()),
            (keel_store::CallKind::Tool, "look"),
        ]
    );
}
