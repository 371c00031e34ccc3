//! What the admin API asks of the proxy: the [`ProxyState`] trait, the data plane's side
//! of the contract, and the helpers that answer it from configuration (`/clusters` and
//! `/listeners` before any traffic, the endpoints `/config_dump` shows).
//!
//! The trait is called from the admin thread, never from a data-plane worker, and each
//! call should be a cheap read (clone an `Arc`ed snapshot, load atomics): a scrape must
//! not take a lock that the data path holds.

use std::net::SocketAddr;
use std::time::SystemTime;

use envoy_types::pb::envoy::admin::v3::{ClusterStatus, HostHealthStatus, HostStatus, ListenerStatus, SimpleMetric, simple_metric};
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::circuit_breakers::Thresholds;
use envoy_types::pb::envoy::config::cluster::v3::CircuitBreakers;
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{Address, HealthStatus, RoutingPriority};
use envoy_types::pb::envoy::config::endpoint::v3::endpoint::HealthCheckConfig;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, cluster_load_assignment};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::RouteSpecifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use envoy_types::pb::google::protobuf::UInt32Value;
use prost::{Message, Name};

use super::stats::Stat;

/// The proxy as the admin API sees it. Implemented by the data plane
/// ([`crate::snapshot::live::Live`]).
pub trait ProxyState: Send + Sync + 'static {
    /// The bootstrap the proxy was started with (`/config_dump`'s BootstrapConfigDump,
    /// `/server_info`'s node).
    fn bootstrap(&self) -> Bootstrap;

    /// Every resource in use, static and dynamic (Envoy's config tracker).
    fn resources(&self) -> Resources;

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

/// A resource with what the config tracker knows of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Tracked<T> {
    pub resource: T,
    /// The xDS version it came with; `None` for a static (bootstrap) resource. Shared:
    /// an update copies the tracked resources of a type without copying a version.
    pub version_info: Option<std::sync::Arc<str>>,
    pub last_updated: SystemTime,
}

impl<T> Tracked<T> {
    pub fn new_static(resource: T, last_updated: SystemTime) -> Self {
        Tracked {
            resource,
            version_info: None,
            last_updated,
        }
    }

    pub fn is_static(&self) -> bool {
        self.version_info.is_none()
    }
}

/// Every resource the proxy uses, as `/config_dump` shows them. Dynamic resources are
/// those with a `version_info`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resources {
    /// In the order they were added.
    pub listeners: Vec<Tracked<Listener>>,
    pub clusters: Vec<Tracked<Cluster>>,
    /// Route configurations: inline ones (from an HCM's `route_config`, static) and RDS ones.
    pub route_configs: Vec<Tracked<RouteConfiguration>>,
    pub secrets: Vec<Tracked<Secret>>,
    /// The endpoints of each cluster as the load balancer has them (`?include_eds`).
    pub endpoints: Vec<Tracked<ClusterLoadAssignment>>,
    /// The last version accepted over LDS and CDS (empty without xDS).
    pub listeners_version: String,
    pub clusters_version: String,
    /// CDS clusters waiting for their endpoints or secrets (`dynamic_warming_clusters`).
    pub warming_clusters: Vec<Tracked<Cluster>>,
    /// LDS listeners waiting for their routes or secrets (`warming_state`).
    pub warming_listeners: Vec<Tracked<Listener>>,
    /// Resources whose last xDS update was refused, with why (their `error_state`).
    pub errors: Vec<UpdateFailure>,
}

/// A refused (NACKed) xDS update of one resource: Envoy's `UpdateFailureState`.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateFailure {
    /// The resource's type URL (`type.googleapis.com/envoy.config.cluster.v3.Cluster`).
    pub type_url: String,
    pub name: String,
    /// The refused resource as it came.
    pub failed_configuration: Option<envoy_types::pb::google::protobuf::Any>,
    pub details: String,
    /// The version of the refused update.
    pub version_info: String,
    pub last_update_attempt: SystemTime,
}

impl Resources {
    /// The static resources of a bootstrap, loaded at `at`: its listeners, clusters and
    /// secrets, the route configurations inline in its HTTP connection managers, and the
    /// endpoints of its clusters' `load_assignment`s.
    pub fn from_bootstrap(bootstrap: &Bootstrap, at: SystemTime) -> Self {
        let statics = bootstrap.static_resources.clone().unwrap_or_default();
        let route_configs = statics
            .listeners
            .iter()
            .flat_map(inline_route_configs)
            .map(|route| Tracked::new_static(route, at))
            .collect();
        let endpoints = statics
            .clusters
            .iter()
            .map(|cluster| Tracked::new_static(endpoints_of(cluster), at))
            .collect();
        Resources {
            listeners: statics
                .listeners
                .into_iter()
                .map(|l| Tracked::new_static(l, at))
                .collect(),
            clusters: statics
                .clusters
                .into_iter()
                .map(|c| Tracked::new_static(c, at))
                .collect(),
            route_configs,
            secrets: statics
                .secrets
                .into_iter()
                .map(|s| Tracked::new_static(s, at))
                .collect(),
            endpoints,
            listeners_version: String::new(),
            clusters_version: String::new(),
            warming_clusters: Vec::new(),
            warming_listeners: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// These (static) resources with the dynamic ones accepted over xDS added after them.
    pub fn with_dynamic(mut self, dynamic: &crate::snapshot::DynamicResources) -> Self {
        fn owned<T: Clone>(tracked: &Tracked<std::sync::Arc<T>>) -> Tracked<T> {
            Tracked {
                resource: (*tracked.resource).clone(),
                version_info: tracked.version_info.clone(),
                last_updated: tracked.last_updated,
            }
        }
        self.listeners.extend(dynamic.listeners.iter().map(owned));
        // The configs as CDS sent them: EDS endpoints are shown as endpoints.
        self.clusters
            .extend(dynamic.clusters.iter().map(|c| owned(&c.tracked)));
        self.route_configs
            .extend(dynamic.route_configs.iter().map(owned));
        self.secrets.extend(dynamic.secrets.iter().map(owned));
        self.endpoints.extend(dynamic.endpoints.iter().map(owned));
        self.warming_clusters = dynamic.warming_clusters.iter().map(owned).collect();
        self.warming_listeners = dynamic.warming_listeners.iter().map(owned).collect();
        self.errors = dynamic.errors.clone();
        self.listeners_version = dynamic.listeners_version.clone();
        self.clusters_version = dynamic.clusters_version.clone();
        self
    }
}

/// The HTTP connection managers of a listener (every filter chain, the default one too).
pub fn http_connection_managers(listener: &Listener) -> Vec<HttpConnectionManager> {
    listener
        .filter_chains
        .iter()
        .chain(&listener.default_filter_chain)
        .flat_map(|chain| &chain.filters)
        .filter_map(|filter| match &filter.config_type {
            Some(ConfigType::TypedConfig(any))
                if any.type_url.ends_with(&HttpConnectionManager::full_name()) =>
            {
                HttpConnectionManager::decode(any.value.as_slice()).ok()
            }
            _ => None,
        })
        .collect()
}

fn inline_route_configs(listener: &Listener) -> Vec<RouteConfiguration> {
    http_connection_managers(listener)
        .into_iter()
        .filter_map(|hcm| match hcm.route_specifier {
            Some(RouteSpecifier::RouteConfig(route)) => Some(route),
            _ => None,
        })
        .collect()
}

/// A cluster's endpoints as Envoy's load balancer holds them: every host HEALTHY with
/// weight 1 unless configured, the default overprovisioning factor (140).
pub fn endpoints_of(cluster: &Cluster) -> ClusterLoadAssignment {
    let service_name = cluster
        .eds_cluster_config
        .as_ref()
        .map(|eds| eds.service_name.clone())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| cluster.name.clone());
    let mut assignment = cluster.load_assignment.clone().unwrap_or_default();
    assignment.cluster_name = service_name;
    for locality in &mut assignment.endpoints {
        locality.locality.get_or_insert_with(Default::default);
        for lb_endpoint in &mut locality.lb_endpoints {
            if lb_endpoint.health_status == HealthStatus::Unknown as i32 {
                lb_endpoint.health_status = HealthStatus::Healthy as i32;
            }
            lb_endpoint
                .load_balancing_weight
                .get_or_insert(UInt32Value { value: 1 });
            if let Some(HostIdentifier::Endpoint(endpoint)) = &mut lb_endpoint.host_identifier {
                endpoint
                    .health_check_config
                    .get_or_insert_with(HealthCheckConfig::default);
            }
        }
    }
    let policy = assignment
        .policy
        .get_or_insert_with(cluster_load_assignment::Policy::default);
    policy
        .overprovisioning_factor
        .get_or_insert(UInt32Value { value: 140 });
    assignment
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

/// A socket address as an IP and port, if it is one (not a pipe, not a named port).
pub fn socket_addr(address: &Address) -> Option<SocketAddr> {
    let Some(AddressKind::SocketAddress(socket)) = &address.address else {
        return None;
    };
    let Some(PortSpecifier::PortValue(port)) = socket.port_specifier else {
        return None;
    };
    let ip = socket.address.parse().ok()?;
    Some(SocketAddr::new(ip, u16::try_from(port).ok()?))
}

/// An address as Envoy prints it (`asString()`): `ip:port`, `[v6]:port`, a pipe's path.
pub fn address_text(address: &Address) -> String {
    match &address.address {
        Some(AddressKind::SocketAddress(socket)) => {
            if let Some(addr) = socket_addr(address) {
                return addr.to_string();
            }
            match &socket.port_specifier {
                Some(PortSpecifier::PortValue(port)) => format!("{}:{port}", socket.address),
                Some(PortSpecifier::NamedPort(port)) => format!("{}:{port}", socket.address),
                None => socket.address.clone(),
            }
        }
        Some(AddressKind::Pipe(pipe)) => pipe.path.clone(),
        Some(AddressKind::EnvoyInternalAddress(internal)) => format!("envoy://{internal:?}"),
        None => String::new(),
    }
}
