//! A cluster's stats by their Envoy names (`cluster.<observability name>.<stat>`), as
//! handles into the admin API's [`Store`]: created once when the cluster is compiled,
//! then each update is one relaxed atomic operation on the data path.
//!
//! A cluster compiled without a store (tests, `--mode validate`) gets handles that belong
//! to no store: they count, and nobody reads them.

use std::sync::{Arc, OnceLock};

use crate::stats::{self, Counter, Gauge, Histogram, Store};

/// `upstream_rq_<code>` (`upstream_rq_200`, ...), each made in the store the first
/// time a response has that code, then kept.
#[derive(Debug, Default)]
pub struct CodeCounters {
    /// The store and the cluster's observability name; `None`: counts go nowhere.
    store: Option<(Store, String)>,
    /// Codes 100 to 599.
    by_code: Vec<OnceLock<Counter>>,
}

impl CodeCounters {
    fn new(store: &Store, name: &str) -> Self {
        CodeCounters {
            store: Some((store.clone(), name.to_owned())),
            by_code: (100..600).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Counts one response with `code`.
    pub fn inc(&self, code: u16) {
        let (Some((store, name)), Some(slot)) = (
            &self.store,
            self.by_code.get(usize::from(code).wrapping_sub(100)),
        ) else {
            return;
        };
        slot.get_or_init(|| {
            store.counter(&stats::cluster_stat(name, &format!("upstream_rq_{code}")))
        })
        .inc();
    }
}

#[derive(Debug, Clone, Default)]
pub struct ClusterStats {
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
    /// Hosts in the cluster, and those of them that are healthy.
    pub membership_total: Gauge,
    pub membership_healthy: Gauge,
    /// HTTP requests sent to the cluster (each retry counts), and their responses by
    /// status class: `upstream_rq_1xx` .. `upstream_rq_5xx` at index 0 .. 4.
    pub upstream_rq_total: Counter,
    pub upstream_rq_class: [Counter; 5],
    /// HTTP responses by code (`upstream_rq_200`).
    pub upstream_rq_code: Arc<CodeCounters>,
    /// HTTP requests that got a response, and how long it took to its head.
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
    pub ssl: crate::tls::SslStats,
}

impl ClusterStats {
    /// The stats of the cluster whose observability name (`alt_stat_name`, else its
    /// name) is `name`, in `store`.
    pub fn new(store: &Store, name: &str) -> Self {
        let counter = |stat: &str| store.counter(&stats::cluster_stat(name, stat));
        let gauge = |stat: &str| store.gauge(&stats::cluster_stat(name, stat));
        ClusterStats {
            upstream_cx_total: counter("upstream_cx_total"),
            upstream_cx_active: gauge("upstream_cx_active"),
            upstream_cx_connect_fail: counter("upstream_cx_connect_fail"),
            upstream_cx_connect_timeout: counter("upstream_cx_connect_timeout"),
            upstream_cx_overflow: counter("upstream_cx_overflow"),
            upstream_cx_none_healthy: counter("upstream_cx_none_healthy"),
            upstream_cx_connect_ms: store
                .histogram(&stats::cluster_stat(name, "upstream_cx_connect_ms")),
            upstream_cx_length_ms: store
                .histogram(&stats::cluster_stat(name, "upstream_cx_length_ms")),
            upstream_cx_tx_bytes_total: counter("upstream_cx_tx_bytes_total"),
            upstream_cx_rx_bytes_total: counter("upstream_cx_rx_bytes_total"),
            membership_total: gauge("membership_total"),
            membership_healthy: gauge("membership_healthy"),
            upstream_rq_total: counter("upstream_rq_total"),
            upstream_rq_class: ["1xx", "2xx", "3xx", "4xx", "5xx"]
                .map(|class| counter(&format!("upstream_rq_{class}"))),
            upstream_rq_code: Arc::new(CodeCounters::new(store, name)),
            upstream_rq_completed: counter("upstream_rq_completed"),
            upstream_rq_time: store.histogram(&stats::cluster_stat(name, "upstream_rq_time")),
            upstream_cx_http1_total: counter("upstream_cx_http1_total"),
            upstream_cx_http2_total: counter("upstream_cx_http2_total"),
            upstream_rq_timeout: counter("upstream_rq_timeout"),
            upstream_rq_retry: counter("upstream_rq_retry"),
            ssl: crate::tls::SslStats::new(store, &format!("cluster.{name}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Stat;

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
}
