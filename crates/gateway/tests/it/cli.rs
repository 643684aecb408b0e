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
    assert!(!help.contains("serve"), "{help}");
    insta::assert_snapshot!(help);
}
