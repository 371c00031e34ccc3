//! The Envoy bootstrap pilot-agent would write (`envoy-rev.json`), generated from what
//! pilot-agent reads: the pod's environment, the merged ProxyConfig ([`ProxyConfig`])
//! and its own options. A typed builder, not a template engine: each part of the
//! bootstrap is built where its concern lives — the node and its metadata ([`node`]),
//! stats tags, inclusion lists and sinks ([`stats`]), static clusters ([`clusters`]),
//! the 15090/15021 (and secure metrics) listeners ([`listeners`]) — and [`render`] puts
//! them together in the shape of Istio's `envoy_bootstrap.json` template.
//! [`BootstrapInputs::from_pod`] ([`pod`]) fills the inputs from a pod's environment and
//! files.
//!
//! Checked against the 30 golden bootstraps of Istio's `pkg/bootstrap` test
//! (`tests/agent_bootstrap.rs`).

mod clusters;
mod listeners;
mod node;
mod pod;
mod proxy_config;
mod stats;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::{Map, Value, json};

pub use pod::{PodFiles, parse_downward_api};
pub use proxy_config::{ProxyConfig, ProxyConfigView};

/// Everything pilot-agent's bootstrap depends on. `shunt agent` fills it from its
/// environment and files; the golden test from each case's inputs.
#[derive(Clone, Debug)]
pub struct BootstrapInputs {
    /// `sidecar~IP~POD.NS~NS.svc.cluster.local` (see [`node_id`]).
    pub node_id: String,
    /// The process environment, in order: `ISTIO_META_*`, `ISTIO_METAJSON_*`,
    /// `POD_NAME`, `POD_NAMESPACE`, `SERVICE_ACCOUNT`, `DNS_PROXY_ADDR`, `HOST_IP` and
    /// pilot-agent's feature switches (`ISTIO_DELTA_XDS`, `ISTIO_DUAL_STACK`,
    /// `ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL`,
    /// `HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED`).
    pub env: Vec<(String, String)>,
    /// The merged ProxyConfig (mesh `defaultConfig`, `PROXY_CONFIG`, annotation).
    pub proxy_config: ProxyConfig,
    /// The pod's IPs (`INSTANCE_IP` and the interfaces'); repeats are dropped.
    pub instance_ips: Vec<String>,
    /// The SANs istiod's certificate must carry.
    pub pilot_san: Vec<String>,
    pub outlier_log_path: String,
    /// The downward API's `annotations` file, if there is one.
    pub annotations: Option<BTreeMap<String, String>>,
    /// The downward API's `labels` file, if there is one.
    pub pod_labels: Option<BTreeMap<String, String>>,
    pub platform_metadata: BTreeMap<String, String>,
    /// region, zone, sub_zone from the platform, used when no label names a locality.
    pub platform_locality: [String; 3],
    pub envoy_prometheus_port: u16,
    pub envoy_status_port: u16,
    /// 0: no mTLS listener for Envoy's own stats.
    pub secure_metrics_port: u16,
    /// 0: no mTLS listener for the merged (agent + app + Envoy) metrics.
    pub secure_merged_metrics_port: u16,
    /// 0: no STS server.
    pub sts_port: u16,
    pub exit_on_zero_active_connections: bool,
    /// None: on for ambient (`ENABLE_HBONE`) proxies only.
    pub metadata_discovery: Option<bool>,
    pub envoy_skip_deprecated_logs: bool,
    /// The SDS socket's file name under `./var/run/secrets/workload-spiffe-uds/`.
    pub workload_identity_socket_file: String,
    pub credential_socket_exists: bool,
    pub custom_credentials_file_exists: bool,
    /// `fips-140-2` caps Envoy's google_grpc TLS at 1.2.
    pub compliance_policy: String,
    /// Envoy's own log lines as JSON.
    pub log_as_json: bool,
    /// pilot-agent's version, the default `ISTIO_VERSION`.
    pub istio_version: String,
}

impl Default for BootstrapInputs {
    fn default() -> Self {
        Self {
            node_id: String::new(),
            env: Vec::new(),
            proxy_config: ProxyConfig::istio_defaults(),
            instance_ips: Vec::new(),
            pilot_san: Vec::new(),
            outlier_log_path: String::new(),
            annotations: None,
            pod_labels: None,
            platform_metadata: BTreeMap::new(),
            platform_locality: Default::default(),
            envoy_prometheus_port: 15090,
            envoy_status_port: 15021,
            secure_metrics_port: 0,
            secure_merged_metrics_port: 0,
            sts_port: 0,
            exit_on_zero_active_connections: false,
            metadata_discovery: None,
            envoy_skip_deprecated_logs: false,
            workload_identity_socket_file: "socket".into(),
            credential_socket_exists: false,
            custom_credentials_file_exists: false,
            compliance_policy: String::new(),
            log_as_json: false,
            istio_version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// The proxy's role in the node id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeType {
    Sidecar,
    Router,
    Waypoint,
}

/// pilot-agent's node id: `TYPE~IP~POD.NS~NS.DOMAIN` (domain `svc.cluster.local`).
pub fn node_id(kind: NodeType, ip: &str, pod: &str, namespace: &str, domain: &str) -> String {
    let t = match kind {
        NodeType::Sidecar => "sidecar",
        NodeType::Router => "router",
        NodeType::Waypoint => "waypoint",
    };
    format!("{t}~{ip}~{pod}.{namespace}~{namespace}.{domain}")
}

/// The bootstrap and the files pilot-agent writes beside it.
#[derive(Clone, Debug)]
pub struct Rendered {
    pub bootstrap: Value,
    /// (path, contents): the Lightstep access token file.
    pub files: Vec<(PathBuf, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("ProxyConfig from {source_name}: {reason}")]
    ProxyConfig { source_name: String, reason: String },
    #[error("node metadata {key}: {reason}")]
    Metadata { key: String, reason: String },
    #[error("ProxyConfig {field}: {reason}")]
    Address { field: String, reason: String },
}

/// Renders the bootstrap pilot-agent would write for these inputs.
pub fn render(inputs: &BootstrapInputs) -> Result<Rendered, BootstrapError> {
    let pc = inputs.proxy_config.view()?;
    let node = node::build(inputs, &pc)?;
    let env = &inputs.env;
    let switch = |name: &str, default: bool| {
        node::env_value(env, name)
            .and_then(|v| v.parse::<bool>().ok())
            .unwrap_or(default)
    };
    // A waypoint always speaks Delta; metadata discovery needs Delta.
    let delta = switch("ISTIO_DELTA_XDS", true) || inputs.node_id.starts_with("waypoint~");
    let metadata_discovery =
        (node.metadata_discovery || inputs.node_id.starts_with("waypoint~")) && delta;
    let net = Network::of(&node.instance_ips, switch("ISTIO_DUAL_STACK", false));

    let mut files = Vec::new();
    let mut b = Map::new();
    b.insert(
        "application_log_config".into(),
        application_log_config(inputs),
    );
    b.insert("node".into(), node.json());
    b.insert(
        "layered_runtime".into(),
        json!({"layers": [
            {"name": "global config", "static_layer": runtime_flags(inputs, &pc)},
            {"name": "admin", "admin_layer": {}},
        ]}),
    );
    b.insert(
        "bootstrap_extensions".into(),
        bootstrap_extensions(metadata_discovery),
    );
    let stats = stats::Stats::of(&node, &pc, inputs.exit_on_zero_active_connections);
    if let Some(flush) = &stats.flush_interval {
        b.insert("stats_flush_interval".into(), flush.clone().into());
    }
    if let Some(evict) = &stats.eviction_interval {
        b.insert("stats_eviction_interval".into(), evict.clone().into());
    }
    b.insert("stats_config".into(), stats.config(metadata_discovery));
    b.insert("admin".into(), admin(&net, &pc));
    b.insert("dynamic_resources".into(), dynamic_resources(delta));
    let tracer = clusters::Tracer::of(&pc, &env_host_ip(env))?;
    if let Some((path, token)) = tracer.as_ref().and_then(|t| t.token_file.clone()) {
        files.push((path, token));
    }
    let clusters = clusters::static_clusters(inputs, &pc, &node, &net, tracer.as_ref())?;
    let listeners = listeners::static_listeners(
        inputs,
        &pc,
        &net,
        switch("ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL", false),
    );
    b.insert(
        "static_resources".into(),
        json!({"clusters": clusters, "listeners": listeners}),
    );
    b.insert("overload_manager".into(), overload_manager(&pc));
    if let Some(t) = tracer.as_ref().and_then(|t| t.tracing(&node.cluster)) {
        b.insert("tracing".into(), t);
    }
    let sinks = stats::sinks(&pc, &env_host_ip(env))?;
    if !sinks.is_empty() {
        b.insert("stats_sinks".into(), Value::Array(sinks));
    }
    if let Some(cluster_manager) = cluster_manager(inputs, &node)? {
        b.insert("cluster_manager".into(), cluster_manager);
    }
    b.insert(
        "deferred_stat_options".into(),
        json!({"enable_deferred_creation_stats": true}),
    );
    Ok(Rendered {
        bootstrap: Value::Object(b),
        files,
    })
}

/// Envoy's log format: pilot-agent's JSON one or its text one.
fn application_log_config(inputs: &BootstrapInputs) -> Value {
    let log_format = if inputs.log_as_json {
        json!({"json_format": {
            "time": "%Y-%m-%dT%T.%fZ", "level": "%l", "scope": "envoy %n",
            "msg": "%j", "caller": "%g:%#", "thread": "%t"}})
    } else {
        json!({"text_format": "%Y-%m-%dT%T.%fZ\t%l\tenvoy %n %g:%#\t%v\tthread=%t"})
    };
    json!({ "log_format": log_format })
}

/// Istio's metadata discovery (when on) and the internal listener extension.
fn bootstrap_extensions(metadata_discovery: bool) -> Value {
    let mut extensions = Vec::new();
    if metadata_discovery {
        extensions.push(json!({
            "name": "metadata_discovery",
            "typed_config": {
                "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
                "value": {"config_source": {"ads": {}}},
            }
        }));
    }
    extensions.push(json!({
        "name": "envoy.bootstrap.internal_listener",
        "typed_config": {
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
            "value": {"buffer_size_kb": 64},
        }
    }));
    Value::Array(extensions)
}

/// The admin listener, on the pod's localhost.
fn admin(net: &Network, pc: &ProxyConfigView) -> Value {
    json!({
        "access_log": [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": "/dev/null",
            }
        }],
        "profile_path": "/var/lib/istio/data/envoy.prof",
        "address": {"socket_address": {"address": net.localhost, "port_value": pc.proxy_admin_port}},
    })
}

/// LDS and CDS over ADS, Delta or State of the World.
fn dynamic_resources(delta: bool) -> Value {
    let xds_type = if delta { "DELTA_GRPC" } else { "GRPC" };
    json!({
        "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
        "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
        "ads_config": {
            "api_type": xds_type,
            "set_node_on_first_message_only": true,
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}],
        },
    })
}

/// The global downstream connection limit.
fn overload_manager(pc: &ProxyConfigView) -> Value {
    json!({"resource_monitors": [{
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": global_downstream_max_connections(pc),
        }
    }]})
}

/// `cluster_manager`, when something sets it: the local cluster for self discovery,
/// the outlier log, the load stats config from the node metadata.
fn cluster_manager(
    inputs: &BootstrapInputs,
    node: &node::Node,
) -> Result<Option<Value>, BootstrapError> {
    let lrs = node
        .raw
        .get("LOAD_STATS_CONFIG_JSON")
        .and_then(Value::as_str)
        .map(|s| {
            serde_json::from_str::<Value>(s).map_err(|e| BootstrapError::Metadata {
                key: "LOAD_STATS_CONFIG_JSON".into(),
                reason: format!("not JSON: {e}"),
            })
        })
        .transpose()?;
    if !inputs.outlier_log_path.is_empty() || lrs.is_some() || node.enable_self_discovery {
        let mut cm = Map::new();
        if node.enable_self_discovery {
            cm.insert("local_cluster_name".into(), "local_cluster".into());
        }
        if !inputs.outlier_log_path.is_empty() {
            cm.insert(
                "outlier_detection".into(),
                json!({"event_log_path": inputs.outlier_log_path}),
            );
        }
        if let Some(lrs) = lrs {
            cm.insert("load_stats_config".into(), lrs);
        }
        cm.insert("enable_deferred_cluster_creation".into(), true.into());
        return Ok(Some(Value::Object(cm)));
    }
    Ok(None)
}

fn env_host_ip(env: &[(String, String)]) -> String {
    node::env_value(env, "HOST_IP").unwrap_or_default()
}

/// The addresses the bootstrap binds and resolves with, from the pod's IP families.
pub(crate) struct Network {
    localhost: &'static str,
    wildcard: &'static str,
    /// With dual stack: the other family's localhost and wildcard.
    additional: Option<(&'static str, &'static str)>,
    dns_lookup_family: &'static str,
}

impl Network {
    fn of(ips: &[String], dual_stack_enabled: bool) -> Self {
        let v4 = |s: &String| s.parse::<std::net::Ipv4Addr>().is_ok();
        let v6 = |s: &String| s.parse::<std::net::Ipv6Addr>().is_ok();
        let ipv4 = Self {
            localhost: "127.0.0.1",
            wildcard: "0.0.0.0",
            additional: None,
            dns_lookup_family: "V4_ONLY",
        };
        if ips.iter().all(v4) {
            return ipv4;
        }
        if ips.iter().all(v6) {
            return Self {
                localhost: "::1",
                wildcard: "::",
                additional: None,
                dns_lookup_family: "V6_ONLY",
            };
        }
        if !dual_stack_enabled {
            return ipv4;
        }
        if ips.first().is_some_and(v6) {
            Self {
                localhost: "::1",
                wildcard: "::",
                additional: Some(("127.0.0.1", "0.0.0.0")),
                dns_lookup_family: "ALL",
            }
        } else {
            Self {
                additional: Some(("::1", "::")),
                dns_lookup_family: "ALL",
                ..ipv4
            }
        }
    }
}

/// The runtime layer: Istio's defaults, then the ProxyConfig's `runtimeValues` ("" drops
/// a default; "true"/"false" become booleans, as Envoy no longer takes them as strings).
fn runtime_flags(inputs: &BootstrapInputs, pc: &ProxyConfigView) -> Value {
    let mut flags = Map::new();
    flags.insert("re2.max_program_size.error_level".into(), "32768".into());
    flags.insert(
        "envoy.deprecated_features:envoy.config.listener.v3.Listener.hidden_envoy_deprecated_use_original_dst".into(),
        true.into(),
    );
    flags.insert(
        "envoy.reloadable_features.http_reject_path_with_fragment".into(),
        false.into(),
    );
    flags.insert(
        "envoy.reloadable_features.fixed_heap_use_allocated".into(),
        true.into(),
    );
    // Off in Istio for envoyproxy/envoy#45212.
    flags.insert(
        "envoy.reloadable_features.coalesce_lb_rebuilds_on_batch_update".into(),
        false.into(),
    );
    if inputs.compliance_policy == "fips-140-2" {
        flags.insert(
            "envoy.reloadable_features.google_grpc_disable_tls_13".into(),
            true.into(),
        );
    }
    let strip_fragment = node::env_value(
        &inputs.env,
        "HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED",
    )
    .and_then(|v| v.parse::<bool>().ok())
    .unwrap_or(true);
    if !strip_fragment {
        flags.insert(
            "envoy.reloadable_features.http_strip_fragment_from_path_unsafe_if_disabled".into(),
            "false".into(),
        );
    }
    for (k, v) in &pc.runtime_values {
        match v.as_str() {
            "" => {
                flags.remove(k);
            }
            "true" => {
                flags.insert(k.clone(), true.into());
            }
            "false" => {
                flags.insert(k.clone(), false.into());
            }
            _ => {
                flags.insert(k.clone(), v.clone().into());
            }
        }
    }
    Value::Object(flags)
}

/// The overload manager's connection cap: ProxyConfig `connectionSettings`, then the
/// `ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS` proxy metadata, then the deprecated
/// runtime value, else unlimited (i32::MAX).
fn global_downstream_max_connections(pc: &ProxyConfigView) -> i64 {
    if let Some(limit) = pc
        .connection_settings
        .as_ref()
        .and_then(|c| c.global_downstream_connection_limit)
        .filter(|v| *v > 0)
    {
        return limit;
    }
    if let Some(v) = pc
        .proxy_metadata
        .get("ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS")
        .and_then(|v| v.parse::<i64>().ok())
    {
        return v;
    }
    pc.runtime_values
        .get("overload.global_downstream_max_connections")
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(i32::MAX as i64)
}
