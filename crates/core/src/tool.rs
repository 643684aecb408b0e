//! The [`Tool`] trait, the policies that decide who may use a tool, the
//! context a tool runs in, and the [`ToolRegistry`] that sessions and runs
//! scope their tool sets from.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::id::{RunId, SessionId, TurnId};
use crate::message::TurnOrigin;
use crate::provider::ToolDefinition;

/// Who may be given a tool. Fixed by the tool's code, never by configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DelegationPolicy {
    /// Only the root agent (the default: new tools are not delegatable).
    #[default]
    RootOnly,
    /// Audited for use by delegated agents.
    Delegatable,
    /// Injected by the runtime according to the caller's rights; never listed
    /// in an agent definition.
    RuntimeInjected,
}

/// How a running tool reacts to new input for its turn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputInterruptPolicy {
    /// Runs to completion (the default).
    #[default]
    Never,
    /// Ends its wait early and reports the wake (e.g. `sleep`).
    WakeOnly,
    /// May be cancelled safely when input arrives.
    CancelSafe,
}

/// What a tool returns to the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolOutput {
    /// Text shown to the model.
    pub content: String,
    /// Whether the text describes a failure.
    #[serde(default)]
    pub is_error: bool,
}

impl ToolOutput {
    /// A successful output.
    pub fn text(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            is_error: false,
        }
    }

    /// A successful output cut to at most `max_bytes` (on a char boundary),
    /// with a note saying how much was cut.
    pub fn bounded(content: impl Into<String>, max_bytes: usize) -> Self {
        Self::text(truncate_with_note(content.into(), max_bytes))
    }
}

/// Cuts `s` to at most `max_bytes` on a char boundary, appending a note with
/// the number of bytes removed.
pub fn truncate_with_note(mut s: String, max_bytes: usize) -> String {
    if s.len() <= max_bytes {
        return s;
    }
    let mut cut = max_bytes;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    let removed = s.len() - cut;
    s.truncate(cut);
    s.push_str(&format!("\n… [truncated {removed} bytes]"));
    s
}

/// A failed tool call. The engine shows it to the model as an error result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// The arguments do not match the tool's schema.
    #[error("invalid arguments: {0}")]
    InvalidArguments(String),
    /// The call is not allowed (outside the workspace, disabled tool …).
    #[error("denied: {0}")]
    Denied(String),
    /// The tool ran and failed.
    #[error("failed: {0}")]
    Failed(String),
    /// The turn was cancelled while the tool ran.
    #[error("cancelled")]
    Cancelled,
    /// The tool exceeded its time limit.
    #[error("timed out after {0} ms")]
    TimedOut(u64),
}

/// A type map carrying runtime context (e.g. the engine's execution context)
/// to tools without keel-core knowing its type. Cloning is cheap.
#[derive(Clone, Default)]
pub struct Extensions {
    map: Arc<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

impl Extensions {
    /// Stores `value`, replacing a previous value of the same type.
    pub fn insert<T: Any + Send + Sync>(&mut self, value: T) {
        Arc::make_mut(&mut self.map).insert(TypeId::of::<T>(), Arc::new(value));
    }

    /// The stored value of type `T`.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.map
            .get(&TypeId::of::<T>())
            .and_then(|v| v.downcast_ref::<T>())
    }
}

impl fmt::Debug for Extensions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Extensions({} entries)", self.map.len())
    }
}

/// Everything a tool call knows about where it runs.
#[derive(Debug, Clone, Default)]
pub struct ToolExecutionContext {
    /// The session whose turn called the tool.
    pub session_id: Option<SessionId>,
    /// The turn that called the tool.
    pub turn_id: Option<TurnId>,
    /// The sub-agent run that called the tool (`None` for the root agent).
    pub run_id: Option<RunId>,
    /// What started the turn.
    pub origin: TurnOrigin,
    /// Fires when the turn or run is cancelled; tools must observe it.
    pub cancellation: CancellationToken,
    /// Runtime context for runtime-injected tools.
    pub extensions: Extensions,
}

/// A capability the model can invoke.
#[async_trait]
pub trait Tool: Send + Sync {
    /// Unique name.
    fn name(&self) -> &str;

    /// What the tool does, for the model.
    fn description(&self) -> &str;

    /// JSON schema of the arguments object.
    fn parameters(&self) -> serde_json::Value;

    /// Who may be given this tool.
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::RootOnly
    }

    /// How the tool reacts to new input for its turn.
    fn input_interrupt_policy(&self) -> InputInterruptPolicy {
        InputInterruptPolicy::Never
    }

    /// Whether the tool only reads (allowed in continuation turns).
    fn read_only(&self) -> bool {
        false
    }

    /// The definition sent to the model.
    fn definition(&self) -> ToolDefinition {
        ToolDefinition {
            name: self.name().to_owned(),
            description: self.description().to_owned(),
            parameters: self.parameters(),
        }
    }

    /// Runs the tool. Must return [`ToolError::Cancelled`] soon after
    /// `ctx.cancellation` fires.
    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError>;
}

/// Why a registry could not be built or scoped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolRegistryError {
    /// Two tools share a name.
    #[error("tool {0:?} is registered twice")]
    Duplicate(String),
    /// A scope names a tool that is not registered.
    #[error("unknown tool {0:?}")]
    Unknown(String),
    /// A scope names a tool that only the runtime may inject.
    #[error("tool {0:?} is injected by the runtime and cannot be listed")]
    RuntimeOnly(String),
    /// A delegated scope names a tool whose policy is not `Delegatable`.
    #[error("tool {name:?} cannot be given to a delegated agent (policy {policy:?})")]
    NotDelegatable {
        /// The tool.
        name: String,
        /// Its policy.
        policy: DelegationPolicy,
    },
}

/// Which policies a scoped view accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeRule {
    /// The root agent: any registered tool except runtime-injected ones.
    Root,
    /// A delegated agent: only `Delegatable` tools (fail-closed).
    Delegated,
}

/// Tools by name. Shared registries are never mutated after construction;
/// sessions and runs build scoped views with [`ToolRegistry::scoped`].
#[derive(Clone, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl ToolRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool; a second tool with the same name is an error.
    pub fn register(&mut self, tool: Arc<dyn Tool>) -> Result<(), ToolRegistryError> {
        let name = tool.name().to_owned();
        if self.tools.contains_key(&name) {
            return Err(ToolRegistryError::Duplicate(name));
        }
        self.tools.insert(name, tool);
        Ok(())
    }

    /// The tool called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name)
    }

    /// The delegation policy of tool `name`.
    pub fn policy(&self, name: &str) -> Option<DelegationPolicy> {
        self.tools.get(name).map(|t| t.delegation_policy())
    }

    /// Whether a tool called `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tools.contains_key(name)
    }

    /// Tool names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.keys().map(String::as_str)
    }

    /// Number of tools.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether there are no tools.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Definitions of every tool, sorted by name.
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        self.tools.values().map(|t| t.definition()).collect()
    }

    /// Checks that tool `name` may be listed under `rule`, without building a
    /// view (used by the catalog to validate definitions).
    pub fn check(&self, name: &str, rule: ScopeRule) -> Result<(), ToolRegistryError> {
        let policy = self
            .policy(name)
            .ok_or_else(|| ToolRegistryError::Unknown(name.to_owned()))?;
        match (policy, rule) {
            (DelegationPolicy::RuntimeInjected, _) => {
                Err(ToolRegistryError::RuntimeOnly(name.to_owned()))
            }
            (DelegationPolicy::RootOnly, ScopeRule::Delegated) => {
                Err(ToolRegistryError::NotDelegatable {
                    name: name.to_owned(),
                    policy,
                })
            }
            _ => Ok(()),
        }
    }

    /// A new registry holding only `names`, each checked against `rule`.
    /// `self` is left untouched.
    pub fn scoped<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
        rule: ScopeRule,
    ) -> Result<ToolRegistry, ToolRegistryError> {
        let mut view = ToolRegistry::new();
        for name in names {
            self.check(name, rule)?;
            if let Some(tool) = self.tools.get(name) {
                view.tools.insert(name.to_owned(), Arc::clone(tool));
            }
        }
        Ok(view)
    }

    /// A new registry holding the tools for which `keep` is true.
    pub fn filtered(&self, keep: impl Fn(&dyn Tool) -> bool) -> ToolRegistry {
        ToolRegistry {
            tools: self
                .tools
                .iter()
                .filter(|(_, t)| keep(t.as_ref()))
                .map(|(n, t)| (n.clone(), Arc::clone(t)))
                .collect(),
        }
    }
}

impl fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.tools.keys()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(&'static str, DelegationPolicy, bool);

    #[async_trait]
    impl Tool for Fake {
        fn name(&self) -> &str {
            self.0
        }
        fn description(&self) -> &str {
            "fake"
        }
        fn parameters(&self) -> serde_json::Value {
            serde_json::json!({"type": "object"})
        }
        fn delegation_policy(&self) -> DelegationPolicy {
            self.1
        }
        fn read_only(&self) -> bool {
            self.2
        }
        async fn execute(
            &self,
            _args: serde_json::Value,
            _ctx: &ToolExecutionContext,
        ) -> Result<ToolOutput, ToolError> {
            Ok(ToolOutput::text(self.0))
        }
    }

    fn registry() -> ToolRegistry {
        let mut r = ToolRegistry::new();
        r.register(Arc::new(Fake(
            "read_file",
            DelegationPolicy::Delegatable,
            true,
        )))
        .unwrap();
        r.register(Arc::new(Fake("shell", DelegationPolicy::RootOnly, false)))
            .unwrap();
        r.register(Arc::new(Fake(
            "delegate",
            DelegationPolicy::RuntimeInjected,
            false,
        )))
        .unwrap();
        r
    }

    #[test]
    fn duplicate_names_are_rejected() {
        let mut r = registry();
        let err = r
            .register(Arc::new(Fake("shell", DelegationPolicy::RootOnly, false)))
            .unwrap_err();
        assert_eq!(err, ToolRegistryError::Duplicate("shell".into()));
    }

    #[test]
    fn lookup_and_policies() {
        let r = registry();
        assert_eq!(
            r.names().collect::<Vec<_>>(),
            ["delegate", "read_file", "shell"]
        );
        assert_eq!(r.policy("shell"), Some(DelegationPolicy::RootOnly));
        assert_eq!(r.policy("nope"), None);
        assert_eq!(r.get("read_file").unwrap().name(), "read_file");
        assert_eq!(r.definitions().len(), 3);
    }

    #[test]
    fn delegated_scope_is_fail_closed_and_leaves_the_shared_registry_alone() {
        let r = registry();
        let view = r.scoped(["read_file"], ScopeRule::Delegated).unwrap();
        assert_eq!(view.names().collect::<Vec<_>>(), ["read_file"]);
        assert_eq!(r.len(), 3, "shared registry unchanged");
        let errs: Vec<String> = [
            r.scoped(["shell"], ScopeRule::Delegated).unwrap_err(),
            r.scoped(["delegate"], ScopeRule::Delegated).unwrap_err(),
            r.scoped(["delegate"], ScopeRule::Root).unwrap_err(),
            r.scoped(["nope"], ScopeRule::Root).unwrap_err(),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        insta::assert_yaml_snapshot!(errs);
        assert!(r.scoped(["shell", "read_file"], ScopeRule::Root).is_ok());
    }

    #[test]
    fn filtered_keeps_read_only_tools() {
        let view = registry().filtered(|t| t.read_only());
        assert_eq!(view.names().collect::<Vec<_>>(), ["read_file"]);
    }

    #[test]
    fn extensions_are_typed_and_copy_on_write() {
        #[derive(Debug, PartialEq)]
        struct Marker(u32);
        let mut a = Extensions::default();
        a.insert(Marker(1));
        let mut b = a.clone();
        b.insert(Marker(2));
        assert_eq!(a.get::<Marker>(), Some(&Marker(1)));
        assert_eq!(b.get::<Marker>(), Some(&Marker(2)));
        assert_eq!(a.get::<String>(), None);
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate_with_note("short".into(), 10), "short");
        let cut = truncate_with_note("héllo wörld".into(), 2);
        assert_eq!(cut, "h\n… [truncated 12 bytes]");
        assert_eq!(
            ToolOutput::bounded("abcdef", 3).content,
            "abc\n… [truncated 3 bytes]"
        );
    }

    #[test]
    fn serde_forms_are_stable() {
        insta::assert_json_snapshot!((
            DelegationPolicy::ALL_FOR_TEST,
            [
                InputInterruptPolicy::Never,
                InputInterruptPolicy::WakeOnly,
                InputInterruptPolicy::CancelSafe
            ],
            ToolOutput {
                content: "x".into(),
                is_error: true
            },
        ));
    }

    impl DelegationPolicy {
        const ALL_FOR_TEST: [DelegationPolicy; 3] = [
            DelegationPolicy::RootOnly,
            DelegationPolicy::Delegatable,
            DelegationPolicy::RuntimeInjected,
        ];
    }
}
