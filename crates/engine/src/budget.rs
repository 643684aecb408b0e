//! Spend budgets: tokens and USD per run tree (definition `limits`), per
//! root turn and per dialog (keel.toml).
//!
//! Each budget is a [`Ledger`]; the agent loop of a turn or run holds a
//! [`SpendMeter`], the chain of ledgers its model calls count against
//! (innermost first: the run's own, its foreground ancestors', the root
//! turn's when the tree is the turn's foreground, the dialog's). Before a
//! model call the meter reserves the request's estimated input tokens (and
//! their cost at the profile's prices) in every ledger, all or nothing; a
//! ledger the reservation would take past its limit refuses, and the call
//! is not made ([`EngineError::BudgetExhausted`]). When the call returns,
//! the reservation is replaced by the usage the provider reported; the
//! dialog's share is added to the store (`dialog_spend`) before the loop
//! goes on, so a restart does not reset it. A reservation dropped unsettled
//! (a failed or cancelled call) is released.

use std::collections::HashMap;
use std::sync::Arc;

use keel_core::time::now_ms;
use keel_core::{AgentId, Prices, SessionId, Usage, Usd};
use keel_store::Store;
use parking_lot::Mutex;

use crate::error::{EngineError, Result};

/// What model calls spent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spend {
    /// Their tokens.
    pub usage: Usage,
    /// Their cost at their profiles' prices (0 for unpriced profiles).
    pub cost: Usd,
    /// How many calls.
    pub model_calls: u64,
}

impl Spend {
    fn add(&mut self, usage: Usage, cost: Usd) {
        self.usage.add(usage);
        self.cost = self.cost.saturating_add(cost);
        self.model_calls = self.model_calls.saturating_add(1);
    }
}

impl From<keel_store::DialogSpend> for Spend {
    fn from(s: keel_store::DialogSpend) -> Self {
        Spend {
            usage: s.usage,
            cost: s.cost,
            model_calls: s.model_calls,
        }
    }
}

/// Which budget a ledger is: it names the key that set its limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BudgetScope {
    /// A run and its foreground descendants (definition `limits`).
    Run(AgentId),
    /// A root turn and its foreground tree.
    RootTurn,
    /// Everything a dialog runs, its background runs included.
    Dialog,
}

impl BudgetScope {
    fn key(&self, cost: bool) -> String {
        match (self, cost) {
            (BudgetScope::Run(agent), false) => {
                format!("limits.max_tokens_total of agent {:?}", agent.as_str())
            }
            (BudgetScope::Run(agent), true) => {
                format!("limits.max_cost_usd of agent {:?}", agent.as_str())
            }
            (BudgetScope::RootTurn, _) => "orchestration.max_cost_usd_per_root_turn".to_owned(),
            (BudgetScope::Dialog, _) => "session.max_cost_usd_per_dialog".to_owned(),
        }
    }
}

#[derive(Debug, Default)]
struct LedgerState {
    spent: Spend,
    reserved_tokens: u64,
    reserved_cost: Usd,
}

/// One budget: its limits, what was spent and what in-flight calls reserved.
#[derive(Debug)]
pub(crate) struct Ledger {
    scope: BudgetScope,
    max_tokens: Option<u64>,
    max_cost: Option<Usd>,
    state: Mutex<LedgerState>,
}

impl Ledger {
    /// A ledger of `scope` with these limits that has spent `spent`.
    pub(crate) fn new(
        scope: BudgetScope,
        max_tokens: Option<u64>,
        max_cost: Option<Usd>,
        spent: Spend,
    ) -> Arc<Ledger> {
        Arc::new(Ledger {
            scope,
            max_tokens,
            max_cost,
            state: Mutex::new(LedgerState {
                spent,
                ..LedgerState::default()
            }),
        })
    }

    /// What it spent so far.
    #[cfg(test)]
    pub(crate) fn spent(&self) -> Spend {
        self.state.lock().spent
    }

    /// The refusal if `tokens` and `cost` more would pass a limit.
    fn check(&self, state: &LedgerState, tokens: u64, cost: Usd) -> Result<()> {
        let used_tokens = state
            .spent
            .usage
            .total()
            .saturating_add(state.reserved_tokens);
        if let Some(max) = self.max_tokens {
            if used_tokens.saturating_add(tokens) > max {
                return Err(EngineError::BudgetExhausted {
                    budget: self.scope.key(false),
                    detail: format!(
                        "{} of {max} tokens spent, and the next model call needs about {tokens}",
                        state.spent.usage.total()
                    ),
                });
            }
        }
        if let Some(max) = self.max_cost {
            let used = state.spent.cost.saturating_add(state.reserved_cost);
            if used.saturating_add(cost) > max {
                return Err(EngineError::BudgetExhausted {
                    budget: self.scope.key(true),
                    detail: format!(
                        "{} of {max} spent, and the next model call needs about {cost}",
                        state.spent.cost
                    ),
                });
            }
        }
        Ok(())
    }

    /// What is left of each limit, for the model (`None` without limits).
    fn remaining(&self) -> Vec<String> {
        let s = self.state.lock();
        let mut out = Vec::new();
        if let Some(max) = self.max_tokens {
            let left = max.saturating_sub(s.spent.usage.total());
            out.push(format!("{left} tokens ({})", self.scope.key(false)));
        }
        if let Some(max) = self.max_cost {
            let left = max.saturating_sub(s.spent.cost);
            out.push(format!("{left} ({})", self.scope.key(true)));
        }
        out
    }
}

/// The ledgers one agent loop's model calls count against, the prices of
/// its profile, and the store its dialog's spend is recorded in. Put in the
/// loop's [`keel_core::ToolExecutionContext::extensions`] as
/// `Arc<SpendMeter>`.
#[derive(Debug)]
pub(crate) struct SpendMeter {
    ledgers: Vec<Arc<Ledger>>,
    prices: Option<Prices>,
    record: Option<(Store, SessionId)>,
    /// This loop's own calls (a run's own spend, recorded with the run).
    own: Mutex<Spend>,
}

/// Spend reserved for one model call; released when dropped unsettled.
#[derive(Debug)]
pub(crate) struct Reservation<'a> {
    meter: &'a SpendMeter,
    tokens: u64,
    cost: Usd,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        for ledger in &self.meter.ledgers {
            let mut s = ledger.state.lock();
            s.reserved_tokens = s.reserved_tokens.saturating_sub(self.tokens);
            s.reserved_cost = s.reserved_cost.saturating_sub(self.cost);
        }
    }
}

impl SpendMeter {
    /// A meter over `ledgers` (innermost first) at `prices`, recording into
    /// `record`'s dialog when given.
    pub(crate) fn new(
        ledgers: Vec<Arc<Ledger>>,
        prices: Option<Prices>,
        record: Option<(Store, SessionId)>,
    ) -> Arc<SpendMeter> {
        Arc::new(SpendMeter {
            ledgers,
            prices,
            record,
            own: Mutex::new(Spend::default()),
        })
    }

    /// The meter of a run this loop delegates to: the run's own `ledger`
    /// first, then this meter's ledgers (for a foreground run) or only its
    /// dialog's (a background run outlives the turn and its tree).
    pub(crate) fn child(
        &self,
        ledger: Arc<Ledger>,
        prices: Option<Prices>,
        foreground: bool,
    ) -> Arc<SpendMeter> {
        let ledgers = std::iter::once(ledger)
            .chain(
                self.ledgers
                    .iter()
                    .filter(|l| foreground || l.scope == BudgetScope::Dialog)
                    .cloned(),
            )
            .collect();
        SpendMeter::new(ledgers, prices, self.record.clone())
    }

    /// Reserves a call of about `input_tokens` in every ledger, or refuses
    /// it naming the first budget it would pass.
    pub(crate) fn reserve(&self, input_tokens: u64) -> Result<Reservation<'_>> {
        let cost = self
            .prices
            .map_or(Usd::ZERO, |p| p.cost(Usage::new(input_tokens, 0)));
        let mut states: Vec<_> = self.ledgers.iter().map(|l| l.state.lock()).collect();
        for (ledger, state) in self.ledgers.iter().zip(&states) {
            ledger.check(state, input_tokens, cost)?;
        }
        for state in &mut states {
            state.reserved_tokens = state.reserved_tokens.saturating_add(input_tokens);
            state.reserved_cost = state.reserved_cost.saturating_add(cost);
        }
        Ok(Reservation {
            meter: self,
            tokens: input_tokens,
            cost,
        })
    }

    /// Replaces `reservation` with the `usage` the call reported, and adds
    /// it to the dialog's stored spend.
    pub(crate) async fn settle(&self, reservation: Reservation<'_>, usage: Usage) -> Result<()> {
        drop(reservation);
        let cost = self.prices.map_or(Usd::ZERO, |p| p.cost(usage));
        for ledger in &self.ledgers {
            ledger.state.lock().spent.add(usage, cost);
        }
        self.own.lock().add(usage, cost);
        if let Some((store, session)) = &self.record {
            store
                .add_dialog_spend(*session, usage, cost, now_ms())
                .await?;
        }
        Ok(())
    }

    /// What this loop's own calls spent.
    pub(crate) fn own(&self) -> Spend {
        *self.own.lock()
    }

    /// Whether its profile has prices.
    pub(crate) fn priced(&self) -> bool {
        self.prices.is_some()
    }

    /// What is left of every budget over this loop, for the model; `None`
    /// when no limit applies.
    pub(crate) fn remaining(&self) -> Option<String> {
        let parts: Vec<String> = self.ledgers.iter().flat_map(|l| l.remaining()).collect();
        (!parts.is_empty()).then(|| format!("remaining budget: {}", parts.join("; ")))
    }
}

/// The dialog ledgers of this process, one per dialog read so far (loaded
/// with the session), so every turn and run of a dialog counts against the
/// same one and a turn reads nothing from the store for it.
#[derive(Debug, Default)]
pub(crate) struct DialogLedgers {
    live: Mutex<HashMap<SessionId, Arc<Ledger>>>,
}

impl DialogLedgers {
    /// The ledger of `session`'s dialog, loaded from the store when no turn
    /// or run holds it.
    pub(crate) async fn get(
        &self,
        store: &Store,
        session: SessionId,
        max_cost: Option<Usd>,
    ) -> Result<Arc<Ledger>> {
        if let Some(l) = self.live.lock().get(&session) {
            return Ok(Arc::clone(l));
        }
        let spent = Spend::from(store.dialog_spend(session).await?);
        let mut live = self.live.lock();
        let ledger = live
            .entry(session)
            .or_insert_with(|| Ledger::new(BudgetScope::Dialog, None, max_cost, spent));
        Ok(Arc::clone(ledger))
    }

    /// Drops `session`'s ledger: the next [`Self::get`] reads the stored
    /// spend (another process may have added to it).
    pub(crate) fn forget(&self, session: SessionId) {
        self.live.lock().remove(&session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usd(v: f64) -> Usd {
        Usd::new(v).unwrap()
    }

    #[test]
    fn a_call_that_would_pass_a_limit_is_refused_and_reservations_count() {
        let run = Ledger::new(
            BudgetScope::Run(AgentId::parse("a").unwrap()),
            Some(100),
            None,
            Spend::default(),
        );
        let meter = SpendMeter::new(vec![run.clone()], None, None);
        let first = meter.reserve(60).unwrap();
        // The in-flight call's reservation counts: 60 + 50 > 100.
        let err = meter.reserve(50).unwrap_err();
        insta::assert_snapshot!(err, @r#"the budget limits.max_tokens_total of agent "a" is exhausted (0 of 100 tokens spent, and the next model call needs about 50); no model call was made"#);
        drop(first);
        let second = meter.reserve(50).unwrap();
        drop(second);
        assert_eq!(run.spent(), Spend::default());
        let unlimited = SpendMeter::new(
            vec![Ledger::new(
                BudgetScope::Dialog,
                None,
                None,
                Spend::default(),
            )],
            None,
            None,
        );
        assert_eq!(unlimited.remaining(), None);
    }

    #[tokio::test]
    async fn settling_counts_reported_usage_in_every_ledger() {
        let prices = Prices {
            input_per_mtok: usd(1_000_000.0),
            output_per_mtok: usd(2_000_000.0),
        };
        let dialog = Ledger::new(BudgetScope::Dialog, None, Some(usd(10.0)), Spend::default());
        let turn = Ledger::new(
            BudgetScope::RootTurn,
            None,
            Some(usd(5.0)),
            Spend::default(),
        );
        let root = SpendMeter::new(vec![turn.clone(), dialog.clone()], Some(prices), None);
        let r = root.reserve(1).unwrap();
        root.settle(r, Usage::new(1, 1)).await.unwrap();
        assert_eq!(turn.spent().cost, usd(3.0));
        let run = Ledger::new(
            BudgetScope::Run(AgentId::parse("b").unwrap()),
            Some(1000),
            None,
            Spend::default(),
        );
        let bg = root.child(run, Some(prices), false);
        // A background run counts against the dialog, not the turn.
        let r = bg.reserve(1).unwrap();
        bg.settle(r, Usage::new(1, 0)).await.unwrap();
        assert_eq!(turn.spent().cost, usd(3.0));
        assert_eq!(dialog.spent().cost, usd(4.0));
        assert_eq!(bg.own().usage, Usage::new(1, 0));
        // $3 of the turn's $5 is spent: a call estimated at $3 is refused.
        let err = root.reserve(3).unwrap_err();
        assert!(
            err.to_string()
                .contains("orchestration.max_cost_usd_per_root_turn"),
            "{err}"
        );
        insta::assert_snapshot!(root.remaining().unwrap(), @"remaining budget: $2.000000 (orchestration.max_cost_usd_per_root_turn); $6.000000 (session.max_cost_usd_per_dialog)");
    }
}
