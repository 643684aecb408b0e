//! `get_skill`: the runtime-injected tool that reads one skill the calling
//! agent may use, and [`grant_skills`], which gives an agent that tool
//! (scoped to its allowlist) and lists the skills in its system prompt.

use std::sync::Arc;

use async_trait::async_trait;
use keel_catalog::SkillSet;
use keel_core::{
    DelegationPolicy, Tool, ToolError, ToolExecutionContext, ToolOutput, ToolRegistry,
};
use serde::Deserialize;

use super::{parse_args, MAX_TOOL_OUTPUT_BYTES};
use crate::error::Result;

/// Name of the skill tool.
pub(crate) const GET_SKILL_TOOL: &str = "get_skill";

/// Reads a skill of an allowlist.
struct GetSkillTool {
    skills: SkillSet,
    allowed: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    name: String,
}

#[async_trait]
impl Tool for GetSkillTool {
    fn name(&self) -> &str {
        GET_SKILL_TOOL
    }

    fn description(&self) -> &str {
        "Load the full instructions of one of your skills (listed in your system prompt) \
         before doing the work it covers."
    }

    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "object",
            "properties": {
                "name": {
                    "type": "string",
                    "enum": self.allowed,
                    "description": "The skill's name.",
                },
            },
            "required": ["name"],
            "additionalProperties": false,
        })
    }

    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RuntimeInjected
    }

    async fn execute(
        &self,
        args: serde_json::Value,
        _ctx: &ToolExecutionContext,
    ) -> std::result::Result<ToolOutput, ToolError> {
        let Args { name } = parse_args(args)?;
        let skill = self
            .allowed
            .contains(&name)
            .then(|| self.skills.get(&name))
            .flatten()
            .ok_or_else(|| {
                let shown: String = name.chars().take(64).collect();
                ToolError::Denied(format!(
                    "no skill {shown:?} is available to you; your skills: {}",
                    self.allowed.join(", ")
                ))
            })?;
        Ok(ToolOutput::bounded(
            skill.body.clone(),
            MAX_TOOL_OUTPUT_BYTES,
        ))
    }
}

/// Gives an agent the skills of `allowed` (every entry must be in `skills`;
/// unknown ones are skipped): registers `get_skill` scoped to them and
/// appends their names and descriptions to `system_prompt`. With no skill
/// allowed, nothing changes.
pub fn grant_skills(
    skills: &SkillSet,
    allowed: &[String],
    tools: &mut ToolRegistry,
    system_prompt: &mut String,
) -> Result<()> {
    let allowed: Vec<String> = allowed
        .iter()
        .filter(|name| skills.contains(name))
        .cloned()
        .collect();
    if allowed.is_empty() {
        return Ok(());
    }
    system_prompt
        .push_str("\n\nSkills you can load with the get_skill tool when a task calls for them:");
    for name in &allowed {
        if let Some(skill) = skills.get(name) {
            system_prompt.push_str(&format!("\n- {name}: {}", skill.description));
        }
    }
    tools.register(Arc::new(GetSkillTool {
        skills: skills.clone(),
        allowed,
    }))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> SkillSet {
        SkillSet::from_texts([
            (
                "git.md",
                "---\nname: git\ndescription: Git workflows.\n---\nRebase, never merge.\n",
            ),
            (
                "rust.md",
                "---\nname: rust\ndescription: Rust style.\n---\nNo unwrap.\n",
            ),
        ])
        .unwrap()
    }

    #[tokio::test]
    async fn the_tool_serves_only_the_allowlist() {
        let mut tools = ToolRegistry::new();
        let mut prompt = "You are a coder.".to_owned();
        grant_skills(
            &set(),
            &["git".into(), "ghost".into()],
            &mut tools,
            &mut prompt,
        )
        .unwrap();
        assert_eq!(
            prompt,
            "You are a coder.\n\nSkills you can load with the get_skill tool when a task calls for them:\n- git: Git workflows."
        );
        assert_eq!(
            tools.policy(GET_SKILL_TOOL),
            Some(DelegationPolicy::RuntimeInjected)
        );
        let tool = tools.get(GET_SKILL_TOOL).unwrap();
        let ctx = ToolExecutionContext::default();
        let out = tool
            .execute(serde_json::json!({"name": "git"}), &ctx)
            .await
            .unwrap();
        assert_eq!(out.content, "Rebase, never merge.");
        let err = tool
            .execute(serde_json::json!({"name": "rust"}), &ctx)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "denied: no skill \"rust\" is available to you; your skills: git"
        );
        assert!(tool
            .execute(serde_json::json!({"skill": "git"}), &ctx)
            .await
            .is_err());
    }

    #[test]
    fn no_allowed_skill_changes_nothing() {
        let mut tools = ToolRegistry::new();
        let mut prompt = "p".to_owned();
        grant_skills(&set(), &[], &mut tools, &mut prompt).unwrap();
        grant_skills(&SkillSet::empty(), &["git".into()], &mut tools, &mut prompt).unwrap();
        assert_eq!(prompt, "p");
        assert!(tools.get(GET_SKILL_TOOL).is_none());
    }
}
