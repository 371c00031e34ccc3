//! The response head as it goes on the wire, byte for byte what hyper's HTTP/1.1 server
//! writes (what `http::wire` counts for the access log and Istio's byte metrics): the
//! status line, the headers in order with `connection`, `transfer-encoding` and
//! `trailer` values joined on one line, the body's framing when no header states it,
//! and a `date` when there is none.

use std::cell::Cell;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, BytesMut};
use hyper::StatusCode;
use hyper::body::Body as _;
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::http::response::Parts;

use crate::http::body::ResponseBody;
use crate::upstream::http1::{Framing, content_length, declared_trailers, tokens};

/// What the head says about the rest of the response.
pub(super) struct Head {
    pub framing: Framing,
    /// The connection closes once this response is sent.
    pub last: bool,
    /// The trailer fields a chunked body may end with.
    pub declared: Vec<HeaderName>,
}

/// Writes the head of the response to a request (`head_request`: a HEAD) into `out`.
/// `Err` when the headers contradict themselves (hyper refuses those too).
pub(super) fn head(
    out: &mut BytesMut,
    parts: &Parts,
    body: &ResponseBody,
    head_request: bool,
) -> Result<Head, &'static str> {
    let status = parts.status;
    if status.is_informational() {
        return Err("1xx response");
    }
    let no_content = matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED);
    // Whether a body may follow (hyper's `can_chunked` / `can_have_body`).
    let may_have_body = !head_request && !no_content;
    // `None`: no body; `Some(None)`: one of unknown length.
    let length = (!body.is_end_stream()).then(|| body.size_hint().exact());
    let headers = &parts.headers;
    out.reserve(64 + headers.len() * 32);
    if status == StatusCode::OK {
        out.put_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.put_slice(b"HTTP/1.1 ");
        out.put_slice(status.as_str().as_bytes());
        out.put_u8(b' ');
        out.put_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
        out.put_slice(b"\r\n");
    }
    let mut framing = None;
    let (mut last, mut dated) = (false, false);
    for name in headers.keys() {
        let values = headers.get_all(name);
        match *name {
            header::CONTENT_LENGTH if length.is_some() && framing.is_some() => {
                return Err("content-length and transfer-encoding");
            }
            header::CONTENT_LENGTH => match length {
                Some(Some(known)) => {
                    // The body knows its length: the header is trusted to agree.
                    field(out, name, values.iter().take(1));
                    framing = Some(Framing::Length(known));
                }
                Some(None) => {
                    let stated = content_length(headers)
                        .map_err(|_| "invalid content-length")?
                        .unwrap_or_default();
                    field(out, name, values.iter().take(1));
                    framing = Some(Framing::Length(stated));
                }
                // A HEAD's answer says the length its GET would have.
                None if head_request => {
                    for value in values {
                        field(out, name, std::iter::once(value));
                    }
                    framing = Some(Framing::Empty);
                }
                None => {}
            },
            header::TRANSFER_ENCODING => {
                if !may_have_body {
                    continue;
                }
                if framing.is_some() {
                    return Err("content-length and transfer-encoding");
                }
                field(out, name, values.iter());
                // `chunked` must be the last coding: it is added when it is not.
                if values
                    .iter()
                    .next_back()
                    .is_some_and(|v| !ends_chunked(v.as_bytes()))
                {
                    out.truncate(out.len() - 2);
                    out.put_slice(b", chunked\r\n");
                }
                framing = Some(Framing::Chunked);
            }
            header::CONNECTION => {
                last |=
                    tokens(headers, header::CONNECTION).any(|t| t.eq_ignore_ascii_case(b"close"));
                field(out, name, values.iter());
            }
            header::TRAILER => {
                if may_have_body {
                    field(out, name, values.iter());
                }
            }
            _ => {
                dated |= *name == header::DATE;
                for value in values {
                    field(out, name, std::iter::once(value));
                }
            }
        }
    }
    let framing = match framing {
        Some(framing) => framing,
        None => match length {
            Some(None) if may_have_body => {
                out.put_slice(b"transfer-encoding: chunked\r\n");
                Framing::Chunked
            }
            Some(None) => Framing::Empty,
            None | Some(Some(0)) => {
                if !no_content && !head_request {
                    out.put_slice(b"content-length: 0\r\n");
                }
                Framing::Empty
            }
            Some(Some(length)) => {
                if no_content {
                    Framing::Empty
                } else {
                    let _ = write!(out, "content-length: {length}\r\n");
                    Framing::Length(length)
                }
            }
        },
    };
    let framing = if may_have_body {
        framing
    } else {
        Framing::Empty
    };
    if !dated {
        out.put_slice(b"date: ");
        out.put_slice(&date());
        out.put_slice(b"\r\n");
    }
    out.put_slice(b"\r\n");
    let declared = if framing == Framing::Chunked {
        declared_trailers(headers)
    } else {
        Vec::new()
    };
    Ok(Head {
        framing,
        last,
        declared,
    })
}

fn ends_chunked(value: &[u8]) -> bool {
    value
        .rsplit(|&b| b == b',')
        .next()
        .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// `name: v1, v2\r\n` (or one value).
fn field<'a>(out: &mut BytesMut, name: &HeaderName, values: impl Iterator<Item = &'a HeaderValue>) {
    out.put_slice(name.as_str().as_bytes());
    out.put_slice(b": ");
    for (i, value) in values.enumerate() {
        if i > 0 {
            out.put_slice(b", ");
        }
        out.put_slice(value.as_bytes());
    }
    out.put_slice(b"\r\n");
}

/// The `date` value, formatted once a second per thread.
fn date() -> [u8; 29] {
    thread_local! {
        static CACHED: Cell<(u64, [u8; 29])> = const { Cell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let (at, value) = cached.get();
        if at == second {
            return value;
        }
        let mut value = [0; 29];
        let formatted = httpdate::fmt_http_date(now);
        if formatted.len() == value.len() {
            value.copy_from_slice(formatted.as_bytes());
        }
        cached.set((second, value));
        value
    })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use hyper::Response;

    use super::*;

    fn encode(response: Response<ResponseBody>, head_request: bool) -> (String, Framing, bool) {
        let (parts, body) = response.into_parts();
        let mut out = BytesMut::new();
        let head = head(&mut out, &parts, &body, head_request).unwrap();
        let text = String::from_utf8(out.to_vec()).unwrap();
        // The date changes; its place and form do not.
        let date = text.find("date: ").expect("a date");
        assert_eq!(&text[date + 6 + 29..date + 6 + 33], "\r\n\r\n", "{text}");
        let stated = httpdate::parse_http_date(&text[date + 6..date + 6 + 29]).unwrap();
        let age = SystemTime::now().duration_since(stated).unwrap_or_default();
        assert!(age.as_secs() < 60, "{text}");
        let text = format!("{}{}", &text[..date], &text[date + 6 + 31..]);
        (text, head.framing, head.last)
    }

    #[test]
    fn a_known_length_is_stated_and_values_keep_their_lines() {
        let response = Response::builder()
            .header("x-a", "1")
            .header("x-a", "2")
            .header("connection", "keep-alive")
            .header("connection", "close")
            .body(ResponseBody::full(Bytes::from_static(b"hello")))
            .unwrap();
        let (text, framing, last) = encode(response, false);
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\nx-a: 1\r\nx-a: 2\r\nconnection: keep-alive, close\r\ncontent-length: 5\r\n\r\n"
        );
        assert_eq!(framing, Framing::Length(5));
        assert!(last);
    }

    #[test]
    fn no_body_says_zero_except_for_head_204_and_304() {
        let empty = || ResponseBody::full(Bytes::new());
        let (text, framing, _) = encode(Response::new(empty()), false);
        assert_eq!(text, "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
        assert_eq!(framing, Framing::Empty);
        let (text, ..) = encode(Response::new(empty()), true);
        assert_eq!(text, "HTTP/1.1 200 OK\r\n\r\n");
        let mut response = Response::new(ResponseBody::full(Bytes::from_static(b"x")));
        *response.status_mut() = StatusCode::NO_CONTENT;
        let (text, framing, _) = encode(response, false);
        assert_eq!(text, "HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!(framing, Framing::Empty);
        // A HEAD's answer keeps the length its GET would have, and sends no body.
        let response = Response::builder()
            .status(404)
            .header("content-length", "12")
            .body(empty())
            .unwrap();
        let (text, framing, _) = encode(response, true);
        assert_eq!(text, "HTTP/1.1 404 Not Found\r\ncontent-length: 12\r\n\r\n");
        assert_eq!(framing, Framing::Empty);
    }

    #[test]
    fn a_stated_date_is_kept() {
        let response = Response::builder()
            .header("date", "Tue, 24 Nov 2026 07:00:00 GMT")
            .body(ResponseBody::full(Bytes::new()))
            .unwrap();
        let (parts, body) = response.into_parts();
        let mut out = BytesMut::new();
        head(&mut out, &parts, &body, false).unwrap();
        assert_eq!(
            &out[..],
            b"HTTP/1.1 200 OK\r\ndate: Tue, 24 Nov 2026 07:00:00 GMT\r\ncontent-length: 0\r\n\r\n"
        );
    }
}
