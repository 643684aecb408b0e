//! Benchmark: load a definitions directory of 500 agents (parse, validate,
//! resolve, hash) against a baseline measured in the same run — reading the
//! same 500 files raw. Prints one `BENCH` line.

use std::fs;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use keel_catalog::{AgentCatalog, CatalogInputs};
use keel_core::{
    AgentId, DelegationPolicy, Tool, ToolError, ToolExecutionContext, ToolOutput, ToolRegistry,
};

const DEFS: usize = 500;
const RUNS: usize = 7;

struct Fake(&'static str);

#[async_trait]
impl Tool for Fake {
    fn name(&self) -> &str {
        self.0
    }
    fn description(&self) -> &str {
        "bench tool"
    }
    fn parameters(&self) -> serde_json::Value {
        serde_json::json!({"type": "object"})
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    async fn execute(
        &self,
        _args: serde_json::Value,
        _ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text(""))
    }
}

fn definition(i: usize) -> String {
    let body = "You are a focused specialist. Read the task, use your tools, and \
                answer with a short, sourced summary.\n"
        .repeat(12);
    format!(
        "---\nid: agent-{i:03}\ndescription: Specialist number {i}.\nllm_profile: default\n\
         tools: [read_file, search_text]\ndelegates:\n  - agent-{:03}\n  - agent-{:03}\n\
         skills: [git]\nlimits:\n  max_iterations: 12\n  timeout_secs: 300\n  max_children: 2\n\
         signal:\n  delivery: queue\n  max_signals: 8\n  severities: [info, warning]\n---\n\n{body}",
        (i + 1) % DEFS,
        (i + 2) % DEFS
    )
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn read_raw(dir: &Path) -> usize {
    let mut names: Vec<_> = fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").path())
        .collect();
    names.sort();
    let mut total = 0;
    for n in names {
        let mut s = String::new();
        fs::File::open(n)
            .expect("open")
            .read_to_string(&mut s)
            .expect("read");
        total += s.len();
    }
    total
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    for i in 0..DEFS {
        fs::write(dir.path().join(format!("agent-{i:03}.md")), definition(i)).expect("write");
    }
    let mut tools = ToolRegistry::new();
    tools
        .register(Arc::new(Fake("read_file")))
        .expect("register");
    tools
        .register(Arc::new(Fake("search_text")))
        .expect("register");
    let mut inputs = CatalogInputs::new(["default"], Arc::new(tools));
    inputs.skills = keel_catalog::SkillSet::from_texts([(
        "git.md",
        "---\nname: git\ndescription: Git workflows.\n---\nRebase.\n",
    )])
    .expect("skills");
    inputs.root_delegates = (0..5)
        .map(|i| AgentId::parse(&format!("agent-{i:03}")).expect("id"))
        .collect();

    // Warm the page cache and check the set is valid.
    let bytes = read_raw(dir.path());
    let catalog = AgentCatalog::load(dir.path(), &inputs, 1).unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(catalog.len(), DEFS);

    let mut load = Vec::new();
    let mut raw = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        std::hint::black_box(read_raw(dir.path()));
        raw.push(t.elapsed());
        let t = Instant::now();
        let c = AgentCatalog::load(dir.path(), &inputs, 1).expect("valid");
        std::hint::black_box(c);
        load.push(t.elapsed());
    }
    let (load, raw) = (median(load), median(raw));
    let ms = load.as_secs_f64() * 1e3;
    println!(
        "BENCH catalog_load defs={DEFS} bytes={bytes} ms={ms:.2} per_def_us={:.1} \
         baseline_raw_read_ms={:.2} ratio={:.1} runs={RUNS} (median)",
        ms * 1e3 / DEFS as f64,
        raw.as_secs_f64() * 1e3,
        load.as_secs_f64() / raw.as_secs_f64().max(1e-9),
    );
}
