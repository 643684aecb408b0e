//! Skills: the strict skill-file format, the skills root on disk, names
//! unique in a set, and what `keel agents check` prints about them.

use std::fs;
use std::path::Path;

use keel_catalog::*;

use crate::*;

fn skill_err(text: &str) -> String {
    render(&parse_skill(Path::new("skills/x.md"), text).expect_err("should be rejected"))
}

#[test]
fn a_skill_is_a_name_a_description_and_instructions() {
    let s = parse_skill(
        Path::new("review.md"),
        "---\nname: code-review\ndescription: How to review a change.\n---\n\nRead the diff twice.\r\nThen comment.\n\n",
    )
    .unwrap();
    assert_eq!(s.name, "code-review");
    assert_eq!(s.description, "How to review a change.");
    assert_eq!(s.body, "Read the diff twice.\nThen comment.");
}

#[test]
fn skill_files_are_as_strict_as_agent_definitions() {
    let cases = [
        "no frontmatter\n",
        "---\nname: a\ndescription: d\n",
        "---\n---\nbody\n",
        "---\ndescription: d\n---\nbody\n",
        "---\nname: Code Review\ndescription: d\n---\nbody\n",
        "---\nname: a\ndescription: \"\"\n---\nbody\n",
        "---\nname: a\ndescription: d\nid: a\n---\nbody\n",
        "---\nname: a\ndescription: d\ntools: [read_file]\n---\nbody\n",
        "---\nname: a\nname: b\ndescription: d\n---\nbody\n",
        "---\nname: a\ndescription: d\n---\n\n  \n",
        "---\nname: 7\ndescription: d\n---\nbody\n",
    ];
    let out: String = cases
        .iter()
        .map(|c| format!("--- {c:?}\n{}", skill_err(c)))
        .collect();
    insta::assert_snapshot!(out);
    let bytes = b"---\nname: a\ndescription: d\n---\nr\xe9sum\xe9\n";
    let err = parse_skill_bytes(Path::new("x.md"), bytes).unwrap_err();
    assert_eq!(err[0].kind, DiagnosticKind::NotUtf8);
    let huge = vec![b'x'; MAX_DEFINITION_BYTES as usize + 1];
    let err = parse_skill_bytes(Path::new("x.md"), &huge).unwrap_err();
    assert_eq!(err[0].kind, DiagnosticKind::FileTooLarge);
}

#[test]
fn names_are_unique_in_a_set() {
    let a = skill("git", "One.");
    let b = skill("git", "Two.");
    let err = SkillSet::from_texts([("a.md", a.as_str()), ("b.md", b.as_str())]).unwrap_err();
    insta::assert_snapshot!(err.to_string(), @r#"
    b.md: name: the skill name "git" is already used by a.md; rename one of them
    1 problem found; the agent catalog was not loaded
    "#);
}

#[cfg(unix)]
#[test]
fn the_skills_root_is_read_like_the_definitions_root() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("skills");
    fs::create_dir(&root).unwrap();
    fs::write(root.join("git.md"), skill("git", "Git workflows.")).unwrap();
    fs::write(root.join("notes.txt"), "ignored").unwrap();
    fs::write(root.join(".draft.md"), "ignored").unwrap();
    let set = SkillSet::load(&root).unwrap();
    assert_eq!(set.names().collect::<Vec<_>>(), ["git"]);
    assert_eq!(
        set.get("git").unwrap().source_file,
        Path::new("skills/git.md")
    );

    let outside = tempfile::tempdir().unwrap();
    fs::write(outside.path().join("secret.md"), skill("secret", "S.")).unwrap();
    symlink(outside.path().join("secret.md"), root.join("escape.md")).unwrap();
    fs::create_dir(root.join("folder.md")).unwrap();
    let err = SkillSet::load(&root).unwrap_err();
    let kinds: Vec<_> = err.iter().map(|d| d.kind).collect();
    assert!(kinds.contains(&DiagnosticKind::SymlinkEscape), "{err}");
    assert!(kinds.contains(&DiagnosticKind::NotRegularFile), "{err}");
    assert!(err
        .iter()
        .all(|d| d.file.as_ref().is_some_and(|f| f.starts_with("skills"))));
    assert!(
        err.to_string().contains("outside the skills directory"),
        "{err}"
    );

    let missing = SkillSet::load(&dir.path().join("nope")).unwrap_err();
    assert!(missing
        .to_string()
        .contains("cannot open the skills directory"));
}

#[test]
fn the_catalog_keeps_its_skills_and_check_prints_them() {
    let files = valid_dir_files();
    let c = AgentCatalog::from_texts(
        files.iter().map(|(n, t)| (*n, t.as_str())),
        &inputs(&["planner"]),
        1,
    )
    .unwrap();
    assert_eq!(c.skills().len(), 2);
    assert_eq!(c.get_str("coder").unwrap().skills, ["rust", "git"]);
    insta::assert_snapshot!(c.summary().to_string());
}
