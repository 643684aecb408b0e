//! Conversation messages: roles, content parts, tool calls, and the two
//! provenance markers every stored message carries ([`ClientVisibility`] and
//! [`TurnOrigin`]).

use serde::{Deserialize, Serialize};

crate::text_enum!(
    /// Who authored a message.
    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    Role, "role" {
        /// Instructions for the model.
        System = "system",
        /// A person, or a hidden runtime trigger standing in for one.
        User = "user",
        /// The model.
        Assistant = "assistant",
        /// The result of a tool call.
        Tool = "tool",
    }
);

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// Plain text.
    Text {
        /// The text.
        text: String,
    },
    /// A reference to an image stored elsewhere (keel never inlines bytes).
    ImageRef {
        /// Where the image is (URL or opaque reference).
        uri: String,
        /// Its media type, when known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mime_type: Option<String>,
    },
}

/// A tool invocation requested by the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Provider-assigned id that the tool result refers back to.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// Arguments as JSON (an object for well-behaved models).
    pub arguments: serde_json::Value,
}

crate::text_enum!(
    /// Whether clients (HTTP, WS, terminal) see a message. Hidden messages are
    /// replayed to the model but never shown, e.g. continuation triggers.
    #[derive(Default, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    ClientVisibility, "client visibility" {
        /// Shown to clients.
        #[default]
        Visible = "visible",
        /// Replayed to the model only.
        Hidden = "hidden",
    }
);

crate::text_enum!(
    /// What started the turn a message belongs to.
    #[derive(Default, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    TurnOrigin, "turn origin" {
        /// A person sent input.
        #[default]
        User = "user",
        /// Background agent results arrived through the inbox.
        AgentContinuation = "agent_continuation",
        /// The runtime itself (summaries, titles, notices).
        System = "system",
    }
);

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Author.
    pub role: Role,
    /// Content parts, in order.
    #[serde(default)]
    pub content: Vec<ContentPart>,
    /// Tool calls requested by an assistant message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For a tool message: the tool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
    /// Whether clients see this message.
    #[serde(default)]
    pub visibility: ClientVisibility,
    /// What started the turn this message belongs to.
    #[serde(default)]
    pub origin: TurnOrigin,
    /// For a tool message: the call failed or did not run (a denial).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
}

impl Message {
    fn with_text(role: Role, text: impl Into<String>) -> Self {
        Self {
            role,
            content: vec![ContentPart::Text { text: text.into() }],
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            visibility: ClientVisibility::Visible,
            origin: TurnOrigin::User,
            is_error: false,
        }
    }

    /// A system message.
    pub fn system(text: impl Into<String>) -> Self {
        Self::with_text(Role::System, text)
    }

    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::with_text(Role::User, text)
    }

    /// An assistant message with text only.
    pub fn assistant(text: impl Into<String>) -> Self {
        Self::with_text(Role::Assistant, text)
    }

    /// An assistant message that requests tool calls (and may carry text).
    pub fn assistant_with_tools(text: impl Into<String>, tool_calls: Vec<ToolCall>) -> Self {
        let text = text.into();
        let mut m = Self::with_text(Role::Assistant, text);
        m.content
            .retain(|p| !matches!(p, ContentPart::Text { text } if text.is_empty()));
        m.tool_calls = tool_calls;
        m
    }

    /// The result of tool call `call_id` of tool `tool_name`.
    pub fn tool_result(
        call_id: impl Into<String>,
        tool_name: impl Into<String>,
        text: impl Into<String>,
    ) -> Self {
        let mut m = Self::with_text(Role::Tool, text);
        m.tool_call_id = Some(call_id.into());
        m.tool_name = Some(tool_name.into());
        m
    }

    /// Marks a tool message as a failure (`failed`) or not.
    pub fn failed(mut self, failed: bool) -> Self {
        self.is_error = failed;
        self
    }

    /// Marks the message hidden from clients.
    pub fn hidden(mut self) -> Self {
        self.visibility = ClientVisibility::Hidden;
        self
    }

    /// Sets the turn origin.
    pub fn with_origin(mut self, origin: TurnOrigin) -> Self {
        self.origin = origin;
        self
    }

    /// All text parts joined, without separators.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for part in &self.content {
            if let ContentPart::Text { text } = part {
                out.push_str(text);
            }
        }
        out
    }

    /// Whether this is user input a person typed and can see (it counts for
    /// titles and `message_count`).
    pub fn is_visible_user_input(&self) -> bool {
        self.role == Role::User && self.visibility == ClientVisibility::Visible
    }

    /// A rough token estimate (4 bytes per token) used for context budgeting.
    pub fn estimated_tokens(&self) -> usize {
        let mut bytes = self.text().len();
        for call in &self.tool_calls {
            bytes += call.name.len() + call.arguments.to_string().len();
        }
        bytes.div_ceil(4) + 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_forms_are_stable() {
        let msgs = vec![
            Message::system("be brief"),
            Message::user("hi"),
            Message::assistant_with_tools(
                "",
                vec![ToolCall {
                    id: "call_1".into(),
                    name: "read_file".into(),
                    arguments: serde_json::json!({"path": "README.md"}),
                }],
            ),
            Message::tool_result("call_1", "read_file", "# keel"),
            Message::user("[background results]")
                .hidden()
                .with_origin(TurnOrigin::AgentContinuation),
            Message {
                role: Role::User,
                content: vec![ContentPart::ImageRef {
                    uri: "file:///tmp/a.png".into(),
                    mime_type: Some("image/png".into()),
                }],
                tool_calls: vec![],
                tool_call_id: None,
                tool_name: None,
                visibility: ClientVisibility::Visible,
                origin: TurnOrigin::User,
                is_error: false,
            },
            Message::tool_result("call_2", "write_file", "denied: …").failed(true),
        ];
        insta::assert_json_snapshot!(msgs);
        let json = serde_json::to_string(&msgs).unwrap();
        let back: Vec<Message> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, msgs);
    }

    #[test]
    fn missing_provenance_defaults_to_visible_user() {
        let m: Message =
            serde_json::from_str(r#"{"role":"user","content":[{"type":"text","text":"x"}]}"#)
                .unwrap();
        assert_eq!(m.visibility, ClientVisibility::Visible);
        assert_eq!(m.origin, TurnOrigin::User);
        assert!(m.is_visible_user_input());
        assert!(!Message::user("x").hidden().is_visible_user_input());
    }

    #[test]
    fn unknown_role_is_rejected() {
        assert!(serde_json::from_str::<Message>(r#"{"role":"robot"}"#).is_err());
    }

    #[test]
    fn text_joins_parts_and_estimates_tokens() {
        let m = Message::assistant("abcdefgh");
        assert_eq!(m.text(), "abcdefgh");
        assert_eq!(m.estimated_tokens(), 2 + 4);
    }
}
