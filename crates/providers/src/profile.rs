//! Provider profiles as configured under `[providers.NAME]`, their validation
//! (every error names its key path), and [`build_provider`], which turns a
//! profile into a ready [`Provider`].
//!
//! Secrets come only from environment variables; the lookup is injectable so
//! tests never read real keys.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_core::{Prices, Provider, ScriptedProvider, Usd};
use serde::{Deserialize, Serialize};

use crate::anthropic::AnthropicProvider;
use crate::http::{
    HttpProviderConfig, ResponseLimits, RetryPolicy, DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MAX_TOOL_ARGUMENT_BYTES, DEFAULT_TOTAL_TIMEOUT_SECS,
};
use crate::openai::OpenAiProvider;
use crate::script::{load_script, ScriptError};

/// Default `base_url` of kind `openai`.
pub const OPENAI_BASE_URL: &str = "https://api.openai.com/v1";
/// Default `base_url` of kind `anthropic`.
pub const ANTHROPIC_BASE_URL: &str = "https://api.anthropic.com/v1";
/// Default key variable of kind `openai` (used only with the default base URL).
pub const OPENAI_API_KEY_ENV: &str = "OPENAI_API_KEY";
/// Default key variable of kind `anthropic` (used only with the default base URL).
pub const ANTHROPIC_API_KEY_ENV: &str = "ANTHROPIC_API_KEY";
/// Default `connect_timeout_secs`.
pub const DEFAULT_CONNECT_TIMEOUT_SECS: u64 = 10;
/// Largest accepted `connect_timeout_secs`.
pub const MAX_CONNECT_TIMEOUT_SECS: u64 = 300;
/// Default `read_timeout_secs`.
pub const DEFAULT_READ_TIMEOUT_SECS: u64 = 120;
/// Largest accepted `read_timeout_secs`.
pub const MAX_READ_TIMEOUT_SECS: u64 = 3600;
/// Default `max_retries`.
pub const DEFAULT_MAX_RETRIES: u32 = 3;
/// Largest accepted `max_retries`.
pub const MAX_RETRIES_CAP: u32 = 10;
/// Largest accepted `max_response_bytes` (1 GiB).
pub const MAX_RESPONSE_BYTES_CAP: u64 = 1024 * 1024 * 1024;
/// Largest accepted `max_tool_argument_bytes` (256 MiB).
pub const MAX_TOOL_ARGUMENT_BYTES_CAP: u64 = 256 * 1024 * 1024;
/// Largest accepted `total_timeout_secs` (2 h).
pub const MAX_TOTAL_TIMEOUT_SECS: u64 = 7200;
/// Smallest accepted `context_window_tokens`.
pub const MIN_CONTEXT_WINDOW_TOKENS: u64 = 1_000;
/// Largest accepted `context_window_tokens`.
pub const MAX_CONTEXT_WINDOW_TOKENS: u64 = 10_000_000;
/// `context_window_tokens` of a model keel does not know.
pub const DEFAULT_CONTEXT_WINDOW_TOKENS: u64 = 32_000;

/// Which wire protocol a profile speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ProviderKind {
    /// OpenAI-compatible `/chat/completions`.
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic `/messages`.
    #[serde(rename = "anthropic")]
    Anthropic,
    /// keel's deterministic [`ScriptedProvider`] (offline, no network).
    #[serde(rename = "scripted")]
    Scripted,
}

impl ProviderKind {
    /// The config spelling: `openai`, `anthropic` or `scripted`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::OpenAi => "openai",
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::Scripted => "scripted",
        }
    }

    /// The API root used when `base_url` is not set (none for `scripted`).
    pub fn default_base_url(self) -> Option<&'static str> {
        match self {
            ProviderKind::OpenAi => Some(OPENAI_BASE_URL),
            ProviderKind::Anthropic => Some(ANTHROPIC_BASE_URL),
            ProviderKind::Scripted => None,
        }
    }

    /// The key variable used when `api_key_env` is not set and `base_url` is
    /// the default one (none for `scripted`).
    pub fn default_api_key_env(self) -> Option<&'static str> {
        match self {
            ProviderKind::OpenAi => Some(OPENAI_API_KEY_ENV),
            ProviderKind::Anthropic => Some(ANTHROPIC_API_KEY_ENV),
            ProviderKind::Scripted => None,
        }
    }
}

fn default_connect_timeout_secs() -> u64 {
    DEFAULT_CONNECT_TIMEOUT_SECS
}

fn default_read_timeout_secs() -> u64 {
    DEFAULT_READ_TIMEOUT_SECS
}

fn default_max_retries() -> u32 {
    DEFAULT_MAX_RETRIES
}

fn default_max_response_bytes() -> u64 {
    DEFAULT_MAX_RESPONSE_BYTES
}

fn default_max_tool_argument_bytes() -> u64 {
    DEFAULT_MAX_TOOL_ARGUMENT_BYTES
}

fn default_total_timeout_secs() -> u64 {
    DEFAULT_TOTAL_TIMEOUT_SECS
}

/// Context windows of well-known models, by model-name prefix (the longest
/// matching prefix wins). Unknown models get [`DEFAULT_CONTEXT_WINDOW_TOKENS`].
const KNOWN_CONTEXT_WINDOWS: &[(&str, u64)] = &[
    ("gpt-4.1", 1_047_576),
    ("gpt-4o", 128_000),
    ("gpt-4-turbo", 128_000),
    ("gpt-4", 8_192),
    ("gpt-3.5-turbo", 16_385),
    ("gpt-5", 400_000),
    ("o1", 200_000),
    ("o3", 200_000),
    ("o4-mini", 200_000),
    ("claude", 200_000),
    ("deepseek", 64_000),
    ("qwen", 32_768),
    ("llama3.1", 128_000),
    ("llama3.2", 128_000),
    ("llama3.3", 128_000),
    ("llama3", 8_192),
    ("mistral", 32_000),
    ("gemma", 8_192),
];

/// The context window of `model`: the longest known model-name prefix
/// (`gpt-4o` 128000, `claude` 200000 …), else [`DEFAULT_CONTEXT_WINDOW_TOKENS`].
pub fn default_context_window(model: &str) -> u64 {
    let model = model.trim().to_ascii_lowercase();
    let name = model.rsplit('/').next().unwrap_or(&model);
    KNOWN_CONTEXT_WINDOWS
        .iter()
        .filter(|(prefix, _)| name.starts_with(prefix))
        .max_by_key(|(prefix, _)| prefix.len())
        .map_or(DEFAULT_CONTEXT_WINDOW_TOKENS, |(_, tokens)| *tokens)
}

/// One `[providers.NAME]` table.
///
/// API keys: when `api_key_env` is set, that variable must hold the key.
/// When it is not set, the kind's default variable (`OPENAI_API_KEY`,
/// `ANTHROPIC_API_KEY`) must hold it, but only if `base_url` is also the
/// default: a custom `base_url` (Ollama, vLLM, a proxy …) is sent no key unless
/// `api_key_env` names one, so a real key never leaks to another server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderProfile {
    /// Wire protocol: `openai`, `anthropic` or `scripted`.
    pub kind: ProviderKind,
    /// API root; requests go to `{base_url}/chat/completions` or
    /// `{base_url}/messages`. Default: the kind's public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Model identifier. Required except for `scripted`.
    #[serde(default)]
    pub model: String,
    /// Environment variable holding the API key (see the type docs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Seconds to establish a connection (default 10, 1..=300).
    #[serde(default = "default_connect_timeout_secs")]
    pub connect_timeout_secs: u64,
    /// Longest silence, in seconds, before a response or its next chunk
    /// (default 120, 1..=3600).
    #[serde(default = "default_read_timeout_secs")]
    pub read_timeout_secs: u64,
    /// Retries on 429/5xx/connect errors/timeouts before any output
    /// (default 3, at most 10).
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// Output token cap used when a request sets none (Anthropic defaults to 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Most bytes of one response body (default 32 MiB, at most 1 GiB).
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: u64,
    /// Most bytes of tool-call arguments in one response (default 4 MiB,
    /// at most 256 MiB).
    #[serde(default = "default_max_tool_argument_bytes")]
    pub max_tool_argument_bytes: u64,
    /// Longest time, in seconds, one model call may take, retries included
    /// (default 600, 1..=7200).
    #[serde(default = "default_total_timeout_secs")]
    pub total_timeout_secs: u64,
    /// The model's context window in tokens; requests are compacted to stay
    /// under it. Default: known for well-known models, else 32000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window_tokens: Option<u64>,
    /// For `scripted`: a YAML/JSON script file; without one the provider is
    /// the offline echo.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<PathBuf>,
    /// USD per million prompt tokens (a finite number, 0 or more); with
    /// `price_output_per_mtok` it prices the profile's calls for cost
    /// budgets. Default: none (the calls cost nothing known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_input_per_mtok: Option<Usd>,
    /// USD per million completion tokens (a finite number, 0 or more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_output_per_mtok: Option<Usd>,
    /// Whether the model takes images in user messages (default true);
    /// `false` marks it text-only: a message with images is refused.
    #[serde(default = "default_images")]
    pub images: bool,
}

fn default_images() -> bool {
    true
}

impl ProviderProfile {
    /// A profile of `kind` for `model` with every other key at its default.
    pub fn new(kind: ProviderKind, model: impl Into<String>) -> Self {
        Self {
            kind,
            base_url: None,
            model: model.into(),
            api_key_env: None,
            connect_timeout_secs: DEFAULT_CONNECT_TIMEOUT_SECS,
            read_timeout_secs: DEFAULT_READ_TIMEOUT_SECS,
            max_retries: DEFAULT_MAX_RETRIES,
            max_tokens: None,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            max_tool_argument_bytes: DEFAULT_MAX_TOOL_ARGUMENT_BYTES,
            total_timeout_secs: DEFAULT_TOTAL_TIMEOUT_SECS,
            context_window_tokens: None,
            script: None,
            price_input_per_mtok: None,
            price_output_per_mtok: None,
            images: true,
        }
    }

    /// What the profile's tokens cost, when both prices are set.
    pub fn prices(&self) -> Option<Prices> {
        Some(Prices {
            input_per_mtok: self.price_input_per_mtok?,
            output_per_mtok: self.price_output_per_mtok?,
        })
    }

    /// The context window requests of this profile must fit in:
    /// `context_window_tokens`, else the model's known window.
    pub fn context_window(&self) -> u64 {
        self.context_window_tokens
            .unwrap_or_else(|| default_context_window(&self.model))
    }

    /// The API root requests go to (none for `scripted`).
    pub fn effective_base_url(&self) -> Option<&str> {
        self.base_url.as_deref().or(self.kind.default_base_url())
    }

    /// The variable the key is read from, if a key is sent at all.
    pub fn effective_api_key_env(&self) -> Option<&str> {
        match (&self.api_key_env, &self.base_url) {
            (Some(var), _) => Some(var),
            (None, None) => self.kind.default_api_key_env(),
            (None, Some(_)) => None,
        }
    }

    /// Checks the profile at `key_path` (e.g. `providers.main`), reading the
    /// process environment for the key.
    pub fn validate(&self, key_path: &str) -> Result<(), ProviderConfigError> {
        self.validate_with_env(key_path, &real_env)
    }

    /// [`validate`](Self::validate) with an injected environment lookup.
    pub fn validate_with_env(
        &self,
        key_path: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ProviderConfigError> {
        self.check_static(key_path)?;
        self.api_key(key_path, env).map(|_| ())
    }

    /// Everything that does not need the environment.
    fn check_static(&self, key_path: &str) -> Result<(), ProviderConfigError> {
        let invalid = |key: &str, message: String| ProviderConfigError::Invalid {
            key: format!("{key_path}.{key}"),
            message,
        };
        let http = self.kind != ProviderKind::Scripted;
        if http && self.model.trim().is_empty() {
            return Err(invalid("model", "must name a model".into()));
        }
        if let Some(url) = &self.base_url {
            if !http {
                return Err(invalid("base_url", "is not used by kind `scripted`".into()));
            }
            check_base_url(url).map_err(|m| invalid("base_url", m))?;
        }
        if let Some(var) = &self.api_key_env {
            if !http {
                return Err(invalid(
                    "api_key_env",
                    "is not used by kind `scripted`".into(),
                ));
            }
            if var.is_empty() || var.contains(['=', '\0']) {
                return Err(invalid(
                    "api_key_env",
                    format!("`{var}` is not an environment variable name"),
                ));
            }
        }
        if self.script.is_some() && http {
            return Err(invalid(
                "script",
                format!(
                    "is only used by kind `scripted`, not `{}`",
                    self.kind.as_str()
                ),
            ));
        }
        check_range(self.connect_timeout_secs, 1, MAX_CONNECT_TIMEOUT_SECS)
            .map_err(|m| invalid("connect_timeout_secs", m))?;
        check_range(self.read_timeout_secs, 1, MAX_READ_TIMEOUT_SECS)
            .map_err(|m| invalid("read_timeout_secs", m))?;
        check_range(u64::from(self.max_retries), 0, u64::from(MAX_RETRIES_CAP))
            .map_err(|m| invalid("max_retries", m))?;
        if self.max_tokens == Some(0) {
            return Err(invalid("max_tokens", "must be at least 1".into()));
        }
        check_range(self.max_response_bytes, 1024, MAX_RESPONSE_BYTES_CAP)
            .map_err(|m| invalid("max_response_bytes", m))?;
        check_range(self.max_tool_argument_bytes, 1, MAX_TOOL_ARGUMENT_BYTES_CAP)
            .map_err(|m| invalid("max_tool_argument_bytes", m))?;
        check_range(self.total_timeout_secs, 1, MAX_TOTAL_TIMEOUT_SECS)
            .map_err(|m| invalid("total_timeout_secs", m))?;
        if let Some(tokens) = self.context_window_tokens {
            check_range(tokens, MIN_CONTEXT_WINDOW_TOKENS, MAX_CONTEXT_WINDOW_TOKENS)
                .map_err(|m| invalid("context_window_tokens", m))?;
        }
        match (self.price_input_per_mtok, self.price_output_per_mtok) {
            (Some(_), None) => {
                return Err(invalid(
                    "price_output_per_mtok",
                    "is missing: set both prices or neither".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "price_input_per_mtok",
                    "is missing: set both prices or neither".into(),
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// The key to send, read from the effective variable.
    fn api_key(
        &self,
        key_path: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, ProviderConfigError> {
        let Some(var) = self.effective_api_key_env() else {
            return Ok(None);
        };
        let key = format!("{key_path}.api_key_env");
        match env(var) {
            None => Err(ProviderConfigError::MissingApiKey {
                key,
                var: var.to_owned(),
                empty: false,
            }),
            Some(v) if v.trim().is_empty() => Err(ProviderConfigError::MissingApiKey {
                key,
                var: var.to_owned(),
                empty: true,
            }),
            Some(v) if !v.trim().chars().all(|c| c.is_ascii_graphic()) => {
                Err(ProviderConfigError::Invalid {
                    key,
                    message: format!(
                        "environment variable {var} holds characters that cannot be sent \
                         in an HTTP header"
                    ),
                })
            }
            Some(v) => Ok(Some(v.trim().to_owned())),
        }
    }

    /// The endpoint settings of an HTTP kind.
    fn http_config(
        &self,
        key_path: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<HttpProviderConfig, ProviderConfigError> {
        let base_url = self.effective_base_url().unwrap_or_default();
        let mut config = HttpProviderConfig::new(base_url, self.model.trim());
        config.api_key = self.api_key(key_path, env)?;
        config.api_key_env = self.effective_api_key_env().map(str::to_owned);
        config.connect_timeout = Duration::from_secs(self.connect_timeout_secs);
        config.read_timeout = Duration::from_secs(self.read_timeout_secs);
        config.retry = RetryPolicy {
            max_retries: self.max_retries,
            ..RetryPolicy::default()
        };
        config.max_tokens = self.max_tokens;
        config.limits = ResponseLimits {
            max_response_bytes: self.max_response_bytes,
            max_tool_argument_bytes: self.max_tool_argument_bytes,
            total_timeout: Duration::from_secs(self.total_timeout_secs),
            key_path: key_path.to_owned(),
        };
        Ok(config)
    }
}

fn real_env(var: &str) -> Option<String> {
    std::env::var(var).ok()
}

fn check_range(value: u64, min: u64, max: u64) -> Result<(), String> {
    if value < min || value > max {
        return Err(format!("must be between {min} and {max}, got {value}"));
    }
    Ok(())
}

fn check_base_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("`{url}` is not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("`{url}` must start with http:// or https://"));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(format!("`{url}` has no host"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(format!(
            "`{url}` must not have a query or fragment (the endpoint path is appended)"
        ));
    }
    Ok(())
}

/// A provider profile keel cannot use; every variant names its key path.
#[derive(Debug, thiserror::Error)]
pub enum ProviderConfigError {
    /// A key has a value keel cannot use.
    #[error("{key}: {message}")]
    Invalid {
        /// Full key path, e.g. `providers.main.base_url`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The variable that should hold the API key is unset or empty.
    #[error("{key}: environment variable {var} is {}", if *empty { "empty" } else { "not set" })]
    MissingApiKey {
        /// Full key path, `providers.NAME.api_key_env`.
        key: String,
        /// The variable.
        var: String,
        /// Set but empty (rather than unset).
        empty: bool,
    },
    /// The script of a `scripted` profile cannot be loaded.
    #[error("{key}: {source}")]
    Script {
        /// Full key path, `providers.NAME.script`.
        key: String,
        /// Why loading failed.
        #[source]
        source: ScriptError,
    },
    /// The HTTP client could not be built.
    #[error("{key}: {message}")]
    Client {
        /// Full key path, `providers.NAME`.
        key: String,
        /// What failed.
        message: String,
    },
}

impl ProviderConfigError {
    /// The key path the error is about.
    pub fn key(&self) -> &str {
        match self {
            ProviderConfigError::Invalid { key, .. }
            | ProviderConfigError::MissingApiKey { key, .. }
            | ProviderConfigError::Script { key, .. }
            | ProviderConfigError::Client { key, .. } => key,
        }
    }
}

/// Builds the provider of profile `providers.{name}`, reading the key from
/// the process environment.
pub fn build_provider(
    name: &str,
    profile: &ProviderProfile,
) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    build_provider_with_env(name, profile, &real_env)
}

/// [`build_provider`] with an injected environment lookup.
pub fn build_provider_with_env(
    name: &str,
    profile: &ProviderProfile,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    let key_path = format!("providers.{name}");
    profile.check_static(&key_path)?;
    let client_error = |e: keel_core::ProviderError| ProviderConfigError::Client {
        key: key_path.clone(),
        message: e.to_string(),
    };
    let provider = build_kind(&key_path, profile, env, client_error)?;
    Ok(if profile.images {
        provider
    } else {
        crate::text_only::TextOnly::wrap(name, provider)
    })
}

fn build_kind(
    key_path: &str,
    profile: &ProviderProfile,
    env: &dyn Fn(&str) -> Option<String>,
    client_error: impl Fn(keel_core::ProviderError) -> ProviderConfigError,
) -> Result<Arc<dyn Provider>, ProviderConfigError> {
    let key_path = key_path.to_owned();
    Ok(match profile.kind {
        ProviderKind::OpenAi => Arc::new(
            OpenAiProvider::new(profile.http_config(&key_path, env)?).map_err(client_error)?,
        ),
        ProviderKind::Anthropic => Arc::new(
            AnthropicProvider::new(profile.http_config(&key_path, env)?).map_err(client_error)?,
        ),
        ProviderKind::Scripted => {
            let provider = match &profile.script {
                Some(path) => load_script(path)
                    .map(ScriptedProvider::from_script)
                    .map_err(|source| ProviderConfigError::Script {
                        key: format!("{key_path}.script"),
                        source,
                    })?,
                None => ScriptedProvider::offline(),
            };
            let model = profile.model.trim();
            Arc::new(if model.is_empty() {
                provider
            } else {
                provider.with_model(model)
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_with(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    fn parse(toml_like_json: serde_json::Value) -> Result<ProviderProfile, serde_json::Error> {
        serde_json::from_value(toml_like_json)
    }

    #[test]
    fn defaults_are_documented_values() {
        let p = parse(serde_json::json!({"kind": "openai", "model": "gpt-4o-mini"})).unwrap();
        assert_eq!(p, ProviderProfile::new(ProviderKind::OpenAi, "gpt-4o-mini"));
        assert_eq!(p.effective_base_url(), Some(OPENAI_BASE_URL));
        assert_eq!(p.effective_api_key_env(), Some(OPENAI_API_KEY_ENV));
        assert_eq!(
            (p.connect_timeout_secs, p.read_timeout_secs, p.max_retries),
            (10, 120, 3)
        );
        let a = ProviderProfile::new(ProviderKind::Anthropic, "claude");
        assert_eq!(a.effective_base_url(), Some(ANTHROPIC_BASE_URL));
        assert_eq!(a.effective_api_key_env(), Some(ANTHROPIC_API_KEY_ENV));
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["kind"], "openai");
        assert!(json.get("base_url").is_none());
    }

    #[test]
    fn prices_are_amounts_of_usd_and_come_in_pairs() {
        let p = parse(
            serde_json::json!({"kind": "scripted", "price_input_per_mtok": 3,
            "price_output_per_mtok": 15.5}),
        )
        .unwrap();
        let prices = p.prices().unwrap();
        assert_eq!(prices.input_per_mtok.get(), 3.0);
        assert_eq!(prices.output_per_mtok.get(), 15.5);
        p.validate_with_env("providers.p", &env_with(&[])).unwrap();
        let err = parse(
            serde_json::json!({"kind": "scripted", "price_input_per_mtok": -1,
            "price_output_per_mtok": 1}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("is not an amount of USD"), "{err}");
        assert_eq!(
            ProviderProfile::new(ProviderKind::Scripted, "").prices(),
            None
        );
    }

    #[test]
    fn unknown_keys_and_kinds_are_rejected() {
        let err = parse(serde_json::json!({"kind": "openai", "model": "m", "api_key": "sk"}))
            .unwrap_err();
        assert!(err.to_string().contains("unknown field `api_key`"), "{err}");
        assert!(parse(serde_json::json!({"kind": "gemini", "model": "m"})).is_err());
    }

    #[test]
    fn custom_base_url_sends_no_key_unless_named() {
        let mut p = ProviderProfile::new(ProviderKind::OpenAi, "llama3");
        p.base_url = Some("http://127.0.0.1:11434/v1".into());
        assert_eq!(p.effective_api_key_env(), None);
        p.validate_with_env("providers.local", &env_with(&[]))
            .unwrap();
        p.api_key_env = Some("DEEPSEEK_API_KEY".into());
        let err = p
            .validate_with_env("providers.local", &env_with(&[]))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "providers.local.api_key_env: environment variable DEEPSEEK_API_KEY is not set"
        );
        p.validate_with_env(
            "providers.local",
            &env_with(&[("DEEPSEEK_API_KEY", "sk-x")]),
        )
        .unwrap();
    }

    #[test]
    fn validation_errors_name_the_key() {
        let base = ProviderProfile::new(ProviderKind::OpenAi, "gpt");
        let key = env_with(&[
            ("OPENAI_API_KEY", "sk-test"),
            ("BLANK", " "),
            ("BAD", "a\u{1}b"),
        ]);
        let cases: Vec<(&str, ProviderProfile)> = vec![
            (
                "empty model",
                ProviderProfile {
                    model: " ".into(),
                    ..base.clone()
                },
            ),
            (
                "ftp url",
                ProviderProfile {
                    base_url: Some("ftp://x/v1".into()),
                    ..base.clone()
                },
            ),
            (
                "not a url",
                ProviderProfile {
                    base_url: Some("localhost:11434".into()),
                    ..base.clone()
                },
            ),
            (
                "query",
                ProviderProfile {
                    base_url: Some("http://h/v1?x=1".into()),
                    ..base.clone()
                },
            ),
            (
                "zero connect",
                ProviderProfile {
                    connect_timeout_secs: 0,
                    ..base.clone()
                },
            ),
            (
                "huge read",
                ProviderProfile {
                    read_timeout_secs: 86_400,
                    ..base.clone()
                },
            ),
            (
                "retries",
                ProviderProfile {
                    max_retries: 50,
                    ..base.clone()
                },
            ),
            (
                "max tokens",
                ProviderProfile {
                    max_tokens: Some(0),
                    ..base.clone()
                },
            ),
            (
                "tiny response cap",
                ProviderProfile {
                    max_response_bytes: 10,
                    ..base.clone()
                },
            ),
            (
                "zero tool argument cap",
                ProviderProfile {
                    max_tool_argument_bytes: 0,
                    ..base.clone()
                },
            ),
            (
                "endless call",
                ProviderProfile {
                    total_timeout_secs: 86_400,
                    ..base.clone()
                },
            ),
            (
                "tiny context window",
                ProviderProfile {
                    context_window_tokens: Some(10),
                    ..base.clone()
                },
            ),
            (
                "script on http",
                ProviderProfile {
                    script: Some("s.yaml".into()),
                    ..base.clone()
                },
            ),
            (
                "bad env name",
                ProviderProfile {
                    api_key_env: Some("A=B".into()),
                    ..base.clone()
                },
            ),
            (
                "blank key",
                ProviderProfile {
                    api_key_env: Some("BLANK".into()),
                    ..base.clone()
                },
            ),
            (
                "bad key",
                ProviderProfile {
                    api_key_env: Some("BAD".into()),
                    ..base.clone()
                },
            ),
            (
                "missing default key",
                ProviderProfile::new(ProviderKind::Anthropic, "claude"),
            ),
            (
                "one price",
                ProviderProfile {
                    price_input_per_mtok: Some(Usd::ZERO),
                    ..base.clone()
                },
            ),
            (
                "url on scripted",
                ProviderProfile {
                    base_url: Some("http://h".into()),
                    ..ProviderProfile::new(ProviderKind::Scripted, "")
                },
            ),
        ];
        let messages: Vec<String> = cases
            .iter()
            .map(|(what, p)| {
                let err = p.validate_with_env("providers.main", &key).unwrap_err();
                assert!(err.to_string().starts_with(err.key()), "{what}: {err}");
                format!("{what}: {err}")
            })
            .collect();
        insta::assert_yaml_snapshot!(messages);
        base.validate_with_env("providers.main", &key).unwrap();
    }

    #[test]
    fn context_windows_of_known_models() {
        let window =
            |model: &str| ProviderProfile::new(ProviderKind::OpenAi, model).context_window();
        assert_eq!(window("gpt-4o-mini"), 128_000);
        assert_eq!(window("gpt-4.1-nano"), 1_047_576);
        assert_eq!(window("gpt-4"), 8_192);
        assert_eq!(window("claude-sonnet-4-5"), 200_000);
        assert_eq!(window("Qwen/Qwen2.5-7B-Instruct"), 32_768);
        assert_eq!(window("llama3.1:8b"), 128_000);
        assert_eq!(window("my-finetune"), DEFAULT_CONTEXT_WINDOW_TOKENS);
        let set = ProviderProfile {
            context_window_tokens: Some(4_000),
            ..ProviderProfile::new(ProviderKind::OpenAi, "gpt-4o")
        };
        assert_eq!(set.context_window(), 4_000);
    }

    #[test]
    fn builds_each_kind() {
        let env = env_with(&[("OPENAI_API_KEY", "sk-o"), ("ANTHROPIC_API_KEY", "sk-a")]);
        let o = build_provider_with_env(
            "o",
            &ProviderProfile::new(ProviderKind::OpenAi, "gpt"),
            &env,
        )
        .unwrap();
        assert_eq!((o.name(), o.model()), ("openai", "gpt"));
        let a = build_provider_with_env(
            "a",
            &ProviderProfile::new(ProviderKind::Anthropic, "claude"),
            &env,
        )
        .unwrap();
        assert_eq!((a.name(), a.model()), ("anthropic", "claude"));
        let s =
            build_provider_with_env("s", &ProviderProfile::new(ProviderKind::Scripted, ""), &env)
                .unwrap();
        assert_eq!((s.name(), s.model()), ("scripted", "scripted"));
        let err = build_provider_with_env(
            "main",
            &ProviderProfile::new(ProviderKind::OpenAi, "gpt"),
            &env_with(&[]),
        )
        .err()
        .unwrap();
        assert_eq!(
            err.to_string(),
            "providers.main.api_key_env: environment variable OPENAI_API_KEY is not set"
        );
        let missing = ProviderProfile {
            script: Some("/nonexistent/keel-script.yaml".into()),
            ..ProviderProfile::new(ProviderKind::Scripted, "")
        };
        let err = build_provider_with_env("demo", &missing, &env)
            .err()
            .unwrap();
        assert_eq!(err.key(), "providers.demo.script");
    }
}
