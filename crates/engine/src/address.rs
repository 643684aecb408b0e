//! [`DialogAddress`]: `channel:chat_id:dialog_id`, where a dialog lives.

use std::fmt;
use std::str::FromStr;

use crate::error::{EngineError, Result};

/// Longest part of a dialog address, in characters.
pub(crate) const MAX_PART_LEN: usize = 128;

/// The address of a dialog, `channel:chat_id:dialog_id` (e.g. `cli:alice:default`):
/// a channel holds chats, a chat holds dialogs, each dialog is one session.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DialogAddress {
    channel: String,
    chat_id: String,
    dialog_id: String,
}

impl DialogAddress {
    /// Validates and joins the three parts. Each is 1 to 128 characters
    /// without ':' or control characters.
    pub fn new(channel: &str, chat_id: &str, dialog_id: &str) -> Result<Self> {
        for (name, part) in [
            ("channel", channel),
            ("chat_id", chat_id),
            ("dialog_id", dialog_id),
        ] {
            validate_part(name, part)?;
        }
        Ok(Self {
            channel: channel.to_owned(),
            chat_id: chat_id.to_owned(),
            dialog_id: dialog_id.to_owned(),
        })
    }

    /// The channel (e.g. `cli`, `web`).
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// The chat within the channel.
    pub fn chat_id(&self) -> &str {
        &self.chat_id
    }

    /// The dialog within the chat.
    pub fn dialog_id(&self) -> &str {
        &self.dialog_id
    }
}

fn validate_part(name: &str, part: &str) -> Result<()> {
    let problem = if part.is_empty() {
        Some("is empty")
    } else if part.chars().count() > MAX_PART_LEN {
        Some("is longer than 128 characters")
    } else if part.contains(':') {
        Some("contains ':'")
    } else if part.chars().any(char::is_control) {
        Some("contains a control character")
    } else {
        None
    };
    match problem {
        Some(p) => Err(EngineError::InvalidInput(format!("{name} {p}"))),
        None => Ok(()),
    }
}

impl FromStr for DialogAddress {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        let mut parts = s.split(':');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(c), Some(chat), Some(d), None) => Self::new(c, chat, d),
            _ => Err(EngineError::InvalidInput(format!(
                "{:?} is not channel:chat_id:dialog_id",
                s.chars().take(80).collect::<String>()
            ))),
        }
    }
}

impl fmt::Display for DialogAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.channel, self.chat_id, self.dialog_id)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn parses_and_formats() {
        let id: DialogAddress = "cli:alice:d1".parse().unwrap();
        assert_eq!(
            (id.channel(), id.chat_id(), id.dialog_id()),
            ("cli", "alice", "d1")
        );
        assert_eq!(id.to_string(), "cli:alice:d1");
    }

    #[test]
    fn rejects_malformed_ids() {
        let errs: Vec<String> = [
            "cli:alice",
            "a:b:c:d",
            "::",
            "cli:al\nice:d",
            &format!("c:{}:d", "x".repeat(129)),
        ]
        .iter()
        .map(|s| s.parse::<DialogAddress>().unwrap_err().to_string())
        .collect();
        insta::assert_yaml_snapshot!(errs, @r#"
        - "invalid input: \"cli:alice\" is not channel:chat_id:dialog_id"
        - "invalid input: \"a:b:c:d\" is not channel:chat_id:dialog_id"
        - "invalid input: channel is empty"
        - "invalid input: chat_id contains a control character"
        - "invalid input: chat_id is longer than 128 characters"
        "#);
    }

    /// A valid part: 1 to 128 characters, none of them ':' or a control character.
    fn part() -> impl Strategy<Value = String> {
        "[^:\\p{Cc}]{1,128}"
    }

    /// A part broken in one of the ways the rules name, with that rule's wording.
    fn bad_part() -> impl Strategy<Value = (String, &'static str)> {
        prop_oneof![
            Just((String::new(), "is empty")),
            "[^:\\p{Cc}]{129,140}".prop_map(|p| (p, "is longer than 128 characters")),
            ("[^:\\p{Cc}]{0,10}", "[^:\\p{Cc}]{0,10}")
                .prop_map(|(a, b)| (format!("{a}:{b}"), "contains ':'")),
            ("[^:\\p{Cc}]{0,10}", "\\p{Cc}", "[^:\\p{Cc}]{0,10}")
                .prop_map(|(a, c, b)| (format!("{a}{c}{b}"), "contains a control character")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn display_and_parse_round_trip(channel in part(), chat in part(), dialog in part()) {
            let address = DialogAddress::new(&channel, &chat, &dialog).unwrap();
            let text = address.to_string();
            prop_assert_eq!(&text, &format!("{channel}:{chat}:{dialog}"));
            let back: DialogAddress = text.parse().unwrap();
            prop_assert_eq!(
                (back.channel(), back.chat_id(), back.dialog_id()),
                (channel.as_str(), chat.as_str(), dialog.as_str())
            );
            prop_assert_eq!(back, address);
        }

        #[test]
        fn a_bad_part_is_rejected_by_name(
            good in part(),
            (bad, problem) in bad_part(),
            position in 0..3usize,
        ) {
            let mut parts = [good.as_str(); 3];
            parts[position] = &bad;
            let err = DialogAddress::new(parts[0], parts[1], parts[2]).unwrap_err();
            let name = ["channel", "chat_id", "dialog_id"][position];
            prop_assert_eq!(err, EngineError::InvalidInput(format!("{name} {problem}")));
        }

        #[test]
        fn text_without_exactly_three_parts_is_rejected(
            parts in prop::collection::vec(part(), 0..6).prop_filter("not three", |p| p.len() != 3),
        ) {
            let text = parts.join(":");
            let err = text.parse::<DialogAddress>().unwrap_err();
            let is_shape_error = err.to_string().ends_with("is not channel:chat_id:dialog_id");
            prop_assert!(is_shape_error, "{}", err);
        }
    }
}
