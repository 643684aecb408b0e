//! Spend budgets of root turns and dialogs: a call that would pass
//! `max_cost_usd_per_root_turn` is not made and the turn fails typed, the
//! next turn has a budget of its own; a dialog's spend is stored, so its
//! budget is not reset by restarting the manager on a reopened store.

use std::sync::Arc;

use keel_core::{Prices, ScriptedProvider, ScriptedResponse, ToolRegistry, Usage, Usd};
use keel_engine::{EngineError, RuntimeBundle, SessionManager, SessionManagerConfig};

use crate::common::*;

/// 1 token costs $0.01 at these prices.
fn prices() -> Prices {
    Prices {
        input_per_mtok: Usd::new(10_000.0).unwrap(),
        output_per_mtok: Usd::new(10_000.0).unwrap(),
    }
}

fn usd(v: f64) -> Usd {
    Usd::new(v).unwrap()
}

fn priced_manager(
    store: keel_store::Store,
    provider: &ScriptedProvider,
    config: SessionManagerConfig,
) -> Arc<SessionManager> {
    let mut root = profile("root", provider, ToolRegistry::new());
    root.prices = Some(prices());
    SessionManager::new(store, RuntimeBundle::new(root), config)
}

fn answer(text: &str, prompt: u64, completion: u64) -> ScriptedResponse {
    let mut r = ScriptedResponse::text(text);
    r.usage = Some(Usage::new(prompt, completion));
    r
}

/// About 100 tokens of input (4 bytes a token), so a request carrying it is
/// estimated at more than $1.
fn long_input() -> String {
    "word ".repeat(80)
}

#[tokio::test]
async fn a_root_turn_stops_before_a_call_past_its_cost_cap_and_the_next_turn_has_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let provider = ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    let config = SessionManagerConfig {
        max_cost_usd_per_root_turn: Some(usd(1.5)),
        ..SessionManagerConfig::default()
    };
    let manager = priced_manager(open_store(dir.path()), &provider, config);
    // Call 1 costs $1 (100 prompt tokens) and asks for a tool; call 2 would
    // carry the long input again (> $1 estimated): past the $1.50 cap.
    let mut call = ScriptedResponse::tool_call("nothing", serde_json::json!({}));
    call.usage = Some(Usage::new(100, 0));
    provider.push([call]);
    let id = manager.create(spec("d1")).await.unwrap();
    let err = manager.submit_turn(id, &long_input()).await.unwrap_err();
    assert!(err.is_budget_exhausted(), "{err}");
    assert!(matches!(&err, EngineError::BudgetExhausted { budget, .. }
        if budget == "orchestration.max_cost_usd_per_root_turn"));
    insta::assert_snapshot!(err, @"the budget orchestration.max_cost_usd_per_root_turn is exhausted ($1.000000 of $1.500000 spent, and the next model call needs about $1.310000); no model call was made");
    assert_eq!(provider.requests().len(), 1, "the second call is not made");
    // A new turn has a fresh root-turn budget (the dialog has none).
    provider.push([answer("ok", 1, 1)]);
    let report = manager.submit_turn(id, "short").await.unwrap();
    assert_eq!(report.output.final_text(), "ok");
    let spent = manager.dialog_spend(id).await.unwrap();
    assert_eq!(spent.usage, Usage::new(101, 1));
    assert_eq!(spent.model_calls, 2);
    assert!((spent.cost.get() - 1.02).abs() < 1e-9, "{:?}", spent.cost);
}

#[tokio::test]
async fn a_dialog_budget_is_not_reset_by_restarting_the_manager() {
    let dir = tempfile::tempdir().unwrap();
    let provider = ScriptedProvider::new(Vec::<ScriptedResponse>::new());
    let config = || SessionManagerConfig {
        max_cost_usd_per_dialog: Some(usd(1.5)),
        ..SessionManagerConfig::default()
    };
    let id = {
        let manager = priced_manager(open_store(dir.path()), &provider, config());
        provider.push([answer("first", 100, 0)]);
        let id = manager.create(spec("d1")).await.unwrap();
        manager.submit_turn(id, "hi").await.unwrap();
        manager.shutdown();
        id
    }; // manager and store dropped
    let manager = priced_manager(open_store(dir.path()), &provider, config());
    assert_eq!(manager.dialog_spend(id).await.unwrap().cost, usd(1.0));
    provider.push([answer("never", 1, 1)]);
    let err = manager.submit_turn(id, &long_input()).await.unwrap_err();
    assert!(
        matches!(&err, EngineError::BudgetExhausted { budget, .. }
        if budget == "session.max_cost_usd_per_dialog"),
        "{err}"
    );
    assert_eq!(provider.requests().len(), 1, "no call after the restart");
    // Another dialog has its own budget.
    let other = manager.create(spec("d2")).await.unwrap();
    manager.submit_turn(other, "hi").await.unwrap();
    assert_eq!(provider.requests().len(), 2);
}
