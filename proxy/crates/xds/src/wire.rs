//! Discovery responses as the manager reads them: Envoy's `DiscoveryResponse` and
//! `DeltaDiscoveryResponse` with only the fields it uses, each resource's `Any` a slice
//! of the response's own buffer rather than a copy.
//!
//! A full push is thousands of resources. Decoded as envoy-types' messages, each cost
//! two allocations and a copy (its type URL and its bytes) before it was even looked
//! up, and in node mode every pod after the first finds each resource already accepted
//! by another pod (the manager's `interned` table) and drops its copy. Here a resource
//! costs no allocation until it is kept, and one of its exact length then.
//!
//! The field numbers are Envoy's (`envoy/service/discovery/v3/discovery.proto`); fields
//! the manager does not read are skipped as unknown ones.

use bytes::Bytes;
use envoy_types::pb::envoy::service::discovery::v3 as envoy;

/// `google.protobuf.Any`, both fields slices of the response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Any {
    #[prost(bytes = "bytes", tag = "1")]
    pub type_url: Bytes,
    #[prost(bytes = "bytes", tag = "2")]
    pub value: Bytes,
}

/// A state-of-the-world response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DiscoveryResponse {
    #[prost(string, tag = "1")]
    pub version_info: String,
    #[prost(message, repeated, tag = "2")]
    pub resources: Vec<Any>,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub nonce: String,
}

/// A Delta response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaDiscoveryResponse {
    #[prost(string, tag = "1")]
    pub system_version_info: String,
    #[prost(message, repeated, tag = "2")]
    pub resources: Vec<Resource>,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub nonce: String,
    #[prost(string, repeated, tag = "6")]
    pub removed_resources: Vec<String>,
}

/// One resource of a Delta response.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(message, optional, tag = "2")]
    pub resource: Option<Any>,
    #[prost(string, tag = "3")]
    pub name: String,
}

impl From<envoy_types::pb::google::protobuf::Any> for Any {
    /// An in-process server's resource: its buffers become the slices, uncopied.
    fn from(any: envoy_types::pb::google::protobuf::Any) -> Self {
        Any {
            type_url: any.type_url.into(),
            value: any.value.into(),
        }
    }
}

impl From<envoy::DiscoveryResponse> for DiscoveryResponse {
    fn from(response: envoy::DiscoveryResponse) -> Self {
        DiscoveryResponse {
            version_info: response.version_info,
            resources: response.resources.into_iter().map(Any::from).collect(),
            type_url: response.type_url,
            nonce: response.nonce,
        }
    }
}

impl From<envoy::DeltaDiscoveryResponse> for DeltaDiscoveryResponse {
    fn from(response: envoy::DeltaDiscoveryResponse) -> Self {
        DeltaDiscoveryResponse {
            system_version_info: response.system_version_info,
            resources: (response.resources.into_iter())
                .map(|r| Resource {
                    version: r.version,
                    resource: r.resource.map(Any::from),
                    name: r.name,
                })
                .collect(),
            type_url: response.type_url,
            nonce: response.nonce,
            removed_resources: response.removed_resources,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// Envoy's responses, encoded, read here with every field the manager uses, each
    /// resource's bytes a slice of the one buffer.
    #[test]
    fn envoys_responses_read_with_their_resources_as_slices() {
        let any = |name: &str| envoy_types::pb::google::protobuf::Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: name.as_bytes().to_vec(),
        };
        let sotw = envoy::DiscoveryResponse {
            version_info: "v1".into(),
            resources: vec![any("a"), any("bb")],
            canary: true,
            type_url: "T".into(),
            nonce: "n1".into(),
            ..Default::default()
        };
        let wire = Bytes::from(sotw.encode_to_vec());
        let read = DiscoveryResponse::decode(wire.clone()).unwrap();
        assert_eq!(read, DiscoveryResponse::from(sotw));
        let (start, end) = (wire.as_ptr() as usize, wire.as_ptr() as usize + wire.len());
        for resource in &read.resources {
            let at = resource.value.as_ptr() as usize;
            assert!((start..end).contains(&at), "a slice, not a copy");
        }

        let delta = envoy::DeltaDiscoveryResponse {
            system_version_info: "s".into(),
            resources: vec![envoy::Resource {
                name: "a".into(),
                version: "3".into(),
                resource: Some(any("a")),
                aliases: vec!["x".into()],
                ..Default::default()
            }],
            type_url: "T".into(),
            nonce: "n2".into(),
            removed_resources: vec!["gone".into()],
            ..Default::default()
        };
        let read = DeltaDiscoveryResponse::decode(Bytes::from(delta.encode_to_vec())).unwrap();
        assert_eq!(read, DeltaDiscoveryResponse::from(delta));
        assert_eq!(read.removed_resources, ["gone"]);
        assert_eq!(read.resources[0].version, "3");
    }
}
