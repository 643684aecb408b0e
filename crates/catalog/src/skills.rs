//! Skills: named instructions an agent may load on demand. One skill per
//! `*.md` file at the top level of a skills root (`<data_dir>/skills`), with
//! the same strict frontmatter rules as agent definitions:
//!
//! ```text
//! ---
//! name: code-review
//! description: How to review a change in this repository.
//! ---
//! Read the diff twice …
//! ```
//!
//! A [`SkillSet`] is immutable; agent definitions list the skills they may
//! read (`skills: [code-review]`) and the catalog checks every entry exists.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::diagnostic::{Diagnostic, DiagnosticKind as K, Diagnostics};
use crate::loader::{read_files, RootKind};
use crate::parse::{parse_skill, parse_skill_bytes};

/// The frontmatter of a skill file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SkillFrontmatter {
    pub name: String,
    pub description: String,
}

/// One skill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skill {
    /// Its name, matching `[a-z][a-z0-9_-]{0,63}`, unique in its set.
    pub name: String,
    /// One line telling a model when the skill helps.
    pub description: String,
    /// The instructions (the Markdown after the frontmatter, normalized like
    /// an agent's role prompt).
    pub body: String,
    /// The file it came from, relative to the skills root's parent (so
    /// diagnostics read `skills/review.md`).
    pub source_file: PathBuf,
}

/// An immutable set of skills by name. Cloning is cheap (one `Arc`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SkillSet {
    skills: Arc<BTreeMap<String, Arc<Skill>>>,
}

/// The skills root.
const SKILLS: RootKind = RootKind {
    what: "skills",
    entry: "a skill file",
    files: "skill files",
};

impl SkillSet {
    /// No skills.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Loads every skill under `root`; any problem fails the whole load and
    /// every problem is returned. Files are named `<root name>/<file>` in
    /// diagnostics.
    pub fn load(root: &Path) -> Result<Self, Diagnostics> {
        let (canonical, files) = read_files(root, SKILLS)?;
        let prefix = canonical.file_name().map(PathBuf::from).unwrap_or_default();
        let parsed = files.into_iter().map(|(name, bytes)| {
            let file = prefix.join(&name);
            let skill = bytes
                .map_err(|d| {
                    vec![Diagnostic {
                        file: Some(file.clone()),
                        ..d
                    }]
                })
                .and_then(|bytes| parse_skill_bytes(&file, &bytes));
            (file, skill)
        });
        Self::build(parsed.collect())
    }

    /// A set from `(file name, text)` pairs, without touching the filesystem.
    pub fn from_texts<'a>(
        texts: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, Diagnostics> {
        let mut parsed: Vec<(PathBuf, Result<Skill, Vec<Diagnostic>>)> = texts
            .into_iter()
            .map(|(name, text)| (PathBuf::from(name), parse_skill(Path::new(name), text)))
            .collect();
        parsed.sort_by(|a, b| a.0.cmp(&b.0));
        Self::build(parsed)
    }

    /// Checks names are unique (a second file with a taken name is reported,
    /// naming the first) and collects every problem.
    fn build(parsed: Vec<(PathBuf, Result<Skill, Vec<Diagnostic>>)>) -> Result<Self, Diagnostics> {
        let mut diags = Vec::new();
        let mut skills: BTreeMap<String, Arc<Skill>> = BTreeMap::new();
        for (file, outcome) in parsed {
            match outcome {
                Err(mut d) => diags.append(&mut d),
                Ok(skill) => match skills.get(&skill.name) {
                    Some(first) => diags.push(
                        Diagnostic::new(
                            Some(&file),
                            K::DuplicateId,
                            format!(
                                "the skill name {:?} is already used by {}; rename one of them",
                                skill.name,
                                first.source_file.display()
                            ),
                        )
                        .with_key("name"),
                    ),
                    None => {
                        skills.insert(skill.name.clone(), Arc::new(skill));
                    }
                },
            }
        }
        if diags.is_empty() {
            Ok(Self {
                skills: Arc::new(skills),
            })
        } else {
            Err(Diagnostics(diags))
        }
    }

    /// The skill called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Skill>> {
        self.skills.get(name)
    }

    /// Whether a skill called `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.skills.contains_key(name)
    }

    /// Every skill, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Skill>> {
        self.skills.values()
    }

    /// Every name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.skills.keys().map(String::as_str)
    }

    /// Number of skills.
    pub fn len(&self) -> usize {
        self.skills.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.skills.is_empty()
    }
}
