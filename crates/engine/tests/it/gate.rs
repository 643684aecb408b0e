//! ExecutionGate behaviour: limits under contention, fail-fast run quota,
//! cancellation at every stage without leaks, keyed-semaphore cleanup,
//! nested delegation with every limit at 1, and the `StepGate` impl driving
//! an `AgentLoop`.
//!
//! No test sleeps to synchronise: waiting is proven either by polling a
//! pinned future (`futures::poll!`) or, with paused time, by a timeout that
//! can only elapse once every task is idle.
#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::poll;
use keel_core::{
    AgentId, CancellationToken, DelegationPolicy, Message, ScriptedProvider, ScriptedResponse,
    ScriptedToolCall, SessionId, Tool, ToolError, ToolExecutionContext, ToolOutput, ToolRegistry,
};
use keel_engine::{AgentLoop, EngineError, TurnRequest};
use keel_engine::{
    ExecutionGate, GateCounters, GateLimits, GateScope, StepKind, StepPermitGuard, StepScope,
};
use keel_engine::{OpenGate, StepGate};
use serde_json::json;
use tokio::sync::oneshot;

fn agent(name: &str) -> AgentId {
    AgentId::parse(name).unwrap()
}

fn gate(limits: GateLimits) -> Arc<ExecutionGate> {
    Arc::new(ExecutionGate::new(limits))
}

fn idle() -> GateCounters {
    GateCounters::default()
}

async fn step(
    gate: &ExecutionGate,
    kind: StepKind,
    session: Option<SessionId>,
    agent: Option<&AgentId>,
    cancel: &CancellationToken,
) -> Result<StepPermitGuard, EngineError> {
    match kind {
        StepKind::Provider => gate.acquire_provider_step(session, agent, cancel).await,
        StepKind::Tool => gate.acquire_tool_step(session, agent, cancel).await,
    }
}

/// With time paused, tokio advances the clock only when every task is idle,
/// so this timeout elapses exactly when `fut` cannot make progress without
/// something else happening.
async fn blocked<F: Future + Unpin>(fut: &mut F) -> bool {
    tokio::time::timeout(Duration::from_secs(3600), fut)
        .await
        .is_err()
}

/// Limits.
mod gate_limits {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn with_limit_one_a_second_step_waits_until_the_first_permit_drops() {
        for kind in [StepKind::Provider, StepKind::Tool] {
            let gate = gate(GateLimits::uniform(1));
            let cancel = CancellationToken::new();
            let session = SessionId::new();
            let first = step(&gate, kind, Some(session), None, &cancel)
                .await
                .unwrap();
            assert_eq!(first.kind(), kind);

            let (acquired_tx, mut acquired_rx) = oneshot::channel();
            let (release_tx, release_rx) = oneshot::channel::<()>();
            let second = tokio::spawn({
                let gate = Arc::clone(&gate);
                async move {
                    let cancel = CancellationToken::new();
                    let permit = step(&gate, kind, Some(session), None, &cancel)
                        .await
                        .unwrap();
                    acquired_tx.send(()).unwrap();
                    release_rx.await.unwrap();
                    drop(permit);
                }
            });

            assert!(
                blocked(&mut acquired_rx).await,
                "{kind:?}: the second acquire must wait while the first permit is held"
            );
            drop(first);
            acquired_rx.await.unwrap();
            let held = gate.snapshot();
            assert_eq!(
                held.provider_steps_in_use + held.tool_steps_in_use,
                1,
                "{kind:?}: exactly the second permit is held"
            );
            release_tx.send(()).unwrap();
            second.await.unwrap();
            assert_eq!(gate.snapshot(), idle());
        }
    }

    #[tokio::test]
    async fn per_session_limit_applies_below_the_global_limit() {
        let mut limits = GateLimits::uniform(3);
        limits.max_concurrent_provider_steps_per_session = 1;
        let gate = gate(limits);
        let cancel = CancellationToken::new();
        let (s1, s2, s3, s4) = (
            SessionId::new(),
            SessionId::new(),
            SessionId::new(),
            SessionId::new(),
        );

        let a = gate
            .acquire_provider_step(Some(s1), None, &cancel)
            .await
            .unwrap();
        // Same session: waits at the session stage although global has room,
        // holding no global permit.
        let mut same = pin!(gate.acquire_provider_step(Some(s1), None, &cancel));
        assert!(poll!(&mut same).is_pending());
        assert_eq!(gate.snapshot().provider_steps_in_use, 1);
        // Other sessions pass, up to the 3 global permits.
        let b = gate
            .acquire_provider_step(Some(s2), None, &cancel)
            .await
            .unwrap();
        let c = gate
            .acquire_provider_step(Some(s3), None, &cancel)
            .await
            .unwrap();
        assert_eq!(gate.snapshot().provider_steps_in_use, 3);
        // Global is now full: a fourth session waits at the global stage.
        let mut other = pin!(gate.acquire_provider_step(Some(s4), None, &cancel));
        assert!(poll!(&mut other).is_pending());

        // b's global permit goes to the global waiter; the session waiter stays.
        drop(b);
        let other = match poll!(&mut other) {
            std::task::Poll::Ready(r) => r.unwrap(),
            std::task::Poll::Pending => panic!("a global permit was released"),
        };
        assert!(poll!(&mut same).is_pending(), "s1 is still at its limit");
        drop(a);
        let same = same.await.unwrap();
        // All three global permits are held again (c, other, same).
        let mut unrelated = pin!(gate.acquire_provider_step(Some(s2), None, &cancel));
        assert!(poll!(&mut unrelated).is_pending());
        drop(same);
        let unrelated = unrelated.await.unwrap();
        drop(c);
        drop((other, unrelated));
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn limits_hold_under_contention() {
        const GLOBAL: usize = 3;
        const PER_SESSION: usize = 2;
        const SESSIONS: usize = 3;
        let mut limits = GateLimits::uniform(GLOBAL);
        limits.max_concurrent_provider_steps_per_session = PER_SESSION;
        limits.max_concurrent_tool_steps_per_session = PER_SESSION;
        let gate = gate(limits);
        let sessions: Vec<SessionId> = (0..SESSIONS).map(|_| SessionId::new()).collect();
        // Index 0..SESSIONS: per-session counters; SESSIONS: global.
        let current: Arc<Vec<[AtomicUsize; 2]>> = Arc::new(
            (0..=SESSIONS)
                .map(|_| [AtomicUsize::new(0), AtomicUsize::new(0)])
                .collect(),
        );
        let high: Arc<Vec<[AtomicUsize; 2]>> = Arc::new(
            (0..=SESSIONS)
                .map(|_| [AtomicUsize::new(0), AtomicUsize::new(0)])
                .collect(),
        );
        let mut tasks = Vec::new();
        for t in 0..24 {
            let (gate, current, high) =
                (Arc::clone(&gate), Arc::clone(&current), Arc::clone(&high));
            let s = t % SESSIONS;
            let session = sessions[s];
            let kind = if t % 2 == 0 {
                StepKind::Provider
            } else {
                StepKind::Tool
            };
            tasks.push(tokio::spawn(async move {
                let cancel = CancellationToken::new();
                let k = kind as usize;
                for _ in 0..20 {
                    let permit = step(&gate, kind, Some(session), None, &cancel)
                        .await
                        .unwrap();
                    for i in [s, SESSIONS] {
                        let now = current[i][k].fetch_add(1, Ordering::SeqCst) + 1;
                        high[i][k].fetch_max(now, Ordering::SeqCst);
                    }
                    for _ in 0..3 {
                        tokio::task::yield_now().await;
                    }
                    for i in [s, SESSIONS] {
                        current[i][k].fetch_sub(1, Ordering::SeqCst);
                    }
                    drop(permit);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        for k in 0..2 {
            let global = high[SESSIONS][k].load(Ordering::SeqCst);
            assert!((1..=GLOBAL).contains(&global), "global high-water {global}");
            for s in 0..SESSIONS {
                let h = high[s][k].load(Ordering::SeqCst);
                assert!((1..=PER_SESSION).contains(&h), "session high-water {h}");
            }
        }
        assert_eq!(gate.snapshot(), idle());
    }
}

/// Run quota.
mod gate_run_quota {
    use super::*;

    #[tokio::test]
    async fn try_admit_run_fails_fast_naming_the_full_limit() {
        let mut limits = GateLimits::uniform(2);
        limits.max_concurrent_runs_per_session = 1;
        let gate = gate(limits);
        let (s1, s2, s3) = (SessionId::new(), SessionId::new(), SessionId::new());

        let r1 = gate.try_admit_run(s1).unwrap();
        assert_eq!(r1.session(), s1);
        assert_eq!(
            gate.try_admit_run(s1).unwrap_err(),
            EngineError::RunQuotaExceeded {
                scope: GateScope::Session,
                limit: 1
            }
        );
        let r2 = gate.try_admit_run(s2).unwrap();
        let err = gate.try_admit_run(s3).unwrap_err();
        assert_eq!(
            err,
            EngineError::RunQuotaExceeded {
                scope: GateScope::Global,
                limit: 2
            }
        );
        assert!(err.to_string().contains("global limit of 2"), "{err}");
        // Refusals hold nothing: two runs, two session entries.
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                runs_in_use: 2,
                keyed_semaphores: 2,
                ..idle()
            }
        );
        // Run quota and step permits are independent.
        let cancel = CancellationToken::new();
        let steps = gate
            .acquire_provider_step(Some(s3), None, &cancel)
            .await
            .unwrap();
        drop(steps);
        drop(r1);
        let r3 = gate.try_admit_run(s3).unwrap();
        drop((r2, r3));
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn admit_run_waits_for_quota_and_is_cancellable() {
        let gate = gate(GateLimits::uniform(1));
        let session = SessionId::new();
        let held = gate.try_admit_run(session).unwrap();

        // Waits, then gets the quota once it is released.
        let cancel = CancellationToken::new();
        let mut waiting = pin!(gate.admit_run(session, &cancel));
        assert!(poll!(&mut waiting).is_pending());
        drop(held);
        let second = waiting.await.unwrap();

        // Cancelled while waiting: Cancelled, nothing leaked.
        let other = SessionId::new();
        let cancel = CancellationToken::new();
        let mut waiting = pin!(gate.admit_run(other, &cancel));
        assert!(poll!(&mut waiting).is_pending());
        cancel.cancel();
        assert_eq!(waiting.await.unwrap_err(), EngineError::Cancelled);
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                runs_in_use: 1,
                keyed_semaphores: 1,
                ..idle()
            }
        );
        drop(second);
        assert_eq!(gate.snapshot(), idle());
    }
}

/// Cancellation and cleanup.
mod gate_cancellation {
    use super::*;

    #[tokio::test]
    async fn cancel_while_waiting_at_the_global_stage_leaks_nothing() {
        let mut limits = GateLimits::uniform(4);
        limits.max_concurrent_tool_steps = 1;
        let gate = gate(limits);
        let never = CancellationToken::new();
        let holder = gate
            .acquire_tool_step(Some(SessionId::new()), None, &never)
            .await
            .unwrap();

        let cancel = CancellationToken::new();
        let mut waiter = pin!(gate.acquire_tool_step(Some(SessionId::new()), None, &cancel));
        assert!(poll!(&mut waiter).is_pending());
        // At the global stage, the last one: the waiter holds its session permit.
        assert_eq!(gate.snapshot().keyed_semaphores, 2);
        cancel.cancel();
        assert_eq!(waiter.await.unwrap_err(), EngineError::Cancelled);
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                tool_steps_in_use: 1,
                keyed_semaphores: 1,
                ..idle()
            }
        );
        drop(holder);
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn cancel_while_waiting_at_the_session_stage_leaks_nothing() {
        let mut limits = GateLimits::uniform(4);
        limits.max_concurrent_provider_steps_per_session = 1;
        let gate = gate(limits);
        let session = SessionId::new();
        let never = CancellationToken::new();
        let holder = gate
            .acquire_provider_step(Some(session), None, &never)
            .await
            .unwrap();

        let cancel = CancellationToken::new();
        let mut waiter = pin!(gate.acquire_provider_step(Some(session), None, &cancel));
        assert!(poll!(&mut waiter).is_pending());
        // The waiter shares the session's entry and holds no global permit.
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                provider_steps_in_use: 1,
                keyed_semaphores: 1,
                ..idle()
            }
        );
        cancel.cancel();
        assert_eq!(waiter.await.unwrap_err(), EngineError::Cancelled);
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                provider_steps_in_use: 1,
                keyed_semaphores: 1,
                ..idle()
            }
        );
        drop(holder);
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn cancel_while_waiting_at_the_agent_stage_releases_the_session_permit() {
        let worker = agent("worker");
        let mut limits = GateLimits::uniform(4);
        limits
            .max_concurrent_provider_steps_per_agent
            .insert(worker.clone(), 1);
        let gate = gate(limits);
        let never = CancellationToken::new();
        let holder = gate
            .acquire_provider_step(Some(SessionId::new()), Some(&worker), &never)
            .await
            .unwrap();
        assert_eq!(gate.snapshot().keyed_semaphores, 2);

        let cancel = CancellationToken::new();
        let mut waiter =
            pin!(gate.acquire_provider_step(Some(SessionId::new()), Some(&worker), &cancel));
        assert!(poll!(&mut waiter).is_pending());
        // Waiter: its own session + the shared agent entry, no global permit.
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                provider_steps_in_use: 1,
                keyed_semaphores: 3,
                ..idle()
            }
        );
        cancel.cancel();
        assert_eq!(waiter.await.unwrap_err(), EngineError::Cancelled);
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                provider_steps_in_use: 1,
                keyed_semaphores: 2,
                ..idle()
            }
        );
        // An agent without a per-agent limit is not limited per agent.
        let free = gate
            .acquire_provider_step(None, Some(&agent("other")), &never)
            .await
            .unwrap();
        assert_eq!(gate.snapshot().keyed_semaphores, 2);
        drop((holder, free));
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn dropping_a_waiting_acquire_leaks_nothing() {
        let mut limits = GateLimits::uniform(4);
        limits.max_concurrent_tool_steps_per_session = 1;
        let gate = gate(limits);
        let session = SessionId::new();
        let cancel = CancellationToken::new();
        let holder = gate
            .acquire_tool_step(Some(session), None, &cancel)
            .await
            .unwrap();
        {
            let mut waiter = Box::pin(gate.acquire_tool_step(Some(session), None, &cancel));
            assert!(poll!(&mut waiter).is_pending());
            assert_eq!(gate.snapshot().tool_steps_in_use, 1);
            // Dropped mid-wait, like an aborted task.
        }
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                tool_steps_in_use: 1,
                keyed_semaphores: 1,
                ..idle()
            }
        );
        drop(holder);
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn an_already_cancelled_token_takes_no_permit() {
        let gate = gate(GateLimits::uniform(4));
        let cancel = CancellationToken::new();
        cancel.cancel();
        let session = Some(SessionId::new());
        assert_eq!(
            gate.acquire_provider_step(session, None, &cancel)
                .await
                .unwrap_err(),
            EngineError::Cancelled
        );
        assert_eq!(
            gate.acquire_tool_step(session, None, &cancel)
                .await
                .unwrap_err(),
            EngineError::Cancelled
        );
        assert_eq!(
            gate.admit_run(SessionId::new(), &cancel).await.unwrap_err(),
            EngineError::Cancelled
        );
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn keyed_semaphores_are_removed_when_unused() {
        let worker = agent("worker");
        let mut limits = GateLimits::uniform(8);
        limits
            .max_concurrent_tool_steps_per_agent
            .insert(worker.clone(), 2);
        let gate = gate(limits);
        let cancel = CancellationToken::new();
        let sessions: Vec<SessionId> = (0..5).map(|_| SessionId::new()).collect();
        let mut held = Vec::new();
        for &s in &sessions {
            held.push(
                gate.acquire_provider_step(Some(s), None, &cancel)
                    .await
                    .unwrap(),
            );
        }
        let tools = [
            gate.acquire_tool_step(Some(sessions[0]), Some(&worker), &cancel)
                .await
                .unwrap(),
            gate.acquire_tool_step(Some(sessions[0]), Some(&worker), &cancel)
                .await
                .unwrap(),
        ];
        let run = gate.try_admit_run(sessions[0]).unwrap();
        // 5 provider-session + 1 tool-session + 1 tool-agent + 1 run-session.
        assert_eq!(gate.snapshot().keyed_semaphores, 8);
        // Permits without a session or agent use no keyed entry.
        let anonymous = gate.acquire_tool_step(None, None, &cancel).await.unwrap();
        assert_eq!(gate.snapshot().keyed_semaphores, 8);
        drop(anonymous);

        let [t1, t2] = tools;
        drop(t1);
        assert_eq!(
            gate.snapshot().keyed_semaphores,
            8,
            "one tool permit still uses both"
        );
        drop(t2);
        assert_eq!(gate.snapshot().keyed_semaphores, 6);
        held.truncate(2);
        assert_eq!(gate.snapshot().keyed_semaphores, 3);
        drop(held);
        drop(run);
        assert_eq!(gate.snapshot(), idle());

        // A key whose entry was removed starts again with its full limit.
        let again = [
            gate.acquire_tool_step(Some(sessions[0]), Some(&worker), &cancel)
                .await
                .unwrap(),
            gate.acquire_tool_step(Some(sessions[1]), Some(&worker), &cancel)
                .await
                .unwrap(),
        ];
        let mut third = pin!(gate.acquire_tool_step(Some(sessions[2]), Some(&worker), &cancel));
        assert!(poll!(&mut third).is_pending(), "agent limit 2 still holds");
        drop(again);
        drop(third.await.unwrap());
        assert_eq!(gate.snapshot(), idle());
    }
}

/// Nested delegation.
mod gate_nested_delegation {
    use super::*;

    /// One model call of an agent: takes and releases a provider step.
    async fn model_call(gate: &ExecutionGate, session: SessionId, cancel: &CancellationToken) {
        let permit = gate
            .acquire_provider_step(Some(session), None, cancel)
            .await
            .unwrap();
        tokio::task::yield_now().await;
        drop(permit);
    }

    #[tokio::test(start_paused = true)]
    async fn nested_delegation_with_every_limit_at_one_does_not_deadlock() {
        let gate = gate(GateLimits::uniform(1));
        let root_session = SessionId::new();
        let cancel = CancellationToken::new();

        let tree = async {
            // Root turn: step permits, no run quota.
            model_call(&gate, root_session, &cancel).await;
            // The root delegates: the child run takes the single run permit.
            let child_run = gate.try_admit_run(root_session).unwrap();
            // Quota is full: a second (background) admission fails fast.
            assert_eq!(
                gate.try_admit_run(root_session).unwrap_err(),
                EngineError::RunQuotaExceeded {
                    scope: GateScope::Global,
                    limit: 1
                }
            );
            // The parent waits on its child holding a run permit but no step
            // permit; the child's steps get the single provider and tool permit.
            let (done_tx, done_rx) = oneshot::channel();
            let child = tokio::spawn({
                let gate = Arc::clone(&gate);
                let cancel = cancel.clone();
                async move {
                    let _run = child_run;
                    model_call(&gate, root_session, &cancel).await;
                    let tool = gate
                        .acquire_tool_step(Some(root_session), None, &cancel)
                        .await
                        .unwrap();
                    drop(tool);
                    model_call(&gate, root_session, &cancel).await;
                    done_tx.send("child result").unwrap();
                    // `_run` drops here: the terminal commit releases the quota.
                }
            });
            let result = done_rx.await.unwrap();
            child.await.unwrap();
            // The parent resumes with its own model call.
            model_call(&gate, root_session, &cancel).await;
            result
        };
        // With paused time a deadlock would let this timeout fire at once.
        let result = tokio::time::timeout(Duration::from_secs(60), tree)
            .await
            .expect("nested delegation deadlocked");
        assert_eq!(result, "child result");
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn a_parent_holding_its_step_permit_would_block_its_child() {
        // The counterfactual (a parent waiting on children while it holds a
        // step permit), to show the previous test bites.
        let gate = gate(GateLimits::uniform(1));
        let session = SessionId::new();
        let cancel = CancellationToken::new();
        let _child_run = gate.try_admit_run(session).unwrap();
        let parent_step = gate
            .acquire_provider_step(Some(session), None, &cancel)
            .await
            .unwrap();
        let mut child_step = pin!(gate.acquire_provider_step(Some(session), None, &cancel));
        assert!(poll!(&mut child_step).is_pending());
        drop(parent_step);
        assert!(poll!(&mut child_step).is_ready());
    }
}

/// StepGate impl through the AgentLoop.
mod gate_step_gate_impl {
    use super::*;

    /// A tool that records how many calls run at once and what the gate holds.
    struct Probe {
        current: AtomicUsize,
        high_water: AtomicUsize,
        calls: AtomicUsize,
        gate: Option<Arc<ExecutionGate>>,
    }

    impl Probe {
        fn new(gate: Option<Arc<ExecutionGate>>) -> Arc<Self> {
            Arc::new(Self {
                current: AtomicUsize::new(0),
                high_water: AtomicUsize::new(0),
                calls: AtomicUsize::new(0),
                gate,
            })
        }
    }

    struct ProbeTool(Arc<Probe>);

    #[async_trait]
    impl Tool for ProbeTool {
        fn name(&self) -> &str {
            "probe"
        }
        fn description(&self) -> &str {
            "records concurrency"
        }
        fn parameters(&self) -> serde_json::Value {
            json!({"type": "object"})
        }
        fn delegation_policy(&self) -> DelegationPolicy {
            DelegationPolicy::Delegatable
        }
        async fn execute(
            &self,
            args: serde_json::Value,
            _: &ToolExecutionContext,
        ) -> Result<ToolOutput, ToolError> {
            let p = &self.0;
            let now = p.current.fetch_add(1, Ordering::SeqCst) + 1;
            p.high_water.fetch_max(now, Ordering::SeqCst);
            if let Some(gate) = &p.gate {
                let held = gate.snapshot();
                assert_eq!(held.tool_steps_in_use, 1, "a tool runs under its permit");
                assert_eq!(held.provider_steps_in_use, 0, "no provider step meanwhile");
            }
            // Give the other calls of the batch every chance to overlap.
            for _ in 0..5 {
                tokio::task::yield_now().await;
            }
            p.current.fetch_sub(1, Ordering::SeqCst);
            p.calls.fetch_add(1, Ordering::SeqCst);
            Ok(ToolOutput::text(format!("probed {args}")))
        }
    }

    fn batch_of_three() -> ScriptedProvider {
        let call = |n: u32| ScriptedToolCall {
            id: Some(format!("call_{n}")),
            name: "probe".into(),
            arguments: json!({ "n": n }),
        };
        ScriptedProvider::new([
            ScriptedResponse {
                tool_calls: vec![call(1), call(2), call(3)],
                ..ScriptedResponse::default()
            },
            ScriptedResponse::text("all probed"),
        ])
    }

    fn turn(
        provider: ScriptedProvider,
        probe: &Arc<Probe>,
        context: ToolExecutionContext,
    ) -> TurnRequest {
        let mut tools = ToolRegistry::new();
        tools
            .register(Arc::new(ProbeTool(Arc::clone(probe))))
            .unwrap();
        TurnRequest {
            provider: Arc::new(provider),
            tools: Arc::new(tools),
            system_prompt: None,
            history: Vec::new(),
            input: vec![Message::user("probe three times")],
            max_iterations: 4,
            max_output_tokens: None,
            context,
        }
    }

    #[tokio::test]
    async fn agent_loop_with_every_limit_at_one_runs_a_parallel_batch_one_tool_at_a_time() {
        let mut limits = GateLimits::uniform(1);
        limits
            .max_concurrent_provider_steps_per_agent
            .insert(agent("root"), 1);
        limits
            .max_concurrent_tool_steps_per_agent
            .insert(agent("root"), 1);
        let gate = gate(limits);
        let probe = Probe::new(Some(Arc::clone(&gate)));
        let mut context = ToolExecutionContext {
            session_id: Some(SessionId::new()),
            ..ToolExecutionContext::default()
        };
        context.extensions.insert(StepScope {
            session: None,
            agent: Some(agent("root")),
        });
        let agent_loop = AgentLoop::new(Arc::clone(&gate) as Arc<dyn StepGate>);

        let out = agent_loop
            .run(turn(batch_of_three(), &probe, context), None)
            .await
            .unwrap();

        assert_eq!(out.final_text(), "all probed");
        assert_eq!(out.tool_calls, 3);
        assert_eq!(out.iterations, 2);
        assert_eq!(probe.calls.load(Ordering::SeqCst), 3);
        assert_eq!(probe.high_water.load(Ordering::SeqCst), 1);
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn open_gate_runs_the_same_batch_concurrently() {
        // Shows the high-water probe above would see overlap if the gate allowed it.
        let probe = Probe::new(None);
        let agent_loop = AgentLoop::new(Arc::new(OpenGate));
        let out = agent_loop
            .run(
                turn(batch_of_three(), &probe, ToolExecutionContext::default()),
                None,
            )
            .await
            .unwrap();
        assert_eq!(out.tool_calls, 3);
        assert_eq!(probe.high_water.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn step_gate_reads_session_and_agent_from_step_scope() {
        let worker = agent("worker");
        let mut limits = GateLimits::uniform(4);
        limits.max_concurrent_tool_steps_per_session = 1;
        limits
            .max_concurrent_tool_steps_per_agent
            .insert(worker.clone(), 1);
        let gate = gate(limits);
        let (ctx_session, root_session) = (SessionId::new(), SessionId::new());
        let mut ctx = ToolExecutionContext {
            session_id: Some(ctx_session),
            ..ToolExecutionContext::default()
        };
        ctx.extensions.insert(StepScope {
            session: Some(root_session),
            agent: Some(worker.clone()),
        });

        let permit = gate.tool_step(&ctx).await.unwrap();
        assert!(permit.downcast_ref::<StepPermitGuard>().is_some());
        assert_eq!(
            gate.snapshot().keyed_semaphores,
            2,
            "root session + worker agent"
        );
        let never = CancellationToken::new();
        // The scope's session is limited, the ctx's own session is not involved.
        let mut same_session = pin!(gate.acquire_tool_step(Some(root_session), None, &never));
        assert!(poll!(&mut same_session).is_pending());
        let mut same_agent = pin!(gate.acquire_tool_step(None, Some(&worker), &never));
        assert!(poll!(&mut same_agent).is_pending());
        let other = gate
            .acquire_tool_step(Some(ctx_session), None, &never)
            .await
            .unwrap();
        drop(permit);
        drop((
            same_session.await.unwrap(),
            same_agent.await.unwrap(),
            other,
        ));

        // Without a StepScope the ctx's session applies.
        let plain = ToolExecutionContext {
            session_id: Some(ctx_session),
            ..ToolExecutionContext::default()
        };
        let permit = gate.provider_step(&plain).await.unwrap();
        let mut same = pin!(gate.acquire_provider_step(Some(ctx_session), None, &never));
        assert!(
            poll!(&mut same).is_ready(),
            "provider per-session limit is 4"
        );
        drop(permit);
        assert_eq!(gate.snapshot(), idle());
    }

    #[tokio::test]
    async fn a_turn_cancelled_while_waiting_for_a_step_is_cancelled_and_leaks_nothing() {
        let gate = gate(GateLimits::uniform(1));
        let session = SessionId::new();
        let never = CancellationToken::new();
        let busy = gate
            .acquire_provider_step(Some(SessionId::new()), None, &never)
            .await
            .unwrap();

        let cancel = CancellationToken::new();
        let context = ToolExecutionContext {
            session_id: Some(session),
            cancellation: cancel.clone(),
            ..ToolExecutionContext::default()
        };
        let probe = Probe::new(None);
        let agent_loop = AgentLoop::new(Arc::clone(&gate) as Arc<dyn StepGate>);
        let provider = batch_of_three();
        let mut running = pin!(agent_loop.run(turn(provider.clone(), &probe, context), None));
        assert!(poll!(&mut running).is_pending());
        cancel.cancel();
        assert_eq!(running.await.unwrap_err(), EngineError::Cancelled);
        assert!(
            provider.requests().is_empty(),
            "the provider was never called"
        );
        assert_eq!(
            gate.snapshot(),
            GateCounters {
                provider_steps_in_use: 1,
                keyed_semaphores: 1,
                ..idle()
            }
        );
        drop(busy);
        assert_eq!(gate.snapshot(), idle());
    }
}
