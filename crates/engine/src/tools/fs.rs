//! File tools: `read_file`, `list_dir`, `search_text` (delegatable, read-only)
//! and `write_file` (root only).

use std::io::{BufRead, Read};
use std::path::Path;

use async_trait::async_trait;
use keel_core::{DelegationPolicy, Tool, ToolError, ToolExecutionContext, ToolOutput};
use serde::Deserialize;
use serde_json::json;

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

fn read_text(path: &Path, shown: &str) -> Result<String, ToolError> {
    let meta = std::fs::metadata(path).map_err(|e| ToolError::Failed(format!("{shown}: {e}")))?;
    if !meta.is_file() {
        return Err(ToolError::Failed(format!("{shown}: not a regular file")));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(ToolError::Failed(format!(
            "{shown}: {} bytes is over the {MAX_FILE_BYTES}-byte limit",
            meta.len()
        )));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE_BYTES).read_to_end(&mut bytes))
        .map_err(|e| ToolError::Failed(format!("{shown}: {e}")))?;
    String::from_utf8(bytes).map_err(|_| ToolError::Failed(format!("{shown}: not UTF-8 text")))
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
        let path = self.workspace.resolve_existing(&args.path)?;
        let shown = args.path.clone();
        let text = blocking(ctx, move || read_text(&path, &shown)).await?;
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
        let dir = self.workspace.resolve_existing(&args.path)?;
        let shown = args.path;
        let lines = blocking(ctx, move || {
            let mut names = Vec::new();
            let entries =
                std::fs::read_dir(&dir).map_err(|e| ToolError::Failed(format!("{shown}: {e}")))?;
            for entry in entries {
                let entry = entry.map_err(|e| ToolError::Failed(format!("{shown}: {e}")))?;
                let mut name = entry.file_name().to_string_lossy().into_owned();
                if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    name.push('/');
                }
                names.push(name);
            }
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
        let start = self.workspace.resolve_existing(&args.path)?;
        let ws = self.workspace.clone();
        let cancel = ctx.cancellation.clone();
        let pattern = args.pattern;
        let hits = blocking(ctx, move || {
            let mut hits = Vec::new();
            let mut stack = vec![start];
            let mut files = 0usize;
            while let Some(path) = stack.pop() {
                if cancel.is_cancelled() {
                    return Err(ToolError::Cancelled);
                }
                // symlink_metadata: never follow links, so nothing leads out.
                let Ok(meta) = std::fs::symlink_metadata(&path) else {
                    continue;
                };
                if meta.is_dir() {
                    let Ok(entries) = std::fs::read_dir(&path) else {
                        continue;
                    };
                    let mut children: Vec<_> = entries
                        .filter_map(Result::ok)
                        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                        .map(|e| e.path())
                        .collect();
                    children.sort();
                    children.reverse();
                    stack.extend(children);
                } else if meta.is_file() && meta.len() <= MAX_FILE_BYTES {
                    files += 1;
                    if files > MAX_SEARCH_FILES {
                        break;
                    }
                    let Ok(file) = std::fs::File::open(&path) else {
                        continue;
                    };
                    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
                        let Ok(line) = line else { break }; // binary file
                        if line.contains(&pattern) {
                            let text: String = line.trim().chars().take(200).collect();
                            hits.push(format!("{}:{}: {}", ws.display(&path), i + 1, text));
                            if hits.len() >= max {
                                return Ok(hits);
                            }
                        }
                    }
                }
            }
            Ok(hits)
        })
        .await?;
        if hits.is_empty() {
            return Ok(ToolOutput::text("no matches"));
        }
        Ok(ToolOutput::bounded(hits.join("\n"), MAX_TOOL_OUTPUT_BYTES))
    }
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
        let target = self.workspace.resolve_for_write(&args.path)?;
        let shown = args.path.clone();
        let bytes = args.content.len();
        blocking(ctx, move || {
            // Write then rename: readers never see a half-written file.
            let tmp = target.with_extension("keel-tmp");
            std::fs::write(&tmp, args.content.as_bytes())
                .and_then(|()| std::fs::rename(&tmp, &target))
                .map_err(|e| ToolError::Failed(format!("{shown}: {e}")))
        })
        .await?;
        Ok(ToolOutput::text(format!(
            "wrote {bytes} bytes to {}",
            args.path
        )))
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
        let ws = Workspace::new(dir.path()).unwrap();
        (dir, ws)
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
}
