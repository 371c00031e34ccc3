//! The config tracker's view of resources: every listener, cluster, route configuration,
//! secret and endpoint set in use, static or from xDS, with its version and update time
//! ([`Tracked`]), and the NACKed ones ([`UpdateFailure`]). xDS fills it, `/config_dump`
//! shows it.

use std::net::SocketAddr;
use std::time::SystemTime;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{Address, HealthStatus};
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
