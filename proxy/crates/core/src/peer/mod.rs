//! A workload's peer identity, as Istio's proxies exchange it: the node metadata istiod's
//! pilot-agent writes into the bootstrap (`NAME`, `NAMESPACE`, `LABELS`, `WORKLOAD_NAME`,
//! `OWNER`, `CLUSTER_ID`, ...), the subset of it one proxy sends the other
//! ([`NodeMetadata`]), and the workload view the stats read from it ([`Workload`]).
//!
//! The wire forms live in the submodules: [`exchange`] is the TCP metadata exchange
//! (`istio-peer-exchange` ALPN), [`headers`] the HTTP `x-envoy-peer-metadata` headers and
//! the baggage form, [`proto`] the deterministic `google.protobuf.Struct` encoding both
//! need so the bytes equal istio-proxy's. [`workload_discovery`] is the other way to know
//! a peer: by its address, from the workloads istiod serves over xDS.

pub mod exchange;
pub mod filter_state;
pub mod headers;
pub mod workload_discovery;

pub use filter_state::PeerInfo;

use std::collections::BTreeMap;
use std::sync::Arc;

use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};

/// The canonical service label istiod's injector sets on every pod.
pub const CANONICAL_NAME_LABEL: &str = "service.istio.io/canonical-name";
/// The canonical revision label.
pub const CANONICAL_REVISION_LABEL: &str = "service.istio.io/canonical-revision";
/// The prefix of an `OWNER` istiod writes: `kubernetes://apis/apps/v1/namespaces/<ns>/...`.
pub const OWNER_PREFIX: &str = "kubernetes://apis/apps/v1/namespaces/";

/// The node metadata fields a proxy exchanges with its peer: exactly those istio-proxy's
/// metadata exchange keeps from its node metadata (its `FlatNode`), every other key is
/// dropped before sending and ignored on receipt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeMetadata {
    /// `NAME`: the pod name.
    pub name: String,
    /// `NAMESPACE`.
    pub namespace: String,
    /// `OWNER`: `kubernetes://apis/apps/v1/namespaces/<ns>/deployments/<name>`.
    pub owner: String,
    /// `WORKLOAD_NAME`: the deployment (or pod, job, ...) name.
    pub workload_name: String,
    /// `ISTIO_VERSION`.
    pub istio_version: String,
    /// `MESH_ID`.
    pub mesh_id: String,
    /// `CLUSTER_ID`.
    pub cluster_id: String,
    /// `LABELS`: the pod's labels (`app`, `version`, the canonical service labels...).
    pub labels: BTreeMap<String, String>,
    /// `PLATFORM_METADATA`: cloud platform facts (GCP project, zone...).
    pub platform_metadata: BTreeMap<String, String>,
    /// `APP_CONTAINERS`: comma-separated on the wire.
    pub app_containers: Vec<String>,
    /// `INSTANCE_IPS`: comma-separated on the wire.
    pub instance_ips: Vec<String>,
}

impl NodeMetadata {
    /// Reads the exchanged fields of a node metadata `Struct` (the bootstrap's
    /// `node.metadata`, or what a peer sent). Values of other kinds than expected read as
    /// empty, as istio-proxy's reader does: the exchange never fails on a peer's extra or
    /// odd fields.
    pub fn from_struct(metadata: &Struct) -> Self {
        let text = |key: &str| -> String {
            match metadata.fields.get(key).and_then(|v| v.kind.as_ref()) {
                Some(Kind::StringValue(s)) => s.clone(),
                _ => String::new(),
            }
        };
        let map = |key: &str| -> BTreeMap<String, String> {
            match metadata.fields.get(key).and_then(|v| v.kind.as_ref()) {
                Some(Kind::StructValue(s)) => s
                    .fields
                    .iter()
                    .map(|(k, v)| {
                        let value = match &v.kind {
                            Some(Kind::StringValue(s)) => s.clone(),
                            _ => String::new(),
                        };
                        (k.clone(), value)
                    })
                    .collect(),
                _ => BTreeMap::new(),
            }
        };
        let list = |key: &str| -> Vec<String> {
            match metadata.fields.get(key).and_then(|v| v.kind.as_ref()) {
                Some(Kind::StringValue(s)) if !s.is_empty() => {
                    s.split(',').map(str::to_owned).collect()
                }
                _ => Vec::new(),
            }
        };
        NodeMetadata {
            name: text("NAME"),
            namespace: text("NAMESPACE"),
            owner: text("OWNER"),
            workload_name: text("WORKLOAD_NAME"),
            istio_version: text("ISTIO_VERSION"),
            mesh_id: text("MESH_ID"),
            cluster_id: text("CLUSTER_ID"),
            labels: map("LABELS"),
            platform_metadata: map("PLATFORM_METADATA"),
            app_containers: list("APP_CONTAINERS"),
            instance_ips: list("INSTANCE_IPS"),
        }
    }

    /// The `Struct` a proxy sends its peer: only the fields that are set (an unset string
    /// is left out, as istio-proxy leaves out an absent flatbuffer field).
    pub fn to_struct(&self) -> Struct {
        let mut fields = std::collections::HashMap::new();
        let mut text = |key: &str, value: &str| {
            if !value.is_empty() {
                fields.insert(key.to_owned(), string_value(value));
            }
        };
        text("NAME", &self.name);
        text("NAMESPACE", &self.namespace);
        text("OWNER", &self.owner);
        text("WORKLOAD_NAME", &self.workload_name);
        text("ISTIO_VERSION", &self.istio_version);
        text("MESH_ID", &self.mesh_id);
        text("CLUSTER_ID", &self.cluster_id);
        text("APP_CONTAINERS", &self.app_containers.join(","));
        text("INSTANCE_IPS", &self.instance_ips.join(","));
        for (key, map) in [
            ("LABELS", &self.labels),
            ("PLATFORM_METADATA", &self.platform_metadata),
        ] {
            if !map.is_empty() {
                let inner = Struct {
                    fields: map
                        .iter()
                        .map(|(k, v)| (k.clone(), string_value(v)))
                        .collect(),
                };
                fields.insert(
                    key.to_owned(),
                    Value {
                        kind: Some(Kind::StructValue(inner)),
                    },
                );
            }
        }
        Struct { fields }
    }

    /// The workload view of this node (what the stats label with).
    pub fn workload(&self) -> Workload {
        let label = |key: &str| self.labels.get(key).cloned().unwrap_or_default();
        Workload {
            instance_name: self.name.clone(),
            cluster_name: self.cluster_id.clone(),
            namespace_name: self.namespace.clone(),
            workload_name: self.workload_name.clone(),
            canonical_name: label(CANONICAL_NAME_LABEL),
            canonical_revision: label(CANONICAL_REVISION_LABEL),
            app_name: label("app"),
            app_version: label("version"),
            workload_type: WorkloadType::from_owner(&self.owner, &self.workload_name),
            identity: String::new(),
        }
    }
}

fn string_value(value: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(value.to_owned())),
    }
}

/// The kind of controller that owns a workload, as the baggage form names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WorkloadType {
    #[default]
    Pod,
    Deployment,
    Job,
    CronJob,
}

impl WorkloadType {
    /// The singular name used in `OWNER` (`.../deployments/<name>`) and baggage
    /// (`k8s.deployment.name`).
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadType::Pod => "pod",
            WorkloadType::Deployment => "deployment",
            WorkloadType::Job => "job",
            WorkloadType::CronJob => "cronjob",
        }
    }

    /// Read from an `OWNER` ending in `/<type>s/<workload name>`; anything else is a pod,
    /// as istio-proxy reads it.
    pub fn from_owner(owner: &str, workload_name: &str) -> Self {
        let Some(rest) = owner.strip_suffix(workload_name) else {
            return WorkloadType::Pod;
        };
        let Some(rest) = rest.strip_suffix("s/") else {
            return WorkloadType::Pod;
        };
        match rest.rsplit('/').next() {
            Some("deployment") => WorkloadType::Deployment,
            Some("job") => WorkloadType::Job,
            Some("cronjob") => WorkloadType::CronJob,
            _ => WorkloadType::Pod,
        }
    }
}

/// A workload as Istio's telemetry sees it (istio-proxy's `WorkloadMetadataObject`): the
/// peer learned through an exchange or baggage, or the local node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Workload {
    pub instance_name: String,
    pub cluster_name: String,
    pub namespace_name: String,
    pub workload_name: String,
    pub canonical_name: String,
    pub canonical_revision: String,
    pub app_name: String,
    pub app_version: String,
    pub workload_type: WorkloadType,
    /// The SPIFFE id, when known without TLS: workload discovery gives it, the exchanged
    /// forms do not (there the peer's certificate is the identity).
    pub identity: String,
}

impl Workload {
    /// The node metadata that carries this workload (what istio-proxy builds to send a
    /// workload learned from baggage or workload discovery): `OWNER` in Istio's form,
    /// the four labels.
    pub fn to_node_metadata(&self) -> NodeMetadata {
        let mut labels = BTreeMap::new();
        for (key, value) in [
            (CANONICAL_NAME_LABEL, &self.canonical_name),
            (CANONICAL_REVISION_LABEL, &self.canonical_revision),
            ("app", &self.app_name),
            ("version", &self.app_version),
        ] {
            labels.insert(key.to_owned(), value.clone());
        }
        NodeMetadata {
            name: self.instance_name.clone(),
            namespace: self.namespace_name.clone(),
            owner: format!(
                "{OWNER_PREFIX}{}/{}s/{}",
                self.namespace_name,
                self.workload_type.as_str(),
                self.workload_name
            ),
            workload_name: self.workload_name.clone(),
            cluster_id: self.cluster_name.clone(),
            labels,
            ..NodeMetadata::default()
        }
    }

    /// Istio's compact endpoint encoding of `filter_metadata.istio.workload` on an EDS
    /// endpoint: `workload;namespace;canonical service;canonical revision;cluster`; the
    /// client side's fallback when the peer sent nothing. `None` with fewer than 5 parts.
    pub fn from_endpoint_metadata(encoded: &str) -> Option<Self> {
        let parts: Vec<&str> = encoded.split(';').collect();
        if parts.len() < 5 {
            return None;
        }
        Some(Workload {
            workload_name: parts[0].to_owned(),
            namespace_name: parts[1].to_owned(),
            canonical_name: parts[2].to_owned(),
            canonical_revision: parts[3].to_owned(),
            cluster_name: parts[4].to_owned(),
            ..Workload::default()
        })
    }
}

/// The node as one proxy instance knows itself: its id and metadata from the bootstrap.
/// Each proxy instance has its own (node mode serves many pods from one process), carried
/// by its compiled config, never a process global.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocalNode {
    /// `node.id`: `sidecar~10.0.0.1~pod.ns~ns.svc.cluster.local`.
    pub id: String,
    /// `node.cluster` and `node.locality.zone` (tracers name spans' service and zone).
    pub cluster: String,
    pub zone: String,
    pub metadata: NodeMetadata,
    /// `SERVICE_ACCOUNT`, not exchanged but part of the node's identity.
    pub service_account: String,
    /// The instance's workload index (WDS), set by its own xDS stream.
    pub workloads: Arc<workload_discovery::WorkloadDiscovery>,
}

impl LocalNode {
    /// From the bootstrap's `node`.
    pub fn from_node(node: &envoy_types::pb::envoy::config::core::v3::Node) -> Self {
        let metadata = node.metadata.clone().unwrap_or_default();
        let service_account = match metadata
            .fields
            .get("SERVICE_ACCOUNT")
            .and_then(|v| v.kind.as_ref())
        {
            Some(Kind::StringValue(s)) => s.clone(),
            _ => String::new(),
        };
        LocalNode {
            id: node.id.clone(),
            cluster: node.cluster.clone(),
            zone: node
                .locality
                .as_ref()
                .map(|l| l.zone.clone())
                .unwrap_or_default(),
            metadata: NodeMetadata::from_struct(&metadata),
            service_account,
            workloads: Arc::default(),
        }
    }

    pub fn workload(&self) -> Workload {
        self.metadata.workload()
    }
}

/// A JSON object as a `Struct` (tests build node metadata from JSON fixtures).
#[cfg(test)]
pub(crate) fn struct_from_json(json: &serde_json::Value) -> Struct {
    fn value(json: &serde_json::Value) -> Value {
        use envoy_types::pb::google::protobuf::ListValue;
        let kind = match json {
            serde_json::Value::Null => Kind::NullValue(0),
            serde_json::Value::Bool(b) => Kind::BoolValue(*b),
            serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
            serde_json::Value::String(s) => Kind::StringValue(s.clone()),
            serde_json::Value::Array(a) => Kind::ListValue(ListValue {
                values: a.iter().map(value).collect(),
            }),
            serde_json::Value::Object(_) => Kind::StructValue(struct_from_json(json)),
        };
        Value { kind: Some(kind) }
    }
    Struct {
        fields: json
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), value(v)))
            .collect(),
    }
}

#[cfg(test)]
mod tests;
