//! What callers see of runs: [`AgentRunView`], [`RunResult`], the delegate
//! request/response types, and the bounded projection of a delegate result
//! that goes back to the model.

use keel_core::{AgentId, CompletionPolicy, ExecutionMode, GroupId, RunId, RunStatus, Usage};
use keel_store::RunRecord;
use serde::Serialize;

use crate::fence::{fence, FENCE_NOTE};

/// Longest task text shown in a run view, in bytes.
pub(crate) const TASK_PREVIEW_BYTES: usize = 200;

/// One task of a delegate request.
#[derive(Debug, Clone, PartialEq)]
pub struct DelegateTask {
    /// The agent to run.
    pub agent: AgentId,
    /// What it should do.
    pub task: String,
    /// Extra context handed to it (shown after the task).
    pub context: Option<serde_json::Value>,
}

/// A delegation: one or more tasks, awaited or not.
#[derive(Debug, Clone, PartialEq)]
pub struct DelegateRequest {
    /// Whether the caller waits.
    pub mode: ExecutionMode,
    /// The tasks, in the order results come back.
    pub tasks: Vec<DelegateTask>,
    /// One completion for the batch (`All`) or one per run (`Each`); background only.
    pub completion_policy: CompletionPolicy,
    /// Makes a retried request return the earlier run or group.
    pub idempotency_key: Option<String>,
}

/// How one foreground run ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForegroundResult {
    /// The run.
    pub run_id: RunId,
    /// Its agent.
    pub agent_id: AgentId,
    /// Its status (terminal unless an earlier identical request still runs it).
    pub status: RunStatus,
    /// The full result of a completed run.
    pub result: Option<String>,
    /// The error of any other outcome.
    pub error: Option<String>,
}

impl ForegroundResult {
    pub(crate) fn from_record(r: &RunRecord) -> Self {
        Self {
            run_id: r.spec.id,
            agent_id: r.spec.agent_id.clone(),
            status: r.status,
            result: r.result.clone(),
            error: r.error.clone(),
        }
    }
}

/// What a delegation returned.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum DelegateResponse {
    /// The caller waited: one result per task, in request order.
    Foreground {
        /// The batch's group (batches of more than one task).
        group_id: Option<GroupId>,
        /// Results in request order.
        results: Vec<ForegroundResult>,
        /// True when an earlier request with the same key was returned.
        existing: bool,
    },
    /// Accepted in the background; completions arrive in the root inbox.
    Background {
        /// The batch's group (batches of more than one task).
        group_id: Option<GroupId>,
        /// The runs, in request order.
        run_ids: Vec<RunId>,
        /// True when an earlier request with the same key was returned.
        existing: bool,
    },
}

/// A run as the `agent_task` tool and the coordinator's queries show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgentRunView {
    /// The run.
    pub run_id: RunId,
    /// Its batch group, if any.
    pub group_id: Option<GroupId>,
    /// The delegating run (`None` for a child of the root).
    pub parent_run_id: Option<RunId>,
    /// The agent.
    pub agent_id: AgentId,
    /// Foreground or background.
    pub mode: ExecutionMode,
    /// Status.
    pub status: RunStatus,
    /// Depth in the tree.
    pub depth: u32,
    /// The task, cut to its first 200 bytes.
    pub task: String,
    /// Error of a run that did not complete.
    pub error: Option<String>,
    /// Bytes of the full result (read it with `get_result`).
    pub result_bytes: Option<usize>,
    /// Tokens used, once known.
    pub usage: Option<Usage>,
    /// Tool calls made.
    pub tool_calls: u32,
    /// Model calls made.
    pub iterations: u32,
    /// Creation time (Unix ms).
    pub created_at_ms: i64,
    /// Start time (Unix ms).
    pub started_at_ms: Option<i64>,
    /// End time (Unix ms).
    pub finished_at_ms: Option<i64>,
    /// Deadline (Unix ms).
    pub deadline_at_ms: i64,
}

impl From<&RunRecord> for AgentRunView {
    fn from(r: &RunRecord) -> Self {
        Self {
            run_id: r.spec.id,
            group_id: r.group_id,
            parent_run_id: r.spec.parent_run_id,
            agent_id: r.spec.agent_id.clone(),
            mode: r.spec.mode,
            status: r.status,
            depth: r.spec.depth,
            task: keel_core::truncate_with_note(r.spec.task.clone(), TASK_PREVIEW_BYTES),
            error: r.error.clone(),
            result_bytes: r.result.as_ref().map(String::len),
            usage: r.usage,
            tool_calls: r.tool_calls_count,
            iterations: r.iterations,
            created_at_ms: r.created_at_ms,
            started_at_ms: r.started_at_ms,
            finished_at_ms: r.finished_at_ms,
            deadline_at_ms: r.spec.deadline_at_ms,
        }
    }
}

/// The full outcome of a run (`agent_task get_result`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunResult {
    /// The run.
    pub run_id: RunId,
    /// Its status.
    pub status: RunStatus,
    /// The full result of a completed run.
    pub result: Option<String>,
    /// The error of any other terminal outcome.
    pub error: Option<String>,
}

/// The text a delegate tool call returns: per run its id, agent and status,
/// at most `preview_bytes` of its result fenced as data, and where to read the rest.
pub fn project_response(response: &DelegateResponse, preview_bytes: usize) -> String {
    match response {
        DelegateResponse::Foreground {
            group_id,
            results,
            existing,
        } => {
            let mut out = String::new();
            if *existing {
                out.push_str("(an earlier request with this idempotency key is returned)\n");
            }
            if let Some(g) = group_id {
                out.push_str(&format!("group {g}: {} runs\n", results.len()));
            }
            for (i, r) in results.iter().enumerate() {
                out.push_str(&format!(
                    "[{}] run {} ({}) {}",
                    i + 1,
                    r.run_id,
                    r.agent_id,
                    r.status
                ));
                let label = format!("run {} agent {}", r.run_id, r.agent_id);
                match (&r.result, &r.error) {
                    (Some(text), _) => {
                        out.push_str(":\n");
                        out.push_str(&fence(
                            &label,
                            &keel_core::truncate_with_note(text.clone(), preview_bytes),
                        ));
                        if text.len() > preview_bytes {
                            out.push_str(&format!(
                                "\n(full result: agent_task {{\"action\": \"get_result\", \"run_id\": \"{}\"}})",
                                r.run_id
                            ));
                        }
                    }
                    (None, Some(err)) => {
                        out.push_str(":\n");
                        out.push_str(&fence(
                            &label,
                            &keel_core::truncate_with_note(err.clone(), preview_bytes),
                        ));
                    }
                    (None, None) if !r.status.is_terminal() => {
                        out.push_str(" (still running; check it with agent_task get)");
                    }
                    (None, None) => {}
                }
                out.push('\n');
            }
            if results
                .iter()
                .any(|r| r.result.is_some() || r.error.is_some())
            {
                out.push_str(FENCE_NOTE);
                out.push('\n');
            }
            out
        }
        DelegateResponse::Background {
            group_id,
            run_ids,
            existing,
        } => {
            let mut out = String::from(if *existing {
                "already accepted earlier (same idempotency key) in the background:"
            } else {
                "accepted in the background:"
            });
            if let Some(g) = group_id {
                out.push_str(&format!(" group {g},"));
            }
            let ids: Vec<String> = run_ids.iter().map(ToString::to_string).collect();
            out.push_str(&format!(
                " runs {}. Their results arrive in a later turn; check progress with agent_task.",
                ids.join(", ")
            ));
            out
        }
    }
}
