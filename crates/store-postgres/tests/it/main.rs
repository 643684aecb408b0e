//! keel-store-postgres on a real PostgreSQL (see `keel_store_postgres::testing`): one test binary.

mod checks;
mod pool;
mod schema;
