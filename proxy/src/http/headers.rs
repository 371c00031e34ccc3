//! Header names shunt adds or reads per request, as in Envoy's `Http::Headers`. They
//! are constants: `HeaderName::from_static` outside a const context validates its name
//! on every call (about 180 instructions each, per `callgrind`).

use hyper::header::HeaderName;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const ENVOY_ORIGINAL_PATH: HeaderName = HeaderName::from_static("x-envoy-original-path");
pub const ENVOY_UPSTREAM_SERVICE_TIME: HeaderName =
    HeaderName::from_static("x-envoy-upstream-service-time");
pub const ENVOY_EXPECTED_RQ_TIMEOUT_MS: HeaderName =
    HeaderName::from_static("x-envoy-expected-rq-timeout-ms");
pub const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
pub const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
pub const HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

/// The credentials in `headers`, marked to be sent as never-indexed HPACK literals
/// (RFC 7541 7.1.3), as nghttp2 sends them (Envoy's HTTP/2 codec for most of its
/// life): `authorization`, `proxy-authorization`, and a `cookie` under 20 bytes, which
/// is short enough to guess. A field in a connection's dynamic table can be recovered
/// by a compression oracle (CRIME). h2 keeps `authorization` and `cookie` out of its
/// own table, but as literals *without* indexing, which a proxy after us may index,
/// and it indexes `proxy-authorization`. Its decoder does not keep the never-indexed
/// mark a field arrived with, so an HTTP/2 downstream's marks are set again here.
pub fn never_index_credentials(headers: &mut hyper::HeaderMap) {
    use hyper::header::{AUTHORIZATION, COOKIE, Entry, PROXY_AUTHORIZATION};
    for name in [AUTHORIZATION, PROXY_AUTHORIZATION, COOKIE] {
        let short_only = name == COOKIE;
        if let Entry::Occupied(mut values) = headers.entry(name) {
            for value in values.iter_mut() {
                if !short_only || value.len() < 20 {
                    value.set_sensitive(true);
                }
            }
        }
    }
}
