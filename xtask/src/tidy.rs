//! Repository-wide checks that run as ordinary `#[test]`s (so `cargo test`
//! and `cargo xtask ci` enforce them), in the style of rust-analyzer's
//! `xtask/src/tidy.rs`:
//!
//! - **Sizes.** No file of a library crate's `src/` holds more than
//!   [`MAX_FILE_CODE_LINES`] lines of non-test code, and no non-test function
//!   is longer than [`MAX_FN_LINES`] lines, except the data tables listed in
//!   [`DATA_TABLES`]. "Non-test code" is everything but `#[cfg(test)]` items
//!   and files only a `#[cfg(test)] mod` declaration includes; blank lines
//!   and `//` comment lines (doc comments included) do not count toward a
//!   file's size, they do toward a function's span.
//! - **Public API with a user.** A `pub` item of a library crate must be
//!   named somewhere in the workspace outside its definition — in code,
//!   tests, benches, examples or a code block of a doc comment (a doctest is
//!   a documented use) — unless [`UNUSED_API_PENDING`] lists it with the work
//!   that will use it. And a `pub` item without a doc comment must have a
//!   user outside its own crate; otherwise it is crate-internal and should
//!   say so (`pub(crate)`), or it is API and should say what it is. (rustc's
//!   `missing_docs` sees only items reachable from the crate root; this
//!   sees `pub` items in private modules too.)
//! - **Comments cite only the repository.** A comment that points to a
//!   design document outside the repository (a numbered seed, a section of
//!   the product spec) sends the reader where they cannot follow; state the
//!   rule itself. See [`outside_citations`].
//! - **Config keys with a reader.** Every key of the generated table in
//!   docs/CONFIG.md is read by the runtime, unless its row says it is not
//!   supported yet (and then nothing may read it — drop the mark once it is).
//!   See [`unread_config_keys`] for what counts as a reader.
//!
//! The analysis is syntactic (syn plus a token scan): a name counts as used
//! wherever the identifier appears outside its definition, an import or an
//! `impl` header. Two items of the same name shadow each other, so the check
//! can miss dead code but does not report live code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{Delimiter, TokenStream, TokenTree};
use syn::spanned::Spanned;
use syn::visit::Visit;

/// Most lines of non-test code (not blank, not a comment) in one file of a
/// library crate's `src/`.
pub const MAX_FILE_CODE_LINES: usize = 900;

/// Most lines of one non-test function, from its signature to its closing brace.
pub const MAX_FN_LINES: usize = 150;

/// Functions that are data, not logic, and may be longer than
/// [`MAX_FN_LINES`]: (file, function name, why).
pub const DATA_TABLES: &[(&str, &str, &str)] = &[(
    "crates/gateway/src/config/reference.rs",
    "reference",
    "the keel.toml key reference: one row per key",
)];

/// Public items nothing in the workspace uses yet, each kept for the work
/// that will: (crate directory, name, why). An entry whose item is used or
/// gone is reported, so the list only shrinks.
pub const UNUSED_API_PENDING: &[(&str, &str, &str)] = &[];

/// Library crates: their `pub` items are API, their `src/` is sized.
pub const LIBRARY_CRATES: &[&str] = &[
    "crates/core",
    "crates/providers",
    "crates/store",
    "crates/catalog",
    "crates/engine",
    "crates/gateway",
];

/// Files where a config key is only parsed, validated or documented: a field
/// access there does not make the key read.
pub const CONFIG_MACHINERY: &[&str] = &[
    "crates/gateway/src/config/validate.rs",
    "crates/gateway/src/config/reference.rs",
    "crates/gateway/src/config/spans.rs",
    "crates/gateway/src/config/error.rs",
];

/// How docs/CONFIG.md marks a key the code parses and validates but does
/// not act on yet (the start of its "Meaning" cell).
pub const NOT_SUPPORTED_MARK: &str = "**Not supported yet.**";

/// One Rust source file of the workspace.
pub struct SourceFile {
    /// Path relative to the workspace root, with `/` separators.
    pub path: String,
    /// Its text.
    pub text: String,
    /// Test-only: a test, bench, example or fuzz target, or a file only a
    /// `#[cfg(test)] mod` includes.
    pub test_only: bool,
    syntax: syn::File,
}

/// Every Rust source file of the workspace, parsed.
pub struct Workspace {
    /// The files, sorted by path.
    pub files: Vec<SourceFile>,
}

impl Workspace {
    /// Reads every `.rs` file under `crates/`, `tests/`, `xtask/` and `fuzz/`.
    pub fn load(root: &Path) -> Result<Self, String> {
        let mut paths = Vec::new();
        for top in ["crates", "tests", "xtask", "fuzz"] {
            collect_rs(&root.join(top), &mut paths)?;
        }
        let mut files = Vec::new();
        for path in paths {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .replace('\\', "/");
            files.push((rel, text));
        }
        Self::from_texts(files)
    }

    /// A workspace of the given (path, text) files.
    pub fn from_texts(files: Vec<(String, String)>) -> Result<Self, String> {
        let mut parsed = Vec::new();
        for (path, text) in files {
            let syntax =
                syn::parse_file(&text).map_err(|e| format!("{path}: cannot parse: {e}"))?;
            let test_only = !is_library_src(&path);
            parsed.push(SourceFile {
                path,
                text,
                test_only,
                syntax,
            });
        }
        // Files included only by a `#[cfg(test)] mod name;` are tests too.
        let mut test_modules = BTreeSet::new();
        for file in &parsed {
            for item in &file.syntax.items {
                if let syn::Item::Mod(m) = item {
                    if m.content.is_none() && is_cfg_test(&m.attrs) {
                        let dir = module_dir(&file.path);
                        test_modules.insert(format!("{dir}{}.rs", m.ident));
                        test_modules.insert(format!("{dir}{}/mod.rs", m.ident));
                    }
                }
            }
        }
        for file in &mut parsed {
            file.test_only |= test_modules.contains(&file.path);
        }
        parsed.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(Self { files: parsed })
    }

    fn library_files(&self) -> impl Iterator<Item = &SourceFile> {
        self.files.iter().filter(|f| !f.test_only)
    }
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    if !dir.is_dir() {
        return Ok(());
    }
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                collect_rs(&path, out)?;
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    Ok(())
}

fn is_library_src(path: &str) -> bool {
    LIBRARY_CRATES
        .iter()
        .any(|krate| path.starts_with(&format!("{krate}/src/")))
        && !path.ends_with("/main.rs")
}

/// The directory holding the files of `path`'s child modules.
fn module_dir(path: &str) -> String {
    let (dir, file) = path.rsplit_once('/').unwrap_or(("", path));
    match file {
        "lib.rs" | "main.rs" | "mod.rs" => format!("{dir}/"),
        _ => format!("{dir}/{}/", file.trim_end_matches(".rs")),
    }
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.meta
                .require_list()
                .map(|l| has_ident(l.tokens.clone(), "test"))
                .unwrap_or(false)
    })
}

fn has_ident(tokens: TokenStream, name: &str) -> bool {
    tokens.into_iter().any(|t| match t {
        TokenTree::Ident(i) => i == name,
        TokenTree::Group(g) => has_ident(g.stream(), name),
        _ => false,
    })
}

fn has_doc(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| a.path().is_ident("doc"))
}

/// Every tidy problem of `ws`, given docs/CONFIG.md as `config_md`.
pub fn check_all(ws: &Workspace, config_md: &str) -> Vec<String> {
    let mut out = long_files(ws);
    out.extend(long_fns(ws));
    out.extend(unused_pub_items(ws));
    out.extend(outside_citations(ws));
    out.extend(unread_config_keys(ws, config_md));
    out
}

/// Comment lines that cite a document outside the repository: a design seed
/// by number ("seed" and three digits), the product spec (its name in
/// capitals), or a section sign.
pub fn outside_citations(ws: &Workspace) -> Vec<String> {
    let mut out = Vec::new();
    for file in &ws.files {
        for (i, line) in file.text.lines().enumerate() {
            let Some(comment) = line.trim_start().strip_prefix("//") else {
                continue;
            };
            let seed = comment.match_indices("seed ").any(|(at, _)| {
                let digits = &comment[at + 5..];
                digits.len() >= 3 && digits.bytes().take(3).all(|b| b.is_ascii_digit())
            });
            if seed || comment.contains("SPEC") || comment.contains('\u{a7}') {
                out.push(format!(
                    "{}:{}: the comment cites a document outside the repository; state the rule itself",
                    file.path,
                    i + 1
                ));
            }
        }
    }
    out
}

// ── sizes ──────────────────────────────────────────────────────────────────

/// Files of library crates with more than [`MAX_FILE_CODE_LINES`] code lines.
pub fn long_files(ws: &Workspace) -> Vec<String> {
    let mut out = Vec::new();
    for file in ws.library_files() {
        let mut test_lines = BTreeSet::new();
        for item in &file.syntax.items {
            if is_cfg_test(item_attrs(item)) {
                let span = item.span();
                test_lines.extend(span.start().line..=span.end().line);
            }
        }
        let code = file
            .text
            .lines()
            .enumerate()
            .filter(|(i, line)| {
                let line = line.trim();
                !test_lines.contains(&(i + 1)) && !line.is_empty() && !line.starts_with("//")
            })
            .count();
        if code > MAX_FILE_CODE_LINES {
            out.push(format!(
                "{}: {code} lines of non-test code (at most {MAX_FILE_CODE_LINES}); split it along its sections",
                file.path
            ));
        }
    }
    out
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    match item {
        syn::Item::Const(i) => &i.attrs,
        syn::Item::Enum(i) => &i.attrs,
        syn::Item::Fn(i) => &i.attrs,
        syn::Item::Impl(i) => &i.attrs,
        syn::Item::Mod(i) => &i.attrs,
        syn::Item::Static(i) => &i.attrs,
        syn::Item::Struct(i) => &i.attrs,
        syn::Item::Trait(i) => &i.attrs,
        syn::Item::Type(i) => &i.attrs,
        syn::Item::Use(i) => &i.attrs,
        syn::Item::Macro(i) => &i.attrs,
        _ => &[],
    }
}

/// Non-test functions of library crates longer than [`MAX_FN_LINES`], and
/// entries of [`DATA_TABLES`] that no longer name a long function.
pub fn long_fns(ws: &Workspace) -> Vec<String> {
    let mut out = Vec::new();
    let mut tables_seen = BTreeSet::new();
    for file in ws.library_files() {
        let mut v = FnLengths::default();
        v.visit_file(&file.syntax);
        for (name, line, len) in v.found {
            let table = DATA_TABLES
                .iter()
                .find(|(f, n, _)| *f == file.path && *n == name);
            if len > MAX_FN_LINES {
                match table {
                    Some(t) => {
                        tables_seen.insert(t.0.to_owned() + "::" + t.1);
                    }
                    None => out.push(format!(
                        "{}:{line}: fn {name} is {len} lines (at most {MAX_FN_LINES}); split it into its steps",
                        file.path
                    )),
                }
            }
        }
    }
    for (file, name, _) in DATA_TABLES {
        if !tables_seen.contains(&format!("{file}::{name}")) {
            out.push(format!(
                "{file}: DATA_TABLES lists fn {name}, which is gone or short now; remove the entry"
            ));
        }
    }
    out
}

/// (name, first line, length) of every function outside `#[cfg(test)]`.
#[derive(Default)]
struct FnLengths {
    found: Vec<(String, usize, usize)>,
}

impl FnLengths {
    fn record(&mut self, sig: &syn::Signature, block: &syn::Block) {
        let start = sig.span().start().line;
        let end = block.brace_token.span.close().end().line;
        self.found
            .push((sig.ident.to_string(), start, end + 1 - start));
    }
}

impl<'ast> Visit<'ast> for FnLengths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !is_cfg_test(item_attrs(item)) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.record(&f.sig, &f.block);
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_cfg_test(&f.attrs) {
            self.record(&f.sig, &f.block);
            syn::visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(block) = &f.default {
            self.record(&f.sig, block);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

// ── uses of names ──────────────────────────────────────────────────────────

/// How often each identifier is used, over all files or non-test code only.
#[derive(Default)]
struct Uses {
    all: BTreeMap<String, usize>,
    non_test: BTreeMap<String, usize>,
    /// Uses per crate directory (`crates/core`, `tests`, `xtask`, …).
    by_crate: BTreeMap<String, BTreeMap<String, usize>>,
}

impl Uses {
    fn of(ws: &Workspace) -> Self {
        let mut uses = Uses::default();
        for file in &ws.files {
            let Ok(tokens) = file.text.parse::<TokenStream>() else {
                continue;
            };
            let mut all = BTreeMap::new();
            scan(tokens.clone(), false, &mut all);
            merge(
                uses.by_crate.entry(crate_of(&file.path)).or_default(),
                all.clone(),
            );
            merge(&mut uses.all, all);
            if !file.test_only {
                let mut non_test = BTreeMap::new();
                scan(tokens, true, &mut non_test);
                merge(&mut uses.non_test, non_test);
            }
        }
        uses
    }
}

/// The crate directory holding `path`: `crates/NAME`, else its first segment.
fn crate_of(path: &str) -> String {
    let mut parts = path.split('/');
    match (parts.next(), parts.next()) {
        (Some("crates"), Some(name)) => format!("crates/{name}"),
        (Some(top), _) => top.to_owned(),
        _ => String::new(),
    }
}

fn merge(into: &mut BTreeMap<String, usize>, from: BTreeMap<String, usize>) {
    for (k, n) in from {
        *into.entry(k).or_default() += n;
    }
}

const DEFINING_KEYWORDS: &[&str] = &[
    "fn", "struct", "enum", "trait", "type", "const", "static", "union", "mod",
];

/// Counts identifier uses in `tokens`: not the name after a defining
/// keyword, nothing in a `use` declaration or an `impl` header; inside
/// string literals, `{name}` format captures and every word of an
/// attribute's string (`#[serde(default = "name")]`); of doc comments, the
/// Rust code blocks. With `skip_tests`, `#[cfg(test)]` items are left out.
fn scan(tokens: TokenStream, skip_tests: bool, out: &mut BTreeMap<String, usize>) {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    // A doc comment arrives as one `#[doc = "…"]` per line.
    let mut doc = String::new();
    let mut i = 0;
    while i < tokens.len() {
        if let Some((attr, next)) = attribute_at(&tokens, i) {
            let inner: Vec<TokenTree> = attr.stream().into_iter().collect();
            if let Some(line) = doc_text(&inner) {
                doc.push_str(&line);
                doc.push('\n');
                i = next;
                continue;
            }
            flush_doc(&mut doc, out);
            let is_cfg_test = matches!(inner.first(), Some(TokenTree::Ident(id)) if id == "cfg")
                && has_ident(attr.stream(), "test");
            if skip_tests && is_cfg_test {
                i = skip_item(&tokens, next);
            } else {
                scan_attribute(&inner, out);
                i = next;
            }
            continue;
        }
        flush_doc(&mut doc, out);
        match &tokens[i] {
            TokenTree::Ident(id) if id == "use" => {
                i = skip_past_semicolon(&tokens, i);
                continue;
            }
            TokenTree::Ident(id) if id == "impl" && starts_impl_block(&tokens, i) => {
                // The header names the impl's own types; the body is scanned.
                while i < tokens.len()
                    && !matches!(&tokens[i], TokenTree::Group(g) if g.delimiter() == Delimiter::Brace)
                {
                    i += 1;
                }
                continue;
            }
            TokenTree::Ident(id) => {
                let defining = i > 0
                    && matches!(&tokens[i - 1], TokenTree::Ident(k) if DEFINING_KEYWORDS.contains(&k.to_string().as_str()));
                if !defining {
                    let name = id.to_string();
                    *out.entry(name.trim_start_matches("r#").to_owned())
                        .or_default() += 1;
                }
            }
            TokenTree::Group(g) => scan(g.stream(), skip_tests, out),
            TokenTree::Literal(lit) => {
                for name in string_value(lit).iter().flat_map(|s| format_captures(s)) {
                    *out.entry(name).or_default() += 1;
                }
            }
            TokenTree::Punct(_) => {}
        }
        i += 1;
    }
    flush_doc(&mut doc, out);
}

/// The bracket group of an attribute `#[…]` or `#![…]` starting at `i`, and
/// the index after it.
fn attribute_at(tokens: &[TokenTree], i: usize) -> Option<(&proc_macro2::Group, usize)> {
    if !matches!(&tokens[i], TokenTree::Punct(p) if p.as_char() == '#') {
        return None;
    }
    let j = match tokens.get(i + 1) {
        Some(TokenTree::Punct(p)) if p.as_char() == '!' => i + 2,
        _ => i + 1,
    };
    match tokens.get(j) {
        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Bracket => Some((g, j + 1)),
        _ => None,
    }
}

/// The text of a `doc = "…"` attribute.
fn doc_text(inner: &[TokenTree]) -> Option<String> {
    match inner {
        [TokenTree::Ident(id), TokenTree::Punct(eq), TokenTree::Literal(lit)]
            if id == "doc" && eq.as_char() == '=' =>
        {
            string_value(lit)
        }
        _ => None,
    }
}

/// Scans the Rust code blocks of the doc comment collected in `doc`.
fn flush_doc(doc: &mut String, out: &mut BTreeMap<String, usize>) {
    if doc.is_empty() {
        return;
    }
    for code in doc_code(doc) {
        if let Ok(tokens) = code.parse::<TokenStream>() {
            scan(tokens, false, out);
        }
    }
    doc.clear();
}

/// An `impl` that starts an item (not `impl Trait` in a type position).
fn starts_impl_block(tokens: &[TokenTree], i: usize) -> bool {
    match i.checked_sub(1).map(|p| &tokens[p]) {
        None => true,
        Some(TokenTree::Punct(p)) => p.as_char() == ';',
        Some(TokenTree::Group(g)) => {
            g.delimiter() == Delimiter::Brace || g.delimiter() == Delimiter::Bracket
        }
        Some(TokenTree::Ident(id)) => id == "unsafe" || id == "default",
        Some(TokenTree::Literal(_)) => false,
    }
}

fn scan_attribute(inner: &[TokenTree], out: &mut BTreeMap<String, usize>) {
    for t in inner {
        match t {
            TokenTree::Literal(lit) => {
                for word in string_value(lit).iter().flat_map(|s| words(s)) {
                    *out.entry(word).or_default() += 1;
                }
            }
            TokenTree::Group(g) => {
                let inner: Vec<TokenTree> = g.stream().into_iter().collect();
                scan_attribute(&inner, out);
            }
            _ => {}
        }
    }
}

/// The Rust code blocks of a doc comment (fences without a language or
/// with a Rust one; `# ` hidden lines included).
fn doc_code(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    // Inside a fence: `Some(is_rust)`, with the lines so far.
    let mut fence: Option<bool> = None;
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            match fence.take() {
                Some(true) => blocks.push(std::mem::take(&mut current)),
                Some(false) => current.clear(),
                None => {
                    let info = info.trim_start_matches('`').trim();
                    fence = Some(info.split(',').all(|t| {
                        matches!(
                            t.trim(),
                            "" | "rust" | "no_run" | "ignore" | "should_panic" | "compile_fail"
                        )
                    }));
                }
            }
        } else if fence.is_some() {
            current.push_str(trimmed.strip_prefix("# ").unwrap_or(trimmed));
            current.push('\n');
        }
    }
    blocks
}

fn string_value(lit: &proc_macro2::Literal) -> Option<String> {
    let tokens = TokenStream::from(TokenTree::Literal(lit.clone()));
    syn::parse2::<syn::LitStr>(tokens).ok().map(|s| s.value())
}

/// `name` for every `{name}` or `{name:…}` in a format string.
fn format_captures(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let (name, after) = rest.split_at(end);
        if !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && (after.starts_with('}') || after.starts_with(':'))
        {
            out.push(name.to_owned());
        }
    }
    out
}

fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty() && !w.starts_with(|c: char| c.is_ascii_digit()))
        .map(str::to_owned)
        .collect()
}

fn skip_past_semicolon(tokens: &[TokenTree], mut i: usize) -> usize {
    while i < tokens.len() {
        if matches!(&tokens[i], TokenTree::Punct(p) if p.as_char() == ';') {
            return i + 1;
        }
        i += 1;
    }
    i
}

/// The index after the item starting at `i`: through its first brace
/// group (a body) or its `;`, whichever comes first.
fn skip_item(tokens: &[TokenTree], mut i: usize) -> usize {
    while i < tokens.len() {
        match &tokens[i] {
            TokenTree::Punct(p) if p.as_char() == ';' => return i + 1,
            TokenTree::Group(g) if g.delimiter() == Delimiter::Brace => {
                // `struct S { … }` ends here; `const X: T = T { … };` at its `;`.
                let next_is_semi =
                    matches!(tokens.get(i + 1), Some(TokenTree::Punct(p)) if p.as_char() == ';');
                return i + 1 + usize::from(next_is_semi);
            }
            _ => i += 1,
        }
    }
    i
}

// ── dead public API ────────────────────────────────────────────────────────

/// A `pub` item of a library crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubItem {
    /// Its file.
    pub file: String,
    /// Its line.
    pub line: usize,
    /// `fn`, `struct`, …
    pub kind: &'static str,
    /// Its name.
    pub name: String,
    /// It has a doc comment.
    pub documented: bool,
}

/// Every `pub` item of the library crates outside `#[cfg(test)]`: free
/// items and inherent `impl` items (trait impls are not API of their own).
/// The store's conformance tests (`src/conformance/` but its harness and
/// fixtures) are test bodies, called from the suite's macro.
pub fn pub_items(ws: &Workspace) -> Vec<PubItem> {
    let mut out = Vec::new();
    for file in ws.library_files() {
        if is_conformance_test(&file.path) {
            continue;
        }
        let mut v = PubItems {
            file: &file.path,
            out: &mut out,
        };
        v.visit_file(&file.syntax);
    }
    out
}

/// A module of the store's conformance suite holding test bodies.
fn is_conformance_test(path: &str) -> bool {
    path.contains("/src/conformance/")
        && !path.ends_with("/mod.rs")
        && !path.ends_with("/fixtures.rs")
}

struct PubItems<'a> {
    file: &'a str,
    out: &'a mut Vec<PubItem>,
}

impl PubItems<'_> {
    fn push(
        &mut self,
        vis: &syn::Visibility,
        attrs: &[syn::Attribute],
        kind: &'static str,
        ident: &syn::Ident,
    ) {
        if matches!(vis, syn::Visibility::Public(_)) {
            self.out.push(PubItem {
                file: self.file.to_owned(),
                line: ident.span().start().line,
                kind,
                name: ident.to_string(),
                documented: has_doc(attrs),
            });
        }
    }
}

impl<'ast> Visit<'ast> for PubItems<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if is_cfg_test(item_attrs(item)) {
            return;
        }
        match item {
            syn::Item::Fn(i) => self.push(&i.vis, &i.attrs, "fn", &i.sig.ident),
            syn::Item::Struct(i) => self.push(&i.vis, &i.attrs, "struct", &i.ident),
            syn::Item::Enum(i) => self.push(&i.vis, &i.attrs, "enum", &i.ident),
            syn::Item::Trait(i) => self.push(&i.vis, &i.attrs, "trait", &i.ident),
            syn::Item::Type(i) => self.push(&i.vis, &i.attrs, "type", &i.ident),
            syn::Item::Const(i) => self.push(&i.vis, &i.attrs, "const", &i.ident),
            syn::Item::Static(i) => self.push(&i.vis, &i.attrs, "static", &i.ident),
            syn::Item::Union(i) => self.push(&i.vis, &i.attrs, "union", &i.ident),
            syn::Item::Impl(i) if i.trait_.is_some() => return,
            _ => {}
        }
        syn::visit::visit_item(self, item);
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        match item {
            syn::ImplItem::Fn(f) if !is_cfg_test(&f.attrs) => {
                self.push(&f.vis, &f.attrs, "fn", &f.sig.ident)
            }
            syn::ImplItem::Const(c) if !is_cfg_test(&c.attrs) => {
                self.push(&c.vis, &c.attrs, "const", &c.ident)
            }
            _ => {}
        }
    }
}

/// `pub` items of library crates without a user (see the module docs), and
/// stale entries of [`UNUSED_API_PENDING`].
pub fn unused_pub_items(ws: &Workspace) -> Vec<String> {
    unused_pub_items_with(ws, UNUSED_API_PENDING)
}

fn unused_pub_items_with(ws: &Workspace, api_pending: &[(&str, &str, &str)]) -> Vec<String> {
    let uses = Uses::of(ws);
    let mut out = Vec::new();
    let mut pending_seen = BTreeSet::new();
    for item in pub_items(ws) {
        let own = crate_of(&item.file);
        let pending = api_pending
            .iter()
            .find(|(k, n, _)| *k == own && *n == item.name);
        let at = format!(
            "{}:{}: pub {} {}",
            item.file, item.line, item.kind, item.name
        );
        if !uses.all.contains_key(&item.name) {
            match pending {
                Some((k, n, _)) => {
                    pending_seen.insert((*k, *n));
                }
                None => out.push(format!(
                    "{at} is used nowhere in the workspace (no code, test or doc example names it); use it (a test counts) or delete it"
                )),
            }
            continue;
        }
        let elsewhere = uses
            .by_crate
            .iter()
            .any(|(k, u)| *k != own && u.contains_key(&item.name));
        if !item.documented && !elsewhere {
            out.push(format!(
                "{at} has no doc comment and no user outside {own}; make it pub(crate), or say what it is"
            ));
        }
    }
    for (krate, name, _) in api_pending {
        if !pending_seen.contains(&(*krate, *name)) {
            out.push(format!(
                "{krate}: UNUSED_API_PENDING lists {name}, which is used or gone now; remove the entry"
            ));
        }
    }
    out
}

// ── config keys ────────────────────────────────────────────────────────────

/// A key of the generated table in docs/CONFIG.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocumentedKey {
    /// Dotted path, `providers.NAME.kind` for provider keys.
    pub key: String,
    /// Its row is marked [`NOT_SUPPORTED_MARK`].
    pub not_supported: bool,
}

/// The keys of the `| Key | Default | Meaning |` table in `config_md`.
pub fn documented_keys(config_md: &str) -> Vec<DocumentedKey> {
    config_md
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split(" | ").collect();
            let key = cells.first()?.strip_prefix("| `")?.strip_suffix('`')?;
            Some(DocumentedKey {
                key: key.to_owned(),
                not_supported: cells.get(2)?.starts_with(NOT_SUPPORTED_MARK),
            })
        })
        .collect()
}

/// Documented keys without a reader, and keys marked not supported that
/// have one.
///
/// A key is *read* when the last segment of its path is accessed as a
/// field (`x.field`, or `Struct { field, .. }` in a pattern) in non-test
/// code of a library crate, outside the files that only parse, validate or
/// document configuration ([`CONFIG_MACHINERY`]) and outside `Default`
/// impls, inside a function that non-test code calls (its name appears
/// outside its own definition). A conversion nobody calls does not count;
/// one that is called only by such a conversion is caught by
/// [`unused_pub_items`] on the uncalled one.
pub fn unread_config_keys(ws: &Workspace, config_md: &str) -> Vec<String> {
    let keys = documented_keys(config_md);
    let uses = Uses::of(ws);
    let mut reads: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in ws.library_files() {
        if CONFIG_MACHINERY.contains(&file.path.as_str()) {
            continue;
        }
        let mut v = FieldReads::default();
        v.visit_file(&file.syntax);
        for (field, func) in v.reads {
            if uses.non_test.get(&func).copied().unwrap_or(0) > 0 {
                reads
                    .entry(field)
                    .or_default()
                    .push(format!("{}::{func}", file.path));
            }
        }
    }
    let mut out = Vec::new();
    if keys.is_empty() {
        out.push("docs/CONFIG.md has no key table".to_owned());
    }
    for DocumentedKey { key, not_supported } in keys {
        let field = key.rsplit('.').next().unwrap_or(&key);
        match (reads.get(field), not_supported) {
            (None, false) => out.push(format!(
                "{key}: documented in docs/CONFIG.md but nothing reads it; wire it, or mark it {NOT_SUPPORTED_MARK} in crates/gateway/src/config/reference.rs"
            )),
            (Some(readers), true) => out.push(format!(
                "{key}: marked not supported yet but read by {}; drop the mark",
                readers.join(", ")
            )),
            _ => {}
        }
    }
    out
}

/// (field, enclosing function) of every named field read outside
/// `#[cfg(test)]` and `Default` impls.
#[derive(Default)]
struct FieldReads {
    func: Vec<String>,
    reads: Vec<(String, String)>,
}

impl FieldReads {
    fn read(&mut self, member: &syn::Member) {
        if let (syn::Member::Named(field), Some(func)) = (member, self.func.last()) {
            self.reads.push((field.to_string(), func.clone()));
        }
    }
}

impl<'ast> Visit<'ast> for FieldReads {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !is_cfg_test(item_attrs(item)) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        let is_default = i
            .trait_
            .as_ref()
            .and_then(|(_, path, _)| path.segments.last())
            .is_some_and(|s| s.ident == "Default");
        if !is_default {
            syn::visit::visit_item_impl(self, i);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.func.push(f.sig.ident.to_string());
        syn::visit::visit_item_fn(self, f);
        self.func.pop();
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_cfg_test(&f.attrs) {
            return;
        }
        self.func.push(f.sig.ident.to_string());
        syn::visit::visit_impl_item_fn(self, f);
        self.func.pop();
    }

    fn visit_expr_field(&mut self, e: &'ast syn::ExprField) {
        self.read(&e.member);
        syn::visit::visit_expr_field(self, e);
    }

    fn visit_field_pat(&mut self, p: &'ast syn::FieldPat) {
        self.read(&p.member);
        syn::visit::visit_field_pat(self, p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(files: &[(&str, &str)]) -> Workspace {
        Workspace::from_texts(
            files
                .iter()
                .map(|(p, t)| ((*p).to_owned(), (*t).to_owned()))
                .collect(),
        )
        .unwrap()
    }

    fn real() -> (Workspace, PathBuf) {
        let root = crate::root();
        (Workspace::load(&root).expect("workspace"), root)
    }

    // ── sizes ──

    #[test]
    fn a_file_over_the_limit_is_reported_and_its_tests_do_not_count() {
        let body = "fn f() {}\n".repeat(MAX_FILE_CODE_LINES);
        let tests = format!(
            "#[cfg(test)]\nmod tests {{\n{}}}\n",
            "fn t() {}\n".repeat(50)
        );
        let comments = "// a comment\n\n/// a doc line\n".repeat(200);
        let at_limit = format!("{comments}{body}{tests}");
        let over = format!("{at_limit}fn one_more() {{}}\n");
        let w = ws(&[
            ("crates/store/src/at_limit.rs", &at_limit),
            ("crates/store/src/over.rs", &over),
            ("crates/store/tests/long.rs", &over),
        ]);
        assert_eq!(
            long_files(&w),
            ["crates/store/src/over.rs: 901 lines of non-test code (at most 900); split it along its sections"]
        );
    }

    #[test]
    fn a_file_included_only_under_cfg_test_is_test_code() {
        let long = "fn f() {}\n".repeat(MAX_FILE_CODE_LINES + 1);
        let w = ws(&[
            (
                "crates/core/src/lib.rs",
                "#[cfg(test)]\nmod tests;\nmod real;\n",
            ),
            ("crates/core/src/tests.rs", &long),
            ("crates/core/src/real.rs", &long),
        ]);
        let v = long_files(&w);
        assert_eq!(v.len(), 1, "{v:#?}");
        assert!(v[0].starts_with("crates/core/src/real.rs:"), "{v:#?}");
    }

    #[test]
    fn a_long_function_is_reported_a_data_table_is_not() {
        let long_body = "    let _x = 1;\n".repeat(MAX_FN_LINES - 2);
        let file = format!(
            "fn fits() {{\n{long_body}}}\nstruct S;\nimpl S {{\n    pub fn too_long(&self) {{\n{long_body}    let _y = 2;\n    }}\n}}\n#[cfg(test)]\nmod tests {{\n    fn long_test() {{\n{long_body}{long_body}}}\n}}\n"
        );
        let table = format!("pub fn reference() {{\n{long_body}{long_body}}}\n");
        let w = ws(&[
            ("crates/engine/src/manager.rs", &file),
            ("crates/gateway/src/config/reference.rs", &table),
        ]);
        assert_eq!(
            long_fns(&w),
            ["crates/engine/src/manager.rs:153: fn too_long is 151 lines (at most 150); split it into its steps"]
        );
    }

    #[test]
    fn a_stale_data_table_entry_is_reported() {
        let w = ws(&[(
            "crates/gateway/src/config/reference.rs",
            "pub fn reference() {}\n",
        )]);
        assert_eq!(
            long_fns(&w),
            ["crates/gateway/src/config/reference.rs: DATA_TABLES lists fn reference, which is gone or short now; remove the entry"]
        );
    }

    #[test]
    fn the_workspace_keeps_files_and_functions_short() {
        let (w, _) = real();
        let mut v = long_files(&w);
        v.extend(long_fns(&w));
        assert!(v.is_empty(), "{}", v.join("\n"));
    }

    // ── dead public API ──

    const LIB: &str = r#"//! A crate.
#![deny(missing_docs)]
use crate::Imported;
/// Documented and used by the other crate.
pub fn used_elsewhere() {}
/// Documented, used nowhere.
pub fn dead_documented() {}
pub fn dead_undocumented() {}
pub fn undocumented_used_only_here() {}
pub fn undocumented_used_by_the_engine() {}
/// Only a doc example uses it:
/// ```
/// # fn main() {
/// keel_core::in_doc_example();
/// # }
/// ```
/// ```text
/// not_rust_so_not_a_use
/// ```
pub fn in_doc_example() {}
/// Named only in a text block.
pub fn not_rust_so_not_a_use() {}
/// Used only by its own crate's tests.
pub const TESTED: u32 = 1;
/// Used in a format string.
pub const IN_FORMAT: u32 = 2;
/// Named by a serde attribute.
pub fn serde_default() -> u32 { 0 }
/// A type with impls and nothing else.
pub struct OnlyImpl;
impl std::fmt::Display for OnlyImpl {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { Ok(()) }
}
impl OnlyImpl {
    /// An inherent method nobody calls.
    pub fn never_called(&self) {}
    pub(crate) fn crate_only(&self) {}
}
#[derive(serde::Deserialize)]
struct Config { #[serde(default = "serde_default")] x: u32 }
fn show() -> String { undocumented_used_only_here(); format!("{IN_FORMAT}") }
#[cfg(test)]
mod tests {
    pub fn helper() {}
    #[test]
    fn t() { assert_eq!(super::TESTED, 1); }
}
"#;

    const ENGINE: &str =
        "fn f() { keel_core::used_elsewhere(); keel_core::undocumented_used_by_the_engine(); }";

    #[test]
    fn pub_items_without_a_user_are_reported_with_their_location() {
        let w = ws(&[
            ("crates/core/src/lib.rs", LIB),
            ("crates/engine/src/lib.rs", ENGINE),
        ]);
        assert_eq!(
            unused_pub_items_with(&w, &[]),
            [
                "crates/core/src/lib.rs:7: pub fn dead_documented is used nowhere in the workspace (no code, test or doc example names it); use it (a test counts) or delete it",
                "crates/core/src/lib.rs:8: pub fn dead_undocumented is used nowhere in the workspace (no code, test or doc example names it); use it (a test counts) or delete it",
                "crates/core/src/lib.rs:9: pub fn undocumented_used_only_here has no doc comment and no user outside crates/core; make it pub(crate), or say what it is",
                "crates/core/src/lib.rs:22: pub fn not_rust_so_not_a_use is used nowhere in the workspace (no code, test or doc example names it); use it (a test counts) or delete it",
                "crates/core/src/lib.rs:30: pub struct OnlyImpl is used nowhere in the workspace (no code, test or doc example names it); use it (a test counts) or delete it",
                "crates/core/src/lib.rs:36: pub fn never_called is used nowhere in the workspace (no code, test or doc example names it); use it (a test counts) or delete it",
            ]
        );
    }

    #[test]
    fn pending_api_is_accepted_while_unused_and_reported_once_used() {
        let inbox =
            "/// Later.\npub fn dead_letter_events() {}\n/// Later.\npub fn group_runs() {}\n";
        let w = ws(&[
            ("crates/store/src/inbox.rs", inbox),
            ("crates/engine/src/lib.rs", "fn f() { store.group_runs(); }"),
        ]);
        let pending = [
            ("crates/store", "dead_letter_events", "later"),
            ("crates/store", "group_runs", "later"),
        ];
        let v = unused_pub_items_with(&w, &pending);
        assert!(
            !v.iter().any(|m| m.contains("dead_letter_events")),
            "{v:#?}"
        );
        assert!(
            v.contains(&"crates/store: UNUSED_API_PENDING lists group_runs, which is used or gone now; remove the entry".to_owned()),
            "{v:#?}"
        );
    }

    #[test]
    fn the_workspace_has_no_dead_public_api() {
        let (w, _) = real();
        let v = unused_pub_items(&w);
        assert!(v.is_empty(), "{}", v.join("\n"));
    }

    // ── citations ──

    #[test]
    fn comments_citing_outside_documents_are_reported() {
        let text = "/// Quotas (seed 002 \u{a7}4.1).\n// As SPEC says.\n// a seed 12 is fine\nconst S: &str = \"seed 002\";\n";
        let w = ws(&[
            ("crates/core/src/a.rs", text),
            ("xtask/src/b.rs", "//! SPEC\n"),
        ]);
        assert_eq!(
            outside_citations(&w),
            [
                "crates/core/src/a.rs:1: the comment cites a document outside the repository; state the rule itself",
                "crates/core/src/a.rs:2: the comment cites a document outside the repository; state the rule itself",
                "xtask/src/b.rs:1: the comment cites a document outside the repository; state the rule itself",
            ]
        );
    }

    #[test]
    fn no_comment_cites_an_outside_document() {
        let (w, _) = real();
        let v = outside_citations(&w);
        assert!(v.is_empty(), "{}", v.join("\n"));
    }

    // ── config keys ──

    const CONFIG_MD: &str = "\
| Key | Default | Meaning |
|---|---|---|
| `storage.busy_timeout_ms` | `5000` | Milliseconds. |
| `session.ttl_hours` | `24` | Hours. |
| `server.bind` | `\"127.0.0.1:7420\"` | **Not supported yet.** Address. |
| `orchestration.max_inbox_wait_secs` | `30` | **Not supported yet.** Seconds. |
| `providers.NAME.model` | required | Model. |
";

    const CONFIG_RS: &str = r#"
pub struct Config { pub storage: Storage, pub session: Session }
impl Default for Config {
    fn default() -> Self { let s = Session::default(); let _ = s.ttl_hours; todo!() }
}
impl Config {
    /// Called by the app.
    pub fn store_options(&self) -> u64 { self.storage.busy_timeout_ms }
    /// Called by nobody but tests.
    pub fn ttl(&self) -> u64 { self.session.ttl_hours }
    /// Reads a key marked not supported.
    pub fn wait(&self) -> u64 { let Orchestration { max_inbox_wait_secs, .. } = self.o; max_inbox_wait_secs }
}
"#;

    #[test]
    fn config_keys_need_a_called_reader_unless_marked() {
        let w = ws(&[
            ("crates/gateway/src/config.rs", CONFIG_RS),
            (
                "crates/gateway/src/config/validate.rs",
                "fn check(c: &Config) { let _ = c.server.bind; let _ = c.providers.model; }",
            ),
            (
                "crates/gateway/src/app.rs",
                "fn open(c: &Config) { c.store_options(); c.wait(); }",
            ),
            (
                "crates/gateway/tests/config.rs",
                "fn t(c: &Config) { c.ttl(); }",
            ),
            (
                "crates/providers/src/profile.rs",
                "pub fn build(p: &Profile) -> String { p.model.clone() }\nfn caller(p: &Profile) { build(p); }",
            ),
        ]);
        assert_eq!(
            unread_config_keys(&w, CONFIG_MD),
            [
                "session.ttl_hours: documented in docs/CONFIG.md but nothing reads it; wire it, or mark it **Not supported yet.** in crates/gateway/src/config/reference.rs",
                "orchestration.max_inbox_wait_secs: marked not supported yet but read by crates/gateway/src/config.rs::wait; drop the mark",
            ]
        );
    }

    #[test]
    fn the_documented_config_keys_are_read() {
        let (w, root) = real();
        let md = std::fs::read_to_string(root.join("docs/CONFIG.md")).unwrap();
        let keys = documented_keys(&md);
        assert!(keys.len() > 30, "{keys:?}");
        let v = unread_config_keys(&w, &md);
        assert!(v.is_empty(), "{}", v.join("\n"));
    }
}
