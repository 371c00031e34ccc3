//! The request as it goes on the wire: the head, then the body framed by a
//! content-length or chunked (with its trailers), as Envoy's HTTP/1 codec sends it.

use std::fmt::Write as _;

use bytes::{BufMut, Bytes, BytesMut};
use hyper::body::Body as _;
use hyper::header::{self, HeaderMap};
use hyper::http::request::Parts;

use super::Error;
use crate::upstream::http_pool::RequestBody;

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
    } else if let Some(length) = content_length(&parts.headers)? {
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
    for (name, value) in &parts.headers {
        // The framing is this hop's own.
        if name == header::TRANSFER_ENCODING {
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

/// The request's `content-length`, when it has one; several must agree.
fn content_length(headers: &HeaderMap) -> Result<Option<u64>, Error> {
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        let parsed = std::str::from_utf8(value.as_bytes())
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or(Error::RequestLength)?;
        if length.is_some_and(|l| l != parsed) {
            return Err(Error::RequestLength);
        }
        length = Some(parsed);
    }
    Ok(length)
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

/// The body's end, with its trailers if any (sent only when chunked, as Envoy does).
pub(super) fn end(
    framing: Framing,
    trailers: Option<&HeaderMap>,
    out: &mut BytesMut,
    queue: &mut Vec<Bytes>,
) -> Result<(), Error> {
    match framing {
        Framing::Empty | Framing::Length(0) => Ok(()),
        Framing::Length(_) => Err(Error::RequestLength),
        Framing::Chunked => {
            out.put_slice(b"0\r\n");
            for (name, value) in trailers.into_iter().flatten() {
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
