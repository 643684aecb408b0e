//! Timelines against a model: random sequences of turn commits, manual
//! checkpoints, rollbacks, forks, prunes and deletes, checked after every
//! step against an in-memory tree in which each session and each checkpoint
//! simply owns a copy of its whole history. The store shares prefixes
//! between timelines instead; what any session or checkpoint loads must be
//! the same.
//!
//! proptest generates and shrinks the sequences; the cases run one after
//! another on the test's one database (each in sessions of its own, which
//! prune and delete never reach past), awaited on the test's runtime.
#![allow(missing_docs)] // a test's name is its documentation

use keel_core::{CheckpointId, Message, SessionId};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::fixtures::*;
use super::TestDb;
use crate::{
    CheckpointSource, MessageFilter, NewCheckpoint, NewMessage, PrunePolicy, Store, StoreError,
    StoredMessage, TurnCommit,
};

/// Random sequences tried (as many as the SQLite-only test ran).
const CASES: u32 = 64;
/// Runs a failing sequence's shrinking may take before it reports.
const MAX_SHRINK_RUNS: u32 = 256;

#[derive(Debug, Clone)]
enum Op {
    /// A committed turn of `messages` messages, with a turn checkpoint or not.
    Turn {
        session: Index,
        messages: usize,
        checkpoint: bool,
    },
    /// A manual checkpoint with a new state.
    Manual { session: Index },
    /// A rollback of `session` to `checkpoint`, which may be another session's (refused).
    Rollback { session: Index, checkpoint: Index },
    /// A new session forked from `checkpoint`.
    Fork { checkpoint: Index },
    /// Retention of `session` keeping its newest `keep_latest` turn checkpoints.
    Prune { session: Index, keep_latest: usize },
    /// Delete of every checkpoint of `session`.
    DeleteAll { session: Index },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (any::<Index>(), 0..=3usize, any::<bool>()).prop_map(|(session, messages, checkpoint)| {
            Op::Turn { session, messages, checkpoint }
        }),
        1 => any::<Index>().prop_map(|session| Op::Manual { session }),
        3 => (any::<Index>(), any::<Index>())
            .prop_map(|(session, checkpoint)| Op::Rollback { session, checkpoint }),
        2 => any::<Index>().prop_map(|checkpoint| Op::Fork { checkpoint }),
        1 => (any::<Index>(), 0..=2usize)
            .prop_map(|(session, keep_latest)| Op::Prune { session, keep_latest }),
        1 => any::<Index>().prop_map(|session| Op::DeleteAll { session }),
    ]
}

#[derive(Debug)]
struct ModelSession {
    id: SessionId,
    /// Message texts in seq order (seq = position + 1).
    history: Vec<String>,
    /// The live state, once one was committed.
    state: Option<Vec<u8>>,
}

#[derive(Debug)]
struct ModelCheckpoint {
    id: CheckpointId,
    session: SessionId,
    history: Vec<String>,
    state: Vec<u8>,
    parent: Option<CheckpointId>,
    source: CheckpointSource,
}

/// Sessions, and the checkpoints that still exist in creation order.
#[derive(Debug, Default)]
struct Model {
    sessions: Vec<ModelSession>,
    checkpoints: Vec<ModelCheckpoint>,
    /// This run's number: its dialog names differ from other runs' on the
    /// same database.
    run: u64,
    /// Source of unique message texts, states and dialog names.
    counter: u64,
}

impl Model {
    fn fresh(&mut self, what: &str) -> String {
        self.counter += 1;
        format!("{what}-{}-{}", self.run, self.counter)
    }

    /// The session's newest checkpoint: the parent of its next turn or manual one.
    fn newest_of(&self, session: SessionId) -> Option<CheckpointId> {
        self.checkpoints
            .iter()
            .rev()
            .find(|c| c.session == session)
            .map(|c| c.id)
    }

    /// Records checkpoint `id` of session `s` at its head: its history and live state.
    fn checkpoint_head(
        &mut self,
        s: usize,
        id: CheckpointId,
        parent: Option<CheckpointId>,
        source: CheckpointSource,
    ) {
        let m = &self.sessions[s];
        self.checkpoints.push(ModelCheckpoint {
            id,
            session: m.id,
            history: m.history.clone(),
            state: m.state.clone().expect("a checkpointed session has a state"),
            parent,
            source,
        });
    }

    /// What retention keeping `keep` turn checkpoints removes from `session`,
    /// newest first: turn checkpoints past the newest `keep` turn ones, except
    /// the session's newest and any a rollback or fork points at.
    fn prunable(&self, session: SessionId, keep: usize) -> Vec<CheckpointId> {
        let newest = self.newest_of(session);
        self.checkpoints
            .iter()
            .rev()
            .filter(|c| c.session == session && c.source == CheckpointSource::Turn)
            .skip(keep)
            .filter(|c| Some(c.id) != newest)
            .filter(|c| {
                !self.checkpoints.iter().any(|k| {
                    k.parent == Some(c.id)
                        && matches!(
                            k.source,
                            CheckpointSource::Rollback | CheckpointSource::Fork
                        )
                })
            })
            .map(|c| c.id)
            .collect()
    }

    /// Removes `doomed` (newest first, as the store does), re-parenting each
    /// one's children to its parent so the tree stays connected.
    fn remove(&mut self, doomed: &[CheckpointId]) {
        for id in doomed {
            let Some(pos) = self.checkpoints.iter().position(|c| c.id == *id) else {
                continue;
            };
            let gone = self.checkpoints.remove(pos);
            for c in &mut self.checkpoints {
                if c.parent == Some(gone.id) {
                    c.parent = gone.parent;
                }
            }
        }
    }
}

/// A store error as the step's failure, which proptest shrinks like any
/// other (a panic would end the test unshrunk).
fn failed(what: &'static str) -> impl FnOnce(StoreError) -> TestCaseError {
    move |e| TestCaseError::fail(format!("{what}: {e}"))
}

/// A row the model says exists, or the step's failure.
fn found<T>(what: &str, row: Option<T>) -> Result<T, TestCaseError> {
    row.ok_or_else(|| TestCaseError::fail(format!("{what} is missing")))
}

fn texts(messages: &[StoredMessage]) -> Vec<(i64, String)> {
    messages.iter().map(|m| (m.seq, m.message.text())).collect()
}

fn numbered(history: &[String]) -> Vec<(i64, String)> {
    (1..).zip(history.iter().cloned()).collect()
}

/// A committed turn of `messages` new messages and a new state, with a
/// turn checkpoint or not.
async fn commit_turn(
    store: &Store,
    model: &mut Model,
    session: Index,
    messages: usize,
    checkpoint: bool,
    now_ms: i64,
) -> Result<(), TestCaseError> {
    let s = session.index(model.sessions.len());
    let id = model.sessions[s].id;
    let texts: Vec<String> = (0..messages).map(|_| model.fresh("message")).collect();
    let state = model.fresh("state").into_bytes();
    let new_cp = checkpoint.then(CheckpointId::new);
    let committed = store
        .commit_turn(TurnCommit {
            calls: None,
            session_id: id,
            messages: texts
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    NewMessage::new(if i % 2 == 0 {
                        Message::user(t.as_str())
                    } else {
                        Message::assistant(t.as_str())
                    })
                })
                .collect(),
            state: state.clone(),
            checkpoint: new_cp.map(|id| NewCheckpoint {
                id,
                turn_index: 1,
                source: CheckpointSource::Turn,
            }),
            visible_user_inputs: 1,
            answers: Vec::new(),
            expected_head: None,
            now_ms,
        })
        .await
        .map_err(failed("commit_turn"))?;
    let before = model.sessions[s].history.len() as i64;
    let expected: Vec<i64> = (before + 1..=before + messages as i64).collect();
    prop_assert_eq!(committed.seqs, expected);
    let parent = model.newest_of(id);
    let m = &mut model.sessions[s];
    m.history.extend(texts);
    m.state = Some(state);
    if let Some(cp) = new_cp {
        model.checkpoint_head(s, cp, parent, CheckpointSource::Turn);
    }
    Ok(())
}

async fn apply(store: &Store, model: &mut Model, op: Op, now_ms: i64) -> Result<(), TestCaseError> {
    match op {
        Op::Turn {
            session,
            messages,
            checkpoint,
        } => commit_turn(store, model, session, messages, checkpoint, now_ms).await?,
        Op::Manual { session } => {
            let s = session.index(model.sessions.len());
            let id = model.sessions[s].id;
            let state = model.fresh("state").into_bytes();
            let cp = CheckpointId::new();
            store
                .create_checkpoint(
                    id,
                    NewCheckpoint {
                        id: cp,
                        turn_index: 1,
                        source: CheckpointSource::Manual,
                    },
                    state.clone(),
                    now_ms,
                )
                .await
                .map_err(failed("create_checkpoint"))?;
            let parent = model.newest_of(id);
            model.sessions[s].state = Some(state);
            model.checkpoint_head(s, cp, parent, CheckpointSource::Manual);
        }
        Op::Rollback {
            session,
            checkpoint,
        } => {
            if model.checkpoints.is_empty() {
                return Ok(());
            }
            let s = session.index(model.sessions.len());
            let id = model.sessions[s].id;
            let target = &model.checkpoints[checkpoint.index(model.checkpoints.len())];
            let (target_id, target_session) = (target.id, target.session);
            let (history, state) = (target.history.clone(), target.state.clone());
            let cp = CheckpointId::new();
            let result = store.rollback(id, target_id, cp, now_ms).await;
            if target_session != id {
                prop_assert!(
                    matches!(result, Err(StoreError::InvalidInput(_))),
                    "rollback to another session's checkpoint: {result:?}"
                );
                return Ok(());
            }
            result.map_err(failed("rollback"))?;
            let m = &mut model.sessions[s];
            m.history = history;
            m.state = Some(state);
            model.checkpoint_head(s, cp, Some(target_id), CheckpointSource::Rollback);
        }
        Op::Fork { checkpoint } => {
            if model.checkpoints.is_empty() {
                return Ok(());
            }
            let source = &model.checkpoints[checkpoint.index(model.checkpoints.len())];
            let (source_id, history, state) =
                (source.id, source.history.clone(), source.state.clone());
            let dialog = model.fresh("fork");
            let cp = CheckpointId::new();
            let (created, _) = store
                .fork(source_id, new_session(&dialog, now_ms), cp)
                .await
                .map_err(failed("fork"))?;
            model.sessions.push(ModelSession {
                id: created.id,
                history,
                state: Some(state),
            });
            model.checkpoint_head(
                model.sessions.len() - 1,
                cp,
                Some(source_id),
                CheckpointSource::Fork,
            );
        }
        Op::Prune {
            session,
            keep_latest,
        } => {
            let id = model.sessions[session.index(model.sessions.len())].id;
            let policy = PrunePolicy {
                keep_latest: Some(keep_latest),
                older_than_ms: None,
            };
            let report = store
                .prune_checkpoints(id, policy)
                .await
                .map_err(failed("prune_checkpoints"))?;
            let doomed = model.prunable(id, keep_latest);
            prop_assert_eq!(report.checkpoints_deleted, doomed.len() as u64);
            model.remove(&doomed);
        }
        Op::DeleteAll { session } => {
            let id = model.sessions[session.index(model.sessions.len())].id;
            let report = store
                .delete_checkpoints(id)
                .await
                .map_err(failed("delete_checkpoints"))?;
            let doomed: Vec<CheckpointId> = model
                .checkpoints
                .iter()
                .rev()
                .filter(|c| c.session == id)
                .map(|c| c.id)
                .collect();
            prop_assert_eq!(report.checkpoints_deleted, doomed.len() as u64);
            model.remove(&doomed);
        }
    }
    Ok(())
}

/// Everything the store can load equals the model.
async fn check(store: &Store, model: &Model) -> Result<(), TestCaseError> {
    for s in &model.sessions {
        let loaded = store
            .load_messages(s.id, MessageFilter::default())
            .await
            .map_err(failed("load_messages"))?;
        prop_assert_eq!(texts(&loaded), numbered(&s.history), "session {}", s.id);
        let last = store.last_seq(s.id).await.map_err(failed("last_seq"))?;
        prop_assert_eq!(last, s.history.len() as i64);
        let record = store
            .get_session(s.id)
            .await
            .map_err(failed("get_session"))?;
        let record = found(&format!("session {}", s.id), record)?;
        let state = match record.state_hash {
            Some(hash) => store
                .get_state_blob(hash)
                .await
                .map_err(failed("get_state_blob"))?,
            None => None,
        };
        prop_assert_eq!(&state, &s.state, "state of session {}", s.id);
        let listed: Vec<CheckpointId> = store
            .list_checkpoints(s.id)
            .await
            .map_err(failed("list_checkpoints"))?
            .iter()
            .map(|c| c.id)
            .collect();
        let expected: Vec<CheckpointId> = model
            .checkpoints
            .iter()
            .rev()
            .filter(|c| c.session == s.id)
            .map(|c| c.id)
            .collect();
        prop_assert_eq!(listed, expected, "checkpoints of session {}", s.id);
    }
    for c in &model.checkpoints {
        let loaded = store
            .load_messages_at_checkpoint(c.id, MessageFilter::default())
            .await
            .map_err(failed("load_messages_at_checkpoint"))?;
        prop_assert_eq!(texts(&loaded), numbered(&c.history), "checkpoint {}", c.id);
        let record = store
            .get_checkpoint(c.id)
            .await
            .map_err(failed("get_checkpoint"))?;
        let record = found(&format!("checkpoint {}", c.id), record)?;
        prop_assert_eq!(record.session_id, c.session);
        prop_assert_eq!(record.parent_id, c.parent, "parent of checkpoint {}", c.id);
        prop_assert_eq!(record.seq, c.history.len() as i64);
        let state = store
            .get_state_blob(record.state_hash)
            .await
            .map_err(failed("get_state_blob"))?;
        prop_assert_eq!(
            state.as_ref(),
            Some(&c.state),
            "state of checkpoint {}",
            c.id
        );
    }
    Ok(())
}

/// One sequence on `store`, in sessions of its own: the `run`-th.
async fn run(store: &Store, run: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let first = store
        .create_session(new_session(&format!("d-{run}"), 1))
        .await
        .map_err(failed("create_session"))?;
    let mut model = Model {
        sessions: vec![ModelSession {
            id: first.id,
            history: vec![],
            state: None,
        }],
        run,
        ..Model::default()
    };
    for (i, op) in ops.into_iter().enumerate() {
        apply(store, &mut model, op, 10 + i as i64).await?;
        check(store, &model).await?;
    }
    Ok(())
}

/// proptest's loop, awaited: each case runs, and a failing one shrinks
/// (simplify while it still fails, complicate back once it passes) to the
/// smallest sequence that fails, which the panic names.
pub async fn every_session_and_checkpoint_loads_the_models_history(db: TestDb) {
    let store = &db.store;
    let strategy = prop::collection::vec(op(), 1..24);
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    });
    let mut runs = 0;
    for _ in 0..CASES {
        let mut case = strategy.new_tree(&mut runner).unwrap();
        runs += 1;
        let Err(error) = run(store, runs, case.current()).await else {
            continue;
        };
        let mut smallest = (case.current(), error);
        let mut shrink_runs = 0;
        let mut more = case.simplify();
        while more && shrink_runs < MAX_SHRINK_RUNS {
            shrink_runs += 1;
            runs += 1;
            more = match run(store, runs, case.current()).await {
                Ok(()) => case.complicate(),
                Err(error) => {
                    smallest = (case.current(), error);
                    case.simplify()
                }
            };
        }
        let (ops, error) = smallest;
        panic!("{error}\nthe smallest failing sequence found: {ops:?}");
    }
}
