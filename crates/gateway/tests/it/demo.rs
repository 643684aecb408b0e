//! `keel demo` runs offline, end to end, and exits 0.

use std::process::Command;

#[test]
fn the_demo_tour_completes_and_recovers_identically() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["demo", "--data-dir"])
        .arg(dir.path())
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in 1..=7 {
        assert!(
            stdout.contains(&format!("\n{step}. ")),
            "step {step} missing:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("title is now \"Launch checklist\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("identical to before the restart: yes"),
        "{stdout}"
    );
    assert!(stdout.contains("rollback parent"), "{stdout}");
    // The run tree read back from the database: two foreground runs and the
    // background one, all completed.
    for agent in [
        "researcher  foreground  completed",
        "writer  foreground  completed",
        "archivist  background  completed",
    ] {
        assert!(stdout.contains(agent), "{agent} missing:\n{stdout}");
    }
    // The background result was answered by a continuation while idle.
    assert!(
        stdout.contains("keel> The archivist is done: today's launch decisions are filed"),
        "{stdout}"
    );
    assert!(
        stdout.contains("inbox: completion of run")
            && stdout.contains("consumed after 0 failed attempt(s)"),
        "{stdout}"
    );
    assert!(
        dir.path().join("keel.db").exists(),
        "--data-dir keeps the database"
    );
}
