//! Clients that break the rules on purpose, on raw sockets: half-sent
//! heads and bodies, more connections than the bound, idle connections,
//! ambiguous `Host`s, HTTP/2 without TLS (h2c), WebSocket protocol
//! violations, and a token that needs percent-decoding.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{Setup, TestServer};

/// How long a test waits for the server to close a connection it must close.
const DEADLINE: Duration = Duration::from_secs(10);

impl TestServer {
    /// `host:port` of the server.
    fn authority(&self) -> String {
        self.server().addr().to_string()
    }

    /// A raw connection that has sent `bytes`.
    async fn raw(&self, bytes: &[u8]) -> TcpStream {
        let mut tcp = TcpStream::connect(self.server().addr()).await.unwrap();
        tcp.write_all(bytes).await.unwrap();
        tcp
    }

    /// The answer to the raw request `head` (read until the server closes).
    async fn raw_answer(&self, head: &str) -> String {
        let mut tcp = self.raw(head.as_bytes()).await;
        let mut out = Vec::new();
        tokio::time::timeout(DEADLINE, tcp.read_to_end(&mut out))
            .await
            .expect("an answer")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// A server whose `[server]` section is `server`.
async fn server_with(server: &str) -> TestServer {
    TestServer::start(Setup {
        config: format!("[server]\n{server}\n"),
        ..Setup::default()
    })
    .await
}

/// Reads `tcp` until the server closes it; what it sent, and when it closed.
async fn until_closed(tcp: &mut TcpStream) -> (String, Instant) {
    let (bytes, closed) = bytes_until_closed(tcp).await;
    (String::from_utf8_lossy(&bytes).into_owned(), closed)
}

/// [`until_closed`], the bytes as sent.
async fn bytes_until_closed(tcp: &mut TcpStream) -> (Vec<u8>, Instant) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(DEADLINE, tcp.read(&mut buf))
            .await
            .expect("the server closes the connection")
        {
            Ok(0) | Err(_) => return (out, Instant::now()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test]
async fn a_half_sent_request_head_is_closed_after_the_header_timeout() {
    let t = server_with("header_timeout_secs = 1").await;
    let started = Instant::now();
    let mut slow = t.raw(b"GET /api/hea").await;
    let (_, closed) = until_closed(&mut slow).await;
    let waited = closed - started;
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
    // Others were served meanwhile and still are.
    assert_eq!(t.get("/api/health").await.status(), 200);
}

#[tokio::test]
async fn a_body_sent_too_slowly_is_answered_400_after_the_body_timeout() {
    let t = server_with("body_timeout_secs = 1").await;
    let head = format!(
        "POST /api/dialogs HTTP/1.1\r\nHost: {}\r\ncontent-type: application/json\r\n\
         content-length: 100\r\n\r\n{{\"title\"",
        t.authority()
    );
    let started = Instant::now();
    let mut slow = t.raw(head.as_bytes()).await;
    let (answer, closed) = until_closed(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("server.body_timeout_secs"), "{answer}");
    assert!(closed - started >= Duration::from_millis(900));
    assert!(t.json("/api/dialogs").await["items"]
        .as_array()
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn a_connection_with_no_request_in_flight_is_closed_after_the_idle_timeout() {
    let t = server_with("header_timeout_secs = 60\nidle_timeout_secs = 1").await;
    let started = Instant::now();
    let mut idle = t.raw(b"").await;
    let (_, closed) = until_closed(&mut idle).await;
    let waited = closed - started;
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(30),
        "{waited:?}"
    );
}

#[tokio::test]
async fn when_every_connection_is_taken_the_oldest_idle_one_makes_room() {
    let t = server_with("max_connections = 4\nheader_timeout_secs = 60").await;
    let mut half = Vec::new();
    for _ in 0..4 {
        half.push(t.raw(b"GET /api/he").await);
    }
    // A normal client is served at once: the oldest half-sent head is closed for it.
    let started = Instant::now();
    assert_eq!(t.get("/api/health").await.status(), 200);
    assert!(started.elapsed() < Duration::from_secs(1));
    let (_, _) = until_closed(&mut half[0]).await;

    // Four requests whose bodies never come: every connection is busy, and
    // a new one is closed at once. `100 Continue` says the handler is
    // reading the body: the request is in flight.
    let head = format!(
        "POST /api/dialogs HTTP/1.1\r\nHost: {}\r\ncontent-type: application/json\r\n\
         expect: 100-continue\r\ncontent-length: 100\r\n\r\n",
        t.authority()
    );
    let mut busy = Vec::new();
    for _ in 0..4 {
        let mut tcp = t.raw(head.as_bytes()).await;
        let mut line = [0u8; 25];
        tokio::time::timeout(DEADLINE, tcp.read_exact(&mut line))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&line, b"HTTP/1.1 100 Continue\r\n\r\n");
        busy.push(tcp);
    }
    // The rest of the half-sent heads were closed to make room for them.
    for h in &mut half[1..] {
        until_closed(h).await;
    }
    let started = Instant::now();
    let mut refused = t.raw(b"").await;
    let (answer, _) = until_closed(&mut refused).await;
    assert_eq!(answer, "");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn two_host_headers_or_a_target_that_disagrees_with_host_are_bad_requests() {
    let t = TestServer::start(Setup::default()).await;
    let own = t.authority();
    let status = |answer: String| answer.lines().next().unwrap_or("").to_owned();
    let two = t
        .raw_answer(&format!(
            "GET /api/health HTTP/1.1\r\nHost: {own}\r\nHost: attacker.example\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(status(two), "HTTP/1.1 400 Bad Request");
    let disagreeing = t
        .raw_answer(&format!(
            "GET http://attacker.example/api/health HTTP/1.1\r\nHost: {own}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert!(
        disagreeing.contains("\"code\":\"bad_request\""),
        "{disagreeing}"
    );
    assert_eq!(status(disagreeing), "HTTP/1.1 400 Bad Request");
    let agreeing = t
        .raw_answer(&format!(
            "GET http://{own}/api/health HTTP/1.1\r\nHost: {own}\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(status(agreeing), "HTTP/1.1 200 OK");
}

#[tokio::test]
async fn h2c_requests_are_served_and_their_authority_is_checked() {
    let t = TestServer::start(Setup::default()).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2
        .get(format!("{}/api/health", t.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    let r = h2
        .post(format!("{}/api/dialogs", t.base))
        .json(&serde_json::json!({"title": "over h2"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    // `:authority` is checked as `Host` is: a name that is not this server's is refused.
    let rebound = format!(
        "http://localhost.attacker.example:{}/api/health",
        t.server().addr().port()
    );
    let r = reqwest::Client::builder()
        .http2_prior_knowledge()
        .resolve("localhost.attacker.example", t.server().addr())
        .build()
        .unwrap()
        .get(rebound)
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 403);
}

/// The close frame the server answers `frame` with on a fresh WebSocket: its code.
async fn close_code_after(t: &TestServer, frame: &[u8]) -> u16 {
    let handshake = format!(
        "GET /api/ws HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        t.authority()
    );
    let mut tcp = t.raw(handshake.as_bytes()).await;
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(tcp.read_u8().await.unwrap());
    }
    assert!(head.starts_with(b"HTTP/1.1 101"), "{head:?}");
    tcp.write_all(frame).await.unwrap();
    let (answer, _) = bytes_until_closed(&mut tcp).await;
    // An unmasked server close frame: 0x88, the length, the code.
    assert_eq!(answer.first(), Some(&0x88), "{answer:?}");
    u16::from_be_bytes([answer[2], answer[3]])
}

/// A WebSocket upgraded by `tcp`'s handshake; the 101 head is consumed.
async fn websocket(t: &TestServer) -> TcpStream {
    let handshake = format!(
        "GET /api/ws HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        t.authority()
    );
    let mut tcp = t.raw(handshake.as_bytes()).await;
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(tcp.read_u8().await.unwrap());
    }
    assert!(head.starts_with(b"HTTP/1.1 101"), "{head:?}");
    tcp
}

/// A WebSocket holds a connection slot and counts as busy: one that sends
/// nothing, not even the pong to the server's ping, is closed after the
/// idle timeout, so silent sockets cannot keep every slot forever.
#[tokio::test]
async fn a_silent_websocket_is_pinged_then_closed_after_the_idle_timeout() {
    let t = server_with("max_connections = 2\nidle_timeout_secs = 1").await;
    let started = Instant::now();
    let mut silent = [websocket(&t).await, websocket(&t).await];
    for tcp in &mut silent {
        let (answer, closed) = bytes_until_closed(tcp).await;
        // An empty ping (0x89 0x00), then a close frame with 1008.
        assert_eq!(answer[..2], [0x89, 0x00], "{answer:?}");
        assert_eq!(answer[2], 0x88, "{answer:?}");
        assert_eq!(u16::from_be_bytes([answer[4], answer[5]]), 1008);
        let reason = String::from_utf8_lossy(&answer[6..]).into_owned();
        insta::allow_duplicates! {
            insta::assert_snapshot!(reason, @"nothing arrived for 1 s, not even a pong (server.idle_timeout_secs)");
        }
        assert!(closed - started >= Duration::from_millis(900));
    }
    // Their slots are free again.
    assert_eq!(t.get("/api/health").await.status(), 200);
}

#[tokio::test]
async fn websocket_protocol_violations_close_with_their_rfc_6455_codes() {
    let t = TestServer::start(Setup::default()).await;
    // Masked (with a zero key) text frames; a zero key leaves the payload as is.
    let invalid_utf8 = [0x81, 0x82, 0, 0, 0, 0, 0xff, 0xfe];
    assert_eq!(close_code_after(&t, &invalid_utf8).await, 1007);
    let unmasked = [0x81, 0x02, b'h', b'i'];
    assert_eq!(close_code_after(&t, &unmasked).await, 1002);
    let mut big_ping = vec![0x89, 0x80 | 126, 0, 126, 0, 0, 0, 0];
    big_ping.extend([b'p'; 126]);
    assert_eq!(close_code_after(&t, &big_ping).await, 1002);
    assert_eq!(t.get("/api/health").await.status(), 200);
}

#[tokio::test]
async fn a_base64_token_passes_the_websocket_query_percent_encoded() {
    // As `openssl rand -base64` makes them, and the web page's URLSearchParams encodes them.
    let t = TestServer::start(Setup {
        token: Some("ab+c/d=="),
        ..Setup::default()
    })
    .await;
    assert_eq!(t.get("/api/dialogs").await.status(), 200);
    let url = format!("{}?access_token=ab%2Bc%2Fd%3D%3D", t.ws_url);
    tokio_tungstenite::connect_async(url)
        .await
        .expect("the encoded token is accepted");
    let wrong = format!("{}?access_token=ab%2Bc%2Fd%3D", t.ws_url);
    assert!(tokio_tungstenite::connect_async(wrong).await.is_err());
}
