//! Istio's standard metrics, as istio-proxy's `istio.stats` filters (HTTP and network,
//! `stats.PluginConfig`) record them: `istio_requests_total`,
//! `istio_request_duration_milliseconds`, `istio_request_bytes`, `istio_response_bytes`,
//! `istio_tcp_connections_opened_total` / `_closed_total`, `istio_tcp_sent_bytes_total` /
//! `_received_bytes_total`, and `istio_build`, with Istio's standard labels in the order
//! istio-proxy writes them (a Prometheus scrape compares label sets, dashboards and tests
//! compare text).
//!
//! [`labels`] computes the labels from the local node, the peer and what the stream saw;
//! [`config`] reads the plugin config (custom dimensions, tag removal, dropped metrics,
//! custom metric definitions); [`expr`] evaluates the attribute expressions dimensions
//! use; [`Recorder`] writes into the stats store. The filters that feed it live with the
//! filter framework.

pub mod config;
pub mod expr;
pub mod labels;

use std::sync::Arc;

use crate::peer::LocalNode;
use crate::stats::Store;
use shunt_config::JsonPath;

pub use config::{PluginConfig, Reporter};
pub use labels::{Observation, Tags};

/// The custom stat namespace the metrics live under (`/stats` shows
/// `istiocustom.istio_requests_total.reporter.source...`).
pub const NAMESPACE: &str = "istiocustom";

/// One of the standard metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Metric {
    RequestsTotal,
    RequestDurationMilliseconds,
    RequestBytes,
    ResponseBytes,
    RequestMessagesTotal,
    ResponseMessagesTotal,
    TcpConnectionsOpenedTotal,
    TcpConnectionsClosedTotal,
    TcpSentBytesTotal,
    TcpReceivedBytesTotal,
}

impl Metric {
    pub const ALL: [Metric; 10] = [
        Metric::RequestsTotal,
        Metric::RequestDurationMilliseconds,
        Metric::RequestBytes,
        Metric::ResponseBytes,
        Metric::RequestMessagesTotal,
        Metric::ResponseMessagesTotal,
        Metric::TcpConnectionsOpenedTotal,
        Metric::TcpConnectionsClosedTotal,
        Metric::TcpSentBytesTotal,
        Metric::TcpReceivedBytesTotal,
    ];

    /// The name the plugin config uses (`requests_total`).
    pub fn config_name(self) -> &'static str {
        match self {
            Metric::RequestsTotal => "requests_total",
            Metric::RequestDurationMilliseconds => "request_duration_milliseconds",
            Metric::RequestBytes => "request_bytes",
            Metric::ResponseBytes => "response_bytes",
            Metric::RequestMessagesTotal => "request_messages_total",
            Metric::ResponseMessagesTotal => "response_messages_total",
            Metric::TcpConnectionsOpenedTotal => "tcp_connections_opened_total",
            Metric::TcpConnectionsClosedTotal => "tcp_connections_closed_total",
            Metric::TcpSentBytesTotal => "tcp_sent_bytes_total",
            Metric::TcpReceivedBytesTotal => "tcp_received_bytes_total",
        }
    }

    /// The stat name in the store: `istiocustom.istio_requests_total`.
    pub fn stat_name(self) -> String {
        format!("{NAMESPACE}.istio_{}", self.config_name())
    }

    pub fn from_config_name(name: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.config_name() == name)
    }
}

/// The label names istio-proxy knows as standard (what `tags_to_remove` and dimension
/// overrides may name).
pub const STANDARD_TAGS: &[&str] = &[
    "reporter",
    "source_workload",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_canonical_service",
    "source_canonical_revision",
    "source_cluster",
    "destination_workload",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
    "destination_service",
    "destination_service_name",
    "destination_service_namespace",
    "destination_canonical_service",
    "destination_canonical_revision",
    "destination_cluster",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
    "response_code",
    "grpc_response_status",
];

/// Records the metrics of one `istio.stats` filter config (one per listener filter
/// chain, sharing the proxy instance's store and node).
#[derive(Debug, Clone)]
pub struct Recorder {
    store: Store,
    node: Arc<LocalNode>,
    config: Arc<PluginConfig>,
}

impl Recorder {
    /// Also sets `istio_build{component="proxy",tag=<ISTIO_VERSION or unknown>}` to 1,
    /// as istio-proxy does when it creates the filter.
    pub fn new(store: Store, node: Arc<LocalNode>, config: Arc<PluginConfig>) -> Self {
        let version = if node.metadata.istio_version.is_empty() {
            "unknown"
        } else {
            node.metadata.istio_version.as_str()
        };
        store
            .tagged_gauge(
                &format!("{NAMESPACE}.istio_build"),
                &[("component", "proxy"), ("tag", version)],
            )
            .set(1);
        Recorder {
            store,
            node,
            config,
        }
    }

    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    pub fn node(&self) -> &LocalNode {
        &self.node
    }

    /// Adds `amount` to a counter metric under `tags`, after the config's drops and
    /// overrides (`attributes` evaluates custom dimensions).
    pub fn add(&self, metric: Metric, tags: &Tags, attributes: &dyn expr::Attributes, amount: u64) {
        if self.config.drops(metric) {
            return;
        }
        let tags = self.config.override_tags(metric, tags, attributes);
        let pairs = tags.as_pairs();
        self.store
            .tagged_counter(&metric.stat_name(), &pairs)
            .add(amount);
    }

    /// Records `value` in a histogram metric under `tags`.
    pub fn record(
        &self,
        metric: Metric,
        tags: &Tags,
        attributes: &dyn expr::Attributes,
        value: f64,
    ) {
        if self.config.drops(metric) {
            return;
        }
        let tags = self.config.override_tags(metric, tags, attributes);
        let pairs = tags.as_pairs();
        self.store
            .tagged_histogram(&metric.stat_name(), &pairs)
            .record(value);
    }

    /// The config's custom metrics (`definitions`), recorded at the end of a stream or
    /// connection with only their own dimensions, as istio-proxy does.
    pub fn record_custom(&self, attributes: &dyn expr::Attributes) {
        for definition in &self.config.definitions {
            let tags = self
                .config
                .custom_tags(&definition.name, attributes)
                .unwrap_or_default();
            let pairs = tags.as_pairs();
            let amount = definition.value.evaluate_int(attributes);
            let name = format!("{NAMESPACE}.istio_{}", definition.name);
            match definition.kind {
                config::MetricKind::Counter => self.store.tagged_counter(&name, &pairs).add(amount),
                config::MetricKind::Gauge => self.store.tagged_gauge(&name, &pairs).set(amount),
                config::MetricKind::Histogram => self
                    .store
                    .tagged_histogram(&name, &pairs)
                    .record(amount as f64),
            }
        }
    }
}

#[cfg(test)]
mod tests;

/// Compiles an `istio.stats` filter's `stats.PluginConfig` (typed, already out of its
/// `TypedStruct`) into a recorder for the proxy instance's `store` and `node`; `inbound`
/// is the listener's direction (an unset reporter follows it). Expressions shunt does not
/// evaluate are warnings, as istio-proxy drops what uses them.
pub fn compile(
    any: &envoy_types::pb::google::protobuf::Any,
    store: &Store,
    node: &Arc<LocalNode>,
    inbound: Option<bool>,
    path: &JsonPath,
    problems: &mut shunt_config::Diagnostics,
) -> Option<Recorder> {
    let json = match shunt_config::any_to_json(any) {
        Ok(json) => json,
        Err(err) => {
            problems.error(path, format!("stats.PluginConfig: {err}"));
            return None;
        }
    };
    let config = match PluginConfig::from_json(&json, inbound) {
        Ok(config) => config,
        Err(err) => {
            let at = if err.path.is_empty() {
                String::from(path)
            } else {
                format!("{path}.{}", err.path)
            };
            problems.error(at, err.to_string());
            return None;
        }
    };
    for warning in &config.warnings {
        problems.warning(path, warning.clone());
    }
    Some(Recorder::new(store.clone(), node.clone(), Arc::new(config)))
}

/// The first of a cluster's `filter_metadata.istio.services` (`host`, and `name` when
/// istiod wrote one).
pub fn cluster_service(
    metadata: &envoy_types::pb::envoy::config::core::v3::Metadata,
) -> Option<(String, Option<String>)> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let istio = metadata.filter_metadata.get("istio")?;
    let Some(Kind::ListValue(services)) = istio.fields.get("services")?.kind.as_ref() else {
        return None;
    };
    let Some(Kind::StructValue(service)) = services.values.first()?.kind.as_ref() else {
        return None;
    };
    let text = |key: &str| match service.fields.get(key).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    };
    Some((text("host").unwrap_or_default(), text("name")))
}

/// An endpoint's `filter_metadata.istio.workload` (`name;ns;service;revision;cluster`).
pub fn endpoint_workload(
    metadata: &envoy_types::pb::envoy::config::core::v3::Metadata,
) -> Option<crate::peer::Workload> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let istio = metadata.filter_metadata.get("istio")?;
    match istio.fields.get("workload")?.kind.as_ref() {
        Some(Kind::StringValue(s)) => crate::peer::Workload::from_endpoint_metadata(s),
        _ => None,
    }
}

/// The downstream's and this side's SPIFFE principals on an inbound connection:
/// istio_authn's filter state (`io.istio.peer_principal`, `io.istio.local_principal`),
/// else the TLS session's first URI SANs (istio-proxy's fallback).
pub fn downstream_principals(
    connection: &crate::stream_info::Connection,
) -> (Option<String>, Option<String>) {
    let peer = connection
        .filter_state
        .get_string("io.istio.peer_principal");
    let local = connection
        .filter_state
        .get_string("io.istio.local_principal");
    if peer.is_some() || local.is_some() {
        return (peer, local);
    }
    let tls = connection.tls.as_deref();
    (
        tls.and_then(|t| t.peer_uri_sans.first().cloned()),
        tls.and_then(|t| t.local_uri_sans.first().cloned()),
    )
}
