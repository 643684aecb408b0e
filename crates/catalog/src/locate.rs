//! Finds the line and column of a key path (`limits.max_iterations`,
//! `delegates[1]`) in frontmatter text. `serde_yaml::Value` carries no
//! positions, so semantic diagnostics locate their key with this small
//! indentation-based scan; when a key cannot be found (flow style, odd
//! layout) the nearest located ancestor is used.

use std::ops::Range;

/// One step of a key path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seg<'a> {
    /// A mapping key.
    Key(&'a str),
    /// A sequence index.
    Index(usize),
}

/// A key as written in messages: bare when it is a plain word, quoted and
/// escaped otherwise (keys come from user input and may hold anything).
pub(crate) fn display_key(k: &str) -> String {
    let plain = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
    if plain {
        k.to_owned()
    } else {
        format!("{k:?}")
    }
}

/// Renders a key path as `limits.max_iterations` or `delegates[1]`.
pub(crate) fn render_path(path: &[Seg<'_>]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(&display_key(k));
            }
            Seg::Index(i) => {
                out.push('[');
                out.push_str(&i.to_string());
                out.push(']');
            }
        }
    }
    out
}

/// Key positions in the YAML lines of one frontmatter.
pub(crate) struct Locator<'a> {
    lines: Vec<&'a str>,
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

fn is_blank(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

fn is_seq_item(content: &str) -> bool {
    content == "-" || content.starts_with("- ") || content.starts_with("-\t")
}

/// The key written at the start of `content` (`key:`, `"key":`, `'key':`).
fn key_of(content: &str) -> Option<&str> {
    let (key, rest) = match content.chars().next()? {
        q @ ('"' | '\'') => {
            let inner = &content[1..];
            let end = inner.find(q)?;
            (&inner[..end], &inner[end + 1..])
        }
        _ => {
            let end = content.find(':')?;
            (content[..end].trim_end(), &content[end..])
        }
    };
    let rest = rest.trim_start();
    let after = rest.strip_prefix(':')?;
    (after.is_empty() || after.starts_with([' ', '\t', '\r'])).then_some(key)
}

/// 1-based character column of the first `key:` in `line` that is not part of
/// a longer word. An empty key (`{"": 1}`) has no text to find.
fn column_in_line(line: &str, key: &str) -> Option<usize> {
    if key.is_empty() {
        return None;
    }
    let mut from = 0;
    while let Some(pos) = line[from..].find(key) {
        let start = from + pos;
        let end = start + key.len();
        let before_ok = line[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_' || c == '-'));
        let after_ok = line[end..].trim_start().starts_with(':');
        if before_ok && after_ok {
            return Some(line[..start].chars().count() + 1);
        }
        // Every round moves forward, so the scan ends on any input.
        from = end;
    }
    None
}

/// 1-based character column of item `n` of a flow sequence (`[a, b]`) on
/// `line`, after its key's colon.
fn flow_item_column(line: &str, n: usize) -> Option<usize> {
    let colon = line.find(':')?;
    let open = colon + line[colon..].find('[')?;
    let mut index = 0;
    let mut at_item_start = true;
    let mut quote: Option<char> = None;
    for (pos, c) in line[open + 1..].char_indices() {
        let abs = open + 1 + pos;
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None => match c {
                ',' => {
                    index += 1;
                    at_item_start = true;
                }
                ']' => return None,
                ' ' | '\t' => {}
                _ => {
                    if at_item_start && index == n {
                        return Some(line[..abs].chars().count() + 1);
                    }
                    at_item_start = false;
                    if c == '"' || c == '\'' {
                        quote = Some(c);
                    }
                }
            },
        }
    }
    None
}

impl<'a> Locator<'a> {
    /// A locator over the YAML text (without the `---` delimiters).
    pub(crate) fn new(yaml: &'a str) -> Self {
        Self {
            lines: yaml.lines().collect(),
        }
    }

    /// 0-based line and 1-based column of `path`, or of its deepest ancestor
    /// that can be found.
    pub(crate) fn locate(&self, path: &[Seg<'_>]) -> Option<(usize, usize)> {
        let mut range = 0..self.lines.len();
        let mut best: Option<(usize, usize)> = None;
        for seg in path {
            let Some(child_indent) = self.first_indent(range.clone()) else {
                return self.in_line_fallback(best, seg);
            };
            let mut candidates = range
                .clone()
                .filter(|&i| !is_blank(self.lines[i]) && indent(self.lines[i]) == child_indent);
            let found = match *seg {
                Seg::Key(k) => candidates.find(|&i| key_of(self.lines[i].trim_start()) == Some(k)),
                Seg::Index(n) => candidates
                    .filter(|&i| is_seq_item(self.lines[i].trim_start()))
                    .nth(n),
            };
            match found {
                Some(l) => {
                    best = Some((l, child_indent + 1));
                    range = self.block_after(l, child_indent, matches!(seg, Seg::Key(_)));
                }
                None => return self.in_line_fallback(best, seg),
            }
        }
        best
    }

    fn in_line_fallback(
        &self,
        best: Option<(usize, usize)>,
        seg: &Seg<'_>,
    ) -> Option<(usize, usize)> {
        let (line, col) = best?;
        let found = match *seg {
            Seg::Key(k) => column_in_line(self.lines[line], k),
            Seg::Index(n) => flow_item_column(self.lines[line], n),
        };
        Some((line, found.unwrap_or(col)))
    }

    /// 0-based line of the second `key:` of the block mapping that starts at
    /// line `start` with indentation `ind` (serde_yaml reports a duplicate key
    /// at the start of its mapping; users want the repeated line).
    pub(crate) fn second_key(&self, start: usize, ind: usize, key: &str) -> Option<usize> {
        let mut hits = 0;
        for i in start..self.lines.len() {
            let line = self.lines[i];
            if is_blank(line) {
                continue;
            }
            if indent(line) < ind {
                break;
            }
            if indent(line) == ind && key_of(line.trim_start()) == Some(key) {
                hits += 1;
                if hits == 2 {
                    return Some(i);
                }
            }
        }
        None
    }

    /// The key of the nearest line above `line` that is indented less than
    /// `ind` (the parent key of a nested mapping).
    pub(crate) fn parent_key(&self, line: usize, ind: usize) -> Option<&'a str> {
        (0..line.min(self.lines.len()))
            .rev()
            .map(|i| self.lines[i])
            .find(|l| !is_blank(l) && indent(l) < ind)
            .and_then(|l| key_of(l.trim_start()))
    }

    fn first_indent(&self, range: Range<usize>) -> Option<usize> {
        range
            .map(|i| self.lines[i])
            .find(|l| !is_blank(l))
            .map(indent)
    }

    /// Lines nested under line `l` (indented deeper; for a key, also a block
    /// sequence written at the key's own indentation).
    fn block_after(&self, l: usize, ind: usize, seq_same_indent: bool) -> Range<usize> {
        let mut end = l + 1;
        while end < self.lines.len() {
            let line = self.lines[end];
            let nested = is_blank(line)
                || indent(line) > ind
                || (seq_same_indent && indent(line) == ind && is_seq_item(line.trim_start()));
            if !nested {
                break;
            }
            end += 1;
        }
        (l + 1)..end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "id: a\nlimits:\n  # comment\n  max_iterations: 0\n  timeout_secs: 5\ntools:\n- x\n- y\ndelegates:\n  - b\n  - c\nsignal: {burst: 0}\n";

    #[test]
    fn finds_nested_keys_items_and_flow_values() {
        let l = Locator::new(YAML);
        assert_eq!(l.locate(&[Seg::Key("id")]), Some((0, 1)));
        assert_eq!(
            l.locate(&[Seg::Key("limits"), Seg::Key("timeout_secs")]),
            Some((4, 3))
        );
        assert_eq!(l.locate(&[Seg::Key("tools"), Seg::Index(1)]), Some((7, 1)));
        assert_eq!(
            l.locate(&[Seg::Key("delegates"), Seg::Index(1)]),
            Some((10, 3))
        );
        assert_eq!(
            l.locate(&[Seg::Key("signal"), Seg::Key("burst")]),
            Some((11, 10))
        );
        assert_eq!(
            l.locate(&[Seg::Key("limits"), Seg::Key("nope")]),
            Some((1, 1))
        );
        assert_eq!(l.locate(&[Seg::Key("nope")]), None);
        assert_eq!(flow_item_column("tools: [a, \"b,c\", d]", 2), Some(19));
        assert_eq!(flow_item_column("tools: [a]", 1), None);
        assert_eq!(column_in_line("limits: {\"\": 1}", ""), None);
        assert_eq!(l.second_key(0, 0, "id"), None);
        assert_eq!(
            render_path(&[Seg::Key("signal"), Seg::Key("severities"), Seg::Index(2)]),
            "signal.severities[2]"
        );
    }
}
