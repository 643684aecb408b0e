//! Token usage of one provider call and the running cost of a session or run.

use serde::{Deserialize, Serialize};

/// Tokens consumed by one provider call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt (input) tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Completion (output) tokens.
    #[serde(default)]
    pub completion_tokens: u64,
}

impl Usage {
    /// Usage of `prompt` input and `completion` output tokens.
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
        }
    }

    /// Prompt plus completion tokens.
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// Adds `other` in place, saturating.
    pub fn add(&mut self, other: Usage) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
    }
}

/// Accumulated usage over many provider calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostTracker {
    /// Sum of prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Sum of completion tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// Number of provider calls recorded.
    #[serde(default)]
    pub requests: u64,
}

impl CostTracker {
    /// Records one provider call's usage.
    pub fn record(&mut self, usage: Usage) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(usage.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(usage.completion_tokens);
        self.requests = self.requests.saturating_add(1);
    }

    /// Folds another tracker into this one (e.g. a child run into its parent).
    pub fn merge(&mut self, other: &CostTracker) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
        self.requests = self.requests.saturating_add(other.requests);
    }

    /// Total tokens.
    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// The accumulated tokens as one [`Usage`].
    pub fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.completion_tokens)
    }
}

impl From<Usage> for CostTracker {
    fn from(usage: Usage) -> Self {
        let mut t = CostTracker::default();
        t.record(usage);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_accumulates_and_saturates() {
        let mut t = CostTracker::from(Usage::new(10, 5));
        t.record(Usage::new(1, 2));
        assert_eq!(t.usage(), Usage::new(11, 7));
        assert_eq!(t.requests, 2);
        assert_eq!(t.total_tokens(), 18);
        t.record(Usage::new(u64::MAX, 0));
        assert_eq!(t.prompt_tokens, u64::MAX);
        let mut other = CostTracker::default();
        other.merge(&t);
        assert_eq!(other, t);
    }

    #[test]
    fn serde_forms_are_stable() {
        insta::assert_json_snapshot!((Usage::new(3, 4), CostTracker::from(Usage::new(3, 4))), @r#"
        [
          {
            "prompt_tokens": 3,
            "completion_tokens": 4
          },
          {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "requests": 1
          }
        ]
        "#);
        let old: CostTracker = serde_json::from_str("{}").unwrap();
        assert_eq!(old, CostTracker::default());
    }
}
