//! Every enum stored as text round-trips through its text form, any other
//! text is an error naming the enum, and unknown text in a column the store
//! reads is a `Corruption` error naming the column, never a default.

use std::fmt::{Debug, Display};
use std::str::FromStr;

use keel_core::{
    CheckpointId, ClientVisibility, CompletionPolicy, Delivery, ExecutionMode, GroupId, Role,
    RunId, RunStatus, SessionId, TurnOrigin, UnknownVariant, Usage,
};
use keel_store::{
    AcceptGroup, CheckpointSource, CompletionHandling, EventStatus, EventType, GroupStatus,
    InputState, NewCheckpoint, NewGroup, OpenTurn, ScopeKind, Store, StoreError, TerminalOutcome,
    TurnCommit,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use rusqlite::Connection;

use crate::common::*;

/// Checks one enum against `text`: each variant's text (as stored, and as
/// displayed) parses back to it, and anything else is `UnknownVariant` of
/// `kind` carrying (up to 80 chars of) the text.
fn check_enum<E>(
    all: &[E],
    as_str: fn(E) -> &'static str,
    kind: &str,
    text: &str,
) -> Result<(), TestCaseError>
where
    E: FromStr<Err = UnknownVariant> + Display + Debug + Copy + PartialEq,
{
    for v in all {
        prop_assert_eq!(as_str(*v).parse::<E>(), Ok(*v));
        prop_assert_eq!(v.to_string(), as_str(*v));
    }
    match all.iter().find(|v| as_str(**v) == text) {
        Some(v) => prop_assert_eq!(text.parse::<E>(), Ok(*v)),
        None => {
            let err = text.parse::<E>().unwrap_err();
            prop_assert_eq!(err.kind, kind);
            prop_assert_eq!(err.value, text.chars().take(80).collect::<String>());
        }
    }
    Ok(())
}

/// The text forms of every stored enum.
fn known_texts() -> Vec<String> {
    fn all<E: Display>(v: &[E]) -> impl Iterator<Item = String> + '_ {
        v.iter().map(ToString::to_string)
    }
    all(RunStatus::ALL)
        .chain(all(ExecutionMode::ALL))
        .chain(all(CompletionPolicy::ALL))
        .chain(all(Delivery::ALL))
        .chain(all(Role::ALL))
        .chain(all(ClientVisibility::ALL))
        .chain(all(TurnOrigin::ALL))
        .chain(all(GroupStatus::ALL))
        .chain(all(CheckpointSource::ALL))
        .chain(all(ScopeKind::ALL))
        .chain(all(EventType::ALL))
        .chain(all(EventStatus::ALL))
        .chain(all(InputState::ALL))
        .collect()
}

/// Text that is often one enum's form but another's not, near misses, or anything.
fn text() -> impl Strategy<Value = String> {
    let known = known_texts();
    let near = known.clone();
    prop_oneof![
        prop::sample::select(known),
        (
            prop::sample::select(near),
            prop_oneof![Just(" "), Just("_"), Just("X")]
        )
            .prop_map(|(t, suffix)| format!("{t}{suffix}")),
        prop::sample::select(known_texts()).prop_map(|t| t.to_uppercase()),
        "\\PC{0,100}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn text_forms_round_trip_and_anything_else_is_unknown(text in text()) {
        check_enum(RunStatus::ALL, RunStatus::as_str, "run status", &text)?;
        check_enum(ExecutionMode::ALL, ExecutionMode::as_str, "execution mode", &text)?;
        check_enum(CompletionPolicy::ALL, CompletionPolicy::as_str, "completion policy", &text)?;
        check_enum(Delivery::ALL, Delivery::as_str, "delivery", &text)?;
        check_enum(Role::ALL, Role::as_str, "role", &text)?;
        check_enum(ClientVisibility::ALL, ClientVisibility::as_str, "client visibility", &text)?;
        check_enum(TurnOrigin::ALL, TurnOrigin::as_str, "turn origin", &text)?;
        check_enum(GroupStatus::ALL, GroupStatus::as_str, "group status", &text)?;
        check_enum(CheckpointSource::ALL, CheckpointSource::as_str, "checkpoint source", &text)?;
        check_enum(ScopeKind::ALL, ScopeKind::as_str, "event scope", &text)?;
        check_enum(EventType::ALL, EventType::as_str, "event type", &text)?;
        check_enum(EventStatus::ALL, EventStatus::as_str, "event status", &text)?;
        check_enum(InputState::ALL, InputState::as_str, "input state", &text)?;
    }
}

/// Every enum column the store parses when it reads a row, with the texts it accepts.
fn enum_columns() -> Vec<(&'static str, &'static str, Vec<String>)> {
    fn texts<E: Display>(v: &[E]) -> Vec<String> {
        v.iter().map(ToString::to_string).collect()
    }
    vec![
        ("agent_runs", "status", texts(RunStatus::ALL)),
        ("agent_runs", "mode", texts(ExecutionMode::ALL)),
        ("agent_runs", "signal_delivery", texts(Delivery::ALL)),
        ("agent_runs", "completion_delivery", texts(Delivery::ALL)),
        ("agent_runs", "failure_delivery", texts(Delivery::ALL)),
        ("agent_run_groups", "status", texts(GroupStatus::ALL)),
        ("agent_run_groups", "mode", texts(ExecutionMode::ALL)),
        (
            "agent_run_groups",
            "completion_policy",
            texts(CompletionPolicy::ALL),
        ),
        (
            "agent_run_groups",
            "completion_delivery",
            texts(Delivery::ALL),
        ),
        ("agent_run_groups", "failure_delivery", texts(Delivery::ALL)),
        ("checkpoints", "source", texts(CheckpointSource::ALL)),
        ("agent_inbox_events", "scope_kind", texts(ScopeKind::ALL)),
        ("agent_inbox_events", "event_type", texts(EventType::ALL)),
        ("agent_inbox_events", "status", texts(EventStatus::ALL)),
        ("agent_inbox_events", "delivery", texts(Delivery::ALL)),
        ("messages", "input_state", texts(InputState::ALL)),
    ]
}

/// Where the rows of [`rows_of_every_kind`] are.
struct Rows {
    /// The root session of the group (it has no session row).
    root: SessionId,
    group: GroupId,
    /// The group's run.
    run: RunId,
    /// The session with a checkpoint.
    session: SessionId,
}

/// A store with one row in each table of [`enum_columns`]: a finished
/// background group of one run (so its completion event), and a session
/// with a checkpoint.
async fn rows_of_every_kind(store: &Store) -> Rows {
    let root = SessionId::new();
    let run = new_run(root, ExecutionMode::Background);
    let group = GroupId::new();
    store
        .accept_agent_group(AcceptGroup {
            group: NewGroup {
                id: group,
                root_session_id: root,
                caller_run_id: None,
                caller_scope_id: "root-turn".into(),
                idempotency_key: None,
                mode: ExecutionMode::Background,
                completion_policy: CompletionPolicy::All,
                completion_delivery: Some(Delivery::Queue),
                failure_delivery: Some(Delivery::Steer),
                deadline_at_ms: 1_000_000,
                runtime_generation: 1,
            },
            runs: vec![run.clone()],
            inbox_capacity: 8,
            now_ms: 10,
        })
        .await
        .unwrap();
    let done = TerminalOutcome::Completed {
        result: "ok".into(),
        usage: Usage::default(),
        tool_calls: 0,
        iterations: 1,
        cost: None,
    };
    let commit = store
        .commit_terminal(
            run.id,
            run.execution_id,
            done,
            CompletionHandling::Deliver,
            20,
        )
        .await
        .unwrap();
    assert!(commit.event_id.is_some(), "the group's completion event");
    let session = store.create_session(new_session("d", 30)).await.unwrap();
    store
        .commit_turn(TurnCommit {
            calls: None,
            session_id: session.id,
            messages: vec![user("hi")],
            state: b"{}".to_vec(),
            checkpoint: Some(NewCheckpoint {
                id: CheckpointId::new(),
                turn_index: 1,
                source: CheckpointSource::Turn,
            }),
            visible_user_inputs: 1,
            answers: Vec::new(),
            expected_head: None,
            now_ms: 40,
        })
        .await
        .unwrap();
    // A turn input (its column is the only enum of `messages` read back).
    store
        .open_turn(OpenTurn {
            session_id: session.id,
            messages: vec![user("more")],
            expected_head: None,
            queued: None,
            now_ms: 50,
        })
        .await
        .unwrap();
    Rows {
        root,
        group,
        run: run.id,
        session: session.id,
    }
}

/// Reads whatever row of `table` the store has, through its public API.
async fn read_table(store: &Store, table: &str, rows: &Rows) -> Result<(), StoreError> {
    match table {
        "agent_runs" => store.get_run(rows.run).await.map(drop),
        "agent_run_groups" => store.get_group(rows.group).await.map(drop),
        "checkpoints" => store.list_checkpoints(rows.session).await.map(drop),
        "agent_inbox_events" => store.list_inbox_events(rows.root).await.map(drop),
        "messages" => store
            .load_messages(rows.session, Default::default())
            .await
            .map(drop),
        other => unreachable!("no reader for {other}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn unknown_text_in_any_enum_column_is_corruption(
        (table, name, valid) in prop::sample::select(enum_columns()),
        text in text(),
    ) {
        // Another enum's text (`running` as a mode) is as unknown as any.
        prop_assume!(!valid.contains(&text));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (dir, store) = temp_store();
            let rows = rows_of_every_kind(&store).await;
            // The rows read back before the damage.
            read_table(&store, table, &rows).await.unwrap();
            let conn = Connection::open(db_path(&dir)).unwrap();
            conn.execute_batch("PRAGMA ignore_check_constraints = ON").unwrap();
            let changed = conn.execute(&format!("UPDATE {table} SET {name} = ?1"), [&text]).unwrap();
            prop_assert!(changed >= 1, "no row in {}", table);
            let err = read_table(&store, table, &rows).await.unwrap_err();
            let StoreError::Corruption(message) = &err else {
                return Err(TestCaseError::fail(format!("{table}.{name}: {err:?}")));
            };
            let prefix = format!("{table}.{name}: unknown ");
            prop_assert!(message.starts_with(&prefix), "{}", message);
            Ok(())
        })?;
    }
}
