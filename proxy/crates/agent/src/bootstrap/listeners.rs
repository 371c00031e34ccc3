//! The bootstrap's static listeners: Prometheus stats on 15090 (compressed if the
//! scraper asks), the optional mTLS metrics listeners (Envoy's stats; the merged agent +
//! app + Envoy metrics), and readiness on 15021, all outside the connection limit and
//! the overload manager so a loaded proxy still answers its probes.

use serde_json::{Value, json};

use super::proxy_config::ProxyConfigView;
use super::{BootstrapInputs, Network};

const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

pub fn static_listeners(
    inputs: &BootstrapInputs,
    pc: &ProxyConfigView,
    net: &Network,
    status_proxy_protocol: bool,
) -> Vec<Value> {
    let localhost_only = pc
        .proxy_metadata
        .get("METRICS_LOCALHOST_ACCESS_ONLY")
        .is_some_and(|v| v == "true");
    let (addr, extra) = if localhost_only {
        (net.localhost, net.additional.map(|a| a.0))
    } else {
        (net.wildcard, net.additional.map(|a| a.1))
    };
    let prom_port = inputs.envoy_prometheus_port;
    let compress = pc.stats_compression.unwrap_or(true);
    let mut filters: Vec<Value> = Vec::new();
    if compress {
        for algo in ["brotli", "zstd", "gzip"] {
            filters.push(compressor(algo));
        }
    }
    filters.push(router());
    let mut prometheus = listener(addr, prom_port, extra);
    prometheus["filter_chains"] = json!([{"filters": [hcm(
        "stats",
        json!([route("/stats/prometheus", "prometheus_stats")]),
        filters,
    )]}]);
    let mut listeners = vec![prometheus];

    for (port, stat_prefix, routes) in [
        (
            inputs.secure_metrics_port,
            "secure_stats",
            json!([route("/stats/prometheus", "prometheus_stats")]),
        ),
        (
            inputs.secure_merged_metrics_port,
            "secure_merged_stats",
            json!([
                route("/stats/prometheus", "agent"),
                route("/metrics", "agent")
            ]),
        ),
    ] {
        if port == 0 {
            continue;
        }
        let mut l = listener(net.wildcard, port, None);
        l["listener_filters"] = json!([{
            "name": "envoy.filters.listener.tls_inspector",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"},
        }]);
        l["filter_chains"] = json!([{
            "filter_chain_match": {"transport_protocol": "tls"},
            "transport_socket": workload_mtls(),
            "filters": [hcm(stat_prefix, routes, vec![router()])],
        }]);
        listeners.push(l);
    }

    let status_port = inputs.envoy_status_port;
    let mut status = listener(net.wildcard, status_port, net.additional.map(|a| a.1));
    if status_proxy_protocol {
        status["listener_filters"] = json!([{
            "name": "envoy.listener.proxy_protocol",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol",
                "allow_requests_without_proxy_protocol": true,
            }
        }]);
    }
    status["filter_chains"] = json!([{"filters": [hcm(
        "agent",
        json!([route("/healthz/ready", "agent")]),
        vec![router()],
    )]}]);
    listeners.push(status);
    listeners
}

fn listener(address: &str, port: u16, additional: Option<&str>) -> Value {
    let sa =
        |a: &str| json!({"socket_address": {"protocol": "TCP", "address": a, "port_value": port}});
    let mut l = json!({
        "name": format!("{address}_{port}"),
        "address": sa(address),
        "ignore_global_conn_limit": true,
        "bypass_overload_manager": true,
    });
    if let Some(a) = additional {
        // Istio's template spells this field in camelCase; protojson reads both.
        l["additionalAddresses"] = json!([{"address": sa(a)}]);
    }
    l
}

fn route(prefix: &str, cluster: &str) -> Value {
    json!({"match": {"prefix": prefix}, "route": {"cluster": cluster}})
}

fn router() -> Value {
    json!({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    })
}

fn hcm(stat_prefix: &str, routes: Value, http_filters: Vec<Value>) -> Value {
    json!({
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": HCM,
            "codec_type": "AUTO",
            "stat_prefix": stat_prefix,
            "route_config": {"virtual_hosts": [{"name": "backend", "domains": ["*"], "routes": routes}]},
            "http_filters": http_filters,
        }
    })
}

fn compressor(algo: &str) -> Value {
    let library = match algo {
        "brotli" => "type.googleapis.com/envoy.extensions.compression.brotli.compressor.v3.Brotli",
        "zstd" => "type.googleapis.com/envoy.extensions.compression.zstd.compressor.v3.Zstd",
        _ => "type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip",
    };
    json!({
        "name": format!("envoy.filters.http.compressor.{algo}"),
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor",
            "compressor_library": {"name": format!("stats_{algo}"), "typed_config": {"@type": library}},
            "response_direction_config": {"common_config": {"content_type": [
                "text/plain",
                "application/vnd.google.protobuf",
                "application/openmetrics-text",
                "application/openmetrics-protobuf",
            ]}},
        }
    })
}

/// The workload certificate and mesh root over SDS; the client must present one.
fn workload_mtls() -> Value {
    let sds = |name: &str| {
        json!({"name": name, "sds_config": {
            "api_config_source": {
                "api_type": "GRPC",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
            },
            "resource_api_version": "V3",
        }})
    };
    json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": true,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [sds("default")],
                "combined_validation_context": {
                    "default_validation_context": {},
                    "validation_context_sds_secret_config": sds("ROOTCA"),
                },
            },
        }
    })
}
