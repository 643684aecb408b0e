//! `keel --help`: the commands it lists are the ones that exist.

use std::process::Command;

#[test]
fn help_lists_only_the_commands_that_exist() {
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    // Every command it lists answers its own --help.
    let commands = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap();
    for line in commands.lines().filter(|l| !l.trim().is_empty()) {
        let name = line.split_whitespace().next().unwrap();
        if name == "help" {
            continue;
        }
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args([name, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success(), "keel {name} --help");
    }
    insta::assert_snapshot!(help);
}
