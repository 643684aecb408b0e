//! The web page as HTTP: its files are embedded and served with their
//! types, caching and a strict Content-Security-Policy; nothing in `web/`
//! is forgotten; the vendored libraries are the files their manifest names.
//! (The page's behaviour is tested in Chromium by tests/web/test_page.py.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use keel_gateway::serve::web::{build_id, ASSETS, CONTENT_SECURITY_POLICY};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{Setup, TestServer};

const WEB: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/web");

/// Files of `web/` that are not served: the page itself (served at `/`)
/// and the vendoring tools.
const NOT_ASSETS: &[&str] = &["index.html", "vendor/vendor.json", "vendor/update.py"];

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn relative(path: &Path) -> String {
    path.strip_prefix(WEB)
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/")
}

#[tokio::test]
async fn the_page_is_served_with_a_strict_policy_and_revalidated() {
    let t = TestServer::start(Setup::default()).await;
    let r = t.get("/").await;
    assert_eq!(r.status(), 200);
    let h = r.headers().clone();
    assert_eq!(h["content-type"], "text/html; charset=utf-8");
    assert_eq!(h["content-security-policy"], CONTENT_SECURITY_POLICY);
    assert_eq!(h["cache-control"], "no-cache");
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["referrer-policy"], "no-referrer");
    let etag = h["etag"].to_str().unwrap().to_owned();
    assert_eq!(etag, format!("\"{}\"", build_id()));
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "require-trusted-types-for 'script'",
        "frame-ancestors 'none'",
    ] {
        assert!(CONTENT_SECURITY_POLICY.contains(directive), "{directive}");
    }
    assert!(!CONTENT_SECURITY_POLICY.contains("unsafe"));
    let html = r.text().await.unwrap();
    assert!(html.contains(&format!("assets/{}/js/main.js", build_id())));
    assert!(!html.contains("{{"), "a placeholder is left: {html}");
    // The policy forbids inline script and style: the page has none.
    for (i, _) in html.match_indices("<script") {
        let tag = &html[i..i + html[i..].find('>').unwrap()];
        assert!(tag.contains(" src="), "inline script: {tag}");
    }
    for bad in [" style=", " onclick=", " onload=", "javascript:"] {
        assert!(!html.contains(bad), "{bad} in the page");
    }
    let again = t
        .http
        .get(format!("{}/", t.base))
        .header("if-none-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);
    assert_eq!(
        again.headers()["content-security-policy"],
        CONTENT_SECURITY_POLICY
    );
}

#[tokio::test]
async fn every_file_is_served_with_its_type_and_cached_for_good() {
    let t = TestServer::start(Setup::default()).await;
    let build = build_id();
    for asset in ASSETS {
        let r = t.get(&format!("/assets/{build}/{}", asset.path)).await;
        assert_eq!(r.status(), 200, "{}", asset.path);
        let h = r.headers().clone();
        let expected = match asset.path.rsplit_once('.').unwrap().1 {
            "js" => "text/javascript; charset=utf-8",
            "css" => "text/css; charset=utf-8",
            "svg" => "image/svg+xml",
            "txt" => "text/plain; charset=utf-8",
            other => panic!("no expected type for .{other}"),
        };
        assert_eq!(h["content-type"], expected, "{}", asset.path);
        assert_eq!(h["cache-control"], "public, max-age=31536000, immutable");
        assert_eq!(h["content-security-policy"], CONTENT_SECURITY_POLICY);
        assert_eq!(h["x-content-type-options"], "nosniff");
        assert_eq!(r.bytes().await.unwrap().as_ref(), asset.bytes);
    }
    // Another build's files, unknown files and escapes are not found.
    for path in [
        format!("/assets/0000000000000000/{}", ASSETS[0].path),
        format!("/assets/{build}/nope.js"),
        format!("/assets/{build}/../keel.toml"),
        format!("/assets/{build}/vendor/vendor.json"),
        format!("/assets/{build}/index.html"),
        "/assets/".to_owned(),
    ] {
        let r = t.get(&path).await;
        assert_eq!(r.status(), 404, "{path}");
    }
}

#[tokio::test]
async fn the_page_needs_no_token_but_the_api_does() {
    let t = TestServer::start(Setup {
        token: Some("s3cret"),
        ..Setup::default()
    })
    .await;
    let anonymous = |path: String| {
        let http = t.http.clone();
        let url = format!("{}{path}", t.base);
        async move { http.get(url).send().await.unwrap().status() }
    };
    assert_eq!(anonymous("/".to_owned()).await, 200);
    assert_eq!(
        anonymous(format!("/assets/{}/js/main.js", build_id())).await,
        200
    );
    assert_eq!(anonymous("/api/dialogs".to_owned()).await, 401);
}

#[test]
fn every_file_of_the_page_is_embedded() {
    let mut files = Vec::new();
    files_under(Path::new(WEB), &mut files);
    let on_disk: BTreeSet<String> = files.iter().map(|p| relative(p)).collect();
    let embedded: BTreeSet<String> = ASSETS
        .iter()
        .map(|a| a.path.to_owned())
        .chain(NOT_ASSETS.iter().map(|p| (*p).to_owned()))
        .collect();
    assert_eq!(
        on_disk, embedded,
        "web/ and the ASSETS table differ: add the file to ASSETS in serve/web.rs (or remove it)"
    );
    // Every module a module imports is embedded too.
    for asset in ASSETS.iter().filter(|a| a.path.starts_with("js/")) {
        let text = std::str::from_utf8(asset.bytes).unwrap();
        for line in text.lines().filter(|l| l.starts_with("import ")) {
            let target = line.rsplit(['\'', '"']).nth(1).unwrap();
            let resolved = Path::new("js").join(target);
            let mut parts: Vec<&str> = Vec::new();
            for c in resolved.iter().map(|c| c.to_str().unwrap()) {
                match c {
                    "." => {}
                    ".." => {
                        parts.pop();
                    }
                    c => parts.push(c),
                }
            }
            let path = parts.join("/");
            assert!(
                ASSETS.iter().any(|a| a.path == path),
                "{} imports {target}, which is not embedded",
                asset.path
            );
        }
    }
}

#[test]
fn vendored_libraries_are_the_files_their_manifest_records() {
    let vendor = Path::new(WEB).join("vendor");
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(vendor.join("vendor.json")).unwrap())
            .unwrap();
    let mut listed = BTreeSet::from(["vendor.json".to_owned(), "update.py".to_owned()]);
    for package in manifest["packages"].as_array().unwrap() {
        let name = package["name"].as_str().unwrap();
        let version = package["version"].as_str().unwrap();
        assert!(
            package["integrity"]
                .as_str()
                .unwrap()
                .starts_with("sha512-"),
            "{name}"
        );
        for file in package["files"].as_array().unwrap() {
            let file_name = file["file"].as_str().unwrap();
            let bytes = std::fs::read(vendor.join(file_name)).unwrap();
            let digest: String = Sha256::digest(&bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            assert_eq!(
                digest,
                file["sha256"].as_str().unwrap(),
                "vendor/{file_name} is not the file {name}@{version} ships: re-run vendor/update.py"
            );
            // The code names its version in its licence banner.
            if file_name.ends_with(".js") {
                let head = String::from_utf8_lossy(&bytes[..bytes.len().min(400)]).to_string();
                assert!(
                    head.contains(&format!("v{version}")) || head.contains(&format!(" {version} ")),
                    "vendor/{file_name} does not say it is {name} {version}: {head}"
                );
            }
            listed.insert(file_name.to_owned());
        }
        assert!(
            package["files"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["file"].as_str().unwrap().starts_with("LICENSE")),
            "{name} is vendored without its licence"
        );
    }
    let present: BTreeSet<String> = std::fs::read_dir(&vendor)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        present, listed,
        "vendor/ holds files its manifest does not record"
    );
}
