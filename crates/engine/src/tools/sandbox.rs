//! Landlock confinement of shell commands.
//!
//! Restricting a child between `fork` and `exec` needs `pre_exec`, which is
//! unsafe; instead the shell tool starts the `keel` binary itself as a small
//! launcher ([`SANDBOX_LAUNCHER_ARG`]): [`run_sandbox_launcher`] drops every capability,
//! restricts its own process with Landlock (which also sets
//! `no_new_privs`), then replaces itself with `sh -c COMMAND`. The command and
//! everything it starts inherit the restriction and cannot lift it.
//!
//! The policy: read, write and execute only in the writable trees (the
//! workspace and a private temporary directory); read and execute in the
//! configured read paths; write `/dev/null`; no TCP bind or connect unless
//! the network is allowed; no signals to, and no abstract Unix sockets of,
//! processes outside the sandbox where the kernel can scope them (ABI 6).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};

/// The first argument that turns the `keel` binary into the sandbox launcher.
pub const SANDBOX_LAUNCHER_ARG: &str = "__keel-sandbox-exec";

/// Read paths used when `tools.shell_read_paths` is not set: the system's
/// programs, libraries and configuration (paths that do not exist are
/// skipped).
pub const DEFAULT_SHELL_READ_PATHS: &[&str] = &[
    "/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/etc", "/opt", "/dev", "/proc",
];

/// The newest ABI whose features the policy asks for when the kernel has
/// them (scoped signals and abstract Unix sockets); older kernels enforce
/// less of them, never less than [`REQUIRED_ABI`].
const WANTED_ABI: ABI = ABI::V6;
/// What a kernel must enforce for a command to run confined: the
/// filesystem rights of ABI 1 and, without network, TCP of ABI 4.
const REQUIRED_ABI: ABI = ABI::V1;
const NETWORK_ABI: ABI = ABI::V4;

/// What a confined command may touch besides its writable trees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LandlockPolicy {
    /// The program started as launcher: the `keel` binary.
    pub launcher: PathBuf,
    /// Trees the command may read and execute from.
    pub read_paths: Vec<PathBuf>,
    /// Whether TCP bind and connect are allowed.
    pub network: bool,
}

impl LandlockPolicy {
    /// The launcher's arguments that confine `argv` to this policy with
    /// `writable` trees.
    pub fn launcher_args(&self, writable: &[&Path], argv: &[OsString]) -> Vec<OsString> {
        let mut args = vec![OsString::from(SANDBOX_LAUNCHER_ARG)];
        for dir in writable {
            args.push("--write".into());
            args.push(dir.as_os_str().to_owned());
        }
        for dir in &self.read_paths {
            args.push("--read".into());
            args.push(dir.as_os_str().to_owned());
        }
        if self.network {
            args.push("--network".into());
        }
        args.push("--".into());
        args.extend(argv.iter().cloned());
        args
    }
}

/// Whether this kernel can confine commands as a policy with or without
/// network needs; the error says what is missing.
pub fn check_sandbox_support(network: bool) -> Result<(), String> {
    ruleset(network)
        .map(drop)
        .map_err(|e| format!("this kernel cannot enforce the shell sandbox (Landlock): {e}"))
}

fn ruleset(network: bool) -> Result<RulesetCreated, landlock::RulesetError> {
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(REQUIRED_ABI))?;
    if !network {
        ruleset = ruleset.handle_access(AccessNet::from_all(NETWORK_ABI))?;
    }
    ruleset
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(WANTED_ABI))?
        .scope(Scope::from_all(WANTED_ABI))?
        .create()
}

/// The parsed launcher command line.
#[derive(Debug, Default, PartialEq)]
struct LaunchSpec {
    write: Vec<PathBuf>,
    read: Vec<PathBuf>,
    network: bool,
    argv: Vec<OsString>,
}

fn parse(args: impl IntoIterator<Item = OsString>) -> Result<LaunchSpec, String> {
    let mut spec = LaunchSpec::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .map(PathBuf::from)
                .ok_or_else(|| format!("{name} needs a path"))
        };
        match arg.to_str() {
            Some("--write") => spec.write.push(value("--write")?),
            Some("--read") => spec.read.push(value("--read")?),
            Some("--network") => spec.network = true,
            Some("--") => {
                spec.argv = args.collect();
                break;
            }
            _ => return Err(format!("unexpected argument {arg:?}")),
        }
    }
    if spec.argv.is_empty() {
        return Err("no command after --".into());
    }
    Ok(spec)
}

/// The launcher: confines this process as `args` (after [`SANDBOX_LAUNCHER_ARG`])
/// say and execs the command. Returns only when that fails, with exit
/// status 126 and the reason on stderr; never runs the command unconfined.
pub fn run_sandbox_launcher(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let error = match parse(args).and_then(|spec| confine(&spec).map(|()| spec)) {
        Ok(spec) => {
            let err = std::process::Command::new(&spec.argv[0])
                .args(&spec.argv[1..])
                .exec();
            format!("cannot run {:?}: {err}", spec.argv[0])
        }
        Err(e) => e,
    };
    eprintln!("keel sandbox: {error}");
    ExitCode::from(126)
}

fn confine(spec: &LaunchSpec) -> Result<(), String> {
    drop_capabilities()?;
    let rw = AccessFs::from_all(WANTED_ABI);
    let ro = AccessFs::from_read(WANTED_ABI);
    let mut ruleset = ruleset(spec.network).map_err(|e| e.to_string())?;
    for (paths, access) in [(&spec.write, rw), (&spec.read, ro)] {
        for path in paths {
            match PathFd::new(path) {
                Ok(fd) => {
                    ruleset = ruleset
                        .add_rule(PathBeneath::new(fd, access))
                        .map_err(|e| format!("{}: {e}", path.display()))?;
                }
                // A configured read path this machine lacks grants nothing.
                Err(_) if !path.exists() => {}
                Err(e) => return Err(format!("{}: {e}", path.display())),
            }
        }
    }
    if let Ok(fd) = PathFd::new("/dev/null") {
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, AccessFs::from_file(WANTED_ABI)))
            .map_err(|e| format!("/dev/null: {e}"))?;
    }
    let status = ruleset.restrict_self().map_err(|e| e.to_string())?;
    if status.ruleset == RulesetStatus::NotEnforced || !status.no_new_privs {
        return Err(format!("the sandbox was not enforced: {status:?}"));
    }
    Ok(())
}

/// Drops every capability (keel running as root would otherwise pass them
/// on: reading other processes' memory and environment, overriding file
/// permissions), including from the bounding set so that exec cannot
/// grant them back.
fn drop_capabilities() -> Result<(), String> {
    use rustix::thread::{
        capabilities, capability_is_in_bounding_set, remove_capability_from_bounding_set,
        set_capabilities, CapabilitySet, CapabilitySets,
    };
    let held = capabilities(None).map_err(|e| format!("cannot read capabilities: {e}"))?;
    if held.permitted.is_empty() {
        return Ok(());
    }
    for cap in CapabilitySet::all().iter() {
        if capability_is_in_bounding_set(cap).unwrap_or(false) {
            remove_capability_from_bounding_set(cap)
                .map_err(|e| format!("cannot drop capability {cap:?}: {e}"))?;
        }
    }
    let none = CapabilitySet::empty();
    set_capabilities(
        None,
        CapabilitySets {
            effective: none,
            permitted: none,
            inheritable: none,
        },
    )
    .map_err(|e| format!("cannot drop capabilities: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launcher_arguments_round_trip() {
        let policy = LandlockPolicy {
            launcher: PathBuf::from("/bin/keel"),
            read_paths: vec![PathBuf::from("/usr"), PathBuf::from("/etc")],
            network: true,
        };
        let argv: Vec<OsString> = ["sh", "-c", "echo --write"].map(OsString::from).into();
        let args = policy.launcher_args(&[Path::new("/ws"), Path::new("/tmp/k")], &argv);
        assert_eq!(args[0], SANDBOX_LAUNCHER_ARG);
        assert_eq!(
            parse(args.into_iter().skip(1)),
            Ok(LaunchSpec {
                write: vec![PathBuf::from("/ws"), PathBuf::from("/tmp/k")],
                read: vec![PathBuf::from("/usr"), PathBuf::from("/etc")],
                network: true,
                argv,
            })
        );
        assert!(parse(["--write".into()]).is_err());
        assert!(parse(["--read".into(), "/x".into(), "--".into()]).is_err());
        assert!(parse(["--frob".into()]).is_err());
    }
}
