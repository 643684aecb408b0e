//! Who is delegating: the [`AgentExecutionContext`] of a run, the
//! [`CallerContext`] derived from it (or from a root turn), and the
//! [`TreeBudget`] shared by every run of one delegation tree.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use keel_core::{
    AgentId, CancellationToken, ExecutionMode, RunId, SessionId, ToolExecutionContext, TurnId,
};
use parking_lot::Mutex;

use crate::budget::SpendMeter;
use crate::error::{EngineError, Result};

/// The runs a delegation tree may still create: one shared atomic count.
/// A tree starts at one delegate call of the root agent and contains every
/// run that call and its descendants create.
#[derive(Debug)]
pub(crate) struct TreeBudget {
    limit: u32,
    used: AtomicU32,
}

impl TreeBudget {
    /// A budget of `limit` runs, none used.
    pub(crate) fn new(limit: u32) -> Self {
        Self::with_used(limit, 0)
    }

    /// A budget of `limit` runs of which `used` exist already (a tree a
    /// resumed run belongs to).
    pub(crate) fn with_used(limit: u32, used: u32) -> Self {
        Self {
            limit,
            used: AtomicU32::new(used),
        }
    }

    /// The most runs the tree may create.
    pub(crate) fn limit(&self) -> u32 {
        self.limit
    }

    /// Reserves `n` runs, all or nothing; on refusal returns the count in use.
    pub(crate) fn try_reserve(&self, n: u32) -> Result<(), u32> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= self.limit)
            })
            .map(|_| ())
    }

    /// Gives back `n` reserved runs that were never persisted.
    pub(crate) fn release(&self, n: u32) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(n))
            });
    }
}

/// Why a run's token was cancelled, recorded before cancelling it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CancelCause {
    pub(crate) reason: String,
    /// Record a background completion as consumed (the root asked for it).
    pub(crate) quiet: bool,
}

/// Identity, limits and cancellation of one sub-agent run: the authorization
/// facts its tools (delegate, agent_task) read. Put in the run's
/// [`ToolExecutionContext::extensions`] as `Arc<AgentExecutionContext>`.
#[derive(Debug)]
pub(crate) struct AgentExecutionContext {
    /// The root session the run's tree belongs to (its inbox gets completions).
    pub(crate) root_session_id: SessionId,
    /// The root turn that started the tree, if known.
    pub(crate) root_turn_id: Option<TurnId>,
    /// This run.
    pub(crate) run_id: RunId,
    /// The delegating run (`None` when the root agent delegated).
    pub(crate) parent_run_id: Option<RunId>,
    /// The agent definition this run executes.
    pub(crate) agent_id: AgentId,
    /// Agents from the root's child down to this run's agent, inclusive.
    pub(crate) ancestry: Vec<AgentId>,
    /// Delegation depth (1 for a child of the root).
    pub(crate) depth: u32,
    /// Foreground or background.
    pub(crate) mode: ExecutionMode,
    /// The run budget of the tree, shared with every run in it.
    pub(crate) budget: Arc<TreeBudget>,
    /// The execution that owns the run; every state change presents it.
    pub(crate) execution_id: String,
    /// Deadline (Unix ms).
    pub(crate) deadline_at_ms: i64,
    /// Fires when the run is cancelled; foreground children derive from it.
    pub(crate) cancellation: CancellationToken,
    pub(crate) max_children: u32,
    pub(crate) children_started: AtomicU32,
    /// The spend budgets the run's model calls count against.
    pub(crate) spend: Arc<SpendMeter>,
    pub(crate) cancel_cause: Mutex<Option<CancelCause>>,
}

impl AgentExecutionContext {
    /// Records why the run is being cancelled (first cause wins) and cancels it.
    pub(crate) fn cancel(&self, reason: impl Into<String>, quiet: bool) {
        {
            let mut cause = self.cancel_cause.lock();
            if cause.is_none() {
                *cause = Some(CancelCause {
                    reason: reason.into(),
                    quiet,
                });
            }
        }
        self.cancellation.cancel();
    }

    /// The recorded cancel cause, or the default one (an ancestor or the turn was cancelled).
    pub(crate) fn cancel_cause(&self) -> CancelCause {
        self.cancel_cause.lock().clone().unwrap_or(CancelCause {
            reason: "cancelled: the delegating turn or run was cancelled".into(),
            quiet: false,
        })
    }

    /// Reserves `n` children against `limits.max_children`; on refusal returns the count started.
    pub(crate) fn try_start_children(&self, n: u32) -> Result<(), u32> {
        let limit = self.max_children;
        self.children_started
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |started| {
                started.checked_add(n).filter(|total| *total <= limit)
            })
            .map(|_| ())
    }

    /// Gives back `n` children that were never persisted.
    pub(crate) fn release_children(&self, n: u32) {
        let _ = self
            .children_started
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                Some(s.saturating_sub(n))
            });
    }

    /// The run's `limits.max_children`.
    pub(crate) fn max_children(&self) -> u32 {
        self.max_children
    }
}

/// Who calls the coordinator: the root turn of a session, or a run.
#[derive(Debug, Clone)]
pub struct CallerContext {
    root_session_id: SessionId,
    root_turn_id: Option<TurnId>,
    run: Option<Arc<AgentExecutionContext>>,
    cancellation: CancellationToken,
    /// The root turn's run budget: every delegation made through this caller
    /// (and its clones) draws from it.
    root_budget: Arc<OnceLock<Arc<TreeBudget>>>,
    /// The caller's spend budgets: a run's, or the root turn's (when the
    /// turn has them).
    spend: Option<Arc<SpendMeter>>,
}

impl CallerContext {
    /// The root turn `turn_id` of `session`, cancelled by `cancellation`
    /// (`/stop`). Every delegation made through it (and its clones) shares
    /// one run budget of `max_runs_per_tree`.
    pub fn root(
        session: SessionId,
        turn_id: TurnId,
        cancellation: CancellationToken,
    ) -> CallerContext {
        CallerContext {
            root_session_id: session,
            root_turn_id: Some(turn_id),
            run: None,
            cancellation,
            root_budget: Arc::new(OnceLock::new()),
            spend: None,
        }
    }

    /// The run described by `context`.
    pub(crate) fn run(context: Arc<AgentExecutionContext>) -> CallerContext {
        CallerContext {
            root_session_id: context.root_session_id,
            root_turn_id: context.root_turn_id,
            cancellation: context.cancellation.clone(),
            spend: Some(Arc::clone(&context.spend)),
            run: Some(context),
            root_budget: Arc::new(OnceLock::new()),
        }
    }

    /// Derives the caller from a tool call's context: a run (its
    /// `Arc<AgentExecutionContext>` extension, matching `run_id`) or a root
    /// turn (`run_id` absent, session and turn present). Anything else has no
    /// identity and may not delegate.
    pub(crate) fn from_tool_context(ctx: &ToolExecutionContext) -> Result<CallerContext> {
        match ctx.run_id {
            Some(run_id) => match ctx.extensions.get::<Arc<AgentExecutionContext>>() {
                Some(agent) if agent.run_id == run_id => {
                    let mut caller = CallerContext::run(Arc::clone(agent));
                    // The tool's own token is the run's token or a child of it.
                    caller.cancellation = ctx.cancellation.clone();
                    Ok(caller)
                }
                _ => Err(EngineError::MissingCallerIdentity),
            },
            None => match (ctx.session_id, ctx.turn_id) {
                (Some(session), Some(turn)) => {
                    let mut caller = CallerContext::root(session, turn, ctx.cancellation.clone());
                    caller.spend = ctx.extensions.get::<Arc<SpendMeter>>().cloned();
                    // The turn's own budget, shared by all its tool calls.
                    if let Some(budget) = ctx.extensions.get::<Arc<TreeBudget>>() {
                        let _ = caller.root_budget.set(Arc::clone(budget));
                    }
                    Ok(caller)
                }
                _ => Err(EngineError::MissingCallerIdentity),
            },
        }
    }

    /// The root session.
    pub(crate) fn root_session_id(&self) -> SessionId {
        self.root_session_id
    }

    /// The root turn, if known.
    pub(crate) fn root_turn_id(&self) -> Option<TurnId> {
        self.root_turn_id
    }

    /// The calling run's context (`None` for the root agent).
    pub(crate) fn run_context(&self) -> Option<&Arc<AgentExecutionContext>> {
        self.run.as_ref()
    }

    /// Whether the caller is the root agent.
    pub(crate) fn is_root(&self) -> bool {
        self.run.is_none()
    }

    /// The calling agent (`None` for the root agent).
    pub(crate) fn agent_id(&self) -> Option<&AgentId> {
        self.run.as_ref().map(|r| &r.agent_id)
    }

    /// The calling agent's name as shown in messages (`root` for the root agent).
    pub(crate) fn agent_name(&self) -> String {
        self.agent_id()
            .map_or_else(|| "root".to_owned(), |a| a.as_str().to_owned())
    }

    /// The caller's depth (0 for the root agent).
    pub(crate) fn depth(&self) -> u32 {
        self.run.as_ref().map_or(0, |r| r.depth)
    }

    /// The run budget of the caller's tree: its run's, or the root turn's
    /// (created with `limit` on first use).
    pub(crate) fn tree_budget(&self, limit: u32) -> Arc<TreeBudget> {
        match &self.run {
            Some(run) => Arc::clone(&run.budget),
            None => Arc::clone(
                self.root_budget
                    .get_or_init(|| Arc::new(TreeBudget::new(limit))),
            ),
        }
    }

    /// The caller's spend budgets, if it has any.
    pub(crate) fn spend(&self) -> Option<&Arc<SpendMeter>> {
        self.spend.as_ref()
    }

    /// The caller's cancellation token.
    pub(crate) fn cancellation(&self) -> &CancellationToken {
        &self.cancellation
    }

    /// The idempotency scope: the calling run, or the root turn.
    pub(crate) fn scope_id(&self) -> String {
        match (&self.run, self.root_turn_id) {
            (Some(run), _) => format!("run:{}", run.run_id),
            (None, Some(turn)) => format!("turn:{turn}"),
            (None, None) => format!("session:{}", self.root_session_id),
        }
    }
}
