//! keel as an MCP server: `/mcp` on `keel serve` speaks MCP's Streamable
//! HTTP (rmcp's server side) behind the same token and origin checks as
//! `/api`. docs/MCP.md is the client's guide.
//!
//! Each agent of the catalog in force is a tool `ask_AGENT` (`ask_root`
//! for the root agent) whose input is `{task, dialog?}`. A call is a user
//! turn of a keel dialog: a new dialog with that agent (channel `mcp`, the
//! chat named after the client), or the dialog `dialog` names, which must
//! run that agent. The task is committed as the turn's user message before
//! the agent starts (the turn runner's send, as for `/api`); the turn's
//! answer, once committed, is the tool result, with the dialog and turn ids
//! in its structured content; a turn that paused for a person's approval
//! says which calls wait (the work goes on in the dialog once decided). A
//! turn that fails or is stopped is an `isError` result whose text is the
//! safe message clients of `/api` read (internal detail only in the log,
//! under an error id). A call whose
//! client sent a progress token reports progress: the turn starting, each
//! tool call starting and ending, each sub-agent run's status, and each
//! model call beginning to write. A cancellation (`notifications/cancelled`,
//! or the session ending) stops the turn as `/stop` does.
//! The tool list is read from the catalog on every `tools/list`, so it
//! follows reloads; after a reload every open session is sent
//! `notifications/tools/list_changed` (on its standalone SSE stream, when
//! the client opened one).

use std::sync::Arc;

use keel_core::{AgentId, SessionId};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ProgressToken,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{NotificationContext, Peer, RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{json, Map, Value};

use super::{chat_id, Conversation, Conversations, Fed, Scope};
use crate::serve::frames::ServerFrame;
use crate::serve::problem::{ApiError, ApiResult};
use crate::serve::routes::checked_text;
use crate::serve::Shared;

/// Channel of the dialogs MCP clients start; the chat is the client's name.
pub const CHANNEL: &str = "mcp";
/// Chat of dialogs whose client gave no usable name.
pub const DEFAULT_CHAT: &str = "default";
/// Prefix of every tool name.
pub const TOOL_PREFIX: &str = "ask_";

/// The `/mcp` service: one [`KeelMcp`] per MCP session, sessions kept in
/// memory, ended when the server closes. Host and Origin are checked by
/// keel's own middleware in front of it, so rmcp's checks are off.
pub(crate) fn service(shared: Arc<Shared>) -> StreamableHttpService<KeelMcp, LocalSessionManager> {
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .disable_allowed_origins()
        .with_max_request_body_bytes(shared.limits.max_body_bytes)
        .with_cancellation_token(shared.closing.clone());
    StreamableHttpService::new(
        move || {
            Ok(KeelMcp {
                shared: shared.clone(),
            })
        },
        Arc::new(LocalSessionManager::default()),
        config,
    )
}

/// keel's MCP server handler (one per session).
#[derive(Clone)]
pub(crate) struct KeelMcp {
    shared: Arc<Shared>,
}

/// The open MCP sessions, told when the tool list changed.
#[derive(Default)]
pub(crate) struct Sessions {
    peers: parking_lot::Mutex<Vec<Peer<RoleServer>>>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("open", &self.peers.lock().len())
            .finish()
    }
}

impl Sessions {
    /// Sends `notifications/tools/list_changed` to every open session (in
    /// the background; sessions closed since are forgotten).
    pub(crate) fn tools_changed(&self) {
        let peers: Vec<Peer<RoleServer>> = {
            let mut peers = self.peers.lock();
            peers.retain(|p| !p.is_transport_closed());
            peers.clone()
        };
        if peers.is_empty() {
            return;
        }
        tokio::spawn(async move {
            for peer in peers {
                if let Err(e) = peer.notify_tool_list_changed().await {
                    tracing::debug!(error = %e, "cannot tell an MCP session its tool list changed");
                }
            }
        });
    }

    fn add(&self, peer: Peer<RoleServer>) {
        let mut peers = self.peers.lock();
        peers.retain(|p| !p.is_transport_closed());
        peers.push(peer);
    }
}

/// The tool name of `agent`.
pub fn tool_name(agent: &AgentId) -> String {
    format!("{TOOL_PREFIX}{agent}")
}

/// The input schema of every `ask_AGENT` tool.
fn input_schema() -> Arc<Map<String, Value>> {
    let Value::Object(map) = json!({
        "type": "object",
        "properties": {
            "task": {
                "type": "string",
                "description": "What the agent should do: the user message of its turn.",
            },
            "dialog": {
                "type": "string",
                "description": "A keel dialog id (a UUID, from an earlier result) to continue; \
                                without it a new dialog is started.",
            },
        },
        "required": ["task"],
        "additionalProperties": false,
    }) else {
        unreachable!("a JSON object literal")
    };
    Arc::new(map)
}

/// What a call asks, checked.
#[derive(Debug)]
struct Ask {
    task: String,
    dialog: Option<SessionId>,
}

impl Ask {
    /// Reads and checks a call's arguments.
    fn read(arguments: Option<&Map<String, Value>>) -> ApiResult<Self> {
        let empty = Map::new();
        let arguments = arguments.unwrap_or(&empty);
        if let Some(extra) = arguments.keys().find(|k| *k != "task" && *k != "dialog") {
            return Err(ApiError::BadRequest(format!(
                "unknown argument {extra:?}: the arguments are `task` and, optionally, `dialog`"
            )));
        }
        let task = match arguments.get("task") {
            Some(Value::String(task)) if !task.trim().is_empty() => checked_text(task.clone())?,
            _ => {
                return Err(ApiError::BadRequest(
                    "`task` must be a string with text: what the agent should do".to_owned(),
                ))
            }
        };
        let dialog = match arguments.get("dialog") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) => Some(id.trim().parse().map_err(|_| {
                ApiError::BadRequest(format!("`dialog` {id:?} is not a dialog id (a UUID)"))
            })?),
            Some(_) => {
                return Err(ApiError::BadRequest(
                    "`dialog` must be a dialog id (a UUID string)".to_owned(),
                ))
            }
        };
        Ok(Self { task, dialog })
    }
}

/// Progress notifications of one call, when its client asked for them.
struct Progress {
    peer: Peer<RoleServer>,
    token: Option<ProgressToken>,
    count: u32,
}

impl Progress {
    /// Reports `message` as the next step, if the client sent a progress token.
    async fn report(&mut self, message: String) {
        let Some(token) = &self.token else {
            return;
        };
        self.count += 1;
        let param = ProgressNotificationParam::new(token.clone(), f64::from(self.count))
            .with_message(message);
        if let Err(e) = self.peer.notify_progress(param).await {
            tracing::debug!(error = %e, "cannot send an MCP progress notification");
        }
    }
}

/// The answer of a committed turn.
struct Answer {
    dialog: SessionId,
    turn: uuid::Uuid,
    text: String,
    /// Tools of calls the turn left waiting for a person's approval.
    waiting: Vec<String>,
}

/// What a cancelled call answers (its client no longer reads it).
fn cancelled() -> ApiError {
    ApiError::Conflict("the call was cancelled; nothing of its answer was saved".to_owned())
}

/// An `isError` result saying `message`.
fn error_result(message: impl Into<String>) -> CallToolResponse {
    CallToolResult::error(vec![ContentBlock::text(message)]).into()
}

impl KeelMcp {
    /// The agent `name` asks, if it is a tool of the catalog in force.
    fn agent_of(&self, name: &str) -> ApiResult<Option<AgentId>> {
        let known = self.shared.app.manager.agent_ids()?;
        Ok(name
            .strip_prefix(TOOL_PREFIX)
            .and_then(|id| AgentId::parse(id).ok())
            .filter(|id| known.contains(id)))
    }

    /// The description of `agent`'s tool: its definition's.
    fn description(&self, agent: &AgentId) -> String {
        if *agent == AgentId::root() {
            return "keel's root agent: the default agent of a dialog, which may use keel's tools \
                    and delegate to the other agents."
                .to_owned();
        }
        self.shared
            .app
            .catalog
            .as_ref()
            .and_then(|(handle, _)| handle.current().get(agent).map(|d| d.description.clone()))
            .unwrap_or_default()
    }

    /// The chat new dialogs of this session go to: the client's name when
    /// it is a usable chat id.
    fn chat(context: &RequestContext<RoleServer>) -> String {
        context
            .peer
            .peer_info()
            .and_then(|info| chat_id("the client name", &info.client_info.name).ok())
            .unwrap_or_else(|| DEFAULT_CHAT.to_owned())
    }

    /// Runs `ask` as a turn of `agent` and waits for its answer (see the module docs).
    async fn ask(
        &self,
        agent: AgentId,
        ask: Ask,
        context: &RequestContext<RoleServer>,
    ) -> ApiResult<Answer> {
        let shared = &self.shared;
        if shared.turns.is_draining() {
            return Err(ApiError::Unavailable(
                "the server is shutting down; no new turns are started".to_owned(),
            ));
        }
        let agent = (agent != AgentId::root()).then_some(agent);
        let dialog = match ask.dialog {
            Some(dialog) => dialog,
            None => {
                shared
                    .app
                    .manager
                    .create_dialog(CHANNEL, &Self::chat(context), None, agent.clone())
                    .await?
            }
        };
        let conversation = Conversation {
            scope: Scope::Dialog(dialog),
            agent,
            history: Vec::new(),
            input: ask.task,
        };
        let mut progress = Progress {
            peer: context.peer.clone(),
            token: context.meta.get_progress_token(),
            count: 0,
        };
        if shared.conversations.busy(dialog) {
            progress
                .report(format!(
                    "waiting for dialog {dialog}: another call's turn runs there"
                ))
                .await;
        }
        // Cancelled while it waits for the dialog: nothing is written.
        let placed = tokio::select! {
            biased;
            () = context.ct.cancelled() => return Err(cancelled()),
            placed = shared.conversations.place(shared, &conversation) => placed?,
        };
        // Sub-agent changes of the dialog are published from now on.
        shared.projections.watch(dialog).await?;
        let mut feed =
            Conversations::start_turn(shared, placed, keel_core::Message::user(conversation.input))
                .await?
                .with_runs(shared.projections.clone());
        let turn = feed.turn;
        let mut text = String::new();
        let mut writing = false;
        loop {
            let fed = tokio::select! {
                fed = feed.next() => fed,
                () = context.ct.cancelled() => {
                    // The client will not read an answer: stop the work.
                    self.stop(dialog, turn).await;
                    return Err(cancelled());
                }
            };
            let frame = match fed {
                Some(Fed::Frame(frame)) => frame,
                Some(Fed::Lost) => {
                    return Err(ApiError::Unavailable(format!(
                        "the answer could not be relayed whole; it is saved in dialog {dialog}"
                    )))
                }
                None => {
                    return Err(ApiError::Unavailable(
                        "the server closed before the turn ended".to_owned(),
                    ))
                }
            };
            match frame.as_ref() {
                ServerFrame::TurnStarted { .. } => {
                    progress
                        .report(format!("turn {turn} started in dialog {dialog}"))
                        .await;
                }
                ServerFrame::TextDelta { text: t, .. } => {
                    text.push_str(t);
                    if !writing {
                        writing = true;
                        progress.report("writing".to_owned()).await;
                    }
                }
                ServerFrame::ModelCallFinished { .. } => writing = false,
                ServerFrame::ToolStarted { name, .. } => {
                    progress.report(format!("calling tool {name}")).await;
                }
                ServerFrame::ToolFinished { name, is_error, .. } => {
                    let how = if *is_error { "failed" } else { "finished" };
                    progress.report(format!("tool {name} {how}")).await;
                }
                ServerFrame::AgentRunUpdated { run, .. } => {
                    let status = serde_json::to_value(run.status)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default();
                    progress
                        .report(format!("sub-agent {} run {}: {status}", run.agent, run.id))
                        .await;
                }
                ServerFrame::TurnCommitted { .. } => {
                    // A turn that paused for approvals ended committed.
                    let waiting = shared
                        .app
                        .manager
                        .approvals(dialog, true)
                        .await?
                        .into_iter()
                        .filter(|a| a.turn_id.as_uuid() == turn)
                        .map(|a| a.tool_name)
                        .collect();
                    return Ok(Answer {
                        dialog,
                        turn,
                        text,
                        waiting,
                    });
                }
                ServerFrame::TurnFailed { message, .. } => {
                    return Err(ApiError::Conflict(message.clone()));
                }
                _ => {}
            }
        }
    }

    /// Stops `turn` of `dialog` as `/stop` does when it is the dialog's
    /// running turn; a turn still queued is cancelled before it starts and
    /// its input taken off the queue (else the next start of keel runs it).
    async fn stop(&self, dialog: SessionId, turn: uuid::Uuid) {
        let manager = &self.shared.app.manager;
        let running = manager.running_turn(dialog).map(|t| t.as_uuid());
        if running == Some(turn) {
            if let Err(e) = manager.stop(dialog).await {
                tracing::warn!(session_id = %dialog, error = %e, "cannot stop a cancelled MCP call's turn");
            }
            return;
        }
        self.shared.turns.cancel(turn);
        if let Err(e) = manager.store().discard_queued_input(turn.into()).await {
            tracing::warn!(session_id = %dialog, error = %e, "cannot withdraw a cancelled MCP call's queued task");
        }
    }
}

impl ServerHandler for KeelMcp {
    fn get_info(&self) -> ServerConfig {
        let capabilities = ServerCapabilities::builder()
            .enable_tools()
            .enable_tool_list_changed()
            .build();
        ServerConfig::new(capabilities)
            .with_server_info(Implementation::new("keel", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Each tool ask_AGENT hands a task to a keel agent and returns its answer. Pass \
                 the dialog id of a result as `dialog` to continue that conversation.",
            )
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        self.shared.mcp_sessions.add(context.peer);
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let agents = self
            .shared
            .app
            .manager
            .agent_ids()
            .map_err(|e| ErrorData::internal_error(ApiError::from(e).to_string(), None))?;
        let schema = input_schema();
        let tools = agents
            .iter()
            .map(|agent| Tool::new(tool_name(agent), self.description(agent), schema.clone()))
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let agent = match self.agent_of(&request.name) {
            Ok(Some(agent)) => agent,
            Ok(None) => {
                return Err(ErrorData::invalid_params(
                    format!(
                    "unknown tool {:?}: keel's tools are ask_AGENT for the agents tools/list names",
                    request.name
                ),
                    None,
                ))
            }
            Err(e) => return Ok(error_result(e.to_string())),
        };
        let ask = match Ask::read(request.arguments.as_ref()) {
            Ok(ask) => ask,
            Err(e) => return Ok(error_result(e.to_string())),
        };
        match self.ask(agent, ask, &context).await {
            Ok(answer) => {
                let note = format!(
                    "keel dialog {} (pass it as `dialog` to continue this conversation)",
                    answer.dialog
                );
                let mut content = vec![
                    ContentBlock::text(answer.text.clone()),
                    ContentBlock::text(note),
                ];
                if !answer.waiting.is_empty() {
                    content.push(ContentBlock::text(format!(
                        "{} tool call(s) of this turn ({}) wait for a person's approval in keel \
                         dialog {}; once decided (keel's web page, or POST /api/approvals/ID), \
                         the agent goes on in that dialog, not in this call",
                        answer.waiting.len(),
                        answer.waiting.join(", "),
                        answer.dialog
                    )));
                }
                let mut result = CallToolResult::success(content);
                result.structured_content = Some(json!({
                    "answer": answer.text,
                    "dialog": answer.dialog.to_string(),
                    "turn": answer.turn.to_string(),
                    "waiting_for_approval": answer.waiting,
                }));
                Ok(result.into())
            }
            Err(e) => Ok(error_result(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(v: Value) -> Result<Ask, String> {
        Ask::read(v.as_object()).map_err(|e| e.to_string())
    }

    #[test]
    fn arguments_are_a_task_and_an_optional_dialog() {
        let ask = read(json!({"task": "sum it"})).unwrap();
        assert_eq!((ask.task.as_str(), ask.dialog), ("sum it", None));
        let id = SessionId::new();
        let ask = read(json!({"task": "more", "dialog": id.to_string()})).unwrap();
        assert_eq!(ask.dialog, Some(id));
        insta::assert_snapshot!([
            read(json!({})).unwrap_err(),
            read(json!({"task": "  "})).unwrap_err(),
            read(json!({"task": 3})).unwrap_err(),
            read(json!({"task": "x", "dialog": "nope"})).unwrap_err(),
            read(json!({"task": "x", "dialog": 7})).unwrap_err(),
            read(json!({"task": "x", "agent": "y"})).unwrap_err(),
        ]
        .join("\n"));
    }

    #[test]
    fn every_agent_id_makes_a_valid_unique_mcp_tool_name() {
        // MCP tool names: 1..=128 of A-Z a-z 0-9 _ - .
        let longest = AgentId::parse(&format!("a{}", "z-_9".repeat(15))).unwrap();
        for agent in [AgentId::root(), AgentId::parse("a").unwrap(), longest] {
            let name = tool_name(&agent);
            assert!(name.len() <= 128, "{name}");
            assert!(name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')));
            assert_eq!(name.strip_prefix(TOOL_PREFIX), Some(agent.as_str()));
        }
    }
}
