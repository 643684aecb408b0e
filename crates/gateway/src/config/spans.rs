//! Where each key of a TOML document is: a span index built from the text, so
//! that type errors and validation problems can name a key path and a line.

use std::fmt;
use std::ops::Range;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use toml::Spanned;

/// Key paths of a document with the spans of their keys.
#[derive(Debug, Default)]
pub(crate) struct KeyIndex {
    /// 1-based line of every line start, for offsets → lines.
    line_starts: Vec<usize>,
    /// (dotted path, span of the key or array item), parents before children.
    entries: Vec<(String, Range<usize>)>,
}

impl KeyIndex {
    /// Indexes `text`; an empty index when the text cannot be walked (it is
    /// only used to locate errors, never to decide them).
    pub(crate) fn build(text: &str) -> Self {
        let mut index = KeyIndex {
            line_starts: line_starts(text),
            entries: Vec::new(),
        };
        if let Ok(Node::Table(entries)) = toml::from_str::<Node>(text) {
            index.add_table("", entries);
        }
        index
    }

    fn add_table(&mut self, prefix: &str, entries: Vec<(Spanned<String>, Node)>) {
        for (key, value) in entries {
            let path = join(prefix, key.get_ref());
            self.entries.push((path.clone(), key.span()));
            self.add_node(&path, value);
        }
    }

    fn add_node(&mut self, path: &str, node: Node) {
        match node {
            Node::Table(entries) => self.add_table(path, entries),
            Node::Array(items) => {
                for (i, item) in items.into_iter().enumerate() {
                    let item_path = format!("{path}[{i}]");
                    self.entries.push((item_path.clone(), item.span()));
                    self.add_node(&item_path, item.into_inner());
                }
            }
            Node::Leaf => {}
        }
    }

    /// The key path an error at byte `offset` is about: the key (or array
    /// item) written there, else the nearest one before it (the key of a
    /// value), else the last one on the same line (a table header).
    pub(crate) fn path_at(&self, offset: usize) -> Option<&str> {
        let found = self
            .entries
            .iter()
            .filter(|(_, span)| span.start <= offset && offset < span.end)
            .max_by_key(|(path, span)| (span.start, path.len()))
            .or_else(|| {
                self.entries
                    .iter()
                    .filter(|(_, span)| span.start <= offset)
                    .max_by_key(|(path, span)| (span.start, path.len()))
            })
            .or_else(|| {
                let line = line_of(&self.line_starts, offset);
                self.entries
                    .iter()
                    .filter(|(_, span)| line_of(&self.line_starts, span.start) == line)
                    .max_by_key(|(path, span)| (span.start, path.len()))
            });
        found.map(|(path, _)| path.as_str())
    }

    /// The 1-based line of `path`, or of its nearest written ancestor.
    pub(crate) fn line_of_key(&self, path: &str) -> Option<usize> {
        let mut candidate = path;
        loop {
            if let Some((_, key)) = self.entries.iter().find(|(p, _)| p == candidate) {
                return Some(line_of(&self.line_starts, key.start));
            }
            candidate = parent(candidate)?;
        }
    }
}

/// `a.b.c` → `a.b`; `a[2]` → `a`; `a` → none.
fn parent(path: &str) -> Option<&str> {
    let cut = path.rfind(['.', '['])?;
    Some(&path[..cut])
}

/// Joins a key to a dotted path, quoting keys that are not bare.
pub(crate) fn join(prefix: &str, key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let key = if bare {
        key.to_owned()
    } else {
        format!("{key:?}")
    };
    if prefix.is_empty() {
        key
    } else {
        format!("{prefix}.{key}")
    }
}

fn line_starts(text: &str) -> Vec<usize> {
    std::iter::once(0)
        .chain(text.match_indices('\n').map(|(i, _)| i + 1))
        .collect()
}

fn line_of(starts: &[usize], offset: usize) -> usize {
    starts.partition_point(|&s| s <= offset).max(1)
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
pub(crate) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let starts = line_starts(text);
    let line = line_of(&starts, offset);
    let start = starts.get(line - 1).copied().unwrap_or(0);
    let column = text
        .get(start..offset.min(text.len()))
        .map_or(0, |s| s.chars().count());
    (line, column + 1)
}

/// The shape of a TOML value with the spans of its keys and array items
/// (implicit tables such as `providers` in `[providers.main]` have no span of
/// their own, so values are not wrapped in `Spanned`).
enum Node {
    Table(Vec<(Spanned<String>, Node)>),
    Array(Vec<Spanned<Node>>),
    Leaf,
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any TOML value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Node>>()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(entry) = map.next_entry::<Spanned<String>, Node>()? {
            entries.push(entry);
        }
        Ok(Node::Table(entries))
    }
}
