//! How big a request is, and how big it may be.
//!
//! Tokens are estimated, not counted: 4 bytes of text per token plus 4 per
//! message ([`Message::estimated_tokens`]), and the same for each tool's
//! name, description and JSON schema. The estimate errs high for English
//! and code and needs no tokenizer per model; a provider that still refuses
//! a request as too long triggers one compaction and one retry.

use std::sync::Arc;

use keel_core::{ChatRequest, Message, ToolDefinition};

use crate::session::AgentProfile;

/// The context window assumed for an agent whose profile names none.
pub const DEFAULT_CONTEXT_WINDOW_TOKENS: usize = 32_000;

/// Estimated tokens of `request`: its messages and its tool definitions.
pub fn estimate_request_tokens(request: &ChatRequest) -> usize {
    messages_tokens(&request.messages) + tools_tokens(&request.tools)
}

/// Estimated tokens of `messages`.
pub(crate) fn messages_tokens(messages: &[Arc<Message>]) -> usize {
    messages.iter().map(|m| m.estimated_tokens()).sum()
}

/// Estimated tokens of tool definitions sent with a request.
pub(crate) fn tools_tokens(tools: &[ToolDefinition]) -> usize {
    tools
        .iter()
        .map(|t| {
            (t.name.len() + t.description.len() + t.parameters.to_string().len()).div_ceil(4) + 4
        })
        .sum()
}

/// The most tokens a request of `agent` may carry: its context window less
/// the room its answer needs (at least half the window stays for input).
pub(crate) fn input_budget(agent: &AgentProfile) -> usize {
    let window = agent.context_window_tokens.max(1);
    let answer = agent.max_output_tokens.map_or(0, |t| t as usize);
    window.saturating_sub(answer).max(window / 2)
}
