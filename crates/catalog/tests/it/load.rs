//! The loader on real files in tempdirs, and reload.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use keel_catalog::*;

use crate::*;

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

#[test]
fn a_second_frontmatter_block_in_the_body_is_a_warning_naming_file_and_line() {
    let doubled = format!(
        "---\n{H}---\n\n---\ntools: [read_file]\nlimits:\n  max_iterations: 3\n---\nYou are a.\n"
    );
    // A horizontal rule followed by prose is Markdown, not a block of keys.
    let ruled = agent("b", "").replace("You are b.", "---\nYou are b.\n\n---\nMore.");
    let c = AgentCatalog::from_texts(
        [("a.md", doubled.as_str()), ("b.md", ruled.as_str())],
        &inputs(&[]),
        1,
    )
    .expect("a warning does not fail the load");
    assert_eq!(c.len(), 2);
    let kinds: Vec<_> = c.warnings().iter().map(|w| w.kind).collect();
    assert_eq!(kinds, [DiagnosticKind::SecondFrontmatter]);
    assert!(DiagnosticKind::SecondFrontmatter.is_warning());
    assert!(!DiagnosticKind::UnknownSkill.is_warning());
    insta::assert_snapshot!("second_frontmatter", render(c.warnings()));

    // The handle keeps a reloaded catalog's warnings with it.
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("a.md"), &doubled).unwrap();
    let handle = CatalogHandle::load(dir.path(), &inputs(&[])).unwrap();
    assert_eq!(handle.current().warnings().len(), 1);
    fs::write(dir.path().join("a.md"), agent("a", "")).unwrap();
    handle.reload(&inputs(&[])).unwrap();
    assert!(handle.current().warnings().is_empty());
}
