//! Envoy resources to serve, built from envoy-types' structs (the test crates have no
//! JSON descriptor pool): the shapes the xDS tests and `bench xds` push.

use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    ClusterDiscoveryType, DiscoveryType, EdsClusterConfig,
};
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{Address, ApiVersion, ConfigSource, SocketAddress};
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, TransportSocket, data_source, transport_socket,
};
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route, route_action,
    route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::tcp_proxy::ClusterSpecifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, Secret,
    TlsCertificate, common_tls_context, secret,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;

use super::{AdsServer, Any};

/// A resource as [`AdsServer::set`] takes it.
pub fn named<M: prost::Message + prost::Name>(name: &str, message: &M) -> (String, Any) {
    (name.to_owned(), AdsServer::any(message))
}

pub fn address(ip: IpAddr, port: u16) -> Address {
    Address {
        address: Some(AddressKind::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(PortSpecifier::PortValue(port.into())),
            ..Default::default()
        })),
    }
}

/// `ads: {}` (v3): what an EDS cluster's `eds_config` says under ADS, as istiod writes it.
pub fn ads_source() -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(ConfigSourceSpecifier::Ads(Default::default())),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// A state-of-the-world gRPC source through static cluster `cluster` (v3), as Istio
/// names its agent's SDS server (`sds-grpc`).
pub fn grpc_source(cluster: &str) -> ConfigSource {
    use envoy_types::pb::envoy::config::core::v3::api_config_source::ApiType;
    use envoy_types::pb::envoy::config::core::v3::grpc_service::{EnvoyGrpc, TargetSpecifier};
    use envoy_types::pb::envoy::config::core::v3::{ApiConfigSource, GrpcService};
    ConfigSource {
        config_source_specifier: Some(ConfigSourceSpecifier::ApiConfigSource(ApiConfigSource {
            api_type: ApiType::Grpc as i32,
            transport_api_version: ApiVersion::V3 as i32,
            set_node_on_first_message_only: true,
            grpc_services: vec![GrpcService {
                target_specifier: Some(TargetSpecifier::EnvoyGrpc(EnvoyGrpc {
                    cluster_name: cluster.into(),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        })),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// An EDS cluster whose endpoints come from `eds_config`, under its own name.
pub fn eds_cluster(name: &str, eds_config: ConfigSource, connect_timeout_s: i64) -> Cluster {
    Cluster {
        name: name.into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(eds_config),
            service_name: String::new(),
        }),
        connect_timeout: Some(PbDuration {
            seconds: connect_timeout_s,
            nanos: 0,
        }),
        ..Default::default()
    }
}

/// Endpoints for cluster `name`, one locality.
pub fn load_assignment(name: &str, endpoints: &[SocketAddr]) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: endpoints
                .iter()
                .map(|e| LbEndpoint {
                    host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                        address: Some(address(e.ip(), e.port())),
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A listener on `at` with one chain: `tcp_proxy` to `cluster`.
pub fn tcp_proxy_listener(name: &str, at: SocketAddr, cluster: &str) -> Listener {
    let proxy = TcpProxy {
        stat_prefix: name.into(),
        cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.into())),
        ..Default::default()
    };
    Listener {
        name: name.into(),
        address: Some(address(at.ip(), at.port())),
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: "envoy.filters.network.tcp_proxy".into(),
                config_type: Some(filter::ConfigType::TypedConfig(AdsServer::any(&proxy))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn network_filter<M: prost::Message + prost::Name>(name: &str, config: &M) -> Filter {
    Filter {
        name: name.into(),
        config_type: Some(filter::ConfigType::TypedConfig(AdsServer::any(config))),
    }
}

/// A listener on `at` with one chain: an HTTP connection manager whose routes come
/// over RDS (`ads: {}`) as `route_config_name`, as istiod writes outbound listeners.
pub fn http_listener(name: &str, at: SocketAddr, route_config_name: &str) -> Listener {
    let hcm = HttpConnectionManager {
        stat_prefix: name.into(),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads_source()),
            route_config_name: route_config_name.into(),
        })),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(AdsServer::any(
                &Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    };
    Listener {
        name: name.into(),
        address: Some(address(at.ip(), at.port())),
        filter_chains: vec![FilterChain {
            filters: vec![network_filter(
                "envoy.filters.network.http_connection_manager",
                &hcm,
            )],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A route configuration with one virtual host for every domain: each path prefix to
/// its cluster, in order.
pub fn route_config(name: &str, routes: &[(&str, &str)]) -> RouteConfiguration {
    RouteConfiguration {
        name: name.into(),
        virtual_hosts: vec![VirtualHost {
            name: format!("{name}-all"),
            domains: vec!["*".into()],
            routes: routes
                .iter()
                .map(|(prefix, cluster)| Route {
                    r#match: Some(RouteMatch {
                        path_specifier: Some(route_match::PathSpecifier::Prefix((*prefix).into())),
                        ..Default::default()
                    }),
                    action: Some(route::Action::Route(RouteAction {
                        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                            (*cluster).into(),
                        )),
                        ..Default::default()
                    })),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn inline(pem: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(data_source::Specifier::InlineString(pem.into())),
        ..Default::default()
    })
}

/// An SDS secret holding a certificate chain and its key (Istio's `default`).
pub fn certificate_secret(name: &str, chain_pem: &str, key_pem: &str) -> Secret {
    Secret {
        name: name.into(),
        r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(chain_pem),
            private_key: inline(key_pem),
            ..Default::default()
        })),
    }
}

/// An SDS secret holding trusted CAs (Istio's `ROOTCA`).
pub fn validation_secret(name: &str, ca_pem: &str) -> Secret {
    Secret {
        name: name.into(),
        r#type: Some(secret::Type::ValidationContext(
            CertificateValidationContext {
                trusted_ca: inline(ca_pem),
                ..Default::default()
            },
        )),
    }
}

/// A `tcp_proxy` listener that terminates TLS with SDS secret `certificate` from
/// `source`, and asks clients for a certificate signed by secret `validation` if set.
pub fn tls_tcp_proxy_listener(
    name: &str,
    at: SocketAddr,
    cluster: &str,
    source: ConfigSource,
    certificate: &str,
    validation: Option<&str>,
) -> Listener {
    let sds = |name: &str| SdsSecretConfig {
        name: name.into(),
        sds_config: Some(source.clone()),
    };
    let tls = DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds(certificate)],
            validation_context_type: validation.map(|v| {
                common_tls_context::ValidationContextType::ValidationContextSdsSecretConfig(sds(v))
            }),
            ..Default::default()
        }),
        require_client_certificate: validation
            .map(|_| envoy_types::pb::google::protobuf::BoolValue { value: true }),
        ..Default::default()
    };
    let mut listener = tcp_proxy_listener(name, at, cluster);
    listener.filter_chains[0].transport_socket = Some(TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(AdsServer::any(
            &tls,
        ))),
    });
    listener
}

/// `cluster` originating mTLS as Istio's outbound clusters do: its certificate
/// (`certificate`) and trust (`validation`) over SDS from `source`, and the peer's
/// SPIFFE identity `peer_uri` required.
pub fn with_upstream_mtls(
    mut cluster: Cluster,
    source: ConfigSource,
    certificate: &str,
    validation: &str,
    peer_uri: &str,
) -> Cluster {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::subject_alt_name_matcher::SanType;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        SubjectAltNameMatcher, UpstreamTlsContext,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
    let sds = |name: &str| SdsSecretConfig {
        name: name.into(),
        sds_config: Some(source.clone()),
    };
    let tls = UpstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds(certificate)],
            validation_context_type: Some(
                common_tls_context::ValidationContextType::CombinedValidationContext(
                    common_tls_context::CombinedCertificateValidationContext {
                        default_validation_context: Some(CertificateValidationContext {
                            match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
                                san_type: SanType::Uri as i32,
                                matcher: Some(StringMatcher {
                                    match_pattern: Some(string_matcher::MatchPattern::Exact(
                                        peer_uri.into(),
                                    )),
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }],
                            ..Default::default()
                        }),
                        validation_context_sds_secret_config: Some(sds(validation)),
                        ..Default::default()
                    },
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    };
    cluster.transport_socket = Some(TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(AdsServer::any(
            &tls,
        ))),
    });
    cluster
}
