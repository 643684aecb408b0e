//! [`AgentSession`]: one session's in-memory state (its record, checkpointed
//! state and history) and the commit of a turn into the store.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_core::{CheckpointId, Message, Provider, SessionId, ToolRegistry};
use keel_store::{
    ApprovalResultCommit, CheckpointSource, ContinuationCommit, InputState, LeasedEvents,
    MessageFilter, NewApproval, NewCheckpoint, NewMessage, NoticeCommit, OpenTurn,
    PausedTurnCommit, SessionHead, SessionRecord, Store, TurnCalls, TurnCommit,
};

use crate::agent_loop::TurnOutput;
use crate::error::{EngineError, Result};
use crate::state::{HistoryMessage, MemoryEntry, SessionState, SlotMode};

/// What a session runs with: an agent's prompt, model and tools.
pub struct AgentProfile {
    /// The agent's name (`root` for the root agent).
    pub name: keel_core::AgentId,
    /// The role prompt sent first in every request.
    pub system_prompt: String,
    /// The model.
    pub provider: Arc<dyn Provider>,
    /// The tools the model may call.
    pub tools: Arc<ToolRegistry>,
    /// Most provider calls per turn.
    pub max_iterations: u32,
    /// Output token cap per provider call.
    pub max_output_tokens: Option<u32>,
    /// The model's context window: requests are kept under it less
    /// `max_output_tokens` by compacting older history.
    pub context_window_tokens: usize,
    /// The tools whose calls wait for a person's approval.
    pub approval: crate::ApprovalPolicy,
    /// What its profile's tokens cost (`price_input_per_mtok`,
    /// `price_output_per_mtok`), for cost budgets; `None`: unpriced.
    pub prices: Option<keel_core::Prices>,
}

impl std::fmt::Debug for AgentProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentProfile")
            .field("name", &self.name)
            .field("provider", &self.provider.name())
            .field("model", &self.provider.model())
            .field("tools", &self.tools)
            .finish_non_exhaustive()
    }
}

/// What a session commit does to the inbox in the same transaction.
enum InboxEffect {
    /// Nothing.
    None,
    /// Consumes the events the turn answered.
    Consume(Vec<LeasedEvents>),
    /// Marks dead letters told (the commit is their notice).
    Tell(Vec<keel_core::EventId>),
    /// The turn paused: its gated calls wait for approval (and it consumes
    /// the steered events it read).
    Pause {
        turn_id: keel_core::TurnId,
        approvals: Vec<NewApproval>,
        consumed: Vec<LeasedEvents>,
    },
    /// Tool results settle these approvals (superseding them with the reason).
    Settle {
        approvals: Vec<keel_core::ApprovalId>,
        supersede: Option<String>,
    },
}

/// What a finished turn commits.
pub(crate) struct FinishedTurn<'a> {
    /// The slot it ran in.
    pub(crate) slot: &'a str,
    /// What the loop produced, its input first.
    pub(crate) output: &'a TurnOutput,
    /// How many leading messages of `output` are its input, committed
    /// before the model was called.
    pub(crate) committed_inputs: usize,
    /// The seqs of that input, marked answered by the commit.
    pub(crate) answers: &'a [i64],
    /// The inbox events it answered, consumed by the commit.
    pub(crate) consumed: Vec<LeasedEvents>,
    /// The session memory its tools left, if they changed it.
    pub(crate) memory: Option<BTreeMap<String, MemoryEntry>>,
    /// The turn paused for these approvals (committed with it).
    pub(crate) paused: Option<(keel_core::TurnId, Vec<NewApproval>)>,
    /// The root turn it is (its calls are stored under this id).
    pub(crate) turn_id: keel_core::TurnId,
}

/// A session loaded in memory.
#[derive(Debug)]
pub struct AgentSession {
    pub(crate) record: SessionRecord,
    pub(crate) agent: Arc<AgentProfile>,
    pub(crate) state: SessionState,
    pub(crate) history: Vec<HistoryMessage>,
    pub(crate) last_seq: i64,
}

impl AgentSession {
    /// Loads a session from the store (its head state and history).
    pub(crate) async fn load(
        store: &Store,
        record: SessionRecord,
        agent: Arc<AgentProfile>,
    ) -> Result<Self> {
        let state = SessionState::of_record(store, &record).await?;
        let history: Vec<HistoryMessage> = store
            .load_messages(record.id, MessageFilter::default())
            .await?
            .into_iter()
            .map(|m| HistoryMessage {
                seq: m.seq,
                slot: m.slot,
                message: Arc::new(m.message),
                created_at_ms: m.created_at_ms,
                input_state: m.input_state,
            })
            .collect();
        let last_seq = store.last_seq(record.id).await?;
        Ok(Self {
            record,
            agent,
            state,
            history,
            last_seq,
        })
    }

    /// The session id.
    pub fn id(&self) -> SessionId {
        self.record.id
    }

    /// The stored record (title, dialog address, counters …) as of the last
    /// change made through this session.
    pub fn record(&self) -> &SessionRecord {
        &self.record
    }

    /// The agent this session runs.
    pub fn agent(&self) -> &Arc<AgentProfile> {
        &self.agent
    }

    /// The checkpointed state (turn index, cost, slots, memory).
    pub fn state(&self) -> &SessionState {
        &self.state
    }

    /// Completed turns.
    pub fn turn_index(&self) -> u32 {
        self.state.turn_index
    }

    /// Every message of the current history, all slots, hidden included.
    pub fn history(&self) -> &[HistoryMessage] {
        &self.history
    }

    /// The messages slot `name` replays to the model.
    pub fn replay(&self, slot: &str) -> Result<Vec<Arc<Message>>> {
        self.state.replay(slot, &self.history)
    }

    /// Visible messages of the current slot (what a client shows).
    pub fn visible_messages(&self) -> Result<Vec<&HistoryMessage>> {
        Ok(self
            .state
            .slot_view(&self.state.current_slot, &self.history)?
            .into_iter()
            .filter(|m| m.message.visibility == keel_core::ClientVisibility::Visible)
            .collect())
    }

    /// Visible user messages of the current slot whose turn never answered
    /// them (failed, cancelled or interrupted), oldest first.
    pub fn unanswered(&self) -> Result<Vec<&HistoryMessage>> {
        Ok(self
            .visible_messages()?
            .into_iter()
            .filter(|m| m.input_state == Some(InputState::Unanswered))
            .collect())
    }

    /// Sets the input state of the history messages at `seqs` (in memory).
    pub(crate) fn set_input_state(&mut self, seqs: &[i64], state: InputState) {
        for m in self.history.iter_mut().rev() {
            if seqs.contains(&m.seq) {
                m.input_state = Some(state);
            }
        }
    }

    /// Commits a turn's input on its own, before the model is called: it is
    /// durable and visible from now on, `open` until the turn ends (and off
    /// the queue, for the input of turn `queued`). An input an earlier turn
    /// left open is unanswered from now on. Returns the seqs.
    pub(crate) async fn open_turn(
        &mut self,
        store: &Store,
        slot: &str,
        input: &[Message],
        queued: Option<keel_core::TurnId>,
    ) -> Result<Vec<i64>> {
        let now = keel_core::time::now_ms();
        let seqs = store
            .open_turn(OpenTurn {
                session_id: self.record.id,
                messages: input
                    .iter()
                    .map(|m| NewMessage::in_slot(slot, m.clone()))
                    .collect(),
                expected_head: Some(SessionHead {
                    timeline: self.record.head_timeline_id.clone(),
                    last_seq: self.last_seq,
                }),
                queued,
                now_ms: now,
            })
            .await?;
        for m in &mut self.history {
            if m.input_state == Some(InputState::Open) {
                m.input_state = Some(InputState::Unanswered);
            }
        }
        for (message, seq) in input.iter().zip(&seqs) {
            self.history.push(HistoryMessage {
                seq: *seq,
                slot: slot.to_owned(),
                message: Arc::new(message.clone()),
                created_at_ms: now,
                input_state: Some(InputState::Open),
            });
            self.last_seq = self.last_seq.max(*seq);
        }
        let visible = input.iter().filter(|m| m.is_visible_user_input()).count();
        self.record.message_count += visible as u64;
        self.record.last_active_at_ms = now;
        Ok(seqs)
    }

    /// Marks the open inputs at `seqs` unanswered: their turn ended without
    /// an answer. Memory changes even when the store fails (the next turn's
    /// input commit closes them there).
    pub(crate) async fn mark_unanswered(&mut self, store: &Store, seqs: &[i64]) -> Result<()> {
        self.set_input_state(seqs, InputState::Unanswered);
        store.mark_unanswered(self.record.id, seqs.to_vec()).await?;
        Ok(())
    }

    /// Checks that a turn may run in the current slot.
    pub(crate) fn writable_slot(&self) -> Result<String> {
        let slot = self.state.current_slot.clone();
        if self.state.slot(&slot)?.mode == SlotMode::Readonly {
            return Err(EngineError::SlotReadonly(slot));
        }
        Ok(slot)
    }

    /// Commits `messages` (each with its slot) with `state` (and a
    /// checkpoint when `checkpoint` is set) in one store transaction, marking
    /// the open inputs `answers` answered, then applies it in memory. On
    /// error nothing changes. Returns the seqs and the checkpoint.
    pub(crate) async fn commit(
        &mut self,
        store: &Store,
        messages: Vec<(String, Message)>,
        state: SessionState,
        checkpoint: Option<CheckpointSource>,
        answers: &[i64],
    ) -> Result<(Vec<i64>, Option<CheckpointId>)> {
        self.commit_with(
            store,
            messages,
            state,
            checkpoint,
            answers,
            InboxEffect::None,
        )
        .await
    }

    /// [`Self::commit`], with what the same transaction does to the inbox.
    async fn commit_with(
        &mut self,
        store: &Store,
        messages: Vec<(String, Message)>,
        state: SessionState,
        checkpoint: Option<CheckpointSource>,
        answers: &[i64],
        inbox: InboxEffect,
    ) -> Result<(Vec<i64>, Option<CheckpointId>)> {
        self.commit_calls(store, messages, state, checkpoint, answers, inbox, None)
            .await
    }

    /// [`Self::commit_with`], storing a root turn's `calls` with it.
    #[allow(clippy::too_many_arguments)]
    async fn commit_calls(
        &mut self,
        store: &Store,
        messages: Vec<(String, Message)>,
        state: SessionState,
        checkpoint: Option<CheckpointSource>,
        answers: &[i64],
        inbox: InboxEffect,
        calls: Option<TurnCalls>,
    ) -> Result<(Vec<i64>, Option<CheckpointId>)> {
        let now = keel_core::time::now_ms();
        let visible_user_inputs = messages
            .iter()
            .filter(|(_, m)| m.is_visible_user_input())
            .count();
        let checkpoint = checkpoint.map(|source| NewCheckpoint {
            id: CheckpointId::new(),
            turn_index: u64::from(state.turn_index),
            source,
        });
        let turn = TurnCommit {
            calls,
            session_id: self.record.id,
            messages: messages
                .iter()
                .map(|(slot, message)| NewMessage::in_slot(slot, message.clone()))
                .collect(),
            state: state.to_blob()?,
            checkpoint,
            visible_user_inputs: u32::try_from(visible_user_inputs).unwrap_or(u32::MAX),
            answers: answers.to_vec(),
            // Two writers can never silently interleave on one session:
            // the commit is refused if the history moved since this load.
            expected_head: Some(SessionHead {
                timeline: self.record.head_timeline_id.clone(),
                last_seq: self.last_seq,
            }),
            now_ms: now,
        };
        let committed = match inbox {
            InboxEffect::None => store.commit_turn(turn).await?,
            InboxEffect::Consume(consumed) => {
                store
                    .commit_continuation_turn(ContinuationCommit { turn, consumed })
                    .await?
                    .turn
            }
            InboxEffect::Tell(event_ids) => {
                store
                    .commit_dead_letter_notice(NoticeCommit { turn, event_ids })
                    .await?
            }
            InboxEffect::Pause {
                turn_id,
                approvals,
                consumed,
            } => {
                store
                    .commit_paused_turn(PausedTurnCommit {
                        turn,
                        turn_id,
                        approvals,
                        consumed,
                    })
                    .await?
            }
            InboxEffect::Settle {
                approvals,
                supersede,
            } => {
                store
                    .commit_approval_results(ApprovalResultCommit {
                        turn,
                        settle: approvals,
                        supersede,
                    })
                    .await?
            }
        };
        for ((slot, message), seq) in messages.into_iter().zip(&committed.seqs) {
            self.history.push(HistoryMessage {
                seq: *seq,
                slot,
                message: Arc::new(message),
                created_at_ms: now,
                input_state: None,
            });
            self.last_seq = self.last_seq.max(*seq);
        }
        self.set_input_state(answers, InputState::Answered);
        self.state = state;
        self.record.state_hash = Some(committed.state_hash);
        self.record.message_count += visible_user_inputs as u64;
        self.record.last_active_at_ms = now;
        Ok((committed.seqs, committed.checkpoint.map(|c| c.id)))
    }

    /// Appends `notice` (a system message about undeliverable background
    /// results) to the current slot and marks the dead-lettered `events` told,
    /// in one transaction.
    pub(crate) async fn commit_notice(
        &mut self,
        store: &Store,
        notice: Message,
        events: Vec<keel_core::EventId>,
    ) -> Result<()> {
        let slot = self.state.current_slot.clone();
        let state = self.state.clone();
        self.commit_with(
            store,
            vec![(slot, notice)],
            state,
            None,
            &[],
            InboxEffect::Tell(events),
        )
        .await?;
        Ok(())
    }

    /// Appends the tool results answering `approvals` to the current slot
    /// and settles them (superseding pending ones with `supersede`), in one
    /// transaction; the state is unchanged and no checkpoint is taken.
    pub(crate) async fn commit_approval_results(
        &mut self,
        store: &Store,
        results: Vec<Message>,
        approvals: Vec<keel_core::ApprovalId>,
        supersede: Option<String>,
    ) -> Result<()> {
        let slot = self.state.current_slot.clone();
        let state = self.state.clone();
        let messages = results.into_iter().map(|m| (slot.clone(), m)).collect();
        self.commit_with(
            store,
            messages,
            state,
            None,
            &[],
            InboxEffect::Settle {
                approvals,
                supersede,
            },
        )
        .await?;
        Ok(())
    }

    /// Applies a finished turn: the state after it (with the session memory
    /// its tools left, if they changed it) and the commit of its
    /// messages, which also answers its committed input and consumes the
    /// inbox events it answered.
    pub(crate) async fn commit_turn(
        &mut self,
        store: &Store,
        turn: FinishedTurn<'_>,
        auto_checkpoint: bool,
    ) -> Result<Option<CheckpointId>> {
        let FinishedTurn {
            slot,
            output,
            committed_inputs,
            answers,
            consumed,
            memory,
            paused,
            turn_id,
        } = turn;
        let mut state = self.state.clone();
        if let Some(memory) = memory {
            state.memory = memory;
        }
        state.turn_index = state.turn_index.saturating_add(1);
        state.cost.merge(&keel_core::CostTracker {
            prompt_tokens: output.usage.prompt_tokens,
            completion_tokens: output.usage.completion_tokens,
            requests: u64::from(output.iterations),
        });
        let checkpoint = auto_checkpoint.then_some(CheckpointSource::Turn);
        let messages = output
            .messages
            .iter()
            .skip(committed_inputs)
            .map(|m| (slot.to_owned(), m.clone()))
            .collect();
        let inbox = match paused {
            Some((turn_id, approvals)) => InboxEffect::Pause {
                turn_id,
                approvals,
                consumed,
            },
            None if consumed.is_empty() => InboxEffect::None,
            None => InboxEffect::Consume(consumed),
        };
        let calls = TurnCalls {
            turn_id,
            spans: output.calls.clone(),
        };
        let (_, checkpoint) = self
            .commit_calls(
                store,
                messages,
                state,
                checkpoint,
                answers,
                inbox,
                Some(calls),
            )
            .await?;
        Ok(checkpoint)
    }
}
