//! A cluster (Envoy's `Cluster`): a named set of upstream hosts, how they are found
//! ([`Discovery`]), how one is chosen ([`Balancer`]), and the guards around them (circuit
//! breaker, outlier detection, active health checks).
//!
//! The compiled settings are immutable; what changes at run time is the host list (DNS
//! re-resolution) and each host's health. Either change rebuilds [`Members`], the hosts
//! load balancing may use plus the balancer over them, and publishes it with one pointer
//! swap, so choosing a host takes a read lock and an `Arc` clone and never waits for a
//! rebuild.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use super::circuit_breaker::CircuitBreaker;
use super::dns_cluster::{self, DnsTarget, LookupFamily};
use super::health_check::{self, HealthCheck};
use super::host::{self, ActiveConnection, Host};
use super::load_balancer::{Balancer, LbContext, LbPolicy};
use super::outlier::OutlierDetection;
use super::stats::ClusterStats;
use shunt_core::stats::{Counter, Gauge, Histogram};

/// Envoy's default `connect_timeout`.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Envoy's default `dns_refresh_rate`.
pub const DEFAULT_DNS_REFRESH_RATE: Duration = Duration::from_secs(5);
/// Envoy's default `common_lb_config.healthy_panic_threshold`, in percent.
pub const DEFAULT_PANIC_THRESHOLD: f64 = 50.0;

/// How a cluster finds its hosts (Envoy's discovery `type`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// The endpoints in `load_assignment`, as written.
    Static,
    /// Every address of every endpoint's DNS name, re-resolved every `refresh`.
    StrictDns {
        targets: Vec<DnsTarget>,
        refresh: Duration,
        family: LookupFamily,
    },
    /// One host: the first address the name resolves to, re-resolved every `refresh`.
    LogicalDns {
        target: DnsTarget,
        refresh: Duration,
        family: LookupFamily,
    },
    /// Endpoints from EDS; until xDS exists, the bootstrap's `load_assignment`.
    Eds,
    /// No hosts of its own: each connection goes to its original destination.
    OriginalDst,
}

impl Discovery {
    pub fn name(&self) -> &'static str {
        match self {
            Discovery::Static => "STATIC",
            Discovery::StrictDns { .. } => "STRICT_DNS",
            Discovery::LogicalDns { .. } => "LOGICAL_DNS",
            Discovery::Eds => "EDS",
            Discovery::OriginalDst => "ORIGINAL_DST",
        }
    }
}

/// The HTTP version the router speaks to a cluster's hosts (Envoy's upstream
/// `HttpProtocolOptions`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UpstreamProtocol {
    #[default]
    Http1,
    Http2,
    /// The downstream request's version (`use_downstream_protocol_config`).
    UseDownstream,
}

/// Everything a cluster is compiled from.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub name: String,
    pub discovery: Discovery,
    pub lb_policy: LbPolicy,
    pub connect_timeout: Duration,
    /// `upstream_bind_config.source_address`.
    pub source_address: Option<SocketAddr>,
    pub max_connections: u64,
    pub outlier_detection: Option<OutlierDetection>,
    pub health_checks: Vec<HealthCheck>,
    /// Percent of healthy hosts under which all hosts are used anyway; 0 disables.
    pub panic_threshold: f64,
    /// The endpoints' `policy.overprovisioning_factor`, in percent (Envoy's 140).
    pub overprovisioning_factor: u32,
    /// ORIGINAL_DST: how long a destination's host outlives its last connection.
    pub cleanup_interval: Duration,
    /// The digest of the Envoy config this was compiled from (0 when not compiled from
    /// one), to keep the cluster when an update leaves it unchanged.
    pub config_digest: u64,
    /// Where the cluster's `cluster.<name>.*` stats go (`None`: to no store, e.g. a
    /// shared compile, which a pod's cluster gets its own of: no handles allocated).
    pub stats: Option<ClusterStats>,
    pub http_protocol: UpstreamProtocol,
    /// `transport_socket`: TLS to originate on each connection; `None` for raw bytes.
    pub transport_socket: Option<Arc<shunt_tls::UpstreamTls>>,
    /// `transport_socket_matches`: per-endpoint sockets, chosen by endpoint metadata
    /// before `transport_socket`.
    pub transport_socket_matches: Arc<[shunt_tls::transport_socket::SocketMatch]>,
    /// `transport_socket` when it is `internal_upstream`: the metadata it passes.
    pub passthrough: Option<Arc<shunt_tls::internal_upstream::Passthrough>>,
    /// The cluster's `metadata` (for `internal_upstream`'s cluster sources).
    pub metadata: Option<Arc<shunt_core::interned::EncodedMetadata>>,
    /// ORIGINAL_DST's `original_dst_lb_config.upstream_port_override`.
    pub port_override: Option<u16>,
    /// The ALPN protocol of the cluster's upstream metadata exchange filter
    /// (`filters: envoy.filters.network.upstream.metadata_exchange`, Istio's
    /// `istio-peer-exchange`): on a connection that negotiated it, the proxy sends its
    /// node metadata first and reads the peer's.
    pub metadata_exchange: Option<Arc<str>>,
    /// The shared compile this config is a pod's copy of (see
    /// [`super::compile::Prototype`]): held while the pod's cluster is, so that other
    /// pods with the same cluster find it.
    pub prototype: Option<Arc<super::compile::Prototype>>,
}

impl ClusterConfig {
    /// A STATIC, round-robin cluster with Envoy's defaults.
    pub fn new(name: impl Into<String>) -> Self {
        ClusterConfig {
            name: name.into(),
            discovery: Discovery::Static,
            lb_policy: LbPolicy::RoundRobin,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            source_address: None,
            max_connections: super::circuit_breaker::DEFAULT_MAX_CONNECTIONS,
            outlier_detection: None,
            health_checks: Vec::new(),
            panic_threshold: DEFAULT_PANIC_THRESHOLD,
            overprovisioning_factor: DEFAULT_OVERPROVISIONING_FACTOR,
            cleanup_interval: DEFAULT_CLEANUP_INTERVAL,
            config_digest: 0,
            stats: None,
            http_protocol: UpstreamProtocol::Http1,
            transport_socket: None,
            transport_socket_matches: Arc::new([]),
            passthrough: None,
            metadata: None,
            port_override: None,
            metadata_exchange: None,
            prototype: None,
        }
    }
}

#[derive(Debug)]
pub struct Cluster {
    pub name: Arc<str>,
    /// See [`ClusterConfig::config_digest`].
    pub config_digest: u64,
    pub discovery: Discovery,
    pub lb_policy: LbPolicy,
    pub connect_timeout: Duration,
    pub source_address: Option<SocketAddr>,
    pub circuit_breaker: CircuitBreaker,
    pub outlier_detection: Option<OutlierDetection>,
    pub health_checks: Vec<HealthCheck>,
    pub stats: ClusterStats,
    pub http_protocol: UpstreamProtocol,
    /// See [`ClusterConfig::transport_socket`].
    pub transport_socket: Option<Arc<shunt_tls::UpstreamTls>>,
    pub transport_socket_matches: Arc<[shunt_tls::transport_socket::SocketMatch]>,
    /// See [`ClusterConfig::passthrough`].
    pub passthrough: Option<Arc<shunt_tls::internal_upstream::Passthrough>>,
    pub metadata: Option<Arc<shunt_core::interned::EncodedMetadata>>,
    pub port_override: Option<u16>,
    /// See [`ClusterConfig::metadata_exchange`].
    pub metadata_exchange: Option<Arc<str>>,
    /// Keep-alive HTTP connections to the hosts, closed with the cluster.
    pub http_pools: super::http_pool::Pools,
    /// HTTP/2 connections carrying `tcp_proxy` tunnels, closed with the cluster.
    pub tunnel_pools: super::tunnel_pool::TunnelPools,
    panic_threshold: f64,
    overprovisioning_factor: u32,
    members: RwLock<Arc<Members>>,
    /// ORIGINAL_DST: a host per destination in use, with when it was last chosen, so
    /// that `/clusters` lists them with their stats, as Envoy's.
    original_dst_hosts: Mutex<HashMap<SocketAddr, (Arc<Host>, Instant)>>,
    cleanup_interval: Duration,
    /// See [`ClusterConfig::prototype`].
    _prototype: Option<Arc<super::compile::Prototype>>,
}

/// Envoy's default ORIGINAL_DST `cleanup_interval`.
pub const DEFAULT_CLEANUP_INTERVAL: Duration = Duration::from_secs(5);

/// Envoy's default `overprovisioning_factor`: a level with 1/1.4 of its hosts healthy
/// still takes all the load it would take healthy.
pub const DEFAULT_OVERPROVISIONING_FACTOR: u32 = 140;

/// Every host of the cluster, and per priority level the share of new connections it
/// takes now (percent, summing to 100) with the balancer over the hosts it may use.
#[derive(Debug)]
struct Members {
    hosts: Vec<Arc<Host>>,
    levels: Vec<(u32, Balancer)>,
}

impl Cluster {
    /// A cluster with `hosts` (for DNS clusters, none until [`Cluster::start`] resolves).
    pub fn new(config: ClusterConfig, hosts: Vec<Host>) -> Arc<Cluster> {
        let stats = config.stats.unwrap_or_default();
        let cluster = Cluster {
            name: config.name.into(),
            config_digest: config.config_digest,
            discovery: config.discovery,
            lb_policy: config.lb_policy,
            connect_timeout: config.connect_timeout,
            source_address: config.source_address,
            circuit_breaker: CircuitBreaker::counting(
                config.max_connections,
                stats.upstream_cx_overflow.clone(),
            ),
            outlier_detection: config.outlier_detection,
            health_checks: config.health_checks,
            stats,
            http_protocol: config.http_protocol,
            transport_socket: config.transport_socket,
            transport_socket_matches: config.transport_socket_matches,
            passthrough: config.passthrough,
            metadata: config.metadata,
            port_override: config.port_override,
            metadata_exchange: config.metadata_exchange,
            http_pools: Default::default(),
            tunnel_pools: Default::default(),
            panic_threshold: config.panic_threshold,
            overprovisioning_factor: config.overprovisioning_factor,
            members: RwLock::new(Arc::new(Members {
                hosts: Vec::new(),
                levels: Vec::new(),
            })),
            original_dst_hosts: Mutex::new(HashMap::new()),
            cleanup_interval: config.cleanup_interval,
            _prototype: config.prototype,
        };
        cluster.set_hosts(hosts);
        Arc::new(cluster)
    }

    /// Every host, healthy or not (ORIGINAL_DST: the destinations in use, by address).
    pub fn hosts(&self) -> Vec<Arc<Host>> {
        let mut hosts = self.members().hosts.clone();
        if matches!(self.discovery, Discovery::OriginalDst) {
            let dst = self
                .original_dst_hosts
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let mut dynamic: Vec<Arc<Host>> = dst.values().map(|(h, _)| h.clone()).collect();
            dynamic.sort_by_key(|h| h.address);
            hosts.extend(dynamic);
        }
        hosts
    }

    /// The host for destination `dst` of an ORIGINAL_DST cluster, made on first use.
    fn original_dst_host(&self, dst: SocketAddr) -> Arc<Host> {
        let mut hosts = self
            .original_dst_hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let entry = hosts
            .entry(dst)
            .or_insert_with(|| (Arc::new(Host::new(dst)), Instant::now()));
        entry.1 = Instant::now();
        entry.0.clone()
    }

    /// Forgets ORIGINAL_DST hosts with no connection since `cleanup_interval`.
    fn clean_up_original_dst_hosts(&self) {
        let mut hosts = self
            .original_dst_hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        hosts.retain(|_, (host, used)| {
            host.active_connections() > 0 || used.elapsed() < self.cleanup_interval
        });
        // A forgotten host has no connection left, idle pooled ones included: its HTTP
        // pool goes too, or passthrough HTTP would keep one per destination for ever.
        self.http_pools
            .retain(|address| hosts.contains_key(address));
        self.tunnel_pools
            .retain(|address| hosts.contains_key(address));
    }

    /// The hosts load balancing chooses from now.
    #[cfg_attr(not(test), allow(dead_code, reason = "read by tests"))]
    pub fn routable_hosts(&self) -> Vec<Arc<Host>> {
        self.members()
            .levels
            .iter()
            .filter(|(load, _)| *load > 0)
            .flat_map(|(_, balancer)| balancer.hosts().to_vec())
            .collect()
    }

    /// Each priority level's share of new connections now, in percent.
    #[cfg(test)]
    fn priority_loads(&self) -> Vec<u32> {
        self.members()
            .levels
            .iter()
            .map(|(load, _)| *load)
            .collect()
    }

    fn members(&self) -> Arc<Members> {
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Chooses the host for a connection. An ORIGINAL_DST cluster's host is the
    /// connection's `original_dst`; `None` means no host (flag `UH`).
    pub fn choose_host(
        &self,
        ctx: &LbContext<'_>,
        original_dst: Option<SocketAddr>,
    ) -> Option<Arc<Host>> {
        let host = match self.discovery {
            // An internal connection whose destination nothing restored has no IP
            // address (Envoy's is `envoy://...`): no host, as in Envoy.
            Discovery::OriginalDst => original_dst
                .filter(|dst| !(dst.ip().is_unspecified() && dst.port() == 0))
                .map(|dst| {
                    let dst = match self.port_override {
                        Some(port) => SocketAddr::new(dst.ip(), port),
                        None => dst,
                    };
                    self.original_dst_host(dst)
                }),
            _ => self.members().choose(ctx),
        };
        if host.is_none() {
            self.stats.upstream_cx_none_healthy.inc();
        }
        host
    }

    /// Opens a connection to `host` (from `upstream_bind_config`'s source, within
    /// `connect_timeout`), counted in the cluster's and the host's stats for as long as
    /// the returned guard lives, and reports the result to outlier detection.
    pub async fn connect(
        self: &Arc<Self>,
        host: &Arc<Host>,
    ) -> io::Result<(TcpStream, UpstreamConnection)> {
        let dial = super::connect::connect(host.address, self.source_address, self.connect_timeout);
        self.connect_with(host, dial).await
    }

    /// [`Cluster::connect`] with the connect itself given: `dial` (an internal
    /// listener's pipe, a socket) is counted and reported the same way.
    pub async fn connect_with<T>(
        self: &Arc<Self>,
        host: &Arc<Host>,
        dial: impl std::future::Future<Output = io::Result<T>>,
    ) -> io::Result<(T, UpstreamConnection)> {
        self.stats.upstream_cx_total.inc();
        let started = Instant::now();
        let mut guard = UpstreamConnection {
            _host: host.track_connection(),
            cluster_active: self.stats.upstream_cx_active.clone(),
            connected: None,
            destroy_remote: self.stats.upstream_cx_destroy_remote.clone(),
            closed_by_remote: false,
        };
        guard.cluster_active.inc();
        match dial.await {
            Ok(stream) => {
                self.stats
                    .upstream_cx_connect_ms
                    .record(millis(started.elapsed()));
                guard.connected = Some((Instant::now(), self.stats.upstream_cx_length_ms.clone()));
                self.report_connect(host, true);
                Ok((stream, guard))
            }
            Err(err) => {
                self.stats.upstream_cx_connect_fail.inc();
                if err.kind() == io::ErrorKind::TimedOut {
                    self.stats.upstream_cx_connect_timeout.inc();
                }
                host.count_connect_failure();
                self.report_connect(host, false);
                Err(err)
            }
        }
    }

    /// Replaces the host list, keeping the state (health, counters) of hosts whose
    /// address stays, and rebuilds the balancer.
    pub fn set_hosts(&self, hosts: Vec<Host>) {
        let mut members = self.members.write().unwrap_or_else(|e| e.into_inner());
        let old = &members.hosts;
        let hosts: Vec<Arc<Host>> = hosts
            .into_iter()
            .map(|host| {
                old.iter()
                    .find(|o| {
                        o.address == host.address
                            && o.weight == host.weight
                            && o.priority == host.priority
                            && o.socket_match == host.socket_match
                            && o.internal == host.internal
                            && o.metadata == host.metadata
                    })
                    .cloned()
                    .unwrap_or_else(|| {
                        // A new host has not passed a health check yet (Envoy's
                        // PENDING_ACTIVE_HC): it takes traffic only in panic.
                        if !self.health_checks.is_empty() {
                            host.set_flag(host::FAILED_ACTIVE_HC, true);
                        }
                        Arc::new(host)
                    })
            })
            .collect();
        // Idle HTTP connections to hosts that left are closed (requests in flight keep
        // theirs).
        let addresses: std::collections::HashSet<SocketAddr> =
            hosts.iter().map(|h| h.address).collect();
        self.http_pools
            .retain(|address| addresses.contains(address));
        *members = Arc::new(self.build(hosts));
    }

    /// Rebuilds the balancer after a host's health changed.
    pub fn refresh(&self) {
        let mut members = self.members.write().unwrap_or_else(|e| e.into_inner());
        let hosts = members.hosts.clone();
        *members = Arc::new(self.build(hosts));
    }

    fn build(&self, hosts: Vec<Arc<Host>>) -> Members {
        self.stats.membership_total.set(hosts.len() as u64);
        self.stats
            .membership_healthy
            .set(hosts.iter().filter(|h| h.healthy()).count() as u64);
        let levels = priority_levels(&hosts, self.panic_threshold, self.overprovisioning_factor)
            .into_iter()
            .map(|(load, hosts)| (load, Balancer::new(&self.lb_policy, hosts)))
            .collect();
        Members { levels, hosts }
    }

    /// Feeds a connect result to outlier detection, ejecting the host if it is one
    /// failure too many and scheduling its return.
    pub fn report_connect(self: &Arc<Self>, host: &Arc<Host>, succeeded: bool) {
        let Some(outlier) = &self.outlier_detection else {
            return;
        };
        if matches!(self.discovery, Discovery::OriginalDst) {
            return;
        }
        if succeeded {
            outlier.on_success(host);
            return;
        }
        let hosts = self.hosts();
        let ejected = hosts
            .iter()
            .filter(|h| h.has_flag(host::FAILED_OUTLIER_CHECK))
            .count();
        let Some(time) = outlier.on_failure(host, ejected, hosts.len()) else {
            return;
        };
        tracing::info!(cluster = %self.name, host = %host.address, ejection_time_ms = time.as_millis() as u64, "outlier detection ejected a host");
        host.set_flag(host::FAILED_OUTLIER_CHECK, true);
        self.refresh();
        let cluster = Arc::downgrade(self);
        let host = host.clone();
        tokio::spawn(async move {
            tokio::time::sleep(time).await;
            if let Some(cluster) = cluster.upgrade()
                && host.set_flag(host::FAILED_OUTLIER_CHECK, false)
            {
                tracing::info!(cluster = %cluster.name, host = %host.address, "ejected host returns");
                cluster.refresh();
            }
        });
    }

    /// Resolves DNS clusters once (bounded) and starts their re-resolution and every
    /// active health checker. Background tasks hold only a weak reference and end with
    /// the cluster.
    pub async fn start(self: &Arc<Self>) {
        tracing::debug!(cluster = %self.name, r#type = self.discovery.name(), lb_policy = self.lb_policy.name(), "starting cluster");
        match &self.discovery {
            Discovery::StrictDns {
                refresh, family, ..
            }
            | Discovery::LogicalDns {
                refresh, family, ..
            } => {
                let (refresh, family) = (*refresh, *family);
                dns_cluster::resolve_into(self, family).await;
                tokio::spawn(dns_cluster::refresh_loop(
                    Arc::downgrade(self),
                    refresh,
                    family,
                ));
            }
            Discovery::OriginalDst => {
                let cluster = Arc::downgrade(self);
                let every = self.cleanup_interval.max(Duration::from_millis(100));
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(every).await;
                        let Some(cluster) = cluster.upgrade() else {
                            return;
                        };
                        cluster.clean_up_original_dst_hosts();
                    }
                });
            }
            _ => {}
        }
        for index in 0..self.health_checks.len() {
            tokio::spawn(health_check::run(Arc::downgrade(self), index));
        }
    }
}

/// One upstream connection, counted in `upstream_cx_active` and its host's `cx_active`
/// until dropped.
#[derive(Debug)]
pub struct UpstreamConnection {
    _host: ActiveConnection,
    cluster_active: Gauge,
    /// Once connected: when, and where its length goes (`upstream_cx_length_ms`).
    connected: Option<(Instant, Histogram)>,
    /// `upstream_cx_destroy_remote`, counted at the end if the upstream closed it.
    destroy_remote: Counter,
    closed_by_remote: bool,
}

impl UpstreamConnection {
    /// The upstream closed the connection (counted once, when it is dropped).
    pub fn closed_by_remote(&mut self) {
        self.closed_by_remote = true;
    }
}

impl Drop for UpstreamConnection {
    fn drop(&mut self) {
        self.cluster_active.dec();
        if self.closed_by_remote {
            self.destroy_remote.inc();
        }
        if let Some((since, length)) = &self.connected {
            length.record(millis(since.elapsed()));
        }
    }
}

/// A duration in (fractional) milliseconds, the unit of Envoy's `*_ms` histograms.
fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

impl Members {
    /// A level by its load (a random draw over the shares), then a host of it.
    fn choose(&self, ctx: &LbContext<'_>) -> Option<Arc<Host>> {
        if self.levels.len() > 1 {
            let mut draw = fastrand::u32(..100);
            for (load, balancer) in &self.levels {
                if draw < *load {
                    return balancer.choose(ctx);
                }
                draw -= load;
            }
        }
        self.levels
            .iter()
            .find(|(load, _)| *load > 0)
            .and_then(|(_, balancer)| balancer.choose(ctx))
    }
}

/// Envoy's priority load: each level's health is its healthy share of hosts times the
/// overprovisioning factor, capped at 100%; level 0 takes its health in load, the next
/// level what is left up to its own health, and so on. If the levels' health sums to
/// under 100%, the loads are scaled up to 100%, and a level with fewer than
/// `panic_threshold` percent of its hosts healthy panics: load balancing uses all its
/// hosts (better to try every host than refuse traffic); otherwise its healthy ones. With no healthy host
/// anywhere, level 0 takes everything, in panic, unless panic is off.
fn priority_levels(
    hosts: &[Arc<Host>],
    panic_threshold: f64,
    overprovisioning_factor: u32,
) -> Vec<(u32, Vec<Arc<Host>>)> {
    let mut by_priority: BTreeMap<u32, Vec<Arc<Host>>> = BTreeMap::new();
    for host in hosts {
        by_priority
            .entry(host.priority)
            .or_default()
            .push(host.clone());
    }
    let levels: Vec<Vec<Arc<Host>>> = by_priority.into_values().collect();
    let health: Vec<u32> = levels
        .iter()
        .map(|level| {
            let healthy = level.iter().filter(|h| h.healthy()).count() as u64;
            let percent = healthy * 100 * u64::from(overprovisioning_factor) / 100;
            (percent / level.len() as u64).min(100) as u32
        })
        .collect();
    let total: u32 = health.iter().sum::<u32>().min(100);
    let mut loads = vec![0u32; levels.len()];
    if total == 0 {
        if let Some(first) = loads.first_mut() {
            *first = 100;
        }
    } else {
        let mut left = 100u32;
        for (load, h) in loads.iter_mut().zip(&health) {
            // Scaled when the levels cannot carry all the load together.
            let share = if total < 100 { h * 100 / total } else { *h };
            *load = share.min(left);
            left -= *load;
        }
        // Rounding in the scaling: the remainder goes to the first level with health.
        if left > 0
            && let Some(i) = health.iter().position(|h| *h > 0)
        {
            loads[i] += left;
        }
    }
    levels
        .into_iter()
        .zip(loads)
        .map(|(level, load)| {
            let healthy: Vec<_> = level.iter().filter(|h| h.healthy()).cloned().collect();
            // As Envoy: no level panics while the levels together carry all the load.
            let panic = total < 100
                && (healthy.len() as f64) * 100.0 < panic_threshold * level.len() as f64;
            let usable = if panic || healthy.is_empty() {
                if panic_threshold > 0.0 {
                    level
                } else {
                    healthy
                }
            } else {
                healthy
            };
            (load, usable)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(last: u8, priority: u32) -> Host {
        Host::new(SocketAddr::from(([10, 0, 0, last], 80))).with_priority(priority)
    }

    fn addrs(hosts: &[Arc<Host>]) -> Vec<u8> {
        hosts
            .iter()
            .map(|h| match h.address.ip() {
                std::net::IpAddr::V4(ip) => ip.octets()[3],
                std::net::IpAddr::V6(_) => 0,
            })
            .collect()
    }

    #[test]
    fn unhealthy_hosts_leave_the_rotation_until_panic() {
        let cluster = Cluster::new(
            ClusterConfig::new("c"),
            vec![host(1, 0), host(2, 0), host(3, 0), host(4, 0)],
        );
        let hosts = cluster.hosts();
        hosts[0].set_flag(host::FAILED_OUTLIER_CHECK, true);
        hosts[1].set_flag(host::FAILED_ACTIVE_HC, true);
        cluster.refresh();
        assert_eq!(addrs(&cluster.routable_hosts()), [3, 4]);
        // 1 of 4 healthy is under the 50% panic threshold: every host takes traffic.
        hosts[2].set_flag(host::FAILED_EDS_HEALTH, true);
        cluster.refresh();
        assert_eq!(addrs(&cluster.routable_hosts()), [1, 2, 3, 4]);
    }

    #[test]
    fn original_dst_hosts_are_listed_while_in_use() {
        let mut config = ClusterConfig::new("PassthroughCluster");
        config.discovery = Discovery::OriginalDst;
        config.cleanup_interval = Duration::from_millis(30);
        let cluster = Cluster::new(config, Vec::new());
        let (a, b): (SocketAddr, SocketAddr) = (
            "10.0.0.1:80".parse().unwrap(),
            "10.0.0.2:80".parse().unwrap(),
        );
        let ctx = LbContext::default();
        let first = cluster.choose_host(&ctx, Some(a)).unwrap();
        assert!(Arc::ptr_eq(
            &first,
            &cluster.choose_host(&ctx, Some(a)).unwrap()
        ));
        let held = cluster
            .choose_host(&ctx, Some(b))
            .unwrap()
            .track_connection();
        let listed: Vec<SocketAddr> = cluster.hosts().iter().map(|h| h.address).collect();
        assert_eq!(listed, [a, b]);
        // Both carried HTTP: each has a connection pool.
        cluster.http_pools.touch(a);
        cluster.http_pools.touch(b);
        std::thread::sleep(Duration::from_millis(40));
        cluster.clean_up_original_dst_hosts();
        let listed: Vec<SocketAddr> = cluster.hosts().iter().map(|h| h.address).collect();
        assert_eq!(listed, [b], "idle a is forgotten, b has a connection");
        assert_eq!(
            cluster.http_pools.len(),
            1,
            "a's HTTP pool is forgotten with it"
        );
        drop(held);
    }

    #[test]
    fn priority_load_spills_over_as_envoys_does() {
        // Level 0: 4 hosts; level 1: 2 hosts. All healthy: level 0 takes everything.
        let hosts = vec![
            host(1, 0),
            host(2, 0),
            host(3, 0),
            host(4, 0),
            host(5, 1),
            host(6, 1),
        ];
        let cluster = Cluster::new(ClusterConfig::new("c"), hosts);
        assert_eq!(cluster.priority_loads(), [100, 0]);
        // 3 of 4 healthy: 75% x 1.4 = 105%, still all of the load.
        let all = cluster.hosts();
        all[0].set_flag(host::FAILED_OUTLIER_CHECK, true);
        cluster.refresh();
        assert_eq!(cluster.priority_loads(), [100, 0]);
        // 2 of 4: 70% stays on level 0, 30% spills to level 1.
        all[1].set_flag(host::FAILED_OUTLIER_CHECK, true);
        cluster.refresh();
        assert_eq!(cluster.priority_loads(), [70, 30]);
        // Spread as the loads say.
        let picks = (0..4000)
            .filter_map(|_| cluster.choose_host(&LbContext::default(), None))
            .filter(|h| h.priority == 1)
            .count();
        assert!((1000..1400).contains(&picks), "{picks} of 4000 to level 1");
        // Level 1 half down too: 70 + 70 > 100, level 1 capped by what is left.
        all[4].set_flag(host::FAILED_OUTLIER_CHECK, true);
        cluster.refresh();
        assert_eq!(cluster.priority_loads(), [70, 30]);
        // Level 0 down to 1 of 4 (35%) and level 1 1 of 2 (70%): 105% in all.
        all[2].set_flag(host::FAILED_OUTLIER_CHECK, true);
        cluster.refresh();
        assert_eq!(cluster.priority_loads(), [35, 65]);
    }

    #[test]
    fn a_lower_priority_serves_only_when_the_first_has_no_healthy_host() {
        let cluster = Cluster::new(ClusterConfig::new("c"), vec![host(1, 0), host(2, 1)]);
        assert_eq!(addrs(&cluster.routable_hosts()), [1]);
        cluster.hosts()[0].set_flag(host::FAILED_OUTLIER_CHECK, true);
        cluster.refresh();
        assert_eq!(addrs(&cluster.routable_hosts()), [2]);
    }

    #[test]
    fn new_hosts_wait_for_a_health_check_and_kept_hosts_keep_their_state() {
        let mut config = ClusterConfig::new("c");
        config.health_checks.push(HealthCheck::tcp_for_tests());
        let cluster = Cluster::new(config, vec![host(1, 0), host(2, 0)]);
        assert!(cluster.hosts().iter().all(|h| !h.healthy()));
        cluster.hosts()[0].set_flag(host::FAILED_ACTIVE_HC, false);
        cluster.set_hosts(vec![host(1, 0), host(3, 0)]);
        let hosts = cluster.hosts();
        assert!(hosts[0].healthy());
        assert!(!hosts[1].healthy());
        assert_eq!(addrs(&cluster.routable_hosts()), [1]);
    }

    #[test]
    fn an_original_dst_cluster_goes_where_the_connection_was_going() {
        let mut config = ClusterConfig::new("PassthroughCluster");
        config.discovery = Discovery::OriginalDst;
        let cluster = Cluster::new(config, Vec::new());
        let dst: SocketAddr = "10.96.0.10:443".parse().unwrap();
        let ctx = LbContext::default();
        assert_eq!(cluster.choose_host(&ctx, Some(dst)).unwrap().address, dst);
        assert!(cluster.choose_host(&ctx, None).is_none());
    }

    #[test]
    fn a_cluster_without_endpoints_has_no_host() {
        let cluster = Cluster::new(ClusterConfig::new("BlackHoleCluster"), Vec::new());
        assert!(cluster.choose_host(&LbContext::default(), None).is_none());
    }

    #[tokio::test]
    async fn consecutive_connect_failures_eject_until_the_ejection_time_is_up() {
        let mut config = ClusterConfig::new("c");
        config.outlier_detection = Some(OutlierDetection {
            consecutive: 2,
            base_ejection_time: Duration::from_millis(50),
            max_ejection_percent: 100,
            ..Default::default()
        });
        let cluster = Cluster::new(config, vec![host(1, 0), host(2, 0)]);
        let bad = cluster.hosts()[0].clone();
        cluster.report_connect(&bad, false);
        assert_eq!(addrs(&cluster.routable_hosts()), [1, 2]);
        let ejected_at = std::time::Instant::now();
        cluster.report_connect(&bad, false);
        assert_eq!(addrs(&cluster.routable_hosts()), [2]);
        // It comes back on its own once its ejection time has passed, not before.
        let back = async {
            while !bad.healthy() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), back)
            .await
            .expect("the ejected host never came back");
        assert!(ejected_at.elapsed() >= Duration::from_millis(50));
        assert_eq!(addrs(&cluster.routable_hosts()), [1, 2]);
    }

    #[tokio::test]
    async fn connects_are_counted_for_the_cluster_and_the_host() {
        let store = shunt_core::stats::Store::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap();
        let refused = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let mut config = ClusterConfig::new("c");
        config.stats = Some(ClusterStats::new(&store, "c"));
        let cluster = Cluster::new(config, vec![Host::new(open), Host::new(refused)]);
        let hosts = cluster.hosts();

        let (_stream, guard) = cluster.connect(&hosts[0]).await.unwrap();
        assert!(cluster.connect(&hosts[1]).await.is_err());
        let stats = &cluster.stats;
        assert_eq!(stats.upstream_cx_total.value(), 2);
        assert_eq!(stats.upstream_cx_active.value(), 1);
        assert_eq!(stats.upstream_cx_connect_fail.value(), 1);
        assert_eq!(stats.upstream_cx_connect_timeout.value(), 0);
        assert_eq!(stats.upstream_cx_connect_ms.summary().count, 1);
        assert_eq!(
            (hosts[0].total_connections(), hosts[0].active_connections()),
            (1, 1)
        );
        assert_eq!(
            (hosts[1].total_connections(), hosts[1].connect_failures()),
            (1, 1)
        );
        drop(guard);
        assert_eq!(stats.upstream_cx_active.value(), 0);
        assert_eq!(hosts[0].active_connections(), 0);
        assert_eq!(stats.upstream_cx_length_ms.summary().count, 1);
        assert_eq!(stats.membership_total.value(), 2);
        assert_eq!(stats.membership_healthy.value(), 2);
    }

    #[test]
    fn no_host_and_overflow_are_counted() {
        let mut config = ClusterConfig::new("BlackHoleCluster");
        config.max_connections = 0;
        let cluster = Cluster::new(config, Vec::new());
        assert!(cluster.choose_host(&LbContext::default(), None).is_none());
        assert!(cluster.circuit_breaker.try_acquire().is_none());
        assert_eq!(cluster.stats.upstream_cx_none_healthy.value(), 1);
        assert_eq!(cluster.stats.upstream_cx_overflow.value(), 1);
    }
}
