//! keel's MCP test server over stdio (see `keel_e2e::mcp_server`):
//! `keel-mcp-test-server [--tools a,b | --tools-file FILE]`.

use std::process::ExitCode;

use keel_e2e::mcp_server::TestServer;
use rmcp::ServiceExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let server = match args.as_slice() {
        [] => TestServer::new(None),
        [flag, tools] if flag == "--tools" => TestServer::new(Some(tools)),
        [flag, file] if flag == "--tools-file" => TestServer::listing_from(file.into()),
        _ => {
            eprintln!("usage: keel-mcp-test-server [--tools a,b | --tools-file FILE]");
            return ExitCode::FAILURE;
        }
    };
    let service = match server.serve(rmcp::transport::stdio()).await {
        Ok(service) => service,
        Err(e) => {
            eprintln!("keel-mcp-test-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    match service.waiting().await {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keel-mcp-test-server: {e}");
            ExitCode::FAILURE
        }
    }
}
