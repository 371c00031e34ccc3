//! xDS: configuration from a control plane (istiod through its agent, or any Envoy v3
//! management server), as Envoy takes it.
//!
//! - [`source`] reads the bootstrap's `dynamic_resources` into streams: one ADS stream,
//!   or one per type, state of the world or Delta.
//! - [`local`] holds the xDS servers of this process (`shunt agent`'s), which a stream
//!   to their socket path calls instead of connecting.
//! - [`stream`] keeps each gRPC stream connected (TCP or Unix socket), reconnecting with
//!   jittered exponential back-off, and hands responses to the manager.
//! - [`manager`] owns the accepted resources. Each response is judged resource by
//!   resource, as Envoy does: the new resources are compiled with everything else into a
//!   snapshot; one that does not compile goes back to its last good version, the others
//!   are served; the response is ACKed, or NACKed naming what was refused, which keeps
//!   its error state in `/config_dump`. It follows Envoy's order: clusters first,
//!   an EDS cluster warms until its endpoints arrive (or `initial_fetch_timeout`), and
//!   listeners are asked for once the first clusters are in.

pub mod local;
pub mod manager;
pub mod source;
pub mod stream;

pub use manager::Manager;

/// The resource types shunt subscribes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TypeUrl {
    Cluster,
    ClusterLoadAssignment,
    Listener,
    RouteConfiguration,
    Secret,
    /// Istio's DNS name table (NDS), asked for over ADS when the DNS proxy is on.
    NameTable,
    /// Istio's workloads (WDS), asked for when the bootstrap has workload discovery.
    Workload,
}

impl TypeUrl {
    pub const ALL: [TypeUrl; 7] = [
        TypeUrl::Cluster,
        TypeUrl::ClusterLoadAssignment,
        TypeUrl::Listener,
        TypeUrl::RouteConfiguration,
        TypeUrl::Secret,
        TypeUrl::NameTable,
        TypeUrl::Workload,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TypeUrl::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            TypeUrl::ClusterLoadAssignment => {
                "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
            }
            TypeUrl::Listener => "type.googleapis.com/envoy.config.listener.v3.Listener",
            TypeUrl::RouteConfiguration => {
                "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
            }
            TypeUrl::Secret => {
                "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
            }
            TypeUrl::NameTable => crate::dns::name_table::TYPE_URL,
            TypeUrl::Workload => crate::peer::workload_discovery::TYPE_URL,
        }
    }

    pub fn parse(url: &str) -> Option<TypeUrl> {
        TypeUrl::ALL.into_iter().find(|t| t.as_str() == url)
    }

    /// What Envoy calls one, in its messages ("duplicate listener NAME found").
    pub fn noun(self) -> &'static str {
        match self {
            TypeUrl::Cluster => "cluster",
            TypeUrl::ClusterLoadAssignment => "cluster load assignment",
            TypeUrl::Listener => "listener",
            TypeUrl::RouteConfiguration => "route configuration",
            TypeUrl::Secret => "secret",
            TypeUrl::NameTable => "name table",
            TypeUrl::Workload => "workload",
        }
    }

    /// Envoy's short name, for logs and stats.
    pub fn short(self) -> &'static str {
        match self {
            TypeUrl::Cluster => "cds",
            TypeUrl::ClusterLoadAssignment => "eds",
            TypeUrl::Listener => "lds",
            TypeUrl::RouteConfiguration => "rds",
            TypeUrl::Secret => "sds",
            TypeUrl::NameTable => "nds",
            TypeUrl::Workload => "wds",
        }
    }

    /// Listeners, clusters, the name table and workloads are asked for whole (wildcard); the others
    /// by name, as the accepted listeners and clusters reference them. In state of the
    /// world, only a wildcard type's response is its complete set, so only there does
    /// omission remove.
    pub fn is_wildcard(self) -> bool {
        matches!(
            self,
            TypeUrl::Cluster | TypeUrl::Listener | TypeUrl::NameTable | TypeUrl::Workload
        )
    }

    /// The gRPC method of a stream carrying only this type.
    fn method(self, delta: bool) -> &'static str {
        match (self, delta) {
            (TypeUrl::Cluster, false) => {
                "/envoy.service.cluster.v3.ClusterDiscoveryService/StreamClusters"
            }
            (TypeUrl::Cluster, true) => {
                "/envoy.service.cluster.v3.ClusterDiscoveryService/DeltaClusters"
            }
            (TypeUrl::ClusterLoadAssignment, false) => {
                "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
            }
            (TypeUrl::ClusterLoadAssignment, true) => {
                "/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints"
            }
            (TypeUrl::Listener, false) => {
                "/envoy.service.listener.v3.ListenerDiscoveryService/StreamListeners"
            }
            (TypeUrl::Listener, true) => {
                "/envoy.service.listener.v3.ListenerDiscoveryService/DeltaListeners"
            }
            (TypeUrl::RouteConfiguration, false) => {
                "/envoy.service.route.v3.RouteDiscoveryService/StreamRoutes"
            }
            (TypeUrl::RouteConfiguration, true) => {
                "/envoy.service.route.v3.RouteDiscoveryService/DeltaRoutes"
            }
            (TypeUrl::Secret, false) => {
                "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets"
            }
            (TypeUrl::Secret, true) => {
                "/envoy.service.secret.v3.SecretDiscoveryService/DeltaSecrets"
            }
            // Istio serves the name table and workloads on ADS only.
            (TypeUrl::NameTable | TypeUrl::Workload, false) => {
                "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
            }
            (TypeUrl::NameTable | TypeUrl::Workload, true) => {
                "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
            }
        }
    }
}

/// The gRPC method of a stream carrying `types`: ADS when it carries more than one.
fn method(types: &[TypeUrl], delta: bool) -> &'static str {
    match types {
        [one] => one.method(delta),
        _ if delta => {
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
        }
        _ => "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
    }
}
