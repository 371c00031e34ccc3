//! The bootstrap's static clusters: `prometheus_stats` (Envoy's admin), `agent` (the
//! status server), `sds-grpc` and `xds-grpc` (the agent's Unix sockets), then as the
//! ProxyConfig asks: the tracer's collector (zipkin, lightstep or datadog), the metrics
//! and access-log services, and the `local_cluster` for zone-aware routing. TLS to those
//! services takes its certificates over SDS from the agent (`file-cert:`/`file-root:`
//! for files, `default`/`ROOTCA` for ISTIO_MUTUAL).

use std::path::PathBuf;

use serde_json::{Value, json};

use super::node::Node;
use super::proxy_config::{ClientTls, ProxyConfigView, RemoteService};
use super::{BootstrapError, BootstrapInputs, Network};

const LIGHTSTEP_TOKEN_FILE: &str = "lightstep_access_token.txt";
/// pilot-agent's SDS socket for file-mounted credentials.
const FILE_CREDENTIAL_SOCKET: &str = "./var/run/secrets/credential-uds/files-socket";

/// The configured tracer: its collector cluster and the `tracing` block.
pub struct Tracer {
    kind: TracerKind,
    address: Value,
    tls: Option<Value>,
    /// Lightstep's token is handed to Envoy in a file pilot-agent writes.
    pub token_file: Option<(PathBuf, String)>,
}

enum TracerKind {
    Zipkin,
    Lightstep,
    Datadog,
}

impl Tracer {
    pub fn of(pc: &ProxyConfigView, host_ip: &str) -> Result<Option<Self>, BootstrapError> {
        let Some(tracing) = &pc.tracing else {
            return Ok(None);
        };
        let (kind, address, h2, token_file) = if let Some(z) = &tracing.zipkin {
            (TracerKind::Zipkin, &z.address, false, None)
        } else if let Some(l) = &tracing.lightstep {
            let path = PathBuf::from(&pc.config_path).join(LIGHTSTEP_TOKEN_FILE);
            (
                TracerKind::Lightstep,
                &l.address,
                true,
                Some((path, l.access_token.clone())),
            )
        } else if let Some(d) = &tracing.datadog {
            (TracerKind::Datadog, &d.address, false, None)
        } else {
            // Stackdriver and OpenCensus have no cluster in Istio's template.
            return Ok(None);
        };
        if address.is_empty() {
            return Ok(None);
        }
        let field = match kind {
            TracerKind::Zipkin => "tracing.zipkin.address",
            TracerKind::Lightstep => "tracing.lightstep.address",
            TracerKind::Datadog => "tracing.datadog.address",
        };
        Ok(Some(Self {
            address: socket_address(field, address, host_ip)?,
            tls: tracing
                .tls_settings
                .as_ref()
                .and_then(|t| transport_socket(t, "tracer", h2)),
            kind,
            token_file,
        }))
    }

    fn cluster(&self, net: &Network) -> Value {
        let name = match self.kind {
            TracerKind::Zipkin => "zipkin",
            TracerKind::Lightstep => "lightstep",
            TracerKind::Datadog => "datadog_agent",
        };
        let mut c = json!({
            "name": name,
            "alt_stat_name": format!("{name};"),
            "type": "STRICT_DNS",
            "respect_dns_ttl": true,
            "dns_lookup_family": net.dns_lookup_family,
            "connect_timeout": "1s",
            "lb_policy": "ROUND_ROBIN",
            "load_assignment": load_assignment(name, json!({"socket_address": self.address})),
        });
        match self.kind {
            TracerKind::Zipkin => c["dns_refresh_rate"] = "30s".into(),
            TracerKind::Lightstep => c["typed_extension_protocol_options"] = h2_options(),
            TracerKind::Datadog => {}
        }
        if let Some(tls) = &self.tls {
            c["transport_socket"] = tls.clone();
        }
        c
    }

    /// The `tracing` block; datadog names the service after the node's cluster.
    pub fn tracing(&self, service_cluster: &str) -> Option<Value> {
        let http = match self.kind {
            TracerKind::Zipkin => json!({
                "name": "envoy.tracers.zipkin",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                    "collector_cluster": "zipkin",
                    "collector_endpoint": "/api/v2/spans",
                    "collector_endpoint_version": "HTTP_JSON",
                    "trace_id_128bit": true,
                    "shared_span_context": false,
                }
            }),
            TracerKind::Lightstep => json!({
                "name": "envoy.tracers.lightstep",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.LightstepConfig",
                    "collector_cluster": "lightstep",
                    "access_token_file": self.token_file.as_ref().map(|(p, _)| p.display().to_string()),
                }
            }),
            TracerKind::Datadog => json!({
                "name": "envoy.tracers.datadog",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
                    "collector_cluster": "datadog_agent",
                    "service_name": service_cluster,
                }
            }),
        };
        Some(json!({ "http": http }))
    }
}

pub fn static_clusters(
    inputs: &BootstrapInputs,
    pc: &ProxyConfigView,
    node: &Node,
    net: &Network,
    tracer: Option<&Tracer>,
) -> Result<Vec<Value>, BootstrapError> {
    let host_ip = super::env_host_ip(&inputs.env);
    let mut clusters = vec![
        local_cluster("prometheus_stats", net.localhost, pc.proxy_admin_port),
        local_cluster("agent", net.localhost, pc.status_port),
        pipe_cluster(
            "sds-grpc",
            &format!(
                "./var/run/secrets/workload-spiffe-uds/{}",
                inputs.workload_identity_socket_file
            ),
        ),
    ];
    if node.raw.contains_key("file-credential") {
        clusters.push(pipe_cluster("sds-files-grpc", FILE_CREDENTIAL_SOCKET));
    }
    clusters.push(xds_cluster(&format!("{}/XDS", pc.config_path)));
    if let Some(t) = tracer {
        clusters.push(t.cluster(net));
    }
    for (name, field, service) in [
        (
            "envoy_metrics_service",
            "envoyMetricsService.address",
            &pc.envoy_metrics_service,
        ),
        (
            "envoy_accesslog_service",
            "envoyAccessLogService.address",
            &pc.envoy_access_log_service,
        ),
    ] {
        if let Some(s) = service.as_ref().filter(|s| !s.address.is_empty()) {
            clusters.push(grpc_service_cluster(name, field, s, net, &host_ip)?);
        }
    }
    if node.enable_self_discovery {
        clusters.push(json!({
            "name": "local_cluster",
            "alt_stat_name": "local_cluster;",
            "type": "EDS",
            "connect_timeout": "1s",
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                    "locality_lb_config": {"zone_aware_lb_config": {"min_cluster_size": "1"}},
                }
            }}]},
            "eds_cluster_config": {
                "eds_config": {"ads": {}, "resource_api_version": "V3"},
                "service_name": "local_cluster",
            },
        }));
    }
    Ok(clusters)
}

fn load_assignment(name: &str, address: Value) -> Value {
    json!({
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
    })
}

fn h2_options() -> Value {
    json!({"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }})
}

fn local_cluster(name: &str, localhost: &str, port: u32) -> Value {
    json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
        "type": "STATIC",
        "connect_timeout": "0.250s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": load_assignment(name, json!({"socket_address": {
            "protocol": "TCP", "address": localhost, "port_value": port,
        }})),
    })
}

fn pipe_cluster(name: &str, path: &str) -> Value {
    json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
        "type": "STATIC",
        "typed_extension_protocol_options": h2_options(),
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": load_assignment(name, json!({"pipe": {"path": path}})),
    })
}

/// The agent's xDS proxy socket: one request per connection and no circuit breaking.
fn xds_cluster(path: &str) -> Value {
    let threshold = |priority: &str| {
        json!({"priority": priority, "max_connections": 100000,
               "max_pending_requests": 100000, "max_requests": 100000})
    };
    json!({
        "name": "xds-grpc",
        "alt_stat_name": "xds-grpc;",
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": load_assignment("xds-grpc", json!({"pipe": {"path": path}})),
        "circuit_breakers": {"thresholds": [threshold("DEFAULT"), threshold("HIGH")]},
        "upstream_connection_options": {"tcp_keepalive": {"keepalive_time": 300}},
        "max_requests_per_connection": 1,
        "typed_extension_protocol_options": h2_options(),
    })
}

fn grpc_service_cluster(
    name: &str,
    field: &str,
    service: &RemoteService,
    net: &Network,
    host_ip: &str,
) -> Result<Value, BootstrapError> {
    let mut c = json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
        "type": "STRICT_DNS",
        "respect_dns_ttl": true,
        "dns_lookup_family": net.dns_lookup_family,
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": h2_options(),
        "load_assignment": load_assignment(name, json!({"socket_address": socket_address(field, &service.address, host_ip)?})),
    });
    if let Some(tls) = service
        .tls_settings
        .as_ref()
        .and_then(|t| transport_socket(t, name, true))
    {
        c["transport_socket"] = tls;
    }
    if let Some(k) = &service.tcp_keepalive {
        // Plain numbers: Envoy reads the UInt32Value wrappers so.
        let mut ka = serde_json::Map::new();
        if k.probes > 0 {
            ka.insert("keepalive_probes".into(), k.probes.into());
        }
        for (key, d) in [
            ("keepalive_time", &k.time),
            ("keepalive_interval", &k.interval),
        ] {
            if let Some(secs) = d
                .as_deref()
                .and_then(proto_duration_secs)
                .filter(|s| *s > 0)
            {
                ka.insert(key.into(), secs.into());
            }
        }
        c["upstream_connection_options"] = json!({"tcp_keepalive": ka});
    }
    Ok(c)
}

/// Whole seconds of a protojson duration ("300s", "1.5s").
fn proto_duration_secs(d: &str) -> Option<u64> {
    d.strip_suffix('s')?.parse::<f64>().ok().map(|s| s as u64)
}

/// `host:port` as a socket_address; `$(HOST_IP)` is the node's IP, as Kubernetes would
/// have expanded it in the container's arguments.
pub fn socket_address(field: &str, addr: &str, host_ip: &str) -> Result<Value, BootstrapError> {
    let bad = |reason: &str| BootstrapError::Address {
        field: field.to_owned(),
        reason: format!("{addr:?}: {reason}"),
    };
    let (host, port) = if let Some(rest) = addr.strip_prefix('[') {
        let (h, p) = rest
            .split_once("]:")
            .ok_or_else(|| bad("expected [host]:port"))?;
        (h, p)
    } else {
        let (h, p) = addr
            .rsplit_once(':')
            .ok_or_else(|| bad("expected host:port"))?;
        if h.contains(':') {
            return Err(bad("an IPv6 host needs brackets"));
        }
        (h, p)
    };
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let host = if host == "$(HOST_IP)" && !host_ip.is_empty() {
        host_ip
    } else {
        host
    };
    Ok(json!({"address": host, "port_value": port}))
}

fn sds(name: &str) -> Value {
    json!({
        "name": name,
        "sds_config": {
            "api_config_source": {
                "api_type": "GRPC",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
            },
            "resource_api_version": "V3",
        }
    })
}

/// An UpstreamTlsContext transport socket for ClientTLSSettings; None for no TLS.
/// `sni` is the default SNI of ISTIO_MUTUAL; ALPN (h2) only toward HTTP/2 services.
fn transport_socket(tls: &ClientTls, sni: &str, h2: bool) -> Option<Value> {
    let sans: Vec<Value> = tls
        .subject_alt_names
        .iter()
        .map(|s| json!({"exact": s}))
        .collect();
    let mut validation = json!({"default_validation_context": {}});
    if !sans.is_empty() {
        validation["default_validation_context"] = json!({"match_subject_alt_names": sans});
    }
    let root = |ca: &str| (!ca.is_empty()).then(|| format!("file-root:{ca}"));
    let (certs, root, alpn, sni) = match tls.mode.as_str() {
        "SIMPLE" => (
            vec![],
            root(&tls.ca_certificates),
            vec!["h2"],
            tls.sni.clone(),
        ),
        "MUTUAL" => {
            let cert =
                (!tls.client_certificate.is_empty() && !tls.private_key.is_empty()).then(|| {
                    sds(&format!(
                        "file-cert:{}~{}",
                        tls.client_certificate, tls.private_key
                    ))
                });
            (
                cert.into_iter().collect(),
                root(&tls.ca_certificates),
                vec!["h2"],
                tls.sni.clone(),
            )
        }
        "ISTIO_MUTUAL" => (
            vec![sds("default")],
            Some("ROOTCA".to_owned()),
            vec!["istio", "h2"],
            if tls.sni.is_empty() {
                sni.to_owned()
            } else {
                tls.sni.clone()
            },
        ),
        _ => return None,
    };
    if let Some(root) = root {
        validation["validation_context_sds_secret_config"] = sds(&root);
    }
    let mut common = json!({"combined_validation_context": validation});
    if !certs.is_empty() {
        common["tls_certificate_sds_secret_configs"] = Value::Array(certs);
    }
    if h2 {
        common["alpn_protocols"] = json!(alpn);
    }
    let mut ctx = json!({
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    });
    if !sni.is_empty() {
        ctx["sni"] = sni.into();
    }
    Some(json!({"name": "envoy.transport_sockets.tls", "typed_config": ctx}))
}
