//! `cargo xtask deps`: the layering check. Reads `cargo metadata` and rejects
//! a workspace edge the table [`ALLOWED`] does not list, a workspace crate the
//! table does not name, an HTTP crate anywhere in the dependency closure of a
//! crate that must not speak HTTP, and tokio features a layer must not pull
//! (again over the whole closure, so an edge through another crate counts).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

/// Every workspace crate and the workspace crates it may depend on (any
/// kind of dependency: normal, dev or build). Not a line: providers, store
/// and catalog are siblings that know only core.
pub const ALLOWED: &[(&str, &[&str])] = &[
    ("keel-core", &[]),
    ("keel-providers", &["keel-core"]),
    ("keel-store", &["keel-core"]),
    // The PostgreSQL backend, at the store's layer: it implements
    // keel-store's Backend. Only the gateway (and the tests) link it.
    ("keel-store-postgres", &["keel-core", "keel-store"]),
    ("keel-catalog", &["keel-core"]),
    ("keel-engine", &["keel-core", "keel-store", "keel-catalog"]),
    (
        "keel-gateway",
        &[
            "keel-core",
            "keel-providers",
            "keel-store",
            "keel-store-postgres",
            "keel-catalog",
            "keel-engine",
        ],
    ),
    (
        "keel-e2e",
        &[
            "keel-core",
            "keel-providers",
            "keel-store",
            "keel-store-postgres",
            "keel-catalog",
            "keel-engine",
            "keel-gateway",
        ],
    ),
    // Tooling builds the product; it links none of it.
    ("xtask", &[]),
];

/// Crates whose dependency closure (what they link, and what their tests
/// link) must not contain an HTTP client or server.
const NO_HTTP: &[&str] = &[
    "keel-core",
    "keel-store",
    "keel-store-postgres",
    "keel-catalog",
    "keel-engine",
];

/// HTTP clients, servers and WebSocket stacks.
const HTTP_DEPS: &[&str] = &[
    "reqwest",
    "hyper",
    "hyper-util",
    "h2",
    "axum",
    "tower-http",
    "ureq",
    "actix-web",
    "warp",
    "tungstenite",
    "tokio-tungstenite",
];

/// Tokio features each crate's normal closure must not enable (after the
/// feature implications of tokio itself, so `full` counts as `net`). Core,
/// store and catalog stay runtime-agnostic; the engine may spawn tasks and
/// processes but owns no sockets, no multi-threaded runtime and no stdio.
const TOKIO_BANS: &[(&str, &[&str])] = &[
    (
        "keel-core",
        &["net", "rt-multi-thread", "process", "io-std", "signal"],
    ),
    (
        "keel-store",
        &["net", "rt-multi-thread", "process", "io-std", "signal"],
    ),
    (
        "keel-catalog",
        &["net", "rt-multi-thread", "process", "io-std", "signal"],
    ),
    (
        "keel-engine",
        &["net", "rt-multi-thread", "io-std", "signal"],
    ),
];

/// The kind of a dependency edge, as cargo metadata reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DepKind {
    /// `[dependencies]`.
    Normal,
    /// `[dev-dependencies]`.
    Dev,
    /// `[build-dependencies]`.
    Build,
}

/// One resolved dependency edge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dep {
    /// Package id of the dependency (its name in the tests).
    pub id: String,
    /// Edge kind.
    pub kind: DepKind,
    /// Features the depending crate asks for on this edge (`default`
    /// included unless default features are off).
    pub features: Vec<String>,
}

/// A package of the resolved graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    /// Package name.
    pub name: String,
    /// A member of this workspace.
    pub workspace: bool,
    /// Its activated dependencies.
    pub deps: Vec<Dep>,
    /// Its feature table (`feature → what it enables`).
    pub features: BTreeMap<String, Vec<String>>,
}

/// The resolved dependency graph, keyed by package id.
pub type Graph = BTreeMap<String, Package>;

/// One broken rule; each names both ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A workspace edge [`ALLOWED`] does not list.
    ForbiddenEdge {
        /// The depending crate.
        from: String,
        /// The crate it depends on.
        to: String,
        /// Edge kind.
        kind: DepKind,
    },
    /// A workspace crate missing from [`ALLOWED`].
    UnknownCrate {
        /// The crate.
        name: String,
    },
    /// An HTTP crate in the closure of a crate that must not speak HTTP.
    Http {
        /// The crate under the ban.
        krate: String,
        /// The HTTP crate.
        dep: String,
        /// Package names from `krate` to `dep`.
        path: Vec<String>,
    },
    /// A banned tokio feature in a crate's normal closure.
    Tokio {
        /// The crate under the ban.
        krate: String,
        /// The banned feature.
        feature: String,
        /// The crate whose edge to tokio asks for it (or for a feature implying it).
        requested_by: String,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::ForbiddenEdge { from, to, kind } => {
                let allowed = allowed_for(from).unwrap_or(&[]);
                let allowed = if allowed.is_empty() {
                    "no workspace crate".to_owned()
                } else {
                    allowed.join(", ")
                };
                write!(
                    f,
                    "{from} depends on {to} ({kind:?} dependency), but {from} may depend only on {allowed} (xtask/src/deps.rs ALLOWED)"
                )
            }
            Violation::UnknownCrate { name } => write!(
                f,
                "workspace crate {name} is not in the layer table (xtask/src/deps.rs ALLOWED); list what it may depend on"
            ),
            Violation::Http { krate, dep, path } => write!(
                f,
                "{krate} links {dep} ({}), but HTTP stays in keel-providers and keel-gateway",
                path.join(" → ")
            ),
            Violation::Tokio {
                krate,
                feature,
                requested_by,
            } => write!(
                f,
                "{krate} links tokio with feature {feature:?} (asked for by {requested_by}); {krate} must not use tokio {}",
                bans_for(krate).join("/")
            ),
        }
    }
}

fn allowed_for(name: &str) -> Option<&'static [&'static str]> {
    ALLOWED.iter().find(|(n, _)| *n == name).map(|(_, a)| *a)
}

fn bans_for(name: &str) -> &'static [&'static str] {
    TOKIO_BANS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(&[], |(_, b)| *b)
}

/// Checks the graph against the layer rules.
pub fn check(graph: &Graph) -> Vec<Violation> {
    let mut out = Vec::new();
    for (id, pkg) in graph.iter().filter(|(_, p)| p.workspace) {
        let Some(allowed) = allowed_for(&pkg.name) else {
            out.push(Violation::UnknownCrate {
                name: pkg.name.clone(),
            });
            continue;
        };
        for dep in &pkg.deps {
            let Some(target) = graph.get(&dep.id) else {
                continue;
            };
            // A dev-dependency on itself only turns on features (such as
            // `testing`) for the crate's own tests; it is no edge.
            if dep.id == *id && dep.kind == DepKind::Dev {
                continue;
            }
            if target.workspace && !allowed.contains(&target.name.as_str()) {
                out.push(Violation::ForbiddenEdge {
                    from: pkg.name.clone(),
                    to: target.name.clone(),
                    kind: dep.kind,
                });
            }
        }
        if NO_HTTP.contains(&pkg.name.as_str()) {
            // Tests link dev-dependencies too, so they count on the first
            // hop; the walk stops at an HTTP crate (what it pulls is its own).
            let is_http = |p: &Package| HTTP_DEPS.contains(&p.name.as_str());
            for (dep, path) in closure(graph, id, true, &is_http) {
                if HTTP_DEPS.contains(&graph[&dep].name.as_str()) {
                    out.push(Violation::Http {
                        krate: pkg.name.clone(),
                        dep: graph[&dep].name.clone(),
                        path,
                    });
                }
            }
        }
        let bans = bans_for(&pkg.name);
        if !bans.is_empty() {
            out.extend(tokio_violations(graph, id, bans));
        }
    }
    out
}

/// Every package reachable from `root` over normal and build edges (and the
/// root's own dev edges when `with_dev`), with the shortest path of names;
/// the walk does not go past a package for which `stop` holds.
fn closure(
    graph: &Graph,
    root: &str,
    with_dev: bool,
    stop: &dyn Fn(&Package) -> bool,
) -> BTreeMap<String, Vec<String>> {
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut queue = VecDeque::from([(root.to_owned(), vec![graph[root].name.clone()])]);
    while let Some((id, path)) = queue.pop_front() {
        for dep in &graph[&id].deps {
            let first_hop = id == root;
            if dep.kind == DepKind::Dev && !(with_dev && first_hop) {
                continue;
            }
            if dep.id == root || seen.contains_key(&dep.id) || !graph.contains_key(&dep.id) {
                continue;
            }
            let mut next = path.clone();
            next.push(graph[&dep.id].name.clone());
            seen.insert(dep.id.clone(), next.clone());
            if !stop(&graph[&dep.id]) {
                queue.push_back((dep.id.clone(), next));
            }
        }
    }
    seen
}

fn tokio_violations(graph: &Graph, root: &str, bans: &[&str]) -> Vec<Violation> {
    let mut members: Vec<String> = closure(graph, root, false, &|_| false)
        .into_keys()
        .collect();
    members.push(root.to_owned());
    let mut out = Vec::new();
    let mut reported = BTreeSet::new();
    for member in &members {
        for dep in &graph[member].deps {
            let Some(tokio) = graph.get(&dep.id).filter(|p| p.name == "tokio") else {
                continue;
            };
            if dep.kind == DepKind::Dev {
                continue;
            }
            for feature in implied_features(&tokio.features, &dep.features) {
                if bans.contains(&feature.as_str()) && reported.insert(feature.clone()) {
                    out.push(Violation::Tokio {
                        krate: graph[root].name.clone(),
                        feature,
                        requested_by: graph[member].name.clone(),
                    });
                }
            }
        }
    }
    out
}

/// `requested` and every feature they enable, through `table`.
fn implied_features(
    table: &BTreeMap<String, Vec<String>>,
    requested: &[String],
) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    let mut todo: Vec<String> = requested.to_vec();
    while let Some(f) = todo.pop() {
        if all.insert(f.clone()) {
            // `dep:x` and `x/feature` enable dependencies, not own features.
            todo.extend(table.get(&f).into_iter().flatten().cloned());
        }
    }
    all
}

/// The resolved graph from `cargo metadata --format-version 1` JSON (with
/// the `resolve` section).
pub fn graph_from_metadata(json: &serde_json::Value) -> Result<Graph, String> {
    let members: BTreeSet<&str> = json["workspace_members"]
        .as_array()
        .ok_or("cargo metadata has no workspace_members")?
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    let packages: BTreeMap<&str, &serde_json::Value> = json["packages"]
        .as_array()
        .ok_or("cargo metadata has no packages array")?
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let nodes = json["resolve"]["nodes"]
        .as_array()
        .ok_or("cargo metadata has no resolve graph (was --no-deps given?)")?;
    let mut graph = Graph::new();
    for node in nodes {
        let id = node["id"].as_str().ok_or("resolve node without an id")?;
        let pkg = packages
            .get(id)
            .ok_or_else(|| format!("resolve node {id} has no package"))?;
        let mut deps = Vec::new();
        for d in node["deps"].as_array().into_iter().flatten() {
            let dep_id = d["pkg"].as_str().ok_or("resolve dep without a pkg")?;
            let dep_name = packages
                .get(dep_id)
                .and_then(|p| p["name"].as_str())
                .unwrap_or_default();
            let kinds: BTreeSet<DepKind> = d["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|k| kind_of(&k["kind"]))
                .collect();
            for kind in kinds {
                deps.push(Dep {
                    id: dep_id.to_owned(),
                    kind,
                    features: requested_features(pkg, dep_name, kind),
                });
            }
        }
        let features = pkg["features"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| {
                let enables = v
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect();
                (k.clone(), enables)
            })
            .collect();
        graph.insert(
            id.to_owned(),
            Package {
                name: pkg["name"].as_str().unwrap_or_default().to_owned(),
                workspace: members.contains(id),
                deps,
                features,
            },
        );
    }
    Ok(graph)
}

fn kind_of(v: &serde_json::Value) -> DepKind {
    match v.as_str() {
        Some("dev") => DepKind::Dev,
        Some("build") => DepKind::Build,
        _ => DepKind::Normal,
    }
}

/// The features `pkg` declares on its dependency `dep_name` of `kind`
/// (all declarations of it, e.g. per target, together).
fn requested_features(pkg: &serde_json::Value, dep_name: &str, kind: DepKind) -> Vec<String> {
    let mut out = BTreeSet::new();
    for d in pkg["dependencies"].as_array().into_iter().flatten() {
        if d["name"].as_str() != Some(dep_name) || kind_of(&d["kind"]) != kind {
            continue;
        }
        if d["uses_default_features"].as_bool().unwrap_or(true) {
            out.insert("default".to_owned());
        }
        for f in d["features"].as_array().into_iter().flatten() {
            if let Some(f) = f.as_str() {
                out.insert(f.to_owned());
            }
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A graph in which every id is the package name.
    struct G(Graph);

    impl G {
        fn new() -> Self {
            let mut g = G(Graph::new());
            for name in ["keel-core", "keel-providers", "keel-store", "keel-catalog"] {
                g.krate(name);
            }
            for name in ["keel-engine", "keel-gateway", "keel-e2e", "xtask"] {
                g.krate(name);
            }
            g.edge("keel-providers", "keel-core", DepKind::Normal);
            g.edge("keel-store", "keel-core", DepKind::Normal);
            g.edge("keel-catalog", "keel-core", DepKind::Normal);
            for to in ["keel-core", "keel-store", "keel-catalog"] {
                g.edge("keel-engine", to, DepKind::Normal);
            }
            for to in ["keel-engine", "keel-providers", "keel-store"] {
                g.edge("keel-gateway", to, DepKind::Normal);
            }
            g.edge("keel-e2e", "keel-gateway", DepKind::Dev);
            g.third_party("reqwest");
            g.edge("reqwest", "hyper", DepKind::Normal);
            g.edge("keel-providers", "reqwest", DepKind::Normal);
            g.third_party("axum");
            g.edge("keel-gateway", "axum", DepKind::Normal);
            g.third_party("tokio");
            let table: &[(&str, &[&str])] = &[
                ("default", &[]),
                ("full", &["net", "rt-multi-thread", "time"]),
                ("net", &["dep:socket2"]),
                ("rt-multi-thread", &["rt"]),
                ("rt", &[]),
                ("time", &[]),
                ("process", &[]),
            ];
            g.0.get_mut("tokio").unwrap().features = table
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.iter().map(|s| (*s).to_owned()).collect()))
                .collect();
            g.tokio("keel-core", &["time"]);
            g.tokio("keel-engine", &["rt", "process"]);
            g.tokio("keel-gateway", &["full"]);
            g
        }

        fn add(&mut self, name: &str, workspace: bool) {
            self.0.entry(name.to_owned()).or_insert(Package {
                name: name.to_owned(),
                workspace,
                deps: vec![],
                features: BTreeMap::new(),
            });
        }

        fn krate(&mut self, name: &str) {
            self.add(name, true);
        }

        fn third_party(&mut self, name: &str) {
            self.add(name, false);
        }

        fn edge(&mut self, from: &str, to: &str, kind: DepKind) {
            self.add(to, false);
            self.0.get_mut(from).unwrap().deps.push(Dep {
                id: to.to_owned(),
                kind,
                features: vec![],
            });
        }

        fn tokio(&mut self, from: &str, features: &[&str]) {
            self.0.get_mut(from).unwrap().deps.push(Dep {
                id: "tokio".to_owned(),
                kind: DepKind::Normal,
                features: features.iter().map(|s| (*s).to_owned()).collect(),
            });
        }

        fn messages(&self) -> Vec<String> {
            check(&self.0).iter().map(ToString::to_string).collect()
        }
    }

    #[test]
    fn a_clean_graph_passes() {
        assert_eq!(G::new().messages(), Vec::<String>::new());
    }

    #[test]
    fn catalog_on_store_is_rejected_naming_both() {
        let mut g = G::new();
        g.edge("keel-catalog", "keel-store", DepKind::Normal);
        assert_eq!(
            g.messages(),
            ["keel-catalog depends on keel-store (Normal dependency), but keel-catalog may depend only on keel-core (xtask/src/deps.rs ALLOWED)"]
        );
    }

    #[test]
    fn store_on_providers_is_rejected_and_so_is_the_reqwest_behind_it() {
        let mut g = G::new();
        g.edge("keel-store", "keel-providers", DepKind::Normal);
        assert_eq!(
            g.messages(),
            [
                // The engine links the store, so it links reqwest too.
                "keel-engine links reqwest (keel-engine → keel-store → keel-providers → reqwest), but HTTP stays in keel-providers and keel-gateway",
                "keel-store depends on keel-providers (Normal dependency), but keel-store may depend only on keel-core (xtask/src/deps.rs ALLOWED)",
                "keel-store links reqwest (keel-store → keel-providers → reqwest), but HTTP stays in keel-providers and keel-gateway",
            ]
        );
    }

    #[test]
    fn a_transitive_reqwest_under_store_is_rejected_with_its_path() {
        let mut g = G::new();
        g.third_party("some-sdk");
        g.edge("some-sdk", "reqwest", DepKind::Normal);
        g.edge("keel-store", "some-sdk", DepKind::Normal);
        let msgs = g.messages();
        assert!(
            msgs.contains(&"keel-store links reqwest (keel-store → some-sdk → reqwest), but HTTP stays in keel-providers and keel-gateway".to_owned()),
            "{msgs:#?}"
        );
        // The engine above the store is reported with its longer path; the
        // walk stops at reqwest, so the hyper below it is not repeated.
        assert_eq!(msgs.len(), 2, "{msgs:#?}");
        assert!(
            msgs[0].starts_with(
                "keel-engine links reqwest (keel-engine → keel-store → some-sdk → reqwest)"
            ),
            "{msgs:#?}"
        );
    }

    #[test]
    fn http_in_a_dev_dependency_of_a_banned_crate_is_rejected() {
        let mut g = G::new();
        g.edge("keel-engine", "axum", DepKind::Dev);
        assert_eq!(
            g.messages(),
            ["keel-engine links axum (keel-engine → axum), but HTTP stays in keel-providers and keel-gateway"]
        );
    }

    #[test]
    fn a_dev_dependency_of_a_dependency_is_not_linked() {
        let mut g = G::new();
        // Only core's own tests link this; the crates above core do not.
        g.third_party("mock-server");
        g.edge("mock-server", "hyper", DepKind::Normal);
        g.edge("keel-core", "mock-server", DepKind::Dev);
        let msgs = g.messages();
        assert_eq!(
            msgs,
            ["keel-core links hyper (keel-core → mock-server → hyper), but HTTP stays in keel-providers and keel-gateway"]
        );
    }

    #[test]
    fn a_forbidden_dev_edge_is_rejected_too() {
        let mut g = G::new();
        g.edge("keel-core", "keel-gateway", DepKind::Dev);
        let msgs = g.messages();
        assert!(
            msgs[0].starts_with("keel-core depends on keel-gateway (Dev dependency), but keel-core may depend only on no workspace crate"),
            "{msgs:#?}"
        );
    }

    #[test]
    fn a_dev_dependency_on_itself_is_allowed_and_a_normal_one_is_not() {
        let mut g = G::new();
        g.edge("keel-engine", "keel-engine", DepKind::Dev);
        assert_eq!(g.messages(), Vec::<String>::new());
        g.edge("keel-engine", "keel-engine", DepKind::Normal);
        assert_eq!(
            g.messages(),
            ["keel-engine depends on keel-engine (Normal dependency), but keel-engine may depend only on keel-core, keel-store, keel-catalog (xtask/src/deps.rs ALLOWED)"]
        );
    }

    #[test]
    fn tooling_depends_on_no_product_crate() {
        let mut g = G::new();
        g.edge("xtask", "keel-core", DepKind::Normal);
        assert_eq!(
            g.messages(),
            ["xtask depends on keel-core (Normal dependency), but xtask may depend only on no workspace crate (xtask/src/deps.rs ALLOWED)"]
        );
    }

    #[test]
    fn an_unknown_workspace_crate_is_rejected() {
        let mut g = G::new();
        g.krate("keel-extra");
        g.edge("keel-extra", "keel-core", DepKind::Normal);
        assert_eq!(
            g.messages(),
            ["workspace crate keel-extra is not in the layer table (xtask/src/deps.rs ALLOWED); list what it may depend on"]
        );
    }

    #[test]
    fn a_banned_tokio_feature_is_found_through_implications_and_other_crates() {
        let mut g = G::new();
        // core asks for `full`, which implies `net` and `rt-multi-thread`.
        g.tokio("keel-core", &["full"]);
        let msgs = g.messages();
        for krate in ["keel-core", "keel-store", "keel-catalog"] {
            assert!(
                msgs.contains(&format!("{krate} links tokio with feature \"net\" (asked for by keel-core); {krate} must not use tokio net/rt-multi-thread/process/io-std/signal")),
                "{msgs:#?}"
            );
        }
        // The engine reaches core's `net` too; `process` is allowed there.
        assert!(
            msgs.iter().any(|m| m.starts_with(
                "keel-engine links tokio with feature \"net\" (asked for by keel-core)"
            )),
            "{msgs:#?}"
        );
        assert!(!msgs.iter().any(|m| m.contains("\"process\"")), "{msgs:#?}");
    }

    #[test]
    fn process_is_banned_in_store_but_not_in_the_engine() {
        let mut g = G::new();
        g.tokio("keel-store", &["process"]);
        assert_eq!(
            g.messages(),
            ["keel-store links tokio with feature \"process\" (asked for by keel-store); keel-store must not use tokio net/rt-multi-thread/process/io-std/signal"]
        );
    }

    #[test]
    fn tokio_features_of_dev_dependencies_do_not_count() {
        let mut g = G::new();
        g.0.get_mut("keel-store").unwrap().deps.push(Dep {
            id: "tokio".into(),
            kind: DepKind::Dev,
            features: vec!["rt-multi-thread".into()],
        });
        assert_eq!(g.messages(), Vec::<String>::new());
    }

    /// The real workspace obeys the rules (the check runs under `cargo test` too).
    #[test]
    fn the_workspace_is_layered() {
        let meta = crate::cargo_metadata().expect("cargo metadata");
        let graph = graph_from_metadata(&meta).unwrap();
        let members: Vec<&str> = graph
            .values()
            .filter(|p| p.workspace)
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(members.len(), ALLOWED.len(), "{members:?}");
        let v = check(&graph);
        assert!(v.is_empty(), "{v:#?}");
        // The closure walk sees through the real graph: providers links reqwest.
        let providers = graph
            .iter()
            .find(|(_, p)| p.name == "keel-providers")
            .map(|(id, _)| id.clone())
            .unwrap();
        assert!(closure(&graph, &providers, false, &|_| false)
            .values()
            .any(|path| path.last().map(String::as_str) == Some("hyper")));
    }
}
