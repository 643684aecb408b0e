//! Sessions and dialogs: create/upsert/get, rename, soft delete, the tree,
//! and cursor pagination that stays stable while dialogs are created.
#![allow(missing_docs)] // a test's name is its documentation

use crate::{DialogQuery, StoreError};

use super::fixtures::*;
use super::TestDb;

fn query(limit: usize) -> DialogQuery {
    DialogQuery {
        channel: "cli_chat".into(),
        chat_id: "chat-1".into(),
        include_deleted: false,
        limit,
        cursor: None,
    }
}

fn import_turn(session: &crate::NewSession) -> crate::TurnCommit {
    crate::TurnCommit {
        calls: None,
        session_id: session.id,
        messages: vec![user("hi"), assistant("hello")],
        state: br#"{"turn":1}"#.to_vec(),
        checkpoint: None,
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 200,
    }
}

pub async fn create_get_rename_touch_and_soft_delete(db: TestDb) {
    let store = db.store.clone();
    let s = new_session("default", 100);
    let created = store.create_session(s.clone()).await.unwrap();
    assert_eq!(created.title, "Dialog default");
    assert_eq!(created.created_at_ms, 100);
    assert_eq!(created.message_count, 0);
    assert!(created.state_hash.is_none());

    // Same id again, or another id for the same dialog: conflicts.
    assert!(matches!(
        store.create_session(s.clone()).await,
        Err(StoreError::Conflict(_))
    ));
    let mut clash = new_session("default", 101);
    clash.title = "other".into();
    assert!(matches!(
        store.create_session(clash).await,
        Err(StoreError::Conflict(_))
    ));

    let mut up = s.clone();
    up.title = "Renamed by upsert".into();
    up.delivery_context = Some(r#"{"reply":"x"}"#.into());
    up.now_ms = 150;
    let updated = store.upsert_session(up).await.unwrap();
    assert_eq!(updated.title, "Renamed by upsert");
    assert_eq!(
        updated.delivery_context.as_deref(),
        Some(r#"{"reply":"x"}"#)
    );
    assert_eq!(updated.last_active_at_ms, 150);

    store
        .rename_session(s.id, "Trip plans".into(), 160)
        .await
        .unwrap();
    store.touch_session(s.id, 170).await.unwrap();
    let got = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(got.title, "Trip plans");
    assert_eq!(got.last_active_at_ms, 170);
    let by_key = store
        .get_dialog("cli_chat", "chat-1", "default")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(by_key.id, s.id);

    assert!(store.soft_delete_session(s.id, 180).await.unwrap());
    assert!(!store.soft_delete_session(s.id, 190).await.unwrap());
    let deleted = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(deleted.deleted_at_ms, Some(180));
    assert!(store
        .list_dialogs(query(10))
        .await
        .unwrap()
        .items
        .is_empty());
    let mut all = query(10);
    all.include_deleted = true;
    assert_eq!(store.list_dialogs(all).await.unwrap().items.len(), 1);

    let missing = keel_core::SessionId::new();
    assert!(matches!(
        store.rename_session(missing, "x".into(), 1).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(store.get_session(missing).await.unwrap().is_none());
}

pub async fn empty_keys_are_rejected_before_sql(db: TestDb) {
    let store = db.store.clone();
    let mut s = new_session("", 1);
    s.dialog_id.clear();
    assert!(matches!(
        store.create_session(s).await,
        Err(StoreError::InvalidInput(_))
    ));
}

pub async fn latest_active_dialog_and_session_tree(db: TestDb) {
    let store = db.store.clone();
    let a = store.create_session(new_session("a", 10)).await.unwrap();
    let b = store.create_session(new_session("b", 20)).await.unwrap();
    store.touch_session(a.id, 30).await.unwrap();
    let latest = store
        .latest_active_dialog("cli_chat", "chat-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(latest.id, a.id);
    store.soft_delete_session(a.id, 40).await.unwrap();
    let latest = store
        .latest_active_dialog("cli_chat", "chat-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(latest.id, b.id);
    assert!(store
        .latest_active_dialog("cli_chat", "nobody")
        .await
        .unwrap()
        .is_none());

    let mut child = new_session("b-child", 50);
    child.parent_id = Some(b.id);
    child.agent_id = Some(keel_core::AgentId::parse("researcher").unwrap());
    let child = store.create_session(child).await.unwrap();
    let children = store.child_sessions(b.id).await.unwrap();
    assert_eq!(children.len(), 1);
    assert_eq!(children[0].id, child.id);
    assert_eq!(child.parent_id, Some(b.id));
}

pub async fn pagination_is_stable_under_inserts(db: TestDb) {
    let store = db.store.clone();
    let mut ids = Vec::new();
    for i in 0..10 {
        // Two dialogs share each timestamp: the id breaks the tie.
        let s = store
            .create_session(new_session(&format!("d{i}"), 1000 + i / 2))
            .await
            .unwrap();
        ids.push(s.id);
    }
    // Newest first = reverse creation order (v7 ids grow within a millisecond).
    let expected: Vec<_> = ids.iter().rev().copied().collect();

    let first = store.list_dialogs(query(4)).await.unwrap();
    let mut seen: Vec<_> = first.items.iter().map(|s| s.id).collect();
    let mut cursor = first.next_cursor;
    let mut n = 0;
    while let Some(c) = cursor {
        // Meanwhile new dialogs keep arriving (newer than everything listed).
        store
            .create_session(new_session(&format!("new{n}"), 2000 + n))
            .await
            .unwrap();
        n += 1;
        let mut q = query(4);
        q.cursor = Some(c);
        let page = store.list_dialogs(q).await.unwrap();
        seen.extend(page.items.iter().map(|s| s.id));
        cursor = page.next_cursor;
    }
    assert_eq!(seen, expected, "no duplicates, no gaps");
    assert!(matches!(
        store.list_dialogs(query(0)).await,
        Err(StoreError::InvalidInput(_))
    ));
}

pub async fn import_session_creates_the_session_with_its_history_in_one_step(db: TestDb) {
    let store = db.store.clone();
    let s = new_session("imported", 100);
    let committed = store
        .import_session(s.clone(), import_turn(&s), Vec::new())
        .await
        .unwrap();
    assert_eq!(committed.seqs, [1, 2]);
    let record = store.get_session(s.id).await.unwrap().unwrap();
    assert_eq!(record.message_count, 1);
    assert_eq!(record.state_hash.as_deref(), Some(&*committed.state_hash));
    let history = store
        .load_messages(s.id, crate::MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(history.len(), 2);
}

pub async fn a_failed_import_leaves_no_session_behind(db: TestDb) {
    let store = db.store.clone();
    let elsewhere = store
        .create_session(new_session("elsewhere", 100))
        .await
        .unwrap();
    let s = new_session("imported", 100);
    // The history fails after the session row is written: both roll back.
    let mut turn = import_turn(&s);
    turn.expected_head = Some(crate::SessionHead {
        timeline: elsewhere.head_timeline_id,
        last_seq: 7,
    });
    assert!(store
        .import_session(s.clone(), turn, Vec::new())
        .await
        .is_err());
    assert!(store.get_session(s.id).await.unwrap().is_none());
    // A history for another session is refused before anything is written.
    let mut other = import_turn(&s);
    other.session_id = keel_core::SessionId::new();
    assert!(matches!(
        store.import_session(s.clone(), other, Vec::new()).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(store.get_session(s.id).await.unwrap().is_none());
}
