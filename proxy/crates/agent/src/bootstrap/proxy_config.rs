//! The ProxyConfig pilot-agent renders from: mesh config `defaultConfig`, then the
//! `PROXY_CONFIG` environment variable, then the `proxy.istio.io/config` pod annotation,
//! each YAML or JSON with proto field names (camelCase or snake_case), merged as
//! pilot-agent merges them. Kept as protojson (camelCase keys, durations as "2s", enums
//! by name) because the bootstrap carries it whole in the node metadata (`PROXY_CONFIG`);
//! [`ProxyConfig::view`] reads the fields the bootstrap uses.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::BootstrapError;

/// ProxyConfig fields whose values are maps with user keys: their keys are kept as
/// written (a `proxyMetadata` key like `ISTIO_META_X` is not a proto field name).
const MAP_FIELDS: [&str; 3] = ["proxyMetadata", "runtimeValues", "customTags"];

/// Enum fields and their zero value. protojson leaves a zero value out of what it
/// writes, but a zero value *written* in a layer is a value: `controlPlaneAuthPolicy:
/// NONE` in `PROXY_CONFIG` replaces the mesh default MUTUAL_TLS (Istio's
/// `TestGetMeshConfig`, "Environment Override").
const ENUM_ZEROS: [(&str, &str); 10] = [
    ("controlPlaneAuthPolicy", "NONE"),
    ("interceptionMode", "REDIRECT"),
    ("tracingServiceName", "APP_LABEL_AND_NAMESPACE"),
    // ClientTLSSettings.TLSmode, and ProxyHeaders' MetadataExchangeMode.
    ("mode", "DISABLE"),
    ("mode", "UNDEFINED"),
    ("forwardClientCertDetails", "UNDEFINED"),
    ("context", "UNSPECIFIED"),
    ("profile", "SIDECAR"),
    (
        "headersWithUnderscoresAction",
        "HEADERS_WITH_UNDERSCORES_UNSPECIFIED",
    ),
    (
        "pathWithEscapedSlashesAction",
        "PATH_WITH_ESCAPED_SLASHES_UNSPECIFIED",
    ),
];

/// ProxyConfig's `cluster_name` oneof: setting one member clears the other, and a
/// member set to its zero value is still set (written by protojson).
const CLUSTER_NAME_ONEOF: [&str; 2] = ["serviceCluster", "tracingServiceName"];

/// Fields of a wrapper type (`google.protobuf.BoolValue`, `Int32Value`, ...) in
/// ProxyConfig and the messages under it: present even at zero, so protojson writes
/// `false` and `0` for them (`holdApplicationUntilProxyStarts: false` overrides a
/// mesh-wide true).
const WRAPPER_FIELDS: [&str; 23] = [
    "concurrency",
    "holdApplicationUntilProxyStarts",
    "statsCompression",
    "disabled",
    "enabled",
    "subject",
    "cert",
    "chain",
    "dns",
    "uri",
    "fallback",
    "insecureSkipVerify",
    "enableIstioTags",
    "maxNumberOfAttributes",
    "maxNumberOfAnnotations",
    "maxNumberOfMessageEvents",
    "preserveHttp1HeaderCase",
    "listenerPerConnectionBufferLimitBytes",
    "clusterPerConnectionBufferLimitBytes",
    "httpMaxConcurrentStreams",
    "http2InitialStreamWindowSize",
    "http2InitialConnectionWindowSize",
    "globalDownstreamConnectionLimit",
];

/// A merged ProxyConfig in protojson form.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProxyConfig(Map<String, Value>);

impl ProxyConfig {
    /// An empty ProxyConfig: every field at its proto default.
    pub fn new() -> Self {
        Self::default()
    }

    /// Istio's `mesh.DefaultProxyConfig()`, the base a mesh config's `defaultConfig` is
    /// applied onto.
    pub fn istio_defaults() -> Self {
        let v = serde_json::json!({
            "configPath": "./etc/istio/proxy",
            "binaryPath": "/usr/local/bin/envoy",
            "serviceCluster": "istio-proxy",
            "drainDuration": "45s",
            "terminationDrainDuration": "5s",
            "proxyAdminPort": 15000,
            "controlPlaneAuthPolicy": "MUTUAL_TLS",
            "discoveryAddress": "istiod.istio-system.svc:15012",
            "statNameLength": 189,
            "statusPort": 15020,
        });
        match v {
            Value::Object(m) => Self(m),
            _ => unreachable!("a JSON object literal"),
        }
    }

    /// Parses one ProxyConfig document (YAML or JSON); `source` names it in errors.
    pub fn parse(text: &str, source: &str) -> Result<Self, BootstrapError> {
        let mut cfg = Self::new();
        cfg.apply(text, source)?;
        Ok(cfg)
    }

    /// Applies one more layer on top, as pilot-agent's `MergeProxyConfig` does (see
    /// [`merge`]).
    pub fn apply(&mut self, text: &str, source: &str) -> Result<(), BootstrapError> {
        if text.trim().is_empty() {
            return Ok(());
        }
        let doc: Value =
            serde_yaml_ng::from_str(text).map_err(|e| BootstrapError::ProxyConfig {
                source_name: source.to_owned(),
                reason: e.to_string(),
            })?;
        let doc = match doc {
            Value::Object(m) => m,
            Value::Null => return Ok(()),
            other => {
                return Err(BootstrapError::ProxyConfig {
                    source_name: source.to_owned(),
                    reason: format!("expected a mapping of ProxyConfig fields, got {other}"),
                });
            }
        };
        let doc = canonical_keys(doc);
        merge(&mut self.0, doc);
        // The typed view must read: a bad value fails here, naming the field.
        self.view_from(source).map(|_| ())
    }

    /// Sets one field (protojson name), replacing what was there.
    pub fn set(&mut self, field: &str, value: Value) {
        self.0.insert(field.to_owned(), value);
    }

    /// The ProxyConfig as protojson writes it (the node metadata's `PROXY_CONFIG`):
    /// fields at their zero value are left out, wrapper fields and messages are not.
    pub fn to_json(&self) -> Value {
        Value::Object(without_zero_values(&self.0))
    }

    /// The fields the bootstrap reads, typed.
    pub fn view(&self) -> Result<ProxyConfigView, BootstrapError> {
        self.view_from("ProxyConfig")
    }

    fn view_from(&self, source: &str) -> Result<ProxyConfigView, BootstrapError> {
        serde_json::from_value(Value::Object(self.0.clone())).map_err(|e| {
            // serde does not say which field: find it by reading them one at a time.
            let field = self.0.iter().find_map(|(k, v)| {
                let one = Map::from_iter([(k.clone(), v.clone())]);
                serde_json::from_value::<ProxyConfigView>(Value::Object(one))
                    .is_err()
                    .then(|| k.clone())
            });
            BootstrapError::ProxyConfig {
                source_name: source.to_owned(),
                reason: match field {
                    Some(f) => format!("field `{f}`: {e}"),
                    None => e.to_string(),
                },
            }
        })
    }
}

/// snake_case field names to protojson's camelCase, except inside map fields. A
/// `null` is no value (protobuf's JSON decoding skips it); every other value is kept,
/// zero values included: they override what an earlier layer set.
fn canonical_keys(m: Map<String, Value>) -> Map<String, Value> {
    m.into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| {
            let k = camel(&k);
            let v = if MAP_FIELDS.contains(&k.as_str()) {
                v
            } else {
                canonical_value(v)
            };
            (k, v)
        })
        .collect()
}

fn canonical_value(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(canonical_keys(m)),
        Value::Array(a) => Value::Array(a.into_iter().map(canonical_value).collect()),
        other => other,
    }
}

/// What protojson writes of a message: scalars at their zero value (`""`, `0`,
/// `false`, an enum's zero name), empty lists and empty maps are left out; wrapper
/// fields and message fields are written whatever they hold.
fn without_zero_values(m: &Map<String, Value>) -> Map<String, Value> {
    m.iter()
        .filter(|(k, v)| !is_zero_value(k, v))
        .map(|(k, v)| {
            let v = match v {
                Value::Object(inner) if !MAP_FIELDS.contains(&k.as_str()) => {
                    Value::Object(without_zero_values(inner))
                }
                Value::Array(items) => Value::Array(
                    items
                        .iter()
                        .map(|item| match item {
                            Value::Object(inner) => Value::Object(without_zero_values(inner)),
                            other => other.clone(),
                        })
                        .collect(),
                ),
                other => other.clone(),
            };
            (k.clone(), v)
        })
        .collect()
}

fn is_zero_value(field: &str, v: &Value) -> bool {
    if WRAPPER_FIELDS.contains(&field) || CLUSTER_NAME_ONEOF.contains(&field) {
        return false;
    }
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => {
            s.is_empty() || ENUM_ZEROS.iter().any(|(f, zero)| *f == field && s == zero)
        }
        Value::Array(a) => a.is_empty(),
        Value::Object(m) => MAP_FIELDS.contains(&field) && m.is_empty(),
    }
}

fn camel(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

/// pilot-agent's `MergeProxyConfig`: protobuf's JSON decoding into the existing config
/// replaces each field it names, messages included (a later `tracing` replaces the
/// whole `tracing`); then `proxyMetadata` gets the earlier entries back (the later wins
/// a key), and `proxyHeaders` its earlier headers the later one leaves unset. A
/// member of the `cluster_name` oneof replaces the other member.
fn merge(into: &mut Map<String, Value>, from: Map<String, Value>) {
    for (k, v) in from {
        if CLUSTER_NAME_ONEOF.contains(&k.as_str()) {
            for member in CLUSTER_NAME_ONEOF {
                into.remove(member);
            }
        }
        match (k.as_str(), into.get_mut(&k), v) {
            ("proxyMetadata" | "proxyHeaders", Some(Value::Object(a)), Value::Object(b)) => {
                a.extend(b);
            }
            (_, _, v) => {
                into.insert(k, v);
            }
        }
    }
}

/// The ProxyConfig fields the bootstrap uses (protojson names).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyConfigView {
    pub config_path: String,
    pub discovery_address: String,
    pub proxy_admin_port: u32,
    pub status_port: u32,
    pub service_cluster: Option<String>,
    pub tracing_service_name: Option<String>,
    pub statsd_udp_address: String,
    pub tracing: Option<Tracing>,
    pub envoy_metrics_service: Option<RemoteService>,
    pub envoy_access_log_service: Option<RemoteService>,
    pub stats_compression: Option<bool>,
    pub extra_stat_tags: Vec<String>,
    pub proxy_stats_matcher: Option<ProxyStatsMatcher>,
    pub proxy_metadata: std::collections::BTreeMap<String, String>,
    pub runtime_values: std::collections::BTreeMap<String, String>,
    pub connection_settings: Option<ConnectionSettings>,
    // Read only to refuse a bad value at start, naming it (the bootstrap carries them
    // in PROXY_CONFIG, where Envoy never looks).
    pub drain_duration: Option<ProtoDuration>,
    pub termination_drain_duration: Option<ProtoDuration>,
    pub discovery_refresh_delay: Option<ProtoDuration>,
    pub file_flush_interval: Option<ProtoDuration>,
    pub concurrency: Option<i32>,
    pub stat_name_length: i32,
    pub hold_application_until_proxy_starts: Option<bool>,
    pub control_plane_auth_policy: Option<Enum<AuthenticationPolicy>>,
    pub interception_mode: Option<Enum<InterceptionMode>>,
}

/// A `google.protobuf.Duration` in protojson: seconds with up to nine decimals and an
/// `s` ("45s", "0.5s").
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProtoDuration(pub std::time::Duration);

impl<'de> Deserialize<'de> for ProtoDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.strip_suffix('s')
            .and_then(|secs| secs.parse::<f64>().ok())
            .filter(|secs| secs.is_finite() && *secs >= 0.0)
            .map(|secs| ProtoDuration(std::time::Duration::from_secs_f64(secs)))
            .ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "{text:?} is not a duration (seconds with an \"s\", e.g. \"5s\")"
                ))
            })
    }
}

/// An enum field in protojson: its name, or its number.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Enum<E>(pub E);

/// The names of a ProxyConfig enum, in number order.
pub trait EnumNames: Sized + Copy {
    const NAMES: &'static [&'static str];
    fn from_index(i: usize) -> Self;
}

impl<'de, E: EnumNames> Deserialize<'de> for Enum<E> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let index = match Value::deserialize(d)? {
            Value::String(name) => E::NAMES.iter().position(|n| *n == name),
            Value::Number(n) => n
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n < E::NAMES.len()),
            _ => None,
        };
        index.map(|i| Enum(E::from_index(i))).ok_or_else(|| {
            serde::de::Error::custom(format!("expected one of {}", E::NAMES.join(", ")))
        })
    }
}

/// `controlPlaneAuthPolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthenticationPolicy {
    None,
    MutualTls,
    Inherit,
}

impl EnumNames for AuthenticationPolicy {
    const NAMES: &'static [&'static str] = &["NONE", "MUTUAL_TLS", "INHERIT"];
    fn from_index(i: usize) -> Self {
        [Self::None, Self::MutualTls, Self::Inherit][i]
    }
}

/// `interceptionMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterceptionMode {
    Redirect,
    Tproxy,
    None,
}

impl EnumNames for InterceptionMode {
    const NAMES: &'static [&'static str] = &["REDIRECT", "TPROXY", "NONE"];
    fn from_index(i: usize) -> Self {
        [Self::Redirect, Self::Tproxy, Self::None][i]
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Tracing {
    pub zipkin: Option<TracerAddress>,
    pub lightstep: Option<Lightstep>,
    pub datadog: Option<TracerAddress>,
    pub stackdriver: Option<Value>,
    pub tls_settings: Option<ClientTls>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TracerAddress {
    pub address: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Lightstep {
    pub address: String,
    pub access_token: String,
}

/// `RemoteService`: the metrics and access-log services.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RemoteService {
    pub address: String,
    pub tls_settings: Option<ClientTls>,
    pub tcp_keepalive: Option<TcpKeepalive>,
}

/// networking `ClientTLSSettings`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClientTls {
    pub mode: String,
    pub client_certificate: String,
    pub private_key: String,
    pub ca_certificates: String,
    pub subject_alt_names: Vec<String>,
    pub sni: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpKeepalive {
    pub probes: u32,
    pub time: Option<String>,
    pub interval: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyStatsMatcher {
    pub inclusion_prefixes: Option<Vec<String>>,
    pub inclusion_suffixes: Option<Vec<String>>,
    pub inclusion_regexps: Option<Vec<String>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConnectionSettings {
    pub global_downstream_connection_limit: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_merge_as_pilot_agent_merges_them() {
        let mut pc = ProxyConfig::istio_defaults();
        pc.apply(
            "discovery_address: a:1\nproxyMetadata: {ISTIO_META_A: '1'}\n",
            "mesh",
        )
        .unwrap();
        pc.apply(r#"{"proxyMetadata": {"ISTIO_META_B": "2"}, "tracing": {"zipkin": {"address": "z:9411"}}}"#, "env")
            .unwrap();
        pc.apply("tracing: {sampling: 10}", "annotation").unwrap();
        let v = pc.view().unwrap();
        assert_eq!(v.discovery_address, "a:1");
        assert_eq!(v.proxy_metadata.len(), 2);
        // A later message replaces the earlier one whole.
        assert!(v.tracing.unwrap().zipkin.is_none());
        assert_eq!(v.proxy_admin_port, 15000);
    }

    #[test]
    fn bad_durations_enums_and_numbers_are_named() {
        for (text, field) in [
            ("drainDuration: forever", "drainDuration"),
            ("terminationDrainDuration: 5", "terminationDrainDuration"),
            (
                "controlPlaneAuthPolicy: SOMETIMES",
                "controlPlaneAuthPolicy",
            ),
            ("interceptionMode: 7", "interceptionMode"),
            ("concurrency: two", "concurrency"),
            (
                "holdApplicationUntilProxyStarts: maybe",
                "holdApplicationUntilProxyStarts",
            ),
        ] {
            let err = ProxyConfig::parse(text, "PROXY_CONFIG")
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{text}: {err}");
        }
        let ok = ProxyConfig::parse(
            "drainDuration: 2.5s\ncontrolPlaneAuthPolicy: 1\ninterceptionMode: TPROXY",
            "PROXY_CONFIG",
        )
        .unwrap()
        .view()
        .unwrap();
        assert_eq!(ok.drain_duration.unwrap().0.as_millis(), 2500);
        assert_eq!(
            ok.control_plane_auth_policy.unwrap().0,
            AuthenticationPolicy::MutualTls
        );
    }

    #[test]
    fn a_bad_field_is_named_with_its_source() {
        let err = ProxyConfig::parse("proxyAdminPort: lots", "PROXY_CONFIG").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("PROXY_CONFIG") && msg.contains("proxyAdminPort"),
            "{msg}"
        );
    }
}
