//! What a dialog export holds beyond its history: runs, checkpoints, branches.

use keel_core::{AgentId, Delivery, ExecutionMode, RunId, RunStatus, SessionId, Usage};
use keel_engine::SessionManagerConfig;
use keel_store::{AcceptRun, CompletionHandling, NewRun, Store, TerminalOutcome};

use crate::common::*;

fn run(root: SessionId, parent: Option<RunId>, task: &str) -> NewRun {
    let id = RunId::new();
    NewRun {
        id,
        root_session_id: root,
        root_turn_id: None,
        parent_run_id: parent,
        caller_agent_id: AgentId::parse(if parent.is_some() { "helper" } else { "root" }).unwrap(),
        caller_scope_id: parent.map_or_else(|| "root-turn".into(), |p| p.to_string()),
        idempotency_key: None,
        agent_id: AgentId::parse("helper").unwrap(),
        definition_hash: "d".repeat(64),
        provider_profile: "default".into(),
        provider_name: "scripted".into(),
        model_id: "scripted-1".into(),
        mode: ExecutionMode::Foreground,
        depth: if parent.is_some() { 2 } else { 1 },
        plan_item_id: None,
        execution_id: format!("exec-{id}"),
        task: task.into(),
        context_json: None,
        budget_json: "{}".into(),
        signal_contract_json: None,
        signal_delivery: None,
        completion_delivery: Some(Delivery::Queue),
        failure_delivery: Some(Delivery::Queue),
        runtime_generation: 1,
        deadline_at_ms: 10_000_000,
    }
}

async fn accept(store: &Store, run: NewRun, now_ms: i64) -> RunId {
    let id = run.id;
    store
        .accept_run(AcceptRun {
            run,
            inbox_capacity: 16,
            now_ms,
        })
        .await
        .unwrap();
    id
}

async fn complete(store: &Store, id: RunId, result: &str, now_ms: i64) {
    let commit = store
        .commit_terminal(
            id,
            format!("exec-{id}"),
            TerminalOutcome::Completed {
                result: result.into(),
                usage: Usage::new(12, 3),
                tool_calls: 1,
                iterations: 2,
                cost: None,
            },
            CompletionHandling::Quiet,
            now_ms,
        )
        .await
        .unwrap();
    assert!(commit.won);
}

/// A run of `root` that completed with a child that completed too.
pub(crate) async fn ended_runs(store: &Store, root: SessionId) -> (RunId, RunId) {
    let parent = accept(store, run(root, None, "find the plan"), 1_000).await;
    let child = accept(store, run(root, Some(parent), "read the notes"), 1_100).await;
    complete(store, child, "the notes say yes", 1_200).await;
    complete(store, parent, "the plan is yes", 1_300).await;
    (parent, child)
}

#[tokio::test]
async fn runs_are_exported_whole_and_imported_as_ended_runs_with_new_ids() {
    let h = harness(SessionManagerConfig::default());
    let id = h.manager.create(spec("d1")).await.unwrap();
    let store = h.manager.store();
    let (parent, child) = ended_runs(store, id).await;
    let unfinished = accept(store, run(id, None, "still going"), 1_400).await;
    let export = h.manager.export_dialog(id).await.unwrap();
    let tasks: Vec<_> = export.runs.iter().map(|r| r.task.as_str()).collect();
    assert_eq!(tasks, ["find the plan", "still going", "read the notes"]);
    let exported_child = &export.runs[2];
    assert_eq!(exported_child.id, child.to_string());
    assert_eq!(exported_child.parent_run_id, Some(parent.to_string()));
    assert_eq!(exported_child.status, RunStatus::Completed);
    assert_eq!(exported_child.result.as_deref(), Some("the notes say yes"));
    assert_eq!(exported_child.usage, Some(Usage::new(12, 3)));
    assert_eq!(export.runs[1].status, RunStatus::Queued);

    let copy = h.manager.import_dialog(export).await.unwrap();
    let runs = store.session_runs(copy).await.unwrap();
    assert_eq!(runs.len(), 3);
    let by_task = |t: &str| runs.iter().find(|r| r.spec.task == t).unwrap();
    let (p, c, u) = (
        by_task("find the plan"),
        by_task("read the notes"),
        by_task("still going"),
    );
    for r in [p, c, u] {
        assert_eq!(r.spec.root_session_id, copy);
        assert!(![parent, child, unfinished].contains(&r.spec.id));
        assert!(r.status.is_terminal(), "{:?}", r.status);
        assert!(!r.completion_slot_reserved);
    }
    assert_eq!(c.spec.parent_run_id, Some(p.spec.id));
    assert_eq!(c.spec.caller_scope_id, p.spec.id.to_string());
    assert_eq!(c.result.as_deref(), Some("the notes say yes"));
    assert_eq!((c.tool_calls_count, c.iterations), (1, 2));
    assert_eq!(u.status, RunStatus::Interrupted);
    assert_eq!(
        u.error.as_deref(),
        Some("the run had not ended when its dialog was exported")
    );
    // The original's runs are untouched.
    assert_eq!(store.session_runs(id).await.unwrap().len(), 3);
}

#[tokio::test]
async fn an_import_whose_run_names_a_missing_parent_writes_nothing() {
    let h = harness(SessionManagerConfig::default());
    let id = h.manager.create(spec("d1")).await.unwrap();
    ended_runs(h.manager.store(), id).await;
    let mut export = h.manager.export_dialog(id).await.unwrap();
    export.runs.remove(0);
    let before = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    let err = h.manager.import_dialog(export).await.unwrap_err();
    assert!(err.to_string().contains("does not hold"), "{err}");
    let after = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    assert_eq!(after.items.len(), before.items.len());
}

/// `export` with every id replaced by its kind and position (`run-1`,
/// `timeline-2`, `checkpoint-3`, …) and references following them, so two
/// exports compare equal modulo ids.
pub(crate) fn normalized(mut export: keel_engine::DialogExport) -> keel_engine::DialogExport {
    use std::collections::HashMap;
    export.dialog.id = Some("dialog".into());
    export.dialog.dialog_id = Some("dialog-id".into());
    let mut names: HashMap<String, String> = HashMap::new();
    for (i, r) in export.runs.iter().enumerate() {
        names.insert(r.id.clone(), format!("run-{}", i + 1));
    }
    for (i, t) in export.timelines.iter().enumerate() {
        names.insert(t.id.clone(), format!("timeline-{}", i + 1));
    }
    for (i, c) in export.checkpoints.iter().enumerate() {
        names.insert(c.id.clone(), format!("checkpoint-{}", i + 1));
    }
    let name = |id: &str| names.get(id).cloned().unwrap_or_else(|| id.to_owned());
    for r in &mut export.runs {
        r.id = name(&r.id);
        r.parent_run_id = r.parent_run_id.as_deref().map(name);
        r.caller_scope = name(&r.caller_scope);
    }
    for t in &mut export.timelines {
        t.id = name(&t.id);
        t.parent = t.parent.as_deref().map(name);
    }
    export.head_timeline = export.head_timeline.as_deref().map(name);
    for c in &mut export.checkpoints {
        c.id = name(&c.id);
        c.parent_id = c.parent_id.as_deref().map(name);
        c.timeline = name(&c.timeline);
    }
    export
}

/// A dialog with a rollback: turns 1–3, back to after turn 1, then turn 4
/// on the new branch, and runs; returns it.
async fn dialog_with_a_rollback(h: &Harness) -> SessionId {
    replies(&h.provider, &["a", "b", "c", "d"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    let at = h.manager.latest_checkpoint(id).await.unwrap().unwrap();
    h.manager.submit_turn(id, "2").await.unwrap();
    h.manager.submit_turn(id, "3").await.unwrap();
    h.manager.rollback(id, at.id).await.unwrap();
    h.manager.submit_turn(id, "4").await.unwrap();
    ended_runs(h.manager.store(), id).await;
    id
}

async fn texts_at(store: &Store, cp: keel_core::CheckpointId) -> Vec<String> {
    store
        .load_messages_at_checkpoint(cp, keel_store::MessageFilter::default())
        .await
        .unwrap()
        .iter()
        .map(|m| m.message.text())
        .collect()
}

#[tokio::test]
async fn an_imported_dialog_lists_the_same_checkpoints_and_restores_each_to_the_same_history() {
    let h = harness(SessionManagerConfig::default());
    let id = dialog_with_a_rollback(&h).await;
    let export = h.manager.export_dialog(id).await.unwrap();
    assert_eq!(
        export.timelines.len(),
        2,
        "the branch left behind is exported"
    );
    let copy = h.manager.import_dialog(export).await.unwrap();
    let store = h.manager.store();
    let (old, new) = (
        h.manager.list_checkpoints(id).await.unwrap(),
        h.manager.list_checkpoints(copy).await.unwrap(),
    );
    assert_eq!(old.len(), 5, "{old:?}");
    assert_eq!(new.len(), old.len());
    for (o, n) in old.iter().zip(&new) {
        assert_ne!(o.id, n.id);
        assert_eq!(
            (o.source, o.turn_index, o.seq),
            (n.source, n.turn_index, n.seq)
        );
        assert_eq!(texts_at(store, n.id).await, texts_at(store, o.id).await);
    }
    assert_eq!(visible_texts(&h.manager, copy).await, ["1", "a", "4", "d"]);
    // Restoring the tip of the abandoned branch gives both the same history
    // and state.
    let tip = |cps: &[keel_store::CheckpointRecord]| {
        cps.iter()
            .find(|c| c.turn_index == 3)
            .map(|c| c.id)
            .unwrap()
    };
    h.manager.rollback(id, tip(&old)).await.unwrap();
    h.manager.rollback(copy, tip(&new)).await.unwrap();
    let expected = ["1", "a", "2", "b", "3", "c"];
    assert_eq!(visible_texts(&h.manager, id).await, expected);
    assert_eq!(visible_texts(&h.manager, copy).await, expected);
    let (a, b) = (h.manager.get(id).unwrap(), h.manager.get(copy).unwrap());
    assert_eq!(a.lock().await.state(), b.lock().await.state());
    assert_eq!(h.manager.record(copy).await.unwrap().message_count, 3);
    // The database the import wrote keeps every invariant the checker knows.
    let report = store
        .check_invariants(keel_store::CheckOptions::default())
        .await
        .unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
}

#[tokio::test]
async fn an_export_of_a_dialog_with_a_rollback_and_runs_is_stable() {
    let h = harness(SessionManagerConfig::default());
    let id = dialog_with_a_rollback(&h).await;
    let export = crate::exports::normalized(h.manager.export_dialog(id).await.unwrap());
    let json: serde_json::Value = serde_json::from_str(&export.to_json().unwrap()).unwrap();
    insta::assert_json_snapshot!(json, {
        ".checkpoints[].created_at_ms" => "[time]",
        ".state.memory.*.created_at_ms" => "[time]",
    });
}

#[tokio::test]
async fn a_tree_that_does_not_hold_together_is_refused_and_writes_nothing() {
    let h = harness(SessionManagerConfig::default());
    let id = dialog_with_a_rollback(&h).await;
    let export = normalized(h.manager.export_dialog(id).await.unwrap());
    let mut gap = export.clone();
    gap.timelines[0].messages.remove(1);
    let mut orphan = export.clone();
    orphan.timelines[1].parent = Some("nowhere".into());
    let mut no_head = export.clone();
    no_head.head_timeline = Some("nowhere".into());
    let mut bad_checkpoint = export.clone();
    bad_checkpoint.checkpoints[1].parent_id = Some("later".into());
    let mut past_the_end = export.clone();
    past_the_end.checkpoints[4].seq = 40;
    let before = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    let mut errors = Vec::new();
    for e in [gap, orphan, no_head, bad_checkpoint, past_the_end] {
        errors.push(h.manager.import_dialog(e).await.unwrap_err().to_string());
    }
    let after = h
        .manager
        .list_dialogs("test", "chat", 10, None)
        .await
        .unwrap();
    assert_eq!(after.items.len(), before.items.len());
    insta::assert_debug_snapshot!(errors);
}

#[tokio::test]
async fn a_fork_exports_the_history_it_inherited_and_imports_standing_alone() {
    let h = harness(SessionManagerConfig::default());
    replies(&h.provider, &["a", "b", "c"]);
    let id = h.manager.create(spec("d1")).await.unwrap();
    h.manager.submit_turn(id, "1").await.unwrap();
    let at = h.manager.latest_checkpoint(id).await.unwrap().unwrap();
    h.manager.submit_turn(id, "2").await.unwrap();
    let fork = h.manager.fork(at.id, None).await.unwrap();
    h.manager.submit_turn(fork, "3").await.unwrap();
    let export = h.manager.export_dialog(fork).await.unwrap();
    assert_eq!(export.timelines.len(), 1);
    assert_eq!(export.timelines[0].parent, None);
    let seqs: Vec<i64> = export.timelines[0].messages.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4], "the inherited history is in the file");
    // The fork point's parent is in the source dialog, not in the file.
    assert_eq!(export.checkpoints[0].source, "fork");
    assert_eq!(export.checkpoints[0].parent_id, None);
    let copy = h.manager.import_dialog(export).await.unwrap();
    assert_eq!(visible_texts(&h.manager, copy).await, ["1", "a", "3", "c"]);
    let store = h.manager.store();
    let (old, new) = (
        h.manager.list_checkpoints(fork).await.unwrap(),
        h.manager.list_checkpoints(copy).await.unwrap(),
    );
    assert_eq!(new.len(), old.len());
    for (o, n) in old.iter().zip(&new) {
        assert_eq!(texts_at(store, n.id).await, texts_at(store, o.id).await);
    }
    assert_eq!(new.last().unwrap().parent_id, None);
}

#[tokio::test]
async fn a_file_without_timelines_imports_its_history_with_one_checkpoint() {
    let h = harness(SessionManagerConfig::default());
    let id = dialog_with_a_rollback(&h).await;
    // What an older keel wrote: no timelines, head or checkpoints.
    let mut json: serde_json::Value = serde_json::from_str(
        &h.manager
            .export_dialog(id)
            .await
            .unwrap()
            .to_json()
            .unwrap(),
    )
    .unwrap();
    for field in ["timelines", "head_timeline", "checkpoints", "runs"] {
        json.as_object_mut().unwrap().remove(field);
    }
    let old = keel_engine::DialogExport::from_value(json).unwrap();
    let copy = h.manager.import_dialog(old).await.unwrap();
    assert_eq!(visible_texts(&h.manager, copy).await, ["1", "a", "4", "d"]);
    let cps = h.manager.list_checkpoints(copy).await.unwrap();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].source, keel_store::CheckpointSource::Manual);
    assert!(h
        .manager
        .store()
        .session_runs(copy)
        .await
        .unwrap()
        .is_empty());
}

/// The smallest PNG header the store's sniffing recognises, and a tail.
const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01";

/// A dialog whose history holds a user message with a stored image.
async fn dialog_with_an_image(h: &Harness) -> (SessionId, String) {
    let stored = h.manager.store().put_image(PNG.to_vec()).await.unwrap();
    let id = h.manager.create(spec("pictures")).await.unwrap();
    let user: keel_core::Message = serde_json::from_value(serde_json::json!({
        "role": "user",
        "content": [
            {"type": "text", "text": "look"},
            {"type": "image_ref", "uri": keel_core::image::image_uri(&stored.sha256),
             "mime_type": "image/png"},
        ],
    }))
    .unwrap();
    h.manager
        .import_messages(id, vec![user, keel_core::Message::assistant("a dot")])
        .await
        .unwrap();
    (id, stored.sha256)
}

#[tokio::test]
async fn an_exported_image_travels_with_its_dialog_and_a_missing_or_altered_one_is_refused() {
    let from = harness(SessionManagerConfig::default());
    let (id, hash) = dialog_with_an_image(&from).await;
    let export = from.manager.export_dialog(id).await.unwrap();
    assert_eq!(export.images.len(), 1, "one image, referred to once");
    assert_eq!(export.images[0].sha256, hash);
    assert_eq!(export.images[0].media_type, "image/png");

    // Into another data directory: the image comes along, byte for byte.
    let to = harness(SessionManagerConfig::default());
    let copy = to.manager.import_dialog(export.clone()).await.unwrap();
    let image = to
        .manager
        .store()
        .image(&hash)
        .await
        .unwrap()
        .expect("carried");
    assert_eq!(image.bytes, PNG);
    assert_eq!(visible_texts(&to.manager, copy).await, ["look", "a dot"]);
    assert!(to
        .manager
        .store()
        .check_invariants(keel_store::CheckOptions::default())
        .await
        .unwrap()
        .is_clean());

    // A file that refers to an image it does not carry, or whose bytes are
    // not the image its references name, is refused.
    let elsewhere = harness(SessionManagerConfig::default());
    let mut missing = export.clone();
    missing.images.clear();
    let mut altered = export.clone();
    altered.images[0].data = "R0lGODlhAQABAAAAACw=".into(); // a GIF's header
    let mut errors = Vec::new();
    for file in [missing, altered] {
        let err = elsewhere.manager.import_dialog(file).await.unwrap_err();
        errors.push(err.to_string().replace(&hash, "HASH"));
    }
    insta::assert_debug_snapshot!(errors, @r#"
    [
        "invalid input: a message refers to image HASH, which the file does not carry",
        "invalid input: image HASH: its bytes have another hash (2f41918f848b5fb01cd6731a4f8e50a6d5bb3b78fcc34d0a419052672fb72af3)",
    ]
    "#);
}
