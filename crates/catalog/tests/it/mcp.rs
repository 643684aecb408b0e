//! `mcp:SERVER/TOOL` and `mcp:SERVER/*` in `tools:`: resolved against the
//! servers' last committed manifests handed in as plain data, expanded to
//! the registered tool names, and rejected with located errors.

use std::collections::BTreeMap;

use keel_catalog::*;

use crate::*;

/// `files` (delegatable or not) with tools `read` and `write`, and `web`
/// which keel has never reached.
fn with_mcp(root_delegates: &[&str], delegatable: bool) -> CatalogInputs {
    let mut i = inputs(root_delegates);
    let tools: BTreeMap<String, String> =
        [("write", "mcp__files__write"), ("read", "mcp__files__read")]
            .into_iter()
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .collect();
    i.mcp.insert(
        "files".to_owned(),
        McpServerTools {
            delegatable,
            tools: Some(tools),
        },
    );
    i.mcp.insert("web".to_owned(), McpServerTools::default());
    i
}

fn load(files: &[(&str, String)], inputs: &CatalogInputs) -> Result<AgentCatalog, Diagnostics> {
    AgentCatalog::from_texts(files.iter().map(|(n, t)| (*n, t.as_str())), inputs, 1)
}

#[test]
fn a_star_and_a_named_tool_expand_to_registered_names_once_each() {
    let files = vec![(
        "a.md",
        agent("a", "tools: [read_file, mcp:files/*, mcp:files/read]\n"),
    )];
    let catalog = load(&files, &with_mcp(&[], false)).unwrap();
    let def = catalog.get(&AgentId::parse("a").unwrap()).unwrap();
    assert_eq!(
        def.tools,
        ["read_file", "mcp__files__read", "mcp__files__write"]
    );
    let files = vec![("a.md", agent("a", "tools: [mcp:files/write]\n"))];
    let catalog = load(&files, &with_mcp(&[], false)).unwrap();
    let def = catalog.get(&AgentId::parse("a").unwrap()).unwrap();
    assert_eq!(def.tools, ["mcp__files__write"]);
}

#[test]
fn a_delegatable_server_may_serve_an_agent_that_is_delegated_to() {
    let files = vec![("a.md", agent("a", "tools: [mcp:files/read]\n"))];
    assert!(load(&files, &with_mcp(&["a"], true)).is_ok());
    let err = load(&files, &with_mcp(&["a"], false)).unwrap_err();
    assert!(err.has(DiagnosticKind::ToolNotDelegatable), "{err}");
}

#[test]
fn every_mcp_rejection_is_located_and_says_what_to_do() {
    type Case = (&'static str, &'static str, CatalogInputs);
    let cases: Vec<Case> = vec![
        (
            "unknown_tool",
            "tools: [read_file, mcp:files/raed]\n",
            with_mcp(&[], false),
        ),
        (
            "unknown_server",
            "tools: [mcp:fils/*]\n",
            with_mcp(&[], false),
        ),
        (
            "never_reached",
            "tools: [mcp:web/fetch]\n",
            with_mcp(&[], false),
        ),
        ("malformed", "tools: [mcp:files]\n", with_mcp(&[], false)),
        (
            "root_only",
            "tools:\n  - mcp:files/*\n",
            with_mcp(&["a"], false),
        ),
    ];
    for (name, tools, inputs) in cases {
        let files = vec![("a.md", agent("a", tools))];
        let err = load(&files, &inputs).unwrap_err();
        insta::assert_snapshot!(format!("mcp_{name}"), err.to_string());
    }
}
