//! Shared vocabulary of keel: typed ids, messages, usage and cost, the
//! [`Provider`] and [`Tool`] traits with their events and errors, the
//! [`ToolRegistry`], orchestration enums, and the deterministic
//! [`ScriptedProvider`] every other crate tests against.
//!
//! Architecture invariant: keel-core performs no I/O besides timers; it knows
//! nothing of SQL, HTTP or the filesystem.
#![deny(missing_docs)]

pub mod id;
pub mod image;
pub mod message;
pub mod provider;
pub mod run;
pub mod scripted;
pub mod text;
pub mod time;
pub mod tool;
pub mod usage;

pub use id::{
    AgentId, ApprovalId, CheckpointId, EventId, GroupId, IdError, RunId, SessionId, TurnId,
};
pub use image::{
    image_uri, is_sha256_hex_str, sniff_image, stored_image_hash, IMAGE_MEDIA_TYPES,
    IMAGE_URI_PREFIX,
};
pub use message::{ClientVisibility, ContentPart, Message, Role, ToolCall, TurnOrigin};
pub use provider::{
    ChatRequest, FinishReason, Provider, ProviderError, ProviderResponse, ProviderStream,
    ResponseAccumulator, StreamEvent, ToolDefinition,
};
pub use run::{CompletionPolicy, Delivery, ExecutionMode, RunStatus, UnknownVariant};
pub use scripted::{
    Script, ScriptedError, ScriptedErrorKind, ScriptedProvider, ScriptedResponse, ScriptedToolCall,
    WhenExhausted,
};
pub use text::is_invisible;
pub use tokio_util::sync::CancellationToken;
pub use tool::{
    truncate_with_note, DelegationPolicy, Extensions, InputInterruptPolicy, ScopeRule, Tool,
    ToolError, ToolExecutionContext, ToolOutput, ToolRegistry, ToolRegistryError,
};
pub use usage::{CostTracker, Prices, Usage, Usd, UsdError};
