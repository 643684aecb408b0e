//! The parser: one snapshot per rejection kind, defaults, and the
//! regressions cargo-fuzz found.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use keel_catalog::*;

use crate::*;

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
            "out_of_range_cost_budget",
            K::OutOfRange,
            format!("---\n{H}limits:\n  max_cost_usd: -0.5\n---\nbody\n"),
        ),
        (
            "out_of_range_token_budget",
            K::OutOfRange,
            format!("---\n{H}limits:\n  max_tokens_total: 0\n---\nbody\n"),
        ),
        (
            "wrong_type_cost_budget",
            K::WrongType,
            format!("---\n{H}limits:\n  max_cost_usd: \"$5\"\n---\nbody\n"),
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
    insta::assert_snapshot!(render(&diags), @r#"agent.md:5:1: limits."": unknown key `""` in `limits`; known keys: max_iterations, timeout_secs, max_output_tokens, max_children, max_tokens_total, max_cost_usd"#);
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
