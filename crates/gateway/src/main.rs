//! `keel`: serve, chat, demo, agents check.

fn main() -> std::process::ExitCode {
    keel_gateway::cli::main()
}
