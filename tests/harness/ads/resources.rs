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
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, Listener, filter};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::tcp_proxy::ClusterSpecifier;
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
