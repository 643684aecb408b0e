//! End-to-end tests of keel across crates. The tests are in `tests/it/`; the
//! `keel` binary they run is this package's bin target `keel-e2e`, built
//! from the gateway's `src/main.rs` (see `tests/it/main.rs`).

pub mod mcp_server;
