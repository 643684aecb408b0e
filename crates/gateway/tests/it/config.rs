//! `keel.toml`: defaults, parsing, validation messages, profile resolution,
//! conversions, and the key reference that docs/CONFIG.md must contain.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_gateway::config::{
    flatten_keys, reference, render_generated_docs, Config, ConfigError, LoadedConfig, SyncMode,
    EXAMPLE_TOML, OFFLINE_NOTICE,
};
use keel_gateway::serve::ServeOptions;
use keel_providers::ProviderKind;

/// An environment with only `vars` set.
fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| (*v).to_owned())
    }
}

const NO_ENV: &[(&str, &str)] = &[];
const OPENAI: &[(&str, &str)] = &[("OPENAI_API_KEY", "sk-test"), ("DOCS_TOKEN", "t")];

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str_with_env(text, "keel.toml", &env(OPENAI))
}

fn error(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

/// Each input with the error it produces, for one snapshot per test. Every
/// message must start with the file label.
fn errors(inputs: &[&str]) -> String {
    inputs
        .iter()
        .map(|text| {
            let err = error(text);
            for line in err.lines() {
                assert!(line.starts_with("keel.toml"), "{line}");
            }
            format!("--- input\n{text}--- error\n{err}\n")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn defaults_load_with_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let loaded = Config::load_with_env(None, Some(dir.path()), &env(NO_ENV)).unwrap();
    assert_eq!(loaded.source, None);
    assert_eq!(loaded.config.data_dir(), dir.path());
    assert_eq!(
        Config {
            data_dir: None,
            ..loaded.config.clone()
        },
        Config::default()
    );
    assert_eq!(loaded.source_label(), "keel.toml (defaults)");
    let c = &loaded.config;
    assert_eq!(c.offline_notice(), Some(OFFLINE_NOTICE));
    assert_eq!(c.agents_dir(), None);
    assert_eq!(c.workspace_root(), PathBuf::from("."));
    assert_eq!(c.server.bind.to_string(), "127.0.0.1:7420");
    assert_eq!(c.server.token_env, "KEEL_TOKEN");
    assert_eq!(c.session.ttl_hours, 24);
    assert_eq!(c.session.turn_timeout_secs, 900);
    assert_eq!(c.session.cleanup_interval_minutes, 60);
    assert_eq!(c.session.auto_title_after_n_messages, 10);
    assert!(c.session.auto_checkpoint);
    assert_eq!(c.storage.synchronous, SyncMode::Normal);
    assert_eq!(c.storage.retry_delays_ms, [100, 200, 300]);
    assert_eq!(c.storage.busy_timeout_ms, 5000);
    assert!(!c.tools.enable_write && !c.tools.enable_shell);
    assert_eq!(c.tools.shell_timeout_secs, 30);
    // An empty file is the defaults too.
    assert_eq!(parse("").unwrap(), Config::default());
}

#[test]
fn data_dir_comes_from_the_flag_then_the_environment_then_dot_keel() {
    let from_env =
        Config::load_with_env(None, None, &env(&[("KEEL_DATA_DIR", "/nonexistent/k")])).unwrap();
    assert_eq!(from_env.config.data_dir(), Path::new("/nonexistent/k"));
    let plain = Config::load_with_env(None, None, &env(&[("KEEL_DATA_DIR", " ")])).unwrap();
    assert_eq!(plain.config.data_dir(), Path::new(".keel"));
}

#[test]
fn the_data_dir_file_is_found_and_relative_paths_follow_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("agents")).unwrap();
    std::fs::write(
        dir.path().join("keel.toml"),
        "workspace_root = \".\"\n[tools]\nenable_shell = true\n",
    )
    .unwrap();
    let loaded = Config::load_with_env(None, Some(dir.path()), &env(NO_ENV)).unwrap();
    assert_eq!(loaded.source, Some(dir.path().join("keel.toml")));
    let c = loaded.config;
    assert!(c.tools.enable_shell);
    assert_eq!(c.data_dir(), dir.path());
    assert_eq!(c.workspace_root(), dir.path().join("."));
    // `<data_dir>/agents` is used because it exists.
    assert_eq!(c.agents_dir(), Some(dir.path().join("agents")));
}

#[test]
fn approval_policy_gates_enabled_shell_and_write_file_unless_relaxed() {
    use keel_engine::ApprovalPolicy;
    let c = parse("[tools]\nenable_shell = true\nenable_write = true\n").unwrap();
    assert_eq!(
        c.approval_policy(),
        ApprovalPolicy::tools(["shell", "write_file"])
    );
    assert!(!c.approval_policy().needs("read_file"));
    let c = parse("[tools]\nenable_write = true\n").unwrap();
    assert_eq!(c.approval_policy(), ApprovalPolicy::tools(["write_file"]));
    let c = parse(
        "[tools]\nenable_shell = true\nenable_write = true\napproval_default = \"never\"\n\n[tools.approval]\nshell = \"always\"\nread_file = \"always\"\n",
    )
    .unwrap();
    assert_eq!(
        c.approval_policy(),
        ApprovalPolicy::tools(["read_file", "shell"])
    );
    let c = parse("[tools]\nenable_write = true\n\n[tools.approval]\nwrite_file = \"never\"\n")
        .unwrap();
    assert!(c.approval_policy().is_empty());
    assert_eq!(
        c.session_manager_config().approval_timeout,
        std::time::Duration::from_secs(86400)
    );
    assert_eq!(
        c.session_manager_config().supersede_reason,
        "superseded by new input"
    );
    let c = parse(
        "[tools]
approval_supersede_reason = \"the user moved on\"\n",
    )
    .unwrap();
    assert_eq!(
        c.session_manager_config().supersede_reason,
        "the user moved on"
    );
}

#[test]
fn a_blank_or_long_supersede_reason_is_a_located_error() {
    let err = parse("[tools]\napproval_supersede_reason = \"  \"\n").unwrap_err();
    insta::assert_snapshot!("supersede_reason_blank", err.to_string());
    let long = "x".repeat(501);
    let err = parse(&format!(
        "[tools]\napproval_supersede_reason = \"{long}\"\n"
    ))
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("tools.approval_supersede_reason: is 501 bytes, above the hard cap 500"),
        "{err}"
    );
}

#[test]
fn an_approval_for_an_unknown_tool_or_mode_is_a_located_error() {
    let err = parse("[tools.approval]\nbash = \"always\"\n").unwrap_err();
    insta::assert_snapshot!("approval_unknown_tool", err.to_string());
    let err = parse("[tools.approval]\nshell = \"sometimes\"\n").unwrap_err();
    insta::assert_snapshot!("approval_unknown_mode", err.to_string());
    let err = parse("[tools]\napproval_timeout_secs = 0\n").unwrap_err();
    assert!(
        err.to_string().contains("tools.approval_timeout_secs"),
        "{err}"
    );
}

#[test]
fn a_full_example_file_parses() {
    let c = parse(EXAMPLE_TOML).unwrap();
    assert_eq!(c.default_profile.as_deref(), Some("main"));
    assert_eq!(c.root_delegates, ["researcher", "reviewer"]);
    assert_eq!(c.providers.len(), 2);
    assert_eq!(c.providers["main"].kind, ProviderKind::OpenAi);
    assert_eq!(c.providers["offline"].kind, ProviderKind::Scripted);
    // Every section of the example shows the defaults, but for the
    // connection bound, derived from the open-file limit when unset, the
    // PostgreSQL database (SQLite by default) and its pool's size (derived
    // from the CPUs when unset), and
    // `[tools.approval]`, which spells out what the default gates, and
    // the cost budgets, unset by default.
    let d = Config::default();
    assert_eq!(c.server.max_connections, Some(768));
    let server = keel_gateway::config::ServerConfig {
        max_connections: None,
        ..c.server.clone()
    };
    assert_eq!(c.tools.approval.len(), 2);
    let tools = keel_gateway::config::ToolsConfig {
        approval: Default::default(),
        ..c.tools.clone()
    };
    let usd = |v: f64| keel_core::Usd::new(v).unwrap();
    assert_eq!(c.session.max_cost_usd_per_dialog, Some(usd(5.0)));
    assert_eq!(c.orchestration.max_cost_usd_per_root_turn, Some(usd(1.0)));
    assert_eq!(
        c.profile_prices("default").unwrap().input_per_mtok,
        usd(0.15)
    );
    let session = keel_gateway::config::SessionConfig {
        max_cost_usd_per_dialog: None,
        ..c.session.clone()
    };
    let orchestration = keel_gateway::config::OrchestrationConfig {
        max_cost_usd_per_root_turn: None,
        ..c.orchestration.clone()
    };
    assert_eq!(
        c.storage.url.as_deref(),
        Some("postgres://keel@db.internal/keel?sslmode=require")
    );
    assert_eq!(c.storage.max_connections, Some(16));
    let storage = keel_gateway::config::StorageConfig {
        url: None,
        max_connections: None,
        ..c.storage.clone()
    };
    assert_eq!(
        (&session, &storage, &tools, &orchestration, &server),
        (
            &d.session,
            &d.storage,
            &d.tools,
            &d.orchestration,
            &d.server
        )
    );
    assert_eq!(c.offline_notice(), None);
    let (name, profile) = c.resolve_profile("default").unwrap();
    assert_eq!((name, profile.model.as_str()), ("main", "gpt-4o-mini"));
}

#[test]
fn a_cost_budget_over_an_unpriced_profile_refuses_to_load_naming_the_key() {
    let unpriced = "[providers.a]\nkind = \"scripted\"\n\
        [providers.b]\nkind = \"scripted\"\nprice_input_per_mtok = 1\nprice_output_per_mtok = 2\n";
    insta::assert_snapshot!(errors(&[
        &format!("default_profile = \"b\"\n{unpriced}[session]\nmax_cost_usd_per_dialog = 2.5\n"),
        &format!("default_profile = \"b\"\n{unpriced}[orchestration]\nmax_cost_usd_per_root_turn = 0.0\n"),
        "[session]\nmax_cost_usd_per_dialog = 1\n",
        "[session]\nmax_cost_usd_per_dialog = -1\n",
        "[providers.p]\nkind = \"scripted\"\nprice_input_per_mtok = nan\nprice_output_per_mtok = 1\n",
        "[providers.p]\nkind = \"scripted\"\nprice_output_per_mtok = 1\n",
    ]));
    // Priced everywhere, both budgets load and reach the session manager.
    let ok = parse(
        "[providers.p]\nkind = \"scripted\"\nprice_input_per_mtok = 1\nprice_output_per_mtok = 2\n\
         [session]\nmax_cost_usd_per_dialog = 2\n[orchestration]\nmax_cost_usd_per_root_turn = 0.5\n",
    )
    .unwrap();
    let engine = ok.session_manager_config();
    assert_eq!(engine.max_cost_usd_per_dialog.map(|u| u.get()), Some(2.0));
    assert_eq!(
        engine.max_cost_usd_per_root_turn.map(|u| u.get()),
        Some(0.5)
    );
    let inputs = ok.catalog_inputs(
        std::sync::Arc::new(keel_core::ToolRegistry::new()),
        keel_catalog::SkillSet::empty(),
    );
    assert!(inputs.priced_profiles.contains("p") && inputs.priced_profiles.contains("default"));
}

#[test]
fn unknown_key_names_the_file_line_and_key() {
    insta::assert_snapshot!(errors(&[
        "[session]\nttl_hours = 2\nttl_hour = 3\n",
        "bind = \"0.0.0.0:1\"\n",
        "[sessions]\nttl_hours = 1\n",
        "[providers.main]\nkind = \"openai\"\nmodel = \"m\"\napi_key = \"sk\"\n",
        "session.summary = { enabled = true, ratio = 0.5 }\n",
    ]));
}

#[test]
fn mcp_servers_are_checked_strictly_with_located_errors() {
    insta::assert_snapshot!(errors(&[
        "[mcp.files]\ncommand = \"srv\"\nenvs = [\"A\"]\n",
        "[mcp.files]\nargs = [\"x\"]\n",
        "[mcp.files]\ncommand = \"srv\"\nurl = \"http://127.0.0.1:1/mcp\"\n",
        "[mcp.web]\nurl = \"ftp://host/mcp\"\nargs = [\"x\"]\ncwd = \".\"\n",
        "[mcp.web]\nurl = \"http://127.0.0.1:1/mcp\"\nheaders_env = { Authorization = \"UNSET_TOKEN\", \"Bad Header\" = \"DOCS_TOKEN\" }\n",
        "[mcp.files]\ncommand = \"srv\"\nheaders_env = { X = \"DOCS_TOKEN\" }\nenv = [\"OPENAI_API_KEY\", \"A=B\"]\n",
        "[mcp.\"Files.One\"]\ncommand = \"srv\"\n",
        "[mcp.files]\ncommand = \"srv\"\ntimeout_secs = 0\nmax_output_bytes = 100000000\ntools = [\"\"]\n",
        "[mcp.files]\ncommand = \"srv\"\ndelegatable = \"yes\"\n",
    ]));
}

#[test]
fn wrong_type_names_the_file_line_and_key() {
    insta::assert_snapshot!(errors(&[
        "[orchestration]\nmax_concurrent_runs = \"four\"\n",
        "[storage]\nsynchronous = \"fast\"\n",
        "[storage]\nretry_delays_ms = [\n  100,\n  -1,\n]\n",
        "[server]\nbind = \"localhost\"\n",
        "session = 5\n",
        "[providers.main]\nkind = \"gemini\"\n",
        "[providers.main]\nmodel = \"m\"\n",
        "[session]\nttl_hours = 2024-01-01\n",
    ]));
}

#[test]
fn syntax_errors_name_the_file_and_line() {
    insta::assert_snapshot!(errors(&[
        "[session\nttl_hours = 1\n",
        "[session]\nttl_hours = 1\nttl_hours = 2\n",
        "default_profile = \"unterminated\n",
    ]));
}

#[test]
fn zero_capacity_is_an_error() {
    insta::assert_snapshot!(errors(&[
        "[orchestration]\nmax_concurrent_tool_steps = 0\n",
        "[orchestration]\nmax_pending_inbox_events_per_session = 0\n",
    ]));
}

#[test]
fn per_session_limit_above_global_is_an_error() {
    let text = "[orchestration]\nmax_concurrent_runs = 4\nmax_concurrent_runs_per_session = 8\n";
    assert_eq!(
        error(text),
        "keel.toml:3: orchestration.max_concurrent_runs_per_session: 8 is above \
         orchestration.max_concurrent_runs (4)"
    );
    // Lowering only the global default below a per-session default is caught too.
    insta::assert_snapshot!(errors(&[
        text,
        "[orchestration]\nmax_concurrent_tool_steps = 2\n",
    ]));
}

#[test]
fn timeouts_over_their_hard_cap_are_errors() {
    insta::assert_snapshot!(errors(&[
        "[tools]\nshell_timeout_secs = 7200\n[orchestration]\ndefault_run_timeout_secs = 100000\ninbox_event_ttl_hours = 10000\n",
        "[providers.main]\nkind = \"openai\"\nmodel = \"m\"\nread_timeout_secs = 86400\n",
        "[providers.main]\nkind = \"openai\"\nmodel = \"m\"\ntotal_timeout_secs = 86400\n",
        "[providers.main]\nkind = \"openai\"\nmodel = \"m\"\nmax_response_bytes = 0\n",
        "root_max_output_tokens = 0\n",
    ]));
}

#[test]
fn shell_env_never_passes_keels_own_keys() {
    let text = "server.token_env = \"ADMIN\"\n\
        [tools]\nshell_env = [\"CARGO_HOME\", \"OPENAI_API_KEY\", \"ANTHROPIC_API_KEY\", \"ADMIN\", \"A=B\", \"MY_KEY\"]\n\
        [providers.main]\nkind = \"openai\"\nmodel = \"m\"\nbase_url = \"http://127.0.0.1:1/v1\"\napi_key_env = \"MY_KEY\"\n";
    let err = Config::from_toml_str_with_env(text, "keel.toml", &env(&[("MY_KEY", "k")]))
        .unwrap_err()
        .to_string();
    insta::assert_snapshot!(err, @r#"
    keel.toml:3: tools.shell_env[1]: OPENAI_API_KEY holds a key keel uses; shell commands (and so the model) would read it
    keel.toml:3: tools.shell_env[2]: ANTHROPIC_API_KEY holds a key keel uses; shell commands (and so the model) would read it
    keel.toml:3: tools.shell_env[3]: ADMIN holds a key keel uses; shell commands (and so the model) would read it
    keel.toml:3: tools.shell_env[4]: "A=B" is not an environment variable name
    keel.toml:3: tools.shell_env[5]: MY_KEY holds a key keel uses; shell commands (and so the model) would read it
    "#);
}

#[test]
fn allowed_origins_are_bare_http_origins() {
    let text = "[server]\nallowed_origins = [\n  \"https://keel.example.com\",\n  \"https://keel.example.com/app\",\n]\n";
    insta::assert_snapshot!(error(text), @r#"keel.toml:2:19: server.allowed_origins: "https://keel.example.com/app" is not an origin (only a host and a port may follow the scheme); write scheme://host[:port], as https://keel.example.com"#);
    let ok = parse("[server]\nallowed_origins = [\"https://Keel.Example.com:8443\"]\n").unwrap();
    let read: Vec<String> = ok
        .server
        .allowed_origins
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(read, ["https://keel.example.com:8443"]);
}

#[test]
fn serve_reads_every_server_key_and_its_flag_wins() {
    let loaded = |text: &str| LoadedConfig {
        config: parse(text).unwrap(),
        source: None,
    };
    let c = loaded(
        "[server]\nbind = \"127.0.0.1:7500\"\ntoken_env = \"MY_TOKEN\"\nshutdown_grace_secs = 7\n\
         allowed_origins = [\"https://keel.example.com\"]\n",
    );
    let tokens = env(&[("MY_TOKEN", "t0k"), ("KEEL_TOKEN", "other")]);
    let o = ServeOptions::from_config(&c, None, &tokens).unwrap();
    assert_eq!(o.bind.to_string(), "127.0.0.1:7500");
    assert!(o.token.as_ref().unwrap().matches("t0k"));
    assert_eq!(o.shutdown_grace, Duration::from_secs(7));
    assert_eq!(o.allowed_origins, c.config.server.allowed_origins);
    assert_eq!(o.allowed_origins.len(), 1);
    let flag = ServeOptions::from_config(&c, Some("127.0.0.1:0".parse().unwrap()), &env(NO_ENV));
    let flag = flag.unwrap();
    assert_eq!(flag.bind.to_string(), "127.0.0.1:0");
    assert!(flag.token.is_none());

    // An exposed address needs a token, whichever way it was chosen.
    let exposed = loaded("[server]\nbind = \"0.0.0.0:7420\"\n");
    let refusals: Vec<String> = [None, Some("[::]:7420".parse().unwrap())]
        .into_iter()
        .map(|bind| {
            ServeOptions::from_config(&exposed, bind, &env(NO_ENV))
                .unwrap_err()
                .to_string()
        })
        .collect();
    insta::assert_snapshot!(refusals.join("\n"), @"
    keel.toml (defaults): server.bind: 0.0.0.0:7420 is not a loopback address and no token is set: anyone who can reach it could use the API. Set the environment variable KEEL_TOKEN (server.token_env) to a secret, or bind 127.0.0.1
    keel.toml (defaults): --bind: [::]:7420 is not a loopback address and no token is set: anyone who can reach it could use the API. Set the environment variable KEEL_TOKEN (server.token_env) to a secret, or bind 127.0.0.1
    ");
    let with_token = ServeOptions::from_config(&exposed, None, &env(&[("KEEL_TOKEN", "t")]));
    assert_eq!(with_token.unwrap().bind.to_string(), "0.0.0.0:7420");
}

#[test]
fn missing_env_var_for_a_key_is_an_error() {
    let text = "[providers.main]\nkind = \"anthropic\"\nmodel = \"claude\"\n\n[providers.local]\nkind = \"openai\"\nmodel = \"llama3\"\nbase_url = \"http://127.0.0.1:11434/v1\"\napi_key_env = \"LOCAL_KEY\"\n";
    let err = Config::from_toml_str_with_env(text, "keel.toml", &env(NO_ENV))
        .unwrap_err()
        .to_string();
    insta::assert_snapshot!(err);
    // With the variables set it loads.
    Config::from_toml_str_with_env(
        &format!("default_profile = \"main\"\n{text}"),
        "keel.toml",
        &env(&[("ANTHROPIC_API_KEY", "sk-a"), ("LOCAL_KEY", "k")]),
    )
    .unwrap();
}

#[test]
fn several_errors_are_collected_at_once() {
    let text = r#"default_profile = "nope"
root_delegates = ["Researcher", "ok", "ok"]

[providers.main]
kind = "openai"
model = ""

[providers."my model"]
kind = "scripted"

[session]
ttl_hours = 0
cleanup_interval_minutes = 99999
turn_timeout_secs = 0

[session.summary]
trigger_ratio = 1.5

[storage]
retry_delays_ms = []
busy_timeout_ms = 999999

[orchestration]
max_tree_depth = 0
max_runs_per_tree = 0
max_concurrent_runs = 2
max_concurrent_runs_per_session = 3
max_concurrent_provider_steps_per_session = 9
max_inbox_delivery_attempts = 0
max_children_per_call = 65

[server]
token_env = ""
"#;
    let err = parse(text).unwrap_err();
    assert!(err.problems().len() >= 12, "{err}");
    insta::assert_snapshot!(err.to_string());
    let delays = error("[storage]\nretry_delays_ms = [100, 20000, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n");
    insta::assert_snapshot!("retry_delays", delays);
}

#[test]
fn no_provider_means_an_offline_default() {
    let c = Config::default();
    assert_eq!(c.offline_notice(), Some(OFFLINE_NOTICE));
    assert_eq!(
        OFFLINE_NOTICE,
        "keel: no provider configured — using the built-in offline model (replies are canned). \
         Add [providers.NAME] to keel.toml to use a real LLM (see docs/CONFIG.md)."
    );
    let (name, profile) = c.resolve_profile("default").unwrap();
    assert_eq!(name, "default");
    assert_eq!(profile.kind, ProviderKind::Scripted);
    assert_eq!(profile.script, None);
    assert_eq!(c.profile_names(), ["default"]);
    assert_eq!(
        c.profiles().keys().collect::<Vec<_>>(),
        [&"default".to_owned()]
    );
    assert!(c.resolve_profile("main").is_none());
    let provider = c.build_provider_with_env("default", &env(NO_ENV)).unwrap();
    assert_eq!(provider.name(), "scripted");
    // `default_profile = "default"` is harmless; any other name is not.
    parse("default_profile = \"default\"\n").unwrap();
    insta::assert_snapshot!(error("default_profile = \"main\"\n"));
}

#[test]
fn one_profile_is_the_default() {
    let c = parse("[providers.main]\nkind = \"openai\"\nmodel = \"gpt\"\n").unwrap();
    assert_eq!(c.offline_notice(), None);
    let (name, profile) = c.resolve_profile("default").unwrap();
    assert_eq!((name, profile.model.as_str()), ("main", "gpt"));
    assert_eq!(c.resolve_profile("main").unwrap().0, "main");
    assert_eq!(c.profile_names(), ["default", "main"]);
    let unknown = c
        .build_provider_with_env("fast", &env(OPENAI))
        .err()
        .unwrap();
    insta::assert_snapshot!(unknown.to_string());
}

#[test]
fn several_profiles_need_default_profile() {
    let two = "[providers.a]\nkind = \"scripted\"\n\n[providers.b]\nkind = \"scripted\"\n";
    let missing = error(two);
    let chosen = parse(&format!("default_profile = \"b\"\n{two}")).unwrap();
    assert_eq!(chosen.resolve_profile("default").unwrap().0, "b");
    // A profile literally named `default` is the default.
    let named =
        parse("[providers.default]\nkind = \"scripted\"\n[providers.b]\nkind = \"scripted\"\n")
            .unwrap();
    assert_eq!(named.resolve_profile("default").unwrap().0, "default");
    let unknown = error(&format!("default_profile = \"c\"\n{two}"));
    let clash = error("default_profile = \"b\"\n[providers.default]\nkind = \"scripted\"\n[providers.b]\nkind = \"scripted\"\n");
    insta::assert_snapshot!(format!("{missing}\n{unknown}\n{clash}"));
}

#[test]
fn missing_config_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.toml");
    let err = Config::load_with_env(Some(&path), None, &env(NO_ENV)).unwrap_err();
    assert!(matches!(err, ConfigError::NotFound { .. }));
    assert_eq!(
        err.to_string(),
        format!(
            "{}: config file not found (given with --config)",
            path.display()
        )
    );
}

/// A keel.toml that is a directory, a FIFO or a dangling symbolic link is
/// an error naming it, whether looked up in the data directory or given
/// with --config: never "no file, defaults used" (nor, for a FIFO, a wait
/// for a writer that never comes).
#[cfg(unix)]
#[test]
fn a_config_path_that_is_not_a_file_is_an_error_naming_it() {
    let mut shown = Vec::new();
    for kind in ["directory", "fifo", "dangling symlink"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.toml");
        match kind {
            "directory" => std::fs::create_dir(&path).unwrap(),
            "fifo" => assert!(std::process::Command::new("mkfifo")
                .arg(&path)
                .status()
                .unwrap()
                .success()),
            _ => std::os::unix::fs::symlink(dir.path().join("gone.toml"), &path).unwrap(),
        }
        for explicit in [None, Some(path.as_path())] {
            let err = Config::load_with_env(explicit, Some(dir.path()), &env(NO_ENV)).unwrap_err();
            assert!(matches!(err, ConfigError::NotAFile { .. }), "{kind}: {err}");
            let text = err.to_string();
            assert!(text.starts_with(&path.display().to_string()), "{text}");
            if explicit.is_none() {
                shown.push(text.replace(&dir.path().display().to_string(), "[DIR]"));
            }
        }
    }
    insta::assert_snapshot!(shown.join("\n"), @r"
    [DIR]/keel.toml: not a config file keel can read: it is a directory
    [DIR]/keel.toml: not a config file keel can read: it is a FIFO (named pipe)
    [DIR]/keel.toml: not a config file keel can read: it is a symbolic link to [DIR]/gone.toml, which does not exist
    ");
}

#[test]
fn errors_from_a_loaded_file_name_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("custom.toml");
    std::fs::write(
        &path,
        "agents_dir = \"missing\"\n[orchestration]\nmax_tree_depth = 9\n",
    )
    .unwrap();
    let err = Config::load_with_env(Some(&path), None, &env(NO_ENV))
        .unwrap_err()
        .to_string();
    let shown = err.replace(&dir.path().display().to_string(), "[DIR]");
    insta::assert_snapshot!(shown);
}

#[test]
fn conversions_carry_the_settings() {
    let c = parse(
        "workspace_root = \"/srv/w\"\n\
         [session]\nttl_hours = 2\ncleanup_interval_minutes = 5\nauto_title_after_n_messages = 0\nauto_checkpoint = false\nturn_timeout_secs = 42\n\
         [session.summary]\nenabled = true\ntrigger_ratio = 0.5\n\
         [storage]\nsynchronous = \"full\"\nretry_delays_ms = [5]\nbusy_timeout_ms = 10\n\
         [tools]\nenable_write = true\nenable_shell = true\nshell_timeout_secs = 9\n\
         shell_env = [\"CARGO_HOME\"]\nshell_read_paths = [\"/usr\"]\nshell_network = true\n",
    )
    .unwrap();
    let store = c.store_options();
    assert_eq!(store.synchronous, keel_store::Synchronous::Full);
    assert_eq!(store.retry_delays, [Duration::from_millis(5)]);
    assert_eq!(store.busy_timeout, Duration::from_millis(10));
    assert_eq!(
        store.readers,
        keel_store::StoreOptions::default().readers,
        "unconfigured store options keep their defaults"
    );
    let manager = c.session_manager_config();
    assert_eq!(manager.idle_ttl, Duration::from_secs(7200));
    assert_eq!(manager.auto_title_after, 0);
    assert!(!manager.auto_checkpoint);
    assert_eq!(manager.turn_timeout, Some(Duration::from_secs(42)));
    let summary = manager.summary.unwrap();
    assert_eq!((summary.trigger_ratio, summary.debounce_turns), (0.5, 3));
    assert_eq!(c.cleanup_interval(), Duration::from_secs(300));
    let (tools, notice) = c.builtin_tools(vec![PathBuf::from("/srv/data")]);
    assert_eq!(tools.workspace_root, PathBuf::from("/srv/w"));
    assert_eq!(tools.protected_paths, [PathBuf::from("/srv/data")]);
    assert!(tools.enable_write && tools.enable_shell);
    assert_eq!(tools.shell.timeout, Duration::from_secs(9));
    assert_eq!(tools.shell.env, ["CARGO_HOME"]);
    match tools.shell.confinement {
        keel_engine::ShellConfinement::Landlock(policy) => {
            assert_eq!(policy.read_paths, [PathBuf::from("/usr")]);
            assert!(policy.network);
            assert_eq!(notice, None);
        }
        // A kernel without Landlock: refused, and said so.
        other => assert!(notice.is_some(), "{other:?}"),
    }
    assert!(Config::default().session_manager_config().summary.is_some());
    let o = parse(
        "[orchestration]\nmax_tree_depth = 5\nmax_runs_per_tree = 7\nmax_concurrent_runs = 6\n\
         max_concurrent_runs_per_session = 2\nmax_concurrent_provider_steps = 5\n\
         max_concurrent_tool_steps_per_session = 1\nmax_children_per_call = 4\n\
         max_pending_inbox_events_per_session = 9\n",
    )
    .unwrap();
    let gate = o.gate_limits();
    assert_eq!(
        (
            gate.max_concurrent_runs,
            gate.max_concurrent_runs_per_session,
            gate.max_concurrent_provider_steps,
            gate.max_concurrent_tool_steps_per_session
        ),
        (6, 2, 5, 1)
    );
    assert!(gate.max_concurrent_provider_steps_per_agent.is_empty());
    let coordinator = o.coordinator_config();
    assert_eq!(
        (
            coordinator.max_tree_depth,
            coordinator.max_runs_per_tree,
            coordinator.max_children_per_call,
            coordinator.max_pending_inbox_events_per_session
        ),
        (5, 7, 4, 9)
    );
    // The defaults are the engine's own.
    assert_eq!(
        Config::default().gate_limits(),
        keel_engine::GateLimits::default()
    );
    assert_eq!(
        Config::default().coordinator_config(),
        keel_engine::CoordinatorConfig::default()
    );
}

#[test]
fn every_key_is_documented_and_every_documented_key_exists() {
    let documented: BTreeSet<String> = reference().into_iter().map(|d| d.key).collect();
    let defaults = flatten_keys(&Config::default());
    let undocumented: Vec<&String> = defaults
        .keys()
        .filter(|k| !documented.contains(*k))
        .collect();
    assert!(
        undocumented.is_empty(),
        "add these keys to config/reference.rs: {undocumented:?}"
    );
    // The example sets every key, so it lists every key there is.
    let example: BTreeSet<String> = flatten_keys(&parse(EXAMPLE_TOML).unwrap())
        .into_keys()
        .collect();
    assert_eq!(
        documented, example,
        "reference() and EXAMPLE_TOML must list the same keys"
    );
    for doc in reference() {
        if let Some(value) = defaults.get(&doc.key) {
            assert_eq!(doc.default, format!("`{value}`"), "{}", doc.key);
        }
        assert!(
            !doc.doc.is_empty() && !doc.default.is_empty(),
            "{}",
            doc.key
        );
    }
}

const BEGIN: &str = "<!-- BEGIN GENERATED: keel.toml reference -->\n";
const END: &str = "<!-- END GENERATED -->";

#[test]
fn config_doc_contains_the_generated_reference() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/CONFIG.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let generated = render_generated_docs();
    let (Some(start), Some(end)) = (doc.find(BEGIN), doc.find(END)) else {
        panic!("{} lacks the markers {BEGIN:?} … {END:?}", path.display());
    };
    let current = &doc[start + BEGIN.len()..end];
    if current == generated {
        return;
    }
    if std::env::var_os("UPDATE_CONFIG_DOC").is_some() {
        let updated = format!("{}{generated}{}", &doc[..start + BEGIN.len()], &doc[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    panic!(
        "docs/CONFIG.md is out of date with crates/gateway/src/config; regenerate it with\n    \
         UPDATE_CONFIG_DOC=1 cargo test -p keel-gateway --test it config"
    );
}

/// `root_max_output_tokens` reaches the root agent the binary runs: every
/// model call of a root turn carries an output cap, its default when unset.
#[tokio::test]
async fn the_root_agent_runs_with_the_configured_output_cap() {
    for (file, expected) in [("", 4096), ("root_max_output_tokens = 512\n", 512)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.toml");
        std::fs::write(&path, file).unwrap();
        let app = keel_gateway::app::App::open("test", Some(&path), Some(dir.path()), None)
            .await
            .unwrap();
        let id = app
            .manager
            .create_dialog("test", "chat", None, None)
            .await
            .unwrap();
        let session = app.manager.session(id).await.unwrap();
        let cap = session.lock().await.agent().max_output_tokens;
        assert_eq!(cap, Some(expected), "{file:?}");
    }
}

/// `<data_dir>/skills` reaches the root agent: its system prompt lists every
/// skill and it has `get_skill`; a broken skill file stops start-up naming it.
#[tokio::test]
async fn skills_in_the_data_dir_reach_the_root_agent() {
    let dir = tempfile::tempdir().unwrap();
    let skills = dir.path().join("skills");
    std::fs::create_dir(&skills).unwrap();
    std::fs::write(
        skills.join("review.md"),
        "---\nname: review\ndescription: How to review a change.\n---\nRead it twice.\n",
    )
    .unwrap();
    let app = keel_gateway::app::App::open("test", None, Some(dir.path()), None)
        .await
        .unwrap();
    let id = app
        .manager
        .create_dialog("test", "chat", None, None)
        .await
        .unwrap();
    let session = app.manager.session(id).await.unwrap();
    let guard = session.lock().await;
    let agent = guard.agent();
    assert!(
        agent.system_prompt.ends_with(
            "get_skill tool when a task calls for them:\n- review: How to review a change."
        ),
        "{}",
        agent.system_prompt
    );
    assert!(agent.tools.get("get_skill").is_some());
    drop(guard);
    drop(app);

    std::fs::write(skills.join("bad.md"), "---\nname: x\n---\nbody\n").unwrap();
    let err = keel_gateway::app::App::open("test", None, Some(dir.path()), None)
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("skills/bad.md: description: required key is missing"),
        "{err}"
    );
}
