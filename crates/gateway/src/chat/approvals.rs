//! Approvals in `keel chat`: `/approvals`, `/approve ID`, `/deny ID
//! [reason]`, and the inline `y` / `n` / `a` answer to the last call asked.

use keel_core::ApprovalId;
use keel_store::Decision;

use super::{one_line, short, Chat, Slash};
use crate::error::Result;

/// A line answering the approval asked inline: `y`/`yes`, `n`/`no`, `a`/`always`.
pub(super) fn inline_answer(line: &str) -> Option<Decision> {
    match line.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" => Some(Decision::Approve),
        "n" | "no" => Some(Decision::Deny),
        "a" | "always" => Some(Decision::ApproveAlways),
        _ => None,
    }
}

impl Chat {
    /// `/approvals`, `/approve ID` and `/deny ID [reason]`.
    pub(super) async fn approval_command(&mut self, cmd: Slash) -> Result<()> {
        match cmd {
            Slash::Approvals => {
                let pending = self.manager.approvals(self.current, true).await?;
                if pending.is_empty() {
                    self.say("no tool call waits for a decision");
                }
                for a in pending {
                    let args = one_line(&a.arguments, 80);
                    self.say(&format!(
                        "{}  {} ({})  {}({args})",
                        short(a.id),
                        a.agent_id,
                        crate::chat::short(a.turn_id),
                        a.tool_name
                    ));
                }
            }
            Slash::Approve(id) => {
                if let Some(id) = self.find_approval(&id).await? {
                    self.decide(id, Decision::Approve, None).await;
                }
            }
            Slash::Deny(id, reason) => {
                if let Some(id) = self.find_approval(&id).await? {
                    self.decide(id, Decision::Deny, reason).await;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The pending approval of this dialog whose id (or its short form) is `text`.
    async fn find_approval(&mut self, text: &str) -> Result<Option<ApprovalId>> {
        let pending = self.manager.approvals(self.current, true).await?;
        let found = pending
            .iter()
            .find(|a| a.id.to_string() == text || short(a.id) == text)
            .map(|a| a.id);
        if found.is_none() {
            self.say(&format!(
                "error: no tool call waits for a decision as {text} (/approvals lists them)"
            ));
        }
        Ok(found)
    }

    /// Commits a decision; once the paused turn has all its decisions it
    /// resumes, and its answer is printed before the next line is read.
    pub(super) async fn decide(
        &mut self,
        id: ApprovalId,
        decision: Decision,
        reason: Option<String>,
    ) {
        if let Err(e) = self
            .manager
            .decide_approval(id, Some(self.current), decision, reason)
            .await
        {
            self.say(&format!("error: {e}"));
            return;
        }
        if self.asking == Some(id) {
            self.asking = None;
        }
        let waiting = match self.manager.approvals(self.current, true).await {
            Ok(pending) => !pending.is_empty(),
            Err(_) => true,
        };
        if waiting {
            return;
        }
        // The resumed turn ends with a commit or a failure on the feed.
        loop {
            let event = self.feed.recv().await;
            let closed = matches!(event, Err(keel_engine::SubscriptionError::Closed));
            if self.show(event).is_some() || closed {
                break;
            }
        }
    }
}
