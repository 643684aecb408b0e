//! Command-line interface of the `keel` binary.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// keel — a durable runtime for LLM agents.
#[derive(Debug, Parser)]
#[command(name = "keel", version, long_about = None)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command that opens a data directory shares.
#[derive(Debug, Clone, clap::Args)]
pub struct DataArgs {
    /// Data directory (SQLite file, keel.toml, agents/).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Configuration file (default: DIR/keel.toml of the data directory, when it exists).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// An offline, deterministic tour of what keel does.
    Demo {
        /// Keep the demo's database here instead of a temporary directory.
        #[arg(long, value_name = "DIR")]
        data_dir: Option<PathBuf>,
    },
    /// Terminal chat with slash commands (/help lists them).
    Chat {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// Chat id: restarting with the same id continues its last dialog.
        #[arg(long, default_value = "local")]
        chat: String,
        /// Agent to talk to (default: the root agent).
        #[arg(long)]
        agent: Option<String>,
        /// Drive the model from a ScriptedProvider script (YAML or JSON).
        #[arg(long, value_name = "FILE")]
        script: Option<PathBuf>,
    },
    /// HTTP + WebSocket API (docs/PROTOCOL.md); SIGHUP reloads agents, SIGTERM stops.
    Serve {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// Address to listen on (default: server.bind, 127.0.0.1:7420).
        #[arg(long, value_name = "ADDR")]
        bind: Option<std::net::SocketAddr>,
    },
    /// Check a data directory's database (exit 1 when an invariant fails)
    ///
    /// Exit 0 when every invariant holds, 1 with findings: each says what
    /// it means and whether --repair fixes it.
    Doctor {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// Run the safe reconciliations (migration, the recovery every
        /// start runs), then check again. Needs the data directory unused.
        #[arg(long)]
        repair: bool,
    },
    /// Prune old checkpoints and purge old deleted dialogs now, as `[session.retention]` says (refused while a keel runs on it)
    ///
    /// Removes for good the dialogs deleted more than
    /// `purge_deleted_after_days` ago, with all their rows; keeps each
    /// dialog's newest `keep_checkpoints` turn checkpoints and everything a
    /// head, rollback, fork or manual checkpoint needs; then gives freed
    /// pages back; prints what it removed. A running keel does this in the
    /// background.
    Prune {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
    },
    /// Compress rows stored before compression and rebuild the database file compactly (refused while a keel runs on it)
    ///
    /// Message bodies, run results and state blobs written uncompressed
    /// are compressed in bounded batches (each its own transaction), then
    /// the file is rebuilt with SQLite's VACUUM: pages left half empty by
    /// deletes are packed, and an older database gets 8 KiB pages. Needs
    /// free disk space about the size of the database.
    CompactStorage {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
    },
    /// Copy a data directory's database to DEST while keel runs (the copy is checked before it is kept)
    ///
    /// One consistent snapshot, copied in bounded steps so turns keep
    /// committing; DEST must not exist.
    Backup {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// The new file to write the copy to.
        dest: PathBuf,
    },
    /// Replace a data directory's database with a backup (refused while a keel runs on it)
    ///
    /// The backup is checked first; a replaced database is kept beside it.
    Restore {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// The backup to restore (a file `keel backup` wrote).
        src: PathBuf,
        /// Replace the data directory's existing database.
        #[arg(long)]
        force: bool,
    },
    /// Bring the database (SQLite, or PostgreSQL with storage.url) to this keel's schema, and say what was done.
    Migrate {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
    },
    /// Copy a whole database to an empty one of either backend (sqlite:PATH or postgres://…), then check the copy.
    Copy {
        /// The database to copy: sqlite:PATH, or a PostgreSQL URL or key=value string (read in one snapshot, also while a keel runs on it).
        #[arg(long, value_name = "LOCATION")]
        from: String,
        /// The empty database to fill: sqlite:PATH, or a PostgreSQL URL or key=value string (created and migrated if needed).
        #[arg(long, value_name = "LOCATION")]
        to: String,
    },
    /// Write one dialog (history, hidden messages, state, memory, branches, checkpoints, runs) as versioned JSON
    ///
    /// The `keel.dialog` format of docs/EXPORT.md. Needs the data directory
    /// unused; while `keel serve` runs, use GET /api/dialogs/{id}/export.
    Export {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// The dialog's id.
        dialog: String,
        /// Write to this new file instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Recreate an exported dialog as a new dialog, with new ids, in one transaction
    ///
    /// A file from a newer format version is refused. Needs the data
    /// directory unused; while `keel serve` runs, use POST /api/dialogs/import.
    Import {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// The export (a file `keel export` wrote).
        file: PathBuf,
    },
    /// Print the trace of a sub-agent run, or of a root turn's runs, as a tree
    ///
    /// Each run with its offset, duration, tokens, model and tool call
    /// counts and status, read from the database (it takes no lock, so it
    /// works while `keel serve` runs); the web page shows the same tree.
    Trace {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// A run's id, or the id of a root turn that started runs.
        id: String,
    },
    /// Agent definitions.
    Agents {
        /// What to do with them.
        #[command(subcommand)]
        command: AgentsCommand,
    },
    /// The configured MCP servers (docs/MCP.md).
    Mcp {
        /// What to do with them.
        #[command(subcommand)]
        command: McpCommand,
    },
}

/// `keel mcp …`.
#[derive(Debug, Subcommand)]
pub enum McpCommand {
    /// Reach every configured server now and list its status, committed
    /// manifest and tools (commits nothing; works while keel serve runs).
    List {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
    },
    /// Call one tool of a server and print what a model would read (no
    /// approval is asked: you are the one calling).
    Call {
        /// Data directory and configuration.
        #[command(flatten)]
        data: DataArgs,
        /// The server (`[mcp.NAME]`).
        name: String,
        /// The tool, by its MCP name (as `keel mcp list` shows it).
        tool: String,
        /// Its arguments, a JSON object.
        #[arg(default_value = "{}")]
        json: String,
    },
}

/// `keel agents …`.
#[derive(Debug, Subcommand)]
pub enum AgentsCommand {
    /// Validate a directory of agent definitions (and the skills they list)
    /// and print the catalog.
    Check {
        /// The definitions directory.
        dir: PathBuf,
        /// Configuration to validate against (default: built-in defaults).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// The skills directory (default: the configuration's, else a
        /// `skills` directory next to DIR if there is one).
        #[arg(long, value_name = "DIR")]
        skills: Option<PathBuf>,
    },
}

/// Parses arguments and runs the command.
pub fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    // The shell tool starts this binary again to confine a command; that
    // happens before anything else (one thread, no runtime, no logging).
    if args.next().as_deref() == Some(keel_engine::SANDBOX_LAUNCHER_ARG.as_ref()) {
        return keel_engine::run_sandbox_launcher(args);
    }
    let cli = Cli::parse();
    // `keel serve` exports traces when `[telemetry]` says so; the exporter
    // starts before the runtime (its HTTP client owns a runtime of its own).
    let telemetry = match &cli.command {
        Command::Serve { data, .. } => match start_telemetry(data) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("keel: {e}");
                return ExitCode::FAILURE;
            }
        },
        _ => None,
    };
    init_tracing(telemetry.as_ref());
    #[cfg(feature = "failpoints")]
    match keel_store::failpoints::configure_from_env() {
        Ok(names) if !names.is_empty() => tracing::warn!(?names, "failpoints set"),
        Ok(_) => {}
        Err(e) => {
            eprintln!("keel: {e}");
            return ExitCode::FAILURE;
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("keel: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(dispatch(cli.command));
    // Tasks still running end with the runtime (their spans too); then
    // the last spans are exported, a bounded wait.
    drop(runtime);
    if let Some(telemetry) = telemetry {
        if let Err(e) = telemetry.shutdown() {
            eprintln!("keel: {e}");
        }
        let lost = crate::telemetry::dropped_spans();
        if lost > 0 {
            eprintln!(
                "keel: telemetry: {lost} span(s) were not exported (the export queue was full or the collector did not take them)"
            );
        }
    }
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keel: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one command to its exit status.
async fn dispatch(command: Command) -> crate::error::Result<ExitCode> {
    match command {
        Command::Demo { data_dir } => crate::demo::run(data_dir).await,
        Command::Chat {
            data,
            chat,
            agent,
            script,
        } => {
            crate::chat::run(
                data.config.as_deref(),
                data.data_dir.as_deref(),
                chat,
                agent,
                script,
            )
            .await
        }
        Command::Copy { from, to } => crate::copy_cmd::run(&from, &to).await,
        Command::Migrate { data } => {
            crate::migrate_cmd::run(data.config.as_deref(), data.data_dir.as_deref()).await
        }
        Command::Serve { data, bind } => {
            crate::serve::run(data.config.as_deref(), data.data_dir.as_deref(), bind).await
        }
        Command::Doctor { data, repair } => {
            crate::doctor::run(data.config.as_deref(), data.data_dir.as_deref(), repair).await
        }
        Command::Prune { data } => {
            crate::prune::run(data.config.as_deref(), data.data_dir.as_deref()).await
        }
        Command::CompactStorage { data } => {
            crate::prune::compact(data.config.as_deref(), data.data_dir.as_deref()).await
        }
        Command::Backup { data, dest } => {
            crate::backup::backup(data.config.as_deref(), data.data_dir.as_deref(), &dest).await
        }
        Command::Restore { data, src, force } => {
            crate::backup::restore(
                data.config.as_deref(),
                data.data_dir.as_deref(),
                &src,
                force,
            )
            .await
        }
        Command::Export { data, dialog, out } => {
            crate::export::export(
                data.config.as_deref(),
                data.data_dir.as_deref(),
                &dialog,
                out.as_deref(),
            )
            .await
        }
        Command::Trace { data, id } => {
            crate::trace_cmd::run(data.config.as_deref(), data.data_dir.as_deref(), &id).await
        }
        Command::Import { data, file } => {
            crate::export::import(data.config.as_deref(), data.data_dir.as_deref(), &file).await
        }
        Command::Agents {
            command:
                AgentsCommand::Check {
                    dir,
                    config,
                    skills,
                },
        } => crate::agents::check(&dir, config.as_deref(), skills.as_deref()).await,
        Command::Mcp {
            command: McpCommand::List { data },
        } => crate::mcp_cmd::list(data.config.as_deref(), data.data_dir.as_deref()).await,
        Command::Mcp {
            command:
                McpCommand::Call {
                    data,
                    name,
                    tool,
                    json,
                },
        } => {
            crate::mcp_cmd::call(
                data.config.as_deref(),
                data.data_dir.as_deref(),
                &name,
                &tool,
                &json,
            )
            .await
        }
    }
}

/// The trace exporter `[telemetry]` of the serve command's configuration
/// asks for (`None`: off). A configuration that does not load is reported
/// by the command itself.
fn start_telemetry(data: &DataArgs) -> Result<Option<crate::telemetry::Telemetry>, String> {
    let Ok(loaded) = crate::config::Config::load(data.config.as_deref(), data.data_dir.as_deref())
    else {
        return Ok(None);
    };
    let env = |name: &str| std::env::var(name).ok();
    match crate::telemetry::ExportSettings::resolve(&loaded.config.telemetry, &env)? {
        Some(settings) => crate::telemetry::Telemetry::start(&settings).map(Some),
        None => Ok(None),
    }
}

/// Logs (`KEEL_LOG`, default `warn`) to stderr; the engine's spans go only
/// to the trace exporter, when there is one.
fn init_tracing(telemetry: Option<&crate::telemetry::Telemetry>) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let filter = EnvFilter::try_from_env("KEEL_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let off = format!("{}=off", keel_engine::TRACE_TARGET);
    let filter = match off.parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let registry = tracing_subscriber::registry().with(logs);
    let _ = match telemetry {
        Some(t) => registry.with(t.layer()).try_init(),
        None => registry.try_init(),
    };
}
