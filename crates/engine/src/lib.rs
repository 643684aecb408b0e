//! The keel engine: the agent loop, built-in tools, sessions with context
//! slots, incremental checkpoints, dialogs, and sub-agent orchestration
//! (delegation, the execution gate, the run reaper and recovery).
//!
//! Where to start reading:
//!
//! - [`AgentLoop`] runs one turn: provider call, parallel tool calls, repeat.
//!   It writes nothing; its caller commits the turn.
//! - [`SessionManager`] owns sessions in memory: it runs their turns and
//!   commits each (messages, state, checkpoint) in one store transaction, and
//!   manages dialogs, slots, memory, checkpoints and dialog exports.
//! - [`AgentCoordinator`] admits, persists, executes and ends sub-agent runs;
//!   the root agent reaches it through the `delegate` and `agent_task` tools
//!   ([`AgentCoordinator::root_tools`]).
//! - [`ExecutionGate`] bounds how many runs exist and how many provider and
//!   tool steps execute at once, globally, per session and per agent.
//!
//! Every fallible operation returns [`EngineError`]; at the tool boundary a
//! refusal reaches the model as precise text and an internal failure as an
//! error id whose detail is in the log.
//!
//! Architecture invariant: the engine never writes SQL (it calls keel-store's
//! domain API) and never speaks HTTP (providers come in as `Arc<dyn Provider>`).
#![deny(missing_docs)]

mod address;
mod agent_loop;
mod approval;
mod budget;
mod clock;
mod context;
mod coordinator;
mod error;
mod events;
mod export;
mod export_runs;
mod export_tree;
mod fence;
mod gate;
mod images;
mod mailbox;
mod manager;
mod metrics;
mod session;
mod state;
mod tools;
mod trace;

pub use address::DialogAddress;
pub use agent_loop::{
    AgentLoop, EventSink, OpenGate, StepGate, StepPermit, TurnEvent, TurnOutput, TurnRequest,
};
pub use approval::{ApprovalPolicy, SUPERSEDED_REASON};
pub use budget::Spend;
pub use context::{estimate_request_tokens, DEFAULT_CONTEXT_WINDOW_TOKENS};
pub use coordinator::{
    project_response, AgentCoordinator, AgentRunView, CallerContext, CatalogSource,
    CoordinatorConfig, DelegateRequest, DelegateResponse, DelegateTask, ForegroundResult,
    ProfileProviders, ProviderFactory, RunEvent, RunObserver, RunResult, SignalView,
};
pub use error::{EngineError, Result};
pub use events::{SessionEvent, SessionEvents, SessionSubscription, SubscriptionError};
pub use export::{
    DialogExport, ExportedDialog, ExportedImage, ExportedMessage, ExportedModel, ExportedRun,
    ExportedRunTimes, DIALOG_FORMAT, DIALOG_FORMAT_VERSION, MAX_DIALOG_EXPORT_BYTES,
};
pub use export_tree::{ExportedCheckpoint, ExportedTimeline};
pub use gate::{
    ExecutionGate, GateCounters, GateLimits, GateScope, RunPermit, StepKind, StepPermitGuard,
    StepScope,
};
pub use images::{resolve_images, ResolvingImages};
pub use mailbox::{MailboxLimits, WakeSource, WakeupState};
pub use manager::{
    apply_retention, AgentSet, AgentSetBuilder, InboxPolicy, NewSessionSpec, RetentionPolicy,
    RetentionReport, RuntimeBundle, SessionManager, SessionManagerConfig, SteerOutcome, StopReport,
    SummaryConfig, TurnReport, TurnTicket, DEFAULT_LEASE_LINGER,
};
pub use session::{AgentProfile, AgentSession};
pub use state::{
    HistoryMessage, MemoryEntry, MergeStrategy, Segment, SessionState, SlotConfig, SlotMode,
};
pub use tools::{
    builtin_registry, check_sandbox_support, grant_skills, register_memory_tools,
    run_sandbox_launcher, BuiltinToolsConfig, LandlockPolicy, ShellConfig, ShellConfinement,
    DEFAULT_SHELL_READ_PATHS, SANDBOX_LAUNCHER_ARG,
};
pub use trace::{
    install_span_linker, set_record_content, SpanHandle, SpanLinker, TARGET as TRACE_TARGET,
};
