//! A tiny HTTP/1.1 server on 127.0.0.1 that answers each connection with the
//! next canned [`Reply`] and records every request it received.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How a reply's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The terminating chunk is sent and the connection closed.
    Complete,
    /// The connection is closed without the terminating chunk (a cut stream).
    Cut,
    /// The connection stays open and silent.
    Stall,
    /// The connection stays open, sending an SSE comment every so often
    /// (never silent long enough for a read timeout).
    Trickle(std::time::Duration),
}

/// One canned response.
#[derive(Debug, Clone)]
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    /// `Some` for a fixed-length body, `None` for chunked `chunks`.
    fixed: Option<String>,
    chunks: Vec<String>,
    end: End,
}

impl Reply {
    /// A `text/event-stream` reply sending each string as one HTTP chunk.
    pub fn sse(chunks: Vec<String>) -> Self {
        Self {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            fixed: None,
            chunks,
            end: End::Complete,
        }
    }

    /// A JSON reply with `status`.
    pub fn json(status: u16, body: &str) -> Self {
        Self {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            fixed: Some(body.to_owned()),
            chunks: Vec::new(),
            end: End::Complete,
        }
    }

    /// Adds a response header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Ends the body as `end` says.
    pub fn ending(mut self, end: End) -> Self {
        self.end = end;
        self
    }
}

/// A request as the server saw it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: serde_json::Value,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The running server.
pub struct Server {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<Recorded>>>,
}

impl Server {
    /// Starts a server answering connections with `replies`, in order; once
    /// they run out it answers 418.
    pub async fn start(replies: Vec<Reply>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let replies = Arc::new(Mutex::new(VecDeque::from(replies)));
        let recorded = requests.clone();
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                let reply = replies.lock().unwrap().pop_front().unwrap_or_else(|| {
                    Reply::json(418, r#"{"error":{"message":"no more replies"}}"#)
                });
                tokio::spawn(serve(socket, reply, recorded.clone()));
            }
        });
        Server { addr, requests }
    }

    /// `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }
}

async fn serve(mut socket: TcpStream, reply: Reply, recorded: Arc<Mutex<Vec<Recorded>>>) {
    let Some(request) = read_request(&mut socket).await else {
        return;
    };
    recorded.lock().unwrap().push(request);
    let mut head = format!("HTTP/1.1 {} X\r\nconnection: close\r\n", reply.status);
    for (n, v) in &reply.headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    match &reply.fixed {
        Some(body) => head.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len())),
        None => head.push_str("transfer-encoding: chunked\r\n\r\n"),
    }
    if socket.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    if reply.fixed.is_none() {
        for chunk in &reply.chunks {
            let framed = format!("{:x}\r\n{chunk}\r\n", chunk.len());
            if socket.write_all(framed.as_bytes()).await.is_err() {
                return;
            }
            let _ = socket.flush().await;
        }
        match reply.end {
            End::Complete => {
                let _ = socket.write_all(b"0\r\n\r\n").await;
            }
            End::Cut => {}
            End::Stall => std::future::pending::<()>().await,
            End::Trickle(every) => loop {
                tokio::time::sleep(every).await;
                let ping = ": ping\n\n";
                let framed = format!("{:x}\r\n{ping}\r\n", ping.len());
                if socket.write_all(framed.as_bytes()).await.is_err() {
                    return;
                }
            },
        }
    }
    let _ = socket.shutdown().await;
}

async fn read_request(socket: &mut TcpStream) -> Option<Recorded> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = socket.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let path = lines.next()?.split(' ').nth(1)?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = socket.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let body =
        serde_json::from_slice(&buf[head_end..head_end + len]).unwrap_or(serde_json::Value::Null);
    Some(Recorded {
        path,
        headers,
        body,
    })
}
