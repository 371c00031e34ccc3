//! A request head off the wire. This codec takes the requests a proxy sees most: an
//! HTTP/1.1 head that arrived whole, with no body, no upgrade, no `expect`, not CONNECT.
//! Anything else is left to hyper's server (`Parsed::Other`), which then serves the
//! rest of the connection: its errors (400, 431), bodies, `100-continue`, upgrades and
//! header timeouts stay exactly as they were.

use std::mem::MaybeUninit;

use bytes::{Bytes, BytesMut};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Uri, Version};

/// Headers parsed in place at most; a request with more goes to hyper (which then
/// applies `max_headers_count`).
const MAX_HEADERS: usize = 100;

/// What the front of the read buffer holds.
pub(super) enum Parsed {
    /// A whole request this codec serves, taken off the buffer.
    Request(Request<()>, KeepAlive),
    /// Not a whole head yet.
    Partial,
    /// A request for hyper: the bytes it must read first (this head and what follows).
    Other(Bytes),
}

/// Whether the downstream asked to close after this request (`connection: close`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeepAlive {
    Yes,
    No,
}

/// A header's name and value as offsets into the head, so the values can share it.
#[derive(Clone, Copy, Default)]
struct Indices {
    name: (usize, usize),
    value: (usize, usize),
}

/// Parses the request head at the front of `buf`.
pub(super) fn parse(buf: &mut BytesMut, max_headers: usize) -> Parsed {
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut indices = [Indices::default(); MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let len = match parsed.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Other(buf.split().freeze()),
    };
    let base = buf.as_ptr() as usize;
    let offsets = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        (start, start + s.len())
    };
    let (Some(method), Some(path), Some(1)) = (parsed.method, parsed.path, parsed.version) else {
        return Parsed::Other(buf.split().freeze());
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Parsed::Other(buf.split().freeze());
    };
    if method == Method::CONNECT || parsed.headers.len() > max_headers {
        return Parsed::Other(buf.split().freeze());
    }
    let path = offsets(path.as_bytes());
    let mut keep_alive = KeepAlive::Yes;
    let count = parsed.headers.len();
    let mut ours = true;
    for (header, slot) in parsed.headers.iter().zip(indices.iter_mut()) {
        let (name, value) = (header.name.as_bytes(), header.value);
        ours &= served(name, value);
        if name.eq_ignore_ascii_case(b"connection") && has_close(value) {
            keep_alive = KeepAlive::No;
        }
        *slot = Indices {
            name: offsets(name),
            value: offsets(value),
        };
    }
    if !ours {
        return Parsed::Other(buf.split().freeze());
    }
    let head = buf.split_to(len).freeze();
    match request(&head, method, path, &indices[..count]) {
        Some(request) => Parsed::Request(request, keep_alive),
        // A target or header name `http` refuses: hyper answers it (400).
        None => {
            let mut all = BytesMut::with_capacity(head.len() + buf.len());
            all.extend_from_slice(&head);
            all.extend_from_slice(&buf.split());
            Parsed::Other(all.freeze())
        }
    }
}

/// Whether a header leaves the request to this codec: no body (`content-length: 0` at
/// most), no upgrade, no `expect`.
fn served(name: &[u8], value: &[u8]) -> bool {
    let is = |other: &[u8]| name.eq_ignore_ascii_case(other);
    if is(b"content-length") {
        return value.trim_ascii() == b"0";
    }
    if is(b"connection") {
        return !value
            .split(|&b| b == b',')
            .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"upgrade"));
    }
    !(is(b"transfer-encoding") || is(b"upgrade") || is(b"expect"))
}

fn has_close(value: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"))
}

/// The request, its target and header values sharing `head`.
fn request(
    head: &Bytes,
    method: Method,
    path: (usize, usize),
    indices: &[Indices],
) -> Option<Request<()>> {
    let uri = Uri::from_maybe_shared(head.slice(path.0..path.1)).ok()?;
    let mut headers = HeaderMap::with_capacity(indices.len());
    for index in indices {
        let name = HeaderName::from_bytes(&head[index.name.0..index.name.1]).ok()?;
        // httparse accepted only the bytes a field value may hold.
        let value =
            HeaderValue::from_maybe_shared(head.slice(index.value.0..index.value.1)).ok()?;
        headers.append(name, value);
    }
    let mut request = Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    Some(request)
}

/// Whether a response must say `connection: close` (appended unless it already does),
/// as hyper's server says it when the connection will not carry another request.
pub(super) fn say_close(headers: &mut HeaderMap) {
    if !crate::upstream::http1::tokens(headers, header::CONNECTION)
        .any(|t| t.eq_ignore_ascii_case(b"close"))
    {
        headers.append(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(s: &str) -> (Parsed, BytesMut) {
        let mut buf = BytesMut::from(s);
        (parse(&mut buf, 100), buf)
    }

    #[test]
    fn a_bodyless_request_is_parsed_and_the_next_one_stays_buffered() {
        let (parsed, rest) = parse_str(
            "GET /a?b=1 HTTP/1.1\r\nHost: svc\r\nX-Two: 1\r\nx-two: 2\r\ncontent-length: 0\r\n\r\nGET /next",
        );
        let Parsed::Request(request, keep_alive) = parsed else {
            panic!("not served")
        };
        assert_eq!(keep_alive, KeepAlive::Yes);
        assert_eq!(request.method(), Method::GET);
        assert_eq!(request.uri(), "/a?b=1");
        assert_eq!(request.headers()["host"], "svc");
        let two: Vec<_> = request.headers().get_all("x-two").iter().collect();
        assert_eq!(two, ["1", "2"]);
        assert_eq!(&rest[..], b"GET /next");
    }

    #[test]
    fn connection_close_is_noticed() {
        let (parsed, _) = parse_str("GET / HTTP/1.1\r\nhost: a\r\nConnection: foo, Close\r\n\r\n");
        assert!(matches!(parsed, Parsed::Request(_, KeepAlive::No)));
    }

    #[test]
    fn what_hyper_serves_is_handed_over_whole() {
        for head in [
            "POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\n\r\nabc",
            "POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n",
            "GET / HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
            "GET / HTTP/1.1\r\nhost: a\r\nexpect: 100-continue\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\nhost: a:443\r\n\r\n",
            "GET / HTTP/1.0\r\n\r\n",
            "GET / HTTP/1.1\r\nbad header\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ] {
            let (parsed, rest) = parse_str(head);
            match parsed {
                Parsed::Other(bytes) => assert_eq!(&bytes[..], head.as_bytes(), "{head}"),
                _ => panic!("served {head:?}"),
            }
            assert!(rest.is_empty());
        }
        let (parsed, rest) = parse_str("GET / HTTP/1.1\r\nhost: a\r\n");
        assert!(matches!(parsed, Parsed::Partial));
        assert_eq!(&rest[..], b"GET / HTTP/1.1\r\nhost: a\r\n");
    }

    #[test]
    fn more_headers_than_the_limit_go_to_hyper() {
        let (parsed, _) = {
            let mut buf = BytesMut::from("GET / HTTP/1.1\r\na: 1\r\nb: 2\r\nc: 3\r\n\r\n");
            (parse(&mut buf, 2), buf)
        };
        assert!(matches!(parsed, Parsed::Other(_)));
    }
}
