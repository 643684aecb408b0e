//! Typed identifiers. Each id is a newtype that is validated when it crosses a
//! boundary (parsing, deserialization), so code inside keel never sees a
//! malformed one.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

/// Why a string is not a valid id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The text is not a UUID.
    #[error("invalid {kind} {value:?}: expected a UUID")]
    NotUuid {
        /// Which id type was being parsed.
        kind: &'static str,
        /// The rejected text (truncated to 80 chars).
        value: String,
    },
    /// The text does not match the agent id rule `[a-z][a-z0-9_-]{0,63}`.
    #[error("invalid agent id {value:?}: {reason} (ids match [a-z][a-z0-9_-]{{0,63}})")]
    BadAgentId {
        /// The rejected text (truncated to 80 chars).
        value: String,
        /// What rule it broke.
        reason: &'static str,
    },
}

fn truncated(s: &str) -> String {
    s.chars().take(80).collect()
}

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Uuid);

        impl $name {
            /// A fresh, time-ordered (UUID v7) id.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// The underlying UUID.
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl From<Uuid> for $name {
            fn from(u: Uuid) -> Self {
                Self(u)
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Uuid::parse_str(s).map(Self).map_err(|_| IdError::NotUuid {
                    kind: $kind,
                    value: truncated(s),
                })
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0.hyphenated(), f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0.hyphenated())
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(&self.0.hyphenated())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = std::borrow::Cow::<str>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

uuid_id!(
    /// A session (a dialog's runtime state, or a sub-agent's child session).
    SessionId,
    "session id"
);
uuid_id!(
    /// One sub-agent run.
    RunId,
    "run id"
);
uuid_id!(
    /// A group of runs created by one batch delegation.
    GroupId,
    "group id"
);
uuid_id!(
    /// One inbox event (completion or signal).
    EventId,
    "event id"
);
uuid_id!(
    /// One tool call waiting for (or given) a person's decision.
    ApprovalId,
    "approval id"
);
uuid_id!(
    /// One checkpoint of a session.
    CheckpointId,
    "checkpoint id"
);
uuid_id!(
    /// One turn of a session (a user turn or a continuation turn).
    TurnId,
    "turn id"
);

/// The name of an agent definition: `[a-z][a-z0-9_-]{0,63}`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentId(String);

impl AgentId {
    /// Longest accepted id, in bytes.
    pub const MAX_LEN: usize = 64;

    /// Validates `s` against the agent id rule.
    pub fn parse(s: &str) -> Result<Self, IdError> {
        let bad = |reason| IdError::BadAgentId {
            value: truncated(s),
            reason,
        };
        let mut bytes = s.bytes();
        match bytes.next() {
            None => return Err(bad("it is empty")),
            Some(b'a'..=b'z') => {}
            Some(_) => return Err(bad("it must start with a lowercase ASCII letter")),
        }
        if s.len() > Self::MAX_LEN {
            return Err(bad("it is longer than 64 characters"));
        }
        if !bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-')) {
            return Err(bad(
                "it may contain only lowercase ASCII letters, digits, '_' and '-'",
            ));
        }
        Ok(Self(s.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The root agent's id, `root` (reserved: no definition may use it).
    pub fn root() -> Self {
        Self("root".to_owned())
    }
}

impl FromStr for AgentId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        Self::parse(s)
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AgentId({})", self.0)
    }
}

impl AsRef<str> for AgentId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Serialize for AgentId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for AgentId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<str>::deserialize(d)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_ids_round_trip_and_are_time_ordered() {
        let a = RunId::new();
        let b = RunId::new();
        assert!(a < b, "v7 ids sort by creation time");
        let parsed: RunId = a.to_string().parse().unwrap();
        assert_eq!(a, parsed);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, format!("\"{a}\""));
        assert_eq!(serde_json::from_str::<RunId>(&json).unwrap(), a);
    }

    #[test]
    fn uuid_id_rejects_garbage_with_its_kind() {
        let err = "not-a-uuid".parse::<SessionId>().unwrap_err();
        insta::assert_snapshot!(err, @r#"invalid session id "not-a-uuid": expected a UUID"#);
        assert!(serde_json::from_str::<CheckpointId>("\"x\"").is_err());
    }

    #[test]
    fn agent_id_rule() {
        for ok in ["a", "researcher", "code-review_2", &"a".repeat(64)] {
            assert!(AgentId::parse(ok).is_ok(), "{ok} should be valid");
        }
        let cases = [
            ("", "it is empty"),
            ("Root", "it must start with a lowercase ASCII letter"),
            ("1abc", "it must start with a lowercase ASCII letter"),
            (
                "ab c",
                "it may contain only lowercase ASCII letters, digits, '_' and '-'",
            ),
            (
                "abC",
                "it may contain only lowercase ASCII letters, digits, '_' and '-'",
            ),
            (
                "aé",
                "it may contain only lowercase ASCII letters, digits, '_' and '-'",
            ),
        ];
        for (bad, reason) in cases {
            match AgentId::parse(bad) {
                Err(IdError::BadAgentId { reason: r, .. }) => assert_eq!(r, reason, "{bad:?}"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
        let long = "a".repeat(65);
        insta::assert_snapshot!(AgentId::parse(&long).unwrap_err(), @r#"invalid agent id "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa": it is longer than 64 characters (ids match [a-z][a-z0-9_-]{0,63})"#);
        assert!(serde_json::from_str::<AgentId>("\"Bad\"").is_err());
        assert_eq!(AgentId::root(), AgentId::parse("root").unwrap());
    }
}
