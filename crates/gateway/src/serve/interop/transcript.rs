//! What a chat client sees of a conversation, and how the history it
//! resends is matched against a keel dialog's.
//!
//! A client sees user messages and the assistant's text; keel's tool calls
//! and results stay inside keel. So both histories are reduced to
//! *exchanges*: a user message and the assistant text that followed it
//! (the text of every assistant message until the next user message,
//! concatenated without separator — exactly what a client was streamed).
//! Text an assistant message of a continuation turn added (a turn that
//! answered background results, which a client only sees when it listens
//! for them) may be present in the client's copy or not.
//!
//! A resent history either is the dialog's ([`Placement::Continue`]), or
//! shares a prefix ending at one of the dialog's checkpoints, after which
//! the client's messages differ or go on ([`Placement::Fork`]: the dialog
//! is forked there and the client's remaining messages imported), or
//! shares nothing ([`Placement::Start`]: a new dialog with the client's
//! history imported). A history is never rewritten and never duplicated.

use std::collections::BTreeSet;

/// Who said a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaker {
    /// The user.
    User,
    /// The assistant.
    Assistant,
}

/// A message of a client's history: who said it, and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Said {
    /// Who.
    pub speaker: Speaker,
    /// The text.
    pub text: String,
}

impl Said {
    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self {
            speaker: Speaker::User,
            text: text.into(),
        }
    }

    /// An assistant message.
    pub fn assistant(text: impl Into<String>) -> Self {
        Self {
            speaker: Speaker::Assistant,
            text: text.into(),
        }
    }
}

/// A message of a keel dialog's visible history (tool messages left out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// Its position in the dialog's history.
    pub seq: i64,
    /// Who said it.
    pub speaker: Speaker,
    /// The text.
    pub text: String,
    /// Whether a continuation turn produced it.
    pub continuation: bool,
}

/// A checkpoint of a dialog's current branch: its id and the last
/// position of the history it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForkPoint<C> {
    /// The checkpoint.
    pub checkpoint: C,
    /// The seq of the last message it holds.
    pub seq: i64,
}

/// A dialog a history may belong to.
#[derive(Debug, Clone)]
pub struct Candidate<D, C> {
    /// The dialog.
    pub dialog: D,
    /// Its visible history, in order.
    pub history: Vec<Kept>,
    /// The checkpoints of its current branch.
    pub checkpoints: Vec<ForkPoint<C>>,
}

/// Where a resent history goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement<D, C> {
    /// The history is the dialog's: the new input goes there.
    Continue {
        /// The dialog.
        dialog: D,
    },
    /// Fork `dialog` at `checkpoint`, import `tail`, then send the input.
    Fork {
        /// The dialog forked.
        dialog: D,
        /// The last checkpoint whose history the client's begins with.
        checkpoint: C,
        /// The client's messages after that checkpoint.
        tail: Vec<Said>,
    },
    /// A new dialog with `history` imported, then the input.
    Start {
        /// The client's whole history.
        history: Vec<Said>,
    },
}

/// A piece of assistant text in a reply, which a client's copy may leave out.
#[derive(Debug, Clone)]
struct Segment<'a> {
    text: &'a str,
    optional: bool,
}

/// A user message (none for text before the first one) and the reply.
#[derive(Debug, Clone)]
struct Exchange<'a> {
    user: Option<&'a str>,
    reply: Vec<Segment<'a>>,
}

/// The client's exchanges, each with the index of its first message.
fn client_exchanges(history: &[Said]) -> Vec<(usize, Exchange<'_>)> {
    let mut out = vec![(
        0,
        Exchange {
            user: None,
            reply: Vec::new(),
        },
    )];
    for (i, said) in history.iter().enumerate() {
        match said.speaker {
            Speaker::User => out.push((
                i,
                Exchange {
                    user: Some(&said.text),
                    reply: Vec::new(),
                },
            )),
            Speaker::Assistant => push_text(
                &mut out.last_mut().expect("never empty").1,
                &said.text,
                false,
            ),
        }
    }
    out
}

/// A dialog's exchanges.
fn dialog_exchanges(history: &[Kept]) -> Vec<Exchange<'_>> {
    let mut out = vec![Exchange {
        user: None,
        reply: Vec::new(),
    }];
    for kept in history {
        match kept.speaker {
            Speaker::User => out.push(Exchange {
                user: Some(&kept.text),
                reply: Vec::new(),
            }),
            Speaker::Assistant => push_text(
                out.last_mut().expect("never empty"),
                &kept.text,
                kept.continuation,
            ),
        }
    }
    out
}

fn push_text<'a>(exchange: &mut Exchange<'a>, text: &'a str, optional: bool) {
    if !text.is_empty() {
        exchange.reply.push(Segment { text, optional });
    }
}

/// Whether `text` is the concatenation of `segments`, each optional one
/// included or not.
fn reply_matches(segments: &[Segment<'_>], text: &str) -> bool {
    let target = text.as_bytes();
    let mut at = BTreeSet::from([0usize]);
    for segment in segments {
        let piece = segment.text.as_bytes();
        let mut next: BTreeSet<usize> = at
            .iter()
            .filter(|&&p| target[p..].starts_with(piece))
            .map(|&p| p + piece.len())
            .collect();
        if segment.optional {
            next.extend(at.iter().copied());
        }
        if next.is_empty() {
            return false;
        }
        at = next;
    }
    at.contains(&target.len())
}

/// Whether a dialog's exchange is what the client holds.
fn same_exchange(dialog: &Exchange<'_>, client: &Exchange<'_>) -> bool {
    if dialog.user != client.user {
        return false;
    }
    let text: String = client.reply.iter().map(|s| s.text).collect();
    reply_matches(&dialog.reply, &text)
}

/// How many of the client's messages a dialog history holds when the
/// client's history begins with it; `None` when it does not.
fn covered(
    dialog: &[Exchange<'_>],
    client: &[(usize, Exchange<'_>)],
    total: usize,
) -> Option<usize> {
    if dialog.len() > client.len() {
        return None;
    }
    let all_same = dialog
        .iter()
        .zip(client)
        .all(|(d, (_, c))| same_exchange(d, c));
    all_same.then(|| client.get(dialog.len()).map_or(total, |(start, _)| *start))
}

/// Decides where `history` (a client's messages before its new input)
/// goes among `candidates`, listed most preferred first (the most recently
/// active dialog first): the first dialog whose history it is; otherwise
/// the fork that keeps the most of the client's messages (ties: the
/// earlier candidate, then the newer checkpoint); otherwise a new dialog.
pub fn place<D: Clone, C: Clone>(
    history: &[Said],
    candidates: &[Candidate<D, C>],
) -> Placement<D, C> {
    let client = client_exchanges(history);
    for candidate in candidates {
        let dialog = dialog_exchanges(&candidate.history);
        if dialog.len() == client.len() && covered(&dialog, &client, history.len()).is_some() {
            return Placement::Continue {
                dialog: candidate.dialog.clone(),
            };
        }
    }
    let mut best: Option<(usize, &Candidate<D, C>, &C)> = None;
    for candidate in candidates {
        let mut points: Vec<&ForkPoint<C>> = candidate.checkpoints.iter().collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.seq));
        for point in points {
            let upto = candidate.history.partition_point(|k| k.seq <= point.seq);
            let dialog = dialog_exchanges(&candidate.history[..upto]);
            if let Some(n) = covered(&dialog, &client, history.len()) {
                if n > 0 && best.as_ref().is_none_or(|(m, _, _)| n > *m) {
                    best = Some((n, candidate, &point.checkpoint));
                }
                // Older checkpoints of this dialog hold less.
                break;
            }
        }
    }
    match best {
        Some((n, candidate, checkpoint)) => Placement::Fork {
            dialog: candidate.dialog.clone(),
            checkpoint: checkpoint.clone(),
            tail: history[n..].to_vec(),
        },
        None => Placement::Start {
            history: history.to_vec(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(seq: i64, speaker: Speaker, text: &str) -> Kept {
        Kept {
            seq,
            speaker,
            text: text.to_owned(),
            continuation: false,
        }
    }

    #[test]
    fn a_reply_matches_with_or_without_its_optional_segments() {
        let seg = |text, optional| Segment { text, optional };
        let reply = [seg("ab", false), seg("cd", true), seg("ef", false)];
        assert!(reply_matches(&reply, "abcdef"));
        assert!(reply_matches(&reply, "abef"));
        assert!(!reply_matches(&reply, "abcd"));
        assert!(!reply_matches(&reply, "cdef"));
        assert!(reply_matches(&[], ""));
        assert!(!reply_matches(&[], "x"));
        // Multi-byte text never splits a character.
        assert!(reply_matches(&[seg("é", false), seg("ü", true)], "é"));
    }

    #[test]
    fn a_continuation_the_client_never_saw_still_matches() {
        let mut answer = kept(4, Speaker::Assistant, " later");
        answer.continuation = true;
        let candidate = Candidate {
            dialog: "d",
            history: vec![
                kept(1, Speaker::User, "u1"),
                kept(2, Speaker::Assistant, "a1"),
                answer,
            ],
            checkpoints: vec![ForkPoint {
                checkpoint: "c1",
                seq: 2,
            }],
        };
        for seen in ["a1", "a1 later"] {
            let history = [Said::user("u1"), Said::assistant(seen)];
            assert_eq!(
                place(&history, std::slice::from_ref(&candidate)),
                Placement::Continue { dialog: "d" },
                "{seen}"
            );
        }
    }
}
