//! What the admin API asks of the proxy: the [`ProxyState`] trait, the data plane's side
//! of the contract, and the helpers that answer it from configuration (`/clusters` and
//! `/listeners` before any traffic, the endpoints `/config_dump` shows).
//!
//! The trait is called from the admin thread, never from a data-plane worker, and each
//! call should be a cheap read (clone an `Arc`ed snapshot, load atomics): a scrape must
//! not take a lock that the data path holds.

use envoy_types::pb::envoy::admin::v3::{
    ClusterStatus, HostHealthStatus, HostStatus, ListenerStatus, SimpleMetric, simple_metric,
};
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::cluster::v3::CircuitBreakers;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::circuit_breakers::Thresholds;
use envoy_types::pb::envoy::config::core::v3::RoutingPriority;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::google::protobuf::UInt32Value;

use shunt_config::{Resources, Tracked, endpoints_of};
use shunt_core::stats::Stat;

/// The proxy as the admin API sees it. Implemented by the data plane
/// ([`super::live::Live`]).
pub trait ProxyState: Send + Sync + 'static {
    /// The bootstrap the proxy was started with (`/config_dump`'s BootstrapConfigDump,
    /// `/server_info`'s node).
    fn bootstrap(&self) -> Bootstrap;

    /// Every resource in use, static and dynamic (Envoy's config tracker).
    fn resources(&self) -> Resources;

    /// The DNS proxy's current name table (`istio.networking.nds.v1.NameTable`), which
    /// `/config_dump` shows after Envoy's configs; `None` when DNS is off or no table
    /// arrived yet.
    fn name_table(&self) -> Option<envoy_types::pb::google::protobuf::Any> {
        None
    }

    /// `/clusters`: the clusters with their hosts, host stats and circuit breakers. The
    /// default is built from [`ProxyState::resources`] with zero host stats.
    fn clusters(&self) -> Vec<ClusterStatus> {
        cluster_statuses(&self.resources())
    }

    /// `/listeners`: each active listener and the address it is bound to. The default is
    /// each listener's configured address.
    fn listeners(&self) -> Vec<ListenerStatus> {
        listener_statuses(&self.resources())
    }

    /// Every stat (counters, gauges, histograms) by its full Envoy name. The admin API adds
    /// the `server.*` stats it owns (`server.live`, `server.state`, `server.uptime`).
    fn stats(&self) -> Vec<Stat>;

    /// Whether initialization is done: listeners bound, first xDS responses applied.
    /// `/ready` and the 15021 health port answer 503 until it is.
    fn is_ready(&self) -> bool;

    /// `/drain_listeners`: stop accepting (on every listener, or inbound ones), letting
    /// open connections finish.
    fn drain_listeners(&self, drain: Drain);

    /// `/quitquitquit`: begin a graceful exit of the process. The admin server stops by
    /// itself once it has answered.
    fn shutdown(&self);
}

/// The parameters of `/drain_listeners`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drain {
    /// `?graceful`: enter the drain period (`--drain-time-s`) before closing listeners.
    pub graceful: bool,
    /// `?inboundonly`: only listeners whose `traffic_direction` is INBOUND.
    pub inbound_only: bool,
    /// `?skip_exit`: do not exit once drained (with `graceful`).
    pub skip_exit: bool,
}

/// Envoy's circuit breaker defaults, for a priority the cluster does not configure.
const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
const DEFAULT_MAX_PENDING_REQUESTS: u32 = 1024;
const DEFAULT_MAX_REQUESTS: u32 = 1024;
const DEFAULT_MAX_RETRIES: u32 = 3;

/// The host counters and gauges Envoy keeps, by name: `(name, is a gauge)`.
pub const HOST_STATS: &[(&str, bool)] = &[
    ("cx_active", true),
    ("cx_connect_fail", false),
    ("cx_total", false),
    ("rq_active", true),
    ("rq_error", false),
    ("rq_success", false),
    ("rq_timeout", false),
    ("rq_total", false),
];

/// `/clusters` from configuration alone: hosts from the endpoints, all stats zero.
pub fn cluster_statuses(resources: &Resources) -> Vec<ClusterStatus> {
    let mut clusters: Vec<&Tracked<Cluster>> = resources.clusters.iter().collect();
    clusters.sort_by(|a, b| a.resource.name.cmp(&b.resource.name));
    clusters
        .into_iter()
        .map(|tracked| {
            let cluster = &tracked.resource;
            let configured = endpoints_of(cluster);
            let assignment = resources
                .endpoints
                .iter()
                .map(|e| &e.resource)
                .find(|e| e.cluster_name == configured.cluster_name)
                .cloned()
                .unwrap_or(configured);
            let host_statuses = assignment
                .endpoints
                .iter()
                .flat_map(|locality| {
                    locality.lb_endpoints.iter().filter_map(move |lb| {
                        let Some(HostIdentifier::Endpoint(endpoint)) = &lb.host_identifier else {
                            return None;
                        };
                        Some(HostStatus {
                            address: endpoint.address.clone(),
                            stats: HOST_STATS
                                .iter()
                                .map(|&(name, gauge)| SimpleMetric {
                                    r#type: if gauge {
                                        simple_metric::Type::Gauge as i32
                                    } else {
                                        simple_metric::Type::Counter as i32
                                    },
                                    value: 0,
                                    name: name.into(),
                                })
                                .collect(),
                            health_status: Some(HostHealthStatus {
                                eds_health_status: lb.health_status,
                                ..Default::default()
                            }),
                            weight: lb.load_balancing_weight.map_or(1, |w| w.value),
                            hostname: endpoint.hostname.clone(),
                            priority: locality.priority,
                            locality: locality.locality.clone(),
                            ..Default::default()
                        })
                    })
                })
                .collect();
            let configured = cluster.circuit_breakers.clone().unwrap_or_default();
            let thresholds = [RoutingPriority::Default, RoutingPriority::High]
                .into_iter()
                .map(|priority| {
                    let given = configured
                        .thresholds
                        .iter()
                        .find(|t| t.priority == priority as i32)
                        .cloned()
                        .unwrap_or_default();
                    let or = |value: Option<UInt32Value>, default| {
                        Some(value.unwrap_or(UInt32Value { value: default }))
                    };
                    Thresholds {
                        priority: priority as i32,
                        max_connections: or(given.max_connections, DEFAULT_MAX_CONNECTIONS),
                        max_pending_requests: or(
                            given.max_pending_requests,
                            DEFAULT_MAX_PENDING_REQUESTS,
                        ),
                        max_requests: or(given.max_requests, DEFAULT_MAX_REQUESTS),
                        max_retries: or(given.max_retries, DEFAULT_MAX_RETRIES),
                        ..Default::default()
                    }
                })
                .collect();
            let eds_service_name = cluster
                .eds_cluster_config
                .as_ref()
                .map(|eds| eds.service_name.clone())
                .unwrap_or_default();
            ClusterStatus {
                name: cluster.name.clone(),
                observability_name: observability_name(cluster).to_owned(),
                added_via_api: !tracked.is_static(),
                host_statuses,
                circuit_breakers: Some(CircuitBreakers {
                    thresholds,
                    ..Default::default()
                }),
                eds_service_name,
                ..Default::default()
            }
        })
        .collect()
}

/// `/listeners` from configuration alone.
pub fn listener_statuses(resources: &Resources) -> Vec<ListenerStatus> {
    resources
        .listeners
        .iter()
        .map(|tracked| ListenerStatus {
            name: tracked.resource.name.clone(),
            local_address: tracked.resource.address.clone(),
            additional_local_addresses: tracked
                .resource
                .additional_addresses
                .iter()
                .filter_map(|a| a.address.clone())
                .collect(),
        })
        .collect()
}

/// The name a cluster's stats use: `alt_stat_name` if set (Envoy's observability name).
pub fn observability_name(cluster: &Cluster) -> &str {
    if cluster.alt_stat_name.is_empty() {
        &cluster.name
    } else {
        &cluster.alt_stat_name
    }
}
