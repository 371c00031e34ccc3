//! An `http_connection_manager` network filter as compiled: codecs, where its routes come
//! from (inline, or RDS by name from the current snapshot), its response header
//! settings, access logs and `http.<stat_prefix>.*` stats. Immutable; held by the
//! listener's filter chain.

use std::sync::Arc;

use super::route::RouteConfig;
use crate::access_log::Sink;
use crate::stats::{Counter, Store};

/// Envoy's `codec_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// HTTP/2 when the connection starts with its prior-knowledge preface, else HTTP/1.
    Auto,
    Http1,
    Http2,
}

#[derive(Debug)]
pub enum RouteSource {
    /// `route_config`, compiled with the listener.
    Static(Arc<RouteConfig>),
    /// `rds.route_config_name`: looked up per request in the current snapshot, so an
    /// RDS update applies to the next request of a live connection.
    Rds(String),
}

/// Envoy's `server_header_transformation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerHeader {
    Overwrite,
    AppendIfAbsent,
    PassThrough,
}

/// Envoy's `strip_matching_host_port` / `strip_any_host_port`: whether the Host's port
/// is removed before routing (and so also upstream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StripHostPort {
    /// Keep it: a port no domain names picks the `*` virtual host.
    #[default]
    Keep,
    /// Remove it when it is the listener's port.
    Matching,
    /// Remove any port.
    Any,
}

#[derive(Debug)]
pub struct HttpConnectionManager {
    pub stat_prefix: String,
    pub codec: Codec,
    pub routes: RouteSource,
    /// The `server` header's value (`server_name`, default `envoy`).
    pub server_name: hyper::header::HeaderValue,
    pub server_header: ServerHeader,
    /// Append the downstream address to `x-forwarded-for` (Envoy's `use_remote_address`).
    pub use_remote_address: bool,
    pub strip_host_port: StripHostPort,
    pub generate_request_id: bool,
    /// The `upgrade_configs` types enabled (lowercase, `websocket`): other upgrade
    /// requests get a 403, as in Envoy (except `h2c`, which is ignored: served over
    /// HTTP/1.1 without its upgrade headers).
    pub upgrades: Vec<String>,
    /// The router's `suppress_envoy_headers`: no `x-envoy-upstream-service-time`.
    pub suppress_envoy_headers: bool,
    pub access_log: Vec<Sink>,
    pub stats: HttpStats,
}

/// The filter's `http.<stat_prefix>.*` stats.
#[derive(Debug, Clone, Default)]
pub struct HttpStats {
    pub downstream_cx_total: Counter,
    pub downstream_rq_total: Counter,
    /// `downstream_rq_1xx` .. `downstream_rq_5xx` at index 0 .. 4.
    pub downstream_rq_class: [Counter; 5],
    /// Requests no route matched (404, flag NR).
    pub no_route: Counter,
    /// Requests whose route names a cluster that does not exist (flag NC).
    pub no_cluster: Counter,
    pub rq_direct_response: Counter,
    pub rq_redirect: Counter,
}

impl HttpStats {
    pub fn new(store: &Store, stat_prefix: &str) -> Self {
        let counter = |stat: &str| store.counter(&format!("http.{stat_prefix}.{stat}"));
        HttpStats {
            downstream_cx_total: counter("downstream_cx_total"),
            downstream_rq_total: counter("downstream_rq_total"),
            downstream_rq_class: ["1xx", "2xx", "3xx", "4xx", "5xx"]
                .map(|class| counter(&format!("downstream_rq_{class}"))),
            no_route: counter("no_route"),
            no_cluster: counter("no_cluster"),
            rq_direct_response: counter("rq_direct_response"),
            rq_redirect: counter("rq_redirect"),
        }
    }
}

/// The counter of a status class (`[1xx, 2xx, 3xx, 4xx, 5xx]`), if the status is in one.
pub fn class_counter(counters: &[Counter; 5], status: u16) -> Option<&Counter> {
    counters.get(usize::from(status / 100).checked_sub(1)?)
}
