//! Which tool calls need a person's approval, and how a turn asks.
//!
//! An agent's [`ApprovalPolicy`] comes from its definition (`approval:`)
//! and keel.toml (`[tools.approval]`, `[tools] approval_default`); the
//! gateway builds it into the [`crate::AgentProfile`]. A root turn that is
//! not a continuation carries an [`ApprovalGate`] in its extensions: when
//! the model calls a gated tool the agent loop runs the other calls of the
//! batch and ends the turn "waiting for approval" (see
//! [`crate::TurnOutput::awaiting_approval`]); the session manager commits the
//! pause and resumes the turn once a person decided. A background run's gate
//! pauses too: the coordinator commits the run as `waiting_approval` and
//! resumes it after the decision. A foreground run's caller waits on it, so
//! its gate refuses a gated call with [`SUB_AGENT_REFUSAL`].

use std::collections::BTreeSet;

/// Which tools of an agent need a person's approval before they run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApprovalPolicy {
    all: bool,
    tools: BTreeSet<String>,
}

impl ApprovalPolicy {
    /// Every tool runs unasked.
    pub fn none() -> Self {
        Self::default()
    }

    /// Every tool call needs approval.
    pub fn all() -> Self {
        Self {
            all: true,
            tools: BTreeSet::new(),
        }
    }

    /// These tools need approval.
    pub fn tools<I, S>(tools: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            all: false,
            tools: tools.into_iter().map(Into::into).collect(),
        }
    }

    /// What either policy gates.
    pub fn union(mut self, other: &ApprovalPolicy) -> Self {
        self.all |= other.all;
        self.tools.extend(other.tools.iter().cloned());
        self
    }

    /// Whether a call of `tool` needs approval.
    pub fn needs(&self, tool: &str) -> bool {
        self.all || self.tools.contains(tool)
    }

    /// Whether no tool needs approval.
    pub fn is_empty(&self) -> bool {
        !self.all && self.tools.is_empty()
    }
}

/// What a turn does with a gated call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GateMode {
    /// A root turn or a background run: pause, durably, until a person
    /// decides.
    Pause,
    /// A foreground sub-agent run: do not run it, and say why.
    Refuse,
}

/// The approval gate of one turn or run, in its extensions.
#[derive(Debug, Clone)]
pub(crate) struct ApprovalGate {
    pub(crate) policy: ApprovalPolicy,
    /// Tools the dialog approved for good ("approve always").
    pub(crate) granted: BTreeSet<String>,
    pub(crate) mode: GateMode,
}

impl ApprovalGate {
    /// Whether a call of `tool` must wait for (or, in a run, be refused for
    /// want of) a person's approval.
    pub(crate) fn gates(&self, tool: &str) -> bool {
        self.policy.needs(tool) && !self.granted.contains(tool)
    }
}

/// What a foreground sub-agent reads for a gated call it made: it was not
/// run (its caller waits on it, so it cannot wait for a person).
pub(crate) const SUB_AGENT_REFUSAL: &str = "error: this tool needs a person's approval, which \
     a foreground sub-agent run cannot wait for (a background run can); it was not run";

/// What the model reads for an approved call whose run a crash interrupted.
pub(crate) const OUTCOME_UNKNOWN: &str = "error: keel stopped while this approved tool call ran; \
     its outcome is unknown and it was not run again";

/// The reason a pending approval gets when the user sends new input,
/// unless `tools.approval_supersede_reason` says another.
pub const SUPERSEDED_REASON: &str = "superseded by new input";

/// What the model reads as the result of a call that was not approved.
pub(crate) fn denial_text(status: &str, reason: Option<&str>) -> String {
    let why = match status {
        "expired" => "nobody decided in time".to_owned(),
        "superseded" => reason
            .filter(|r| !r.trim().is_empty())
            .unwrap_or(SUPERSEDED_REASON)
            .to_owned(),
        _ => reason
            .filter(|r| !r.trim().is_empty())
            .map_or_else(|| "no reason given".to_owned(), str::to_owned),
    };
    format!("denied: the user did not approve this call, so it was not run (reason: {why})")
}

/// The tool result a decided approval gives its model: the approved
/// call's output when this execution `started` it, that its outcome is
/// unknown when a crash interrupted an earlier start, else the denial —
/// marked failed unless the call ran and succeeded.
pub(crate) async fn decided_result(
    agent_loop: &crate::AgentLoop,
    tools: &keel_core::ToolRegistry,
    ctx: &keel_core::ToolExecutionContext,
    a: &keel_store::ApprovalRecord,
    started: bool,
) -> keel_core::Message {
    let (content, failed) = match a.status {
        keel_store::ApprovalStatus::Approved if started => {
            // Stored from a JSON value, so it parses.
            let call = keel_core::ToolCall {
                id: a.tool_call_id.clone(),
                name: a.tool_name.clone(),
                arguments: serde_json::from_str(&a.arguments).unwrap_or(serde_json::Value::Null),
            };
            let output = agent_loop.execute_tool(tools, &call, ctx).await;
            (output.content, output.is_error)
        }
        keel_store::ApprovalStatus::Approved => (OUTCOME_UNKNOWN.to_owned(), true),
        other => (denial_text(other.as_str(), a.reason.as_deref()), true),
    };
    keel_core::Message::tool_result(a.tool_call_id.clone(), a.tool_name.clone(), content)
        .failed(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_lifts_the_gate_for_its_tool_only() {
        let gate = ApprovalGate {
            policy: ApprovalPolicy::tools(["shell", "write_file"]),
            granted: ["shell".to_owned()].into(),
            mode: GateMode::Pause,
        };
        assert!(!gate.gates("shell"));
        assert!(gate.gates("write_file"));
        assert!(!gate.gates("read_file"));
        assert!(ApprovalPolicy::all().needs("read_file"));
        assert!(ApprovalPolicy::none()
            .union(&ApprovalPolicy::all())
            .needs("x"));
    }
}
