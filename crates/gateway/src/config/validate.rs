//! The rules a parsed [`Config`] must meet. Every rule is checked and every
//! problem reported (key path + message); nothing is clamped silently.

use std::collections::BTreeSet;
use std::fmt::Display;

use keel_core::{AgentId, Usd};

use super::error::KeyedProblem;
use super::*;

/// Every rule violation of `config`; provider keys are looked up through `env`.
pub(super) fn problems(config: &Config, env: &dyn Fn(&str) -> Option<String>) -> Vec<KeyedProblem> {
    let mut out = Problems(Vec::new());
    profiles(config, env, &mut out);
    root_delegates(config, &mut out);
    let output = keel_catalog::MAX_OUTPUT_TOKENS_BOUND;
    out.range(
        "root_max_output_tokens",
        u64::from(config.root_max_output_tokens),
        output.min,
        output.max,
    );
    session(&config.session, &mut out);
    storage(&config.storage, &mut out);
    tools(config, &mut out);
    orchestration(&config.orchestration, &mut out);
    cost_budgets(config, &mut out);
    server(&config.server, &mut out);
    mcp(config, env, &mut out);
    telemetry(&config.telemetry, &mut out);
    out.0
}

fn telemetry(t: &TelemetryConfig, out: &mut Problems) {
    if let Some(endpoint) = &t.otlp_endpoint {
        let scheme_ok = endpoint.starts_with("http://") || endpoint.starts_with("https://");
        if !scheme_ok || endpoint.parse::<http::Uri>().is_err() {
            out.push(
                "telemetry.otlp_endpoint",
                format!("{endpoint:?} is not an http:// or https:// URL"),
            );
        }
    }
    if let Some(name) = &t.headers_env {
        out.env_name("telemetry.headers_env", name);
    }
    if let Some(name) = &t.service_name {
        if name.trim().is_empty() {
            out.push("telemetry.service_name", "an empty service name");
        }
    }
    if !(0.0..=1.0).contains(&t.sampling_ratio) {
        out.push(
            "telemetry.sampling_ratio",
            format!("{} is not within 0.0..=1.0", t.sampling_ratio),
        );
    }
}

/// Configured directories that do not exist (checked only when loading a file).
pub(super) fn filesystem_problems(config: &Config) -> Vec<KeyedProblem> {
    let mut out = Problems(Vec::new());
    for (key, dir) in [
        ("agents_dir", &config.agents_dir),
        ("skills_dir", &config.skills_dir),
        ("workspace_root", &config.workspace_root),
    ] {
        if let Some(dir) = dir {
            if !dir.is_dir() {
                out.push(
                    key,
                    format!("{} does not exist or is not a directory", dir.display()),
                );
            }
        }
    }
    out.0
}

struct Problems(Vec<KeyedProblem>);

impl Problems {
    fn push(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push((key.into(), message.into()));
    }

    /// `value` must lie in `min..=max`; `max` is a hard cap.
    fn range<T: PartialOrd + Display>(&mut self, key: &str, value: T, min: T, max: T) {
        if value < min {
            self.push(key, format!("{value} is below the minimum {min}"));
        } else if value > max {
            self.push(key, format!("{value} is above the hard cap {max}"));
        }
    }

    /// A capacity: at least 1, at most `max`.
    fn capacity(&mut self, key: &str, value: usize, max: usize) {
        if value == 0 {
            self.push(key, "0 is not a capacity; the minimum is 1");
        } else {
            self.range(key, value, 1, max);
        }
    }

    /// A per-session limit may not exceed its global limit.
    fn within_global(&mut self, key: &str, value: usize, global_key: &str, global: usize) {
        if value > global {
            self.push(key, format!("{value} is above {global_key} ({global})"));
        }
    }

    fn env_name(&mut self, key: &str, name: &str) {
        if name.is_empty() || name.contains(['=', '\0']) || name.trim() != name {
            self.push(key, format!("{name:?} is not an environment variable name"));
        }
    }
}

fn profiles(config: &Config, env: &dyn Fn(&str) -> Option<String>, out: &mut Problems) {
    let names: Vec<&str> = config.providers.keys().map(String::as_str).collect();
    let listed = || {
        names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (name, profile) in &config.providers {
        let key = super::spans::join("providers", name);
        if !valid_profile_name(name) {
            out.push(
                &key,
                format!(
                    "{name:?} is not a valid profile name (use ASCII letters, digits, '_' and '-', at most 64)"
                ),
            );
            continue;
        }
        if let Err(e) = profile.validate_with_env(&key, env) {
            let message = e.to_string();
            let message = message
                .strip_prefix(&format!("{}: ", e.key()))
                .unwrap_or(&message)
                .to_owned();
            out.push(e.key(), message);
        }
    }
    match &config.default_profile {
        Some(chosen) if config.providers.is_empty() && chosen != DEFAULT_PROFILE_NAME => out
            .push(
                "default_profile",
                format!("names `{chosen}`, but no [providers.NAME] is configured"),
            ),
        Some(_) if config.providers.is_empty() => {}
        Some(chosen) if !config.providers.contains_key(chosen) => out.push(
            "default_profile",
            format!("names `{chosen}`, which is not a configured profile (configured: {})", listed()),
        ),
        Some(chosen)
            if chosen != DEFAULT_PROFILE_NAME
                && config.providers.contains_key(DEFAULT_PROFILE_NAME) =>
        {
            out.push(
                "default_profile",
                format!(
                    "names `{chosen}`, but [providers.default] already defines the profile `default`"
                ),
            )
        }
        Some(_) => {}
        None if config.providers.len() > 1
            && !config.providers.contains_key(DEFAULT_PROFILE_NAME) =>
        {
            out.push(
                "default_profile",
                format!(
                    "must name the profile that `default` means when several are configured ({})",
                    listed()
                ),
            )
        }
        None => {}
    }
}

fn valid_profile_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn root_delegates(config: &Config, out: &mut Problems) {
    let mut seen = BTreeSet::new();
    for (i, id) in config.root_delegates.iter().enumerate() {
        let key = format!("root_delegates[{i}]");
        if let Err(e) = AgentId::parse(id) {
            out.push(key, e.to_string());
        } else if !seen.insert(id.as_str()) {
            out.push(key, format!("`{id}` is listed twice"));
        }
    }
}

/// A cost budget of keel.toml counts every model call of a turn or a
/// dialog, so it needs a positive amount and prices on every profile.
fn cost_budgets(config: &Config, out: &mut Problems) {
    let budgets = [
        (
            "session.max_cost_usd_per_dialog",
            config.session.max_cost_usd_per_dialog,
        ),
        (
            "orchestration.max_cost_usd_per_root_turn",
            config.orchestration.max_cost_usd_per_root_turn,
        ),
    ];
    for (key, budget) in budgets {
        let Some(budget) = budget else { continue };
        if budget == Usd::ZERO {
            out.push(key, "0 is not a budget; write an amount of USD above 0");
        }
        for (name, profile) in config.profiles() {
            if profile.prices().is_none() {
                out.push(
                    key,
                    format!(
                        "a cost budget needs prices, but profile {name:?} has none; set \
                         price_input_per_mtok and price_output_per_mtok in [providers.{name}] \
                         or remove {key}"
                    ),
                );
            }
        }
    }
}

fn session(s: &SessionConfig, out: &mut Problems) {
    out.range("session.ttl_hours", s.ttl_hours, 1, MAX_SESSION_TTL_HOURS);
    out.range(
        "session.cleanup_interval_minutes",
        s.cleanup_interval_minutes,
        1,
        MAX_CLEANUP_INTERVAL_MINUTES,
    );
    out.range(
        "session.auto_title_after_n_messages",
        s.auto_title_after_n_messages,
        0,
        MAX_AUTO_TITLE_AFTER_N_MESSAGES,
    );
    out.range(
        "session.turn_timeout_secs",
        s.turn_timeout_secs,
        1,
        MAX_TURN_TIMEOUT_SECS,
    );
    out.range(
        "session.retention.keep_checkpoints",
        s.retention.keep_checkpoints,
        0,
        MAX_KEEP_CHECKPOINTS,
    );
    out.range(
        "session.retention.purge_deleted_after_days",
        s.retention.purge_deleted_after_days,
        0,
        MAX_PURGE_DELETED_AFTER_DAYS,
    );
    let summary = &s.summary;
    if !(summary.trigger_ratio > 0.0 && summary.trigger_ratio <= 1.0) {
        out.push(
            "session.summary.trigger_ratio",
            format!(
                "{} is outside (0, 1]; it is a share of the context budget",
                summary.trigger_ratio
            ),
        );
    }
    out.range(
        "session.summary.debounce_turns",
        summary.debounce_turns,
        1,
        MAX_SUMMARY_DEBOUNCE_TURNS,
    );
}

fn storage(s: &StorageConfig, out: &mut Problems) {
    if let Some(url) = &s.url {
        if let Err(why) = crate::storage::check_url(url) {
            out.push("storage.url", why);
        }
    }
    if let Some(max) = s.max_connections {
        out.range("storage.max_connections", max, 1, MAX_PG_CONNECTIONS);
    }
    out.range(
        "storage.lease_secs",
        s.lease_secs,
        MIN_LEASE_SECS,
        MAX_LEASE_SECS,
    );
    out.range(
        "storage.lease_linger_ms",
        s.lease_linger_ms,
        0,
        MAX_LEASE_LINGER_MS,
    );
    if s.retry_delays_ms.is_empty() {
        out.push(
            "storage.retry_delays_ms",
            "is empty; at least one retry of a transient write failure is required",
        );
    } else if s.retry_delays_ms.len() > MAX_RETRY_ATTEMPTS {
        out.push(
            "storage.retry_delays_ms",
            format!(
                "has {} entries; the hard cap is {MAX_RETRY_ATTEMPTS} retries",
                s.retry_delays_ms.len()
            ),
        );
    }
    for (i, delay) in s.retry_delays_ms.iter().enumerate() {
        out.range(
            &format!("storage.retry_delays_ms[{i}]"),
            *delay,
            0,
            MAX_RETRY_DELAY_MS,
        );
    }
    out.range(
        "storage.busy_timeout_ms",
        s.busy_timeout_ms,
        0,
        MAX_BUSY_TIMEOUT_MS,
    );
}

fn tools(config: &Config, out: &mut Problems) {
    let t = &config.tools;
    out.range(
        "tools.shell_timeout_secs",
        t.shell_timeout_secs,
        1,
        MAX_SHELL_TIMEOUT_SECS,
    );
    out.range(
        "tools.approval_timeout_secs",
        t.approval_timeout_secs,
        1,
        super::MAX_APPROVAL_TIMEOUT_SECS,
    );
    let reason = &t.approval_supersede_reason;
    if reason.trim().is_empty() {
        out.push(
            "tools.approval_supersede_reason",
            "is blank; the model reads it as the reason of the denial",
        );
    } else if reason.len() > super::MAX_SUPERSEDE_REASON_BYTES {
        out.push(
            "tools.approval_supersede_reason",
            format!(
                "is {} bytes, above the hard cap {}",
                reason.len(),
                super::MAX_SUPERSEDE_REASON_BYTES
            ),
        );
    }
    for name in t.approval.keys() {
        if !super::APPROVABLE_TOOLS.contains(&name.as_str()) {
            out.push(
                format!("tools.approval.{name}"),
                format!(
                    "no tool {name:?}; known tools: {}",
                    super::APPROVABLE_TOOLS.join(", ")
                ),
            );
        }
    }
    let secrets = keel_secrets(config);
    for (i, name) in t.shell_env.iter().enumerate() {
        let key = format!("tools.shell_env[{i}]");
        out.env_name(&key, name);
        if secrets.contains(name.as_str()) {
            out.push(
                &key,
                format!(
                    "{name} holds a key keel uses; shell commands (and so the model) would read it"
                ),
            );
        }
    }
}

/// Variables that hold keel's own secrets: they never reach a command or an
/// MCP server.
fn keel_secrets(config: &Config) -> BTreeSet<&str> {
    config
        .providers
        .values()
        .filter_map(|p| p.api_key_env.as_deref())
        .chain(
            [ProviderKind::OpenAi, ProviderKind::Anthropic]
                .into_iter()
                .filter_map(|kind| -> Option<&str> { kind.default_api_key_env() }),
        )
        .chain([
            config.server.token_env.as_str(),
            config.server.webhook_secret_env.as_str(),
        ])
        .collect()
}

/// `[mcp.NAME]`: a name keel can mangle into tool names, exactly one
/// transport with only its own keys, bounds, and set header variables.
fn mcp(config: &Config, env: &dyn Fn(&str) -> Option<String>, out: &mut Problems) {
    let secrets = keel_secrets(config);
    for (name, server) in &config.mcp {
        let key = super::spans::join("mcp", name);
        let sub = |k: &str| format!("{key}.{k}");
        if !valid_mcp_server_name(name) {
            out.push(
                &key,
                format!("{name:?} is not a valid MCP server name (use [a-z][a-z0-9_-], at most 32 characters)"),
            );
            continue;
        }
        match (&server.command, &server.url) {
            (None, None) => out.push(
                &key,
                "set `command` (a stdio server) or `url` (a Streamable HTTP server)",
            ),
            (Some(_), Some(_)) => out.push(
                sub("url"),
                "a server is either stdio (`command`) or Streamable HTTP (`url`), not both",
            ),
            (Some(command), None) => {
                if command.trim().is_empty() {
                    out.push(sub("command"), "must not be empty");
                }
                if !server.headers_env.is_empty() {
                    out.push(
                        sub("headers_env"),
                        "only for Streamable HTTP servers (`url`)",
                    );
                }
                for (i, var) in server.env.iter().enumerate() {
                    let k = format!("{}[{i}]", sub("env"));
                    out.env_name(&k, var);
                    if secrets.contains(var.as_str()) {
                        out.push(
                            &k,
                            format!("{var} holds a key keel uses; the server would read it"),
                        );
                    }
                }
            }
            (None, Some(url)) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    out.push(
                        sub("url"),
                        format!("{url:?} is not an http:// or https:// URL"),
                    );
                }
                for (k, set) in [
                    ("args", !server.args.is_empty()),
                    ("env", !server.env.is_empty()),
                    ("cwd", server.cwd.is_some()),
                    ("network", server.network),
                    ("unsandboxed", server.unsandboxed),
                ] {
                    if set {
                        out.push(sub(k), "only for stdio servers (`command`)");
                    }
                }
                for (header, var) in &server.headers_env {
                    let k = format!("{}.{header}", sub("headers_env"));
                    if header.is_empty()
                        || !header
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
                    {
                        out.push(&k, format!("{header:?} is not an HTTP header name"));
                    }
                    out.env_name(&k, var);
                    if env(var).is_none() {
                        out.push(&k, format!("environment variable {var} is not set"));
                    }
                }
            }
        }
        if let Some(tools) = &server.tools {
            for (i, tool) in tools.iter().enumerate() {
                if tool.trim().is_empty() {
                    out.push(format!("{}[{i}]", sub("tools")), "must not be empty");
                }
            }
        }
        out.range(
            &sub("timeout_secs"),
            server.timeout_secs,
            1,
            MAX_MCP_TIMEOUT_SECS,
        );
        out.range(
            &sub("max_output_bytes"),
            server.max_output_bytes,
            MIN_MCP_MAX_OUTPUT_BYTES,
            MAX_MCP_MAX_OUTPUT_BYTES,
        );
    }
}

fn orchestration(o: &OrchestrationConfig, out: &mut Problems) {
    const P: &str = "orchestration.";
    let key = |name: &str| format!("{P}{name}");
    out.range(
        &key("max_tree_depth"),
        o.max_tree_depth,
        1,
        keel_catalog::MAX_DELEGATION_DEPTH_CAP,
    );
    out.capacity(
        &key("max_runs_per_tree"),
        o.max_runs_per_tree,
        MAX_RUNS_PER_TREE_CAP,
    );
    let pairs = [
        (
            "max_concurrent_runs",
            o.max_concurrent_runs,
            "max_concurrent_runs_per_session",
            o.max_concurrent_runs_per_session,
            MAX_CONCURRENT_RUNS_CAP,
        ),
        (
            "max_concurrent_provider_steps",
            o.max_concurrent_provider_steps,
            "max_concurrent_provider_steps_per_session",
            o.max_concurrent_provider_steps_per_session,
            MAX_CONCURRENT_STEPS_CAP,
        ),
        (
            "max_concurrent_tool_steps",
            o.max_concurrent_tool_steps,
            "max_concurrent_tool_steps_per_session",
            o.max_concurrent_tool_steps_per_session,
            MAX_CONCURRENT_STEPS_CAP,
        ),
    ];
    for (global_name, global, session_name, per_session, cap) in pairs {
        out.capacity(&key(global_name), global, cap);
        out.capacity(&key(session_name), per_session, cap);
        if global > 0 && per_session > 0 {
            out.within_global(&key(session_name), per_session, &key(global_name), global);
        }
    }
    out.capacity(
        &key("max_pending_inbox_events_per_session"),
        o.max_pending_inbox_events_per_session,
        MAX_PENDING_INBOX_EVENTS_CAP,
    );
    out.range(
        &key("inbox_event_ttl_hours"),
        o.inbox_event_ttl_hours,
        1,
        MAX_INBOX_EVENT_TTL_HOURS,
    );
    out.range(
        &key("max_inbox_delivery_attempts"),
        o.max_inbox_delivery_attempts,
        1,
        MAX_INBOX_DELIVERY_ATTEMPTS_CAP,
    );
    out.capacity(
        &key("max_user_turn_burst_before_inbox"),
        o.max_user_turn_burst_before_inbox,
        MAX_USER_TURN_BURST_CAP,
    );
    out.range(
        &key("max_inbox_wait_secs"),
        o.max_inbox_wait_secs,
        1,
        MAX_INBOX_WAIT_SECS_CAP,
    );
    out.range(
        &key("default_run_timeout_secs"),
        o.default_run_timeout_secs,
        1,
        MAX_RUN_TIMEOUT_SECS,
    );
    out.capacity(
        &key("max_children_per_call"),
        o.max_children_per_call,
        MAX_CHILDREN_PER_CALL_CAP,
    );
}

fn server(s: &ServerConfig, out: &mut Problems) {
    out.env_name("server.token_env", &s.token_env);
    out.range(
        "server.shutdown_grace_secs",
        s.shutdown_grace_secs,
        0,
        MAX_SHUTDOWN_GRACE_SECS,
    );
    if let Some(max) = s.max_connections {
        out.capacity("server.max_connections", max, MAX_CONNECTIONS_CAP);
    }
    for (key, secs) in [
        ("server.header_timeout_secs", s.header_timeout_secs),
        ("server.body_timeout_secs", s.body_timeout_secs),
        ("server.idle_timeout_secs", s.idle_timeout_secs),
    ] {
        out.range(key, secs, 1, MAX_CLIENT_TIMEOUT_SECS);
    }
    out.range(
        "server.stream_replay_secs",
        s.stream_replay_secs,
        0,
        MAX_STREAM_REPLAY_SECS,
    );
    out.range(
        "server.stream_replay_bytes",
        s.stream_replay_bytes,
        4096,
        MAX_STREAM_REPLAY_BYTES,
    );
    out.env_name("server.webhook_secret_env", &s.webhook_secret_env);
    out.range(
        "server.webhook_max_attempts",
        s.webhook_max_attempts,
        1,
        MAX_WEBHOOK_MAX_ATTEMPTS,
    );
    out.range(
        "server.webhook_retry_base_ms",
        s.webhook_retry_base_ms,
        1,
        MAX_WEBHOOK_RETRY_BASE_MS,
    );
    if s.webhook_urls.len() > MAX_WEBHOOK_URLS {
        out.push(
            "server.webhook_urls",
            format!("at most {MAX_WEBHOOK_URLS} URLs"),
        );
    }
    for url in &s.webhook_urls {
        if let Err(e) = crate::serve::webhooks::parse_url(url) {
            out.push("server.webhook_urls", format!("{url:?}: {e}"));
        }
    }
    out.range(
        "server.image_max_bytes",
        s.image_max_bytes,
        1,
        MAX_IMAGE_BYTES,
    );
    out.range(
        "server.images_per_message",
        s.images_per_message,
        0,
        MAX_IMAGES_PER_MESSAGE,
    );
}
