//! The resource types shunt subscribes to, and the gRPC method that carries them.

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
            TypeUrl::NameTable => shunt_dns::name_table::TYPE_URL,
            TypeUrl::Workload => shunt_core::peer::workload_discovery::TYPE_URL,
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
pub(crate) fn method(types: &[TypeUrl], delta: bool) -> &'static str {
    match types {
        [one] => one.method(delta),
        _ if delta => {
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
        }
        _ => "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
    }
}
