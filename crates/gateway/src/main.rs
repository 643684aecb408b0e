//! `keel`: demo, chat, agents check.

fn main() -> std::process::ExitCode {
    keel_gateway::cli::main()
}
