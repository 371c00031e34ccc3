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
