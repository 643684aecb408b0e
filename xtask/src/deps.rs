//! `cargo xtask deps`: the layering check. Reads `cargo metadata` and rejects
//! any workspace edge that points to a later layer, any workspace crate the
//! layer table does not name, and heavy dependencies in low layers.

use std::collections::BTreeMap;
use std::fmt;

/// Every workspace crate and its place. The order is the rule: a crate may
/// depend only on crates with a smaller layer.
pub const LAYERS: &[(&str, Layer)] = &[
    ("keel-core", Layer::Ordered(0)),
    ("keel-providers", Layer::Ordered(1)),
    ("keel-store", Layer::Ordered(2)),
    ("keel-catalog", Layer::Ordered(3)),
    ("keel-engine", Layer::Ordered(4)),
    ("keel-gateway", Layer::Ordered(5)),
    ("keel-e2e", Layer::Ordered(6)),
    ("xtask", Layer::Tooling),
];

/// Crates that may use HTTP/web dependencies.
const HTTP_LAYERS: &[&str] = &["keel-providers", "keel-gateway", "keel-e2e"];

/// HTTP clients and servers: only the layers that own HTTP may use them.
const HTTP_DEPS: &[&str] = &[
    "reqwest",
    "hyper",
    "hyper-util",
    "axum",
    "tower-http",
    "ureq",
    "actix-web",
    "warp",
];

/// Crates whose normal dependencies must stay runtime-agnostic: no tokio
/// networking or multi-threaded runtime.
const LEAN_LAYERS: &[&str] = &["keel-core", "keel-store", "keel-catalog"];
const HEAVY_TOKIO_FEATURES: &[&str] = &["full", "net", "rt-multi-thread", "process", "io-std"];

/// Where a crate sits in the layer table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    /// A product layer; lower numbers are further left.
    Ordered(u8),
    /// Build tooling: depends on no workspace crate.
    Tooling,
}

/// The kind of a dependency edge, as cargo metadata reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepKind {
    /// `[dependencies]`.
    Normal,
    /// `[dev-dependencies]`.
    Dev,
    /// `[build-dependencies]`.
    Build,
}

/// One declared dependency of a workspace crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dep {
    /// Package name.
    pub name: String,
    /// Edge kind.
    pub kind: DepKind,
    /// Features enabled on the edge (including default if not disabled).
    pub features: Vec<String>,
}

/// A workspace crate and its declared dependencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    /// Package name.
    pub name: String,
    /// Its dependencies.
    pub deps: Vec<Dep>,
}

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// `from` depends on `to`, which is not to its left.
    UpwardEdge {
        from: String,
        to: String,
        kind: DepKind,
    },
    /// A workspace crate missing from [`LAYERS`].
    UnknownCrate { name: String },
    /// An HTTP dependency outside the HTTP layers.
    HttpInLowLayer { krate: String, dep: String },
    /// A heavy tokio feature in a lean layer.
    HeavyTokio { krate: String, feature: String },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let order = "core < providers < store < catalog < engine < gateway < e2e";
        match self {
            Violation::UpwardEdge { from, to, kind } => write!(
                f,
                "{from} depends on {to} ({kind:?} dependency), but {to} is not to the left of {from} in the layer order {order}"
            ),
            Violation::UnknownCrate { name } => write!(
                f,
                "workspace crate {name} is not in the layer table (xtask/src/deps.rs LAYERS); give it a layer"
            ),
            Violation::HttpInLowLayer { krate, dep } => write!(
                f,
                "{krate} depends on {dep}, but HTTP stays in keel-providers and keel-gateway"
            ),
            Violation::HeavyTokio { krate, feature } => write!(
                f,
                "{krate} enables tokio feature {feature:?}; core, store and catalog stay runtime-agnostic"
            ),
        }
    }
}

fn layer_of(name: &str) -> Option<Layer> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
}

/// Checks the workspace packages against the layer rules.
pub fn check(packages: &[Package]) -> Vec<Violation> {
    let workspace: BTreeMap<&str, &Package> =
        packages.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut out = Vec::new();
    for pkg in packages {
        let Some(own) = layer_of(&pkg.name) else {
            out.push(Violation::UnknownCrate {
                name: pkg.name.clone(),
            });
            continue;
        };
        for dep in &pkg.deps {
            // A dev-dependency of a crate on itself only turns on its test
            // features (such as `testing`) for its own tests: not an edge.
            if dep.name == pkg.name && dep.kind == DepKind::Dev {
                continue;
            }
            if workspace.contains_key(dep.name.as_str()) {
                let allowed = match (own, layer_of(&dep.name)) {
                    (Layer::Ordered(a), Some(Layer::Ordered(b))) => b < a,
                    // Tooling depends on nothing in the workspace, and nothing
                    // depends on tooling; unknown crates are reported above.
                    (_, None) => true,
                    _ => false,
                };
                if !allowed {
                    out.push(Violation::UpwardEdge {
                        from: pkg.name.clone(),
                        to: dep.name.clone(),
                        kind: dep.kind,
                    });
                }
            }
            if HTTP_DEPS.contains(&dep.name.as_str())
                && own != Layer::Tooling
                && !HTTP_LAYERS.contains(&pkg.name.as_str())
            {
                out.push(Violation::HttpInLowLayer {
                    krate: pkg.name.clone(),
                    dep: dep.name.clone(),
                });
            }
            if dep.name == "tokio"
                && dep.kind != DepKind::Dev
                && LEAN_LAYERS.contains(&pkg.name.as_str())
            {
                for f in &dep.features {
                    if HEAVY_TOKIO_FEATURES.contains(&f.as_str()) {
                        out.push(Violation::HeavyTokio {
                            krate: pkg.name.clone(),
                            feature: f.clone(),
                        });
                    }
                }
            }
        }
    }
    out
}

/// Extracts workspace packages from `cargo metadata --format-version 1 --no-deps` JSON.
pub fn packages_from_metadata(json: &serde_json::Value) -> Result<Vec<Package>, String> {
    let packages = json
        .get("packages")
        .and_then(|p| p.as_array())
        .ok_or("cargo metadata has no packages array")?;
    let mut out = Vec::new();
    for p in packages {
        let name = p
            .get("name")
            .and_then(|n| n.as_str())
            .ok_or("package without a name")?
            .to_owned();
        let mut deps = Vec::new();
        for d in p
            .get("dependencies")
            .and_then(|d| d.as_array())
            .into_iter()
            .flatten()
        {
            let dep_name = d
                .get("name")
                .and_then(|n| n.as_str())
                .ok_or("dependency without a name")?;
            let kind = match d.get("kind").and_then(|k| k.as_str()) {
                Some("dev") => DepKind::Dev,
                Some("build") => DepKind::Build,
                _ => DepKind::Normal,
            };
            let features = d
                .get("features")
                .and_then(|f| f.as_array())
                .into_iter()
                .flatten()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect();
            deps.push(Dep {
                name: dep_name.to_owned(),
                kind,
                features,
            });
        }
        out.push(Package { name, deps });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkg(name: &str, deps: &[(&str, DepKind)]) -> Package {
        Package {
            name: name.into(),
            deps: deps
                .iter()
                .map(|(n, k)| Dep {
                    name: (*n).into(),
                    kind: *k,
                    features: vec![],
                })
                .collect(),
        }
    }

    fn clean() -> Vec<Package> {
        vec![
            pkg("keel-core", &[("serde", DepKind::Normal)]),
            pkg("keel-store", &[("keel-core", DepKind::Normal)]),
            pkg(
                "keel-engine",
                &[
                    ("keel-store", DepKind::Normal),
                    ("keel-core", DepKind::Normal),
                ],
            ),
            pkg(
                "keel-gateway",
                &[("keel-engine", DepKind::Normal), ("axum", DepKind::Normal)],
            ),
            pkg("xtask", &[("serde_json", DepKind::Normal)]),
        ]
    }

    #[test]
    fn a_clean_graph_passes() {
        assert_eq!(check(&clean()), vec![]);
    }

    #[test]
    fn upward_edge_names_both_crates() {
        let mut pkgs = clean();
        pkgs[1].deps.push(Dep {
            name: "keel-engine".into(),
            kind: DepKind::Normal,
            features: vec![],
        });
        let v = check(&pkgs);
        assert_eq!(v.len(), 1);
        let msg = v[0].to_string();
        assert!(
            msg.contains("keel-store") && msg.contains("keel-engine"),
            "{msg}"
        );
    }

    #[test]
    fn upward_dev_edge_is_rejected_too() {
        let mut pkgs = clean();
        pkgs[0].deps.push(Dep {
            name: "keel-gateway".into(),
            kind: DepKind::Dev,
            features: vec![],
        });
        let msg = check(&pkgs)[0].to_string();
        assert!(
            msg.contains("keel-core depends on keel-gateway (Dev"),
            "{msg}"
        );
    }

    #[test]
    fn a_dev_dependency_on_itself_is_no_edge() {
        let mut pkgs = clean();
        pkgs[1].deps.push(Dep {
            name: "keel-store".into(),
            kind: DepKind::Dev,
            features: vec!["testing".into()],
        });
        assert_eq!(check(&pkgs), vec![]);
    }

    #[test]
    fn unknown_crate_is_rejected() {
        let mut pkgs = clean();
        pkgs.push(pkg("keel-extra", &[("keel-core", DepKind::Normal)]));
        let msg = check(&pkgs)[0].to_string();
        assert!(
            msg.contains("keel-extra") && msg.contains("layer table"),
            "{msg}"
        );
    }

    #[test]
    fn http_dependency_in_a_low_layer_names_both() {
        let mut pkgs = clean();
        pkgs[1].deps.push(Dep {
            name: "reqwest".into(),
            kind: DepKind::Normal,
            features: vec![],
        });
        let msg = check(&pkgs)[0].to_string();
        assert!(msg.contains("keel-store depends on reqwest"), "{msg}");
    }

    #[test]
    fn heavy_tokio_feature_in_core_is_rejected() {
        let mut pkgs = clean();
        pkgs[0].deps.push(Dep {
            name: "tokio".into(),
            kind: DepKind::Normal,
            features: vec!["time".into(), "net".into()],
        });
        let v = check(&pkgs);
        assert_eq!(v.len(), 1);
        assert!(v[0]
            .to_string()
            .contains("keel-core enables tokio feature \"net\""));
    }

    #[test]
    fn tooling_must_not_depend_on_product_crates() {
        let mut pkgs = clean();
        pkgs[4].deps.push(Dep {
            name: "keel-core".into(),
            kind: DepKind::Normal,
            features: vec![],
        });
        assert!(matches!(check(&pkgs)[0], Violation::UpwardEdge { .. }));
    }

    /// The real workspace obeys the rules (the check runs under `cargo test` too).
    #[test]
    fn the_workspace_is_layered() {
        let meta = crate::cargo_metadata().expect("cargo metadata");
        let pkgs = packages_from_metadata(&meta).unwrap();
        assert!(pkgs.len() >= 8, "found {} packages", pkgs.len());
        let v = check(&pkgs);
        assert!(v.is_empty(), "{v:#?}");
    }
}
