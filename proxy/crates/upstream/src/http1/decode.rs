//! The response as it comes off the wire: its head (1xx heads skipped), then its body
//! framed by the request's method, the status, `transfer-encoding` or `content-length`,
//! or the connection's close, as RFC 9112 section 6.3 orders them.

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use hyper::body::Frame;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Response, StatusCode, Version};

use super::Error;

/// Envoy's default header limits (`max_headers_count`, `max_response_headers_kb`).
const MAX_HEADERS: usize = 100;
const MAX_HEAD: usize = 60 * 1024;
/// A chunk-size line longer than this is not one.
const MAX_CHUNK_LINE: usize = 1024;

/// How the response body is framed.
#[derive(Debug)]
pub(super) enum Framing {
    /// This many bytes still to read.
    Length(u64),
    Chunked(Chunked),
    /// Everything until the upstream closes.
    Close,
}

/// A response head, parsed.
pub(super) struct Head {
    pub response: Response<()>,
    pub framing: Framing,
    /// The connection may carry another request once this response is read.
    pub keep_alive: bool,
}

/// Parses a response head from the front of `buf`, taking it off; `None` when more
/// bytes are needed. Interim (1xx) heads are skipped.
pub(super) fn head(buf: &mut BytesMut, method: &Method) -> Result<Option<Head>, Error> {
    loop {
        // Slots left uninitialised, as hyper's: filling 100 of them for each response
        // cost more than parsing it.
        let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut parsed,
            buf,
            &mut slots,
        ) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
                return Err(Error::Malformed("response head too large"));
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Error::Malformed("too many response headers"));
            }
            Err(_) => return Err(Error::Malformed("invalid response head")),
        };
        let code = parsed.code.unwrap_or_default();
        let status =
            StatusCode::from_u16(code).map_err(|_| Error::Malformed("invalid status code"))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            // Never asked for on this path (upgrades have their own connections).
            return Err(Error::Malformed("unrequested 101"));
        }
        if status.is_informational() {
            buf.advance(len);
            continue;
        }
        let version = if parsed.version == Some(0) {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        // Copied out: the read buffer stays the connection's alone, reused without an
        // allocation for the next response (a head is a few hundred bytes). The values
        // are slices of the copy, found by their offsets in the read buffer.
        let bytes = Bytes::copy_from_slice(&buf[..len]);
        let base = buf.as_ptr() as usize;
        let mut headers = HeaderMap::with_capacity(parsed.headers.len());
        for field in parsed.headers.iter() {
            let name = HeaderName::from_bytes(field.name.as_bytes())
                .map_err(|_| Error::Malformed("invalid header name"))?;
            let start = field.value.as_ptr() as usize - base;
            let value =
                HeaderValue::from_maybe_shared(bytes.slice(start..start + field.value.len()))
                    .map_err(|_| Error::Malformed("invalid header value"))?;
            headers.append(name, value);
        }
        buf.advance(len);
        let (framing, keep_alive) = framing(method, status, version, &headers)?;
        let mut response = Response::new(());
        *response.status_mut() = status;
        *response.version_mut() = version;
        *response.headers_mut() = headers;
        return Ok(Some(Head {
            response,
            framing,
            keep_alive,
        }));
    }
}

/// The body's framing and whether the connection outlives the response.
fn framing(
    method: &Method,
    status: StatusCode,
    version: Version,
    headers: &HeaderMap,
) -> Result<(Framing, bool), Error> {
    let (mut close, mut keep) = (false, false);
    for token in super::tokens(headers, header::CONNECTION) {
        close |= token.eq_ignore_ascii_case(b"close");
        keep |= token.eq_ignore_ascii_case(b"keep-alive");
    }
    let keep_alive = !close && (version == Version::HTTP_11 || keep);
    if method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok((Framing::Length(0), keep_alive));
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        let chunked = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .next_back()
            .and_then(|v| v.as_bytes().rsplit(|&b| b == b',').next())
            .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        return Ok(if !chunked {
            (Framing::Close, false)
        } else {
            // With a content-length as well, the message was made to smuggle: chunked
            // wins (RFC 9112 6.3), and the connection is not used again.
            let smuggled = headers.contains_key(header::CONTENT_LENGTH);
            (Framing::Chunked(Chunked::Size), keep_alive && !smuggled)
        });
    }
    let length = super::content_length(headers).map_err(Error::Malformed)?;
    Ok(match length {
        Some(length) => (Framing::Length(length), keep_alive),
        None => (Framing::Close, false),
    })
}

/// Where a chunked body's decoder is.
#[derive(Debug)]
pub(super) enum Chunked {
    Size,
    /// Bytes of the current chunk still to come.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    Trailers,
    Done,
}

impl Chunked {
    pub fn is_done(&self) -> bool {
        matches!(self, Chunked::Done)
    }

    /// Whether the body's end (a last chunk without trailers) follows the data just
    /// read, already in `buf`: then it is taken off, so the body ends with its data.
    pub fn finish_early(&mut self, buf: &mut BytesMut) -> bool {
        const END: &[u8] = b"\r\n0\r\n\r\n";
        let end = match self {
            Chunked::DataEnd => END,
            Chunked::Size => &END[2..],
            _ => return false,
        };
        if !buf.starts_with(end) {
            return false;
        }
        buf.advance(end.len());
        *self = Chunked::Done;
        true
    }

    /// The next frame `buf` holds, taken off it; `None` when more bytes are needed
    /// (or, once done, never).
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame<Bytes>>, Error> {
        loop {
            match self {
                Chunked::Done => return Ok(None),
                Chunked::Size => {
                    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
                        if buf.len() > MAX_CHUNK_LINE {
                            return Err(Error::Malformed("chunk size line too long"));
                        }
                        return Ok(None);
                    };
                    let size = chunk_size(&buf[..end])?;
                    buf.advance(end + 2);
                    *self = if size == 0 {
                        Chunked::Trailers
                    } else {
                        Chunked::Data(size)
                    };
                }
                Chunked::Data(left) => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let take = (*left).min(buf.len() as u64) as usize;
                    *left -= take as u64;
                    if *left == 0 {
                        *self = Chunked::DataEnd;
                    }
                    return Ok(Some(Frame::data(take_bytes(buf, take))));
                }
                Chunked::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(None);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(Error::Malformed("chunk data not followed by CRLF"));
                    }
                    buf.advance(2);
                    *self = Chunked::Size;
                }
                Chunked::Trailers => {
                    if buf.starts_with(b"\r\n") {
                        buf.advance(2);
                        *self = Chunked::Done;
                        return Ok(None);
                    }
                    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    let (len, fields) = match httparse::parse_headers(buf, &mut slots) {
                        Ok(httparse::Status::Complete(done)) => done,
                        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
                            return Err(Error::Malformed("trailers too large"));
                        }
                        Ok(httparse::Status::Partial) => return Ok(None),
                        Err(_) => return Err(Error::Malformed("invalid trailers")),
                    };
                    let mut trailers = HeaderMap::with_capacity(fields.len());
                    for field in fields {
                        if let (Ok(name), Ok(value)) = (
                            HeaderName::from_bytes(field.name.as_bytes()),
                            HeaderValue::from_bytes(field.value),
                        ) {
                            trailers.append(name, value);
                        }
                    }
                    buf.advance(len);
                    *self = Chunked::Done;
                    return Ok(Some(Frame::trailers(trailers)));
                }
            }
        }
    }
}

/// Below this, body bytes are copied out of the read buffer rather than split off it:
/// a split makes the buffer shared, and the next read needs a new one.
const COPY_BELOW: usize = 4 * 1024;

/// The first `len` bytes of `buf`, taken off it.
pub(super) fn take_bytes(buf: &mut BytesMut, len: usize) -> Bytes {
    if len < COPY_BELOW {
        let bytes = Bytes::copy_from_slice(&buf[..len]);
        buf.advance(len);
        bytes
    } else {
        buf.split_to(len).freeze()
    }
}

/// A chunk-size line's size; extensions (`;name=value`) are ignored.
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    let digits = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(Error::Malformed("invalid chunk size"));
    }
    let text = std::str::from_utf8(digits).map_err(|_| Error::Malformed("invalid chunk size"))?;
    u64::from_str_radix(text, 16).map_err(|_| Error::Malformed("invalid chunk size"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(wire: &[u8], method: Method) -> Result<Option<Head>, Error> {
        head(&mut BytesMut::from(wire), &method)
    }

    #[test]
    fn length_keep_alive_and_close() {
        let head = parse(
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: b\r\n\r\nhello",
            Method::GET,
        )
        .unwrap()
        .unwrap();
        assert_eq!(head.response.status(), 200);
        assert_eq!(head.response.headers()["x-a"], "b");
        assert!(matches!(head.framing, Framing::Length(5)));
        assert!(head.keep_alive);
        let head = parse(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            Method::GET,
        )
        .unwrap()
        .unwrap();
        assert!(!head.keep_alive);
        let head = parse(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", Method::GET)
            .unwrap()
            .unwrap();
        assert!(!head.keep_alive, "HTTP/1.0 without keep-alive closes");
        let head = parse(b"HTTP/1.1 200 OK\r\n\r\n", Method::GET)
            .unwrap()
            .unwrap();
        assert!(matches!(head.framing, Framing::Close));
        assert!(!head.keep_alive);
    }

    #[test]
    fn no_body_for_head_and_204() {
        let head = parse(
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n",
            Method::HEAD,
        )
        .unwrap()
        .unwrap();
        assert!(matches!(head.framing, Framing::Length(0)));
        let head = parse(b"HTTP/1.1 204 No Content\r\n\r\n", Method::GET)
            .unwrap()
            .unwrap();
        assert!(matches!(head.framing, Framing::Length(0)));
        assert!(head.keep_alive);
    }

    #[test]
    fn interim_heads_are_skipped_and_partial_waits() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n"[..],
        );
        let head = head(&mut buf, &Method::POST).unwrap().unwrap();
        assert_eq!(head.response.status(), 201);
        assert!(buf.is_empty());
        assert!(
            parse(b"HTTP/1.1 200 OK\r\ncontent-le", Method::GET)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn bad_heads_are_malformed() {
        for wire in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
            b"NOT HTTP\r\n\r\n",
        ] {
            assert!(
                matches!(parse(wire, Method::GET), Err(Error::Malformed(_))),
                "{}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    #[test]
    fn chunked_with_trailers_in_pieces() {
        let wire = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-t: 1\r\n\r\n";
        // Fed one byte at a time, the frames come out whole or in pieces, then the
        // trailers, then nothing.
        let mut decoder = Chunked::Size;
        let mut buf = BytesMut::new();
        let (mut data, mut trailers) = (Vec::new(), None);
        for &b in wire {
            buf.extend_from_slice(&[b]);
            while let Some(frame) = decoder.decode(&mut buf).unwrap() {
                match frame.into_data() {
                    Ok(d) => data.extend_from_slice(&d),
                    Err(frame) => trailers = frame.into_trailers().ok(),
                }
            }
        }
        assert_eq!(data, b"hello world");
        assert_eq!(trailers.unwrap()["x-t"], "1");
        assert!(decoder.is_done());
        let mut bad = Chunked::Size;
        assert!(bad.decode(&mut BytesMut::from(&b"zz\r\n"[..])).is_err());
    }
}
