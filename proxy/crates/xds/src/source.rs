//! Where each resource type comes from, as the bootstrap's `dynamic_resources` says:
//! one ADS stream (`ads_config`, used by every `ads: {}` source) or a stream of its own
//! per type (`api_config_source`), each reaching its server through a static cluster
//! (TCP, or a Unix socket `pipe` as Istio's agent listens) or a `google_grpc` target.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::api_config_source::ApiType;
use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
use envoy_types::pb::envoy::config::core::v3::grpc_service::TargetSpecifier;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::transport_socket;
use envoy_types::pb::envoy::config::core::v3::{
    ApiConfigSource, ConfigSource, DataSource, TransportSocket,
};
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::ValidationContextType;
use prost::Message;

pub(crate) use crate::snapshot::{DEFAULT_INITIAL_FETCH_TIMEOUT, fetch_timeout};
use crate::type_url::TypeUrl;

/// How the xDS server is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Tcp(addr) => write!(f, "{addr}"),
            Target::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// One gRPC stream's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stream {
    /// Delta (incremental) rather than state of the world.
    pub delta: bool,
    pub target: Target,
    /// gRPC initial metadata (`grpc_services[0].initial_metadata`).
    pub initial_metadata: Vec<(String, String)>,
    /// Connect timeout (`grpc_services[0].timeout`).
    pub timeout: Option<Duration>,
    pub set_node_on_first_message_only: bool,
    /// TLS to the server, from its cluster's `UpstreamTlsContext`.
    pub tls: Option<Tls>,
    /// The types this stream carries: every ADS type, or one.
    pub types: Vec<TypeUrl>,
    /// The JSON path of its config, for messages.
    pub path: String,
}

/// TLS settings for the xDS server, as PEM read at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    /// `sni`; else the server's IP address is verified.
    pub server_name: Option<String>,
    /// `validation_context.trusted_ca`: the server's certificate must chain to it.
    pub trusted_ca: Vec<u8>,
    /// `tls_certificates[0]`: the client certificate chain and key, for mTLS.
    pub client_certificate: Option<(Vec<u8>, Vec<u8>)>,
}

/// The bootstrap's xDS plan: its streams, and how long a type may take to arrive.
#[derive(Debug, Clone)]
pub struct Plan {
    pub streams: Vec<Stream>,
    pub initial_fetch_timeout: Duration,
    /// Servers in this process (`shunt agent`'s SDS and xDS proxy): a stream to one of
    /// their socket paths calls them instead of connecting.
    pub local: super::local::LocalServers,
    /// Connections shared with other instances' streams (node mode's pods); `None`: this
    /// instance's streams connect on their own.
    pub channels: Option<std::sync::Arc<super::stream::ChannelPool>>,
}

impl Plan {
    /// Asks for Istio's name table on the ADS stream, as istio-agent does when its DNS
    /// proxy is on. False when there is no ADS stream (istiod serves it on ADS only).
    pub fn add_name_table(&mut self) -> bool {
        match self
            .streams
            .iter_mut()
            .find(|s| s.path == "dynamic_resources.ads_config")
        {
            Some(ads) => {
                if !ads.types.contains(&TypeUrl::NameTable) {
                    ads.types.push(TypeUrl::NameTable);
                }
                true
            }
            None => false,
        }
    }
}

/// A bootstrap's xDS plan; `None` when nothing (LDS, CDS, workload discovery) comes over xDS.
pub fn plan(bootstrap: &Bootstrap) -> anyhow::Result<Option<Plan>> {
    // Workload discovery may have a source of its own without `dynamic_resources`.
    let none = Default::default();
    let dynamic = bootstrap.dynamic_resources.as_ref().unwrap_or(&none);
    let mut ads_types = Vec::new();
    let mut streams = Vec::new();
    let mut initial_fetch_timeout = None;
    // Endpoints and routes follow their clusters' and listeners' sources; with ADS every
    // type shares the one stream.
    for (name, source, types) in [
        (
            "cds_config",
            &dynamic.cds_config,
            [TypeUrl::Cluster, TypeUrl::ClusterLoadAssignment],
        ),
        (
            "lds_config",
            &dynamic.lds_config,
            [TypeUrl::Listener, TypeUrl::RouteConfiguration],
        ),
    ] {
        let Some(source) = source else { continue };
        let path = format!("dynamic_resources.{name}");
        initial_fetch_timeout = initial_fetch_timeout.or_else(|| fetch_timeout(source));
        match &source.config_source_specifier {
            Some(ConfigSourceSpecifier::Ads(_)) => ads_types.extend(types),
            Some(ConfigSourceSpecifier::ApiConfigSource(api)) => {
                for kind in types {
                    streams.push(stream(
                        api,
                        vec![kind],
                        bootstrap,
                        &format!("{path}.api_config_source"),
                    )?);
                }
            }
            Some(_) => anyhow::bail!(
                "{path}: only ads and api_config_source (gRPC) config sources are implemented"
            ),
            None => anyhow::bail!("{path}: no config source"),
        }
    }
    // Istio's workload discovery, a bootstrap extension with a source of its own.
    if let Some((source, path)) = workload_source(bootstrap)? {
        match &source.config_source_specifier {
            Some(ConfigSourceSpecifier::Ads(_)) => ads_types.push(TypeUrl::Workload),
            Some(ConfigSourceSpecifier::ApiConfigSource(api)) => streams.push(stream(
                api,
                vec![TypeUrl::Workload],
                bootstrap,
                &format!("{path}.api_config_source"),
            )?),
            Some(_) => anyhow::bail!(
                "{path}: only ads and api_config_source (gRPC) config sources are implemented"
            ),
            None => anyhow::bail!("{path}: no config source"),
        }
    }
    if !ads_types.is_empty() {
        let ads = dynamic.ads_config.as_ref().ok_or_else(|| {
            anyhow::anyhow!("dynamic_resources: a source says ads, but ads_config is not set")
        })?;
        // Secrets come over ADS too when transport sockets name them.
        ads_types.push(TypeUrl::Secret);
        streams.insert(
            0,
            stream(ads, ads_types, bootstrap, "dynamic_resources.ads_config")?,
        );
    }
    if streams.is_empty() {
        return Ok(None);
    }
    Ok(Some(Plan {
        streams,
        initial_fetch_timeout: initial_fetch_timeout.unwrap_or(DEFAULT_INITIAL_FETCH_TIMEOUT),
        local: Default::default(),
        channels: None,
    }))
}

/// The `config_source` of Istio's workload discovery (`istio.workload.BootstrapExtension`
/// in `bootstrap_extensions`, typed or as a `TypedStruct`) and its JSON path, if the
/// bootstrap has it.
fn workload_source(bootstrap: &Bootstrap) -> anyhow::Result<Option<(ConfigSource, String)>> {
    use shunt_core::peer::workload_discovery::{BootstrapExtension, EXTENSION};
    for (i, extension) in bootstrap.bootstrap_extensions.iter().enumerate() {
        let path = shunt_config::JsonPath::new("bootstrap_extensions")
            .index(i)
            .field("typed_config");
        let Some(any) = &extension.typed_config else {
            continue;
        };
        let mut problems = shunt_config::Diagnostics::default();
        let Some(any) = shunt_config::typed_struct::unwrap(any, &path, &mut problems) else {
            // Not ours to judge: validation reports it.
            continue;
        };
        if any.type_url.rsplit('/').next() != Some(EXTENSION) {
            continue;
        }
        let config = BootstrapExtension::decode(any.value.as_slice())
            .map_err(|e| anyhow::anyhow!("{path}: {EXTENSION} does not decode: {e}"))?;
        let source = config
            .config_source
            .ok_or_else(|| anyhow::anyhow!("{path}.config_source: {EXTENSION} needs one"))?;
        return Ok(Some((source, path.field("config_source").into())));
    }
    Ok(None)
}

/// The stream of an SDS `api_config_source` a transport socket names (Istio's
/// `sds-grpc`, a pipe to its agent): secrets only.
pub fn secret_stream(source: &ConfigSource, bootstrap: &Bootstrap) -> anyhow::Result<Stream> {
    let path = "sds_config.api_config_source";
    match &source.config_source_specifier {
        Some(ConfigSourceSpecifier::ApiConfigSource(api)) => {
            stream(api, vec![TypeUrl::Secret], bootstrap, path)
        }
        _ => anyhow::bail!("sds_config: only ads and api_config_source (gRPC) are implemented"),
    }
}

fn stream(
    api: &ApiConfigSource,
    types: Vec<TypeUrl>,
    bootstrap: &Bootstrap,
    path: &str,
) -> anyhow::Result<Stream> {
    let delta = match ApiType::try_from(api.api_type) {
        Ok(ApiType::Grpc | ApiType::AggregatedGrpc) => false,
        Ok(ApiType::DeltaGrpc | ApiType::AggregatedDeltaGrpc) => true,
        Ok(other) => anyhow::bail!(
            "{path}.api_type: {} is not implemented; use GRPC or DELTA_GRPC",
            other.as_str_name()
        ),
        Err(_) => anyhow::bail!("{path}.api_type: unknown value {}", api.api_type),
    };
    let Some(service) = api.grpc_services.first() else {
        anyhow::bail!("{path}.grpc_services: needs one gRPC service");
    };
    let (target, tls) = match &service.target_specifier {
        Some(TargetSpecifier::EnvoyGrpc(grpc)) => cluster_target(
            bootstrap,
            &grpc.cluster_name,
            &format!("{path}.grpc_services[0].envoy_grpc.cluster_name"),
        )?,
        Some(TargetSpecifier::GoogleGrpc(grpc)) => {
            let path = format!("{path}.grpc_services[0].google_grpc.target_uri");
            (uri_target(&grpc.target_uri, &path)?, None)
        }
        None => anyhow::bail!("{path}.grpc_services[0]: no target"),
    };
    let timeout = service.timeout.as_ref().map(|t| {
        Duration::new(
            t.seconds.max(0) as u64,
            t.nanos.clamp(0, 999_999_999) as u32,
        )
    });
    Ok(Stream {
        delta,
        target,
        initial_metadata: service
            .initial_metadata
            .iter()
            .map(|h| (h.key.to_ascii_lowercase(), h.value.clone()))
            .collect(),
        timeout,
        tls,
        set_node_on_first_message_only: api.set_node_on_first_message_only,
        types,
        path: path.to_owned(),
    })
}

/// The first endpoint of static cluster `name`, and TLS if its transport socket asks.
fn cluster_target(
    bootstrap: &Bootstrap,
    name: &str,
    path: &str,
) -> anyhow::Result<(Target, Option<Tls>)> {
    let cluster = bootstrap
        .static_resources
        .iter()
        .flat_map(|r| &r.clusters)
        .find(|c| c.name == name)
        .ok_or_else(|| anyhow::anyhow!("{path}: {name:?} is not a static cluster"))?;
    let tls = match &cluster.transport_socket {
        Some(socket) => upstream_tls(socket, &format!("cluster {name:?}.transport_socket"))?,
        None => None,
    };
    let address = cluster
        .load_assignment
        .iter()
        .flat_map(|a| &a.endpoints)
        .flat_map(|l| &l.lb_endpoints)
        .find_map(|e| match &e.host_identifier {
            Some(HostIdentifier::Endpoint(endpoint)) => endpoint.address.as_ref(),
            _ => None,
        })
        .and_then(|a| a.address.as_ref())
        .ok_or_else(|| anyhow::anyhow!("{path}: cluster {name:?} has no endpoint"))?;
    let target = match address {
        AddressKind::Pipe(pipe) => Target::Unix(PathBuf::from(&pipe.path)),
        AddressKind::SocketAddress(socket) => {
            let port = match socket.port_specifier {
                Some(PortSpecifier::PortValue(port)) => port,
                _ => anyhow::bail!("{path}: cluster {name:?}'s endpoint has no port"),
            };
            let ip: std::net::IpAddr = socket.address.parse().map_err(|_| {
                anyhow::anyhow!(
                    "{path}: cluster {name:?}'s endpoint {:?} is not an IP address",
                    socket.address
                )
            })?;
            let port = u16::try_from(port)
                .map_err(|_| anyhow::anyhow!("{path}: port {port} is out of range"))?;
            Target::Tcp(SocketAddr::new(ip, port))
        }
        AddressKind::EnvoyInternalAddress(_) => {
            anyhow::bail!("{path}: cluster {name:?} has an internal address")
        }
    };
    Ok((target, tls))
}

/// An `UpstreamTlsContext` as TLS settings; `None` for a raw_buffer socket. What shunt
/// cannot honour is refused by name rather than connected to unverified.
fn upstream_tls(socket: &TransportSocket, path: &str) -> anyhow::Result<Option<Tls>> {
    let Some(transport_socket::ConfigType::TypedConfig(any)) = &socket.config_type else {
        return Ok(None);
    };
    if any.type_url.ends_with("RawBuffer") {
        return Ok(None);
    }
    if !any.type_url.ends_with(".UpstreamTlsContext") {
        anyhow::bail!(
            "{path}: transport socket {} is not implemented",
            any.type_url
        );
    }
    let context = UpstreamTlsContext::decode(any.value.as_slice())
        .map_err(|e| anyhow::anyhow!("{path}.typed_config: {e}"))?;
    let common = context.common_tls_context.unwrap_or_default();
    let path = format!("{path}.typed_config.common_tls_context");
    let trusted_ca = match &common.validation_context_type {
        Some(ValidationContextType::ValidationContext(v)) => v.trusted_ca.as_ref(),
        _ => None,
    }
    .ok_or_else(|| {
        anyhow::anyhow!(
            "{path}.validation_context.trusted_ca: needed; shunt does not connect to an \
             unverified xDS server (SDS-provided contexts are not implemented)"
        )
    })?;
    let trusted_ca = data_source(trusted_ca, &format!("{path}.validation_context.trusted_ca"))?;
    let client_certificate = match common.tls_certificates.first() {
        None => None,
        Some(cert) => {
            let chain = cert.certificate_chain.as_ref().ok_or_else(|| {
                anyhow::anyhow!("{path}.tls_certificates[0].certificate_chain: needed")
            })?;
            let key = cert
                .private_key
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("{path}.tls_certificates[0].private_key: needed"))?;
            Some((
                data_source(
                    chain,
                    &format!("{path}.tls_certificates[0].certificate_chain"),
                )?,
                data_source(key, &format!("{path}.tls_certificates[0].private_key"))?,
            ))
        }
    };
    Ok(Some(Tls {
        server_name: (!context.sni.is_empty()).then(|| context.sni.clone()),
        trusted_ca,
        client_certificate,
    }))
}

/// A `DataSource`'s bytes (the data plane's reader, so both name a bad source alike).
fn data_source(source: &DataSource, path: &str) -> anyhow::Result<Vec<u8>> {
    Ok(shunt_tls::data_source::read(source, path)?)
}

/// A `google_grpc` target: `unix:PATH`, `unix://PATH` or `IP:PORT`.
fn uri_target(uri: &str, path: &str) -> anyhow::Result<Target> {
    if let Some(rest) = uri.strip_prefix("unix:") {
        return Ok(Target::Unix(PathBuf::from(
            rest.strip_prefix("//").unwrap_or(rest),
        )));
    }
    uri.parse()
        .map(Target::Tcp)
        .map_err(|_| anyhow::anyhow!("{path}: {uri:?} is neither unix:PATH nor IP:PORT"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bootstrap(json: serde_json::Value) -> Bootstrap {
        shunt_config::message_from_json(json).unwrap()
    }

    #[test]
    fn istio_style_delta_ads_over_a_pipe() {
        let b = bootstrap(serde_json::json!({
            "dynamic_resources": {
                "lds_config": {"ads": {}, "initial_fetch_timeout": "0s"},
                "cds_config": {"ads": {}},
                "ads_config": {
                    "api_type": "DELTA_GRPC",
                    "set_node_on_first_message_only": true,
                    "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"},
                        "initial_metadata": [{"key": "X-Tenant", "value": "a"}]}]
                }
            },
            "static_resources": {"clusters": [{"name": "xds-grpc", "type": "STATIC",
                "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"pipe": {"path": "./etc/istio/proxy/XDS"}}}}]}]}}]}
        }));
        let planned = plan(&b).unwrap().unwrap();
        assert_eq!(planned.streams.len(), 1);
        let ads = &planned.streams[0];
        assert!(ads.delta && ads.set_node_on_first_message_only);
        assert_eq!(ads.target, Target::Unix("./etc/istio/proxy/XDS".into()));
        assert_eq!(ads.initial_metadata, [("x-tenant".into(), "a".into())]);
        assert_eq!(planned.initial_fetch_timeout, Duration::ZERO);
        assert!(ads.types.contains(&TypeUrl::ClusterLoadAssignment));
    }

    #[test]
    fn workload_discovery_rides_ads_or_its_own_source_typed_or_as_a_typed_struct() {
        let ads = bootstrap(serde_json::json!({
            "dynamic_resources": {"ads_config": {"api_type": "GRPC",
                "grpc_services": [{"google_grpc": {"target_uri": "127.0.0.1:15010", "stat_prefix": "x"}}]}},
            "bootstrap_extensions": [{"name": "metadata_discovery", "typed_config": {
                "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
                "value": {"config_source": {"ads": {}}}}}]
        }));
        let streams = plan(&ads).unwrap().unwrap().streams;
        assert_eq!(streams.len(), 1);
        assert!(streams[0].types.contains(&TypeUrl::Workload));

        let own = bootstrap(serde_json::json!({
            "bootstrap_extensions": [{"name": "metadata_discovery", "typed_config": {
                "@type": "type.googleapis.com/istio.workload.BootstrapExtension",
                "config_source": {"api_config_source": {"api_type": "DELTA_GRPC",
                    "grpc_services": [{"google_grpc": {"target_uri": "127.0.0.1:15010", "stat_prefix": "x"}}]}}}}]
        }));
        let streams = plan(&own).unwrap().unwrap().streams;
        assert_eq!(streams.len(), 1);
        assert_eq!(streams[0].types, [TypeUrl::Workload]);
        assert!(streams[0].delta);

        let without_source = bootstrap(serde_json::json!({
            "bootstrap_extensions": [{"name": "metadata_discovery", "typed_config": {
                "@type": "type.googleapis.com/istio.workload.BootstrapExtension"}}]
        }));
        let err = plan(&without_source).unwrap_err().to_string();
        assert!(
            err.starts_with("bootstrap_extensions[0].typed_config.config_source: "),
            "{err}"
        );
    }

    #[test]
    fn per_type_sources_get_a_stream_each_and_errors_name_the_path() {
        let b = bootstrap(serde_json::json!({
            "dynamic_resources": {
                "cds_config": {"api_config_source": {"api_type": "GRPC",
                    "grpc_services": [{"google_grpc": {"target_uri": "127.0.0.1:18000", "stat_prefix": "x"}}]}}
            }
        }));
        let streams = plan(&b).unwrap().unwrap().streams;
        assert_eq!(streams.len(), 2);
        assert_eq!(streams[0].types, [TypeUrl::Cluster]);
        assert_eq!(
            streams[0].target,
            Target::Tcp("127.0.0.1:18000".parse().unwrap())
        );

        let b = bootstrap(serde_json::json!({
            "dynamic_resources": {"cds_config": {"api_config_source": {"api_type": "REST",
                "grpc_services": [{"google_grpc": {"target_uri": "127.0.0.1:1", "stat_prefix": "x"}}]}}}
        }));
        let err = plan(&b).unwrap_err().to_string();
        assert!(
            err.starts_with("dynamic_resources.cds_config.api_config_source.api_type"),
            "{err}"
        );
    }

    #[test]
    fn tls_to_the_server_needs_a_trusted_ca_and_reads_its_files() {
        let with_tls = |context: serde_json::Value| {
            bootstrap(serde_json::json!({
                "dynamic_resources": {"cds_config": {"ads": {}},
                    "ads_config": {"api_type": "GRPC", "grpc_services": [{"envoy_grpc": {"cluster_name": "xds"}}]}},
                "static_resources": {"clusters": [{"name": "xds", "type": "STATIC",
                    "transport_socket": {"name": "tls", "typed_config": context},
                    "load_assignment": {"cluster_name": "xds", "endpoints": [{"lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 1}}}}]}]}}]}
            }))
        };
        let tls =
            "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
        let err = plan(&with_tls(serde_json::json!({"@type": tls})))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("validation_context.trusted_ca: needed"),
            "{err}"
        );

        let err = plan(&with_tls(serde_json::json!({"@type": tls,
            "common_tls_context": {"validation_context": {"trusted_ca": {"filename": "/nonexistent/ca.pem"}}}})))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("trusted_ca.filename: reading /nonexistent/ca.pem"),
            "{err}"
        );

        let planned = plan(&with_tls(serde_json::json!({"@type": tls, "sni": "xds.example",
            "common_tls_context": {"validation_context": {"trusted_ca": {"inline_string": "PEM"}}}})))
        .unwrap()
        .unwrap();
        let tls = planned.streams[0].tls.clone().unwrap();
        assert_eq!(tls.server_name.as_deref(), Some("xds.example"));
        assert_eq!(tls.trusted_ca, b"PEM");
        assert!(tls.client_certificate.is_none());
    }
}
