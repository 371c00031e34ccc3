//! An `http_connection_manager` network filter as compiled: codecs, where its routes come
//! from (inline, or RDS by name from the current snapshot), its response header
//! settings, access logs and `http.<stat_prefix>.*` stats. Immutable; held by the
//! listener's filter chain.

use std::sync::Arc;

use super::route::RouteConfig;
use shunt_core::access_log::Sink;
use shunt_core::stats::{Counter, Gauge, Store};

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
    /// `normalize_path`, `merge_slashes`, `path_with_escaped_slashes_action`.
    pub path_normalization: super::path_normalization::PathNormalization,
    /// The HTTP filters before the router.
    pub filters: super::filter::chain::FilterChain,
    pub access_log: Vec<Sink>,
    /// `tracing`: the request's span and trace context, when configured.
    pub tracing: Option<Arc<crate::tracers::HttpTracing>>,
    pub limits: Limits,
    pub stats: HttpStats,
}

impl HttpConnectionManager {
    /// Whether the HTTP/1.1 wire sizes of a request's and its response's heads are
    /// measured: only the HTTP filters read them (Istio's request and response bytes).
    pub fn measures_wire_sizes(&self) -> bool {
        !self.filters.is_empty()
    }
}

/// Envoy's `headers_with_underscores_action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Underscores {
    Allow,
    /// 400, stat `http1.requests_rejected_with_underscores_in_headers`.
    Reject,
    /// The header is removed, stat `http1.dropped_headers_with_underscores`.
    Drop,
}

/// What a downstream may send, with Envoy's defaults.
#[derive(Debug, Clone)]
pub struct Limits {
    /// `max_request_headers_kb` (60) in bytes: the sum of the header names' and values'
    /// lengths, as Envoy counts it; more gets a 431.
    pub max_request_headers_bytes: usize,
    /// `common_http_protocol_options.max_headers_count` (100); more gets a 431.
    pub max_headers_count: usize,
    pub underscores: Underscores,
    /// `request_headers_timeout` (none): the connection closes if a request's headers do
    /// not arrive in time (`downstream_rq_header_timeout`).
    pub request_headers_timeout: Option<std::time::Duration>,
    /// `common_http_protocol_options.max_requests_per_connection` (none): the response
    /// to the last one closes the connection (`downstream_cx_max_requests_reached`).
    pub max_requests_per_connection: Option<u32>,
    /// The per-stream timers (`stream_idle_timeout`, `request_timeout`,
    /// `common_http_protocol_options.max_stream_duration`).
    pub stream: StreamTimeouts,
    /// `common_http_protocol_options.max_connection_duration` (none): the connection
    /// drains once it is this old (`downstream_cx_max_duration_reached`).
    pub max_connection_duration: Option<std::time::Duration>,
    /// `delayed_close_timeout` (1 s): how long a connection shunt closes keeps reading
    /// (and discarding) after its last response, so that unread request bytes do not
    /// turn the close into a reset that loses the response. `None` closes at once.
    pub delayed_close_timeout: Option<std::time::Duration>,
    /// `http_protocol_options.accept_http_10` (false): an HTTP/1.0 request gets a 426.
    pub accept_http_10: bool,
    /// `http2_protocol_options`: what shunt's HTTP/2 server advertises.
    pub http2: Http2Settings,
}

/// The HCM's `http2_protocol_options` shunt honours, Envoy's defaults where unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Http2Settings {
    /// `max_concurrent_streams` (Envoy's default 2147483647: no practical limit).
    pub max_concurrent_streams: u32,
    /// `initial_stream_window_size`; unset keeps the codec's 1 MiB (Envoy: 256 MiB),
    /// which bounds what a stream that stops reading can hold.
    pub initial_stream_window_size: Option<u32>,
    /// `initial_connection_window_size`; unset keeps the codec's 1 MiB.
    pub initial_connection_window_size: Option<u32>,
}

impl Default for Http2Settings {
    fn default() -> Self {
        Http2Settings {
            max_concurrent_streams: 2_147_483_647,
            initial_stream_window_size: None,
            initial_connection_window_size: None,
        }
    }
}

/// A stream's timers, `None` when disabled (Envoy's 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamTimeouts {
    /// `stream_idle_timeout` (5 minutes): no byte either way for this long ends the
    /// stream (`downstream_rq_idle_timeout`, flag SI).
    pub idle: Option<std::time::Duration>,
    /// `request_timeout` (none): the whole request must arrive within it, unless the
    /// response started first (`downstream_rq_timeout`).
    pub request: Option<std::time::Duration>,
    /// `max_stream_duration` (none): a stream this old is ended
    /// (`downstream_rq_max_duration_reached`).
    pub max_duration: Option<std::time::Duration>,
}

impl Default for StreamTimeouts {
    fn default() -> Self {
        StreamTimeouts {
            idle: Some(std::time::Duration::from_secs(300)),
            request: None,
            max_duration: None,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_request_headers_bytes: 60 * 1024,
            max_headers_count: 100,
            underscores: Underscores::Allow,
            request_headers_timeout: None,
            max_requests_per_connection: None,
            stream: StreamTimeouts::default(),
            max_connection_duration: None,
            delayed_close_timeout: Some(std::time::Duration::from_secs(1)),
            accept_http_10: false,
            http2: Http2Settings::default(),
        }
    }
}

/// The filter's `http.<stat_prefix>.*` stats.
#[derive(Debug, Clone, Default)]
pub struct HttpStats {
    pub downstream_cx_total: Counter,
    pub downstream_cx_active: Gauge,
    /// Connections by the protocol they turned out to speak (known at their first
    /// request under `codec_type: AUTO`): HTTP/1 at index 0, HTTP/2 at 1.
    pub downstream_cx_protocol_total: [Counter; 2],
    pub downstream_cx_protocol_active: [Gauge; 2],
    pub downstream_rq_total: Counter,
    /// Requests by protocol: HTTP/1 at index 0, HTTP/2 at 1.
    pub downstream_rq_protocol_total: [Counter; 2],
    /// Requests being handled (to their response head).
    pub downstream_rq_active: Gauge,
    /// Requests answered (by the upstream or a local reply).
    pub downstream_rq_completed: Counter,
    /// `downstream_rq_1xx` .. `downstream_rq_5xx` at index 0 .. 4.
    pub downstream_rq_class: [Counter; 5],
    /// Requests no route matched (404, flag NR).
    pub no_route: Counter,
    /// Requests whose route names a cluster that does not exist (flag NC).
    pub no_cluster: Counter,
    pub rq_direct_response: Counter,
    pub rq_redirect: Counter,
    /// Requests refused (400) or redirected (307) by path normalization.
    pub downstream_rq_failed_path_normalization: Counter,
    pub downstream_rq_redirected_with_normalized_path: Counter,
    /// Connections closed because a request's headers did not arrive in time.
    pub downstream_rq_header_timeout: Counter,
    /// Connections closed after `max_requests_per_connection` requests.
    pub downstream_cx_max_requests_reached: Counter,
    /// Connections drained after `max_connection_duration`.
    pub downstream_cx_max_duration_reached: Counter,
    /// Streams ended by `stream_idle_timeout`, `request_timeout`, `max_stream_duration`.
    pub downstream_rq_idle_timeout: Counter,
    pub downstream_rq_timeout: Counter,
    pub downstream_rq_max_duration_reached: Counter,
    /// Upgrades (WebSocket, terminated CONNECT) tunnelled, and those open now.
    pub downstream_cx_upgrades_total: Counter,
    pub downstream_cx_upgrades_active: Gauge,
    /// The codecs' (not prefixed) `http1.*` / `http2.*` underscore counters, at index
    /// 0 for HTTP/1, 1 for HTTP/2.
    pub requests_rejected_with_underscores_in_headers: [Counter; 2],
    pub dropped_headers_with_underscores: [Counter; 2],
    /// Bytes read from and written to downstream connections, as they move.
    pub downstream_cx_rx_bytes_total: Counter,
    pub downstream_cx_tx_bytes_total: Counter,
    /// Connections that broke HTTP (hyper's parse errors, the codec rules' refusals).
    pub downstream_cx_protocol_error: Counter,
    /// Streams the downstream reset (HTTP/2 RST_STREAM, or the connection went) before
    /// their response was sent, and those shunt reset.
    pub downstream_rq_rx_reset: Counter,
    pub downstream_rq_tx_reset: Counter,
    /// `listener.<listener>.http.<stat_prefix>.*` of the listener the filter is in.
    pub listener: ListenerHttpStats,
    /// Holds `http.<stat_prefix>.*` in the store while a connection manager uses it.
    pub scope: Option<std::sync::Arc<shunt_core::stats::ScopeGuard>>,
}

/// One upgraded stream counted in `downstream_cx_upgrades_active`.
#[derive(Debug)]
pub struct UpgradeGuard(Gauge);

impl Drop for UpgradeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Envoy's per-listener connection manager stats (`ALL_HTTP_CONN_MAN_LISTENER_STATS`),
/// `listener.<listener>.http.<stat_prefix>.*`; not in a listener: counts go nowhere.
#[derive(Debug, Clone, Default)]
pub struct ListenerHttpStats {
    /// `downstream_rq_1xx` .. `downstream_rq_5xx` at index 0 .. 4.
    pub downstream_rq_class: [Counter; 5],
    pub downstream_rq_completed: Counter,
}

impl ListenerHttpStats {
    /// The stats of the filter with `stat_prefix` in the listener whose stat names start
    /// `listener.<listener_prefix>`.
    pub fn new(store: &Store, listener_prefix: &str, stat_prefix: &str) -> Self {
        let counter = |stat: &str| {
            store.counter(&format!(
                "listener.{listener_prefix}.http.{stat_prefix}.{stat}"
            ))
        };
        ListenerHttpStats {
            downstream_rq_class: ["1xx", "2xx", "3xx", "4xx", "5xx"]
                .map(|class| counter(&format!("downstream_rq_{class}"))),
            downstream_rq_completed: counter("downstream_rq_completed"),
        }
    }
}

impl HttpStats {
    pub fn new(store: &Store, stat_prefix: &str) -> Self {
        let counter = |stat: &str| store.counter(&format!("http.{stat_prefix}.{stat}"));
        let gauge = |stat: &str| store.gauge(&format!("http.{stat_prefix}.{stat}"));
        HttpStats {
            downstream_cx_total: counter("downstream_cx_total"),
            downstream_cx_active: gauge("downstream_cx_active"),
            downstream_cx_protocol_total: ["http1", "http2"]
                .map(|p| counter(&format!("downstream_cx_{p}_total"))),
            downstream_cx_protocol_active: ["http1", "http2"]
                .map(|p| gauge(&format!("downstream_cx_{p}_active"))),
            downstream_rq_total: counter("downstream_rq_total"),
            downstream_rq_protocol_total: ["http1", "http2"]
                .map(|p| counter(&format!("downstream_rq_{p}_total"))),
            downstream_rq_active: gauge("downstream_rq_active"),
            downstream_rq_completed: counter("downstream_rq_completed"),
            downstream_rq_class: ["1xx", "2xx", "3xx", "4xx", "5xx"]
                .map(|class| counter(&format!("downstream_rq_{class}"))),
            no_route: counter("no_route"),
            no_cluster: counter("no_cluster"),
            rq_direct_response: counter("rq_direct_response"),
            rq_redirect: counter("rq_redirect"),
            downstream_rq_failed_path_normalization: counter(
                "downstream_rq_failed_path_normalization",
            ),
            downstream_rq_redirected_with_normalized_path: counter(
                "downstream_rq_redirected_with_normalized_path",
            ),
            downstream_rq_header_timeout: counter("downstream_rq_header_timeout"),
            downstream_cx_max_requests_reached: counter("downstream_cx_max_requests_reached"),
            downstream_cx_max_duration_reached: counter("downstream_cx_max_duration_reached"),
            downstream_rq_idle_timeout: counter("downstream_rq_idle_timeout"),
            downstream_rq_timeout: counter("downstream_rq_timeout"),
            downstream_rq_max_duration_reached: counter("downstream_rq_max_duration_reached"),
            downstream_cx_upgrades_total: counter("downstream_cx_upgrades_total"),
            downstream_cx_upgrades_active: gauge("downstream_cx_upgrades_active"),
            requests_rejected_with_underscores_in_headers: ["http1", "http2"].map(|codec| {
                store.counter(&format!(
                    "{codec}.requests_rejected_with_underscores_in_headers"
                ))
            }),
            dropped_headers_with_underscores: ["http1", "http2"]
                .map(|codec| store.counter(&format!("{codec}.dropped_headers_with_underscores"))),
            downstream_cx_rx_bytes_total: counter("downstream_cx_rx_bytes_total"),
            downstream_cx_tx_bytes_total: counter("downstream_cx_tx_bytes_total"),
            downstream_cx_protocol_error: counter("downstream_cx_protocol_error"),
            downstream_rq_rx_reset: counter("downstream_rq_rx_reset"),
            downstream_rq_tx_reset: counter("downstream_rq_tx_reset"),
            listener: ListenerHttpStats::default(),
            scope: Some(std::sync::Arc::new(
                store.scope(&format!("http.{stat_prefix}.")),
            )),
        }
    }
}

impl HttpStats {
    /// Counts an upgrade that opened (`downstream_cx_upgrades_total`), active until the
    /// guard drops.
    pub fn upgrade(&self) -> UpgradeGuard {
        self.downstream_cx_upgrades_total.inc();
        self.downstream_cx_upgrades_active.inc();
        UpgradeGuard(self.downstream_cx_upgrades_active.clone())
    }

    /// Counts a downstream connection (`downstream_cx_total`, `downstream_cx_active`):
    /// the guard keeps it active, and counts its protocol once its first request shows it.
    pub fn connection(&self) -> DownstreamConnection {
        self.downstream_cx_total.inc();
        self.downstream_cx_active.inc();
        DownstreamConnection {
            stats: self.clone(),
            protocol: std::sync::OnceLock::new(),
        }
    }

    /// Counts a response sent downstream: `downstream_rq_completed` and
    /// `downstream_rq_<class>`, the filter's and its listener's.
    pub fn response(&self, status: u16) {
        self.downstream_rq_completed.inc();
        self.listener.downstream_rq_completed.inc();
        for classes in [
            &self.downstream_rq_class,
            &self.listener.downstream_rq_class,
        ] {
            if let Some(counter) = class_counter(classes, status) {
                counter.inc();
            }
        }
    }

    /// Counts a request (`downstream_rq_total`, by protocol, active while the guard lives).
    pub fn request(&self, version: hyper::Version) -> DownstreamRequest {
        self.downstream_rq_total.inc();
        self.downstream_rq_protocol_total[protocol_index(version)].inc();
        self.downstream_rq_active.inc();
        DownstreamRequest(self.downstream_rq_active.clone())
    }
}

/// HTTP/1 at 0, HTTP/2 at 1.
fn protocol_index(version: hyper::Version) -> usize {
    usize::from(version == hyper::Version::HTTP_2)
}

/// A downstream connection counted in `downstream_cx_active` (and its protocol's
/// `_active`) until dropped.
#[derive(Debug)]
pub struct DownstreamConnection {
    stats: HttpStats,
    protocol: std::sync::OnceLock<usize>,
}

impl DownstreamConnection {
    /// A request of `version` arrived on the connection: the first one counts the
    /// connection's protocol (`downstream_cx_http1_total`, ...).
    pub fn saw(&self, version: hyper::Version) {
        self.protocol.get_or_init(|| {
            let index = protocol_index(version);
            self.stats.downstream_cx_protocol_total[index].inc();
            self.stats.downstream_cx_protocol_active[index].inc();
            index
        });
    }
}

impl Drop for DownstreamConnection {
    fn drop(&mut self) {
        self.stats.downstream_cx_active.dec();
        if let Some(&index) = self.protocol.get() {
            self.stats.downstream_cx_protocol_active[index].dec();
        }
    }
}

/// A request counted in `downstream_rq_active` until dropped.
#[derive(Debug)]
pub struct DownstreamRequest(Gauge);

impl Drop for DownstreamRequest {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The counter of a status class (`[1xx, 2xx, 3xx, 4xx, 5xx]`), if the status is in one.
pub fn class_counter(counters: &[Counter; 5], status: u16) -> Option<&Counter> {
    counters.get(usize::from(status / 100).checked_sub(1)?)
}
