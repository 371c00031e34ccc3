//! The HTTP forms of peer metadata that `io.istio.http.peer_metadata.Config` discovers and
//! propagates: the `x-envoy-peer-metadata` header (the node metadata `Struct`,
//! deterministically encoded, in base64) with `x-envoy-peer-metadata-id` (the node id),
//! and the `baggage` header (`k8s.deployment.name=...,k8s.namespace.name=...`).

use base64::Engine;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::{DecodePaddingMode, general_purpose};
use envoy_types::pb::google::protobuf::Struct;
use prost::Message;

use super::{NodeMetadata, Workload, WorkloadType};
use crate::proto::encode_struct;

pub use super::exchange::{METADATA_ID_KEY as METADATA_ID_HEADER, METADATA_KEY as METADATA_HEADER};

/// The W3C baggage header.
pub const BAGGAGE_HEADER: &str = "baggage";

/// Envoy's `Base64::decodeWithoutPadding`: the standard alphabet, padding optional.
const LENIENT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why an `x-envoy-peer-metadata` value was not read (the filter then treats the peer as
/// unknown, as istio-proxy does).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("x-envoy-peer-metadata is not base64: {0}")]
    NotBase64(String),
    #[error("x-envoy-peer-metadata is not a protobuf Struct: {0}")]
    NotStruct(String),
}

/// The `x-envoy-peer-metadata` value for `node`.
pub fn encode_metadata(node: &NodeMetadata) -> String {
    general_purpose::STANDARD.encode(encode_struct(&node.to_struct()))
}

/// Reads an `x-envoy-peer-metadata` value.
pub fn decode_metadata(value: &str) -> Result<NodeMetadata, HeaderError> {
    let bytes = LENIENT
        .decode(value.trim())
        .map_err(|err| HeaderError::NotBase64(err.to_string()))?;
    let metadata =
        Struct::decode(bytes.as_slice()).map_err(|err| HeaderError::NotStruct(err.to_string()))?;
    Ok(NodeMetadata::from_struct(&metadata))
}

const NAMESPACE: &str = "k8s.namespace.name";
const CLUSTER: &str = "k8s.cluster.name";
const SERVICE_NAME: &str = "service.name";
const SERVICE_VERSION: &str = "service.version";
const APP_NAME: &str = "app.name";
const APP_VERSION: &str = "app.version";

impl Workload {
    /// Reads a `baggage` header value as istio-proxy does: known members set fields, the
    /// rest (and members without `=`) are ignored; the last of a repeated member wins.
    pub fn from_baggage(value: &str) -> Self {
        let mut workload = Workload::default();
        for member in value.split(',') {
            let (key, val) = member.split_once('=').unwrap_or((member, ""));
            let val = val.to_owned();
            match key {
                NAMESPACE => workload.namespace_name = val,
                CLUSTER => workload.cluster_name = val,
                SERVICE_NAME => workload.canonical_name = val,
                SERVICE_VERSION => workload.canonical_revision = val,
                APP_NAME => workload.app_name = val,
                APP_VERSION => workload.app_version = val,
                "k8s.pod.name" => {
                    workload.workload_type = WorkloadType::Pod;
                    workload.instance_name = val.clone();
                    workload.workload_name = val;
                }
                "k8s.deployment.name" => {
                    workload.workload_type = WorkloadType::Deployment;
                    workload.workload_name = val;
                }
                "k8s.job.name" => {
                    workload.workload_type = WorkloadType::Job;
                    workload.instance_name = val.clone();
                    workload.workload_name = val;
                }
                "k8s.cronjob.name" => {
                    workload.workload_type = WorkloadType::CronJob;
                    workload.workload_name = val;
                }
                _ => {}
            }
        }
        workload
    }

    /// The `baggage` value istio-proxy writes for this workload: the workload first, then
    /// the fields that are set, in a fixed order.
    pub fn baggage(&self) -> String {
        let mut out = format!(
            "k8s.{}.name={}",
            self.workload_type.as_str(),
            self.workload_name
        );
        for (key, value) in [
            (CLUSTER, &self.cluster_name),
            (NAMESPACE, &self.namespace_name),
            (SERVICE_NAME, &self.canonical_name),
            (SERVICE_VERSION, &self.canonical_revision),
            (APP_NAME, &self.app_name),
            (APP_VERSION, &self.app_version),
        ] {
            if !value.is_empty() {
                out.push(',');
                out.push_str(key);
                out.push('=');
                out.push_str(value);
            }
        }
        out
    }
}
