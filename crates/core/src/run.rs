//! Orchestration vocabulary shared by the store, the catalog and the engine:
//! run statuses, execution modes, completion policies and inbox delivery.
//! Each has one stable text form; parsing unknown text is an error, never a
//! default.

use serde::{Deserialize, Serialize};

/// Text that names no variant of an enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {value:?}")]
pub struct UnknownVariant {
    /// The enum's name.
    pub kind: &'static str,
    /// The text that did not parse.
    pub value: String,
}

/// Declares a fieldless enum whose variants each have one stable text form
/// (on disk and on the wire), with `ALL`, `as_str`, `Display`, and a
/// `FromStr` whose error for any other text is [`UnknownVariant`]. Extra
/// attributes before the name (docs, derives such as serde's) go on the enum.
///
/// ```
/// keel_core::text_enum!(
///     /// A colour.
///     Colour, "colour" {
///         /// Red.
///         Red = "red",
///         /// Dark blue.
///         DarkBlue = "dark_blue",
///     }
/// );
/// assert_eq!("dark_blue".parse::<Colour>(), Ok(Colour::DarkBlue));
/// assert_eq!(Colour::ALL, [Colour::Red, Colour::DarkBlue]);
/// assert!("blue".parse::<Colour>().is_err());
/// ```
#[macro_export]
macro_rules! text_enum {
    ($(#[$attr:meta])* $name:ident, $kind:literal { $($(#[$vdoc:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$attr])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The stable text form used on disk and on the wire.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::UnknownVariant;
            fn from_str(s: &str) -> ::std::result::Result<Self, $crate::UnknownVariant> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err($crate::UnknownVariant { kind: $kind, value: s.chars().take(80).collect() }),
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

text_enum!(
    /// Lifecycle state of a sub-agent run.
    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    RunStatus, "run status" {
        /// Accepted and persisted, not started.
        Queued = "queued",
        /// Executing provider/tool steps.
        Running = "running",
        /// Waiting for foreground children; holds no step permit.
        WaitingChildren = "waiting_children",
        /// A background run waiting for a person to decide on a tool call;
        /// it holds no permit and no runner until the decision resumes it.
        WaitingApproval = "waiting_approval",
        /// Finished with a result.
        Completed = "completed",
        /// Finished with an error.
        Failed = "failed",
        /// Passed its deadline.
        TimedOut = "timed_out",
        /// Cancelled by a parent, a user or a session deletion.
        Cancelled = "cancelled",
        /// Owned by a runtime generation that stopped before it finished.
        Interrupted = "interrupted",
        /// Stopped before a model call that would have passed a spend budget
        /// (tokens or USD) of the run, its tree, its root turn or its dialog.
        BudgetExhausted = "budget_exhausted",
    }
);

impl RunStatus {
    /// Whether the run can no longer change state.
    pub fn is_terminal(self) -> bool {
        !matches!(
            self,
            RunStatus::Queued
                | RunStatus::Running
                | RunStatus::WaitingChildren
                | RunStatus::WaitingApproval
        )
    }
}

text_enum!(
    /// Whether the caller waits for a delegation.
    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    ExecutionMode, "execution mode" {
        /// The caller awaits the result.
        Foreground = "foreground",
        /// The caller gets ids at once; the result arrives in the inbox.
        Background = "background",
    }
);

text_enum!(
    /// When a background group reports back.
    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    CompletionPolicy, "completion policy" {
        /// One group completion after every run is terminal.
        All = "all",
        /// One completion per run.
        Each = "each",
    }
);

text_enum!(
    /// How an inbox event reaches the root agent.
    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    Delivery, "delivery" {
        /// In a continuation turn after the current one.
        Queue = "queue",
        /// Injected into the running turn at its next safe boundary.
        Steer = "steer",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms_round_trip_and_unknown_is_an_error() {
        for s in RunStatus::ALL {
            assert_eq!(s.as_str().parse::<RunStatus>().unwrap(), *s);
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        for m in ExecutionMode::ALL {
            assert_eq!(m.as_str().parse::<ExecutionMode>().unwrap(), *m);
        }
        for p in CompletionPolicy::ALL {
            assert_eq!(p.as_str().parse::<CompletionPolicy>().unwrap(), *p);
        }
        for d in Delivery::ALL {
            assert_eq!(d.as_str().parse::<Delivery>().unwrap(), *d);
        }
        insta::assert_snapshot!("finished".parse::<RunStatus>().unwrap_err(), @r#"unknown run status "finished""#);
    }

    #[test]
    fn terminal_statuses() {
        let terminal: Vec<_> = RunStatus::ALL
            .iter()
            .filter(|s| s.is_terminal())
            .map(|s| s.as_str())
            .collect();
        assert_eq!(
            terminal,
            [
                "completed",
                "failed",
                "timed_out",
                "cancelled",
                "interrupted",
                "budget_exhausted"
            ]
        );
    }
}
