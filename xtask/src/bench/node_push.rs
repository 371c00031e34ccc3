//! The push `bench node` measures: what istiod sends every sidecar of a namespace
//! without a `Sidecar` resource, for S services of one port each. Per service an
//! `outbound|80||svc-N.bench.svc.cluster.local` EDS cluster in istiod's shape (auto
//! mTLS: the `tlsMode-istio` / `tlsMode-disabled` transport socket matches with SDS
//! `default` and `ROOTCA` from `sds-grpc`, `istio.services` metadata, circuit breakers,
//! `use_downstream_protocol_config`), its endpoints (3 pods, `tlsMode: istio`), and a
//! virtual host in RDS `80`; then `BlackHoleCluster`, `PassthroughCluster`, the inbound
//! clusters, and the listeners `virtualOutbound` (15001), `0.0.0.0_80` (RDS `80`) and
//! `virtualInbound` (15006, mTLS and plain chains).
//!
//! Istio-proxy's own extensions (the Wasm or native stats and metadata exchange
//! filters, the upstream `istio.metadata_exchange` filter) are left out: the same push
//! goes to Envoy 1.40, which has none of them.

use std::net::Ipv4Addr;

use anyhow::{Context, Result};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use harness::ads::resources::named;
use harness::ads::{AdsServer, Any, type_urls};
use prost::Message;
use serde_json::{Value, json};

/// The namespace of the services and of the pods that get the push.
pub const NAMESPACE: &str = "bench";
/// The port of every service (istiod's `0.0.0.0_80` listener and RDS `80`).
const PORT: u16 = 80;
/// The inbound port of the pods themselves (`inbound|8080||`).
const APP_PORT: u16 = 8080;
/// Endpoints per service.
const ENDPOINTS: u8 = 3;

fn host(i: usize) -> String {
    format!("svc-{i}.{NAMESPACE}.svc.cluster.local")
}

fn outbound(i: usize) -> String {
    format!("outbound|{PORT}||{}", host(i))
}

/// The service's ClusterIP: 10.96.0.0/12, one per service.
fn vip(i: usize) -> Ipv4Addr {
    let n = u32::from(Ipv4Addr::new(10, 96, 0, 10)) + i as u32;
    Ipv4Addr::from(n)
}

/// The address of endpoint `e` of service `i`: pod addresses in 10.244.0.0/16 (nothing
/// answers there: the bench measures config, not traffic).
fn endpoint(i: usize, e: u8) -> Ipv4Addr {
    let n = u32::from(Ipv4Addr::new(10, 244, 0, 0)) + (i as u32) * u32::from(ENDPOINTS) + 1;
    Ipv4Addr::from(n + u32::from(e))
}

/// The SDS source istiod names in every transport socket: pilot-agent's `sds-grpc`.
fn sds(name: &str) -> Value {
    json!({"name": name, "sds_config": {
        "api_config_source": {"api_type": "GRPC", "transport_api_version": "V3",
            "set_node_on_first_message_only": true,
            "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]},
        "initial_fetch_timeout": "0s", "resource_api_version": "V3"}})
}

fn ads() -> Value {
    json!({"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"})
}

fn circuit_breakers() -> Value {
    let max = 4_294_967_295u64;
    json!({"thresholds": [{"max_connections": max, "max_pending_requests": max,
        "max_requests": max, "max_retries": max, "track_remaining": true}]})
}

/// `outbound|80||svc-i...` as istiod writes it for a mesh service with auto mTLS.
fn outbound_cluster(i: usize) -> Value {
    let name = outbound(i);
    let service = format!("svc-{i}");
    json!({
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": ads(), "service_name": name},
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": circuit_breakers(),
        "common_lb_config": {"locality_weighted_lb_config": {}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "common_http_protocol_options": {"idle_timeout": "3600s"},
                "use_downstream_protocol_config": {"http_protocol_options": {}, "http2_protocol_options": {}}
            }
        },
        "metadata": {"filter_metadata": {"istio": {
            "services": [{"host": host(i), "name": service, "namespace": NAMESPACE}],
            "default_original_port": PORT}}},
        "transport_socket_matches": [
            {"name": "tlsMode-istio", "match": {"tlsMode": "istio"}, "transport_socket": {
                "name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "common_tls_context": {
                        "tls_params": {"tls_minimum_protocol_version": "TLSv1_2",
                                       "tls_maximum_protocol_version": "TLSv1_3"},
                        "alpn_protocols": ["istio-peer-exchange", "istio"],
                        "tls_certificate_sds_secret_configs": [sds("default")],
                        "combined_validation_context": {
                            "default_validation_context": {"match_subject_alt_names": [
                                {"exact": format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/{service}")}]},
                            "validation_context_sds_secret_config": sds("ROOTCA")
                        }
                    },
                    "sni": format!("outbound_.{PORT}_._.{}", host(i))
                }}},
            {"name": "tlsMode-disabled", "match": {}, "transport_socket": {
                "name": "envoy.transport_sockets.raw_buffer", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}}}
        ]
    })
}

/// An `ORIGINAL_DST` cluster as istiod writes `PassthroughCluster`, and (bound to
/// 127.0.0.6) the inbound ones.
fn original_dst_cluster(name: &str) -> Value {
    let mut cluster = json!({
        "name": name, "type": "ORIGINAL_DST", "connect_timeout": "10s",
        "lb_policy": "CLUSTER_PROVIDED", "circuit_breakers": circuit_breakers()
    });
    if name != "PassthroughCluster" {
        cluster["upstream_bind_config"] =
            json!({"source_address": {"address": "127.0.0.6", "port_value": 0}});
    }
    cluster
}

fn clusters(services: usize) -> Vec<Value> {
    let mut all: Vec<Value> = (0..services).map(outbound_cluster).collect();
    all.push(json!({"name": "BlackHoleCluster", "type": "STATIC", "connect_timeout": "10s"}));
    all.push(original_dst_cluster("PassthroughCluster"));
    all.push(original_dst_cluster("InboundPassthroughClusterIpv4"));
    all.push(original_dst_cluster(&format!("inbound|{APP_PORT}||")));
    all
}

/// Service `i`'s three pods, with istiod's endpoint metadata.
fn endpoints(i: usize) -> Value {
    let lb_endpoints: Vec<Value> = (0..ENDPOINTS)
        .map(|e| {
            json!({
                "endpoint": {"address": {"socket_address": {
                    "address": endpoint(i, e).to_string(), "port_value": PORT}}},
                "metadata": {"filter_metadata": {
                    "envoy.transport_socket_match": {"tlsMode": "istio"},
                    "istio": {"workload": format!("svc-{i}-v1;{NAMESPACE};svc-{i};v1;Kubernetes")}}},
                "load_balancing_weight": 1
            })
        })
        .collect();
    json!({
        "cluster_name": outbound(i),
        "endpoints": [{"locality": {}, "load_balancing_weight": ENDPOINTS, "lb_endpoints": lb_endpoints}]
    })
}

/// RDS `80`: a virtual host per service as istiod writes it, then `allow_any`.
fn route_80(services: usize) -> Value {
    let retry = json!({
        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        "num_retries": 2,
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
        "host_selection_retry_max_attempts": "5"
    });
    let mut virtual_hosts: Vec<Value> = (0..services)
        .map(|i| {
            let short = format!("svc-{i}");
            json!({
                "name": format!("{}:{PORT}", host(i)),
                "domains": [host(i), format!("{short}.{NAMESPACE}.svc"), format!("{short}.{NAMESPACE}"),
                            short, vip(i).to_string()],
                "routes": [{"name": "default", "match": {"prefix": "/"},
                    "route": {"cluster": outbound(i), "timeout": "0s", "retry_policy": retry,
                              "max_grpc_timeout": "0s"},
                    "decorator": {"operation": format!("{}:{PORT}/*", host(i))}}],
                "include_request_attempt_count": true
            })
        })
        .collect();
    virtual_hosts.push(json!({
        "name": "allow_any", "domains": ["*"],
        "routes": [{"name": "allow_any", "match": {"prefix": "/"},
            "route": {"cluster": "PassthroughCluster", "timeout": "0s", "max_grpc_timeout": "0s"}}],
        "include_request_attempt_count": true
    }));
    json!({"name": PORT.to_string(), "virtual_hosts": virtual_hosts, "validate_clusters": false})
}

fn tcp_proxy(stat_prefix: &str, cluster: &str) -> Value {
    json!({"name": "envoy.filters.network.tcp_proxy", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": stat_prefix, "cluster": cluster}})
}

fn http_connection_manager(stat_prefix: &str, routes: Value) -> Value {
    let mut hcm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "use_remote_address": false,
        "normalize_path": true,
        "path_with_escaped_slashes_action": "KEEP_UNCHANGED",
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    });
    for (key, value) in routes.as_object().into_iter().flatten() {
        hcm[key] = value.clone();
    }
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm})
}

fn socket_address(ip: &str, port: u16) -> Value {
    json!({"socket_address": {"address": ip, "port_value": port}})
}

fn listeners() -> Vec<Value> {
    let original_dst = json!({"name": "envoy.filters.listener.original_dst", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"}});
    let tls_inspector = json!({"name": "envoy.filters.listener.tls_inspector", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}});
    let http_inspector = json!({"name": "envoy.filters.listener.http_inspector", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.listener.http_inspector.v3.HttpInspector"}});
    let virtual_outbound = json!({
        "name": "virtualOutbound",
        "address": socket_address("0.0.0.0", 15001),
        "use_original_dst": true,
        "traffic_direction": "OUTBOUND",
        "filter_chains": [{"name": "virtualOutbound-catchall-tcp",
            "filters": [tcp_proxy("PassthroughCluster", "PassthroughCluster")]}]
    });
    let outbound_80 = json!({
        "name": format!("0.0.0.0_{PORT}"),
        "address": socket_address("0.0.0.0", PORT),
        "bind_to_port": false,
        "traffic_direction": "OUTBOUND",
        "listener_filters": [http_inspector.clone()],
        "filter_chains": [{"filter_chain_match": {"application_protocols": ["http/1.1", "h2c"]},
            "filters": [http_connection_manager(&format!("outbound_0.0.0.0_{PORT}"), json!({
                "rds": {"config_source": ads(), "route_config_name": PORT.to_string()}}))]}],
        "default_filter_chain": {"filters": [tcp_proxy("PassthroughCluster", "PassthroughCluster")]}
    });
    let mtls = json!({
    "name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_certificate_sds_secret_configs": [sds("default")],
            "combined_validation_context": {
                "default_validation_context": {},
                "validation_context_sds_secret_config": sds("ROOTCA")
            }
        },
        "require_client_certificate": true
    }});
    let inbound_route = json!({"route_config": {"name": format!("inbound|{APP_PORT}||"),
        "virtual_hosts": [{"name": "inbound|http|8080", "domains": ["*"],
            "routes": [{"name": "default", "match": {"prefix": "/"},
                "route": {"cluster": format!("inbound|{APP_PORT}||"), "timeout": "0s",
                          "max_grpc_timeout": "0s"}}]}],
        "validate_clusters": false}});
    let virtual_inbound = json!({
        "name": "virtualInbound",
        "address": socket_address("0.0.0.0", 15006),
        "traffic_direction": "INBOUND",
        "listener_filters": [original_dst, tls_inspector, http_inspector],
        "filter_chains": [
            {"name": format!("0.0.0.0_{APP_PORT}"),
             "filter_chain_match": {"destination_port": APP_PORT, "transport_protocol": "tls"},
             "transport_socket": mtls.clone(),
             "filters": [http_connection_manager(&format!("inbound_0.0.0.0_{APP_PORT}"), inbound_route.clone())]},
            {"name": format!("0.0.0.0_{APP_PORT}"),
             "filter_chain_match": {"destination_port": APP_PORT, "transport_protocol": "raw_buffer"},
             "filters": [http_connection_manager(&format!("inbound_0.0.0.0_{APP_PORT}"), inbound_route)]},
            {"name": "virtualInbound-catchall-tls", "filter_chain_match": {"transport_protocol": "tls"},
             "transport_socket": mtls,
             "filters": [tcp_proxy("InboundPassthroughClusterIpv4", "InboundPassthroughClusterIpv4")]},
            {"name": "virtualInbound", "filter_chain_match": {"transport_protocol": "raw_buffer"},
             "filters": [tcp_proxy("InboundPassthroughClusterIpv4", "InboundPassthroughClusterIpv4")]}
        ]
    });
    vec![virtual_outbound, outbound_80, virtual_inbound]
}

fn message<M: Message + prost::Name + Default>(value: Value) -> Result<(String, Any)> {
    let name = value["name"]
        .as_str()
        .or(value["cluster_name"].as_str())
        .unwrap_or_default()
        .to_owned();
    let message: M = shunt::config::message_from_json(value)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("the bench's {} {name}", M::NAME))?;
    Ok(named(&name, &message))
}

/// One type's resources as the ADS server serves them.
pub struct TypePush {
    pub type_url: &'static str,
    pub resources: Vec<(String, Any)>,
}

/// The whole push for `services` services, by type (CDS, EDS, LDS, RDS).
pub struct Push {
    pub services: usize,
    pub types: Vec<TypePush>,
}

impl Push {
    pub fn new(services: usize) -> Result<Push> {
        let each = |values: Vec<Value>, f: fn(Value) -> Result<(String, Any)>| {
            values.into_iter().map(f).collect::<Result<Vec<_>>>()
        };
        let types = vec![
            TypePush {
                type_url: type_urls::CLUSTER,
                resources: each(clusters(services), message::<Cluster>)?,
            },
            TypePush {
                type_url: type_urls::ENDPOINT,
                resources: each(
                    (0..services).map(endpoints).collect(),
                    message::<ClusterLoadAssignment>,
                )?,
            },
            TypePush {
                type_url: type_urls::LISTENER,
                resources: each(listeners(), message::<Listener>)?,
            },
            TypePush {
                type_url: type_urls::ROUTE,
                resources: vec![message::<RouteConfiguration>(route_80(services))?],
            },
        ];
        Ok(Push { services, types })
    }

    /// Serves the push to every node of `ads`, each type at `version`.
    pub fn serve(&self, ads: &AdsServer, version: &str) {
        for t in &self.types {
            ads.set(t.type_url, version, t.resources.clone());
        }
    }

    /// The bytes of the push on the wire: each type's `DiscoveryResponse`, encoded.
    pub fn wire_bytes(&self) -> usize {
        self.types
            .iter()
            .map(|t| {
                DiscoveryResponse {
                    version_info: "1".into(),
                    resources: t.resources.iter().map(|(_, any)| any.clone()).collect(),
                    type_url: t.type_url.into(),
                    nonce: "1".into(),
                    ..Default::default()
                }
                .encoded_len()
            })
            .sum()
    }
}
