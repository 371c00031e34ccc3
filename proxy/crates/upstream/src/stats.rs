//! A cluster's stats by their Envoy names (`cluster.<observability name>.<stat>`), as
//! handles into the admin API's [`Store`]: created once when the cluster is compiled,
//! then each update is one relaxed atomic operation on the data path.
//!
//! A cluster compiled without a store (tests, `--mode validate`) gets handles that belong
//! to no store: they count, and nobody reads them.

use std::sync::{Arc, OnceLock};

use shunt_core::stats::{self, Counter, Gauge, Histogram, Kind, Store};

/// `upstream_rq_<code>` (`upstream_rq_200`, ...) and `upstream_rq_<class>`
/// (`upstream_rq_2xx`, ...), each made in the store the first time a response has that
/// code or class, then kept: Envoy's code stats exist once charged, never at zero.
///
/// The slots of a class's 100 codes are allocated when the class is first charged:
/// most clusters never see a response, and 500 empty slots per cluster were 8 KiB of
/// every service's memory.
#[derive(Debug, Default)]
pub struct CodeCounters {
    /// The store and the cluster's observability name; `None`: counts go nowhere.
    store: Option<(Store, Arc<str>)>,
    /// Classes 1xx to 5xx: the class's counter, and its codes' (`x00` to `x99`).
    by_class: [OnceLock<ClassCounters>; 5],
}

/// One class's counter and the slots of its codes.
#[derive(Debug)]
struct ClassCounters {
    class: Counter,
    codes: Box<[OnceLock<Counter>; 100]>,
}

impl CodeCounters {
    fn new(store: &Store, name: Arc<str>) -> Self {
        CodeCounters {
            store: Some((store.clone(), name)),
            by_class: Default::default(),
        }
    }

    /// Counts one response with `code`, by code and by class.
    pub fn inc(&self, code: u16) {
        let Some((store, name)) = &self.store else {
            return;
        };
        if !(100..600).contains(&code) {
            return;
        }
        let class = code / 100;
        let counters = self.by_class[usize::from(class - 1)].get_or_init(|| ClassCounters {
            class: store.counter(&stats::cluster_stat(
                name,
                &format!("upstream_rq_{class}xx"),
            )),
            codes: Box::new(std::array::from_fn(|_| OnceLock::new())),
        });
        counters.codes[usize::from(code % 100)]
            .get_or_init(|| {
                store.counter(&stats::cluster_stat(name, &format!("upstream_rq_{code}")))
            })
            .inc();
        counters.class.inc();
    }
}

/// Every stat a cluster has from the start, under `cluster.<name>.`, as one block of
/// the store (see `shunt_core::stats`): thirty names a cluster would otherwise keep
/// one entry each of.
pub const STATS: stats::BlockSpec = &[
    ("membership_healthy", Kind::Gauge),
    ("membership_total", Kind::Gauge),
    ("ssl.connection_error", Kind::Counter),
    ("ssl.handshake", Kind::Counter),
    ("upstream_cx_active", Kind::Gauge),
    ("upstream_cx_connect_fail", Kind::Counter),
    ("upstream_cx_connect_ms", Kind::Histogram),
    ("upstream_cx_connect_timeout", Kind::Counter),
    ("upstream_cx_destroy_remote", Kind::Counter),
    ("upstream_cx_http1_total", Kind::Counter),
    ("upstream_cx_http2_total", Kind::Counter),
    ("upstream_cx_length_ms", Kind::Histogram),
    ("upstream_cx_none_healthy", Kind::Counter),
    ("upstream_cx_overflow", Kind::Counter),
    ("upstream_cx_protocol_error", Kind::Counter),
    ("upstream_cx_rx_bytes_total", Kind::Counter),
    ("upstream_cx_total", Kind::Counter),
    ("upstream_cx_tx_bytes_total", Kind::Counter),
    ("upstream_rq_active", Kind::Gauge),
    ("upstream_rq_completed", Kind::Counter),
    ("upstream_rq_pending_failure_eject", Kind::Counter),
    ("upstream_rq_pending_total", Kind::Counter),
    ("upstream_rq_retry", Kind::Counter),
    ("upstream_rq_time", Kind::Histogram),
    ("upstream_rq_timeout", Kind::Counter),
    ("upstream_rq_total", Kind::Counter),
];

#[derive(Debug, Clone, Default)]
pub struct ClusterStats {
    /// The observability name the stats are under (`cluster.<name>.`): `alt_stat_name`,
    /// else the cluster's name. Filters that count under the cluster (grpc_stats) use it.
    pub observability_name: Arc<str>,
    /// Upstream connections opened (attempted), successful or not.
    pub upstream_cx_total: Counter,
    /// Upstream connections open now (connecting or connected).
    pub upstream_cx_active: Gauge,
    /// Connect attempts that failed, timeouts included.
    pub upstream_cx_connect_fail: Counter,
    /// Connect attempts that ran out of `connect_timeout`.
    pub upstream_cx_connect_timeout: Counter,
    /// Connections refused because the circuit breaker's `max_connections` was reached.
    pub upstream_cx_overflow: Counter,
    /// Connections for which load balancing found no host (flag UH).
    pub upstream_cx_none_healthy: Counter,
    /// How long successful connects took.
    pub upstream_cx_connect_ms: Histogram,
    /// How long upstream connections lasted, from connect to close.
    pub upstream_cx_length_ms: Histogram,
    /// Bytes written to and read from the cluster's hosts, added as each connection ends.
    pub upstream_cx_tx_bytes_total: Counter,
    pub upstream_cx_rx_bytes_total: Counter,
    /// Connections the upstream closed (Envoy's `upstream_cx_destroy_remote`).
    pub upstream_cx_destroy_remote: Counter,
    /// Responses that broke HTTP (a malformed or cut-off head; flag UPE).
    pub upstream_cx_protocol_error: Counter,
    /// Hosts in the cluster, and those of them that are healthy.
    pub membership_total: Gauge,
    pub membership_healthy: Gauge,
    /// HTTP requests sent to the cluster (each retry counts).
    pub upstream_rq_total: Counter,
    /// HTTP requests on their way to the cluster or waiting for its response head.
    pub upstream_rq_active: Gauge,
    /// HTTP requests that waited for a connection to be made (none was free).
    pub upstream_rq_pending_total: Counter,
    /// HTTP requests that waited for a connection whose connect failed.
    pub upstream_rq_pending_failure_eject: Counter,
    /// HTTP responses by code (`upstream_rq_200`) and class (`upstream_rq_2xx`): the
    /// upstream's, and the router's own replies for the cluster (503 no healthy
    /// upstream, connect failure, overflow, reset; 504 timeout), as Envoy charges them.
    pub upstream_rq_code: Arc<CodeCounters>,
    /// HTTP requests answered (by the upstream or the router, as above); how long the
    /// upstream took to a response head.
    pub upstream_rq_completed: Counter,
    pub upstream_rq_time: Histogram,
    /// Upstream HTTP connections by protocol.
    pub upstream_cx_http1_total: Counter,
    pub upstream_cx_http2_total: Counter,
    /// HTTP requests that got no response within the route's timeout.
    pub upstream_rq_timeout: Counter,
    /// HTTP requests sent again under a route's retry policy.
    pub upstream_rq_retry: Counter,
    /// `ssl.handshake` / `ssl.connection_error` of upstream TLS.
    pub ssl: shunt_tls::SslStats,
    /// Holds `cluster.<name>.*` in the store while the cluster is in use.
    pub scope: Option<std::sync::Arc<stats::ScopeGuard>>,
}

impl ClusterStats {
    /// The stats of the cluster whose observability name (`alt_stat_name`, else its
    /// name) is `name`, in `store`: one block of [`STATS`] under `cluster.<name>.`.
    pub fn new(store: &Store, name: &str) -> Self {
        let observability_name: Arc<str> = name.into();
        let prefix = format!("cluster.{name}.");
        // The guard first: the block goes with the last one.
        let scope = Arc::new(store.scope(&prefix));
        let block = store.block(&prefix, STATS);
        let counter = |stat: &str| block.counter(stat);
        let gauge = |stat: &str| block.gauge(stat);
        ClusterStats {
            observability_name: observability_name.clone(),
            upstream_cx_total: counter("upstream_cx_total"),
            upstream_cx_active: gauge("upstream_cx_active"),
            upstream_cx_connect_fail: counter("upstream_cx_connect_fail"),
            upstream_cx_connect_timeout: counter("upstream_cx_connect_timeout"),
            upstream_cx_overflow: counter("upstream_cx_overflow"),
            upstream_cx_none_healthy: counter("upstream_cx_none_healthy"),
            upstream_cx_connect_ms: block.histogram("upstream_cx_connect_ms"),
            upstream_cx_length_ms: block.histogram("upstream_cx_length_ms"),
            upstream_cx_tx_bytes_total: counter("upstream_cx_tx_bytes_total"),
            upstream_cx_rx_bytes_total: counter("upstream_cx_rx_bytes_total"),
            upstream_cx_destroy_remote: counter("upstream_cx_destroy_remote"),
            upstream_cx_protocol_error: counter("upstream_cx_protocol_error"),
            membership_total: gauge("membership_total"),
            membership_healthy: gauge("membership_healthy"),
            upstream_rq_total: counter("upstream_rq_total"),
            upstream_rq_active: gauge("upstream_rq_active"),
            upstream_rq_pending_total: counter("upstream_rq_pending_total"),
            upstream_rq_pending_failure_eject: counter("upstream_rq_pending_failure_eject"),
            upstream_rq_code: Arc::new(CodeCounters::new(store, observability_name)),
            upstream_rq_completed: counter("upstream_rq_completed"),
            upstream_rq_time: block.histogram("upstream_rq_time"),
            upstream_cx_http1_total: counter("upstream_cx_http1_total"),
            upstream_cx_http2_total: counter("upstream_cx_http2_total"),
            upstream_rq_timeout: counter("upstream_rq_timeout"),
            upstream_rq_retry: counter("upstream_rq_retry"),
            ssl: shunt_tls::SslStats {
                handshake: counter("ssl.handshake"),
                connection_error: counter("ssl.connection_error"),
            },
            scope: Some(scope),
        }
    }

    /// Charges one answer to a request for the cluster, as Envoy's router's
    /// `chargeUpstreamCode`: `upstream_rq_completed`, `upstream_rq_<code>` and
    /// `upstream_rq_<class>`.
    pub fn charge(&self, code: u16) {
        self.upstream_rq_completed.inc();
        self.upstream_rq_code.inc(code);
    }
}

/// Counts a request active (`upstream_rq_active`) until dropped.
#[derive(Debug)]
pub struct ActiveRequest(Gauge);

impl ActiveRequest {
    pub fn new(stats: &ClusterStats) -> Self {
        stats.upstream_rq_active.inc();
        ActiveRequest(stats.upstream_rq_active.clone())
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shunt_core::stats::Stat;

    #[test]
    fn stats_are_named_after_the_cluster() {
        let store = Store::new();
        let stats = ClusterStats::new(&store, "outbound|8080||b");
        stats.upstream_cx_total.inc();
        stats.upstream_cx_active.inc();
        let snapshot = store.snapshot();
        assert!(snapshot.contains(&Stat::counter(
            "cluster.outbound|8080||b.upstream_cx_total",
            1
        )));
        assert!(snapshot.contains(&Stat::gauge(
            "cluster.outbound|8080||b.upstream_cx_active",
            1
        )));
    }

    #[test]
    fn code_stats_exist_once_charged() {
        let store = Store::new();
        let stats = ClusterStats::new(&store, "c");
        stats.charge(200);
        stats.charge(200);
        stats.charge(503);
        stats.charge(99);
        stats.charge(600);
        let snapshot = store.snapshot();
        for (name, value) in [
            ("cluster.c.upstream_rq_200", 2),
            ("cluster.c.upstream_rq_2xx", 2),
            ("cluster.c.upstream_rq_503", 1),
            ("cluster.c.upstream_rq_5xx", 1),
            ("cluster.c.upstream_rq_completed", 5),
        ] {
            assert!(
                snapshot.contains(&Stat::counter(name, value)),
                "{name} = {value}"
            );
        }
        let codes: Vec<&str> = snapshot
            .iter()
            .map(|s| s.name.as_str())
            .filter(|n| {
                n.starts_with("cluster.c.upstream_rq_") && n.as_bytes()[22].is_ascii_digit()
            })
            .collect();
        assert_eq!(
            codes,
            [
                "cluster.c.upstream_rq_200",
                "cluster.c.upstream_rq_2xx",
                "cluster.c.upstream_rq_503",
                "cluster.c.upstream_rq_5xx"
            ]
        );
    }

    #[test]
    fn a_recompiled_cluster_keeps_counting_where_it_was() {
        let store = Store::new();
        let first = ClusterStats::new(&store, "c");
        first.upstream_cx_total.inc();
        // An update compiles the cluster again while the old one still serves.
        let second = ClusterStats::new(&store, "c");
        second.upstream_cx_total.inc();
        drop(first);
        assert!(
            store
                .snapshot()
                .contains(&Stat::counter("cluster.c.upstream_cx_total", 2))
        );
    }
}
