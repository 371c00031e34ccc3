//! xDS resources kept as they came on the wire: what the xDS manager and the snapshots
//! hold of each accepted listener, cluster, route configuration, secret and EDS
//! assignment between compiles. Decoded, an Istio cluster or virtual host takes several
//! times its wire size, and only the compile of a changed resource and `/config_dump`
//! read it whole; the few facts the manager needs every time (the name; a cluster's EDS
//! service, secrets and fetch timeout; a listener's routes and secrets) are taken out
//! once, when the resource is accepted.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as EnvoyCluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::core::v3::ConfigSource;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener as EnvoyListener;
use envoy_types::pb::envoy::config::listener::v3::listener::ListenerSpecifier;
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
    /// Shared: the manager's and the served maps' keys are this very name.
    pub name: Arc<str>,
    pub facts: T::Facts,
    pub bytes: Box<[u8]>,
    /// xxh64 of `bytes`, taken once: compiles and warming checks key on it per pod.
    digest: u64,
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
        Self::from_vec(bytes.to_vec(), xxhash_rust::xxh64::xxh64(bytes, 0))
    }

    /// [`Encoded::new`] keeping `bytes` themselves, whose xxh64 the caller (the xDS
    /// manager, at accept) already took: the one copy of a resource out of its
    /// response's buffer, at its exact length, is kept as it is.
    pub fn from_vec(bytes: Vec<u8>, digest: u64) -> Result<Self, prost::DecodeError> {
        debug_assert_eq!(digest, xxhash_rust::xxh64::xxh64(&bytes, 0));
        let bytes = bytes.into_boxed_slice();
        let decoded = T::decode(&*bytes)?;
        Ok(Encoded {
            name: decoded.name().into(),
            facts: decoded.facts(),
            bytes,
            digest,
            message: PhantomData,
        })
    }

    /// `message` encoded (tests and resources made in place).
    pub fn of(message: &T) -> Self {
        let bytes: Box<[u8]> = message.encode_to_vec().into();
        Encoded {
            name: message.name().into(),
            facts: message.facts(),
            digest: xxhash_rust::xxh64::xxh64(&bytes, 0),
            bytes,
            message: PhantomData,
        }
    }

    pub fn decode(&self) -> T {
        // They decoded when accepted.
        T::decode(&*self.bytes).unwrap_or_default()
    }

    /// The digest of the bytes: the same digest, the same resource.
    pub fn digest(&self) -> u64 {
        self.digest
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

/// What the xDS manager and the snapshot compiler read of a listener without decoding
/// it: what it waits for, and whether it is internal.
#[derive(Debug)]
pub struct ListenerFacts {
    /// The RDS route configurations its HTTP connection managers name.
    pub rds_names: Vec<String>,
    /// The secrets its filter chains terminate TLS with (shared, as a cluster's).
    pub secrets: Arc<Vec<SecretRef>>,
    /// Whether it is an internal listener (which needs a bootstrap extension).
    pub internal: bool,
}

impl Kept for EnvoyListener {
    type Facts = ListenerFacts;
    fn name(&self) -> &str {
        &self.name
    }
    fn facts(&self) -> ListenerFacts {
        ListenerFacts {
            rds_names: references::rds_names(self),
            secrets: shared_secrets(references::listener_secrets(self)),
            internal: matches!(
                self.listener_specifier,
                Some(ListenerSpecifier::InternalListener(_))
            ),
        }
    }
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
    service_name: Option<Arc<str>>,
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
        self.eds_service().map(|s| &**s)
    }

    /// [`Self::eds_service_name`], shared: what maps by service are keyed with.
    pub fn eds_service(&self) -> Option<&Arc<str>> {
        let eds = self.facts.eds.as_ref()?;
        Some(eds.service_name.as_ref().unwrap_or(&self.name))
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
        .and_then(fetch_timeout)
        .unwrap_or(DEFAULT_INITIAL_FETCH_TIMEOUT);
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

/// Envoy's default `initial_fetch_timeout`.
pub(crate) const DEFAULT_INITIAL_FETCH_TIMEOUT: Duration = Duration::from_secs(15);

/// A source's `initial_fetch_timeout`, when it sets one.
pub(crate) fn fetch_timeout(source: &ConfigSource) -> Option<Duration> {
    let t = source.initial_fetch_timeout.as_ref()?;
    Some(Duration::new(
        t.seconds.max(0) as u64,
        t.nanos.clamp(0, 999_999_999) as u32,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(json: serde_json::Value) -> Encoded<EnvoyCluster> {
        let cluster: EnvoyCluster = shunt_config::message_from_json(json).unwrap();
        let encoded = Encoded::new(&cluster.encode_to_vec()).unwrap();
        assert_eq!(encoded.decode(), cluster, "decodes to what it was");
        encoded
    }

    #[test]
    fn a_clusters_facts_are_what_the_manager_read_of_it_decoded() {
        let plain = cluster(serde_json::json!({"name": "s", "type": "STATIC"}));
        assert_eq!(&*plain.name, "s");
        assert_eq!(plain.eds_service_name(), None);
        assert!(plain.facts.secrets.is_empty() && !plain.facts.has_tls);

        // Istio's: service_name is the cluster's name, and it waits for ever.
        let istio = cluster(serde_json::json!({
            "name": "outbound|80||a.ns.svc.cluster.local", "type": "EDS",
            "eds_cluster_config": {
                "service_name": "outbound|80||a.ns.svc.cluster.local",
                "eds_config": {"ads": {}, "initial_fetch_timeout": "0s"}},
            "transport_socket": {"name": "tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"tls_certificate_sds_secret_configs": [
                    {"name": "default", "sds_config": {"ads": {}}}]}}}
        }));
        assert_eq!(
            istio.eds_service_name(),
            Some("outbound|80||a.ns.svc.cluster.local")
        );
        let eds = istio.facts.eds.as_ref().unwrap();
        assert!(eds.service_name.is_none(), "the name is not kept twice");
        assert_eq!(eds.fetch_timeout, Duration::ZERO);
        assert!(istio.facts.has_tls);
        let names: Vec<&str> = istio
            .facts
            .secrets
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(names, ["default"]);

        let other = cluster(serde_json::json!({
            "name": "c", "type": "EDS", "eds_cluster_config": {"service_name": "svc"}}));
        assert_eq!(other.eds_service_name(), Some("svc"));
        let timeout = other.facts.eds.as_ref().unwrap().fetch_timeout;
        assert_eq!(timeout, DEFAULT_INITIAL_FETCH_TIMEOUT);
        let unnamed = cluster(serde_json::json!({"name": "d", "type": "EDS"}));
        assert_eq!(unnamed.eds_service_name(), Some("d"));
    }

    #[test]
    fn equal_secret_lists_are_one_copy() {
        let tls = |name: &str| {
            serde_json::json!({"name": name, "transport_socket": {"name": "tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"tls_certificate_sds_secret_configs": [
                    {"name": "shared-secret", "sds_config": {"ads": {}}}]}}}})
        };
        let (a, b) = (cluster(tls("a")), cluster(tls("b")));
        assert!(Arc::ptr_eq(&a.facts.secrets, &b.facts.secrets));
    }

    #[test]
    fn a_listeners_facts_name_its_routes_and_whether_it_is_internal() {
        let listener: EnvoyListener = shunt_config::message_from_json(serde_json::json!({
            "name": "l", "internal_listener": {},
            "filter_chains": [{"filters": [{"name": "hcm", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "l", "rds": {"route_config_name": "80", "config_source": {"ads": {}}}}}]}]
        }))
        .unwrap();
        let encoded = Encoded::<EnvoyListener>::of(&listener);
        assert_eq!(encoded.facts.rds_names, ["80"]);
        assert!(encoded.facts.internal);
        assert_eq!(encoded.decode(), listener);
    }
}
