//! File tools: `read_file`, `list_dir`, `search_text` (delegatable, read-only)
//! and `write_file` (root only).

use std::io::BufRead;

use async_trait::async_trait;
use keel_core::{DelegationPolicy, Tool, ToolError, ToolExecutionContext, ToolOutput};
use serde::Deserialize;
use serde_json::json;

use super::workspace::Node;
use super::{parse_args, Workspace, MAX_TOOL_OUTPUT_BYTES};
use crate::error::internal_tool_error;

/// Largest file `read_file` and `search_text` look into.
const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// Most entries `list_dir` returns.
const MAX_DIR_ENTRIES: usize = 500;
/// Most matches `search_text` returns.
const MAX_SEARCH_RESULTS: usize = 200;
/// Most files `search_text` opens.
const MAX_SEARCH_FILES: usize = 5_000;
/// Largest content `write_file` accepts.
const MAX_WRITE_BYTES: usize = 1024 * 1024;

/// Runs blocking file work off the async runtime, observing cancellation.
async fn blocking<T: Send + 'static>(
    ctx: &ToolExecutionContext,
    f: impl FnOnce() -> Result<T, ToolError> + Send + 'static,
) -> Result<T, ToolError> {
    let task = tokio::task::spawn_blocking(f);
    tokio::select! {
        biased;
        _ = ctx.cancellation.cancelled() => Err(ToolError::Cancelled),
        r = task => r.map_err(|e| internal_tool_error(&format_args!("file task failed: {e}")))?,
    }
}

/// Reads `user_path` as UTF-8 text: a regular file of at most
/// [`MAX_FILE_BYTES`] inside the workspace.
fn read_text(ws: &Workspace, user_path: &str) -> Result<String, ToolError> {
    let node = ws.open(user_path)?;
    let bytes = node.read_to_end(MAX_FILE_BYTES)?;
    String::from_utf8(bytes).map_err(|_| ToolError::Failed(format!("{user_path}: not UTF-8 text")))
}

/// Reads a text file inside the workspace.
pub(crate) struct ReadFileTool {
    workspace: Workspace,
}

impl ReadFileTool {
    /// A `read_file` confined to `workspace`.
    pub(crate) fn new(workspace: Workspace) -> Self {
        Self { workspace }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadFileArgs {
    path: String,
    #[serde(default)]
    offset: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
}

#[async_trait]
impl Tool for ReadFileTool {
    fn name(&self) -> &str {
        "read_file"
    }
    fn description(&self) -> &str {
        "Read a UTF-8 text file in the workspace. Optional 1-based line offset and line limit."
    }
    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Path relative to the workspace root"},
                "offset": {"type": "integer", "minimum": 1, "description": "First line to return (1-based)"},
                "limit": {"type": "integer", "minimum": 1, "description": "Most lines to return"}
            },
            "required": ["path"],
            "additionalProperties": false
        })
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    fn read_only(&self) -> bool {
        true
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let args: ReadFileArgs = parse_args(args)?;
        let ws = self.workspace.clone();
        let path = args.path.clone();
        let text = blocking(ctx, move || read_text(&ws, &path)).await?;
        let text = match (args.offset, args.limit) {
            (None, None) => text,
            (offset, limit) => {
                let skip = offset.unwrap_or(1).saturating_sub(1);
                let take = limit.unwrap_or(usize::MAX);
                text.lines()
                    .skip(skip)
                    .take(take)
                    .collect::<Vec<_>>()
                    .join("\n")
            }
        };
        Ok(ToolOutput::bounded(text, MAX_TOOL_OUTPUT_BYTES))
    }
}

/// Lists a directory inside the workspace.
pub(crate) struct ListDirTool {
    workspace: Workspace,
}

impl ListDirTool {
    /// A `list_dir` confined to `workspace`.
    pub(crate) fn new(workspace: Workspace) -> Self {
        Self { workspace }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListDirArgs {
    #[serde(default = "dot")]
    path: String,
}

fn dot() -> String {
    ".".into()
}

#[async_trait]
impl Tool for ListDirTool {
    fn name(&self) -> &str {
        "list_dir"
    }
    fn description(&self) -> &str {
        "List a directory in the workspace (directories end with '/')."
    }
    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Directory relative to the workspace root (default '.')"}
            },
            "additionalProperties": false
        })
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    fn read_only(&self) -> bool {
        true
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let args: ListDirArgs = parse_args(args)?;
        let ws = self.workspace.clone();
        let lines = blocking(ctx, move || {
            let dir = ws.open(&args.path)?;
            let mut names: Vec<String> = dir
                .entries()?
                .into_iter()
                .map(|(name, is_dir)| {
                    let mut name = name.to_string_lossy().into_owned();
                    if is_dir {
                        name.push('/');
                    }
                    name
                })
                .collect();
            names.sort();
            let total = names.len();
            names.truncate(MAX_DIR_ENTRIES);
            if total > MAX_DIR_ENTRIES {
                names.push(format!("… and {} more", total - MAX_DIR_ENTRIES));
            }
            Ok(names)
        })
        .await?;
        Ok(ToolOutput::bounded(lines.join("\n"), MAX_TOOL_OUTPUT_BYTES))
    }
}

/// Searches text files in the workspace for a literal string.
pub(crate) struct SearchTextTool {
    workspace: Workspace,
}

impl SearchTextTool {
    /// A `search_text` confined to `workspace`.
    pub(crate) fn new(workspace: Workspace) -> Self {
        Self { workspace }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchArgs {
    pattern: String,
    #[serde(default = "dot")]
    path: String,
    #[serde(default)]
    max_results: Option<usize>,
}

#[async_trait]
impl Tool for SearchTextTool {
    fn name(&self) -> &str {
        "search_text"
    }
    fn description(&self) -> &str {
        "Find lines containing a literal string in the workspace's text files (hidden directories skipped)."
    }
    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "minLength": 1},
                "path": {"type": "string", "description": "Directory or file to search (default '.')"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_RESULTS}
            },
            "required": ["pattern"],
            "additionalProperties": false
        })
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    fn read_only(&self) -> bool {
        true
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let args: SearchArgs = parse_args(args)?;
        if args.pattern.is_empty() {
            return Err(ToolError::InvalidArguments("pattern is empty".into()));
        }
        let max = args.max_results.unwrap_or(50).clamp(1, MAX_SEARCH_RESULTS);
        let ws = self.workspace.clone();
        let cancel = ctx.cancellation.clone();
        let pattern = args.pattern;
        let hits = blocking(ctx, move || {
            let start = ws.open(&args.path)?;
            search(&ws, start, &pattern, max, &cancel)
        })
        .await?;
        if hits.is_empty() {
            return Ok(ToolOutput::text("no matches"));
        }
        Ok(ToolOutput::bounded(hits.join("\n"), MAX_TOOL_OUTPUT_BYTES))
    }
}

/// Lines containing `pattern` under `start`, depth first in name order;
/// hidden entries are skipped and symlinks below `start` are not followed.
fn search(
    ws: &Workspace,
    start: Node,
    pattern: &str,
    max: usize,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<Vec<String>, ToolError> {
    let mut hits = Vec::new();
    let mut files = 0usize;
    let mut stack = vec![start];
    while let Some(node) = stack.pop() {
        if cancel.is_cancelled() {
            return Err(ToolError::Cancelled);
        }
        if node.is_dir() {
            let Ok(entries) = node.entries() else {
                continue;
            };
            let mut names: Vec<_> = entries
                .into_iter()
                .map(|(name, _)| name)
                .filter(|n| !n.to_string_lossy().starts_with('.'))
                .collect();
            names.sort();
            // Children are opened relative to the root by their path: inside
            // the root by construction, and keel's own files are refused.
            for name in names.into_iter().rev() {
                if let Ok(child) = ws.open_entry(&node.rel.join(name)) {
                    stack.push(child);
                }
            }
        } else if node.is_file() && node.len() <= MAX_FILE_BYTES {
            files += 1;
            if files > MAX_SEARCH_FILES {
                break;
            }
            let Ok(file) = node.reader() else {
                continue;
            };
            for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
                let Ok(line) = line else { break }; // binary file
                if line.contains(pattern) {
                    let text: String = line.trim().chars().take(200).collect();
                    hits.push(format!("{}:{}: {}", node.shown, i + 1, text));
                    if hits.len() >= max {
                        return Ok(hits);
                    }
                }
            }
        }
    }
    Ok(hits)
}

/// Writes a text file inside the workspace (root agent only).
pub(crate) struct WriteFileTool {
    workspace: Workspace,
}

impl WriteFileTool {
    /// A `write_file` confined to `workspace`.
    pub(crate) fn new(workspace: Workspace) -> Self {
        Self { workspace }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteArgs {
    path: String,
    content: String,
}

#[async_trait]
impl Tool for WriteFileTool {
    fn name(&self) -> &str {
        "write_file"
    }
    fn description(&self) -> &str {
        "Create or replace a UTF-8 text file in the workspace (its directory must exist)."
    }
    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"}
            },
            "required": ["path", "content"],
            "additionalProperties": false
        })
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let args: WriteArgs = parse_args(args)?;
        if args.content.len() > MAX_WRITE_BYTES {
            return Err(ToolError::InvalidArguments(format!(
                "content is {} bytes, over the {MAX_WRITE_BYTES}-byte limit",
                args.content.len()
            )));
        }
        let ws = self.workspace.clone();
        let bytes = args.content.len();
        let shown = blocking(ctx, move || {
            ws.write_file(&args.path, args.content.as_bytes())
        })
        .await?;
        Ok(ToolOutput::text(format!("wrote {bytes} bytes to {shown}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_util::sync::CancellationToken;

    fn setup() -> (tempfile::TempDir, Workspace) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("src")).unwrap();
        std::fs::create_dir(dir.path().join(".git")).unwrap();
        std::fs::write(
            dir.path().join("src/lib.rs"),
            "fn alpha() {}\nfn beta() {}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("README.md"), "alpha and omega\n").unwrap();
        std::fs::write(dir.path().join(".git/config"), "alpha\n").unwrap();
        std::fs::write(dir.path().join("bin.dat"), [0xff, 0xfe, 0x00]).unwrap();
        let ws = workspace(dir.path(), &[]);
        (dir, ws)
    }

    fn workspace(root: &std::path::Path, protected: &[std::path::PathBuf]) -> Workspace {
        Workspace::new(root, protected).unwrap()
    }

    fn ctx() -> ToolExecutionContext {
        ToolExecutionContext::default()
    }

    #[tokio::test]
    async fn read_file_reads_ranges_and_refuses_binary_and_escapes() {
        let (_d, ws) = setup();
        let t = ReadFileTool::new(ws);
        let out = t
            .execute(json!({"path": "src/lib.rs"}), &ctx())
            .await
            .unwrap();
        assert_eq!(out.content, "fn alpha() {}\nfn beta() {}\n");
        let out = t
            .execute(
                json!({"path": "src/lib.rs", "offset": 2, "limit": 1}),
                &ctx(),
            )
            .await
            .unwrap();
        assert_eq!(out.content, "fn beta() {}");
        let err = t
            .execute(json!({"path": "bin.dat"}), &ctx())
            .await
            .unwrap_err();
        assert_eq!(err, ToolError::Failed("bin.dat: not UTF-8 text".into()));
        let err = t
            .execute(json!({"path": "../etc/passwd"}), &ctx())
            .await
            .unwrap_err();
        assert!(matches!(err, ToolError::Denied(_) | ToolError::Failed(_)));
        let err = t.execute(json!({"file": "x"}), &ctx()).await.unwrap_err();
        assert!(matches!(err, ToolError::InvalidArguments(_)));
    }

    #[tokio::test]
    async fn read_file_output_is_bounded() {
        let (d, ws) = setup();
        std::fs::write(
            d.path().join("big.txt"),
            "x".repeat(MAX_TOOL_OUTPUT_BYTES + 10),
        )
        .unwrap();
        let out = ReadFileTool::new(ws)
            .execute(json!({"path": "big.txt"}), &ctx())
            .await
            .unwrap();
        assert!(out.content.len() < MAX_TOOL_OUTPUT_BYTES + 64);
        assert!(out.content.ends_with("[truncated 10 bytes]"));
    }

    #[tokio::test]
    async fn list_dir_marks_directories() {
        let (_d, ws) = setup();
        let out = ListDirTool::new(ws)
            .execute(json!({}), &ctx())
            .await
            .unwrap();
        assert_eq!(out.content, ".git/\nREADME.md\nbin.dat\nsrc/");
    }

    #[tokio::test]
    async fn search_text_skips_hidden_dirs_and_limits_results() {
        let (_d, ws) = setup();
        let t = SearchTextTool::new(ws);
        let out = t
            .execute(json!({"pattern": "alpha"}), &ctx())
            .await
            .unwrap();
        assert_eq!(
            out.content,
            "README.md:1: alpha and omega\nsrc/lib.rs:1: fn alpha() {}"
        );
        let out = t
            .execute(json!({"pattern": "fn", "max_results": 1}), &ctx())
            .await
            .unwrap();
        assert_eq!(out.content.lines().count(), 1);
        let out = t.execute(json!({"pattern": "zzz"}), &ctx()).await.unwrap();
        assert_eq!(out.content, "no matches");
        let err = t.execute(json!({"pattern": ""}), &ctx()).await.unwrap_err();
        assert!(matches!(err, ToolError::InvalidArguments(_)));
    }

    #[tokio::test]
    async fn search_text_observes_cancellation() {
        let (_d, ws) = setup();
        let c = ToolExecutionContext {
            cancellation: CancellationToken::new(),
            ..ctx()
        };
        c.cancellation.cancel();
        let err = SearchTextTool::new(ws)
            .execute(json!({"pattern": "a"}), &c)
            .await
            .unwrap_err();
        assert_eq!(err, ToolError::Cancelled);
    }

    #[tokio::test]
    async fn write_file_writes_inside_and_refuses_oversize() {
        let (d, ws) = setup();
        let t = WriteFileTool::new(ws);
        t.execute(json!({"path": "src/new.txt", "content": "hi"}), &ctx())
            .await
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("src/new.txt")).unwrap(),
            "hi"
        );
        let big = "x".repeat(MAX_WRITE_BYTES + 1);
        let err = t
            .execute(json!({"path": "a.txt", "content": big}), &ctx())
            .await
            .unwrap_err();
        assert!(matches!(err, ToolError::InvalidArguments(_)));
        let err = t
            .execute(json!({"path": "../out.txt", "content": "x"}), &ctx())
            .await
            .unwrap_err();
        assert!(matches!(err, ToolError::Denied(_)));
        assert!(!d.path().parent().unwrap().join("out.txt").exists());
    }

    #[tokio::test]
    async fn paths_cannot_leave_the_workspace() {
        let outer = tempfile::tempdir().unwrap();
        let root = outer.path().join("ws");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(outer.path().join("secret.txt"), "s").unwrap();
        std::fs::write(root.join("ok.txt"), "ok").unwrap();
        std::os::unix::fs::symlink(outer.path().join("secret.txt"), root.join("link")).unwrap();
        std::os::unix::fs::symlink("ok.txt", root.join("inner")).unwrap();
        let ws = workspace(&root, &[]);
        let read = ReadFileTool::new(ws.clone());
        let secret = outer.path().join("secret.txt");
        let abs_inside = root.canonicalize().unwrap().join("ok.txt");
        for (path, ok) in [
            ("ok.txt", true),
            ("inner", true),
            (abs_inside.to_str().unwrap(), true),
            ("../secret.txt", false),
            (secret.to_str().unwrap(), false),
            ("link", false),
            ("ws/../../secret.txt", false),
        ] {
            let r = read.execute(json!({ "path": path }), &ctx()).await;
            match r {
                Ok(out) => assert!(ok && out.content == "ok", "{path}: {out:?}"),
                Err(e) => assert!(
                    !ok && matches!(e, ToolError::Denied(_) | ToolError::Failed(_)),
                    "{path}: {e:?}"
                ),
            }
        }
        let write = WriteFileTool::new(ws);
        for path in ["../x.txt", "link"] {
            let err = write
                .execute(json!({"path": path, "content": "x"}), &ctx())
                .await
                .unwrap_err();
            assert!(
                matches!(err, ToolError::Denied(_) | ToolError::Failed(_)),
                "{path}: {err:?}"
            );
        }
        assert_eq!(std::fs::read_to_string(&secret).unwrap(), "s");
        assert!(!outer.path().join("x.txt").exists());
    }

    #[tokio::test]
    async fn write_file_never_follows_a_planted_temp_symlink() {
        let (d, ws) = setup();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, "untouched").unwrap();
        // Where a predictable temporary file would go.
        for planted in ["notes.keel-tmp", ".notes.md.tmp", "notes.md.tmp"] {
            std::os::unix::fs::symlink(&victim, d.path().join(planted)).unwrap();
        }
        WriteFileTool::new(ws)
            .execute(json!({"path": "notes.md", "content": "new"}), &ctx())
            .await
            .unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched");
        let target = d.path().join("notes.md");
        assert!(std::fs::symlink_metadata(&target).unwrap().is_file());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "new");
    }

    #[tokio::test]
    async fn write_file_keeps_the_mode_of_the_file_it_replaces() {
        use std::os::unix::fs::PermissionsExt;
        let (d, ws) = setup();
        let script = d.path().join("run.sh");
        std::fs::write(&script, "old").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o751)).unwrap();
        WriteFileTool::new(ws)
            .execute(json!({"path": "run.sh", "content": "new"}), &ctx())
            .await
            .unwrap();
        let mode = std::fs::metadata(&script).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o751);
        assert_eq!(std::fs::read_to_string(&script).unwrap(), "new");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn parallel_writes_into_one_directory_all_land_whole() {
        let (d, ws) = setup();
        let tool = std::sync::Arc::new(WriteFileTool::new(ws));
        let content = |i: usize| format!("{i}:").repeat(20_000);
        let writes: Vec<_> = (0..16)
            .map(|i| {
                let tool = std::sync::Arc::clone(&tool);
                let path = if i % 2 == 0 {
                    format!("src/own{i}.txt")
                } else {
                    "src/same.txt".into()
                };
                tokio::spawn(async move {
                    tool.execute(
                        json!({"path": path, "content": content(i)}),
                        &ToolExecutionContext::default(),
                    )
                    .await
                })
            })
            .collect();
        for w in writes {
            w.await.unwrap().unwrap();
        }
        for i in (0..16).step_by(2) {
            let own = std::fs::read_to_string(d.path().join(format!("src/own{i}.txt"))).unwrap();
            assert_eq!(own, content(i));
        }
        let same = std::fs::read_to_string(d.path().join("src/same.txt")).unwrap();
        assert!(
            (1..16).step_by(2).any(|i| same == content(i)),
            "a torn file"
        );
        let mut names: Vec<String> = std::fs::read_dir(d.path().join("src"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("own"))
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["lib.rs", "same.txt"],
            "no temporary file is left behind"
        );
    }

    /// Another process swaps a path between a file, a symlink out of the
    /// workspace and a FIFO while the model reads it: no read may return
    /// what is outside, and none may block on the FIFO.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_path_swapped_during_reads_never_escapes_or_hangs() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let (d, ws) = setup();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "SECRET").unwrap();
        let (a, link, fifo) = (
            d.path().join("a"),
            d.path().join("link"),
            d.path().join("fifo"),
        );
        std::fs::write(&a, "inside").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), &link).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let swapper = std::thread::spawn({
            let stop = Arc::clone(&stop);
            let (a, link, fifo) = (a.clone(), link.clone(), fifo.clone());
            move || {
                let swap = |x: &std::path::Path, y: &std::path::Path| {
                    rustix::fs::renameat_with(
                        rustix::fs::CWD,
                        x,
                        rustix::fs::CWD,
                        y,
                        rustix::fs::RenameFlags::EXCHANGE,
                    )
                    .unwrap()
                };
                while !stop.load(Ordering::Relaxed) {
                    swap(&a, &link);
                    swap(&a, &fifo);
                }
            }
        });
        let read = ReadFileTool::new(ws.clone());
        let search = SearchTextTool::new(ws);
        for i in 0..1500 {
            let out = tokio::time::timeout(
                std::time::Duration::from_secs(10),
                read.execute(json!({"path": "a"}), &ctx()),
            )
            .await
            .unwrap_or_else(|_| panic!("read {i} hung"));
            if let Ok(out) = out {
                assert_ne!(out.content, "SECRET", "read {i} left the workspace");
            }
            if i % 50 == 0 {
                let out = tokio::time::timeout(
                    std::time::Duration::from_secs(10),
                    search.execute(json!({"pattern": "SECRET"}), &ctx()),
                )
                .await
                .unwrap_or_else(|_| panic!("search {i} hung"))
                .unwrap();
                assert_eq!(out.content, "no matches");
            }
        }
        stop.store(true, Ordering::Relaxed);
        swapper.join().unwrap();
    }

    /// The model must not read or rewrite keel's database, keel.toml or
    /// agent definitions, whether they sit inside the workspace or are
    /// reached through a symlink.
    #[tokio::test]
    async fn keel_data_and_configuration_are_out_of_reach() {
        let (d, _) = setup();
        let data = d.path().join("data");
        std::fs::create_dir_all(data.join("agents")).unwrap();
        std::fs::write(data.join("keel.toml"), "needle\n").unwrap();
        std::fs::write(d.path().join("other.toml"), "needle\n").unwrap();
        std::os::unix::fs::symlink("data", d.path().join("alias")).unwrap();
        let ws = workspace(d.path(), &[data.clone(), d.path().join("other.toml")]);
        let read = ReadFileTool::new(ws.clone());
        let write = WriteFileTool::new(ws.clone());
        for path in [
            "data/keel.toml",
            "alias/keel.toml",
            "other.toml",
            "data/../other.toml",
        ] {
            let err = read
                .execute(json!({ "path": path }), &ctx())
                .await
                .unwrap_err();
            assert!(matches!(err, ToolError::Denied(_)), "read {path}: {err:?}");
        }
        for path in [
            "data/keel.toml",
            "alias/agents/evil.md",
            "data/keel.db",
            "other.toml",
        ] {
            let err = write
                .execute(
                    json!({"path": path, "content": "enable_shell = true"}),
                    &ctx(),
                )
                .await
                .unwrap_err();
            assert!(matches!(err, ToolError::Denied(_)), "write {path}: {err:?}");
        }
        for path in ["data", "alias", "data/agents"] {
            let err = ListDirTool::new(ws.clone())
                .execute(json!({ "path": path }), &ctx())
                .await
                .unwrap_err();
            assert!(matches!(err, ToolError::Denied(_)), "list {path}: {err:?}");
        }
        let out = SearchTextTool::new(ws)
            .execute(json!({"pattern": "needle"}), &ctx())
            .await
            .unwrap();
        assert_eq!(out.content, "no matches");
        assert_eq!(
            std::fs::read_to_string(data.join("keel.toml")).unwrap(),
            "needle\n"
        );
        assert!(!data.join("agents/evil.md").exists());
        insta::assert_snapshot!(
            read.execute(json!({"path": "data/keel.toml"}), &ctx()).await.unwrap_err().to_string(),
            @"denied: data/keel.toml belongs to keel itself (its data directory or configuration); tools may not touch it"
        );
    }
}
