//! `definition_hash`: stable across formatting, changed by any semantic change.

use std::collections::BTreeSet;
use std::path::Path;

use keel_catalog::*;

use crate::*;

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
