//! `keel agents check DIR`: exit 0 with the catalog summary, or exit 1 with
//! every diagnostic.

use std::process::Command;

fn check(dir: &std::path::Path, extra: &[&str]) -> (String, i32) {
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["agents", "check"])
        .arg(dir)
        .args(extra)
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    (
        String::from_utf8(out.stdout).unwrap(),
        out.status.code().unwrap(),
    )
}

#[test]
fn the_shipped_demo_agents_pass_against_the_default_configuration() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/agents");
    let (out, code) = check(&dir, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("4 agents OK"), "{out}");
    for id in ["archivist", "monitor", "researcher", "writer"] {
        assert!(out.contains(id), "{out}");
    }
}

#[test]
fn bad_definitions_exit_1_with_every_diagnostic() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.md"),
        "---\nid: a\ndescription: A.\nllm_profile: nope\ntools: [shell]\ndelegates: [b]\n---\nBody.\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("b.md"),
        "---\nid: b\ndescription: B.\nllm_profile: default\ntoools: []\n---\nBody.\n",
    )
    .unwrap();
    let (out, code) = check(dir.path(), &[]);
    assert_eq!(code, 1, "{out}");
    insta::assert_snapshot!(out);
}

#[test]
fn with_a_config_profiles_and_tool_switches_come_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let agents = dir.path().join("agents");
    std::fs::create_dir(&agents).unwrap();
    std::fs::write(
        agents.join("coder.md"),
        "---\nid: coder\ndescription: Writes code.\nllm_profile: local\ntools: [read_file]\n---\nYou code.\n",
    )
    .unwrap();
    let config = dir.path().join("keel.toml");
    std::fs::write(
        &config,
        "root_delegates = [\"coder\"]\n[providers.local]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\nmodel = \"m\"\n",
    )
    .unwrap();
    let (out, code) = check(&agents, &["--config", config.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("root delegates: coder"), "{out}");
    // Without the config, profile `local` does not exist.
    let (out, code) = check(&agents, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no provider profile \"local\""), "{out}");
}

/// The data-directory layout: `skills/` next to `agents/` is read, each
/// agent's `skills:` must name one of them, and the summary lists both.
#[test]
fn skills_next_to_the_definitions_are_checked_and_listed() {
    let dir = tempfile::tempdir().unwrap();
    let (agents, skills) = (dir.path().join("agents"), dir.path().join("skills"));
    std::fs::create_dir(&agents).unwrap();
    std::fs::create_dir(&skills).unwrap();
    std::fs::write(
        agents.join("coder.md"),
        "---\nid: coder\ndescription: Writes code.\nllm_profile: default\nskills: [review]\n---\nYou code.\n",
    )
    .unwrap();
    std::fs::write(
        skills.join("review.md"),
        "---\nname: review\ndescription: How to review a change.\n---\nRead it twice.\n",
    )
    .unwrap();
    let (out, code) = check(&agents, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("skills=review"), "{out}");
    assert!(
        out.contains("1 skill\n  review  How to review a change.  (skills/review.md)"),
        "{out}"
    );

    // An explicit --skills directory without that skill fails the agent.
    let empty = dir.path().join("none");
    std::fs::create_dir(&empty).unwrap();
    let (out, code) = check(&agents, &["--skills", empty.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("skills[0]: no skill \"review\" exists"),
        "{out}"
    );

    // A broken skill file fails the check, naming the file.
    std::fs::write(
        skills.join("bad.md"),
        "---\nname: Bad\ndescription: x\n---\nbody\n",
    )
    .unwrap();
    let (out, code) = check(&agents, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.starts_with("skills/bad.md:2:1: name: invalid skill name"),
        "{out}"
    );
}

#[test]
fn a_second_frontmatter_block_is_a_warning_and_the_check_still_passes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.md"),
        "---\nid: a\ndescription: A.\nllm_profile: default\n---\n\n---\ntools: [read_file]\n---\nBody.\n",
    )
    .unwrap();
    let (out, code) = check(dir.path(), &[]);
    assert_eq!(code, 0, "{out}");
    let warning = out.lines().last().unwrap();
    insta::assert_snapshot!(warning, @"warning: a.md:7: the role prompt begins with a second frontmatter-like block (`---`, keys, `---`); the model would read it as text — move its keys into the frontmatter above and delete it");
}
