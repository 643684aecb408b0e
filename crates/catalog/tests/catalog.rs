//! Integration tests of keel-catalog: one snapshot per rejection kind, the
//! loader on real files in tempdirs, resolution, hashing, cycles and reload.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use keel_catalog::*;
use keel_core::{
    AgentId, DelegationPolicy, Delivery, Tool, ToolError, ToolExecutionContext, ToolOutput,
    ToolRegistry,
};

struct FakeTool(&'static str, DelegationPolicy);

#[async_trait]
impl Tool for FakeTool {
    fn name(&self) -> &str {
        self.0
    }
    fn description(&self) -> &str {
        "fake"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({"type": "object"})
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        self.1
    }
    async fn execute(
        &self,
        _args: serde_json::Value,
        _ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text(self.0))
    }
}

fn registry() -> Arc<ToolRegistry> {
    let mut r = ToolRegistry::new();
    for (name, policy) in [
        ("read_file", DelegationPolicy::Delegatable),
        ("search_text", DelegationPolicy::Delegatable),
        ("shell", DelegationPolicy::RootOnly),
        ("write_file", DelegationPolicy::RootOnly),
        ("delegate", DelegationPolicy::RuntimeInjected),
    ] {
        r.register(Arc::new(FakeTool(name, policy))).unwrap();
    }
    Arc::new(r)
}

fn inputs(root_delegates: &[&str]) -> CatalogInputs {
    let mut i = CatalogInputs::new(["default", "fast"], registry());
    i.skills = BTreeSet::from(["git".to_owned(), "rust".to_owned()]);
    i.root_delegates = root_delegates
        .iter()
        .map(|s| AgentId::parse(s).unwrap())
        .collect();
    i
}

fn agent(id: &str, extra: &str) -> String {
    format!("---\nid: {id}\ndescription: The {id} agent.\nllm_profile: default\n{extra}---\nYou are {id}.\n")
}

fn render(diags: &[Diagnostic]) -> String {
    diags.iter().map(|d| format!("{d}\n")).collect()
}

fn parse_err(text: &str) -> Vec<Diagnostic> {
    parse_definition(Path::new("agent.md"), text).expect_err("should be rejected")
}

// ── Parser: one snapshot per rejection kind ──────────────────────────────

const H: &str = "id: a\ndescription: d\nllm_profile: default\n";

#[test]
fn every_parse_rejection_kind_has_an_actionable_message() {
    use DiagnosticKind as K;
    let big_frontmatter = format!(
        "---\n{H}# {}\n---\nbody\n",
        "x".repeat(MAX_FRONTMATTER_BYTES)
    );
    let many_tools: String = (0..65).map(|i| format!("t{i},")).collect();
    let cases: Vec<(&str, K, String)> = vec![
        (
            "missing_frontmatter",
            K::MissingFrontmatter,
            "id: a\n---\nbody\n".into(),
        ),
        (
            "bom",
            K::MissingFrontmatter,
            format!("\u{feff}---\n{H}---\nbody\n"),
        ),
        (
            "unclosed_frontmatter",
            K::UnclosedFrontmatter,
            format!("---\n{H}body\n"),
        ),
        (
            "frontmatter_too_large",
            K::FrontmatterTooLarge,
            big_frontmatter,
        ),
        (
            "tab_indentation",
            K::TabIndentation,
            format!("---\n{H}limits:\n\tmax_iterations: 3\n---\nbody\n"),
        ),
        (
            "tab_after_spaces",
            K::TabIndentation,
            format!("---\n{H}limits:\n  \t max_iterations: 3\n---\nbody\n"),
        ),
        (
            "bare_carriage_return",
            K::LineBreak,
            format!("---\n{H}tools: [a]\rdelegates: [b]\n---\nbody\n"),
        ),
        (
            "unicode_line_separator",
            K::LineBreak,
            format!("---\n{H}tools: [a]\u{2028}delegates: [b]\n---\nbody\n"),
        ),
        (
            "document_marker",
            K::MultipleDocuments,
            format!("---\n{H}--- # second\nid: b\n---\nbody\n"),
        ),
        (
            "document_end_marker",
            K::MultipleDocuments,
            format!("---\n{H}...\n---\nbody\n"),
        ),
        (
            "yaml_syntax",
            K::YamlSyntax,
            format!("---\n{H}tools: [read_file\n---\nbody\n"),
        ),
        (
            "yaml_bad_indentation",
            K::YamlSyntax,
            format!("---\n{H}limits:\n    max_iterations: 3\n  timeout_secs: 5\n---\nbody\n"),
        ),
        (
            "duplicate_key",
            K::DuplicateKey,
            format!("---\n{H}tools: [read_file]\ntools: [shell]\n---\nbody\n"),
        ),
        (
            "duplicate_nested_key",
            K::DuplicateKey,
            format!("---\n{H}limits:\n  max_iterations: 3\n  max_iterations: 200\n---\nbody\n"),
        ),
        (
            "not_a_mapping",
            K::NotAMapping,
            "---\n- id: a\n---\nbody\n".into(),
        ),
        (
            "empty_frontmatter",
            K::NotAMapping,
            "---\n---\nbody\n".into(),
        ),
        (
            "unknown_key_typo",
            K::UnknownKey,
            format!("---\n{H}delgates: [b]\n---\nbody\n"),
        ),
        (
            "unknown_key_misindented",
            K::UnknownKey,
            format!("---\n{H}limits:\n  max_iterations: 3\ntimeout_secs: 5\n---\nbody\n"),
        ),
        (
            "unknown_key_nested",
            K::UnknownKey,
            format!("---\n{H}limits:\n  max_tokens: 100\n---\nbody\n"),
        ),
        (
            "unknown_key_other",
            K::UnknownKey,
            format!("---\n{H}model: gpt\n---\nbody\n"),
        ),
        (
            "non_string_key",
            K::UnknownKey,
            format!("---\n{H}1: x\n---\nbody\n"),
        ),
        (
            "missing_key",
            K::MissingKey,
            "---\nid: a\n---\nbody\n".into(),
        ),
        (
            "wrong_type_int_as_string",
            K::WrongType,
            format!("---\n{H}limits:\n  max_iterations: \"5\"\n---\nbody\n"),
        ),
        (
            "wrong_type_float",
            K::WrongType,
            format!("---\n{H}limits:\n  timeout_secs: 1.5\n---\nbody\n"),
        ),
        (
            "wrong_type_list_as_string",
            K::WrongType,
            format!("---\n{H}tools: read_file\n---\nbody\n"),
        ),
        (
            "wrong_type_no_value",
            K::WrongType,
            format!("---\n{H}signal:\n---\nbody\n"),
        ),
        (
            "wrong_type_id_number",
            K::WrongType,
            "---\nid: 42\ndescription: d\nllm_profile: default\n---\nbody\n".into(),
        ),
        (
            "wrong_type_limits_scalar",
            K::WrongType,
            format!("---\n{H}limits: 5\n---\nbody\n"),
        ),
        (
            "invalid_value_empty_description",
            K::InvalidValue,
            "---\nid: a\ndescription: \"  \"\nllm_profile: default\n---\nbody\n".into(),
        ),
        (
            "invalid_value_whitespace_name",
            K::InvalidValue,
            format!("---\n{H}skills: [\"git \"]\n---\nbody\n"),
        ),
        (
            "invalid_value_delivery",
            K::InvalidValue,
            format!("---\n{H}signal:\n  delivery: now\n---\nbody\n"),
        ),
        (
            "invalid_value_severity",
            K::InvalidValue,
            format!("---\n{H}signal:\n  severities: [info, debug]\n---\nbody\n"),
        ),
        (
            "invalid_value_no_severities",
            K::InvalidValue,
            format!("---\n{H}signal:\n  severities: []\n---\nbody\n"),
        ),
        (
            "out_of_range_zero",
            K::OutOfRange,
            format!("---\n{H}limits:\n  max_iterations: 0\n---\nbody\n"),
        ),
        (
            "out_of_range_over_cap",
            K::OutOfRange,
            format!("---\n{H}limits:\n  timeout_secs: 100000\n---\nbody\n"),
        ),
        (
            "out_of_range_negative",
            K::OutOfRange,
            format!("---\n{H}signal: {{burst: -1}}\n---\nbody\n"),
        ),
        (
            "out_of_range_list",
            K::OutOfRange,
            format!("---\n{H}tools: [{many_tools}]\n---\nbody\n"),
        ),
        (
            "duplicate_entry",
            K::DuplicateEntry,
            format!("---\n{H}tools:\n  - read_file\n  - shell\n  - read_file\n---\nbody\n"),
        ),
        (
            "invalid_agent_id",
            K::InvalidAgentId,
            "---\nid: Researcher\ndescription: d\nllm_profile: default\n---\nbody\n".into(),
        ),
        (
            "invalid_delegate_id",
            K::InvalidAgentId,
            format!("---\n{H}delegates: [b, \"C d\"]\n---\nbody\n"),
        ),
        (
            "reserved_id",
            K::ReservedId,
            "---\nid: root\ndescription: d\nllm_profile: default\n---\nbody\n".into(),
        ),
        ("empty_body", K::EmptyBody, format!("---\n{H}---\n  \n\t\n")),
    ];
    let mut seen = BTreeSet::new();
    for (name, kind, text) in cases {
        let diags = parse_err(&text);
        assert!(
            diags.iter().any(|d| d.kind == kind),
            "{name}: expected {kind:?}, got {diags:#?}"
        );
        for d in &diags {
            assert!(
                !d.to_string().contains('\n'),
                "{name}: one line per diagnostic"
            );
        }
        seen.insert(kind);
        insta::assert_snapshot!(format!("parse_{name}"), render(&diags));
    }
    assert_eq!(seen.len(), 18, "every parser rejection kind is covered");
}

#[test]
fn bytes_entry_rejects_non_utf8_and_oversized_input() {
    let mut bad = format!("---\n{H}---\n").into_bytes();
    bad.extend_from_slice(b"caf\xe9\n");
    let diags = parse_definition_bytes(Path::new("latin1.md"), &bad).unwrap_err();
    assert_eq!(diags[0].kind, DiagnosticKind::NotUtf8);
    let big = vec![b'a'; MAX_DEFINITION_BYTES as usize + 1];
    let diags2 = parse_definition_bytes(Path::new("big.md"), &big).unwrap_err();
    assert_eq!(diags2[0].kind, DiagnosticKind::FileTooLarge);
    insta::assert_snapshot!("parse_bytes", render(&[diags, diags2].concat()));
}

#[test]
fn serde_yaml_rejects_duplicate_keys_with_their_line() {
    let diags = parse_err(&format!("---\n{H}id: b\n---\nbody\n"));
    assert_eq!(diags.len(), 1);
    assert_eq!(diags[0].kind, DiagnosticKind::DuplicateKey);
    assert_eq!(
        diags[0].line,
        Some(5),
        "points at the second `id` in the file"
    );
}

#[test]
fn several_problems_in_one_file_are_all_reported() {
    let text = "---\nid: a\ndescription: d\nllm_profile: default\ntools: [read_file, read_file]\nlimits:\n  max_iterations: 0\n  timeout_secs: 999999\n  max_childs: 2\nsignal:\n  burst: 0\n  severities: [loud]\n---\n\n";
    let diags = parse_err(text);
    let kinds: Vec<_> = diags.iter().map(|d| d.kind).collect();
    assert_eq!(diags.len(), 7, "{kinds:?}");
    insta::assert_snapshot!("parse_many_problems", render(&diags));
}

#[test]
fn a_valid_definition_gets_documented_defaults() {
    let def = parse_definition(
        Path::new("x.md"),
        "---\nid: x\ndescription: X.\nllm_profile: default\nsignal: {}\n---\n\nDo x.\n",
    )
    .unwrap();
    assert_eq!(def.limits, AgentLimits::DEFAULT);
    assert_eq!(def.limits.max_iterations, 16);
    assert_eq!(def.limits.timeout_secs, 600);
    assert_eq!(def.limits.max_output_tokens, 4096);
    assert_eq!(def.limits.max_children, 4);
    let signal = def.signal.unwrap();
    assert_eq!(signal, SignalContract::default());
    assert_eq!(signal.delivery, Delivery::Queue);
    assert!(signal.allows(Severity::Error));
    assert_eq!(def.body, "Do x.");
    assert!(def.tools.is_empty() && def.delegates.is_empty() && def.skills.is_empty());
    assert_eq!(def.definition_hash.len(), 64);
    assert_eq!(def.source_file, Path::new("x.md"));

    let no_signal = parse_definition(Path::new("y.md"), &agent("y", "")).unwrap();
    assert_eq!(
        no_signal.signal, None,
        "no contract unless the key is written"
    );
}

#[test]
fn a_full_definition_parses_every_field() {
    let text = "---\nid: scout\ndescription: Scouts.\nllm_profile: fast\ntools:\n- read_file\n- search_text\ndelegates: [helper]\nskills: [git]\nlimits:\n  max_iterations: 256\n  timeout_secs: 1\n  max_output_tokens: 131072\n  max_children: 64\nsignal:\n  delivery: steer\n  max_signals: 1000\n  max_summary_bytes: 4096\n  max_details_bytes: 0\n  min_interval_ms: 0\n  burst: 100\n  severities: [warning, error]\n  dedupe_window_secs: 0\n  max_json_depth: 32\n---\nScout.\n";
    let def = parse_definition(Path::new("scout.md"), text).unwrap();
    assert_eq!(def.tools, ["read_file", "search_text"]);
    assert_eq!(def.delegates, [AgentId::parse("helper").unwrap()]);
    assert_eq!(def.limits.max_children, 64);
    let s = def.signal.unwrap();
    assert_eq!(s.delivery, Delivery::Steer);
    assert_eq!(s.severities, [Severity::Warning, Severity::Error]);
    assert!(!s.allows(Severity::Info));
    assert_eq!((s.max_details_bytes, s.max_json_depth), (0, 32));
}

// ── definition_hash ──────────────────────────────────────────────────────

fn hash(text: &str) -> String {
    parse_definition(Path::new("h.md"), text)
        .unwrap()
        .definition_hash
}

#[test]
fn hash_is_stable_across_formatting() {
    let base = hash("---\nid: a\ndescription: Does a.\nllm_profile: default\ntools: [read_file, shell]\nlimits:\n  max_iterations: 3\n---\nBe a.\n");
    let same = [
        // key order, comments, quoting, flow vs block, trailing whitespace
        "---\nlimits: {max_iterations: 3}\n# a comment\ntools:\n  - read_file\n  - \"shell\"\nllm_profile: 'default'   \ndescription: Does a.  \nid: a\n---\nBe a.\n",
        // CRLF line endings, blank lines around the body
        "---\r\nid: a\r\ndescription: Does a.\r\nllm_profile: default\r\ntools: [read_file, shell]\r\nlimits:\r\n  max_iterations: 3\r\n---\r\n\r\nBe a.\r\n\r\n",
        // explicitly written defaults mean the same thing
        "---\nid: a\ndescription: Does a.\nllm_profile: default\ntools: [read_file, shell]\ndelegates: []\nskills: []\nlimits:\n  max_iterations: 3\n  timeout_secs: 600\n  max_output_tokens: 4096\n  max_children: 4\n---\nBe a.\n",
    ];
    for (i, text) in same.iter().enumerate() {
        assert_eq!(hash(text), base, "variant {i} must hash the same");
    }
}

#[test]
fn hash_changes_with_any_semantic_change() {
    let base_text = "---\nid: a\ndescription: Does a.\nllm_profile: default\ntools: [read_file, shell]\nlimits:\n  max_iterations: 3\n---\nBe a.\n";
    let base = hash(base_text);
    let changes = [
        ("id: a", "id: b"),
        ("Does a.", "Does b."),
        ("llm_profile: default", "llm_profile: fast"),
        ("[read_file, shell]", "[read_file]"),
        ("[read_file, shell]", "[shell, read_file]"),
        ("max_iterations: 3", "max_iterations: 4"),
        ("limits:", "delegates: [b]\nlimits:"),
        ("limits:", "skills: [git]\nlimits:"),
        ("limits:", "signal: {}\nlimits:"),
        ("Be a.", "Be a!"),
        ("Be a.", "Be a.\n\nAnd more."),
    ];
    let mut all = BTreeSet::from([base.clone()]);
    for (from, to) in changes {
        let changed = hash(&base_text.replacen(from, to, 1));
        assert_ne!(changed, base, "{from:?} -> {to:?} must change the hash");
        all.insert(changed);
    }
    assert_eq!(all.len(), changes.len() + 1, "all distinct");
    let s1 = hash("---\nid: a\ndescription: D.\nllm_profile: default\nsignal: {}\n---\nB.\n");
    let s2 =
        hash("---\nid: a\ndescription: D.\nllm_profile: default\nsignal: {burst: 4}\n---\nB.\n");
    assert_ne!(s1, s2);
}

#[test]
fn hash_prefix_is_twelve_hex_digits() {
    let def = parse_definition(Path::new("a.md"), &agent("a", "")).unwrap();
    assert_eq!(def.hash_prefix().len(), 12);
    assert!(def.definition_hash.starts_with(def.hash_prefix()));
    assert!(def
        .definition_hash
        .chars()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
}

// ── Resolution ───────────────────────────────────────────────────────────

fn resolve_err(files: &[(&str, String)], inputs: &CatalogInputs) -> Diagnostics {
    AgentCatalog::from_texts(files.iter().map(|(n, t)| (*n, t.as_str())), inputs, 1)
        .expect_err("should be rejected")
}

#[test]
fn every_resolution_rejection_kind_has_an_actionable_message() {
    use DiagnosticKind as K;
    let mut deep = inputs(&[]);
    deep.max_delegation_depth = 0;
    type Case = (&'static str, K, Vec<(&'static str, String)>, CatalogInputs);
    let cases: Vec<Case> = vec![
        (
            "duplicate_id",
            K::DuplicateId,
            vec![("a.md", agent("alpha", "")), ("b.md", agent("alpha", ""))],
            inputs(&[]),
        ),
        (
            "duplicate_id_folded",
            K::DuplicateId,
            vec![
                ("a.md", agent("code_review", "")),
                ("b.md", agent("code-review", "")),
            ],
            inputs(&[]),
        ),
        (
            "unknown_delegate",
            K::UnknownDelegate,
            vec![
                ("a.md", agent("a", "delegates: [researcher]\n")),
                ("r.md", agent("reseacher", "")),
            ],
            inputs(&[]),
        ),
        (
            "self_delegation",
            K::SelfDelegation,
            vec![("a.md", agent("a", "delegates:\n  - a\n"))],
            inputs(&[]),
        ),
        (
            "unknown_root_delegate",
            K::UnknownRootDelegate,
            vec![("a.md", agent("a", ""))],
            inputs(&["a", "b"]),
        ),
        (
            "duplicate_root_delegate",
            K::DuplicateEntry,
            vec![("a.md", agent("a", ""))],
            inputs(&["a", "a"]),
        ),
        (
            "invalid_depth",
            K::InvalidInput,
            vec![("a.md", agent("a", ""))],
            deep,
        ),
        (
            "unknown_profile",
            K::UnknownProfile,
            vec![(
                "a.md",
                agent("a", "").replace("llm_profile: default", "llm_profile: defualt"),
            )],
            inputs(&[]),
        ),
        (
            "unknown_tool",
            K::UnknownTool,
            vec![("a.md", agent("a", "tools: [read_file, bash]\n"))],
            inputs(&[]),
        ),
        (
            "tool_not_delegatable_root",
            K::ToolNotDelegatable,
            vec![("a.md", agent("a", "tools: [read_file, shell]\n"))],
            inputs(&["a"]),
        ),
        (
            "tool_not_delegatable_agent",
            K::ToolNotDelegatable,
            vec![
                ("a.md", agent("a", "delegates: [b]\n")),
                ("b.md", agent("b", "tools:\n  - write_file\n")),
            ],
            inputs(&[]),
        ),
        (
            "runtime_injected_tool",
            K::RuntimeInjectedTool,
            vec![("a.md", agent("a", "tools: [delegate]\n"))],
            inputs(&[]),
        ),
        (
            "unknown_skill",
            K::UnknownSkill,
            vec![("a.md", agent("a", "skills: [gti, docker]\n"))],
            inputs(&[]),
        ),
    ];
    for (name, kind, files, inp) in cases {
        let diags = resolve_err(&files, &inp);
        assert!(diags.has(kind), "{name}: expected {kind:?}, got {diags:#?}");
        insta::assert_snapshot!(format!("resolve_{name}"), diags.to_string());
    }
}

#[test]
fn a_root_only_tool_is_fine_for_an_agent_nobody_delegates_to() {
    let c = AgentCatalog::from_texts(
        [(
            "admin.md",
            agent("admin", "tools: [shell, write_file]\n").as_str(),
        )],
        &inputs(&[]),
        1,
    )
    .unwrap();
    let admin = AgentId::parse("admin").unwrap();
    assert!(!c.is_delegatable(&admin));
    assert_eq!(c.get(&admin).unwrap().tools, ["shell", "write_file"]);
}

#[test]
fn a_broken_file_does_not_cause_misleading_unknown_delegate_errors() {
    let broken = "---\nid: helper\ndescription: d\nllm_profile: default\nlimits: {max_iterations: 0}\n---\nHelp.\n";
    let diags = resolve_err(
        &[
            ("a.md", agent("a", "delegates: [helper]\n")),
            ("helper.md", broken.into()),
        ],
        &inputs(&["helper"]),
    );
    assert_eq!(diags.len(), 1, "{diags}");
    assert_eq!(diags.as_slice()[0].kind, DiagnosticKind::OutOfRange);
}

fn valid_dir_files() -> Vec<(&'static str, String)> {
    vec![
        ("planner.md", agent("planner", "tools: [read_file]\ndelegates: [researcher, coder]\n").replace("llm_profile: default", "llm_profile: fast")),
        ("researcher.md", agent("researcher", "tools: [read_file, search_text]\ndelegates: [summarizer]\nskills: [git]\nsignal:\n  delivery: steer\n  severities: [info, warning]\n")),
        ("summarizer.md", agent("summarizer", "limits: {max_iterations: 4}\n")),
        ("coder.md", agent("coder", "tools: [read_file]\nskills: [rust, git]\n")),
        ("z-admin.md", agent("admin", "tools: [shell, write_file, read_file]\ndelegates: [planner]\n")),
    ]
}

#[test]
fn a_valid_multi_agent_set_loads_with_the_expected_graph() {
    let files = valid_dir_files();
    let c = AgentCatalog::from_texts(
        files.iter().map(|(n, t)| (*n, t.as_str())),
        &inputs(&["planner", "researcher"]),
        7,
    )
    .unwrap_or_else(|d| panic!("{d}"));
    let id = |s: &str| AgentId::parse(s).unwrap();
    assert_eq!(c.generation(), 7);
    assert_eq!(c.len(), 5);
    assert_eq!(
        c.ids().map(AgentId::as_str).collect::<Vec<_>>(),
        ["admin", "coder", "planner", "researcher", "summarizer"]
    );
    assert_eq!(c.root_delegates(), [id("planner"), id("researcher")]);
    assert_eq!(
        c.delegates_of(&id("planner")),
        [id("researcher"), id("coder")]
    );
    assert_eq!(c.delegates_of(&id("researcher")), [id("summarizer")]);
    assert!(c.delegates_of(&id("coder")).is_empty());
    assert!(c.delegates_of(&id("nobody")).is_empty());
    assert!(c.may_delegate(None, &id("planner")));
    assert!(!c.may_delegate(None, &id("coder")));
    assert!(c.may_delegate(Some(&id("planner")), &id("coder")));
    assert!(!c.may_delegate(Some(&id("coder")), &id("planner")));
    for d in ["planner", "researcher", "summarizer", "coder"] {
        assert!(c.is_delegatable(&id(d)), "{d}");
    }
    assert!(
        !c.is_delegatable(&id("admin")),
        "admin keeps its RootOnly tools"
    );
    assert!(!c.has_cycle());
    assert_eq!(
        c.get(&id("admin")).unwrap().source_file,
        Path::new("z-admin.md")
    );
    assert_eq!(c.get_str("summarizer").unwrap().limits.max_iterations, 4);
    assert!(c.get_str("Bad Id").is_none());
    assert_eq!(c.max_delegation_depth(), DEFAULT_MAX_DELEGATION_DEPTH);
    insta::assert_snapshot!("summary", c.summary().to_string());
}

#[test]
fn delegation_cycles_load_because_depth_bounds_them() {
    let files = [
        ("a.md", agent("a", "tools: [read_file]\ndelegates: [b]\n")),
        ("b.md", agent("b", "delegates: [a]\n")),
    ];
    let mut inp = inputs(&["a"]);
    inp.max_delegation_depth = MAX_DELEGATION_DEPTH_CAP;
    let c = AgentCatalog::from_texts(files.iter().map(|(n, t)| (*n, t.as_str())), &inp, 1).unwrap();
    let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
    assert!(c.has_cycle());
    assert_eq!(c.delegates_of(&a), std::slice::from_ref(&b));
    assert_eq!(c.delegates_of(&b), std::slice::from_ref(&a));
    assert_eq!(c.max_delegation_depth(), 8);
    // The engine walks the graph under the depth bound: a chain root → a → b
    // → a … stops after max_delegation_depth hops however the graph loops.
    let mut chain = vec![a.clone()];
    while chain.len() < c.max_delegation_depth() as usize {
        let next = c.delegates_of(chain.last().unwrap())[0].clone();
        chain.push(next);
    }
    assert_eq!(chain.len(), 8);

    inp.max_delegation_depth = MAX_DELEGATION_DEPTH_CAP + 1;
    let err =
        AgentCatalog::from_texts(files.iter().map(|(n, t)| (*n, t.as_str())), &inp, 1).unwrap_err();
    assert!(
        err.has(DiagnosticKind::InvalidInput),
        "an unbounded depth is refused"
    );
}

#[test]
fn an_empty_catalog_is_valid_without_root_delegates() {
    let c = AgentCatalog::from_texts([], &inputs(&[]), 3).unwrap();
    assert!(c.is_empty());
    assert_eq!(AgentCatalog::empty(5).generation(), 5);
    insta::assert_snapshot!("summary_empty", c.summary().to_string());
}

// ── Loader on real files ─────────────────────────────────────────────────

fn write_valid_dir(dir: &Path) {
    for (name, text) in valid_dir_files() {
        fs::write(dir.join(name), text).unwrap();
    }
    // Ignored: other extensions, hidden files, subdirectories' contents.
    fs::write(dir.join("README.txt"), "not an agent").unwrap();
    fs::write(dir.join(".draft.md"), "not loaded").unwrap();
    fs::create_dir(dir.join("nested")).unwrap();
    fs::write(dir.join("nested/inner.md"), "not loaded").unwrap();
}

fn redact(s: &str, dirs: &[&Path]) -> String {
    let mut s = s.to_owned();
    for (i, d) in dirs.iter().enumerate() {
        let canon = fs::canonicalize(d).unwrap();
        s = s.replace(&canon.display().to_string(), &format!("[DIR{i}]"));
        s = s.replace(&d.display().to_string(), &format!("[DIR{i}]"));
    }
    s
}

#[test]
fn loads_a_directory_and_reports_the_same_summary() {
    let dir = tempfile::tempdir().unwrap();
    write_valid_dir(dir.path());
    let c = AgentCatalog::load(dir.path(), &inputs(&["planner", "researcher"]), 1).unwrap();
    assert_eq!(c.len(), 5);
    assert_eq!(
        c.root(),
        Some(fs::canonicalize(dir.path()).unwrap().as_path())
    );
    let s = check(dir.path(), &inputs(&["planner", "researcher"])).unwrap();
    assert_eq!(s.agents.len(), 5);
    assert_eq!(s.agents[0].id.as_str(), "admin");
    assert_eq!(
        s.agents[0].hash_prefix,
        c.get_str("admin").unwrap().hash_prefix()
    );
}

#[cfg(unix)]
#[test]
fn filesystem_rejections() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let root = dir.path();
    fs::write(root.join("good.md"), agent("good", "")).unwrap();
    fs::create_dir(root.join("folder.md")).unwrap();
    fs::write(outside.path().join("secret.md"), agent("secret", "")).unwrap();
    symlink(outside.path().join("secret.md"), root.join("escape.md")).unwrap();
    symlink(root.join("good.md"), root.join("inside-link.md")).unwrap();
    symlink(root.join("missing"), root.join("dangling.md")).unwrap();
    let mut latin1 = format!("---\n{H}---\n").into_bytes();
    latin1.extend_from_slice(b"r\xe9sum\xe9\n");
    fs::write(root.join("latin1.md"), latin1).unwrap();
    fs::write(
        root.join("huge.md"),
        vec![b'x'; MAX_DEFINITION_BYTES as usize + 1],
    )
    .unwrap();

    let diags = AgentCatalog::load(root, &inputs(&[]), 1).unwrap_err();
    let kinds: BTreeSet<_> = diags.iter().map(|d| d.kind).collect();
    use DiagnosticKind as K;
    for k in [
        K::NotRegularFile,
        K::SymlinkEscape,
        K::Io,
        K::NotUtf8,
        K::FileTooLarge,
        K::DuplicateId,
    ] {
        assert!(kinds.contains(&k), "{k:?} missing from {diags}");
    }
    // inside-link.md is a symlink to good.md inside the root: it loads, and so
    // duplicates good's id, which names both files.
    insta::assert_snapshot!(
        "fs_rejections",
        redact(&diags.to_string(), &[root, outside.path()])
    );
}

#[test]
fn root_problems_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let file = dir.path().join("file");
    fs::write(&file, "x").unwrap();
    let a = AgentCatalog::load(&missing, &inputs(&[]), 1).unwrap_err();
    let b = AgentCatalog::load(&file, &inputs(&[]), 1).unwrap_err();
    assert!(a.has(DiagnosticKind::RootUnusable) && b.has(DiagnosticKind::RootUnusable));
    insta::assert_snapshot!("fs_root", redact(&format!("{a}\n{b}"), &[dir.path()]));
}

#[test]
fn too_many_files_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..=MAX_DEFINITIONS {
        fs::write(dir.path().join(format!("a{i}.md")), "").unwrap();
    }
    let diags = AgentCatalog::load(dir.path(), &inputs(&[]), 1).unwrap_err();
    assert_eq!(diags.len(), 1);
    insta::assert_snapshot!("fs_too_many", redact(&diags.to_string(), &[dir.path()]));
}

#[test]
fn a_directory_full_of_bad_files_reports_everything_in_file_order() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let files: Vec<(&str, String)> = vec![
        (
            "01-typo.md",
            format!("---\n{H}delegate: [b]\n---\nbody\n").replace("id: a", "id: typo"),
        ),
        (
            "02-limits.md",
            agent(
                "limits",
                "limits:\n  max_iterations: 0\n  timeout_secs: \"10\"\n",
            ),
        ),
        ("03-tabs.md", agent("tabs", "tools:\n\t- read_file\n")),
        ("04-dup.md", agent("limits", "")),
        (
            "05-graph.md",
            agent(
                "graph",
                "tools: [shell, nope]\ndelegates: [graph, ghost, tabs]\nskills: [cooking]\n",
            ),
        ),
        (
            "06-empty.md",
            agent("empty", "").replace("You are empty.\n", ""),
        ),
        ("07-nofm.md", "# Just markdown\n".into()),
        (
            "08-profile.md",
            agent("profile", "").replace("llm_profile: default", "llm_profile: gpt-4"),
        ),
    ];
    for (name, text) in &files {
        fs::write(root.join(name), text).unwrap();
    }
    let diags = AgentCatalog::load(root, &inputs(&["graph", "missing"]), 1).unwrap_err();
    insta::assert_snapshot!("fs_bad_directory", diags.to_string());
}

// ── Reload ───────────────────────────────────────────────────────────────

#[test]
fn reload_keeps_the_old_catalog_on_error_and_swaps_on_success() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    fs::write(root.join("a.md"), agent("a", "")).unwrap();
    let inp = inputs(&["a"]);
    let handle = CatalogHandle::load(root, &inp).unwrap();
    let before = handle.current();
    assert_eq!(before.generation(), 1);
    let old_hash = before.get_str("a").unwrap().definition_hash.clone();

    // A bad edit: the reload fails, names the problem, and changes nothing.
    fs::write(root.join("a.md"), agent("a", "tools: [shell]\n")).unwrap();
    fs::write(root.join("b.md"), agent("b", "")).unwrap();
    let err = handle.reload(&inp).unwrap_err();
    assert!(err.has(DiagnosticKind::ToolNotDelegatable), "{err}");
    let still = handle.current();
    assert_eq!(still.generation(), 1);
    assert_eq!(still.len(), 1);
    assert_eq!(still.get_str("a").unwrap().definition_hash, old_hash);

    // Fixed: generation 2 with both agents; the old clone is untouched.
    fs::write(root.join("a.md"), agent("a", "tools: [read_file]\n")).unwrap();
    assert_eq!(handle.reload(&inp).unwrap(), 2);
    let after = handle.current();
    assert_eq!(after.generation(), 2);
    assert_eq!(after.len(), 2);
    assert_ne!(after.get_str("a").unwrap().definition_hash, old_hash);
    assert_eq!(before.len(), 1, "an old catalog is immutable");
    assert_eq!(before.get_str("a").unwrap().definition_hash, old_hash);

    // Changed inputs are part of a reload too.
    let err = handle.reload(&inputs(&["a", "c"])).unwrap_err();
    assert!(err.has(DiagnosticKind::UnknownRootDelegate));
    assert_eq!(handle.current().generation(), 2);
    assert_eq!(handle.reload(&inp).unwrap(), 3);
}

#[test]
fn catalog_is_cheap_to_clone_and_shareable() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<AgentCatalog>();
    fn assert_handle<T: Send + Sync>() {}
    assert_handle::<CatalogHandle>();
}

// ── Regressions found by cargo-fuzz ──────────────────────────────────────

#[test]
fn fuzz_regression_bare_cr_is_rejected_so_lines_stay_true() {
    // libyaml counts a lone CR as a line break; editors and our line numbers
    // do not, so diagnostics pointed past the end of the file.
    let diags =
        parse_definition_bytes(Path::new("f.md"), b"---\n[\r\r[[\r\r[\n---\nBody.\n").unwrap_err();
    assert_eq!(diags.len(), 1);
    assert_eq!(diags[0].kind, DiagnosticKind::LineBreak);
    assert_eq!((diags[0].line, diags[0].column), (Some(2), Some(2)));
}

#[test]
fn fuzz_regression_keys_with_line_breaks_render_on_one_line() {
    let diags = parse_err("---\n? \"x*\\n AN\"\n: 1\n---\nBody.\n");
    let text = render(&diags);
    assert_eq!(text.lines().count(), diags.len(), "{text}");
    assert!(text.contains(r#""x*\n AN""#), "{text}");
    let d = Diagnostic::new(
        Some(Path::new("a\nb.md")),
        DiagnosticKind::Io,
        "x\ny\u{2028}z",
    );
    assert_eq!(d.to_string(), r"a\nb.md: x\ny\u{2028}z");
}

/// Parses `bytes` on another thread; a parse still running after `secs`
/// fails the test instead of hanging it (the fuzz target's time limit).
fn parse_within(name: &str, bytes: Vec<u8>, secs: u64) -> Result<AgentDefinition, Vec<Diagnostic>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let file = name.to_owned();
    std::thread::spawn(move || {
        let _ = tx.send(parse_definition_bytes(Path::new(&file), &bytes));
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("parsing {name} took more than {secs} s"))
}

#[test]
fn fuzz_regression_an_empty_key_in_a_flow_mapping_is_reported_not_spun_on() {
    let text = "---\nid: a\ndescription: d\nllm_profile: default\nlimits: {\"\": 1}\n---\nBody.\n";
    let diags = parse_within("agent.md", text.as_bytes().to_vec(), 10).unwrap_err();
    insta::assert_snapshot!(render(&diags), @r#"agent.md:5:1: limits."": unknown key `""` in `limits`; known keys: max_iterations, timeout_secs, max_output_tokens, max_children"#);
}

#[test]
fn every_fuzz_seed_parses_within_the_time_limit() {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/catalog_frontmatter");
    let mut names = Vec::new();
    for entry in fs::read_dir(&seeds).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let parsed = parse_within(&name, fs::read(&path).unwrap(), 10);
        assert_eq!(parsed.is_ok(), name == "valid.md", "{name}: {parsed:?}");
        names.push(name);
    }
    assert!(names.len() >= 5, "{names:?}");
}
