//! The size of a request's and a response's head as HTTP/1.1 puts them on the wire:
//! what istio-proxy's `istio_request_bytes` / `istio_response_bytes` add to the body
//! (Envoy's downstream bytes meter counts the codec's wire bytes, head included). hyper
//! parses and writes the heads, so they are measured from the parsed request and the
//! response it will write: `Name: value\r\n` per header (hyper's own form, and every
//! common client's), the start line, and what hyper adds to a response.

use hyper::http::{request, response};
use hyper::{HeaderMap, Version, header};

/// `METHOD target HTTP/1.1\r\n`, the headers, and the blank line.
pub fn request_head(parts: &request::Parts) -> u64 {
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.to_string().len(), |p| p.as_str().len());
    let line = parts.method.as_str().len() + 1 + target + 1 + "HTTP/1.1".len() + 2;
    line as u64 + headers(&parts.headers) + 2
}

/// Whether the connection closes after this request's response (hyper then adds
/// `connection: close` to it).
pub fn closes(parts: &request::Parts) -> bool {
    let has = |token: &[u8]| {
        shunt_upstream::http1::tokens(&parts.headers, header::CONNECTION)
            .any(|t| t.eq_ignore_ascii_case(token))
    };
    match parts.version {
        Version::HTTP_10 => !has(b"keep-alive"),
        Version::HTTP_11 => has(b"close"),
        _ => false,
    }
}

/// The status line, the headers with those hyper adds when they are missing (`date`,
/// the body's framing, `connection: close`), and the blank line. `body_len` is the
/// body's exact length when known; without it the body is chunked.
pub fn response_head(parts: &response::Parts, body_len: Option<u64>, closes: bool) -> u64 {
    let status = parts.status;
    let reason = status.canonical_reason().unwrap_or("");
    let mut size = ("HTTP/1.1 ".len() + 3 + 1 + reason.len() + 2) as u64;
    size += headers(&parts.headers);
    let has = |name: header::HeaderName| parts.headers.contains_key(name);
    if !has(header::DATE) {
        // `date: Sun, 06 Nov 1994 08:49:37 GMT`: IMF-fixdate is always 29 characters.
        size += ("date: ".len() + 29 + 2) as u64;
    }
    if !bodiless(parts) && !has(header::CONTENT_LENGTH) && !has(header::TRANSFER_ENCODING) {
        size += match body_len {
            Some(len) => ("content-length: ".len() + len.to_string().len() + 2) as u64,
            None => "transfer-encoding: chunked\r\n".len() as u64,
        };
    }
    if closes && !has(header::CONNECTION) {
        size += "connection: close\r\n".len() as u64;
    }
    size + 2
}

/// Whether hyper sends the body chunked: it has one, of unknown length, and no
/// `content-length`.
pub fn chunked(parts: &response::Parts, body_len: Option<u64>) -> bool {
    body_len.is_none() && !bodiless(parts) && !parts.headers.contains_key(header::CONTENT_LENGTH)
}

fn bodiless(parts: &response::Parts) -> bool {
    let status = parts.status;
    status.is_informational()
        || status == hyper::StatusCode::NO_CONTENT
        || status == hyper::StatusCode::NOT_MODIFIED
}

/// The framing of one chunk of `len` bytes of a chunked body (`{len:x}\r\n...\r\n`).
pub fn chunk_framing(len: usize) -> u64 {
    (format!("{len:x}").len() + 4) as u64
}

/// The last chunk of a chunked body, without trailers (`0\r\n\r\n`).
pub const LAST_CHUNK: u64 = 5;

fn headers(headers: &HeaderMap) -> u64 {
    headers
        .iter()
        .map(|(name, value)| (name.as_str().len() + 2 + value.len() + 2) as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_head_is_counted_as_sent() {
        let raw = "GET /a?b=c HTTP/1.1\r\nHost: svc\r\nConnection: close\r\n\r\n";
        let request = hyper::Request::get("/a?b=c")
            .header("host", "svc")
            .header("connection", "close")
            .body(())
            .unwrap();
        let (parts, ()) = request.into_parts();
        assert_eq!(request_head(&parts), raw.len() as u64);
        assert!(closes(&parts));
    }

    #[test]
    fn hypers_additions_to_a_response_head_are_counted() {
        let response = hyper::Response::builder()
            .status(200)
            .header("server", "envoy")
            .body(())
            .unwrap();
        let (parts, ()) = response.into_parts();
        let written = "HTTP/1.1 200 OK\r\nserver: envoy\r\ncontent-length: 12\r\n\
                       connection: close\r\ndate: Sun, 06 Nov 1994 08:49:37 GMT\r\n\r\n";
        assert_eq!(response_head(&parts, Some(12), true), written.len() as u64);
        let chunked = "HTTP/1.1 200 OK\r\nserver: envoy\r\ntransfer-encoding: chunked\r\n\
                       date: Sun, 06 Nov 1994 08:49:37 GMT\r\n\r\n";
        assert_eq!(response_head(&parts, None, false), chunked.len() as u64);
        assert_eq!(chunk_framing(0x1a), "1a\r\n\r\n".len() as u64);
    }
}
