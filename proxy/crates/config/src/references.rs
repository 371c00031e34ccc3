//! What an accepted resource makes the client subscribe to: the RDS route
//! configurations a listener's HTTP connection managers name, and the SDS secrets its
//! (or a cluster's) TLS transport sockets name, each with the config source it comes
//! from. A listener or cluster warms until these arrive, as in Envoy.

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
use envoy_types::pb::envoy::config::core::v3::{ConfigSource, TransportSocket, transport_socket};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::RouteSpecifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::ValidationContextType;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, UpstreamTlsContext,
};
use prost::{Message, Name};

/// A secret a transport socket names, with where it comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct SecretRef {
    pub name: String,
    pub source: SecretSource,
}

/// Where a named secret comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum SecretSource {
    /// No `sds_config`: one of the bootstrap's `static_resources.secrets`.
    Static,
    /// `sds_config: {ads: {}}`: the ADS stream.
    Ads,
    /// Its own SDS stream (Istio's `sds-grpc` cluster to the agent).
    Api(Box<ConfigSource>),
}

/// The RDS route configurations a listener's HTTP connection managers name.
pub fn rds_names(listener: &Listener) -> Vec<String> {
    super::http_connection_managers(listener)
        .into_iter()
        .filter_map(|hcm| match hcm.route_specifier {
            Some(RouteSpecifier::Rds(rds)) => Some(rds.route_config_name),
            _ => None,
        })
        .collect()
}

/// The secrets a listener's filter chains terminate TLS with.
pub fn listener_secrets(listener: &Listener) -> Vec<SecretRef> {
    listener
        .filter_chains
        .iter()
        .chain(&listener.default_filter_chain)
        .filter_map(|chain| chain.transport_socket.as_ref())
        .filter_map(decode::<DownstreamTlsContext>)
        .filter_map(|tls| tls.common_tls_context)
        .flat_map(|common| secrets_of(&common))
        .collect()
}

/// The secrets a cluster originates TLS with (its transport socket and its matches).
pub fn cluster_secrets(cluster: &Cluster) -> Vec<SecretRef> {
    cluster
        .transport_socket
        .iter()
        .chain(
            cluster
                .transport_socket_matches
                .iter()
                .filter_map(|m| m.transport_socket.as_ref()),
        )
        .filter_map(decode::<UpstreamTlsContext>)
        .filter_map(|tls| tls.common_tls_context)
        .flat_map(|common| secrets_of(&common))
        .collect()
}

fn decode<M: Message + Name + Default>(socket: &TransportSocket) -> Option<M> {
    let Some(transport_socket::ConfigType::TypedConfig(any)) = &socket.config_type else {
        return None;
    };
    if !any.type_url.ends_with(&M::full_name()) {
        return None;
    }
    M::decode(any.value.as_slice()).ok()
}

fn secrets_of(common: &CommonTlsContext) -> Vec<SecretRef> {
    let validation = match &common.validation_context_type {
        Some(ValidationContextType::ValidationContextSdsSecretConfig(sds)) => Some(sds),
        Some(ValidationContextType::CombinedValidationContext(combined)) => {
            combined.validation_context_sds_secret_config.as_ref()
        }
        _ => None,
    };
    common
        .tls_certificate_sds_secret_configs
        .iter()
        .chain(validation)
        .map(secret_ref)
        .collect()
}

fn secret_ref(sds: &SdsSecretConfig) -> SecretRef {
    let source = match &sds.sds_config {
        None => SecretSource::Static,
        Some(source) => match &source.config_source_specifier {
            Some(ConfigSourceSpecifier::Ads(_)) => SecretSource::Ads,
            _ => SecretSource::Api(Box::new(source.clone())),
        },
    };
    SecretRef {
        name: sds.name.clone(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::AggregatedConfigSource;
    use envoy_types::pb::envoy::config::listener::v3::FilterChain;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::CombinedCertificateValidationContext;
    use envoy_types::pb::google::protobuf::Any;

    fn socket<M: Message + Name>(message: &M) -> TransportSocket {
        TransportSocket {
            name: "envoy.transport_sockets.tls".into(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(Any {
                type_url: M::type_url(),
                value: message.encode_to_vec(),
            })),
        }
    }

    fn sds(name: &str, source: Option<ConfigSource>) -> SdsSecretConfig {
        SdsSecretConfig {
            name: name.into(),
            sds_config: source,
        }
    }

    #[test]
    fn istio_style_tls_names_its_certificate_and_root_ca_with_their_sources() {
        let ads = ConfigSource {
            config_source_specifier: Some(ConfigSourceSpecifier::Ads(
                AggregatedConfigSource::default(),
            )),
            ..Default::default()
        };
        let tls = DownstreamTlsContext {
            common_tls_context: Some(CommonTlsContext {
                tls_certificate_sds_secret_configs: vec![sds("default", Some(ads.clone()))],
                validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                    CombinedCertificateValidationContext {
                        validation_context_sds_secret_config: Some(sds("ROOTCA", None)),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            }),
            ..Default::default()
        };
        let listener = Listener {
            filter_chains: vec![FilterChain {
                transport_socket: Some(socket(&tls)),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(
            listener_secrets(&listener),
            vec![
                SecretRef {
                    name: "default".into(),
                    source: SecretSource::Ads
                },
                SecretRef {
                    name: "ROOTCA".into(),
                    source: SecretSource::Static
                },
            ]
        );
        // The same context as an upstream one is not a listener's.
        let cluster = Cluster {
            transport_socket: Some(socket(&UpstreamTlsContext {
                common_tls_context: tls.common_tls_context.clone(),
                ..Default::default()
            })),
            ..Default::default()
        };
        assert_eq!(cluster_secrets(&cluster).len(), 2);
        assert!(
            listener_secrets(&Listener {
                filter_chains: vec![FilterChain {
                    transport_socket: cluster.transport_socket.clone(),
                    ..Default::default()
                }],
                ..Default::default()
            })
            .is_empty()
        );
    }
}
