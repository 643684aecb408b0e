//! Checks for likely mistakes that do not fail a load: each gives a
//! diagnostic whose kind [`is_warning`](crate::DiagnosticKind::is_warning).

use std::path::Path;

use crate::diagnostic::{Diagnostic, DiagnosticKind as K};
use crate::parse::is_delimiter;

/// A warning when the body (first line `body_line`) begins with another
/// frontmatter-like block — a `---` line, `key: value` lines, a `---` line
/// — which is almost always a mistake: the model reads it as prompt text.
pub(crate) fn second_frontmatter(file: &Path, body: &str, body_line: usize) -> Option<Diagnostic> {
    let mut lines = body
        .lines()
        .enumerate()
        .skip_while(|(_, l)| l.trim().is_empty());
    let (opening, first) = lines.next()?;
    if !is_delimiter(first) {
        return None;
    }
    let mut keys = 0;
    for (_, line) in lines {
        if is_delimiter(line) {
            return (keys > 0).then(|| {
                Diagnostic::new(
                    Some(file),
                    K::SecondFrontmatter,
                    "the role prompt begins with a second frontmatter-like block (`---`, keys, `---`); \
                     the model would read it as text — move its keys into the frontmatter above \
                     and delete it",
                )
                .at(body_line + opening, None)
            });
        }
        let key = line.split_once(':').map(|(k, _)| k);
        let looks_like_key = key.is_some_and(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        });
        if looks_like_key {
            keys += 1;
        } else if !line.starts_with([' ', '-']) && !line.trim().is_empty() {
            return None;
        }
    }
    None
}
