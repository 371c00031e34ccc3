//! Ports that answer one HTTP/1.1 request per connection from the instance itself,
//! with no configuration behind them: node mode's per-pod health (Istio's 15021) and
//! stats (15090) ports. A `shunt proxy` serves Istio's own from its admin API instead.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How a local-reply port answers a request.
pub trait LocalReply: Send + Sync + 'static {
    /// The whole response (head and body) to `method` `path` (the query left off).
    fn reply(&self, method: &str, path: &str) -> Vec<u8>;
}

/// A response with no body.
pub fn status_only(status: &str) -> Vec<u8> {
    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").into_bytes()
}

/// A 200 response with `body` of `content_type`.
pub fn ok(content_type: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Reads one request's head and writes what `replies` answers, then closes.
pub async fn serve(mut stream: TcpStream, replies: &dyn LocalReply) {
    let Some(head) = request_head(&mut stream).await else {
        return;
    };
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|b| *b == b' ');
    let method = String::from_utf8_lossy(words.next().unwrap_or_default()).into_owned();
    let target = words.next().unwrap_or_default();
    let path = target.split(|b| *b == b'?').next().unwrap_or(target);
    let reply = replies.reply(&method, &String::from_utf8_lossy(path));
    let _ = stream.write_all(&reply).await;
    let _ = stream.shutdown().await;
}

/// A request's head (up to the blank line), or `None` if it does not come in 5 s.
async fn request_head(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 && head.len() < 8192 => head.extend_from_slice(&buf[..n]),
            _ => return None,
        }
    }
    Some(head)
}
