//! Resolution: every rejection kind, the delegation graph, cycles bounded by depth.

use std::path::Path;

use keel_catalog::*;

use crate::*;

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
            "unknown_approval_tool",
            K::UnknownTool,
            vec![(
                "a.md",
                agent(
                    "a",
                    "tools: [shell, write_file]\napproval: [shell, write_fiel]\n",
                ),
            )],
            inputs(&[]),
        ),
        (
            "unpriced_profile",
            K::UnpricedProfile,
            vec![("a.md", agent("a", "limits: {max_cost_usd: 0.5}\n"))],
            inputs(&[]),
        ),
        (
            "unpriced_delegate_profile",
            K::UnpricedProfile,
            vec![
                (
                    "a.md",
                    agent("a", "delegates: [b]\nlimits:\n  max_cost_usd: 2\n"),
                ),
                (
                    "b.md",
                    agent("b", "").replace("llm_profile: default", "llm_profile: fast"),
                ),
            ],
            priced(&["default"]),
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

fn priced(profiles: &[&str]) -> CatalogInputs {
    let mut i = inputs(&[]);
    i.priced_profiles = profiles.iter().map(|p| p.to_string()).collect();
    i
}

#[test]
fn budgets_load_when_every_profile_they_cover_has_prices() {
    let files = [
        (
            "a.md",
            agent(
                "a",
                "delegates: [b]\nlimits: {max_cost_usd: 0.25, max_tokens_total: 5000}\n",
            ),
        ),
        (
            "b.md",
            agent("b", "").replace("llm_profile: default", "llm_profile: fast"),
        ),
    ];
    let texts = || files.iter().map(|(n, t)| (*n, t.as_str()));
    let c = AgentCatalog::from_texts(texts(), &priced(&["default", "fast"]), 1).unwrap();
    let a = c.get(&AgentId::parse("a").unwrap()).unwrap();
    assert_eq!(a.limits.max_cost_usd.map(|u| u.get()), Some(0.25));
    assert_eq!(a.limits.max_tokens_total, Some(5000));
    // A token budget needs no prices.
    let tokens_only = agent("t", "limits: {max_tokens_total: 10}\n");
    AgentCatalog::from_texts([("t.md", tokens_only.as_str())], &inputs(&[]), 1).unwrap();
}

#[test]
fn approval_is_all_or_a_list_of_the_agents_own_tools() {
    let c = AgentCatalog::from_texts(
        [
            (
                "a.md",
                agent("a", "tools: [shell, write_file]\napproval: [shell]\n").as_str(),
            ),
            (
                "b.md",
                agent("b", "tools: [read_file]\napproval: all\n").as_str(),
            ),
            ("c.md", agent("c", "tools: [shell]\n").as_str()),
        ],
        &inputs(&[]),
        1,
    )
    .unwrap();
    let get = |id: &str| {
        c.get(&AgentId::parse(id).unwrap())
            .unwrap()
            .approval
            .clone()
    };
    let a = get("a").unwrap();
    assert!(a.covers("shell") && !a.covers("write_file"));
    assert!(get("b").unwrap().covers("read_file"));
    assert_eq!(get("c"), None);
    let bad = AgentCatalog::from_texts(
        [(
            "a.md",
            agent("a", "tools: [shell]\napproval: some\n").as_str(),
        )],
        &inputs(&[]),
        1,
    )
    .expect_err("`some` is no approval");
    insta::assert_snapshot!("approval_keyword", bad.to_string());
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

#[test]
fn a_definition_without_a_timeout_gets_the_configured_default_deadline() {
    let files = [
        ("a.md", agent("a", "")),
        ("b.md", agent("b", "limits: {timeout_secs: 30}\n")),
    ];
    let mut inputs = inputs(&[]);
    inputs.default_timeout_secs = 900;
    let c = AgentCatalog::from_texts(files.iter().map(|(n, t)| (*n, t.as_str())), &inputs, 1)
        .unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(c.get_str("a").unwrap().limits.timeout_secs, 900);
    assert_eq!(c.get_str("b").unwrap().limits.timeout_secs, 30);
    inputs.default_timeout_secs = 0;
    let err = AgentCatalog::from_texts(files.iter().map(|(n, t)| (*n, t.as_str())), &inputs, 1)
        .unwrap_err();
    insta::assert_snapshot!(err.to_string(), @r"
    <config>: default_run_timeout_secs: 0 is outside 1..=86400
    1 problem found; the agent catalog was not loaded
    ");
}
