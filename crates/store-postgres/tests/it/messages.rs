//! Messages on PostgreSQL itself (what the conformance suite cannot reach
//! through the store): a row whose content is not a message is reported
//! as corruption, never skipped or defaulted.

use keel_core::{Message, SessionId};
use keel_store::{MessageFilter, NewMessage, NewSession, Store, StoreError};
use keel_store_postgres::{require_postgres, PgOptions, PgStore};

#[tokio::test]
async fn corrupt_message_json_is_a_corruption_error() {
    let db = require_postgres!();
    let (store, _) = PgStore::connect(&db.conninfo, PgOptions::default())
        .await
        .unwrap();
    let store = Store::new(store);
    let id = SessionId::new();
    store
        .create_session(NewSession {
            id,
            channel: "cli_chat".into(),
            chat_id: "chat-1".into(),
            dialog_id: "d".into(),
            title: "t".into(),
            agent_id: None,
            parent_id: None,
            delivery_context: None,
            now_ms: 1,
        })
        .await
        .unwrap();
    store
        .append_message(id, NewMessage::new(Message::user("x")), 2)
        .await
        .unwrap();
    db.connect()
        .await
        .execute("UPDATE messages SET content = '{\"role\":\"wizard\"}'", &[])
        .await
        .unwrap();
    let err = store
        .load_messages(id, MessageFilter::default())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Corruption(_)), "{err}");
}
