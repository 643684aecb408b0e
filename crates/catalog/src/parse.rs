//! The strict frontmatter parser: text in, an unresolved [`AgentDefinition`]
//! or every problem found out. No filesystem access; the loader and the fuzz
//! target both call [`parse_definition_bytes`].
//!
//! Order of checks: delimiters and size, then a line scan (tabs in
//! indentation, document markers), then serde_yaml into a `Value` (syntax,
//! duplicate keys), then a walk over a field table that reports every unknown
//! key, wrong type and out-of-range value with its key path and line, and
//! finally serde_yaml into the `deny_unknown_fields` structs as the
//! authoritative typed parse.

use std::collections::BTreeMap;
use std::path::Path;

use keel_core::AgentId;
use serde_yaml::Value;

use crate::definition::*;
use crate::diagnostic::{edit_distance, Diagnostic, DiagnosticKind as K};
use crate::locate::{render_path, Locator, Seg};
use crate::skills::{Skill, SkillFrontmatter};

/// Largest definition file, in bytes (checked before reading).
pub const MAX_DEFINITION_BYTES: u64 = 256 * 1024;
/// Largest frontmatter (between the delimiters), in bytes.
pub const MAX_FRONTMATTER_BYTES: usize = 16 * 1024;
/// Ids no definition may use: names of roles and of the runtime itself, and
/// `general`, kept for a built-in compatibility agent that delegations
/// naming no agent fall back to.
pub const RESERVED_IDS: &[&str] = &[
    "root",
    "system",
    "user",
    "assistant",
    "tool",
    "keel",
    "general",
];

/// Whether `id` is reserved (see [`RESERVED_IDS`]).
pub fn is_reserved(id: &str) -> bool {
    RESERVED_IDS.contains(&id)
}

/// Parses one definition from raw bytes: size limit, UTF-8, then
/// [`parse_definition`]. `file` is only used in diagnostics.
pub fn parse_definition_bytes(
    file: &Path,
    bytes: &[u8],
) -> Result<AgentDefinition, Vec<Diagnostic>> {
    if bytes.len() as u64 > MAX_DEFINITION_BYTES {
        return Err(vec![too_large(file, bytes.len() as u64)]);
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => parse_definition(file, text),
        Err(e) => Err(vec![not_utf8(file, bytes, &e)]),
    }
}

fn not_utf8(file: &Path, bytes: &[u8], e: &std::str::Utf8Error) -> Diagnostic {
    let line = bytes[..e.valid_up_to()]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1;
    Diagnostic::new(
        Some(file),
        K::NotUtf8,
        format!(
            "the file is not valid UTF-8 (first bad byte at offset {}); save it as UTF-8",
            e.valid_up_to()
        ),
    )
    .at(line, None)
}

pub(crate) fn too_large(file: &Path, len: u64) -> Diagnostic {
    Diagnostic::new(
        Some(file),
        K::FileTooLarge,
        format!("the file is {len} bytes; definitions are limited to {MAX_DEFINITION_BYTES} bytes"),
    )
}

/// Parses one definition from text. The result is not yet resolved against
/// other agents, profiles, tools or skills (the catalog does that).
pub fn parse_definition(file: &Path, text: &str) -> Result<AgentDefinition, Vec<Diagnostic>> {
    parse_full(file, text).outcome
}

/// A parse outcome plus what the resolution pass needs to point at lines.
pub(crate) struct Parsed {
    /// The definition, or every problem of this file.
    pub outcome: Result<AgentDefinition, Vec<Diagnostic>>,
    /// The frontmatter YAML text (empty when it could not be split out).
    pub yaml: String,
    /// The id of a file that failed to parse, when its `id` key was valid;
    /// lets other files delegate to it without a second, misleading error.
    pub salvaged_id: Option<AgentId>,
    /// Problems that do not fail the load.
    pub warnings: Vec<Diagnostic>,
}

pub(crate) fn parse_bytes_full(file: &Path, bytes: &[u8]) -> Parsed {
    match std::str::from_utf8(bytes) {
        Ok(text) if bytes.len() as u64 <= MAX_DEFINITION_BYTES => parse_full(file, text),
        _ => Parsed {
            outcome: parse_definition_bytes(file, bytes),
            yaml: String::new(),
            salvaged_id: None,
            warnings: Vec::new(),
        },
    }
}

pub(crate) fn parse_full(file: &Path, text: &str) -> Parsed {
    let checked = match check_document(file, text, &AGENT) {
        Ok(c) => c,
        Err(rejected) => {
            let salvaged_id = match &rejected.value {
                Some(value) => value
                    .get("id")
                    .and_then(Value::as_str)
                    .and_then(|s| AgentId::parse(s).ok()),
                None => salvage_id(rejected.yaml),
            };
            return Parsed {
                outcome: Err(rejected.diags),
                yaml: rejected.yaml.to_owned(),
                salvaged_id,
                warnings: Vec::new(),
            };
        }
    };
    let warnings = crate::warnings::second_frontmatter(file, checked.raw_body, checked.body_line)
        .into_iter()
        .collect();
    let outcome = typed::<Frontmatter>(file, checked.value)
        .map(|fm| AgentDefinition::from_frontmatter(fm, checked.body, file.to_path_buf()));
    Parsed {
        outcome,
        yaml: checked.yaml.to_owned(),
        salvaged_id: None,
        warnings,
    }
}

/// Parses one skill file: a frontmatter with `name` and `description`, then
/// the skill's instructions. Same strictness as agent definitions.
pub fn parse_skill(file: &Path, text: &str) -> Result<Skill, Vec<Diagnostic>> {
    let checked = check_document(file, text, &SKILL).map_err(|r| r.diags)?;
    let fm = typed::<SkillFrontmatter>(file, checked.value)?;
    Ok(Skill {
        name: fm.name,
        description: fm.description,
        body: checked.body,
        source_file: file.to_path_buf(),
    })
}

/// [`parse_skill`] from raw bytes: size limit and UTF-8 first.
pub fn parse_skill_bytes(file: &Path, bytes: &[u8]) -> Result<Skill, Vec<Diagnostic>> {
    if bytes.len() as u64 > MAX_DEFINITION_BYTES {
        return Err(vec![too_large(file, bytes.len() as u64)]);
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => parse_skill(file, text),
        Err(e) => Err(vec![not_utf8(file, bytes, &e)]),
    }
}

/// The authoritative typed parse of a value the walk accepted. The walk
/// checks at least what the `deny_unknown_fields` structs check; this is the
/// fail-closed backstop if they ever disagree.
fn typed<T: serde::de::DeserializeOwned>(file: &Path, value: Value) -> Result<T, Vec<Diagnostic>> {
    serde_yaml::from_value::<T>(value).map_err(|e| {
        vec![Diagnostic::new(
            Some(file),
            K::WrongType,
            strip_location(&e.to_string()),
        )]
    })
}

/// What a frontmatter document describes: its keys and the wording of the
/// structural errors that name them.
pub(crate) struct DocKind {
    fields: &'static [Field],
    /// Keys named when the opening `---` is missing.
    keys: &'static str,
    /// The required keys, for an empty frontmatter.
    needs: &'static str,
    /// The error for an empty body.
    empty_body: &'static str,
    /// Whether a misplaced key may belong in a nested table (`limits:` …).
    nested: bool,
}

const AGENT: DocKind = DocKind {
    fields: TOP,
    keys: "id, description, llm_profile …",
    needs: "`id`, `description` and `llm_profile`",
    empty_body: "the role prompt after the frontmatter is empty; write the agent's instructions below the closing `---`",
    nested: true,
};

const SKILL: DocKind = DocKind {
    fields: SKILL_TOP,
    keys: "name, description",
    needs: "`name` and `description`",
    empty_body: "the skill's instructions after the frontmatter are empty; write them below the closing `---`",
    nested: false,
};

/// A document that passed every check: its YAML value, normalized body and
/// YAML text.
struct Checked<'a> {
    value: Value,
    body: String,
    yaml: &'a str,
    /// The body as written, and its first line's number in the file.
    raw_body: &'a str,
    body_line: usize,
}

/// A document with problems: every one of them, its YAML text, and the
/// parsed value when the YAML itself was valid.
struct Rejected<'a> {
    diags: Vec<Diagnostic>,
    yaml: &'a str,
    value: Option<Value>,
}

/// Delimiters and size, the line scan, the YAML parse and the walk over
/// `kind`'s keys; every problem found is returned.
fn check_document<'a>(
    file: &Path,
    text: &'a str,
    kind: &DocKind,
) -> Result<Checked<'a>, Rejected<'a>> {
    let rejected = |diags, yaml, value| Rejected { diags, yaml, value };
    let parts = split(file, text, kind).map_err(|diags| rejected(diags, "", None))?;
    let mut diags = scan_lines(file, parts.yaml);
    let body = normalize_body(parts.body);
    if body.is_empty() {
        diags.push(
            Diagnostic::new(Some(file), K::EmptyBody, kind.empty_body).at(parts.body_line, None),
        );
    }
    if diags.iter().any(|d| d.kind != K::EmptyBody) {
        // Tabs or document markers make the YAML mean something else or fail;
        // report them alone rather than serde_yaml's confusing consequences.
        return Err(rejected(diags, parts.yaml, None));
    }
    let value: Value = match serde_yaml::from_str(parts.yaml) {
        Ok(v) => v,
        Err(e) => {
            diags.insert(0, yaml_error(file, parts.yaml, &e));
            return Err(rejected(diags, parts.yaml, None));
        }
    };
    let mut walk = Walk {
        file,
        kind,
        locator: Locator::new(parts.yaml),
        diags: Vec::new(),
    };
    walk.top(&value);
    let mut all = walk.diags;
    all.append(&mut diags);
    // Compiler order: by line, problems without a line (missing keys) first.
    all.sort_by_key(|d| d.line.unwrap_or(0));
    if !all.is_empty() {
        return Err(rejected(all, parts.yaml, Some(value)));
    }
    Ok(Checked {
        value,
        body,
        yaml: parts.yaml,
        raw_body: parts.body,
        body_line: parts.body_line,
    })
}

struct Parts<'a> {
    yaml: &'a str,
    body: &'a str,
    /// 1-based file line of the first body line.
    body_line: usize,
}

/// Lines of `text` with their byte ranges (`\n` excluded, `\r` kept).
fn lines_with_offsets(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= text.len() {
            return None;
        }
        let rest = &text[start..];
        let line_len = rest.find('\n').unwrap_or(rest.len());
        let line = &rest[..line_len];
        let at = start;
        start += line_len + 1;
        Some((at, line))
    })
}

pub(crate) fn is_delimiter(line: &str) -> bool {
    line.trim_end() == "---"
}

fn split<'a>(file: &Path, text: &'a str, kind: &DocKind) -> Result<Parts<'a>, Vec<Diagnostic>> {
    let missing =
        |msg: &str| vec![Diagnostic::new(Some(file), K::MissingFrontmatter, msg).at(1, Some(1))];
    if text.starts_with('\u{feff}') {
        return Err(missing(
            "the file starts with a UTF-8 byte order mark; save it without BOM so the first line is `---`",
        ));
    }
    let mut lines = lines_with_offsets(text);
    match lines.next() {
        Some((_, first)) if is_delimiter(first) => {}
        _ => {
            return Err(missing(&format!(
                "the first line must be `---`, opening the YAML frontmatter ({})",
                kind.keys
            )))
        }
    }
    let yaml_start = text.find('\n').map_or(text.len(), |i| i + 1);
    for (n, (at, line)) in lines.enumerate() {
        if is_delimiter(line) {
            let yaml = &text[yaml_start..at];
            if yaml.len() > MAX_FRONTMATTER_BYTES {
                return Err(vec![Diagnostic::new(
                    Some(file),
                    K::FrontmatterTooLarge,
                    format!(
                        "the frontmatter is {} bytes; the limit is {MAX_FRONTMATTER_BYTES} — move long text into the body",
                        yaml.len()
                    ),
                )
                .at(2, None)]);
            }
            let body_at = (at + line.len() + 1).min(text.len());
            return Ok(Parts {
                yaml,
                body: &text[body_at..],
                body_line: n + 3,
            });
        }
    }
    Err(vec![Diagnostic::new(
        Some(file),
        K::UnclosedFrontmatter,
        "the frontmatter opened on line 1 is never closed; add a line `---` after the last key",
    )
    .at(1, Some(1))])
}

/// Tabs in indentation and YAML document markers, line by line.
fn scan_lines(file: &Path, yaml: &str) -> Vec<Diagnostic> {
    let mut diags = Vec::new();
    for (i, line) in yaml.split('\n').enumerate() {
        let file_line = i + 2;
        let content = line.strip_suffix('\r').unwrap_or(line);
        if let Some((pos, c)) = content
            .char_indices()
            .find(|(_, c)| matches!(c, '\r' | '\u{85}' | '\u{2028}' | '\u{2029}'))
        {
            diags.push(
                Diagnostic::new(
                    Some(file),
                    K::LineBreak,
                    format!(
                        "the line contains the line break U+{:04X}; YAML would split the line here — save the file with LF or CRLF line endings only",
                        u32::from(c)
                    ),
                )
                .at(file_line, Some(content[..pos].chars().count() + 1)),
            );
            continue;
        }
        let lead: &str = &line[..line.len() - line.trim_start_matches([' ', '\t']).len()];
        if let Some(tab) = lead.find('\t') {
            diags.push(
                Diagnostic::new(
                    Some(file),
                    K::TabIndentation,
                    "a tab in the indentation; YAML indentation must use spaces only (a tab can silently change which key a value belongs to)",
                )
                .at(file_line, Some(tab + 1)),
            );
        }
        for marker in ["---", "..."] {
            if let Some(rest) = line.strip_prefix(marker) {
                if rest.is_empty() || rest.starts_with([' ', '\t', '\r']) {
                    diags.push(
                        Diagnostic::new(
                            Some(file),
                            K::MultipleDocuments,
                            format!(
                                "`{marker}` starts another YAML document inside the frontmatter; the frontmatter is one mapping closed by a line `---`"
                            ),
                        )
                        .at(file_line, Some(1)),
                    );
                }
            }
        }
    }
    diags
}

fn normalize_body(body: &str) -> String {
    let body = body.replace("\r\n", "\n");
    let mut start = 0;
    for line in body.split_inclusive('\n') {
        if line.trim().is_empty() {
            start += line.len();
        } else {
            break;
        }
    }
    body[start.min(body.len())..].trim_end().to_owned()
}

/// Removes serde_yaml's " at line N column M" / " at position N" notes; the
/// diagnostic carries the position in file coordinates instead.
fn strip_location(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(pos) = rest.find(" at ") {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 4..];
        let skip = ["line ", "position "].iter().find_map(|p| {
            let tail = after.strip_prefix(p)?;
            let digits = tail.len() - tail.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 {
                return None;
            }
            let tail = &tail[digits..];
            if *p == "line " {
                let col = tail.strip_prefix(" column ")?;
                let d = col.len() - col.trim_start_matches(|c: char| c.is_ascii_digit()).len();
                Some(&col[d..])
            } else {
                Some(tail)
            }
        });
        match skip {
            Some(tail) => rest = tail,
            None => {
                out.push_str(" at ");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The id of a file whose YAML cannot be parsed, from a plain top-level
/// `id: name` line.
fn salvage_id(yaml: &str) -> Option<AgentId> {
    yaml.lines().find_map(|l| {
        let v = l.strip_prefix("id:")?.trim();
        AgentId::parse(v.trim_matches(['"', '\''])).ok()
    })
}

/// The key named in serde_yaml's "duplicate entry with key \"k\"".
fn duplicate_key_name(msg: &str) -> Option<&str> {
    let rest = &msg[msg.find("with key \"")? + 10..];
    Some(&rest[..rest.find('"')?])
}

fn yaml_error(file: &Path, yaml: &str, e: &serde_yaml::Error) -> Diagnostic {
    let msg = strip_location(&e.to_string());
    let (kind, message) = if msg.contains("duplicate entry") || msg.contains("duplicate field") {
        let message = match duplicate_key_name(&msg) {
            Some(key) => format!(
                "the key `{key}` appears twice in one mapping; each key may appear only once — delete one of them"
            ),
            None => format!("{msg}; each key may appear only once — delete one of them"),
        };
        (K::DuplicateKey, message)
    } else if msg.contains("more than one document") {
        (
            K::MultipleDocuments,
            "the frontmatter holds more than one YAML document; it must be a single mapping"
                .to_owned(),
        )
    } else {
        (K::YamlSyntax, format!("invalid YAML: {msg}"))
    };
    let d = Diagnostic::new(Some(file), kind, message);
    let Some(loc) = e.location() else { return d };
    // serde_yaml lines are 1-based within the YAML text, which starts on line
    // 2 of the file. A duplicate key is reported at its mapping's start; point
    // at the repeated key instead when it can be found.
    if kind == K::DuplicateKey {
        if let Some(key) = duplicate_key_name(&msg) {
            let locator = Locator::new(yaml);
            let (start, ind) = (loc.line().saturating_sub(1), loc.column().saturating_sub(1));
            if let Some(line) = locator.second_key(start, ind, key) {
                let path = match locator.parent_key(start, ind) {
                    Some(parent) if ind > 0 => format!("{parent}.{key}"),
                    _ => key.to_owned(),
                };
                return d.at(line + 2, Some(ind + 1)).with_key(path);
            }
        }
    }
    d.at(loc.line() + 1, Some(loc.column()))
}

/// The type a frontmatter key must have.
#[derive(Clone, Copy)]
enum Ty {
    Id,
    SkillName,
    Text,
    Name,
    Names,
    AgentIds,
    Int(Bound),
    /// An amount of USD above 0.
    Usd,
    Delivery,
    Severities,
    Limits,
    Signal,
    Approval,
}

struct Field {
    name: &'static str,
    ty: Ty,
    required: bool,
}

const fn field(name: &'static str, ty: Ty, required: bool) -> Field {
    Field { name, ty, required }
}

const TOP: &[Field] = &[
    field("id", Ty::Id, true),
    field("description", Ty::Text, true),
    field("llm_profile", Ty::Name, true),
    field("tools", Ty::Names, false),
    field("delegates", Ty::AgentIds, false),
    field("skills", Ty::Names, false),
    field("limits", Ty::Limits, false),
    field("signal", Ty::Signal, false),
    field("approval", Ty::Approval, false),
];

const SKILL_TOP: &[Field] = &[
    field("name", Ty::SkillName, true),
    field("description", Ty::Text, true),
];

const LIMITS: &[Field] = &[
    field("max_iterations", Ty::Int(MAX_ITERATIONS_BOUND), false),
    field("timeout_secs", Ty::Int(TIMEOUT_SECS_BOUND), false),
    field("max_output_tokens", Ty::Int(MAX_OUTPUT_TOKENS_BOUND), false),
    field("max_children", Ty::Int(MAX_CHILDREN_BOUND), false),
    field("max_tokens_total", Ty::Int(MAX_TOKENS_TOTAL_BOUND), false),
    field("max_cost_usd", Ty::Usd, false),
];

const SIGNAL: &[Field] = &[
    field("delivery", Ty::Delivery, false),
    field("max_signals", Ty::Int(MAX_SIGNALS_BOUND), false),
    field("max_summary_bytes", Ty::Int(MAX_SUMMARY_BYTES_BOUND), false),
    field("max_details_bytes", Ty::Int(MAX_DETAILS_BYTES_BOUND), false),
    field("min_interval_ms", Ty::Int(MIN_INTERVAL_MS_BOUND), false),
    field("burst", Ty::Int(BURST_BOUND), false),
    field("severities", Ty::Severities, false),
    field(
        "dedupe_window_secs",
        Ty::Int(DEDUPE_WINDOW_SECS_BOUND),
        false,
    ),
    field("max_json_depth", Ty::Int(MAX_JSON_DEPTH_BOUND), false),
];

/// Which table (by its key path) holds `name`, for "wrong place" hints.
fn home_of(name: &str) -> Option<&'static str> {
    if TOP.iter().any(|f| f.name == name) {
        Some("the top level")
    } else if LIMITS.iter().any(|f| f.name == name) {
        Some("`limits:`")
    } else if SIGNAL.iter().any(|f| f.name == name) {
        Some("`signal:`")
    } else {
        None
    }
}

/// A short description of a YAML value for "found …" messages.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "no value".to_owned(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => {
            let short: String = s.chars().take(40).collect();
            let ell = if short.len() < s.len() { "…" } else { "" };
            format!("the string {short:?}{ell}")
        }
        Value::Sequence(_) => "a list".to_owned(),
        Value::Mapping(_) => "a mapping".to_owned(),
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}

struct Walk<'a> {
    file: &'a Path,
    kind: &'a DocKind,
    locator: Locator<'a>,
    diags: Vec<Diagnostic>,
}

impl Walk<'_> {
    fn push(&mut self, kind: K, path: &[Seg<'_>], message: String) {
        // Locator lines are 0-based within the YAML, which starts on line 2.
        let pos = self.locator.locate(path).map(|(l, c)| (l + 2, Some(c)));
        let mut d = Diagnostic::new(Some(self.file), kind, message).at_opt(pos);
        if !path.is_empty() {
            d = d.with_key(render_path(path));
        }
        self.diags.push(d);
    }

    fn top(&mut self, v: &Value) {
        match v {
            Value::Mapping(_) => self.mapping(v, &[], self.kind.fields),
            Value::Null => self.diags.push(
                Diagnostic::new(
                    Some(self.file),
                    K::NotAMapping,
                    format!(
                        "the frontmatter is empty; it needs at least {}",
                        self.kind.needs
                    ),
                )
                .at(2, None),
            ),
            other => self.diags.push(
                Diagnostic::new(
                    Some(self.file),
                    K::NotAMapping,
                    format!(
                        "the frontmatter must be a mapping of `key: value` lines, found {}",
                        describe(other)
                    ),
                )
                .at(2, Some(1)),
            ),
        }
    }

    fn mapping(&mut self, v: &Value, path: &[Seg<'_>], fields: &'static [Field]) {
        let Value::Mapping(map) = v else { return };
        let mut present: BTreeMap<&str, &Value> = BTreeMap::new();
        for (k, val) in map {
            let Value::String(name) = k else {
                self.push(
                    K::UnknownKey,
                    path,
                    format!("keys must be plain words, found {} as a key", describe(k)),
                );
                continue;
            };
            if fields.iter().any(|f| f.name == name) {
                present.insert(name.as_str(), val);
            } else {
                let mut p = path.to_vec();
                p.push(Seg::Key(name));
                let msg = self.unknown_key_message(name, path, fields);
                self.push(K::UnknownKey, &p, msg);
            }
        }
        for f in fields {
            let mut p = path.to_vec();
            p.push(Seg::Key(f.name));
            match present.get(f.name) {
                Some(val) => self.value(val, &p, f.ty),
                None if f.required => {
                    let where_ = if path.is_empty() {
                        "the frontmatter".to_owned()
                    } else {
                        format!("`{}`", render_path(path))
                    };
                    let mut d = Diagnostic::new(
                        Some(self.file),
                        K::MissingKey,
                        format!("required key is missing; add `{}:` to {where_}", f.name),
                    )
                    .with_key(render_path(&p));
                    if !path.is_empty() {
                        d = d.at_opt(self.locator.locate(path).map(|(l, c)| (l + 2, Some(c))));
                    }
                    self.diags.push(d);
                }
                None => {}
            }
        }
    }

    fn unknown_key_message(&self, name: &str, path: &[Seg<'_>], fields: &[Field]) -> String {
        let here = if path.is_empty() {
            "at the top level".to_owned()
        } else {
            format!("in `{}`", render_path(path))
        };
        let shown = crate::locate::display_key(name);
        let mut msg = format!("unknown key `{shown}` {here}");
        let best = fields
            .iter()
            .map(|f| (edit_distance(name, f.name), f.name))
            .min()
            .filter(|(d, n)| *d <= 2.max(n.len() / 4));
        if let Some((_, suggestion)) = best {
            msg.push_str(&format!("; did you mean `{suggestion}`?"));
        } else if let Some(home) = home_of(name).filter(|_| self.kind.nested) {
            msg.push_str(&format!(
                "; `{name}` belongs at {home} — check the indentation"
            ));
        } else {
            let known: Vec<&str> = fields.iter().map(|f| f.name).collect();
            msg.push_str(&format!("; known keys: {}", known.join(", ")));
        }
        msg
    }

    fn value(&mut self, v: &Value, path: &[Seg<'_>], ty: Ty) {
        if matches!(v, Value::Null) {
            let hint = match ty {
                Ty::Names | Ty::AgentIds | Ty::Severities | Ty::Approval => {
                    "write a list like `[a, b]` or remove the key"
                }
                Ty::Limits | Ty::Signal => "write `{}` for the defaults or remove the key",
                _ => "write a value or remove the key",
            };
            self.push(K::WrongType, path, format!("the key has no value; {hint}"));
            return;
        }
        match ty {
            Ty::Id => {
                if let Some(s) = self.string(v, path, "an agent id") {
                    self.agent_id(s, path, true);
                }
            }
            Ty::SkillName => {
                if let Some(s) = self.string(v, path, "a skill name") {
                    if let Err(keel_core::IdError::BadAgentId { value, reason }) = AgentId::parse(s)
                    {
                        self.push(
                            K::InvalidValue,
                            path,
                            format!(
                                "invalid skill name {value:?}: {reason} (names match [a-z][a-z0-9_-]{{0,63}})"
                            ),
                        );
                    }
                }
            }
            Ty::Text => {
                if let Some(s) = self.string(v, path, "text") {
                    self.text(s, path, MAX_DESCRIPTION_BYTES);
                }
            }
            Ty::Name => {
                if let Some(s) = self.string(v, path, "a name") {
                    self.text(s, path, MAX_NAME_BYTES);
                }
            }
            Ty::Names | Ty::AgentIds | Ty::Severities => self.list(v, path, ty),
            Ty::Approval => match v {
                Value::String(s) if s == "all" => {}
                Value::String(s) => self.push(
                    K::InvalidValue,
                    path,
                    format!("unknown approval {s:?}; write `all` or a list of tool names like `[shell, write_file]`"),
                ),
                _ => self.list(v, path, Ty::Names),
            },
            Ty::Int(bound) => self.int(v, path, bound),
            Ty::Usd => self.usd(v, path),
            Ty::Delivery => {
                if let Some(s) = self.string(v, path, "`queue` or `steer`") {
                    if s.parse::<keel_core::Delivery>().is_err() {
                        self.push(
                            K::InvalidValue,
                            path,
                            format!("unknown delivery {s:?}; expected `queue` or `steer`"),
                        );
                    }
                }
            }
            Ty::Limits | Ty::Signal => {
                if matches!(v, Value::Mapping(_)) {
                    let fields = if matches!(ty, Ty::Limits) {
                        LIMITS
                    } else {
                        SIGNAL
                    };
                    self.mapping(v, path, fields);
                } else {
                    self.push(
                        K::WrongType,
                        path,
                        format!(
                            "expected a mapping of `key: value` lines, found {}",
                            describe(v)
                        ),
                    );
                }
            }
        }
    }

    fn string<'v>(&mut self, v: &'v Value, path: &[Seg<'_>], what: &str) -> Option<&'v str> {
        match v {
            Value::String(s) => Some(s),
            other => {
                self.push(
                    K::WrongType,
                    path,
                    format!("expected {what}, found {}", describe(other)),
                );
                None
            }
        }
    }

    fn text(&mut self, s: &str, path: &[Seg<'_>], max: usize) {
        if s.trim().is_empty() {
            self.push(K::InvalidValue, path, "must not be empty".to_owned());
        } else if s.len() > max {
            self.push(
                K::InvalidValue,
                path,
                format!("is {} bytes long; the limit is {max}", s.len()),
            );
        } else if s.trim() != s {
            self.push(
                K::InvalidValue,
                path,
                format!("{s:?} has leading or trailing whitespace; remove it"),
            );
        }
    }

    fn agent_id(&mut self, s: &str, path: &[Seg<'_>], defining: bool) {
        match AgentId::parse(s) {
            Err(e) => self.push(K::InvalidAgentId, path, e.to_string()),
            Ok(_) if defining && is_reserved(s) => self.push(
                K::ReservedId,
                path,
                format!(
                    "{s:?} is reserved by keel (reserved: {}); choose another id",
                    RESERVED_IDS.join(", ")
                ),
            ),
            Ok(_) => {}
        }
    }

    fn list(&mut self, v: &Value, path: &[Seg<'_>], ty: Ty) {
        let Value::Sequence(items) = v else {
            let example = match (ty, v) {
                (_, Value::String(s)) if !s.contains(['[', ',']) => format!("; write `[{s}]`"),
                _ => String::new(),
            };
            self.push(
                K::WrongType,
                path,
                format!("expected a list, found {}{example}", describe(v)),
            );
            return;
        };
        if items.len() > MAX_LIST_ENTRIES {
            self.push(
                K::OutOfRange,
                path,
                format!(
                    "lists {} entries; the limit is {MAX_LIST_ENTRIES}",
                    items.len()
                ),
            );
            return;
        }
        if matches!(ty, Ty::Severities) && items.is_empty() {
            self.push(
                K::InvalidValue,
                path,
                "must name at least one severity; remove the key to allow all".to_owned(),
            );
        }
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            let mut p = path.to_vec();
            p.push(Seg::Index(i));
            let what = match ty {
                Ty::AgentIds => "an agent id",
                Ty::Severities => "a severity",
                _ => "a name",
            };
            let Some(s) = self.string(item, &p, what) else {
                continue;
            };
            match ty {
                Ty::AgentIds => self.agent_id(s, &p, false),
                Ty::Severities => {
                    if !Severity::ALL.iter().any(|sev| sev.as_str() == s) {
                        let all: Vec<&str> = Severity::ALL.iter().map(|s| s.as_str()).collect();
                        self.push(
                            K::InvalidValue,
                            &p,
                            format!(
                                "unknown severity {s:?}; expected one of: {}",
                                all.join(", ")
                            ),
                        );
                    }
                }
                _ => self.text(s, &p, MAX_NAME_BYTES),
            }
            if let Some(first) = seen.insert(s, i) {
                let mut fp = path.to_vec();
                fp.push(Seg::Index(first));
                self.push(
                    K::DuplicateEntry,
                    &p,
                    format!(
                        "{s:?} is listed twice (also at {}); remove one",
                        render_path(&fp)
                    ),
                );
            }
        }
    }

    fn usd(&mut self, v: &Value, path: &[Seg<'_>]) {
        let amount = match v {
            Value::Number(n) => n.as_f64(),
            _ => None,
        };
        match amount {
            Some(x) if x.is_finite() && x > 0.0 => {}
            Some(x) => self.push(
                K::OutOfRange,
                path,
                format!("{x} is not a budget; write an amount of USD above 0"),
            ),
            None => self.push(
                K::WrongType,
                path,
                format!("expected an amount of USD, found {}", describe(v)),
            ),
        }
    }

    fn int(&mut self, v: &Value, path: &[Seg<'_>], bound: Bound) {
        let Value::Number(n) = v else {
            let hint = if matches!(v, Value::String(s) if s.trim().parse::<i128>().is_ok()) {
                "; remove the quotes"
            } else {
                ""
            };
            self.push(
                K::WrongType,
                path,
                format!("expected a whole number, found {}{hint}", describe(v)),
            );
            return;
        };
        let Bound { min, max } = bound;
        if let Some(u) = n.as_u64() {
            if u < min {
                self.push(
                    K::OutOfRange,
                    path,
                    format!("{u} is below the minimum {min}"),
                );
            } else if u > max {
                self.push(
                    K::OutOfRange,
                    path,
                    format!("{u} is above the maximum {max}"),
                );
            }
        } else if let Some(i) = n.as_i64() {
            self.push(
                K::OutOfRange,
                path,
                format!("{i} is below the minimum {min}"),
            );
        } else {
            self.push(
                K::WrongType,
                path,
                format!("expected a whole number, found {}", describe(v)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_serde_yaml_positions() {
        assert_eq!(
            strip_location("did not find expected key at line 3 column 1, while parsing a block mapping at line 1 column 1"),
            "did not find expected key, while parsing a block mapping"
        );
        assert_eq!(strip_location("x at position 7"), "x");
        assert_eq!(strip_location("look at this"), "look at this");
    }

    #[test]
    fn body_normalization() {
        assert_eq!(
            normalize_body("\r\n  \n  code\r\nmore  \n\n"),
            "  code\nmore"
        );
        assert_eq!(normalize_body(" \n\t\n"), "");
    }

    #[test]
    fn edit_distance_suggests() {
        assert_eq!(edit_distance("delgates", "delegates"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
