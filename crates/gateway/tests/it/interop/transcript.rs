//! Matching a resent history against dialogs, against a model: a dialog is
//! a list of turns (a user message, the assistant's messages, a checkpoint
//! after each turn); what a client holds is each user message followed by
//! the assistant's text of that turn, concatenated.

use keel_gateway::serve::interop::transcript::{
    place, Candidate, ForkPoint, Kept, Placement, Said, Speaker,
};
use proptest::prelude::*;

/// A turn: the user's text, the assistant messages' texts, and whether a
/// continuation answer (a text the client may not hold) followed.
#[derive(Debug, Clone)]
struct Turn {
    user: String,
    replies: Vec<String>,
    continuation: Option<String>,
}

fn text() -> impl Strategy<Value = String> {
    // A small alphabet, so that texts collide and concatenations could
    // be mistaken for one another.
    proptest::string::string_regex("[ab ]{0,3}").unwrap()
}

fn turn() -> impl Strategy<Value = Turn> {
    (
        "[ab]{1,3}",
        proptest::collection::vec(text(), 0..3),
        proptest::option::of("[ab]{1,2}"),
    )
        .prop_map(|(user, replies, continuation)| Turn {
            user,
            replies,
            continuation,
        })
}

/// The dialog of `turns` with its id: checkpoint `2k` after turn `k`
/// (1-based) and `2k + 1` after the continuation that answered it, if any.
fn dialog(id: u32, turns: &[Turn]) -> Candidate<u32, usize> {
    let mut history: Vec<Kept> = Vec::new();
    let mut checkpoints = Vec::new();
    let push = |history: &mut Vec<Kept>, speaker, text: &str, continuation| {
        let seq = history.len() as i64 + 1;
        history.push(Kept {
            seq,
            speaker,
            text: text.to_owned(),
            continuation,
        });
    };
    for (k, t) in turns.iter().enumerate() {
        push(&mut history, Speaker::User, &t.user, false);
        for r in &t.replies {
            push(&mut history, Speaker::Assistant, r, false);
        }
        let seq = history.len() as i64;
        checkpoints.push(ForkPoint {
            checkpoint: 2 * (k + 1),
            seq,
        });
        if let Some(c) = &t.continuation {
            push(&mut history, Speaker::Assistant, c, true);
            let seq = history.len() as i64;
            checkpoints.push(ForkPoint {
                checkpoint: 2 * (k + 1) + 1,
                seq,
            });
        }
    }
    Candidate {
        dialog: id,
        history,
        checkpoints,
    }
}

/// The newest checkpoint after the first `k` turns (`k` ≥ 1).
fn after(turns: &[Turn], k: usize) -> usize {
    2 * k + usize::from(turns[k - 1].continuation.is_some())
}

/// What a client holds of `turns`, with or without the continuation answers.
fn client_view(turns: &[Turn], with_continuations: bool) -> Vec<Said> {
    let mut out = Vec::new();
    for t in turns {
        out.push(Said::user(&t.user));
        let mut reply: String = t.replies.concat();
        if with_continuations {
            reply.push_str(t.continuation.as_deref().unwrap_or(""));
        }
        out.push(Said::assistant(reply));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The whole history, as the client holds it, continues the dialog.
    #[test]
    fn a_dialogs_own_history_continues_it(
        turns in proptest::collection::vec(turn(), 1..6),
        with_continuations in any::<bool>(),
    ) {
        let view = client_view(&turns, with_continuations);
        prop_assert_eq!(place(&view, &[dialog(1, &turns)]), Placement::Continue { dialog: 1 });
    }

    /// A history cut after turn `k` (a regenerate, an edited next message)
    /// forks at checkpoint `k` and imports nothing; cut before any turn,
    /// it starts a new dialog.
    #[test]
    fn a_cut_history_forks_where_it_ends(
        turns in proptest::collection::vec(turn(), 2..6),
        cut in 0usize..5,
        with_continuations in any::<bool>(),
    ) {
        let k = cut % turns.len();
        let view = client_view(&turns[..k], with_continuations);
        let got = place(&view, &[dialog(1, &turns)]);
        if k == 0 {
            prop_assert_eq!(got, Placement::Start { history: Vec::new() });
        } else {
            let checkpoint = after(&turns, k);
            prop_assert_eq!(got, Placement::Fork { dialog: 1, checkpoint, tail: Vec::new() });
        }
    }

    /// An edit in turn `k` (its user message or its answer) forks at the
    /// last checkpoint before it — or starts a new dialog when there is
    /// none — and imports exactly the client's messages after that point:
    /// nothing the dialog holds is duplicated, nothing is rewritten.
    #[test]
    fn an_edit_forks_before_it_and_imports_the_rest(
        turns in proptest::collection::vec(turn(), 1..6),
        at in 0usize..5,
        in_answer in any::<bool>(),
    ) {
        let k = at % turns.len();
        let mut view = client_view(&turns, true);
        let edited = if in_answer { 2 * k + 1 } else { 2 * k };
        view[edited].text.push('!');
        let got = place(&view, &[dialog(1, &turns)]);
        if k == 0 {
            prop_assert_eq!(got, Placement::Start { history: view.clone() });
        } else {
            prop_assert_eq!(
                got,
                Placement::Fork { dialog: 1, checkpoint: after(&turns, k), tail: view[2 * k..].to_vec() }
            );
        }
    }

    /// Among several dialogs the one whose history it is wins; otherwise the
    /// fork keeping the most; ties go to the dialog listed first.
    #[test]
    fn the_best_dialog_wins(
        turns in proptest::collection::vec(turn(), 2..5),
        other in proptest::collection::vec(turn(), 1..5),
    ) {
        let view = client_view(&turns, false);
        let own = dialog(2, &turns);
        let longer: Vec<Turn> = turns.iter().cloned().chain(other).collect();
        let ahead = dialog(1, &longer);
        prop_assert_eq!(
            place(&view, &[ahead.clone(), own.clone()]),
            Placement::Continue { dialog: 2 }
        );
        // Only the dialog that went on: a fork at the end of the shared turns.
        let checkpoint = after(&turns, turns.len());
        prop_assert_eq!(
            place(&view, std::slice::from_ref(&ahead)),
            Placement::Fork { dialog: 1, checkpoint, tail: Vec::new() }
        );
        prop_assert_eq!(
            place(&view, &[ahead.clone(), dialog(3, &longer)]),
            Placement::Fork { dialog: 1, checkpoint, tail: Vec::new() }
        );
    }
}

#[test]
fn a_history_shared_with_no_dialog_starts_a_new_one() {
    let turns = [Turn {
        user: "a".into(),
        replies: vec!["b".into()],
        continuation: None,
    }];
    let view = vec![Said::user("x"), Said::assistant("y")];
    assert_eq!(
        place(&view, &[dialog(1, &turns)]),
        Placement::Start {
            history: view.clone()
        }
    );
    assert_eq!(
        place::<u32, usize>(&view, &[]),
        Placement::Start { history: view }
    );
}
