//! Compaction: a slot's summary replaces its older history in every mode,
//! `/compact` makes one now, requests stay under the agent's context budget,
//! a "context too long" refusal compacts and retries once, and a rollback
//! across a compaction point restores the context the checkpoint had.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use keel_core::{ChatRequest, ScriptedErrorKind, ScriptedProvider, ScriptedResponse, ToolRegistry};
use keel_engine::{
    estimate_request_tokens, RuntimeBundle, SessionManager, SessionManagerConfig, SummaryConfig,
};
use parking_lot::Mutex;

use crate::common::*;

const SUMMARY_PROMPT: &str = "Summarize the conversation";

fn is_summary(request: &ChatRequest) -> bool {
    request.messages[0].text().starts_with(SUMMARY_PROMPT)
}

/// Answers turns from `turns` and summary requests from `summaries`, and
/// records every request.
struct Routed {
    turns: ScriptedProvider,
    summaries: ScriptedProvider,
    requests: Mutex<Vec<ChatRequest>>,
}

impl Routed {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            turns: ScriptedProvider::new(Vec::<ScriptedResponse>::new()),
            summaries: ScriptedProvider::new(Vec::<ScriptedResponse>::new()),
            requests: Mutex::new(Vec::new()),
        })
    }

    /// The turn requests (not the summaries), as role: text lines.
    fn turn_requests(&self) -> Vec<Vec<String>> {
        self.requests
            .lock()
            .iter()
            .filter(|r| !is_summary(r))
            .map(|r| {
                r.messages
                    .iter()
                    .skip(1) // the system prompt
                    .map(|m| format!("{}: {}", m.role.as_str(), m.text()))
                    .collect()
            })
            .collect()
    }

    fn summary_requests(&self) -> usize {
        self.requests
            .lock()
            .iter()
            .filter(|r| is_summary(r))
            .count()
    }
}

#[async_trait::async_trait]
impl keel_core::Provider for Routed {
    fn name(&self) -> &str {
        "routed"
    }
    fn model(&self) -> &str {
        "routed"
    }
    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<keel_core::ProviderStream, keel_core::ProviderError> {
        self.requests.lock().push(request.clone());
        if is_summary(request) {
            self.summaries.stream(request, cancel).await
        } else {
            self.turns.stream(request, cancel).await
        }
    }
}

fn routed_manager(
    provider: Arc<dyn keel_core::Provider>,
    window: usize,
    summary: Option<SummaryConfig>,
) -> (tempfile::TempDir, Arc<SessionManager>) {
    let dir = tempfile::tempdir().unwrap();
    let mut root = profile(
        "root",
        &ScriptedProvider::new(Vec::<ScriptedResponse>::new()),
        ToolRegistry::new(),
    );
    root.provider = provider;
    root.context_window_tokens = window;
    let manager = SessionManager::new(
        open_store(dir.path()),
        RuntimeBundle::new(root),
        SessionManagerConfig {
            summary,
            ..Default::default()
        },
    );
    (dir, manager)
}

#[tokio::test]
async fn a_full_slot_replays_the_summary_and_the_turns_after_its_point() {
    let p = Routed::new();
    replies(&p.turns, &["a1", "a2", "a3", "a4"]);
    replies(&p.summaries, &["They said hello twice."]);
    let (_dir, m) = routed_manager(p.clone(), 100_000, None);
    let id = m.create(spec("d1")).await.unwrap();
    m.submit_turn(id, "q1").await.unwrap();
    m.submit_turn(id, "q2").await.unwrap();
    let before = m.list_checkpoints(id).await.unwrap();
    assert!(m.compact(id).await.unwrap());
    // Nothing new since: no second summary, no model call.
    assert!(!m.compact(id).await.unwrap());
    assert_eq!(p.summary_requests(), 1);
    m.submit_turn(id, "q3").await.unwrap();
    assert_eq!(
        p.turn_requests().last().unwrap(),
        &[
            "system: Summary of the earlier conversation:\nThey said hello twice.",
            "user: q3"
        ]
    );
    // The full history stays; a rollback to a checkpoint before the
    // summary replays the history it had.
    assert_eq!(
        visible_texts(&m, id).await,
        ["q1", "a1", "q2", "a2", "q3", "a3"]
    );
    let first = before.last().unwrap();
    m.rollback(id, first.id).await.unwrap();
    m.submit_turn(id, "q4").await.unwrap();
    assert_eq!(
        p.turn_requests().last().unwrap(),
        &["user: q1", "assistant: a1", "user: q4"]
    );
}

/// After a turn, a summary is due past the ratio (debounced; a failure
/// never fails the turn) and leaves the newest messages as they are; a
/// request that would not fit the budget is compacted before it is sent,
/// debounce or not.
#[tokio::test]
async fn summaries_follow_the_ratio_and_a_request_over_the_budget_is_compacted_first() {
    let p = Routed::new();
    replies(&p.turns, &["answer one", "answer two", "answer three"]);
    p.summaries.push([
        ScriptedResponse::error(ScriptedErrorKind::Server, "summary model down"),
        ScriptedResponse::text("The user asked once."),
        ScriptedResponse::text("Two questions so far."),
    ]);
    // A budget of 40 estimated tokens; past half of it a summary is due
    // (after every turn here), at most every second turn; the newest 10
    // tokens stay as they are.
    let summary = SummaryConfig {
        trigger_ratio: 0.5,
        debounce_turns: 2,
    };
    let (_dir, m) = routed_manager(p.clone(), 40, Some(summary));
    let id = m.create(spec("d1")).await.unwrap();
    let slot_summary = |m: &Arc<SessionManager>| {
        let s = m.get(id).unwrap();
        let g = s.try_lock().unwrap();
        (
            g.state().slots["default"].summary.clone(),
            g.state().last_summary_turn,
        )
    };
    // Turn 1: its summary fails: logged, the turn stands.
    m.submit_turn(id, "question one").await.unwrap();
    m.housekeeping_settled(id).await;
    assert_eq!(slot_summary(&m), (None, None));
    // Turn 2: turn 1 is summarized, turn 2 stays as it is.
    m.submit_turn(id, "question two").await.unwrap();
    m.housekeeping_settled(id).await;
    assert_eq!(
        slot_summary(&m),
        (Some("The user asked once.".into()), Some(2))
    );
    // Turn 3: no summary is due after turn 2 (debounced), but summary +
    // turn 2 + question three would be 49 tokens: compacted before the call.
    m.submit_turn(id, "question three").await.unwrap();
    m.housekeeping_settled(id).await;
    let requests = p.requests.lock().clone();
    assert_eq!(
        requests.last().unwrap().messages[1..]
            .iter()
            .map(|m| m.text())
            .collect::<Vec<_>>(),
        [
            "Summary of the earlier conversation:\nTwo questions so far.",
            "question three"
        ]
    );
    // That summary folded the first one in, with turn 2.
    let folded = requests.iter().rev().find(|r| is_summary(r)).unwrap();
    assert!(folded.messages[0].text().ends_with(
        "The user asked once.\n\nWhat followed:\nuser: question two\nassistant: answer two\n"
    ));
    assert_eq!(p.summary_requests(), 3);
    assert_eq!(p.summaries.remaining(), 0);
}

/// Answers every turn at once and every summary with a short text; records
/// the largest request of each kind.
struct Measured {
    turns: AtomicUsize,
    largest: AtomicUsize,
    summaries: AtomicUsize,
}

#[async_trait::async_trait]
impl keel_core::Provider for Measured {
    fn name(&self) -> &str {
        "measured"
    }
    fn model(&self) -> &str {
        "measured"
    }
    async fn stream(
        &self,
        request: &ChatRequest,
        cancel: tokio_util::sync::CancellationToken,
    ) -> Result<keel_core::ProviderStream, keel_core::ProviderError> {
        self.largest
            .fetch_max(estimate_request_tokens(request), Ordering::Relaxed);
        let text = if is_summary(request) {
            let n = self.summaries.fetch_add(1, Ordering::Relaxed) + 1;
            format!("Summary {n}: the user asked numbered questions and got numbered answers.")
        } else {
            let n = self.turns.fetch_add(1, Ordering::Relaxed) + 1;
            format!("Answer {n}. {}", "Some words of the answer. ".repeat(6))
        };
        ScriptedProvider::new([ScriptedResponse::text(text)])
            .stream(request, cancel)
            .await
    }
}

/// 500 turns through a 1,000-token window (output cap 100): no request is
/// ever over the budget, and every turn is answered.
#[tokio::test]
async fn a_500_turn_dialog_never_sends_a_request_over_the_budget() {
    let p = Arc::new(Measured {
        turns: AtomicUsize::new(0),
        largest: AtomicUsize::new(0),
        summaries: AtomicUsize::new(0),
    });
    let dir = tempfile::tempdir().unwrap();
    let mut root = profile(
        "root",
        &ScriptedProvider::new(Vec::<ScriptedResponse>::new()),
        ToolRegistry::new(),
    );
    root.provider = p.clone();
    root.context_window_tokens = 1_000;
    root.max_output_tokens = Some(100);
    let m = SessionManager::new(
        open_store(dir.path()),
        RuntimeBundle::new(root),
        SessionManagerConfig {
            auto_title_after: 0,
            ..Default::default()
        },
    );
    let id = m.create(spec("d1")).await.unwrap();
    for n in 1..=500 {
        let question = format!("Question {n}: {}", "tell me more about it, ".repeat(4));
        let report = m.submit_turn(id, &question).await.unwrap();
        assert!(
            report.output.final_text().starts_with("Answer "),
            "turn {n}"
        );
        assert!(
            p.largest.load(Ordering::Relaxed) <= 900,
            "turn {n} sent {} tokens",
            p.largest.load(Ordering::Relaxed)
        );
    }
    m.housekeeping_settled(id).await;
    assert_eq!(p.turns.load(Ordering::Relaxed), 500);
    assert!(p.summaries.load(Ordering::Relaxed) > 10);
    // The history is whole in SQLite.
    assert_eq!(m.record(id).await.unwrap().message_count, 500);
    assert_eq!(visible_texts(&m, id).await.len(), 1000);
}

#[tokio::test]
async fn a_context_length_refusal_compacts_and_retries_once() {
    let p = Routed::new();
    p.turns.push([
        ScriptedResponse::text("a1"),
        ScriptedResponse::error(
            ScriptedErrorKind::ContextLengthExceeded,
            "prompt is too long",
        ),
        ScriptedResponse::text("a2"),
        ScriptedResponse::error(
            ScriptedErrorKind::ContextLengthExceeded,
            "prompt is too long",
        ),
        ScriptedResponse::error(ScriptedErrorKind::ContextLengthExceeded, "still too long"),
    ]);
    replies(
        &p.summaries,
        &["Earlier: q1 and a1.", "Earlier: q1, a1, q2, a2."],
    );
    let (_dir, m) = routed_manager(p.clone(), 100_000, None);
    let id = m.create(spec("d1")).await.unwrap();
    m.submit_turn(id, "q1").await.unwrap();
    // Refused once: compacted, rerun, answered.
    let report = m.submit_turn(id, "q2").await.unwrap();
    assert_eq!(report.output.final_text(), "a2");
    assert_eq!(
        p.turn_requests().last().unwrap(),
        &[
            "system: Summary of the earlier conversation:\nEarlier: q1 and a1.",
            "user: q2"
        ]
    );
    // Refused twice: one rerun only; the message stays, unanswered.
    let err = m.submit_turn(id, "q3").await.unwrap_err();
    assert!(err.to_string().contains("still too long"), "{err}");
    assert_eq!(unanswered(&m, id).await, ["q3"]);
    assert_eq!(p.summary_requests(), 2);
    assert_eq!(visible_texts(&m, id).await, ["q1", "a1", "q2", "a2", "q3"]);
}
