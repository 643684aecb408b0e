//! The connection pool: deadpool-postgres over tokio-postgres, TLS by
//! rustls (ring) with the system's trust anchors. The connection string's
//! `sslmode` is `disable`, `prefer` (the default: TLS when the server
//! offers it) or `require`; unlike libpq's `require`, a TLS connection
//! always verifies the server's certificate and name against those roots.
//! A unix socket never uses TLS.

use std::sync::Arc;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{PgStoreError, Result};

/// A pool of at most `max_size` connections to `conninfo` (a URL or key=value string).
pub fn pool(conninfo: &str, max_size: usize) -> Result<Pool> {
    let config = config(conninfo)?;
    let manager = Manager::from_config(
        config,
        tls()?,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_size)
        .build()
        .map_err(|e| PgStoreError::Config(e.to_string()))
}

/// The parsed connection string `conninfo`.
pub(crate) fn config(conninfo: &str) -> Result<tokio_postgres::Config> {
    conninfo.parse().map_err(|e: tokio_postgres::Error| {
        // The kind ("invalid connection string") and what was wrong.
        let cause = std::error::Error::source(&e).map(ToString::to_string);
        PgStoreError::Config(match cause {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        })
    })
}

/// rustls with the ring provider (keel's only one) and the native roots.
pub(crate) fn tls() -> Result<MakeRustlsConnect> {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::warn!(error = %e, "a system certificate could not be read");
    }
    let mut roots = rustls::RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(found.certs);
    if ignored > 0 {
        tracing::warn!(
            added,
            ignored,
            "system certificates rustls cannot parse are ignored"
        );
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| PgStoreError::Config(format!("TLS: {e}")))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}
