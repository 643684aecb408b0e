//! HTTP adapters for real LLM providers: an OpenAI-compatible
//! `/chat/completions` adapter ([`OpenAiProvider`]) and an Anthropic
//! `/messages` adapter ([`AnthropicProvider`]), both streaming SSE with tool
//! calls, usage, bounded retries, timeouts and cancellation; plus the
//! [`ProviderProfile`] config type and [`build_provider`], and the script
//! files of keel's offline [`keel_core::ScriptedProvider`] ([`load_script`]).
//!
//! Architecture invariant: this is the only keel crate that speaks HTTP to a
//! model. It knows nothing of sessions or storage; it turns a
//! [`keel_core::ChatRequest`] into wire JSON and wire events into
//! [`keel_core::StreamEvent`]s. Requests are retried only before the first
//! event reached the caller; after that a failure ends the stream with a
//! typed error, never with a silently partial answer.
#![deny(missing_docs)]

mod anthropic;
mod http;
mod openai;
mod profile;
mod script;
mod text_only;
pub use text_only::TextOnly;

pub use anthropic::{AnthropicProvider, ANTHROPIC_VERSION, DEFAULT_ANTHROPIC_MAX_TOKENS};
pub use http::{
    HttpProviderConfig, ResponseLimits, RetryPolicy, SleepFn, DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MAX_TOOL_ARGUMENT_BYTES, DEFAULT_TOTAL_TIMEOUT_SECS, RETRY_AFTER_CAP,
};
pub use openai::OpenAiProvider;
pub use profile::{
    build_provider, build_provider_with_env, default_context_window, ProviderConfigError,
    ProviderKind, ProviderProfile, ANTHROPIC_API_KEY_ENV, ANTHROPIC_BASE_URL,
    DEFAULT_CONNECT_TIMEOUT_SECS, DEFAULT_CONTEXT_WINDOW_TOKENS, DEFAULT_MAX_RETRIES,
    DEFAULT_READ_TIMEOUT_SECS, MAX_CONNECT_TIMEOUT_SECS, MAX_CONTEXT_WINDOW_TOKENS,
    MAX_READ_TIMEOUT_SECS, MAX_RESPONSE_BYTES_CAP, MAX_RETRIES_CAP, MAX_TOOL_ARGUMENT_BYTES_CAP,
    MAX_TOTAL_TIMEOUT_SECS, MIN_CONTEXT_WINDOW_TOKENS, OPENAI_API_KEY_ENV, OPENAI_BASE_URL,
};
pub use script::{load_script, parse_script, ScriptError};
