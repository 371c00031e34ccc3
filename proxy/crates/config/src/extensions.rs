//! The walk that finds every extension a bootstrap names and reports the ones shunt does
//! not implement. What shunt implements ([`Implemented`]) is not listed here: the code
//! that compiles each kind of extension (the filter registries, the listener's, cluster's
//! and transport socket's compilers) names its types, and `shunt_xds::snapshot::extensions`
//! hands the set to [`check`]. What is policy about extensions shunt does not implement
//! (which may be left out) is here.
//!
//! Extensions are matched by the type of their config (`typed_config`'s `@type`), as Envoy
//! finds its factories; the `name` beside it is free text and only shown. Where an
//! extension sits decides what missing it means:
//! - ERROR where a listener or a cluster depends on it: a network filter, a listener
//!   filter, a transport socket, a cluster type, an HTTP filter (unless the config marks
//!   it optional or disabled, or it is in [`HTTP_FILTERS_SAFE_TO_SKIP`]). Serving that
//!   listener or cluster without it would not be what the config says.
//! - WARNING where Envoy would act on it but traffic flows the same without it: stats
//!   sinks, tracers, access loggers, bootstrap extensions, protocol options, and any
//!   other `Any` (resource monitors, request id extensions, matchers, ...).
//!
//! A missing extension's own config is not walked into, so one finding covers it.

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use prost::{Message, Name};
use prost_reflect::{DescriptorPool, DynamicMessage, ReflectMessage, Value};

use super::diagnostic::{Diagnostic, JsonPath, Severity};
use super::json::{Path, each_message, type_name_of_url};
use super::pool::{PoolError, pool};

/// HTTP filters shunt does not implement but may leave out of a chain without changing
/// what a request means or who may make it: they only change how a response is encoded.
/// Leaving one out is a WARNING. Empty today: the compressor (Istio's 15090 Prometheus
/// listener compresses the scrape) is served; kept for the next such filter.
pub const HTTP_FILTERS_SAFE_TO_SKIP: &[&str] = &[];

/// HTTP filters Istio puts in every sidecar's connection managers that change nothing
/// about where a request goes or what it gets back when left out: shunt accepts them
/// with a warning saying what is lost (`--mode validate` and xDS alike). Empty today:
/// every such filter istiod writes is served; kept for the next one Istio adds.
pub const HTTP_FILTERS_SKIPPED_WITH_A_WARNING: &[(&str, &str)] = &[];

/// The config types a build of shunt implements, by where they sit. This crate sits
/// below the code that implements extensions, so it is handed the set: each list comes
/// from the code that compiles those extensions (the network and HTTP filter
/// registries, the listener's, cluster's and transport socket's compilers), assembled
/// by `shunt_xds::snapshot::extensions`.
#[derive(Debug, Clone, Default)]
pub struct Implemented {
    /// Network filters (a listener filter chain's `filters`).
    pub network_filters: Vec<&'static str>,
    /// Upstream network filters (a cluster's `filters`).
    pub upstream_network_filters: Vec<&'static str>,
    /// HTTP filters (`http_connection_manager`'s `http_filters`).
    pub http_filters: Vec<&'static str>,
    /// Per-route configs of the HTTP filters (`typed_per_filter_config`).
    pub http_filter_per_route: Vec<&'static str>,
    /// Listener filters (a listener's `listener_filters`).
    pub listener_filters: Vec<&'static str>,
    /// Transport sockets (a filter chain's or a cluster's `transport_socket`).
    pub transport_sockets: Vec<&'static str>,
    /// Bootstrap extensions (`bootstrap_extensions`).
    pub bootstrap_extensions: Vec<&'static str>,
    /// Cluster discovery types (`Cluster.type`), by enum name.
    pub cluster_types: Vec<&'static str>,
    /// Custom cluster types (`Cluster.cluster_type`).
    pub custom_cluster_types: Vec<&'static str>,
    /// Access loggers (`access_log`).
    pub access_loggers: Vec<&'static str>,
    /// Cluster protocol options (`Cluster.typed_extension_protocol_options`).
    pub protocol_options: Vec<&'static str>,
    /// What a listener's `filter_chain_matcher` reads and matches with.
    pub filter_chain_matching: Vec<&'static str>,
    /// Extensions a filter's own config names (the compressor's and decompressor's
    /// compression libraries).
    pub filter_extensions: Vec<&'static str>,
    /// The tracers an HTTP connection manager's `tracing.provider` may name (the
    /// bootstrap's own `tracing` is not served), and its request id extensions.
    pub tracers: Vec<&'static str>,
    pub request_id_extensions: Vec<&'static str>,
}

impl Implemented {
    /// The config types implemented in `role`.
    pub fn of(&self, role: Role) -> &[&'static str] {
        match role {
            Role::NetworkFilter => &self.network_filters,
            Role::HttpFilter => &self.http_filters,
            Role::ListenerFilter => &self.listener_filters,
            Role::TransportSocket => &self.transport_sockets,
            Role::ClusterType => &self.custom_cluster_types,
            Role::AccessLogger => &self.access_loggers,
            Role::ProtocolOptions => &self.protocol_options,
            Role::BootstrapExtension => &self.bootstrap_extensions,
            Role::Tracer => &self.tracers,
            Role::StatsSink => &[],
            // Reached through other fields: a cluster's upstream network `filters`.
            Role::Other => &self.upstream_network_filters,
        }
    }

    /// Whether `type_name` is implemented in `role`. Outside the named roles any type
    /// implemented somewhere counts, and so do protobuf's own value types.
    fn implements(&self, role: Role, type_name: &str) -> bool {
        if role != Role::Other {
            return self.of(role).contains(&type_name);
        }
        type_name.starts_with("google.protobuf.")
            || [
                &self.network_filters,
                &self.http_filters,
                &self.http_filter_per_route,
                &self.listener_filters,
                &self.transport_sockets,
                &self.custom_cluster_types,
                &self.access_loggers,
                &self.protocol_options,
                &self.filter_chain_matching,
                &self.filter_extensions,
                &self.request_id_extensions,
            ]
            .iter()
            .any(|list| list.contains(&type_name))
    }
}

/// Types that wrap an extension's config as JSON, naming the real type inside.
const TYPED_STRUCTS: &[&str] = &["udpa.type.v1.TypedStruct", "xds.type.v3.TypedStruct"];

const ANY: &str = "google.protobuf.Any";
const TYPED_EXTENSION_CONFIG: &str = "envoy.config.core.v3.TypedExtensionConfig";
const HTTP_FILTER: &str = "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter";

/// What an extension is, by where it sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    NetworkFilter,
    HttpFilter,
    ListenerFilter,
    TransportSocket,
    ClusterType,
    AccessLogger,
    StatsSink,
    Tracer,
    BootstrapExtension,
    ProtocolOptions,
    Other,
}

impl Role {
    /// The role of an `Any` reached through `holder` (`Message.field`); for a
    /// `TypedExtensionConfig`, the field holding that message.
    fn of(holder: &str) -> Role {
        match holder {
            "envoy.config.listener.v3.Filter.typed_config" => Role::NetworkFilter,
            "envoy.config.listener.v3.ListenerFilter.typed_config" => Role::ListenerFilter,
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter.typed_config" => {
                Role::HttpFilter
            }
            "envoy.config.core.v3.TransportSocket.typed_config" => Role::TransportSocket,
            "envoy.config.cluster.v3.Cluster.CustomClusterType.typed_config" => Role::ClusterType,
            "envoy.config.accesslog.v3.AccessLog.typed_config" => Role::AccessLogger,
            "envoy.config.metrics.v3.StatsSink.typed_config" => Role::StatsSink,
            "envoy.config.trace.v3.Tracing.Http.typed_config" => Role::Tracer,
            "envoy.config.bootstrap.v3.Bootstrap.bootstrap_extensions" => Role::BootstrapExtension,
            "envoy.config.cluster.v3.Cluster.typed_extension_protocol_options" => {
                Role::ProtocolOptions
            }
            _ => Role::Other,
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Role::NetworkFilter => "network filter",
            Role::HttpFilter => "HTTP filter",
            Role::ListenerFilter => "listener filter",
            Role::TransportSocket => "transport socket",
            Role::ClusterType => "cluster type",
            Role::AccessLogger => "access logger",
            Role::StatsSink => "stats sink",
            Role::Tracer => "tracer",
            Role::BootstrapExtension => "bootstrap extension",
            Role::ProtocolOptions => "protocol options",
            Role::Other => "extension",
        }
    }
}

/// Reports every extension in `bootstrap` that is not in `implemented`.
pub fn check(
    bootstrap: &Bootstrap,
    implemented: &Implemented,
    findings: &mut Vec<Diagnostic>,
) -> Result<(), PoolError> {
    let pool = &pool()?;
    let desc = pool
        .get_message_by_name(&Bootstrap::full_name())
        .ok_or_else(|| PoolError::missing(&Bootstrap::full_name()))?;
    match DynamicMessage::decode(desc, bootstrap.encode_to_vec().as_slice()) {
        Ok(message) => Walker {
            pool,
            implemented,
            findings,
        }
        .message(&message, &mut Path::default(), ""),
        Err(err) => findings.push(Diagnostic::error(
            "",
            format!("re-reading the bootstrap: {err}"),
        )),
    }
    Ok(())
}

struct Walker<'a> {
    pool: &'a DescriptorPool,
    implemented: &'a Implemented,
    findings: &'a mut Vec<Diagnostic>,
}

impl Walker<'_> {
    /// `holder` is the `Message.field` through which `message` was reached.
    fn message(&mut self, message: &DynamicMessage, path: &mut Path, holder: &str) {
        let type_name = message.descriptor().full_name().to_owned();
        self.check_message(message, &type_name, path);
        for (field, value) in message.fields() {
            let here = format!("{type_name}.{}", field.name());
            // A TypedExtensionConfig's role comes from where it is held.
            let role_key = if type_name == TYPED_EXTENSION_CONFIG {
                holder.to_owned()
            } else {
                here.clone()
            };
            path.field(field.name());
            each_message(value, path, &mut |item, path| {
                if item.descriptor().full_name() == ANY {
                    self.any(item, message, &role_key, path);
                } else {
                    self.message(item, path, &here);
                }
                None::<()>
            });
            path.pop();
        }
    }

    /// What is not an `Any` but still names something shunt must implement.
    fn check_message(&mut self, message: &DynamicMessage, type_name: &str, path: &Path) {
        match type_name {
            "envoy.config.cluster.v3.Cluster" => {
                if let Some(Value::EnumNumber(number)) =
                    message.get_field_by_name("type").as_deref()
                    && message.has_field_by_name("type")
                {
                    let name = message
                        .descriptor()
                        .get_field_by_name("type")
                        .and_then(|field| field.kind().as_enum().cloned())
                        .and_then(|kind| kind.get_value(*number))
                        .map_or_else(|| number.to_string(), |value| value.name().to_owned());
                    if !self.implemented.cluster_types.contains(&name.as_str()) {
                        self.findings.push(Diagnostic::error(
                            JsonPath::from(path).field("type"),
                            format!("cluster type {name} is not implemented by shunt"),
                        ));
                    }
                }
            }
            "envoy.config.listener.v3.Filter"
            | "envoy.config.listener.v3.ListenerFilter"
            | HTTP_FILTER
                if message.has_field_by_name("config_discovery") =>
            {
                let (severity, tail) = optional_http_filter(message, type_name)
                    .map_or((Severity::Error, ""), |why| (Severity::Warning, why));
                self.findings.push(Diagnostic {
                    severity,
                    path: JsonPath::from(path).field("config_discovery").into(),
                    message: format!(
                        "{} is configured through extension config discovery (ECDS), which \
                         shunt does not implement{tail}",
                        describe_name(message)
                    ),
                });
            }
            _ => {}
        }
    }

    fn any(&mut self, any: &DynamicMessage, parent: &DynamicMessage, role_key: &str, path: &Path) {
        let role = Role::of(role_key);
        let type_url = string_field(any, "type_url");
        let bytes = match any.get_field_by_name("value").as_deref() {
            Some(Value::Bytes(bytes)) => bytes.clone(),
            _ => Default::default(),
        };
        let mut type_name = type_name_of_url(&type_url).to_owned();
        let desc = self.pool.get_message_by_name(&type_name);
        let mut wrapped = false;
        if TYPED_STRUCTS.contains(&type_name.as_str())
            && let Some(desc) = &desc
            && let Ok(typed_struct) = DynamicMessage::decode(desc.clone(), bytes.clone())
        {
            type_name = type_name_of_url(&string_field(&typed_struct, "type_url")).to_owned();
            wrapped = true;
        }
        // The bootstrap's own `tracing.http` is never used: only an HCM's provider is.
        let bootstrap_tracer = role == Role::Tracer && path.to_string().starts_with("tracing.");
        if bootstrap_tracer || !self.implemented.implements(role, &type_name) {
            self.report(role, parent, &type_name, wrapped, path);
            return;
        }
        if wrapped {
            // A known type given as JSON in a TypedStruct: nothing to walk into here.
            return;
        }
        let Some(desc) = desc else {
            self.findings.push(Diagnostic::error(
                path.to_string(),
                format!("an Any of type {type_name}, which shunt does not know"),
            ));
            return;
        };
        match DynamicMessage::decode(desc, bytes) {
            Ok(payload) => self.message(&payload, &mut path.clone(), role_key),
            Err(err) => self.findings.push(Diagnostic::error(
                path.to_string(),
                format!("{type_name} does not decode: {err}"),
            )),
        }
    }

    fn report(
        &mut self,
        role: Role,
        parent: &DynamicMessage,
        type_name: &str,
        wrapped: bool,
        path: &Path,
    ) {
        let parent_type = parent.descriptor().full_name().to_owned();
        if let Some(refusal) =
            super::convert::wasm_unsupported(type_name, &string_field(parent, "name"))
        {
            self.findings
                .push(Diagnostic::error(path.to_string(), refusal));
            return;
        }
        let what = format!(
            "{} {}({}{})",
            role.noun(),
            if role == Role::ProtocolOptions || role == Role::Other {
                String::new()
            } else {
                format!("{} ", describe_name(parent))
            },
            type_name,
            if wrapped { ", as a TypedStruct" } else { "" }
        );
        let (severity, consequence) = match role {
            Role::NetworkFilter | Role::ListenerFilter => {
                (Severity::Error, "the listener cannot be served without it")
            }
            Role::TransportSocket => (
                Severity::Error,
                "the listener or cluster that names it cannot be served without it",
            ),
            Role::ClusterType => (Severity::Error, "the cluster cannot be served without it"),
            Role::HttpFilter => match optional_http_filter(parent, &parent_type) {
                Some(why) => (Severity::Warning, why),
                None if HTTP_FILTERS_SAFE_TO_SKIP.contains(&type_name) => (
                    Severity::Warning,
                    "; shunt leaves it out, responses are not re-encoded",
                ),
                None if HTTP_FILTERS_SKIPPED_WITH_A_WARNING
                    .iter()
                    .any(|(name, _)| *name == type_name) =>
                {
                    (Severity::Warning, "; shunt leaves it out (telemetry only)")
                }
                None => (Severity::Error, "the listener cannot be served without it"),
            },
            _ => (Severity::Warning, "ignored"),
        };
        let separator = if consequence.starts_with(';') {
            ""
        } else {
            "; "
        };
        self.findings.push(Diagnostic {
            severity,
            path: path.to_string(),
            message: format!("{what} is not implemented by shunt{separator}{consequence}"),
        });
    }
}

/// Why an HTTP filter may be left out, if its config says it may.
fn optional_http_filter(message: &DynamicMessage, type_name: &str) -> Option<&'static str> {
    if type_name != HTTP_FILTER {
        return None;
    }
    let flag = |name| {
        matches!(
            message.get_field_by_name(name).as_deref(),
            Some(Value::Bool(true))
        )
    };
    if flag("is_optional") {
        Some("; it is marked is_optional, so shunt leaves it out")
    } else if flag("disabled") {
        Some("; it is disabled by default, so shunt leaves it out")
    } else {
        None
    }
}

/// The `name` beside an extension, quoted, or a placeholder.
fn describe_name(message: &DynamicMessage) -> String {
    match message.descriptor().get_field_by_name("name") {
        Some(_) => format!("{:?}", string_field(message, "name")),
        None => "(unnamed)".into(),
    }
}

fn string_field(message: &DynamicMessage, name: &str) -> String {
    match message.get_field_by_name(name).as_deref() {
        Some(Value::String(text)) => text.clone(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::json::from_json;

    /// What these tests take as implemented: a few of shunt's types.
    fn implemented() -> Implemented {
        Implemented {
            network_filters: vec![
                "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                HTTP_CONNECTION_MANAGER,
            ],
            http_filters: vec!["envoy.extensions.filters.http.router.v3.Router"],
            bootstrap_extensions: vec![
                "envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
            ],
            cluster_types: vec!["STATIC"],
            ..Default::default()
        }
    }

    const HTTP_CONNECTION_MANAGER: &str =
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

    fn findings_for(value: serde_json::Value) -> Vec<Diagnostic> {
        let (bootstrap, _) = from_json::<Bootstrap>(value).unwrap();
        let mut findings = Vec::new();
        check(&bootstrap, &implemented(), &mut findings).unwrap();
        findings
    }

    fn listener_with_filter(type_url: &str) -> serde_json::Value {
        json!({"static_resources": {"listeners": [{
            "name": "l",
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": 80}},
            "filter_chains": [{"filters": [{
                "name": "the-filter",
                "typed_config": {"@type": type_url}
            }]}]
        }]}})
    }

    #[test]
    fn implemented_network_filters_pass() {
        let findings = findings_for(listener_with_filter(
            "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        ));
        assert_eq!(findings, []);
    }

    #[test]
    fn an_unknown_network_filter_is_an_error_at_its_path() {
        let findings = findings_for(listener_with_filter(
            "type.googleapis.com/envoy.extensions.filters.network.redis_proxy.v3.RedisProxy",
        ));
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert_eq!(findings[0].severity, Severity::Error);
        assert_eq!(
            findings[0].path,
            "static_resources.listeners[0].filter_chains[0].filters[0].typed_config"
        );
        assert!(
            findings[0].message.starts_with(
                "network filter \"the-filter\" (envoy.extensions.filters.network.redis_proxy.v3.RedisProxy) is not implemented"
            ),
            "{}",
            findings[0].message
        );
    }

    #[test]
    fn a_tracer_shunt_lacks_is_a_warning_at_its_path() {
        let findings = findings_for(json!({"tracing": {"http": {
            "name": "envoy.tracers.zipkin",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                "collector_cluster": "zipkin",
                "collector_endpoint": "/api/v2/spans"
            }
        }}}));
        assert_eq!(findings.len(), 1);
        assert_eq!(findings[0].severity, Severity::Warning);
        assert_eq!(findings[0].path, "tracing.http.typed_config");
        assert!(
            findings[0]
                .message
                .contains("tracer \"envoy.tracers.zipkin\"")
        );
    }

    #[test]
    fn typed_struct_extensions_are_named_by_the_type_inside() {
        let findings = findings_for(json!({"bootstrap_extensions": [{
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {
                "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
            }
        }, {
            "name": "envoy.bootstrap.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                "type_url": "type.googleapis.com/envoy.extensions.wasm.v3.WasmService"
            }
        }]}));
        assert_eq!(findings.len(), 1);
        assert_eq!(findings[0].severity, Severity::Warning);
        // The internal listener extension is implemented: only Wasm is named.
        assert_eq!(findings[0].path, "bootstrap_extensions[1].typed_config");
        assert!(
            findings[0]
                .message
                .contains("envoy.extensions.wasm.v3.WasmService, as a TypedStruct"),
            "{}",
            findings[0].message
        );
    }

    #[test]
    fn http_filters_are_errors_unless_optional_or_harmless_to_skip() {
        let hcm = |filters: serde_json::Value| {
            json!({"static_resources": {"listeners": [{
                "name": "l",
                "filter_chains": [{"filters": [{
                    "name": "hcm",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "s",
                        "http_filters": filters
                    }
                }]}]
            }]}})
        };
        let rbac = json!({"name": "lua", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"}});
        let mut optional_rbac = rbac.clone();
        optional_rbac["is_optional"] = json!(true);
        let router = json!({"name": "router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}});

        let severities = |filters| {
            findings_for(hcm(filters))
                .into_iter()
                .map(|f| (f.path, f.severity))
                .collect::<Vec<_>>()
        };
        let at = |i: usize| {
            format!(
                "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[{i}].typed_config"
            )
        };
        assert_eq!(
            severities(json!([rbac, router])),
            [(at(0), Severity::Error)]
        );
        assert_eq!(
            severities(json!([optional_rbac, router])),
            [(at(0), Severity::Warning)]
        );
    }

    #[test]
    fn unknown_transport_sockets_and_cluster_types_are_errors() {
        let findings = findings_for(json!({"static_resources": {"clusters": [
            {"name": "a", "transport_socket": {"name": "alts", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.alts.v3.Alts"}}},
            {"name": "b", "cluster_type": {"name": "envoy.clusters.aggregate", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig"}}}
        ]}}));
        let got: Vec<_> = findings
            .iter()
            .map(|f| (f.path.as_str(), f.severity))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "static_resources.clusters[0].transport_socket.typed_config",
                    Severity::Error
                ),
                (
                    "static_resources.clusters[1].cluster_type.typed_config",
                    Severity::Error
                ),
            ]
        );
    }

    #[test]
    fn known_extensions_are_walked_into() {
        // An access logger inside a known network filter is still found.
        let findings = findings_for(json!({"static_resources": {"listeners": [{
            "name": "l",
            "filter_chains": [{"filters": [{
                "name": "tcp",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": "s",
                    "cluster": "c",
                    "access_log": [{"name": "grpc", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"}}]
                }
            }]}]
        }]}}));
        assert_eq!(findings.len(), 1);
        assert_eq!(findings[0].severity, Severity::Warning);
        assert_eq!(
            findings[0].path,
            "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.access_log[0].typed_config"
        );
    }
}
