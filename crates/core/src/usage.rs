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

/// An amount of US dollars: finite and not negative, checked on
/// construction (so it is totally ordered and may be `Eq`).
#[derive(Debug, Clone, Copy, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Usd(f64);

// Every `Usd` is finite (see `Usd::new`), so equality is reflexive.
impl Eq for Usd {}

/// A number that is no amount of dollars.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0} is not an amount of USD (it must be a finite number, 0 or more)")]
pub struct UsdError(pub f64);

impl Usd {
    /// No money.
    pub const ZERO: Usd = Usd(0.0);

    /// `value` dollars, if it is finite and not negative.
    pub fn new(value: f64) -> Result<Usd, UsdError> {
        if value.is_finite() && value >= 0.0 {
            // -0.0 becomes 0.0, so the text form never shows a sign.
            Ok(Usd(value + 0.0))
        } else {
            Err(UsdError(value))
        }
    }

    /// The amount as a float.
    pub fn get(self) -> f64 {
        self.0
    }

    /// The sum, saturating at the largest finite amount.
    pub fn saturating_add(self, other: Usd) -> Usd {
        Usd((self.0 + other.0).min(f64::MAX))
    }

    /// The difference, 0 at least.
    pub fn saturating_sub(self, other: Usd) -> Usd {
        Usd((self.0 - other.0).max(0.0))
    }
}

impl TryFrom<f64> for Usd {
    type Error = UsdError;
    fn try_from(value: f64) -> Result<Self, Self::Error> {
        Usd::new(value)
    }
}

impl From<Usd> for f64 {
    fn from(value: Usd) -> Self {
        value.0
    }
}

impl std::fmt::Display for Usd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "${:.6}", self.0)
    }
}

/// What a provider profile's tokens cost (`price_input_per_mtok`,
/// `price_output_per_mtok`): USD per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prices {
    /// USD per million prompt tokens.
    pub input_per_mtok: Usd,
    /// USD per million completion tokens.
    pub output_per_mtok: Usd,
}

impl Prices {
    /// What `usage` costs at these prices.
    pub fn cost(&self, usage: Usage) -> Usd {
        // Token counts far below 2^53 are exact as floats.
        #[allow(clippy::cast_precision_loss)]
        let (input, output) = (usage.prompt_tokens as f64, usage.completion_tokens as f64);
        let cost = (input * self.input_per_mtok.get() + output * self.output_per_mtok.get()) / 1e6;
        Usd::new(cost.min(f64::MAX)).unwrap_or(Usd::ZERO)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usd_refuses_what_is_no_amount_and_prices_cost_usage() {
        for bad in [f64::NAN, f64::INFINITY, -0.01] {
            assert!(Usd::new(bad).is_err(), "{bad}");
        }
        insta::assert_snapshot!(Usd::new(-1.0).unwrap_err(), @"-1 is not an amount of USD (it must be a finite number, 0 or more)");
        assert!(serde_json::from_str::<Usd>("-2").is_err());
        let prices = Prices {
            input_per_mtok: Usd::new(3.0).unwrap(),
            output_per_mtok: Usd::new(15.0).unwrap(),
        };
        let cost = prices.cost(Usage::new(1_000_000, 2_000));
        assert!((cost.get() - 3.03).abs() < 1e-9, "{cost}");
        assert_eq!(cost.to_string(), "$3.030000");
        let a = Usd::new(1.0).unwrap();
        assert_eq!(a.saturating_sub(Usd::new(2.0).unwrap()), Usd::ZERO);
        assert_eq!(Usd::new(-0.0).unwrap().to_string(), "$0.000000");
    }

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
