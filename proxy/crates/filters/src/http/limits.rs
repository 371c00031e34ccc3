//! What a downstream may send, enforced as Envoy does: `max_request_headers_kb` and
//! `max_headers_count` (431 `Request Header Fields Too Large`),
//! `headers_with_underscores_action` (400, or the header dropped),
//! `max_requests_per_connection` (the last response closes the connection, or HTTP/2's
//! GOAWAY); and what Envoy's HTTP/1 codec refuses that hyper's takes (unknown methods,
//! HTTP/1.0, transfer codings other than chunked). hyper's codecs bound the bytes held
//! while headers arrive; the exact checks are here.

use std::sync::atomic::{AtomicU32, Ordering};

use hyper::header::HeaderMap;
use hyper::http::request::Parts;
use hyper::{Response, StatusCode, Version};

use super::body::ResponseBody;
use super::config::{HttpConnectionManager, Limits, Underscores};
use super::router::LocalReply;

/// hyper's HTTP/1 read buffer: the header limit plus room for the request line and each
/// header's `: ` and CRLF, which Envoy does not count. A request whose head does not fit
/// gets hyper's own 431 (with no body) and the connection closes; one that fits but is
/// over Envoy's count gets [`check_request`]'s.
pub fn http1_buffer(limits: &Limits) -> usize {
    const REQUEST_LINE: usize = 16 * 1024;
    // hyper refuses less than 8 KiB.
    (limits.max_request_headers_bytes + 4 * limits.max_headers_count + REQUEST_LINE).max(8192)
}

/// Whether the request numbered by `requests` is the connection's last under
/// `max_requests_per_connection` (or past it); counts `downstream_cx_max_requests_reached`
/// once. Its HTTP/1 response carries `connection: close`; HTTP/2 sends GOAWAY.
pub fn last_request(hcm: &HttpConnectionManager, requests: &AtomicU32) -> bool {
    let Some(max) = hcm.limits.max_requests_per_connection else {
        return false;
    };
    let n = requests.fetch_add(1, Ordering::Relaxed).saturating_add(1);
    if n == max {
        hcm.stats.downstream_cx_max_requests_reached.inc();
    }
    n >= max
}

/// Envoy's header checks on a request as it arrived: the local reply that refuses it,
/// or `None` (headers with underscores dropped if so configured).
pub fn check_request(
    hcm: &HttpConnectionManager,
    version: Version,
    headers: &mut HeaderMap,
) -> Option<LocalReply> {
    let limits = &hcm.limits;
    // Envoy's HTTP/1 codec counts each header's name and value.
    let size: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len())
        .sum();
    if size > limits.max_request_headers_bytes || headers.len() > limits.max_headers_count {
        tracing::debug!(
            size,
            count = headers.len(),
            "request headers over the limit"
        );
        return Some(LocalReply::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "Request Header Fields Too Large",
            None,
        ));
    }
    if limits.underscores == Underscores::Allow {
        return None;
    }
    let codec = usize::from(version == Version::HTTP_2);
    let underscored: Vec<_> = headers
        .keys()
        .filter(|name| name.as_str().contains('_'))
        .cloned()
        .collect();
    if underscored.is_empty() {
        return None;
    }
    if limits.underscores == Underscores::Reject {
        hcm.stats.requests_rejected_with_underscores_in_headers[codec].inc();
        return Some(LocalReply::new(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            None,
        ));
    }
    for name in underscored {
        hcm.stats.dropped_headers_with_underscores[codec].inc();
        headers.remove(name);
    }
    None
}

/// The methods Envoy's HTTP/1 codec takes (http-parser's, which its Balsa parser keeps
/// unless `allow_custom_methods`): any other, lowercase ones included, is a 400.
const HTTP1_METHODS: &[&str] = &[
    "ACL",
    "BIND",
    "CHECKOUT",
    "CONNECT",
    "COPY",
    "DELETE",
    "GET",
    "HEAD",
    "LINK",
    "LOCK",
    "M-SEARCH",
    "MERGE",
    "MKACTIVITY",
    "MKCALENDAR",
    "MKCOL",
    "MOVE",
    "NOTIFY",
    "OPTIONS",
    "PATCH",
    "POST",
    "PROPFIND",
    "PROPPATCH",
    "PURGE",
    "PUT",
    "REBIND",
    "REPORT",
    "SEARCH",
    "SOURCE",
    "SUBSCRIBE",
    "TRACE",
    "UNBIND",
    "UNLINK",
    "UNLOCK",
    "UNSUBSCRIBE",
];

/// What Envoy's HTTP/1 codec refuses that hyper's takes, answered as Envoy answers it
/// (the connection closes): a method outside its list (400), HTTP/1.0 unless
/// `accept_http_10` (426), a `transfer-encoding` other than `chunked` (501: a coding
/// shunt would drop).
pub fn check_http1_request(
    hcm: &HttpConnectionManager,
    parts: &Parts,
) -> Option<Response<ResponseBody>> {
    let status = if !matches!(parts.version, Version::HTTP_10 | Version::HTTP_11) {
        return None;
    } else if !HTTP1_METHODS.contains(&parts.method.as_str()) {
        StatusCode::BAD_REQUEST
    } else if parts.version == Version::HTTP_10 && !hcm.limits.accept_http_10 {
        StatusCode::UPGRADE_REQUIRED
    } else if parts
        .headers
        .get_all(hyper::header::TRANSFER_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().eq_ignore_ascii_case(b"chunked"))
    {
        StatusCode::NOT_IMPLEMENTED
    } else {
        return None;
    };
    hcm.stats.downstream_cx_protocol_error.inc();
    tracing::debug!(method = %parts.method, version = ?parts.version, %status, "HTTP/1 request refused by the codec's rules");
    let reason = status.canonical_reason().unwrap_or_default();
    let mut response = LocalReply::new(status, reason, None).response();
    response.headers_mut().insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    Some(response.map(ResponseBody::full))
}
