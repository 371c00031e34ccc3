//! The resource cache: what each accepted xDS resource is (its wire bytes, or decoded,
//! with its digest, version and update time), how a response edits a type's set and how that edit is
//! undone when the update is refused, and EDS endpoints merged into their clusters.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as EnvoyCluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener as EnvoyListener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::interned::{self, Kind};
use crate::snapshot::{Encoded, Kept};
use crate::type_url::TypeUrl;
use crate::wire;
use bytes::Bytes;
use shunt_config::Tracked;
use shunt_core::peer::workload_discovery::WorkloadResource;
use shunt_dns::name_table::NameTable;

/// An accepted resource, shared with the snapshots built from it: kept as its wire
/// bytes (see [`Encoded`]) but for Istio's own types.
#[derive(Debug, Clone)]
pub(super) enum Resource {
    Listener(Arc<Encoded<EnvoyListener>>),
    Cluster(Arc<Encoded<EnvoyCluster>>),
    Endpoints(Arc<Encoded<ClusterLoadAssignment>>),
    Route(Arc<Encoded<RouteConfiguration>>),
    Secret(Arc<Encoded<Secret>>),
    /// Istio's one unnamed name table.
    NameTable(Arc<NameTable>),
    /// An Istio workload, named by its uid.
    Workload(Arc<WorkloadResource>),
}

/// The interned copy of the message `bytes` decode to (`key`: see [`interned`]).
fn shared<T>(key: (Kind, usize, u64), bytes: &[u8]) -> Result<Arc<T>, prost::DecodeError>
where
    T: Message + Default + Send + Sync + 'static,
{
    let (kind, len, digest) = key;
    interned::intern(kind, len, digest, || T::decode(bytes))
}

/// The interned copy of `bytes` kept as they are (checked to decode): copied out of the
/// response's buffer, at their exact length, only if no live copy is.
fn encoded<T: Kept + 'static>(
    key: (Kind, usize, u64),
    bytes: Bytes,
) -> Result<Arc<Encoded<T>>, prost::DecodeError> {
    let (kind, len, digest) = key;
    interned::intern(kind, len, digest, || {
        Encoded::from_vec(Vec::from(bytes), digest)
    })
}

impl Resource {
    /// Decodes `any` (whose bytes have `digest`), or shares the copy another manager of
    /// this process decoded from the same bytes ([`super::interned`]).
    pub(super) fn decode(kind: TypeUrl, any: wire::Any, digest: u64) -> Result<Resource, String> {
        // Compared as bytes: the type URL is only read as text for an error.
        let type_url = || String::from_utf8_lossy(&any.type_url).into_owned();
        if any.type_url != kind.as_str().as_bytes() {
            return Err(format!(
                "a {} response carries a resource of type {}",
                kind.short().to_uppercase(),
                type_url()
            ));
        }
        let bytes = any.value;
        let key = (Kind::Decoded(kind), bytes.len(), digest);
        let decoded = match kind {
            TypeUrl::Listener => encoded(key, bytes).map(Resource::Listener),
            TypeUrl::Cluster => encoded(key, bytes).map(Resource::Cluster),
            TypeUrl::ClusterLoadAssignment => encoded(key, bytes).map(Resource::Endpoints),
            TypeUrl::RouteConfiguration => encoded(key, bytes).map(Resource::Route),
            TypeUrl::Secret => encoded(key, bytes).map(Resource::Secret),
            TypeUrl::NameTable => shared(key, &bytes).map(Resource::NameTable),
            TypeUrl::Workload => shared(key, &bytes).map(Resource::Workload),
        };
        decoded.map_err(|e| format!("decoding {}: {e}", type_url()))
    }

    /// The name, shared with the accepted resource where it has one of its own: the
    /// key every map of the manager holds it under.
    pub(super) fn key(&self) -> Arc<str> {
        match self {
            Resource::Listener(r) => r.name.clone(),
            Resource::Cluster(r) => r.name.clone(),
            Resource::Endpoints(r) => r.name.clone(),
            Resource::Route(r) => r.name.clone(),
            Resource::Secret(r) => r.name.clone(),
            Resource::NameTable(_) | Resource::Workload(_) => self.name().into(),
        }
    }

    pub(super) fn name(&self) -> &str {
        match self {
            Resource::Listener(r) => &r.name,
            Resource::Cluster(r) => &r.name,
            Resource::Endpoints(r) => &r.name,
            Resource::Route(r) => &r.name,
            Resource::Secret(r) => &r.name,
            Resource::NameTable(_) => "",
            Resource::Workload(r) => &r.uid,
        }
    }

    /// The resource as a NACK's `failed_configuration` shows it: as it came.
    pub(super) fn to_any(&self, kind: TypeUrl) -> Any {
        let value = match self {
            Resource::Listener(r) => r.bytes.to_vec(),
            Resource::Cluster(r) => r.bytes.to_vec(),
            Resource::Endpoints(r) => r.bytes.to_vec(),
            Resource::Route(r) => r.bytes.to_vec(),
            Resource::Secret(r) => r.bytes.to_vec(),
            Resource::NameTable(r) => r.encode_to_vec(),
            Resource::Workload(r) => r.encode_to_vec(),
        };
        Any {
            type_url: kind.as_str().to_owned(),
            value,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Accepted {
    pub(super) resource: Resource,
    /// Digest of the resource as it came on the wire: tells a changed one from a resent one.
    pub(super) digest: u64,
    /// The resource's version: Delta's own, or the SotW response's.
    pub(super) version: Arc<str>,
    pub(super) last_updated: SystemTime,
}

impl Accepted {
    pub(super) fn new(
        kind: TypeUrl,
        any: wire::Any,
        version: Arc<str>,
    ) -> Result<Accepted, String> {
        let digest = xxhash_rust::xxh64::xxh64(&any.value, 0);
        Ok(Accepted {
            resource: Resource::decode(kind, any, digest)?,
            digest,
            version,
            last_updated: SystemTime::now(),
        })
    }

    pub(super) fn tracked<T>(&self, resource: &Arc<T>) -> Tracked<Arc<T>> {
        Tracked {
            resource: resource.clone(),
            version_info: Some(self.version.clone()),
            last_updated: self.last_updated,
        }
    }
}

/// How a response changes a type's accepted set.
pub(super) enum Edit {
    /// State of the world for a wildcard type: this is the whole set.
    Replace(BTreeMap<Arc<str>, Accepted>),
    /// These entries added or replaced, these names removed.
    Patch {
        upserts: Vec<(Arc<str>, Accepted)>,
        removals: Vec<Arc<str>>,
    },
}

/// An EDS cluster's endpoints (`eds`, if they came: the accepted resource itself, shared
/// with the cache and every pod that has it) and the digest of the cluster (whose CDS
/// config has `cluster_digest`) with them: compiled from both where they are, with no
/// copy of the cluster holding the endpoints.
pub(super) fn with_endpoints_of(
    cluster_digest: u64,
    eds: Option<&Accepted>,
) -> (Option<Arc<Encoded<ClusterLoadAssignment>>>, u64) {
    let endpoints = match eds.map(|e| &e.resource) {
        Some(Resource::Endpoints(cla)) => Some(cla.clone()),
        _ => None,
    };
    let eds_digest = eds.map_or(0, |e| e.digest);
    // On the stack: this runs for every EDS cluster of every rebuild.
    let mut both = [0u8; 16];
    both[..8].copy_from_slice(&cluster_digest.to_le_bytes());
    both[8..].copy_from_slice(&eds_digest.to_le_bytes());
    let digest = xxhash_rust::xxh64::xxh64(&both, 0);
    (endpoints, digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resource of another type than its response's is refused, named by its type URL;
    /// one of the response's type is accepted with its name.
    #[test]
    fn a_resource_of_another_type_is_refused_by_its_type_url() {
        let cluster = EnvoyCluster {
            name: "outbound|80||a".into(),
            ..Default::default()
        };
        let value = Bytes::from(cluster.encode_to_vec());
        let any = |type_url: TypeUrl| wire::Any {
            type_url: type_url.as_str().as_bytes().to_vec().into(),
            value: value.clone(),
        };
        let version: Arc<str> = "1".into();
        let err =
            Accepted::new(TypeUrl::Cluster, any(TypeUrl::Listener), version.clone()).unwrap_err();
        assert_eq!(
            err,
            format!(
                "a CDS response carries a resource of type {}",
                TypeUrl::Listener.as_str()
            )
        );
        let accepted = Accepted::new(TypeUrl::Cluster, any(TypeUrl::Cluster), version).unwrap();
        assert_eq!(accepted.resource.name(), "outbound|80||a");
    }
}
