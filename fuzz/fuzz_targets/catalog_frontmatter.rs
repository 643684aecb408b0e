//! Fuzzes the strict frontmatter parser: arbitrary bytes must give a
//! definition or diagnostics, never a panic, and every diagnostic must render
//! on one line with a line number inside the input. Each input is parsed
//! twice: as a whole file, and wrapped as the frontmatter of a file (so the
//! fuzzer reaches the YAML walk without first having to find `---\n`).
//!
//! `cargo xtask fuzz catalog` starts from the committed seeds in
//! `fuzz/seeds/catalog_frontmatter/` (every past finding is one) and reports
//! an input that runs longer than a few seconds as a hang. keel-catalog's
//! tests parse every seed too, so a regression fails CI without nightly.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fn check(data: &[u8]) {
    let file = Path::new("fuzz.md");
    match keel_catalog::parse_definition_bytes(file, data) {
        Ok(def) => {
            assert_eq!(def.definition_hash.len(), 64);
            assert!(!def.body.trim().is_empty());
            let again = keel_catalog::parse_definition_bytes(file, data);
            assert_eq!(again.ok(), Some(def), "parsing is deterministic");
        }
        Err(diags) => {
            assert!(!diags.is_empty());
            let lines = data.iter().filter(|&&b| b == b'\n').count() + 1;
            for d in &diags {
                let text = d.to_string();
                assert!(!text.contains('\n'), "multi-line diagnostic: {text:?}");
                if let Some(line) = d.line {
                    assert!(
                        (1..=lines + 1).contains(&line),
                        "line {line} outside the input ({lines} lines): {text}"
                    );
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let mut wrapped = b"---\n".to_vec();
    wrapped.extend_from_slice(data);
    wrapped.extend_from_slice(b"\n---\nYou are a test agent.\n");
    check(&wrapped);
});
