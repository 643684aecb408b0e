//! HTTP adapters for real LLM providers (OpenAI-compatible chat completions, Anthropic Messages).
