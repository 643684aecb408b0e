//! The shell tool under Landlock, through the real `keel` binary as its
//! launcher: what a command can and cannot reach. These tests need a kernel
//! with Landlock (ABI 4 or newer for the network rules) and fail without one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_core::{Tool, ToolExecutionContext, ToolOutput};
use keel_engine::{
    builtin_registry, check_sandbox_support, BuiltinToolsConfig, LandlockPolicy, ShellConfig,
    ShellConfinement, DEFAULT_SHELL_READ_PATHS,
};
use serde_json::json;

struct Setup {
    _dirs: [tempfile::TempDir; 3],
    ws: PathBuf,
    data: PathBuf,
    outside: PathBuf,
}

fn setup() -> Setup {
    check_sandbox_support(false).expect("these tests need Landlock");
    let dirs = [(); 3].map(|()| tempfile::tempdir().unwrap());
    let [ws, data, outside] = [0, 1, 2].map(|i| dirs[i].path().canonicalize().unwrap());
    std::fs::write(data.join("keel.toml"), "[tools]\nenable_shell = true\n").unwrap();
    std::fs::write(outside.join("secret.txt"), "SECRET").unwrap();
    Setup {
        _dirs: dirs,
        ws,
        data,
        outside,
    }
}

fn config(ws: &Path, data: &Path, read_paths: Vec<PathBuf>, network: bool) -> BuiltinToolsConfig {
    let mut config = BuiltinToolsConfig::new(ws);
    config.protected_paths = vec![data.to_path_buf(), data.join("keel.toml")];
    config.enable_shell = true;
    config.shell = ShellConfig {
        timeout: std::time::Duration::from_secs(30),
        env: Vec::new(),
        confinement: ShellConfinement::Landlock(LandlockPolicy {
            launcher: PathBuf::from(env!("CARGO_BIN_EXE_keel")),
            read_paths,
            network,
        }),
    };
    config
}

fn shell(s: &Setup, network: bool) -> Arc<dyn Tool> {
    let read_paths = DEFAULT_SHELL_READ_PATHS.iter().map(PathBuf::from).collect();
    let registry = builtin_registry(&config(&s.ws, &s.data, read_paths, network)).unwrap();
    Arc::clone(registry.get("shell").unwrap())
}

async fn run(shell: &Arc<dyn Tool>, command: &str) -> ToolOutput {
    shell
        .execute(
            json!({ "command": command }),
            &ToolExecutionContext::default(),
        )
        .await
        .unwrap()
}

#[tokio::test]
async fn a_confined_command_writes_only_in_the_workspace_and_its_temp_dir() {
    let s = setup();
    let out = run(
        &shell(&s, false),
        &format!(
            "echo a > inside.txt && echo b > \"$TMPDIR/t\" && cat \"$TMPDIR/t\" && echo c > {0}/escape.txt; \
             echo d > {0}/secret.txt; rm {0}/secret.txt; mkdir {0}/dir; ln -s /etc {0}/link; echo e > /tmp/keel-escape-$$",
            s.outside.display()
        ),
    )
    .await;
    assert!(
        out.content.contains("--- stdout ---\nb\n"),
        "{}",
        out.content
    );
    assert_eq!(
        out.content.matches("Permission denied").count(),
        6,
        "{}",
        out.content
    );
    assert_eq!(
        std::fs::read_to_string(s.ws.join("inside.txt")).unwrap(),
        "a\n"
    );
    let left: Vec<_> = std::fs::read_dir(&s.outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["secret.txt"]);
    assert_eq!(
        std::fs::read_to_string(s.outside.join("secret.txt")).unwrap(),
        "SECRET"
    );
}

#[tokio::test]
async fn a_confined_command_cannot_connect_to_a_loopback_port_unless_allowed() {
    let s = setup();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let connect = format!("bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}' && echo connected");
    let denied = run(&shell(&s, false), &connect).await;
    assert!(denied.is_error, "{}", denied.content);
    assert!(
        denied.content.contains("connect: Permission denied"),
        "{}",
        denied.content
    );
    // The same command with tools.shell_network = true: the refusal above
    // was the sandbox's, not a missing program or a closed port.
    let allowed = run(&shell(&s, true), &connect).await;
    assert!(
        allowed.content.contains("--- stdout ---\nconnected\n"),
        "{}",
        allowed.content
    );
}

#[tokio::test]
async fn a_confined_command_cannot_read_keel_or_its_secrets() {
    let s = setup();
    let out = run(
        &shell(&s, false),
        &format!(
            "cat {}/keel.toml; cat {}/secret.txt; cat /proc/$PPID/environ; kill -0 $PPID; \
             echo status $?; env | cut -d= -f1 | sort | tr '\\n' ' '",
            s.data.display(),
            s.outside.display()
        ),
    )
    .await;
    let c = &out.content;
    assert!(!c.contains("enable_shell") && !c.contains("SECRET"), "{c}");
    // keel's environment (its API keys) is neither inherited nor readable
    // through /proc, and keel cannot be signalled.
    assert!(!c.contains("CARGO_MANIFEST_DIR"), "{c}");
    assert_eq!(c.matches("Permission denied").count(), 3, "{c}");
    assert!(c.contains("status 1"), "kill -0 on keel succeeded: {c}");
    assert!(
        c.contains("HOME LANG PATH PWD TERM TMPDIR") || c.contains("HOME PATH PWD TMPDIR"),
        "{c}"
    );
}

#[test]
fn the_shell_is_not_set_up_where_it_could_reach_keels_own_files() {
    let s = setup();
    // The default layout: the data directory inside the workspace.
    let inner = s.ws.join(".keel");
    std::fs::create_dir(&inner).unwrap();
    let err = builtin_registry(&config(&s.ws, &inner, Vec::new(), false)).unwrap_err();
    let shown = err.to_string().replace(&s.ws.display().to_string(), "[WS]");
    insta::assert_snapshot!(shown, @"workspace root [WS]: the shell would be able to reach [WS]/.keel (keel's own data or configuration) through [WS]; move data_dir (and --config) out of workspace_root and tools.shell_read_paths");
    // A read path holding the configuration file.
    let err = builtin_registry(&config(&s.ws, &s.data, vec![s.data.clone()], false)).unwrap_err();
    assert!(
        err.to_string().contains("keel.toml")
            || err.to_string().contains(&s.data.display().to_string()),
        "{err}"
    );
    // Neither: fine.
    builtin_registry(&config(&s.ws, &s.data, vec![s.outside.clone()], false)).unwrap();
}
