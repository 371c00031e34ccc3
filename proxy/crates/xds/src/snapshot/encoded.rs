//! xDS resources kept as they came on the wire: what the xDS manager and the snapshots
//! hold of each accepted cluster, route configuration, secret and EDS assignment between
//! compiles. Decoded, an Istio cluster or virtual host takes several times its wire
//! size, and only the compile of a changed resource and `/config_dump` read it whole;
//! the few facts the manager needs every time (the name; a cluster's EDS service,
//! secrets and fetch timeout) are taken out once, when the resource is accepted.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as EnvoyCluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use prost::Message;
use shunt_config::references::{self, SecretRef};

/// A message kept as bytes, with what is read of it without decoding it.
pub trait Kept: Message + Default {
    /// What is taken out of it when it is accepted.
    type Facts: fmt::Debug + Send + Sync;
    fn name(&self) -> &str;
    fn facts(&self) -> Self::Facts;
}

/// A resource as it came on the wire, checked to decode, with its name and facts.
pub struct Encoded<T: Kept> {
    pub name: String,
    pub facts: T::Facts,
    pub bytes: Box<[u8]>,
    message: PhantomData<fn() -> T>,
}

impl<T: Kept> fmt::Debug for Encoded<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoded")
            .field("name", &self.name)
            .field("facts", &self.facts)
            .field("bytes", &self.bytes.len())
            .finish()
    }
}

impl<T: Kept> Encoded<T> {
    /// `bytes` if they decode to a `T`.
    pub fn new(bytes: &[u8]) -> Result<Self, prost::DecodeError> {
        let decoded = T::decode(bytes)?;
        Ok(Encoded {
            name: decoded.name().to_owned(),
            facts: decoded.facts(),
            bytes: bytes.into(),
            message: PhantomData,
        })
    }

    /// `message` encoded (tests and resources made in place).
    pub fn of(message: &T) -> Self {
        Encoded {
            name: message.name().to_owned(),
            facts: message.facts(),
            bytes: message.encode_to_vec().into(),
            message: PhantomData,
        }
    }

    pub fn decode(&self) -> T {
        // They decoded when accepted.
        T::decode(&*self.bytes).unwrap_or_default()
    }

    /// The digest of the bytes: the same digest, the same resource.
    pub fn digest(&self) -> u64 {
        xxhash_rust::xxh64::xxh64(&self.bytes, 0)
    }
}

impl Kept for ClusterLoadAssignment {
    type Facts = ();
    fn name(&self) -> &str {
        &self.cluster_name
    }
    fn facts(&self) {}
}

impl Kept for RouteConfiguration {
    type Facts = ();
    fn name(&self) -> &str {
        &self.name
    }
    fn facts(&self) {}
}

impl Kept for Secret {
    type Facts = ();
    fn name(&self) -> &str {
        &self.name
    }
    fn facts(&self) {}
}

/// What the xDS manager reads of a cluster: which endpoints it waits for, and which
/// secrets.
#[derive(Debug)]
pub struct ClusterFacts {
    /// An EDS cluster's service and how long it waits for its endpoints.
    pub eds: Option<Eds>,
    /// The secrets its transport sockets name; shared by every cluster naming the same
    /// (Istio gives each cluster the same two).
    pub secrets: Arc<Vec<SecretRef>>,
    /// Whether it has a transport socket (or matches).
    pub has_tls: bool,
}

#[derive(Debug)]
pub struct Eds {
    /// Its `eds_cluster_config.service_name`; `None` when that is the cluster's name.
    service_name: Option<Box<str>>,
    /// Its `eds_config`'s `initial_fetch_timeout`, Envoy's 15 s when unset (Istio sets
    /// 0: for ever).
    pub fetch_timeout: Duration,
}

impl Kept for EnvoyCluster {
    type Facts = ClusterFacts;
    fn name(&self) -> &str {
        &self.name
    }
    fn facts(&self) -> ClusterFacts {
        let secrets = references::cluster_secrets(self);
        ClusterFacts {
            eds: eds_facts(self),
            secrets: shared_secrets(secrets),
            has_tls: self.transport_socket.is_some() || !self.transport_socket_matches.is_empty(),
        }
    }
}

impl Encoded<EnvoyCluster> {
    /// The EDS service an EDS cluster's endpoints come under: `service_name`, else its
    /// name.
    pub fn eds_service_name(&self) -> Option<&str> {
        let eds = self.facts.eds.as_ref()?;
        Some(eds.service_name.as_deref().unwrap_or(&self.name))
    }
}

fn eds_facts(cluster: &EnvoyCluster) -> Option<Eds> {
    let is_eds = matches!(
        cluster.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(t)) if t == DiscoveryType::Eds as i32
    );
    if !is_eds {
        return None;
    }
    let eds = cluster.eds_cluster_config.as_ref();
    let service = eds.map_or("", |eds| eds.service_name.as_str());
    let fetch_timeout = eds
        .and_then(|c| c.eds_config.as_ref())
        .and_then(crate::source::fetch_timeout)
        .unwrap_or(crate::source::DEFAULT_INITIAL_FETCH_TIMEOUT);
    Some(Eds {
        service_name: (!service.is_empty() && service != cluster.name).then(|| service.into()),
        fetch_timeout,
    })
}

/// `secrets`, shared process-wide with every equal list.
fn shared_secrets(secrets: Vec<SecretRef>) -> Arc<Vec<SecretRef>> {
    use shunt_config::references::SecretSource;
    let mut digest = Vec::new();
    for secret in &secrets {
        digest.extend_from_slice(secret.name.as_bytes());
        match &secret.source {
            SecretSource::Static => digest.push(0),
            SecretSource::Ads => digest.push(1),
            SecretSource::Api(source) => {
                digest.push(2);
                source.encode(&mut digest).expect("a Vec grows");
            }
        }
    }
    shunt_core::interned::intern(xxhash_rust::xxh64::xxh64(&digest, 0), &secrets)
}
