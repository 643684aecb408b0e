//! The compression dictionary: trained from the database's own rows once
//! it holds enough, used by new values, read back from the file by a
//! process that never saw it, and a frame without its dictionary is
//! corruption.

use keel_core::SessionId;
use keel_store::{CheckOptions, MessageFilter, Store, StoreError, TurnCommit};
use rusqlite::Connection;

use crate::common::*;

/// A turn with a ~1.5 KB answer of varied prose and a ~400-byte state.
fn prose_turn(session: SessionId, n: u64) -> TurnCommit {
    let words = [
        "durable",
        "runtime",
        "agent",
        "turn",
        "checkpoint",
        "history",
        "branch",
        "commit",
        "session",
        "memory",
        "result",
        "model",
        "replay",
        "store",
        "page",
        "frame",
    ];
    let answer: Vec<&str> = (0..200)
        .map(|i| words[((n * 31 + i * 7 + i * i) % 16) as usize])
        .collect();
    TurnCommit {
        calls: None,
        session_id: session,
        messages: vec![
            user(&format!("question {n}: how does keel keep a turn?")),
            assistant(&answer.join(" ")),
        ],
        state: format!(
            r#"{{"turn_index":{n},"cost":{{"prompt_tokens":{},"completion_tokens":{}}},"slots":{{"default":{{"mode":"full"}}}},"memory":{{"project":"keel"}}}}"#,
            n * 1234,
            n * 321
        )
        .into_bytes(),
        checkpoint: None,
        visible_user_inputs: 1,
        answers: Vec::new(),
        expected_head: None,
        now_ms: 100 + i64::try_from(n).unwrap(),
    }
}

/// How many stored message bodies name dictionary `id` in their frame.
fn frames_with(conn: &Connection, id: u32) -> usize {
    let frames: Vec<Vec<u8>> = conn
        .prepare("SELECT content FROM messages WHERE typeof(content) = 'blob'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(|r| r.unwrap())
        .collect();
    frames
        .iter()
        .filter(|f| zstd::zstd_safe::get_dict_id_from_frame(f).map(u32::from) == Some(id))
        .count()
}

#[tokio::test]
async fn a_dictionary_is_trained_once_due_used_by_new_rows_and_read_back_from_the_file() {
    let (dir, store) = temp_store();
    let session = store.create_session(new_session("d", 1)).await.unwrap().id;
    for n in 1..=5 {
        store.commit_turn(prose_turn(session, n)).await.unwrap();
    }
    assert_eq!(
        store.train_dictionary_if_due(10).await.unwrap(),
        None,
        "too little to learn from"
    );
    for n in 6..=120 {
        store.commit_turn(prose_turn(session, n)).await.unwrap();
    }
    let id = store
        .train_dictionary_if_due(20)
        .await
        .unwrap()
        .expect("due");
    assert_eq!(
        store.train_dictionary_if_due(30).await.unwrap(),
        None,
        "once"
    );
    for n in 121..=130 {
        store.commit_turn(prose_turn(session, n)).await.unwrap();
    }
    let before = store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(before.len(), 260);
    {
        let conn = Connection::open(db_path(&dir)).unwrap();
        assert_eq!(frames_with(&conn, id), 20, "every message after training");
        let codecs: i64 = conn
            .query_row(
                "SELECT count(*) FROM state_blobs WHERE codec = 1",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(codecs >= 10, "{codecs}");
    }
    drop(store);

    // A process that never saw the dictionary reads it from the file.
    keel_store::testing::forget_dictionaries();
    let report = keel_store::check_database(&db_path(&dir), &CheckOptions::default()).unwrap();
    assert!(report.is_clean(), "{:?}", report.findings);
    keel_store::testing::forget_dictionaries();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let after = store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap();
    assert_eq!(
        after.iter().map(|m| m.message.text()).collect::<Vec<_>>(),
        before.iter().map(|m| m.message.text()).collect::<Vec<_>>()
    );
    // ...and keeps compressing new rows with it.
    store.commit_turn(prose_turn(session, 131)).await.unwrap();
    let conn = Connection::open(db_path(&dir)).unwrap();
    assert_eq!(frames_with(&conn, id), 22);

    // A frame whose dictionary the database does not hold is corruption.
    drop(store);
    conn.execute_batch("PRAGMA foreign_keys = OFF; DELETE FROM zstd_dictionaries;")
        .unwrap();
    drop(conn);
    keel_store::testing::forget_dictionaries();
    let store = Store::open(db_path(&dir), fast_options()).unwrap();
    let err = store
        .load_messages(session, MessageFilter::default())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Corruption { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!("dictionary {id}")),
        "{err}"
    );
}
