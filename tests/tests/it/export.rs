//! `keel export` and `keel import` on a data directory `keel serve` wrote:
//! export → import → export round-trips equal modulo ids, a file from a
//! newer format version is refused, and an existing output file is kept.

use crate::backup::{acknowledged_turn, new_dialog, run, shown};
use crate::serve::{runtime, Served};

/// `export` with its dialog's ids cleared and every run, timeline and
/// checkpoint id replaced by its kind and position (links following them):
/// two exports of copies of one dialog are equal under it.
fn without_ids(mut export: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    export["dialog"]["id"] = Value::Null;
    export["dialog"]["dialog_id"] = Value::Null;
    let mut names = std::collections::HashMap::new();
    for kind in ["runs", "timelines", "checkpoints"] {
        for (i, item) in export[kind].as_array().into_iter().flatten().enumerate() {
            if let Some(id) = item["id"].as_str() {
                names.insert(id.to_owned(), format!("{kind}-{}", i + 1));
            }
        }
    }
    let rename = |v: &mut Value| {
        if let Some(name) = v.as_str().and_then(|s| names.get(s)) {
            *v = Value::String(name.clone());
        }
    };
    rename(&mut export["head_timeline"]);
    for (kind, fields) in [
        ("runs", &["id", "parent_run_id", "caller_scope"][..]),
        ("timelines", &["id", "parent"][..]),
        ("checkpoints", &["id", "parent_id", "timeline"][..]),
    ] {
        for item in export[kind].as_array_mut().into_iter().flatten() {
            for field in fields {
                rename(&mut item[*field]);
            }
        }
    }
    export
}

#[test]
fn a_dialog_exported_and_imported_by_the_binary_round_trips_equal_modulo_ids() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("echo.yaml"), "when_exhausted: echo\n").unwrap();
    std::fs::write(
        data.join("keel.toml"),
        "[providers.default]\nkind = \"scripted\"\nscript = \"echo.yaml\"\n",
    )
    .unwrap();
    let served = Served::start(&data);
    let http = reqwest::Client::new();
    let id = runtime().block_on(async {
        let id = new_dialog(&http, &served, "Plans").await;
        acknowledged_turn(&http, &served.url(""), &id, "first").await;
        acknowledged_turn(&http, &served.url(""), &id, "second").await;
        id
    });
    served.signal("TERM");
    served.stderr_until("stopped");

    let file = dir.path().join("plans.json");
    let data_dir = data.to_str().unwrap();
    let out = run(&["export", &id, "--data-dir", data_dir, "--out"], &[&file]);
    assert!(out.status.success(), "{}", shown(&out, dir.path()));
    let exported: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(exported["messages"].as_array().unwrap().len(), 4);

    let out = run(&["import", "--data-dir"], &[&data, &file]);
    let text = shown(&out, dir.path());
    assert!(out.status.success(), "{text}");
    let copy = text
        .split("as dialog ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap();
    assert_ne!(copy, id);
    let out = run(&["export", copy, "--data-dir"], &[&data]);
    assert!(out.status.success(), "{}", shown(&out, dir.path()));
    let again: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(again["dialog"]["id"], exported["dialog"]["id"]);
    assert_eq!(without_ids(again), without_ids(exported.clone()));

    // The output file is never overwritten.
    let out = run(&["export", &id, "--data-dir", data_dir, "--out"], &[&file]);
    assert_eq!(out.status.code(), Some(1));
    // A file from a newer format version is refused before the data
    // directory is opened.
    let mut newer = exported;
    newer["version"] = serde_json::json!(2);
    let newer_file = dir.path().join("newer.json");
    std::fs::write(&newer_file, newer.to_string()).unwrap();
    let out = run(&["import", "--data-dir"], &[&data, &newer_file]);
    assert_eq!(out.status.code(), Some(1));
    insta::assert_snapshot!(shown(&out, dir.path()));
}
