//! Sessions, turns, checkpoints and dialogs on a real SQLite file.

use std::time::Duration;

use crate::common::*;
use keel_core::{Message, Role, ScriptedResponse};
use keel_engine::SessionManagerConfig;
use keel_engine::{EngineError, TurnEvent};
use keel_engine::{MergeStrategy, SlotMode};
use keel_store::CheckpointSource;

#[tokio::test]
async fn a_turn_commits_messages_state_and_a_checkpoint() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["hello"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let report = h.manager.submit_turn(id, "hi").await.unwrap();
    assert_eq!(report.output.final_text(), "hello");
    assert!(report.checkpoint.is_some());
    let s = h.manager.get(id).unwrap();
    let g = s.lock().await;
    assert_eq!(g.turn_index(), 1);
    assert_eq!(g.state().cost.requests, 1);
    assert_eq!(g.record().message_count, 1);
    let cps = h.manager.list_checkpoints(id).await.unwrap();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].source, CheckpointSource::Turn);
    assert_eq!(cps[0].turn_index, 1);
}

#[tokio::test]
async fn auto_checkpoint_can_be_turned_off() {
    let h = harness(SessionManagerConfig {
        auto_checkpoint: false,
        ..Default::default()
    });
    replies(&h.provider, &["a", "b"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    let r = h.manager.submit_turn(id, "2").await.unwrap();
    assert!(r.checkpoint.is_none());
    assert!(h.manager.list_checkpoints(id).await.unwrap().is_empty());
    // The turns are still durable without checkpoints.
    assert_eq!(visible_texts(&h.manager, id).await, ["1", "a", "2", "b"]);
}

#[tokio::test]
async fn restart_recovers_identical_messages_slots_memory_cost_and_turn_index() {
    let dir = tempfile::tempdir().unwrap();
    let provider = keel_core::ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    replies(&provider, &["one", "two", "side answer"]);
    let (id, before_state, before_history) = {
        let manager = manager_on(
            open_store(dir.path()),
            &provider,
            SessionManagerConfig::default(),
        );
        let id = manager.create(spec("d1")).await.unwrap();
        manager.submit_turn(id, "first").await.unwrap();
        manager.submit_turn(id, "second").await.unwrap();
        manager
            .derive_slot(id, "default", "side", SlotMode::Focused { window: 4 })
            .await
            .unwrap();
        manager.switch_slot(id, "side").await.unwrap();
        manager.submit_turn(id, "in side").await.unwrap();
        manager
            .set_memory(
                id,
                "goal",
                "ship keel".into(),
                serde_json::json!({"source": "test"}),
            )
            .await
            .unwrap();
        let s = manager.get(id).unwrap();
        let g = s.lock().await;
        (id, g.state().clone(), g.history().to_vec())
    }; // manager and store dropped here
    let manager = manager_on(
        open_store(dir.path()),
        &provider,
        SessionManagerConfig::default(),
    );
    assert!(
        manager.get(id).is_err(),
        "nothing in memory after a restart"
    );
    let s = manager.load(id).await.unwrap();
    let g = s.lock().await;
    assert_eq!(g.state(), &before_state);
    assert_eq!(g.history(), &before_history[..]);
    assert_eq!(g.turn_index(), 3);
    assert_eq!(g.state().memory["goal"].value, "ship keel");
    assert_eq!(g.state().current_slot, "side");
    let side: Vec<String> = g.replay("side").unwrap().iter().map(|m| m.text()).collect();
    // Focused with a window of 4: the last four messages of its view.
    assert_eq!(side, ["second", "two", "in side", "side answer"]);
}

#[tokio::test]
async fn rollback_restores_turn_index_cost_and_slots_exactly() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a", "b", "c"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    let at = h.manager.create_checkpoint(id).await.unwrap();
    let state_at = h.manager.get(id).unwrap().lock().await.state().clone();
    h.manager
        .create_slot(id, "scratch", SlotMode::Full)
        .await
        .unwrap();
    h.manager.submit_turn(id, "2").await.unwrap();
    h.manager.submit_turn(id, "3").await.unwrap();
    h.manager.rollback(id, at.id).await.unwrap();
    let s = h.manager.get(id).unwrap();
    let g = s.lock().await;
    assert_eq!(g.state(), &state_at);
    assert_eq!(g.turn_index(), 1);
    assert!(!g.state().slots.contains_key("scratch"));
    let texts: Vec<String> = g.history().iter().map(|m| m.message.text()).collect();
    assert_eq!(texts, ["1", "a"]);
}

#[tokio::test]
async fn branching_keeps_the_abandoned_branch_restorable() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a1", "a2", "a3", "b1", "b2"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let a = h.manager.create_checkpoint(id).await.unwrap();
    for t in ["x1", "x2", "x3"] {
        h.manager.submit_turn(id, t).await.unwrap();
    }
    let tip_of_first_branch = h.manager.latest_checkpoint(id).await.unwrap().unwrap();
    h.manager.rollback(id, a.id).await.unwrap();
    for t in ["y1", "y2"] {
        h.manager.submit_turn(id, t).await.unwrap();
    }
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["y1", "b1", "y2", "b2"]
    );
    let listed = h.manager.list_checkpoints(id).await.unwrap();
    // manual A, 3 turns, the rollback, 2 turns — newest first.
    let sources: Vec<_> = listed.iter().map(|c| c.source).collect();
    use CheckpointSource::*;
    assert_eq!(sources, [Turn, Turn, Rollback, Turn, Turn, Turn, Manual]);
    assert_eq!(listed[2].parent_id, Some(a.id), "the rollback points at A");
    assert!(listed.iter().any(|c| c.id == tip_of_first_branch.id));
    // Restore the abandoned branch: its three turns come back.
    h.manager
        .rollback(id, tip_of_first_branch.id)
        .await
        .unwrap();
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["x1", "a1", "x2", "a2", "x3", "a3"]
    );
    assert_eq!(h.manager.get(id).unwrap().lock().await.turn_index(), 3);
}

#[tokio::test]
async fn checkpoints_are_isolated_between_sessions() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a", "b"]);
    let one = h.manager.create(spec("one")).await.unwrap();
    let two = h.manager.create(spec("two")).await.unwrap();
    h.manager.submit_turn(one, "1").await.unwrap();
    h.manager.submit_turn(two, "2").await.unwrap();
    let of_one = h.manager.latest_checkpoint(one).await.unwrap().unwrap();
    let err = h.manager.rollback(two, of_one.id).await.unwrap_err();
    assert!(matches!(err, EngineError::CheckpointNotFound(c) if c == of_one.id));
    assert_eq!(h.manager.list_checkpoints(two).await.unwrap().len(), 1);
    assert_eq!(visible_texts(&h.manager, two).await, ["2", "b"]);
}

#[tokio::test]
async fn fork_creates_a_session_from_any_checkpoint_without_touching_the_source() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a", "b", "forked answer"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    let first = h.manager.latest_checkpoint(id).await.unwrap().unwrap();
    h.manager.submit_turn(id, "2").await.unwrap();
    let fork = h.manager.fork(first.id, None).await.unwrap();
    assert_ne!(fork, id);
    assert_eq!(visible_texts(&h.manager, fork).await, ["1", "a"]);
    h.manager.submit_turn(fork, "in fork").await.unwrap();
    assert_eq!(
        visible_texts(&h.manager, fork).await,
        ["1", "a", "in fork", "forked answer"]
    );
    assert_eq!(visible_texts(&h.manager, id).await, ["1", "a", "2", "b"]);
    let rec = h.manager.record(fork).await.unwrap();
    assert_eq!(rec.title, "Fork of Dialog d1");
    assert_eq!(rec.chat_id, "chat");
}

#[tokio::test]
async fn export_import_export_round_trips_equal_modulo_ids() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a", "b"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    h.manager
        .derive_slot(id, "default", "side", SlotMode::Full)
        .await
        .unwrap();
    h.manager.switch_slot(id, "side").await.unwrap();
    h.manager.submit_turn(id, "2").await.unwrap();
    h.manager
        .set_memory(id, "k", "v".into(), serde_json::Value::Null)
        .await
        .unwrap();
    crate::exports::ended_runs(h.manager.store(), id).await;
    let first = h.manager.export_dialog(id).await.unwrap();
    assert_eq!(first.runs.len(), 2);
    let json = first.to_json().unwrap();
    let copy = h
        .manager
        .import_dialog(keel_engine::DialogExport::from_json(json.as_bytes()).unwrap())
        .await
        .unwrap();
    assert_ne!(copy, id);
    let second = h.manager.export_dialog(copy).await.unwrap();
    assert_ne!(second.dialog.id, first.dialog.id);
    assert_ne!(second.dialog.dialog_id, first.dialog.dialog_id);
    for (new, old) in second.runs.iter().zip(&first.runs) {
        assert_ne!(new.id, old.id);
    }
    for (new, old) in second.checkpoints.iter().zip(&first.checkpoints) {
        assert_ne!(new.id, old.id);
    }
    // Equal but for ids: runs, timelines and checkpoints get new ones, and
    // every link follows them.
    assert_eq!(
        crate::exports::normalized(second),
        crate::exports::normalized(first)
    );
    // The copy is a dialog like any other: it replays the same context and
    // has a checkpoint to roll back to.
    let (a, b) = (h.manager.get(id).unwrap(), h.manager.get(copy).unwrap());
    let (a, b) = (a.lock().await, b.lock().await);
    for slot in ["default", "side"] {
        assert_eq!(
            a.replay(slot).unwrap(),
            b.replay(slot).unwrap(),
            "slot {slot}"
        );
    }
    drop((a, b));
    assert_eq!(h.manager.list_checkpoints(copy).await.unwrap().len(), 2);
    let record = h.manager.record(copy).await.unwrap();
    assert_eq!(record.message_count, 2);
}

#[tokio::test]
async fn the_export_format_is_stable() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["hello"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "hi").await.unwrap();
    let export = h.manager.export_dialog(id).await.unwrap();
    let session_id = export.dialog.id.clone().unwrap();
    assert!(uuid::Uuid::parse_str(&session_id).is_ok(), "{session_id}");
    let json: serde_json::Value =
        serde_json::from_str(&crate::exports::normalized(export).to_json().unwrap()).unwrap();
    insta::assert_json_snapshot!(json, { ".checkpoints[].created_at_ms" => "[time]" });
}

#[tokio::test]
async fn an_import_for_an_unknown_agent_writes_nothing() {
    let h = harness(SessionManagerConfig::default());
    let id = h.manager.create(spec("d1")).await.unwrap();
    let mut export = h.manager.export_dialog(id).await.unwrap();
    export.dialog.agent = Some("nobody".into());
    let before = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    let err = h.manager.import_dialog(export).await.unwrap_err();
    assert!(matches!(err, EngineError::UnknownAgent(_)), "{err}");
    let after = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    assert_eq!(after.items.len(), before.items.len());
}

#[tokio::test]
async fn imported_messages_join_the_history_with_a_checkpoint_and_no_model_call() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["after import"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager
        .import_messages(id, vec![Message::user("u1"), Message::assistant("a1")])
        .await
        .unwrap();
    assert!(h.provider.requests().is_empty());
    let cps = h.manager.list_checkpoints(id).await.unwrap();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].source, CheckpointSource::Manual);
    assert_eq!(cps[0].turn_index, 0);
    h.manager.submit_turn(id, "u2").await.unwrap();
    // The model saw the imported history.
    let seen: Vec<String> = h.provider.requests()[0]
        .messages
        .iter()
        .filter(|m| m.role != Role::System)
        .map(|m| m.text())
        .collect();
    assert_eq!(seen, ["u1", "a1", "u2"]);
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["u1", "a1", "u2", "after import"]
    );
    let record = h.manager.record(id).await.unwrap();
    assert_eq!(record.message_count, 2);
}

#[tokio::test]
async fn only_visible_user_and_assistant_text_is_imported_and_a_refusal_writes_nothing() {
    let h = harness(SessionManagerConfig::default());
    let id = h.manager.create(spec("d1")).await.unwrap();
    let refused = [
        vec![],
        vec![Message::user("ok"), Message::system("rules")],
        vec![Message::tool_result("call_1", "read_file", "text")],
        vec![Message::user("trigger").hidden()],
        vec![Message::assistant_with_tools(
            "",
            vec![keel_core::ToolCall {
                id: "call_1".into(),
                name: "read_file".into(),
                arguments: serde_json::json!({}),
            }],
        )],
    ];
    for messages in refused {
        let e = h.manager.import_messages(id, messages).await.unwrap_err();
        assert!(matches!(e, EngineError::InvalidInput(_)), "{e}");
    }
    assert!(visible_texts(&h.manager, id).await.is_empty());
    assert!(h.manager.list_checkpoints(id).await.unwrap().is_empty());
}

#[tokio::test]
async fn orphans_have_no_parent_and_children_are_listed() {
    let h = harness(SessionManagerConfig::default());
    let parent = h.manager.create(spec("p")).await.unwrap();
    let c1 = h.manager.create_child(parent, None).await.unwrap();
    let c2 = h
        .manager
        .create_child(parent, Some(keel_core::AgentId::parse("helper").unwrap()))
        .await
        .unwrap();
    let mut kids = h.manager.children(parent).await.unwrap();
    kids.sort();
    let mut expected = vec![c1, c2];
    expected.sort();
    assert_eq!(kids, expected);
    assert_eq!(h.manager.parent(c1).await.unwrap(), Some(parent));
    assert_eq!(
        h.manager
            .get(c2)
            .unwrap()
            .lock()
            .await
            .agent()
            .name
            .as_str(),
        "helper"
    );
    h.manager.destroy(parent).await.unwrap();
    assert_eq!(h.manager.parent(c1).await.unwrap(), None, "orphan");
    assert!(h.manager.get(c1).is_ok(), "children survive their parent");
    assert!(matches!(
        h.manager.session(parent).await,
        Err(EngineError::SessionNotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_creates_and_destroys() {
    let h = harness(SessionManagerConfig::default());
    let mut tasks = Vec::new();
    for i in 0..10 {
        let m = h.manager.clone();
        tasks.push(tokio::spawn(async move {
            let id = m.create(spec(&format!("c{i}"))).await.unwrap();
            if i % 2 == 0 {
                m.destroy(id).await.unwrap();
            }
            id
        }));
    }
    let mut ids = Vec::new();
    for t in tasks {
        ids.push(t.await.unwrap());
    }
    assert_eq!(h.manager.loaded(), 5);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(h.manager.get(*id).is_ok(), i % 2 == 1);
    }
}

#[tokio::test]
async fn switch_agent_keeps_history() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a", "b"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    let helper = keel_core::AgentId::parse("helper").unwrap();
    h.manager.switch_agent(id, &helper).await.unwrap();
    h.manager.submit_turn(id, "2").await.unwrap();
    let last = h.provider.requests().pop().unwrap();
    assert_eq!(last.messages[0].text(), "You are helper.");
    assert_eq!(last.messages.len(), 4, "system + 1 + a + 2");
    assert_eq!(h.manager.record(id).await.unwrap().agent_id, Some(helper));
    assert!(h
        .manager
        .switch_agent(id, &keel_core::AgentId::parse("ghost").unwrap())
        .await
        .is_err());
}

#[tokio::test]
async fn a_switched_agent_answers_with_the_whole_history_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let provider = keel_core::ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    replies(&provider, &["a", "b"]);
    let helper = keel_core::AgentId::parse("helper").unwrap();
    let id = {
        let manager = manager_on(open_store(dir.path()), &provider, Default::default());
        let id = manager.create(spec("d1")).await.unwrap();
        manager.submit_turn(id, "1").await.unwrap();
        manager
            .update_dialog(id, Some("Renamed"), Some(&helper))
            .await
            .unwrap();
        id
    }; // manager and store dropped here
    let manager = manager_on(open_store(dir.path()), &provider, Default::default());
    manager.load(id).await.unwrap();
    let record = manager.record(id).await.unwrap();
    assert_eq!(
        (record.title.as_str(), record.agent_id),
        ("Renamed", Some(helper))
    );
    manager.submit_turn(id, "2").await.unwrap();
    let last = provider.requests().pop().unwrap();
    assert_eq!(last.messages[0].text(), "You are helper.");
    let texts: Vec<String> = last.messages[1..].iter().map(|m| m.text()).collect();
    assert_eq!(texts, ["1", "a", "2"]);
}

#[tokio::test]
async fn a_bad_title_or_agent_changes_nothing_of_the_dialog() {
    let h = harness(SessionManagerConfig::default());
    let id = h.manager.create(spec("d1")).await.unwrap();
    let before = h.manager.record(id).await.unwrap();
    let helper = keel_core::AgentId::parse("helper").unwrap();
    let ghost = keel_core::AgentId::parse("ghost").unwrap();
    let err = h
        .manager
        .update_dialog(id, Some("  "), Some(&helper))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidTitle(_)), "{err:?}");
    let err = h
        .manager
        .update_dialog(id, Some("New"), Some(&ghost))
        .await
        .unwrap_err();
    assert_eq!(err, EngineError::UnknownAgent("ghost".into()));
    let after = h.manager.record(id).await.unwrap();
    assert_eq!(
        (after.title, after.agent_id),
        (before.title, before.agent_id)
    );
}

#[tokio::test]
async fn slots_merge_and_readonly_rules_through_the_manager() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a", "side-a"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let other = h.manager.create(spec("d2")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    h.manager
        .derive_slot(id, "default", "side", SlotMode::Full)
        .await
        .unwrap();
    h.manager.switch_slot(id, "side").await.unwrap();
    h.manager.submit_turn(id, "2").await.unwrap();
    h.manager.switch_slot(id, "default").await.unwrap();
    let err = h
        .manager
        .merge_slot(id, other, "side", "default", MergeStrategy::Append)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "slots can only be merged within one session"
    );
    h.manager
        .merge_slot(id, id, "side", "default", MergeStrategy::Append)
        .await
        .unwrap();
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["1", "a", "2", "side-a"]
    );
    h.manager
        .create_slot(id, "notes", SlotMode::Readonly)
        .await
        .unwrap();
    h.manager.switch_slot(id, "notes").await.unwrap();
    let err = h.manager.submit_turn(id, "x").await.unwrap_err();
    assert!(matches!(err, EngineError::SlotReadonly(s) if s == "notes"));
    assert_eq!(h.provider.remaining(), 0);
}

#[tokio::test(start_paused = true)]
async fn cancellation_mid_stream_commits_nothing_and_the_session_stays_usable() {
    let h = harness(SessionManagerConfig::default());
    let mut slow = ScriptedResponse::text("never finished answer");
    slow.chunk_delay_ms = 60_000;
    h.provider.push([slow, ScriptedResponse::text("fine")]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let mut feed = h.manager.events().subscribe(id).await.unwrap();
    let ticket = h.manager.send(id, Message::user("q")).await.unwrap();
    turn_event(&mut feed, |e| {
        matches!(
            e,
            TurnEvent::Stream(keel_core::StreamEvent::TextDelta { .. })
        )
    })
    .await;
    let report = h.manager.stop(id).await.unwrap();
    assert_eq!(report.turn, Some(ticket.turn_id()));
    let err = ticket.outcome().await.unwrap_err();
    assert!(err.is_cancelled(), "{err}");
    assert!(h.manager.list_checkpoints(id).await.unwrap().is_empty());
    // Nothing of the answer; the question stays, unanswered.
    assert_eq!(visible_texts(&h.manager, id).await, ["q"]);
    assert_eq!(unanswered(&h.manager, id).await, ["q"]);
    h.manager.submit_turn(id, "again").await.unwrap();
    assert_eq!(visible_texts(&h.manager, id).await, ["q", "again", "fine"]);
}

#[tokio::test(start_paused = true)]
async fn stopping_a_turn_before_its_answer_leaves_no_half_checkpoint() {
    let h = harness(SessionManagerConfig::default());
    h.provider.push([
        ScriptedResponse::text("streamed").delayed(60_000),
        ScriptedResponse::text("ok"),
    ]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let ticket = h.manager.send(id, Message::user("q")).await.unwrap();
    // Single-threaded runtime: the turn task runs only when we yield.
    while h.provider.requests().is_empty() {
        tokio::task::yield_now().await;
    }
    h.manager.stop(id).await.unwrap();
    assert!(ticket.outcome().await.unwrap_err().is_cancelled());
    assert!(h.manager.list_checkpoints(id).await.unwrap().is_empty());
    h.manager.submit_turn(id, "q2").await.unwrap();
    assert_eq!(visible_texts(&h.manager, id).await, ["q", "q2", "ok"]);
    // The only checkpoint is the second turn's, after its whole turn.
    let cps = h.manager.list_checkpoints(id).await.unwrap();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].seq, 3);
}

#[tokio::test]
async fn max_iterations_fails_the_turn_without_committing() {
    let h = harness(SessionManagerConfig::default());
    h.provider
        .push((0..8).map(|_| ScriptedResponse::tool_call("nope", serde_json::json!({}))));
    let id = h.manager.create(spec("d1")).await.unwrap();
    let err = h.manager.submit_turn(id, "loop").await.unwrap_err();
    assert!(matches!(err, EngineError::MaxIterations { limit: 8 }));
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["loop"],
        "no tool call or result"
    );
    assert_eq!(unanswered(&h.manager, id).await, ["loop"]);
}

#[tokio::test(start_paused = true)]
async fn idle_sessions_are_evicted_and_reloaded_transparently() {
    let h = harness(SessionManagerConfig {
        idle_ttl: Duration::from_secs(60),
        ..Default::default()
    });
    replies(&h.provider, &["a", "b"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    assert_eq!(h.manager.evict_idle(), 0, "not idle yet");
    let held = h.manager.get(id).unwrap();
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(
        h.manager.evict_idle(),
        0,
        "a session someone holds is never evicted"
    );
    drop(held);
    let evictor = h.manager.spawn_evictor(Duration::from_secs(30));
    tokio::time::advance(Duration::from_secs(31)).await;
    // Let the evictor task run its tick.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(h.manager.loaded(), 0);
    assert!(h.manager.get(id).is_err());
    h.manager.submit_turn(id, "2").await.unwrap();
    assert_eq!(visible_texts(&h.manager, id).await, ["1", "a", "2", "b"]);
    evictor.abort();
}

#[tokio::test]
async fn title_is_generated_once_after_n_visible_user_messages() {
    let h = harness(SessionManagerConfig {
        auto_title_after: 3,
        ..Default::default()
    });
    let id = h.manager.create(spec("d1")).await.unwrap();
    replies(
        &h.provider,
        &[
            "r1",
            "r2",
            "r3",
            "\"Planning the keel launch\"\n",
            "r4",
            "r5",
        ],
    );
    for i in 1..=5 {
        h.manager
            .submit_turn(id, &format!("message {i}"))
            .await
            .unwrap();
        h.manager.housekeeping_settled(id).await;
        let title = h.manager.record(id).await.unwrap().title;
        if i < 3 {
            assert_eq!(title, "Dialog d1");
        } else {
            assert_eq!(title, "Planning the keel launch");
        }
    }
    let title_requests = h
        .provider
        .requests()
        .iter()
        .filter(|r| {
            r.messages[0]
                .text()
                .starts_with("Given the conversation history")
        })
        .count();
    assert_eq!(title_requests, 1);
    assert_eq!(h.manager.record(id).await.unwrap().message_count, 5);
}

#[tokio::test]
async fn a_failing_title_is_not_fatal_and_renamed_dialogs_keep_their_title() {
    let h = harness(SessionManagerConfig {
        auto_title_after: 1,
        ..Default::default()
    });
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.provider.push([
        ScriptedResponse::text("r1"),
        ScriptedResponse::error(keel_core::ScriptedErrorKind::Server, "down"),
    ]);
    h.manager.submit_turn(id, "hello").await.unwrap();
    h.manager.housekeeping_settled(id).await;
    assert_eq!(h.manager.record(id).await.unwrap().title, "Dialog d1");
    h.manager.rename_dialog(id, "  Mine  ").await.unwrap();
    replies(&h.provider, &["r2"]);
    h.manager.submit_turn(id, "again").await.unwrap();
    h.manager.housekeeping_settled(id).await;
    assert_eq!(h.manager.record(id).await.unwrap().title, "Mine");
    assert_eq!(h.provider.remaining(), 0, "no title request after a rename");
}

#[tokio::test]
async fn dialogs_list_recent_first_and_soft_delete() {
    let h = harness(SessionManagerConfig::default());
    let a = h.manager.open_dialog(&address("a"), None).await.unwrap();
    assert_eq!(
        h.manager.open_dialog(&address("a"), None).await.unwrap(),
        a,
        "idempotent"
    );
    let b = h
        .manager
        .create_dialog("test", "chat", Some("Second".into()), None)
        .await
        .unwrap();
    let page = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    let titles: Vec<_> = page.items.iter().map(|r| r.title.as_str()).collect();
    assert_eq!(titles, ["Second", "Dialog a"]);
    h.manager.delete_dialog(b).await.unwrap();
    let page = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    assert_eq!(page.items.len(), 1);
    assert!(h.manager.session(b).await.is_err());
    assert!(matches!(
        h.manager.rename_dialog(a, "  ").await,
        Err(EngineError::InvalidTitle(_))
    ));
}

/// A title a person or client gives with a bidi control, a zero-width or
/// another format character is refused with the typed error on every path;
/// one the model generates has them dropped instead.
#[tokio::test]
async fn format_characters_are_refused_in_given_titles_and_dropped_from_generated_ones() {
    let h = harness(SessionManagerConfig {
        auto_title_after: 1,
        ..Default::default()
    });
    let id = h.manager.create(spec("d1")).await.unwrap();
    let spoofing = [
        "invoice_\u{202e}fdp.exe",
        "a\u{2066}b",
        "a\u{061c}b",
        "zero\u{200b}width",
        "joined\u{200d}",
        "bom\u{feff}",
    ];
    for title in spoofing {
        let refused = h.manager.rename_dialog(id, title).await.unwrap_err();
        assert!(
            matches!(refused, EngineError::InvalidTitle(_)),
            "{title:?}: {refused}"
        );
        let refused = h
            .manager
            .create_dialog("test", "chat", Some(title.into()), None)
            .await
            .unwrap_err();
        assert!(
            matches!(refused, EngineError::InvalidTitle(_)),
            "{title:?}: {refused}"
        );
    }
    let e = h.manager.rename_dialog(id, "x\u{202e}").await.unwrap_err();
    insta::assert_snapshot!(e.to_string(), @"a title cannot contain control or format characters (bidi controls, zero-width characters …)");
    assert_eq!(h.manager.record(id).await.unwrap().title, "Dialog d1");
    replies(&h.provider, &["r1", "\u{202e}Launch\u{200b} plan\u{2069}"]);
    h.manager.submit_turn(id, "hello").await.unwrap();
    h.manager.housekeeping_settled(id).await;
    assert_eq!(h.manager.record(id).await.unwrap().title, "Launch plan");
}

/// The answer cannot be saved (another process holds the write lock while
/// the model answers): a notice, a typed error, nothing of the answer in
/// memory or on disk — and the question, committed before the model was
/// called, stays (unanswered) for the next turn.
#[tokio::test(start_paused = true)]
async fn a_storage_failure_is_a_notice_and_a_typed_error_and_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let options = keel_store::StoreOptions {
        busy_timeout: Duration::from_millis(5),
        retry_delays: vec![Duration::from_millis(1); 3],
        ..Default::default()
    };
    let store = keel_store::Store::open(dir.path().join("keel.db"), options).unwrap();
    let provider = keel_core::ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    let mut slow = ScriptedResponse::text("lost words");
    slow.chunk_delay_ms = 60_000;
    provider.push([slow, ScriptedResponse::text("kept")]);
    let manager = manager_on(store, &provider, SessionManagerConfig::default());
    let id = manager.create(spec("d1")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let ticket = manager.send(id, Message::user("q")).await.unwrap();
    // The question is committed; the answer is streaming. Now another
    // process takes the write lock until after the turn.
    turn_event(&mut feed, |e| {
        matches!(
            e,
            TurnEvent::Stream(keel_core::StreamEvent::TextDelta { .. })
        )
    })
    .await;
    let blocker = rusqlite::Connection::open(dir.path().join("keel.db")).unwrap();
    blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let err = ticket.outcome().await.unwrap_err();
    assert!(matches!(err, EngineError::Store(_)), "{err}");
    let mut notices = Vec::new();
    let mut failure = None;
    while let Some(e) = feed.try_recv().unwrap() {
        match e.as_ref() {
            keel_engine::SessionEvent::Turn {
                event: TurnEvent::SystemNotice { text },
                ..
            } => notices.push(text.clone()),
            keel_engine::SessionEvent::TurnFailed {
                message,
                input_kept,
                ..
            } => failure = Some((message.clone(), *input_kept)),
            _ => {}
        }
    }
    // The client reads an error id, never SQLite's words.
    let (failure, input_kept) = failure.unwrap();
    assert!(failure.starts_with("internal error (id "), "{failure}");
    assert!(input_kept);
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].starts_with("This turn's answer could not be saved"));
    blocker.execute_batch("ROLLBACK").unwrap();
    assert_eq!(
        visible_texts(&manager, id).await,
        ["q"],
        "nothing of the answer half-applied in memory"
    );
    assert_eq!(unanswered(&manager, id).await, ["q"]);
    manager.submit_turn(id, "q2").await.unwrap();
    assert_eq!(visible_texts(&manager, id).await, ["q", "q2", "kept"]);
    // On disk too: marking it unanswered failed under the lock, and the
    // next turn's input commit closed it.
    let states: Vec<_> = manager
        .store()
        .load_messages(id, Default::default())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.input_state)
        .collect();
    use keel_store::InputState::{Answered, Unanswered};
    assert_eq!(states, [Some(Unanswered), Some(Answered), None]);
}

/// The user's words are durable and visible as soon as the turn starts,
/// marked open while the model works, answered with the turn's commit.
#[tokio::test]
async fn the_input_commits_before_the_model_is_called() {
    let dir = tempfile::tempdir().unwrap();
    let provider = HeldProvider::new(keel_core::ScriptedProvider::new([ScriptedResponse::text(
        "late answer",
    )]));
    let manager = manager_with(
        open_store(dir.path()),
        provider.clone(),
        SessionManagerConfig::default(),
    );
    let id = manager.create(spec("d1")).await.unwrap();
    let ticket = manager
        .send(id, Message::user("remember me"))
        .await
        .unwrap();
    provider.wait_started().await;
    let stored = manager
        .store()
        .load_messages(id, Default::default())
        .await
        .unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].message.text(), "remember me");
    assert_eq!(stored[0].input_state, Some(keel_store::InputState::Open));
    let record = manager.store().get_session(id).await.unwrap().unwrap();
    assert_eq!(record.message_count, 1);
    assert!(manager.list_checkpoints(id).await.unwrap().is_empty());
    provider.release.add_permits(1);
    ticket.outcome().await.unwrap();
    let stored = manager
        .store()
        .load_messages(id, Default::default())
        .await
        .unwrap();
    let states: Vec<_> = stored.iter().map(|m| m.input_state).collect();
    assert_eq!(states, [Some(keel_store::InputState::Answered), None]);
    let cps = manager.list_checkpoints(id).await.unwrap();
    assert_eq!((cps.len(), cps[0].seq), (1, 2));
}

/// A failed turn's question stays in the history; the next turn replays it
/// (the model sees both questions), and it stays marked unanswered after a
/// reload from disk.
#[tokio::test]
async fn the_next_turn_sees_an_unanswered_input() {
    let h = harness(SessionManagerConfig::default());
    h.provider.push([
        ScriptedResponse::error(keel_core::ScriptedErrorKind::Auth, "bad key"),
        ScriptedResponse::text("both answered"),
    ]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "first").await.unwrap_err();
    h.manager.submit_turn(id, "second").await.unwrap();
    let seen: Vec<String> = h.provider.requests()[1]
        .messages
        .iter()
        .map(|m| m.text())
        .collect();
    assert_eq!(seen, ["You are root.", "first", "second"]);
    assert_eq!(unanswered(&h.manager, id).await, ["first"]);
    // A fresh manager reads the marker from disk.
    let fresh = manager_on(
        open_store(h.dir.path()),
        &h.provider,
        SessionManagerConfig::default(),
    );
    assert_eq!(unanswered(&fresh, id).await, ["first"]);
    assert_eq!(
        visible_texts(&fresh, id).await,
        ["first", "second", "both answered"]
    );
}

#[tokio::test]
async fn a_dropped_provider_stream_is_a_typed_error_and_no_partial_assistant_message() {
    let h = harness(SessionManagerConfig::default());
    let mut cut = ScriptedResponse::text("half of an answer");
    cut.error = Some(keel_core::scripted::ScriptedError {
        kind: keel_core::ScriptedErrorKind::StreamInterrupted,
        message: "connection reset".into(),
        status: None,
        retry_after_ms: None,
    });
    h.provider
        .push([cut, ScriptedResponse::text("whole answer")]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let err = h.manager.submit_turn(id, "q").await.unwrap_err();
    assert!(
        matches!(&err, EngineError::Provider(keel_core::ProviderError::StreamInterrupted(m)) if m == "connection reset"),
        "{err}"
    );
    assert_eq!(visible_texts(&h.manager, id).await, ["q"]);
    h.manager.submit_turn(id, "q").await.unwrap();
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["q", "q", "whole answer"]
    );
}

#[tokio::test]
async fn cancellation_during_a_tool_batch_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let provider = keel_core::ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    provider.push([
        ScriptedResponse::tool_call("sleep", serde_json::json!({"ms": 3_600_000})),
        ScriptedResponse::text("after"),
    ]);
    let tools =
        keel_engine::builtin_registry(&keel_engine::BuiltinToolsConfig::new(dir.path())).unwrap();
    let bundle = keel_engine::RuntimeBundle::new(profile("root", &provider, tools));
    let manager = keel_engine::SessionManager::new(
        open_store(dir.path()),
        bundle,
        SessionManagerConfig::default(),
    );
    let id = manager.create(spec("d1")).await.unwrap();
    let mut feed = manager.events().subscribe(id).await.unwrap();
    let ticket = manager.send(id, Message::user("wait")).await.unwrap();
    turn_event(&mut feed, |e| matches!(e, TurnEvent::ToolStarted { .. })).await;
    manager.stop(id).await.unwrap();
    assert!(ticket.outcome().await.unwrap_err().is_cancelled());
    assert_eq!(visible_texts(&manager, id).await, ["wait"]);
    assert!(manager.list_checkpoints(id).await.unwrap().is_empty());
    manager.submit_turn(id, "again").await.unwrap();
    assert_eq!(
        visible_texts(&manager, id).await,
        ["wait", "again", "after"]
    );
}

#[tokio::test]
async fn prune_keeps_the_latest_and_what_the_head_needs() {
    let h = harness(SessionManagerConfig::default());
    let id = h.manager.create(spec("d1")).await.unwrap();
    replies(&h.provider, &["a", "b", "c", "d"]);
    for t in ["1", "2", "3", "4"] {
        h.manager.submit_turn(id, t).await.unwrap();
    }
    let report = h
        .manager
        .prune_checkpoints(
            id,
            keel_store::PrunePolicy {
                keep_latest: Some(2),
                older_than_ms: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(report.checkpoints_deleted, 2);
    let left: Vec<u64> = h
        .manager
        .list_checkpoints(id)
        .await
        .unwrap()
        .iter()
        .map(|c| c.turn_index)
        .collect();
    assert_eq!(left, [4, 3]);
    // The head's history is intact after pruning, and after a restart.
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["1", "a", "2", "b", "3", "c", "4", "d"]
    );
    let fresh = manager_on(
        open_store(h.dir.path()),
        &h.provider,
        SessionManagerConfig::default(),
    );
    assert_eq!(visible_texts(&fresh, id).await.len(), 8);
    h.manager.delete_checkpoints(id).await.unwrap();
    assert!(h.manager.latest_checkpoint(id).await.unwrap().is_none());
}

/// Retention keeping `n` turn checkpoints, purging no deleted dialog.
fn keep(n: usize) -> keel_engine::RetentionPolicy {
    keel_engine::RetentionPolicy {
        keep_checkpoints: Some(n),
        purge_deleted_after: None,
    }
}

fn now_ms() -> i64 {
    keel_core::time::now_ms()
}

/// Every message each checkpoint of `ids` restores, by checkpoint.
async fn restored(
    store: &keel_store::Store,
    ids: &[keel_core::SessionId],
) -> std::collections::BTreeMap<keel_core::CheckpointId, Vec<String>> {
    let mut out = std::collections::BTreeMap::new();
    for id in ids {
        for cp in store.list_checkpoints(*id).await.unwrap() {
            let messages = store
                .load_messages_at_checkpoint(cp.id, keel_store::MessageFilter::default())
                .await
                .unwrap();
            out.insert(cp.id, messages.iter().map(|m| m.message.text()).collect());
        }
    }
    out
}

#[tokio::test]
async fn retention_keeps_the_newest_turn_checkpoints_and_every_point_a_user_made() {
    let h = harness(SessionManagerConfig::default());
    let id = h.manager.create(spec("d1")).await.unwrap();
    replies(&h.provider, &["a", "b", "c", "d", "e"]);
    for t in ["1", "2", "3", "4"] {
        h.manager.submit_turn(id, t).await.unwrap();
    }
    let turns: Vec<_> = h.manager.list_checkpoints(id).await.unwrap();
    let (t2, t1) = (turns[2].id, turns[3].id);
    h.manager.rollback(id, t2).await.unwrap();
    h.manager.submit_turn(id, "5").await.unwrap();
    h.manager.create_checkpoint(id).await.unwrap();
    let fork = h.manager.fork(t1, None).await.unwrap();
    let store = open_store(h.dir.path());
    let before = restored(&store, &[id, fork]).await;

    let report = keel_engine::apply_retention(&store, keep(1), now_ms())
        .await
        .unwrap();
    assert_eq!(
        report.sessions, 1,
        "only d1 has more than one turn checkpoint"
    );
    assert_eq!(
        report.removed.checkpoints_deleted, 2,
        "turns 3 and 4, on the abandoned branch"
    );
    assert_eq!(report.removed.messages_deleted, 4);
    let left: Vec<(CheckpointSource, u64)> = store
        .list_checkpoints(id)
        .await
        .unwrap()
        .iter()
        .map(|c| (c.source, c.turn_index))
        .collect();
    assert_eq!(
        left,
        [
            (CheckpointSource::Manual, 3),
            (CheckpointSource::Turn, 3),
            (CheckpointSource::Rollback, 2),
            (CheckpointSource::Turn, 2),
            (CheckpointSource::Turn, 1),
        ],
        "the newest turn, the manual one, the rollback and its target, the fork's source"
    );
    // Every checkpoint still listed restores exactly what it did before.
    let after = restored(&store, &[id, fork]).await;
    assert_eq!(after.len(), before.len() - 2);
    for (cp, messages) in &after {
        assert_eq!(Some(messages), before.get(cp), "checkpoint {cp}");
    }
    assert_eq!(
        visible_texts(&h.manager, id).await,
        ["1", "a", "2", "b", "5", "e"]
    );
    // Nothing more to remove: a second pass is a no-op.
    let again = keel_engine::apply_retention(&store, keep(1), now_ms())
        .await
        .unwrap();
    assert_eq!(again.removed, keel_store::PruneReport::default());
}

#[tokio::test(start_paused = true)]
async fn the_retention_task_prunes_on_its_interval_and_ends_with_the_manager() {
    let Harness {
        dir,
        provider,
        manager,
    } = harness(SessionManagerConfig::default());
    let id = manager.create(spec("d1")).await.unwrap();
    replies(&provider, &["a", "b", "c"]);
    for t in ["1", "2", "3"] {
        manager.submit_turn(id, t).await.unwrap();
    }
    let interval = Duration::from_secs(3600);
    let task = manager.spawn_retention(interval, keep(1));
    tokio::time::sleep(interval).await;
    // The pass runs on the store's threads; wait for its result, bounded.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while manager.list_checkpoints(id).await.unwrap().len() > 1 {
        assert!(std::time::Instant::now() < deadline, "no retention pass");
        tokio::task::yield_now().await;
    }
    drop(manager);
    task.await.unwrap();
    let store = open_store(dir.path());
    assert_eq!(store.list_checkpoints(id).await.unwrap().len(), 1);
}

#[tokio::test]
async fn retention_purges_dialogs_deleted_longer_ago_than_its_limit() {
    let h = harness(SessionManagerConfig::default());
    let gone = h.manager.create(spec("gone")).await.unwrap();
    let kept = h.manager.create(spec("kept")).await.unwrap();
    replies(&h.provider, &["a", "b", "c"]);
    h.manager.submit_turn(gone, "1").await.unwrap();
    h.manager.submit_turn(gone, "2").await.unwrap();
    h.manager.submit_turn(kept, "3").await.unwrap();
    h.manager.delete_dialog(gone).await.unwrap();
    let store = open_store(h.dir.path());
    let day = Duration::from_secs(86_400);
    let policy = keel_engine::RetentionPolicy {
        keep_checkpoints: None,
        purge_deleted_after: Some(30 * day),
    };
    // Deleted just now: not yet.
    let early = keel_engine::apply_retention(&store, policy, now_ms())
        .await
        .unwrap();
    assert_eq!(early.purged, keel_store::PurgeReport::default());
    assert!(store.get_session(gone).await.unwrap().is_some());

    let later = now_ms() + i64::try_from((31 * day).as_millis()).unwrap();
    let report = keel_engine::apply_retention(&store, policy, later)
        .await
        .unwrap();
    assert_eq!(report.purged.dialogs, 1);
    assert_eq!(report.purged.messages, 4);
    assert_eq!(report.purged.checkpoints, 2);
    assert!(report.purged.blobs >= 1, "{report:?}");
    assert!(store.get_session(gone).await.unwrap().is_none());
    assert_eq!(visible_texts(&h.manager, kept).await, ["3", "c"]);
    let check = store
        .check_invariants(keel_store::CheckOptions::default())
        .await
        .unwrap();
    assert!(check.is_clean(), "{check:#?}");
    let again = keel_engine::apply_retention(&store, policy, later)
        .await
        .unwrap();
    assert_eq!(again.purged, keel_store::PurgeReport::default());
}

#[tokio::test]
async fn a_turns_model_and_tool_calls_are_stored_with_its_commit() {
    let h = harness(SessionManagerConfig::default());
    let mut call = ScriptedResponse::tool_call("<b>nope</b>", serde_json::json!({}));
    call.usage = Some(keel_core::Usage::new(11, 2));
    let mut answer = ScriptedResponse::text("done");
    answer.usage = Some(keel_core::Usage::new(20, 3));
    h.provider.push([call, answer]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    let ticket = h.manager.send(id, Message::user("q")).await.unwrap();
    let turn = ticket.turn_id();
    ticket.outcome().await.unwrap();
    let calls = h.manager.store().turn_calls(Some(id), turn).await.unwrap();
    let rows: Vec<_> = calls
        .iter()
        .map(|c| {
            (
                c.kind,
                c.name.as_str(),
                c.call_id.is_some(),
                c.input_tokens,
                c.output_tokens,
                c.status.as_str(),
            )
        })
        .collect();
    use keel_store::CallKind::{Model, Tool};
    let model = keel_core::Provider::model(&h.provider).to_owned();
    assert_eq!(
        rows,
        [
            (Model, model.as_str(), false, Some(11), Some(2), "tool_call"),
            (Tool, "<b>nope</b>", true, None, None, "error"),
            (Model, model.as_str(), false, Some(20), Some(3), "stop"),
        ]
    );
    assert!(calls
        .windows(2)
        .all(|w| w[0].started_at_ms <= w[1].started_at_ms));
    assert!(calls.iter().all(|c| c.ended_at_ms >= c.started_at_ms));
}
