//! Strict Markdown-frontmatter agent definitions and the immutable agent catalog.
