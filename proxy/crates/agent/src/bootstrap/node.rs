//! The bootstrap's `node`: id, cluster, locality and metadata, as pilot-agent's
//! `GetNodeMetaData` builds them. Metadata comes from `ISTIO_META_*` (and the
//! ProxyConfig's `proxyMetadata` entries so prefixed) as strings, `ISTIO_METAJSON_*` as
//! JSON objects merged in, then Istio's typed fields (`model.NodeMetadata`) are converted
//! to their types (ports are numbers, flags are "true"/"false" strings, IP lists are
//! comma-joined) and laid over the untyped ones; an untyped key whose typed field is
//! empty stays as it came.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::{BootstrapError, BootstrapInputs, proxy_config::ProxyConfigView};

const META_PREFIX: &str = "ISTIO_META_";
const META_JSON_PREFIX: &str = "ISTIO_METAJSON_";
/// Kubernetes labels cannot hold '/', so the locality label uses '.' (`region.zone.sub`).
const LOCALITY_LABEL: &str = "istio-locality";
const TOPOLOGY_LOCALITY_LABEL: &str = "topology.istio.io/locality";
/// The ReplicaSet's label, not the workload's: pilot-agent leaves it out.
const POD_TEMPLATE_HASH: &str = "pod-template-hash";

/// How a typed metadata field converts (Istio's Go types for `model.NodeMetadata`).
#[derive(Clone, Copy)]
enum Kind {
    Str,
    /// `StringBool`: "true"/"false" in and out.
    Bool,
    Int,
    /// map[string]string
    StrMap,
    /// `StringList`: a comma-separated string in and out.
    List,
    /// []string as a JSON array.
    Array,
    /// Anything JSON (POD_PORTS is a JSON string of ports; PROXY_CONFIG a message).
    Any,
}

const TYPED: [(&str, Kind); 56] = [
    ("PROXY_CONFIG", Kind::Any),
    ("ISTIO_VERSION", Kind::Str),
    ("ISTIO_REVISION", Kind::Str),
    ("LABELS", Kind::StrMap),
    ("STATIC_LABELS", Kind::StrMap),
    ("ANNOTATIONS", Kind::StrMap),
    ("INSTANCE_IPS", Kind::List),
    ("NAMESPACE", Kind::Str),
    ("NODE_NAME", Kind::Str),
    ("WORKLOAD_NAME", Kind::Str),
    ("INTERCEPTION_MODE", Kind::Str),
    ("SERVICE_ACCOUNT", Kind::Str),
    ("HTTP_PROXY_PORT", Kind::Str),
    ("MESH_ID", Kind::Str),
    ("CLUSTER_ID", Kind::Str),
    ("NETWORK", Kind::Str),
    ("REQUESTED_NETWORK_VIEW", Kind::List),
    ("POD_PORTS", Kind::Any),
    ("TLS_SERVER_CERT_CHAIN", Kind::Str),
    ("TLS_SERVER_KEY", Kind::Str),
    ("TLS_SERVER_ROOT_CERT", Kind::Str),
    ("TLS_CLIENT_CERT_CHAIN", Kind::Str),
    ("TLS_CLIENT_KEY", Kind::Str),
    ("TLS_CLIENT_ROOT_CERT", Kind::Str),
    ("BASE", Kind::Str),
    ("IDLE_TIMEOUT", Kind::Str),
    ("HTTP10", Kind::Str),
    ("GENERATOR", Kind::Str),
    ("ENABLE_SELF_DISCOVERY", Kind::Bool),
    ("DNS_CAPTURE", Kind::Bool),
    ("DNS_AUTO_ALLOCATE", Kind::Bool),
    ("DNS_PROXY_ADDR", Kind::Str),
    ("ENABLE_HBONE", Kind::Bool),
    ("DISABLE_HBONE_SEND", Kind::Bool),
    ("AUTO_REGISTER_GROUP", Kind::Str),
    ("WORKLOAD_ENTRY", Kind::Str),
    ("UNPRIVILEGED_POD", Kind::Str),
    ("PLATFORM_METADATA", Kind::StrMap),
    ("STS_PORT", Kind::Str),
    ("ENVOY_STATUS_PORT", Kind::Int),
    ("ENVOY_PROMETHEUS_PORT", Kind::Int),
    ("ENVOY_SECURE_METRICS_PORT", Kind::Int),
    ("ENVOY_SECURE_MERGED_METRICS_PORT", Kind::Int),
    ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", Kind::Bool),
    ("INBOUND_LISTENER_EXACT_BALANCE", Kind::Bool),
    ("OUTBOUND_LISTENER_EXACT_BALANCE", Kind::Bool),
    ("CLOUDRUN_ADDR", Kind::Str),
    ("METADATA_DISCOVERY", Kind::Bool),
    ("ENVOY_SKIP_DEPRECATED_LOGS", Kind::Bool),
    ("WORKLOAD_IDENTITY_SOCKET_FILE", Kind::Str),
    // BootstrapNodeMetadata's own.
    ("NAME", Kind::Str),
    ("OWNER", Kind::Str),
    ("PILOT_SAN", Kind::Array),
    ("OUTLIER_LOG_PATH", Kind::Str),
    ("APP_CONTAINERS", Kind::Str),
    ("ISTIO_PROXY_SHA", Kind::Str),
];

/// The node as the bootstrap and the rest of the generator need it.
pub struct Node {
    pub id: String,
    pub cluster: String,
    /// region, zone, sub_zone (empty when unknown).
    pub locality: [String; 3],
    /// The metadata as the bootstrap carries it.
    pub metadata: Map<String, Value>,
    /// The untyped metadata (before typed fields are laid over).
    pub raw: Map<String, Value>,
    pub annotations: BTreeMap<String, String>,
    pub instance_ips: Vec<String>,
    pub enable_self_discovery: bool,
    pub metadata_discovery: bool,
}

impl Node {
    pub fn json(&self) -> Value {
        let mut locality = Map::new();
        for (k, v) in ["region", "zone", "sub_zone"].iter().zip(&self.locality) {
            if !v.is_empty() {
                locality.insert((*k).into(), v.clone().into());
            }
        }
        json!({
            "id": self.id,
            "cluster": self.cluster,
            "locality": locality,
            "metadata": self.metadata,
        })
    }
}

pub fn build(inputs: &BootstrapInputs, pc: &ProxyConfigView) -> Result<Node, BootstrapError> {
    let mut raw = raw_metadata(&inputs.env, pc);
    let instance_ips = dedup(&inputs.instance_ips);
    let mut typed = typed_metadata(inputs, &raw, &instance_ips)?;
    let (labels, annotations, locality) = pod_attributes(inputs, &mut typed);
    typed.insert("PILOT_SAN".into(), json!(inputs.pilot_san));
    typed.insert(
        "OUTLIER_LOG_PATH".into(),
        inputs.outlier_log_path.clone().into(),
    );
    if inputs.credential_socket_exists {
        raw.insert("credential".into(), "true".into());
    }
    if inputs.custom_credentials_file_exists {
        raw.insert("file-credential".into(), "true".into());
    }
    // Not asked either way: on for ambient (HBONE) proxies.
    let metadata_discovery = inputs
        .metadata_discovery
        .unwrap_or_else(|| typed_bool(&typed, "ENABLE_HBONE"));
    typed.insert("METADATA_DISCOVERY".into(), bool_str(metadata_discovery));
    let enable_self_discovery = typed_bool(&typed, "ENABLE_SELF_DISCOVERY");
    let cluster = service_cluster(
        pc,
        &labels,
        &typed_str(&typed, "WORKLOAD_NAME"),
        &typed_str(&typed, "NAMESPACE"),
    );
    // Go's omitempty: empty typed fields are left out, and then an untyped key of the
    // same name (as it came from the environment) shows through.
    let mut metadata: Map<String, Value> = typed
        .into_iter()
        .filter(|(k, v)| k == "METADATA_DISCOVERY" || !is_empty(k, v))
        .collect();
    for (k, v) in &raw {
        if !metadata.contains_key(k) {
            metadata.insert(k.clone(), v.clone());
        }
    }
    Ok(Node {
        id: inputs.node_id.clone(),
        cluster,
        locality,
        metadata,
        raw,
        annotations,
        instance_ips,
        enable_self_discovery,
        metadata_discovery,
    })
}

/// The metadata as given: ProxyConfig's `proxyMetadata` and the environment's
/// `ISTIO_META_*` keys, `ISTIO_METAJSON_*` objects, and `DNS_PROXY_ADDR`.
fn raw_metadata(env: &[(String, String)], pc: &ProxyConfigView) -> Map<String, Value> {
    let mut raw = Map::new();
    for (k, v) in &pc.proxy_metadata {
        if let Some(key) = k.strip_prefix(META_PREFIX) {
            raw.insert(key.into(), v.clone().into());
        }
    }
    for (k, v) in env {
        if let Some(key) = k.strip_prefix(META_PREFIX) {
            raw.insert(key.into(), v.clone().into());
        }
    }
    for (k, v) in env {
        if k.starts_with(META_JSON_PREFIX) {
            // pilot-agent logs and skips an object that does not parse.
            if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(v) {
                raw.extend(m);
            }
        }
    }
    if let Some(v) = env_value(env, "DNS_PROXY_ADDR").filter(|v| !v.is_empty()) {
        raw.insert("DNS_PROXY_ADDR".into(), v.into());
    }
    raw
}

/// The typed fields, converted as Go's json.Unmarshal into
/// model.BootstrapNodeMetadata, and those pilot-agent sets itself.
fn typed_metadata(
    inputs: &BootstrapInputs,
    raw: &Map<String, Value>,
    instance_ips: &[String],
) -> Result<Map<String, Value>, BootstrapError> {
    let mut typed = Map::new();
    for (key, kind) in TYPED {
        if let Some(v) = raw.get(key) {
            typed.insert(key.into(), convert(key, kind, v)?);
        }
    }
    if typed_str(&typed, "ISTIO_VERSION").is_empty() {
        typed.insert("ISTIO_VERSION".into(), inputs.istio_version.clone().into());
    }
    typed.insert("INSTANCE_IPS".into(), instance_ips.join(",").into());
    if inputs.sts_port != 0 {
        typed.insert("STS_PORT".into(), inputs.sts_port.to_string().into());
    }
    typed.insert("ENVOY_STATUS_PORT".into(), inputs.envoy_status_port.into());
    typed.insert(
        "ENVOY_PROMETHEUS_PORT".into(),
        inputs.envoy_prometheus_port.into(),
    );
    typed.insert(
        "ENVOY_SECURE_METRICS_PORT".into(),
        inputs.secure_metrics_port.into(),
    );
    typed.insert(
        "ENVOY_SECURE_MERGED_METRICS_PORT".into(),
        inputs.secure_merged_metrics_port.into(),
    );
    typed.insert(
        "EXIT_ON_ZERO_ACTIVE_CONNECTIONS".into(),
        bool_str(inputs.exit_on_zero_active_connections),
    );
    // Set from the agent's own setting (`build`), whatever the metadata said.
    typed.remove("METADATA_DISCOVERY");
    typed.insert(
        "ENVOY_SKIP_DEPRECATED_LOGS".into(),
        bool_str(inputs.envoy_skip_deprecated_logs),
    );
    typed.insert(
        "WORKLOAD_IDENTITY_SOCKET_FILE".into(),
        inputs.workload_identity_socket_file.clone().into(),
    );
    typed.insert("PROXY_CONFIG".into(), inputs.proxy_config.to_json());
    Ok(typed)
}

/// extractAttributesMetadata: the pod's identity, labels and annotations from the
/// injector and the downward API, written into `typed`; returns the labels, the
/// annotations and the locality (from the locality label, else the platform's).
fn pod_attributes(
    inputs: &BootstrapInputs,
    typed: &mut Map<String, Value>,
) -> (
    BTreeMap<String, String>,
    BTreeMap<String, String>,
    [String; 3],
) {
    // LABELS and STATIC_LABELS are one map in pilot-agent until pod labels are read from
    // the downward API, so a locality rewrite shows in both: `static_shared` keeps that.
    let mut labels: Option<BTreeMap<String, String>> = typed_map(typed, "LABELS");
    let mut static_labels = typed_map(typed, "STATIC_LABELS");
    let mut static_shared = false;
    for (k, v) in &inputs.env {
        match k.as_str() {
            "ISTIO_METAJSON_LABELS" => {
                if let Ok(m) = serde_json::from_str::<BTreeMap<String, String>>(v)
                    && !m.is_empty()
                {
                    labels = Some(m.clone());
                    static_labels = Some(m);
                    static_shared = true;
                }
            }
            "POD_NAME" => {
                typed.insert("NAME".into(), v.clone().into());
            }
            "POD_NAMESPACE" => {
                typed.insert("NAMESPACE".into(), v.clone().into());
            }
            "SERVICE_ACCOUNT" => {
                typed.insert("SERVICE_ACCOUNT".into(), v.clone().into());
            }
            _ => {}
        }
    }
    if !inputs.platform_metadata.is_empty() {
        typed.insert("PLATFORM_METADATA".into(), json!(inputs.platform_metadata));
    }
    if let Some(pod_labels) = &inputs.pod_labels {
        let mut merged = static_labels.clone().unwrap_or_default();
        for (k, v) in pod_labels {
            if k != POD_TEMPLATE_HASH {
                merged.insert(k.clone(), v.clone());
            }
        }
        labels = Some(merged);
        static_shared = false;
    }
    let mut annotations = typed_map(typed, "ANNOTATIONS").unwrap_or_default();
    if let Some(pod_annotations) = &inputs.annotations {
        annotations.extend(pod_annotations.clone());
    }
    let locality = locality(inputs, &mut labels, &mut static_labels, static_shared);
    let labels = labels.unwrap_or_default();
    put_map(typed, "LABELS", &labels);
    put_map(typed, "STATIC_LABELS", &static_labels.unwrap_or_default());
    put_map(typed, "ANNOTATIONS", &annotations);
    (labels, annotations, locality)
}

/// The locality (region, zone, subzone) from the pod's locality label, written back in
/// its `/` form (into the static labels too while they are the same map); else the
/// platform's.
fn locality(
    inputs: &BootstrapInputs,
    labels: &mut Option<BTreeMap<String, String>>,
    static_labels: &mut Option<BTreeMap<String, String>>,
    static_shared: bool,
) -> [String; 3] {
    let mut locality = [String::new(), String::new(), String::new()];
    let label = labels.as_ref().and_then(|l| {
        l.get(TOPOLOGY_LOCALITY_LABEL)
            .or_else(|| l.get(LOCALITY_LABEL))
            .cloned()
    });
    match label.filter(|l| !l.is_empty()) {
        Some(label) => {
            let sanitized = if label.contains('/') {
                label
            } else {
                label.replace('.', "/")
            };
            if let Some(l) = labels.as_mut() {
                l.insert(LOCALITY_LABEL.into(), sanitized.clone());
            }
            if static_shared && let Some(s) = static_labels.as_mut() {
                s.insert(LOCALITY_LABEL.into(), sanitized.clone());
            }
            for (slot, part) in locality.iter_mut().zip(sanitized.splitn(3, '/')) {
                *slot = part.to_owned();
            }
        }
        None => locality.clone_from(&inputs.platform_locality),
    }
    locality
}

fn typed_str(typed: &Map<String, Value>, k: &str) -> String {
    typed
        .get(k)
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

fn typed_bool(typed: &Map<String, Value>, k: &str) -> bool {
    typed.get(k) == Some(&json!("true"))
}

fn convert(key: &str, kind: Kind, v: &Value) -> Result<Value, BootstrapError> {
    let bad = |want: &str| BootstrapError::Metadata {
        key: key.to_owned(),
        reason: format!("{want}, got {v}"),
    };
    Ok(match kind {
        Kind::Str => Value::String(v.as_str().ok_or_else(|| bad("expected a string"))?.into()),
        Kind::Bool => {
            let s = v
                .as_str()
                .ok_or_else(|| bad("expected \"true\" or \"false\""))?;
            bool_str(parse_go_bool(s).ok_or_else(|| bad("expected \"true\" or \"false\""))?)
        }
        Kind::Int => Value::from(v.as_i64().ok_or_else(|| bad("expected a number"))?),
        Kind::StrMap => {
            let m = v
                .as_object()
                .ok_or_else(|| bad("expected a map of strings"))?;
            if m.values().any(|x| !x.is_string()) {
                return Err(bad("expected a map of strings"));
            }
            v.clone()
        }
        Kind::List => Value::String(
            v.as_str()
                .ok_or_else(|| bad("expected a comma-separated string"))?
                .into(),
        ),
        Kind::Array => {
            let a = v
                .as_array()
                .ok_or_else(|| bad("expected a list of strings"))?;
            if a.iter().any(|x| !x.is_string()) {
                return Err(bad("expected a list of strings"));
            }
            v.clone()
        }
        Kind::Any => v.clone(),
    })
}

/// Go's strconv.ParseBool.
fn parse_go_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

fn bool_str(b: bool) -> Value {
    Value::String(if b { "true" } else { "false" }.into())
}

fn is_empty(key: &str, v: &Value) -> bool {
    let is_bool = TYPED
        .iter()
        .any(|(k, kind)| *k == key && matches!(kind, Kind::Bool));
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty() || (is_bool && s == "false"),
        Value::Number(n) => n.as_i64() == Some(0),
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Bool(b) => !b,
    }
}

fn typed_map(typed: &Map<String, Value>, key: &str) -> Option<BTreeMap<String, String>> {
    typed
        .get(key)
        .and_then(|v| serde_json::from_value(v.clone()).ok())
}

fn put_map(typed: &mut Map<String, Value>, key: &str, m: &BTreeMap<String, String>) {
    typed.insert(key.into(), json!(m));
}

pub(super) fn env_value(env: &[(String, String)], name: &str) -> Option<String> {
    env.iter()
        .rev()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

pub(super) fn dedup(values: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(values.len());
    for v in values {
        if !out.contains(v) {
            out.push(v.clone());
        }
    }
    out
}

/// `node.cluster`: the service cluster, or a name made from the pod's labels.
fn service_cluster(
    pc: &ProxyConfigView,
    labels: &BTreeMap<String, String>,
    workload: &str,
    namespace: &str,
) -> String {
    let or_default = |name: &str| -> String {
        if !name.is_empty() && name != "istio-proxy" {
            return name.to_owned();
        }
        if let Some(app) = app_label(labels) {
            return format!("{app}.{namespace}");
        }
        if !workload.is_empty() {
            return format!("{workload}.{namespace}");
        }
        if !namespace.is_empty() {
            return format!("istio-proxy.{namespace}");
        }
        "istio-proxy".into()
    };
    if let Some(sc) = &pc.service_cluster {
        return or_default(sc);
    }
    let workload = if workload.is_empty() {
        "istio-proxy"
    } else {
        workload
    };
    match pc.tracing_service_name.as_deref() {
        Some("CANONICAL_NAME_ONLY") => or_default(&canonical_service(labels, workload)),
        Some("CANONICAL_NAME_AND_NAMESPACE") => {
            let cs = canonical_service(labels, workload);
            if namespace.is_empty() {
                or_default(&cs)
            } else {
                format!("{cs}.{namespace}")
            }
        }
        _ => or_default("istio-proxy"),
    }
}

/// The app name, with Istio's backward-compatible label order.
fn app_label(labels: &BTreeMap<String, String>) -> Option<&String> {
    [
        "app",
        "app.kubernetes.io/name",
        "service.istio.io/canonical-name",
    ]
    .iter()
    .find_map(|k| labels.get(*k).filter(|v| !v.is_empty()))
}

fn canonical_service(labels: &BTreeMap<String, String>, workload: &str) -> String {
    [
        "service.istio.io/canonical-name",
        "app.kubernetes.io/name",
        "app",
    ]
    .iter()
    .find_map(|k| labels.get(*k).filter(|v| !v.is_empty()).cloned())
    .unwrap_or_else(|| workload.to_owned())
}
