//! The request as it goes on the wire: the head, then the body framed by a
//! content-length or chunked (with its trailers), as Envoy's HTTP/1 codec sends it.

use std::fmt::Write as _;

use bytes::{BufMut, Bytes, BytesMut};
use hyper::body::Body as _;
use hyper::header::{self, HeaderMap, HeaderName};
use hyper::http::request::Parts;

use super::Error;
use crate::http_pool::RequestBody;

/// How the request body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// No body: nothing follows the head.
    Empty,
    /// `content-length`: this many bytes still to send.
    Length(u64),
    Chunked,
}

/// Writes the request head into `out` and says how the body follows. A body of
/// unknown length goes chunked; a length the headers state is kept (the downstream
/// said it), one only the body knows is added.
pub(super) fn head(
    out: &mut BytesMut,
    parts: &Parts,
    body: &RequestBody,
) -> Result<Framing, Error> {
    let framing = if body.is_end_stream() {
        Framing::Empty
    } else if let Some(length) =
        super::content_length(&parts.headers).map_err(|_| Error::RequestLength)?
    {
        Framing::Length(length)
    } else if let Some(length) = body.size_hint().exact() {
        Framing::Length(length)
    } else {
        Framing::Chunked
    };
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    out.reserve(64 + target.len() + parts.headers.len() * 32);
    out.put_slice(parts.method.as_str().as_bytes());
    out.put_u8(b' ');
    out.put_slice(target.as_bytes());
    out.put_slice(b" HTTP/1.1\r\n");
    let mut cookie_written = false;
    for (name, value) in &parts.headers {
        // The framing is this hop's own.
        if name == header::TRANSFER_ENCODING {
            continue;
        }
        if name == header::COOKIE {
            // HTTP/2 sends one field per cookie; HTTP/1.1 has one `cookie` line, the
            // fields joined with "; " (RFC 9113 §8.2.3), as Envoy's codec does.
            if !cookie_written {
                cookie_written = true;
                put_cookies(out, &parts.headers);
            }
            continue;
        }
        out.put_slice(name.as_str().as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    }
    match framing {
        Framing::Length(length) if !parts.headers.contains_key(header::CONTENT_LENGTH) => {
            let _ = write!(out, "content-length: {length}\r\n");
        }
        Framing::Chunked => out.put_slice(b"transfer-encoding: chunked\r\n"),
        _ => {}
    }
    out.put_slice(b"\r\n");
    Ok(framing)
}

/// Every `cookie` field of `headers` as one `cookie` line, joined with "; ".
fn put_cookies(out: &mut BytesMut, headers: &HeaderMap) {
    out.put_slice(b"cookie: ");
    for (i, value) in headers.get_all(header::COOKIE).iter().enumerate() {
        if i > 0 {
            out.put_slice(b"; ");
        }
        out.put_slice(value.as_bytes());
    }
    out.put_slice(b"\r\n");
}

/// One data frame, framed: the bytes to queue after what is queued already.
pub(super) fn data(
    framing: &mut Framing,
    data: Bytes,
    out: &mut BytesMut,
    queue: &mut Vec<Bytes>,
) -> Result<(), Error> {
    if data.is_empty() {
        return Ok(());
    }
    match framing {
        Framing::Empty => return Err(Error::RequestLength),
        Framing::Length(left) => {
            *left = left
                .checked_sub(data.len() as u64)
                .ok_or(Error::RequestLength)?;
            queue.push(data);
        }
        Framing::Chunked => {
            let _ = write!(out, "{:x}\r\n", data.len());
            queue.push(out.split().freeze());
            queue.push(data);
            out.put_slice(b"\r\n");
            queue.push(out.split().freeze());
        }
    }
    Ok(())
}

/// The trailer fields a request may send: those its `trailer` header declares, less
/// those that belong in a head (hyper's rule; Envoy drops HTTP/1 trailers unless told).
pub(super) fn declared_trailers(headers: &HeaderMap) -> Vec<HeaderName> {
    super::tokens(headers, header::TRAILER)
        .filter_map(|name| HeaderName::from_bytes(name).ok())
        .filter(|name| {
            ![
                header::AUTHORIZATION,
                header::CACHE_CONTROL,
                header::CONTENT_ENCODING,
                header::CONTENT_LENGTH,
                header::CONTENT_RANGE,
                header::CONTENT_TYPE,
                header::HOST,
                header::MAX_FORWARDS,
                header::SET_COOKIE,
                header::TRAILER,
                header::TRANSFER_ENCODING,
                header::TE,
            ]
            .contains(name)
        })
        .collect()
}

/// The body's end, with the declared ones of its trailers (sent only when chunked).
pub(super) fn end(
    framing: Framing,
    trailers: Option<&HeaderMap>,
    declared: &[HeaderName],
    out: &mut BytesMut,
    queue: &mut Vec<Bytes>,
) -> Result<(), Error> {
    match framing {
        Framing::Empty | Framing::Length(0) => Ok(()),
        Framing::Length(_) => Err(Error::RequestLength),
        Framing::Chunked => {
            out.put_slice(b"0\r\n");
            for (name, value) in trailers.into_iter().flatten() {
                if !declared.contains(name) {
                    continue;
                }
                out.put_slice(name.as_str().as_bytes());
                out.put_slice(b": ");
                out.put_slice(value.as_bytes());
                out.put_slice(b"\r\n");
            }
            out.put_slice(b"\r\n");
            queue.push(out.split().freeze());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_declared_trailers_that_may_trail_are_sent() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::TRAILER,
            "x-checksum, content-length".parse().unwrap(),
        );
        let declared = declared_trailers(&headers);
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", "abc".parse().unwrap());
        trailers.insert("x-other", "1".parse().unwrap());
        trailers.insert(header::CONTENT_LENGTH, "5".parse().unwrap());
        let (mut out, mut queue) = (BytesMut::new(), Vec::new());
        end(
            Framing::Chunked,
            Some(&trailers),
            &declared,
            &mut out,
            &mut queue,
        )
        .unwrap();
        assert_eq!(&queue[0][..], b"0\r\nx-checksum: abc\r\n\r\n");
        let mut length = Framing::Length(3);
        assert!(
            data(
                &mut length,
                Bytes::from_static(b"abcd"),
                &mut out,
                &mut queue
            )
            .is_err()
        );
    }
}
