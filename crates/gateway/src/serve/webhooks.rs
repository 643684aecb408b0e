//! Webhooks: the URL checks of a send's `webhook` and `server.webhook_urls`,
//! the Standard Webhooks signature, and the worker that POSTs the store's
//! outbox ([`keel_store::WebhookDelivery`]) — due rows at start, woken by
//! every commit that created one, retried with exponential backoff until
//! `server.webhook_max_attempts`, then dead-lettered.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use futures::StreamExt as _;
use keel_store::{AttemptOutcome, Store, WebhookDelivery};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// How long one attempt may take, connection to the end of the response.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes of a receiver's response read (the rest is dropped).
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024;
/// Longest wait between two attempts.
const MAX_BACKOFF_MS: u64 = 3_600_000;
/// Deliveries read per pass, and POSTed at once.
const BATCH: usize = 32;
const IN_FLIGHT: usize = 8;
/// Longest URL accepted.
pub const MAX_URL_BYTES: usize = 2048;

/// The webhook settings of `keel serve` (`[server] webhook_*`).
#[derive(Clone, Default)]
pub struct WebhookOptions {
    /// URLs every committed turn is delivered to.
    pub urls: Vec<String>,
    /// The signing key (`None`: the secret's variable is unset).
    pub secret: Option<Vec<u8>>,
    /// The variable the secret is read from (named in errors).
    pub secret_env: String,
    /// Attempts before a delivery is dead.
    pub max_attempts: u32,
    /// Wait before the first retry (doubled per attempt).
    pub retry_base: Duration,
}

impl std::fmt::Debug for WebhookOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookOptions")
            .field("urls", &self.urls)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("max_attempts", &self.max_attempts)
            .field("retry_base", &self.retry_base)
            .finish()
    }
}

/// The signing key of a secret: `whsec_` + base64 is decoded (Standard
/// Webhooks' format); any other text is used as its bytes.
pub fn secret_key(secret: &str) -> Vec<u8> {
    secret
        .strip_prefix("whsec_")
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .unwrap_or_else(|| secret.as_bytes().to_vec())
}

/// Parses a webhook URL: http or https, with a host, no credentials.
pub fn parse_url(url: &str) -> Result<reqwest::Url, String> {
    if url.len() > MAX_URL_BYTES {
        return Err(format!("a webhook URL is at most {MAX_URL_BYTES} bytes"));
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "the scheme {:?} is not http or https",
            parsed.scheme()
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("the URL names no host".to_owned());
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("the URL carries credentials; sign with the webhook secret instead".to_owned());
    }
    Ok(parsed)
}

/// Whether `url` points at the server listening on `own` (an IP literal or
/// `localhost` at its port; a name resolving to it is not looked up).
pub fn aims_at(url: &reqwest::Url, own: SocketAddr) -> bool {
    if url.port_or_known_default() != Some(own.port()) {
        return false;
    }
    let Some(host) = url.host_str() else {
        return false;
    };
    if host.eq_ignore_ascii_case("localhost") {
        return own.ip().is_loopback() || own.ip().is_unspecified();
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let Ok(ip) = bare.parse::<IpAddr>() else {
        return false;
    };
    ip == own.ip()
        || ip.is_unspecified()
        || own.ip().is_unspecified()
        || (ip.is_loopback() && own.ip().is_loopback())
}

/// HMAC-SHA256 (RFC 2104) of `message` under `key`.
fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut block = [0u8; BLOCK];
    if key.len() > BLOCK {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

/// The `webhook-signature` header value: `v1,` + base64 of the HMAC-SHA256
/// of `{id}.{timestamp}.{body}`.
pub fn signature(key: &[u8], id: &str, timestamp: i64, body: &str) -> String {
    let signed = format!("{id}.{timestamp}.{body}");
    let mac = hmac_sha256(key, signed.as_bytes());
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac)
    )
}

/// When the attempt after `attempts` failed ones is due, from `now_ms`.
pub fn retry_at(now_ms: i64, base: Duration, attempts: u32) -> i64 {
    let base = u64::try_from(base.as_millis()).unwrap_or(u64::MAX);
    let wait = base
        .saturating_mul(1u64 << attempts.min(40))
        .min(MAX_BACKOFF_MS);
    now_ms.saturating_add(i64::try_from(wait).unwrap_or(i64::MAX))
}

/// POSTs the outbox; see the module docs.
pub(crate) struct Worker {
    store: Store,
    client: reqwest::Client,
    key: Vec<u8>,
    options: WebhookOptions,
}

impl Worker {
    /// A worker of `store`'s outbox, or `None` without a secret (nothing
    /// can be signed; a send naming a webhook is refused then).
    pub(crate) fn new(store: Store, options: WebhookOptions) -> Option<Arc<Self>> {
        let key = options.secret.clone()?;
        let client = match reqwest::Client::builder()
            .timeout(ATTEMPT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")))
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "cannot build the webhook HTTP client; no webhook is sent");
                return None;
            }
        };
        Some(Arc::new(Self {
            store,
            client,
            key,
            options,
        }))
    }

    /// Delivers until `stop`: the due rows, then whatever each commit wakes
    /// it for or the next retry falls due.
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let now = keel_core::time::now_ms();
            let due = match self.store.due_webhook_deliveries(now, BATCH).await {
                Ok(due) => due,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the webhook outbox");
                    Vec::new()
                }
            };
            let full = due.len() == BATCH;
            // A shutdown cuts attempts short: one not recorded is made again
            // by the next start (at least once).
            let pass =
                futures::stream::iter(due).for_each_concurrent(IN_FLIGHT, |d| self.attempt(d));
            tokio::select! {
                () = stop.cancelled() => return,
                () = pass => {}
            }
            if full {
                continue;
            }
            let next = match self.store.next_webhook_due().await {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the webhook outbox");
                    Some(keel_core::time::now_ms() + 1000)
                }
            };
            let wait = next.map(|at| {
                let ms = at.saturating_sub(keel_core::time::now_ms()).max(0);
                Duration::from_millis(u64::try_from(ms).unwrap_or(0))
            });
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.store.webhook_committed() => {}
                () = sleep_or_forever(wait) => {}
            }
        }
    }

    /// One attempt at `d`, recorded.
    async fn attempt(&self, d: WebhookDelivery) {
        let timestamp = keel_core::time::now_ms() / 1000;
        let outcome = match self.post(&d, timestamp).await {
            Ok(()) => AttemptOutcome::Delivered,
            Err(error) => {
                tracing::info!(delivery = %d.id, url = %d.url, attempt = d.attempts + 1, %error, "a webhook delivery failed");
                AttemptOutcome::Failed {
                    error,
                    retry_at_ms: retry_at(
                        keel_core::time::now_ms(),
                        self.options.retry_base,
                        d.attempts,
                    ),
                    max_attempts: self.options.max_attempts,
                }
            }
        };
        match self
            .store
            .record_webhook_attempt(d.id.clone(), outcome, keel_core::time::now_ms())
            .await
        {
            Ok(Some(keel_store::DeliveryStatus::Dead)) => {
                tracing::warn!(delivery = %d.id, url = %d.url, "a webhook delivery is dead after its last attempt");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(delivery = %d.id, error = %e, "cannot record a webhook attempt; it is made again");
            }
        }
    }

    /// POSTs `d`; `Err` says why it did not count as delivered.
    async fn post(&self, d: &WebhookDelivery, timestamp: i64) -> Result<(), String> {
        let url = parse_url(&d.url)?;
        let response = self
            .client
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("webhook-id", &d.id)
            .header("webhook-timestamp", timestamp.to_string())
            .header(
                "webhook-signature",
                signature(&self.key, &d.id, timestamp, &d.body),
            )
            .body(d.body.clone())
            .send()
            .await
            .map_err(describe)?;
        let status = response.status();
        // Read (a bounded part of) the response so the connection is reused.
        let mut response = response;
        let mut read = 0usize;
        while read < MAX_RESPONSE_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => read += chunk.len(),
                Ok(None) => break,
                Err(e) => {
                    if status.is_success() {
                        tracing::debug!(error = %e, "a webhook receiver's response broke off");
                    }
                    break;
                }
            }
        }
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("the receiver answered {status}"))
        }
    }
}

/// Why a request failed, without the URL (it is logged beside).
fn describe(e: reqwest::Error) -> String {
    if e.is_timeout() {
        format!("no answer within {} s", ATTEMPT_TIMEOUT.as_secs())
    } else if e.is_connect() {
        "cannot connect".to_owned()
    } else {
        e.without_url().to_string()
    }
}

async fn sleep_or_forever(wait: Option<Duration>) {
    match wait {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231 test case 2 (a short key) and 6 (a key longer than a block).
    #[test]
    fn hmac_matches_rfc_4231() {
        let hex = |b: [u8; 32]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn urls_are_checked_and_the_own_address_is_refused() {
        let own: SocketAddr = "127.0.0.1:7420".parse().unwrap();
        let errors: Vec<String> = [
            "ftp://x.example/h",
            "not a url",
            "http://u:p@x.example/",
            "https://",
        ]
        .iter()
        .map(|u| format!("{u}: {}", parse_url(u).unwrap_err()))
        .collect();
        insta::assert_snapshot!(errors.join("\n"));
        for u in [
            "http://127.0.0.1:7420/h",
            "http://localhost:7420/",
            "http://[::1]:7420/",
        ] {
            let url = parse_url(u).unwrap();
            let any: SocketAddr = "0.0.0.0:7420".parse().unwrap();
            assert!(aims_at(&url, any), "{u} at 0.0.0.0");
            if u != "http://[::1]:7420/" {
                assert!(aims_at(&url, own), "{u}");
            }
        }
        for u in [
            "http://127.0.0.1:7421/h",
            "https://127.0.0.1/h",
            "http://10.0.0.1:7420/",
        ] {
            assert!(!aims_at(&parse_url(u).unwrap(), own), "{u}");
        }
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let base = Duration::from_millis(100);
        assert_eq!(retry_at(1000, base, 0), 1100);
        assert_eq!(retry_at(1000, base, 3), 1800);
        assert_eq!(retry_at(0, base, 60), 3_600_000);
    }

    #[test]
    fn a_whsec_secret_is_decoded_and_others_are_bytes() {
        assert_eq!(secret_key("whsec_aGVsbG8="), b"hello");
        assert_eq!(secret_key("plain"), b"plain");
    }
}
