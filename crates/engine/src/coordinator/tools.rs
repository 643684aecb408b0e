//! The runtime-injected tools: `delegate` (start sub-agent runs) and
//! `agent_task` (get, list, get_result, cancel runs of the caller's tree).
//! Both derive the caller from the tool context. Every engine error goes
//! through [`EngineError::into_tool_error`]: refusals reach the model with
//! the coordinator's message, internal failures as an error id.

use std::sync::{Arc, Weak};

use async_trait::async_trait;
use keel_catalog::AgentCatalog;
use keel_core::{
    AgentId, CompletionPolicy, DelegationPolicy, ExecutionMode, RunId, Tool, ToolError,
    ToolExecutionContext, ToolOutput,
};
use serde::Deserialize;

use super::context::CallerContext;
use super::view::{project_response, DelegateRequest, DelegateTask};
use super::AgentCoordinator;
use crate::error::{internal_tool_error, EngineError};
use crate::tools::MAX_TOOL_OUTPUT_BYTES;

/// Name of the delegate tool.
pub(crate) const DELEGATE_TOOL: &str = "delegate";
/// Name of the agent_task tool.
pub(crate) const AGENT_TASK_TOOL: &str = "agent_task";

/// Most runs `agent_task list` returns.
const LIST_LIMIT: usize = 50;

fn coordinator(weak: &Weak<AgentCoordinator>) -> Result<Arc<AgentCoordinator>, ToolError> {
    weak.upgrade()
        .ok_or_else(|| ToolError::Failed("the agent runtime is shutting down".into()))
}

fn invalid(e: serde_json::Error) -> ToolError {
    ToolError::InvalidArguments(e.to_string())
}

/// `delegate`: runs tasks on sub-agents, in the foreground or background.
pub(crate) struct DelegateTool {
    coordinator: Weak<AgentCoordinator>,
    description: String,
}

impl DelegateTool {
    /// A delegate tool whose description lists `targets` (with their
    /// descriptions from `catalog`). Authorization is still checked per call.
    pub(crate) fn new(
        coordinator: Weak<AgentCoordinator>,
        catalog: &AgentCatalog,
        targets: &[AgentId],
    ) -> Self {
        let mut description = String::from(
            "Delegate tasks to sub-agents. mode \"foreground\" (default) waits and returns each \
             result in request order (a batch runs concurrently); mode \"background\" returns run \
             ids at once and the results arrive in a later turn. Long results are cut; read them \
             in full with agent_task get_result.\nAgents you may delegate to:",
        );
        if targets.is_empty() {
            description.push_str(" none.");
        }
        for t in targets {
            let about = catalog.get(t).map(|d| d.description.as_str()).unwrap_or("");
            description.push_str(&format!("\n- {t}: {about}"));
        }
        Self {
            coordinator,
            description,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DelegateArgs {
    #[serde(default = "foreground")]
    mode: ExecutionMode,
    tasks: Vec<TaskArgs>,
    #[serde(default = "all")]
    completion_policy: CompletionPolicy,
    #[serde(default)]
    idempotency_key: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskArgs {
    agent: String,
    task: String,
    #[serde(default)]
    context: Option<serde_json::Value>,
}

fn foreground() -> ExecutionMode {
    ExecutionMode::Foreground
}

fn all() -> CompletionPolicy {
    CompletionPolicy::All
}

/// Parses delegate arguments; a malformed agent id is an unknown agent.
pub(crate) fn parse_delegate_args(args: serde_json::Value) -> Result<DelegateRequest, ToolError> {
    let args: DelegateArgs = serde_json::from_value(args).map_err(invalid)?;
    let tasks = args
        .tasks
        .into_iter()
        .map(|t| {
            let agent = AgentId::parse(&t.agent).map_err(|_| {
                EngineError::UnknownAgent(t.agent.chars().take(80).collect()).into_tool_error()
            })?;
            Ok(DelegateTask {
                agent,
                task: t.task,
                context: t.context,
            })
        })
        .collect::<Result<Vec<_>, ToolError>>()?;
    Ok(DelegateRequest {
        mode: args.mode,
        tasks,
        completion_policy: args.completion_policy,
        idempotency_key: args.idempotency_key,
    })
}

#[async_trait]
impl Tool for DelegateTool {
    fn name(&self) -> &str {
        DELEGATE_TOOL
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["foreground", "background"], "default": "foreground"},
                "tasks": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "agent": {"type": "string", "description": "id of the agent to run"},
                            "task": {"type": "string", "description": "what it should do"},
                            "context": {"description": "optional extra context (any JSON)"}
                        },
                        "required": ["agent", "task"],
                        "additionalProperties": false
                    }
                },
                "completion_policy": {"type": "string", "enum": ["all", "each"], "default": "all"},
                "idempotency_key": {"type": "string", "description": "repeat it to retry without starting the work twice"}
            },
            "required": ["tasks"],
            "additionalProperties": false
        })
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RuntimeInjected
    }

    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let coordinator = coordinator(&self.coordinator)?;
        let caller = CallerContext::from_tool_context(ctx).map_err(EngineError::into_tool_error)?;
        let request = parse_delegate_args(args)?;
        let spend = caller.spend().cloned();
        let response = coordinator
            .delegate(caller, request)
            .await
            .map_err(EngineError::into_tool_error)?;
        let mut text = project_response(&response, coordinator.config().result_preview_bytes);
        // What the delegating model may still spend, now that its children
        // (foreground) ended.
        if let Some(remaining) = spend.and_then(|s| s.remaining()) {
            text.push('\n');
            text.push_str(&remaining);
        }
        Ok(ToolOutput::text(text))
    }
}

/// `agent_task`: inspect or cancel runs of the caller's own tree.
pub(crate) struct AgentTaskTool {
    coordinator: Weak<AgentCoordinator>,
    /// Without `cancel` (a continuation turn's copy).
    read_only: bool,
}

impl AgentTaskTool {
    /// The tool, bound to `coordinator`.
    pub(crate) fn new(coordinator: Weak<AgentCoordinator>) -> Self {
        Self {
            coordinator,
            read_only: false,
        }
    }

    /// The tool without `cancel`: it only reads runs (continuation turns).
    pub(crate) fn read_only(coordinator: Weak<AgentCoordinator>) -> Self {
        Self {
            coordinator,
            read_only: true,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum TaskAction {
    Get,
    List,
    GetResult,
    Cancel,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskToolArgs {
    action: TaskAction,
    #[serde(default)]
    run_id: Option<String>,
}

fn pretty<T: serde::Serialize>(value: &T) -> Result<String, ToolError> {
    serde_json::to_string_pretty(value).map_err(|e| internal_tool_error(&e))
}

#[async_trait]
impl Tool for AgentTaskTool {
    fn name(&self) -> &str {
        AGENT_TASK_TOOL
    }

    fn description(&self) -> &str {
        if self.read_only {
            return "Inspect the sub-agent runs you started (and their descendants). \
                    action get (status of run_id), list (your runs, newest first), get_result \
                    (the full result of run_id).";
        }
        "Inspect or cancel the sub-agent runs you started (and their descendants). \
         action get (status of run_id), list (your runs, newest first), get_result (the full \
         result of run_id), cancel (stop run_id and its foreground descendants)."
    }

    fn parameters(&self) -> serde_json::Value {
        let actions: &[&str] = if self.read_only {
            &["get", "list", "get_result"]
        } else {
            &["get", "list", "get_result", "cancel"]
        };
        serde_json::json!({
            "type": "object",
            "properties": {
                "action": {"type": "string", "enum": actions},
                "run_id": {"type": "string", "description": "the run (not needed for list)"}
            },
            "required": ["action"],
            "additionalProperties": false
        })
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RuntimeInjected
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let coordinator = coordinator(&self.coordinator)?;
        let caller = CallerContext::from_tool_context(ctx).map_err(EngineError::into_tool_error)?;
        let args: TaskToolArgs = serde_json::from_value(args).map_err(invalid)?;
        let run_id = || -> Result<RunId, ToolError> {
            let text = args
                .run_id
                .as_deref()
                .ok_or_else(|| ToolError::InvalidArguments("run_id is required".into()))?;
            text.parse::<RunId>()
                .map_err(|e| ToolError::InvalidArguments(e.to_string()))
        };
        let engine = EngineError::into_tool_error;
        let text = match args.action {
            TaskAction::List => pretty(
                &coordinator
                    .list_runs(&caller, LIST_LIMIT)
                    .await
                    .map_err(engine)?,
            )?,
            TaskAction::Get => pretty(
                &coordinator
                    .get_run(&caller, run_id()?)
                    .await
                    .map_err(engine)?,
            )?,
            TaskAction::Cancel if self.read_only => {
                return Err(ToolError::Denied(
                    "this turn answers background results and may only read runs".into(),
                ))
            }
            TaskAction::Cancel => pretty(
                &coordinator
                    .cancel_run(&caller, run_id()?)
                    .await
                    .map_err(engine)?,
            )?,
            TaskAction::GetResult => {
                let r = coordinator
                    .get_result(&caller, run_id()?)
                    .await
                    .map_err(engine)?;
                match (r.result, r.error) {
                    (Some(result), _) => result,
                    (None, Some(error)) => format!("run {} {}: {error}", r.run_id, r.status),
                    (None, None) => format!("run {} is {}; no result yet", r.run_id, r.status),
                }
            }
        };
        Ok(ToolOutput::bounded(text, MAX_TOOL_OUTPUT_BYTES))
    }
}
