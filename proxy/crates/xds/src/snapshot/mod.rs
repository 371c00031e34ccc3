//! The compiled snapshot: one immutable picture of the listeners and clusters a proxy
//! serves, built from Envoy types and checked once ([`compile`]), then read by every
//! connection without further validation.
//!
//! A [`Current`] holds the current snapshot behind one pointer. Swapping it is atomic; each
//! accepted connection takes the `Arc` current when it was accepted and keeps it to its
//! end, so a new snapshot never changes a connection in flight. Clusters carry run-time
//! state (health, DNS answers, counters) inside their `Arc`, so a later snapshot that
//! keeps a cluster can share it.

mod encoded;
pub mod extensions;

pub use encoded::{ClusterFacts, Eds, Encoded, Kept, ListenerFacts};
pub(crate) use encoded::{DEFAULT_INITIAL_FETCH_TIMEOUT, fetch_timeout};

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;

pub use shunt_config::CompileError;
use shunt_config::{Diagnostic, Diagnostics, JsonPath};
pub use shunt_listener::compile::ListenerStats;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as EnvoyCluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener as EnvoyListener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;

use shunt_config::{Resources, Tracked, UpdateFailure};
use shunt_core::stats::Store as StatsStore;
use shunt_filters::http::{ConfigProvider, RequestConfig, RouteConfig};
use shunt_listener::compile as listener;
use shunt_listener::{ConnectionConfig, Listener, ListenerProvider};
use shunt_tls::Secrets;
use shunt_upstream::compile as cluster;
use shunt_upstream::{Cluster, Clusters};

#[derive(Debug, Default)]
pub struct Snapshot {
    /// In bootstrap order.
    pub listeners: Vec<Arc<Listener>>,
    /// Shared with the previous snapshot when an update changes no cluster (one of
    /// listeners or routes).
    pub clusters: Arc<Clusters>,
    /// Route configurations by name, for HTTP connection managers with `rds`: each
    /// request looks its route configuration up here, in the snapshot current then.
    /// Filled from RDS resources; empty without them.
    pub route_configs: HashMap<String, Arc<shunt_filters::http::RouteConfig>>,
    /// Secrets by name (static `secrets`, SDS): TLS contexts that name one look it up
    /// here when a handshake starts, so a new snapshot rotates them for new handshakes.
    pub secrets: HashMap<String, Arc<shunt_tls::Secret>>,
    /// The RDS and SDS resources `route_configs` and `secrets` were compiled from: an
    /// update compiles again only those that changed (a new `Arc`).
    route_sources: HashMap<String, Arc<Encoded<RouteConfiguration>>>,
    secret_sources: HashMap<String, Arc<Encoded<Secret>>>,
    /// How listeners are looked up, with their stats and config digests: shared with the
    /// previous snapshot when an update changes no listener.
    index: Arc<ListenerIndex>,
    /// The bootstrap's static resources as `/config_dump` shows them (listeners served
    /// by the admin API's health ports too), shared by every snapshot.
    static_resources: Arc<Resources>,
    /// The xDS resources this snapshot was compiled from.
    dynamic: Arc<DynamicResources>,
    /// Whether `dynamic.clusters` are in strict name order: the next update can patch
    /// this snapshot's clusters ([`cluster_changes`]).
    dynamic_clusters_in_order: bool,
    /// When the bootstrap's static resources were loaded (kept across updates); `None`
    /// if this snapshot was not compiled from the bootstrap.
    loaded_at: Option<SystemTime>,
    /// The proxy instance's node, with its workload index (handed to the next snapshot).
    pub node: Arc<shunt_core::peer::LocalNode>,
    /// The checks of the clusters warming: held while they warm, so that the other
    /// pods of a node process checking the same clusters, and their compile once the
    /// endpoints come, find them.
    warming: Vec<Arc<cluster::Checked>>,
}

/// A snapshot's lookups of its listeners (each an index into `listeners`), and what an
/// update needs to keep them.
#[derive(Debug, Default)]
struct ListenerIndex {
    /// Listener index by each of its addresses, for `use_original_dst` hand-offs.
    by_address: HashMap<SocketAddr, usize>,
    /// Listener index by name: every accepted connection looks its listener up.
    by_name: HashMap<Arc<str>, usize>,
    /// Each listener's stats, by listener name.
    stats: HashMap<Arc<str>, ListenerStats>,
    /// Config digests of the compiled listeners, by name: what the next update compares
    /// against to keep unchanged ones.
    digests: HashMap<Arc<str>, u64>,
}

impl ListenerIndex {
    fn new(listeners: &[Arc<Listener>]) -> Self {
        let mut index = ListenerIndex::default();
        for (i, listener) in listeners.iter().enumerate() {
            for addr in &listener.addresses {
                index.by_address.entry(*addr).or_insert(i);
            }
            index.by_name.entry(listener.name.clone()).or_insert(i);
        }
        index
    }
}

impl Snapshot {
    /// Every resource this snapshot serves, static and dynamic, as `/config_dump` shows
    /// them. Built on demand: an update does not pay for copies only the admin API reads.
    pub fn resources(&self) -> Resources {
        self.dynamic.added_to((*self.static_resources).clone())
    }

    /// Whether this snapshot was compiled from the bootstrap ([`compile_with`]): it has
    /// the static resources, and an update can start from it.
    fn compiled_from_bootstrap(&self) -> bool {
        self.loaded_at.is_some()
    }

    /// This snapshot's listener `name` with its stats, if it was compiled from the config
    /// with `digest`.
    fn kept_listener(&self, name: &str, digest: u64) -> Option<(Arc<Listener>, ListenerStats)> {
        if self.index.digests.get(name) != Some(&digest) {
            return None;
        }
        let listener = self.listener(name)?;
        let stats = self.index.stats.get(name)?;
        Some((listener.clone(), stats.clone()))
    }

    /// Whether this snapshot serves the very listeners of `other` (an update that
    /// changed none of them): same `Arc`s, addresses and stats.
    pub fn shares_listeners_with(&self, other: &Snapshot) -> bool {
        Arc::ptr_eq(&self.index, &other.index)
    }

    pub fn listener(&self, name: &str) -> Option<&Arc<Listener>> {
        self.index
            .by_name
            .get(name)
            .map(|&index| &self.listeners[index])
    }

    /// The stats of `listener` (one of this snapshot's).
    pub fn listener_stats(&self, listener: &Listener) -> Option<&ListenerStats> {
        self.index.stats.get(&listener.name)
    }

    /// The listener a connection restored to `destination` is handed to: the one with
    /// exactly that address, else the wildcard address of its family on that port
    /// (Envoy's `getBalancedHandlerByAddress`).
    pub fn listener_for_address(&self, destination: SocketAddr) -> Option<&Arc<Listener>> {
        let wildcard: IpAddr = match destination {
            SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        let by_address = &self.index.by_address;
        by_address
            .get(&destination)
            .or_else(|| by_address.get(&SocketAddr::new(wildcard, destination.port())))
            .map(|&index| &self.listeners[index])
    }
}

/// What the data plane reads of a snapshot, through the traits of the layers below.
impl RequestConfig for Snapshot {
    fn route_config(&self, name: &str) -> Option<&Arc<RouteConfig>> {
        self.route_configs.get(name)
    }

    fn clusters(&self) -> &Clusters {
        &self.clusters
    }

    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

impl ConnectionConfig for Snapshot {
    fn listener(&self, name: &str) -> Option<&Arc<Listener>> {
        Snapshot::listener(self, name)
    }

    fn listener_for_address(&self, destination: SocketAddr) -> Option<&Arc<Listener>> {
        Snapshot::listener_for_address(self, destination)
    }

    fn listener_stats(&self, listener: &Listener) -> Option<&ListenerStats> {
        Snapshot::listener_stats(self, listener)
    }
}

/// The current snapshot, swapped whole.
#[derive(Debug, Default)]
pub struct Current {
    current: RwLock<Arc<Snapshot>>,
}

impl ConfigProvider for Current {
    fn request_config(&self) -> Arc<dyn RequestConfig> {
        self.load()
    }
}

impl ListenerProvider for Current {
    fn connection_config(&self) -> Arc<dyn ConnectionConfig> {
        self.load()
    }
}

impl Current {
    pub fn new(snapshot: Snapshot) -> Self {
        Current {
            current: RwLock::new(Arc::new(snapshot)),
        }
    }

    /// The snapshot to serve a new connection with.
    pub fn load(&self) -> Arc<Snapshot> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Installs `snapshot` for new connections; returns the one it replaced.
    #[cfg_attr(not(test), allow(dead_code, reason = "xDS and file reloads will swap"))]
    pub fn swap(&self, snapshot: Arc<Snapshot>) -> Arc<Snapshot> {
        std::mem::replace(
            &mut *self.current.write().unwrap_or_else(|e| e.into_inner()),
            snapshot,
        )
    }
}

/// A compiled snapshot and what compiling it warned about.
#[derive(Debug)]
pub struct Compiled {
    pub snapshot: Snapshot,
    pub warnings: Vec<Diagnostic>,
    /// Its clusters that were not in the previous snapshot as they are: they start.
    pub fresh_clusters: Vec<Arc<Cluster>>,
}

/// What a proxy serves besides the bootstrap's `static_resources`: the resources accepted
/// over xDS so far ([`crate`]). Empty without a control plane. Resources are shared
/// (`Arc`) with the xDS client's state, so building this for an update copies no config;
/// they are kept as their wire bytes ([`Encoded`]), decoded when they compile and for
/// `/config_dump`.
#[derive(Debug, Clone, Default)]
pub struct DynamicResources {
    /// Active listeners.
    pub listeners: Vec<Tracked<Arc<Encoded<EnvoyListener>>>>,
    /// Listeners waiting for their routes or secrets (Envoy's listener warming): not
    /// served yet.
    pub warming_listeners: Vec<Tracked<Arc<Encoded<EnvoyListener>>>>,
    /// Active clusters, by name. Each is shared, so that an update of one cluster's
    /// endpoints copies pointers, not configs.
    pub clusters: Vec<Arc<DynamicCluster>>,
    /// Clusters waiting for their endpoints (Envoy's cluster warming): not served yet.
    pub warming_clusters: Vec<Tracked<Arc<Encoded<EnvoyCluster>>>>,
    /// The endpoints EDS delivered, by cluster (`/config_dump?include_eds`): shared by
    /// the updates that do not change them.
    pub endpoints: Arc<[Tracked<Arc<Encoded<ClusterLoadAssignment>>>]>,
    pub route_configs: Vec<Tracked<Arc<Encoded<RouteConfiguration>>>>,
    pub secrets: Vec<Tracked<Arc<Encoded<Secret>>>>,
    /// The last versions accepted over LDS and CDS.
    pub listeners_version: String,
    pub clusters_version: String,
    /// Resources whose last update was refused (NACKed), for `/config_dump`'s error state.
    pub errors: Vec<UpdateFailure>,
    /// Compile the warming clusters and listeners too, only for their errors: Envoy
    /// refuses a bad one when it comes, not once it is warm.
    pub validate_warming: bool,
}

impl DynamicResources {
    /// `statics` (the bootstrap's resources) with these, accepted over xDS, added after them.
    pub fn added_to(&self, mut statics: Resources) -> Resources {
        let dynamic = self;
        fn decoded<T: Kept>(tracked: &Tracked<std::sync::Arc<Encoded<T>>>) -> Tracked<T> {
            Tracked {
                resource: tracked.resource.decode(),
                version_info: tracked.version_info.clone(),
                last_updated: tracked.last_updated,
            }
        }
        statics
            .listeners
            .extend(dynamic.listeners.iter().map(decoded));
        // The configs as CDS sent them: EDS endpoints are shown as endpoints.
        statics
            .clusters
            .extend(dynamic.clusters.iter().map(|c| decoded(&c.tracked)));
        statics
            .route_configs
            .extend(dynamic.route_configs.iter().map(decoded));
        statics.secrets.extend(dynamic.secrets.iter().map(decoded));
        statics
            .endpoints
            .extend(dynamic.endpoints.iter().map(decoded));
        statics.warming_clusters = dynamic.warming_clusters.iter().map(decoded).collect();
        statics.warming_listeners = dynamic.warming_listeners.iter().map(decoded).collect();
        statics.errors = dynamic.errors.clone();
        statics.listeners_version = dynamic.listeners_version.clone();
        statics.clusters_version = dynamic.clusters_version.clone();
        statics
    }
}

/// An active CDS cluster.
#[derive(Debug, Clone)]
pub struct DynamicCluster {
    /// As CDS sent it: what `/config_dump` shows.
    pub tracked: Tracked<Arc<Encoded<EnvoyCluster>>>,
    /// An EDS cluster's endpoints (the accepted EDS resource, shared, not copied into
    /// the cluster): compiled in place of its `load_assignment`.
    pub endpoints: Option<Arc<Encoded<ClusterLoadAssignment>>>,
    /// The digest of the cluster's config with its endpoints.
    pub digest: u64,
}

impl DynamicCluster {
    pub fn name(&self) -> &str {
        &self.tracked.resource.name
    }

    /// The cluster to compile: decoded, or in node mode, when another pod of the process
    /// compiled the same cluster with the same endpoints, only its name, with that
    /// compile (held until this one is done, so that the compile finds it and decodes
    /// nothing).
    pub fn for_compile(&self) -> (EnvoyCluster, Option<Arc<cluster::Prototype>>) {
        match cluster::find_shared(self.name(), self.digest) {
            Some(held) => {
                let named = EnvoyCluster {
                    name: self.name().to_owned(),
                    ..Default::default()
                };
                (named, Some(held))
            }
            None => (self.tracked.resource.decode(), None),
        }
    }

    /// What is compiled: the cluster (this one's config, `decoded`) with its endpoints.
    pub fn source<'a>(&'a self, decoded: &'a EnvoyCluster) -> cluster::Source<'a> {
        cluster::Source {
            index: None,
            cluster: decoded,
            endpoints: self.endpoints.as_ref().map(|e| &*e.bytes),
            digest: self.digest,
            config_digest: self.tracked.resource.digest(),
        }
    }
}

/// The static clusters the bootstrap's xDS sources reach their servers through.
fn xds_clusters(bootstrap: &Bootstrap) -> HashSet<&str> {
    use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
    use envoy_types::pb::envoy::config::core::v3::grpc_service::TargetSpecifier;
    let Some(dynamic) = &bootstrap.dynamic_resources else {
        return HashSet::new();
    };
    let per_type = [&dynamic.lds_config, &dynamic.cds_config]
        .into_iter()
        .flatten()
        .filter_map(|source| match &source.config_source_specifier {
            Some(ConfigSourceSpecifier::ApiConfigSource(api)) => Some(api),
            _ => None,
        });
    dynamic
        .ads_config
        .iter()
        .chain(per_type)
        .flat_map(|api| &api.grpc_services)
        .filter_map(|service| match &service.target_specifier {
            Some(TargetSpecifier::EnvoyGrpc(grpc)) => Some(grpc.cluster_name.as_str()),
            _ => None,
        })
        .collect()
}

/// Whether `next` has the very dynamic listeners of `previous` (the xDS manager shares
/// each accepted resource between its updates), in the same order.
fn same_listeners(previous: &DynamicResources, next: &DynamicResources) -> bool {
    previous.listeners.len() == next.listeners.len()
        && previous
            .listeners
            .iter()
            .zip(&next.listeners)
            .all(|(old, new)| Arc::ptr_eq(&old.resource, &new.resource))
}

/// Whether `clusters` are in strict name order (sorted, no name twice).
fn in_name_order(clusters: &[Arc<DynamicCluster>]) -> bool {
    clusters.windows(2).all(|w| w[0].name() < w[1].name())
}

/// What `next` changes in the dynamic clusters of `previous` (in name order): the
/// clusters added or whose config (endpoints included) changed, and the removed ones.
/// Both lists are walked in step; a cluster `next` shares with `previous` (the same
/// `Arc`: the xDS manager keeps what an update does not touch) is passed over without
/// comparing names, so an update of one cluster of thousands hashes, copies and
/// compiles nothing else.
///
/// `None` when patching would not do what compiling all clusters does: `next` is not in
/// name order (checked around the clusters it does not share: shared ones keep the
/// order of `previous`), or a changed cluster has no name or the name of a static one
/// (errors only a full compile reports).
fn cluster_changes<'a>(
    previous: &'a [Arc<DynamicCluster>],
    next: &'a [Arc<DynamicCluster>],
    static_clusters: &[EnvoyCluster],
) -> Option<Vec<ClusterChange<'a>>> {
    let name = |c: &'a DynamicCluster| c.name();
    let upserted = |c: &'a Arc<DynamicCluster>| ClusterChange::Upserted(c);
    let mut changes = Vec::new();
    // The places in `next` of the clusters it does not share with `previous`.
    let mut unshared = Vec::new();
    let (mut i, mut j) = (0, 0);
    loop {
        match (previous.get(i), next.get(j)) {
            (None, None) => break,
            (Some(o), Some(n)) if Arc::ptr_eq(o, n) => {
                i += 1;
                j += 1;
            }
            (Some(o), Some(n)) if name(o) == name(n) => {
                if o.digest != n.digest {
                    changes.push(upserted(n));
                }
                unshared.push(j);
                i += 1;
                j += 1;
            }
            (Some(o), n) if n.is_none_or(|n| name(o) < name(n)) => {
                changes.push(ClusterChange::Removed(name(o)));
                i += 1;
            }
            (_, Some(n)) => {
                changes.push(upserted(n));
                unshared.push(j);
                j += 1;
            }
            (Some(_), None) => unreachable!("a removal, above"),
        }
    }
    let in_order = unshared.iter().all(|&j| {
        (j == 0 || name(&next[j - 1]) < name(&next[j]))
            && next
                .get(j + 1)
                .is_none_or(|after| name(&next[j]) < name(after))
    });
    let needs_full_checks = changes.iter().any(|change| match change {
        ClusterChange::Upserted(c) => {
            c.name().is_empty() || static_clusters.iter().any(|s| s.name == c.name())
        }
        ClusterChange::Removed(_) => false,
    });
    (in_order && !needs_full_checks).then_some(changes)
}

/// What an update does to one dynamic cluster (see [`cluster_changes`]).
#[derive(Debug)]
enum ClusterChange<'a> {
    /// Added, or its config (endpoints included) changed: the new version.
    Upserted(&'a DynamicCluster),
    Removed(&'a str),
}

/// A transport socket naming a secret without `sds_config` names a static one: Envoy
/// refuses the config when `static_resources.secrets` lacks it, and so does shunt.
/// Dynamic clusters the previous snapshot compiled as they are, and listeners when
/// `listeners_changed` is false, were checked already.
/// The bootstrap extension that enables internal listeners.
pub const INTERNAL_LISTENER_EXTENSION: &str =
    "envoy.extensions.bootstrap.internal_listener.v3.InternalListener";

/// Envoy refuses an internal listener unless the bootstrap enables the
/// `envoy.bootstrap.internal_listener` extension ("InternalListener bootstrap extension
/// is mandatory").
fn internal_listener_extension(
    bootstrap: &Bootstrap,
    listeners: &[listener::Source<'_>],
    problems: &mut Diagnostics,
) {
    use envoy_types::pb::envoy::config::listener::v3::listener::ListenerSpecifier;
    const EXTENSION: &str = INTERNAL_LISTENER_EXTENSION;
    #[derive(Clone, PartialEq, prost::Message)]
    struct TypedStructHead {
        #[prost(string, tag = "1")]
        type_url: String,
    }
    let enabled = bootstrap.bootstrap_extensions.iter().any(|e| {
        let Some(any) = &e.typed_config else {
            return false;
        };
        let inner;
        let url = if any.type_url.ends_with("TypedStruct") {
            inner = <TypedStructHead as prost::Message>::decode(any.value.as_slice())
                .map(|h| h.type_url)
                .unwrap_or_default();
            inner.as_str()
        } else {
            any.type_url.as_str()
        };
        url.rsplit('/').next() == Some(EXTENSION)
    });
    if enabled {
        return;
    }
    for (index, l) in listeners {
        if !matches!(
            l.listener_specifier,
            Some(ListenerSpecifier::InternalListener(_))
        ) {
            continue;
        }
        let path = JsonPath::resource("listeners", "Listener", *index, &l.name);
        problems.error(
            path.field("internal_listener"),
            "an internal listener needs the bootstrap extension envoy.bootstrap.internal_listener \
             (InternalListener), as in Envoy",
        );
    }
}

/// A static cluster's `envoy_internal_address` endpoint must name an internal listener
/// of the bootstrap when no LDS can bring one: otherwise each of its connections would
/// fail. (Over xDS, clusters arrive before the listeners they name.)
fn unknown_internal_listeners(
    bootstrap: &Bootstrap,
    static_clusters: &[envoy_types::pb::envoy::config::cluster::v3::Cluster],
    listeners: &[Arc<shunt_listener::Listener>],
    problems: &mut Diagnostics,
) {
    use envoy_types::pb::envoy::config::core::v3::address::Address;
    use envoy_types::pb::envoy::config::core::v3::envoy_internal_address::AddressNameSpecifier;
    use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
    if bootstrap
        .dynamic_resources
        .as_ref()
        .is_some_and(|d| d.lds_config.is_some())
    {
        return;
    }
    let mut named = Vec::new();
    for (i, cluster) in static_clusters.iter().enumerate() {
        let Some(assignment) = &cluster.load_assignment else {
            continue;
        };
        for (l, locality) in assignment.endpoints.iter().enumerate() {
            for (e, endpoint) in locality.lb_endpoints.iter().enumerate() {
                let Some(HostIdentifier::Endpoint(endpoint)) = &endpoint.host_identifier else {
                    continue;
                };
                let Some(Address::EnvoyInternalAddress(internal)) =
                    endpoint.address.as_ref().and_then(|a| a.address.as_ref())
                else {
                    continue;
                };
                let Some(AddressNameSpecifier::ServerListenerName(name)) =
                    &internal.address_name_specifier
                else {
                    continue;
                };
                let address = shunt_upstream::internal::InternalAddress {
                    server_listener_name: name.as_str().into(),
                    endpoint_id: internal.endpoint_id.clone(),
                };
                let path = JsonPath::resource("clusters", "Cluster", Some(i), &cluster.name)
                    .field("load_assignment")
                    .field("endpoints")
                    .index(l)
                    .field("lb_endpoints")
                    .index(e)
                    .field("endpoint")
                    .field("address")
                    .field("envoy_internal_address")
                    .field("server_listener_name");
                named.push((address, String::from(path)));
            }
        }
    }
    let unknown = shunt_upstream::internal::unknown_listeners(
        named.iter().map(|(a, p)| (a, p.clone())),
        |name| listeners.iter().any(|l| l.internal && *l.name == *name),
    );
    for (name, path) in unknown {
        problems.error(
            path,
            format!("no internal listener named {name:?} (a listener with internal_listener {{}})"),
        );
    }
}

fn unknown_static_secrets(
    statics: &[Secret],
    static_clusters: &[EnvoyCluster],
    dynamic: &DynamicResources,
    previous: Option<&Snapshot>,
    listeners: &[listener::Source],
    listeners_changed: bool,
    problems: &mut Diagnostics,
) {
    use shunt_config::references::{self, SecretSource};
    let known: HashSet<&str> = statics.iter().map(|s| s.name.as_str()).collect();
    let has_tls =
        |c: &EnvoyCluster| c.transport_socket.is_some() || !c.transport_socket_matches.is_empty();
    let checked = |c: &DynamicCluster| {
        previous
            .and_then(|p| p.clusters.digest_of(c.name()))
            .is_some_and(|kept| kept == c.digest)
    };
    // The path is written only for a problem: a pod's first push checks every cluster.
    let mut check = |refs: &[references::SecretRef], path: &dyn Fn() -> JsonPath| {
        for secret in refs {
            if secret.source == SecretSource::Static && !known.contains(secret.name.as_str()) {
                problems.error(
                    path().field("transport_socket"),
                    format!(
                        "names secret {:?} without an sds_config, and static_resources.secrets has no such secret",
                        secret.name
                    ),
                );
            }
        }
    };
    for (index, cluster) in static_clusters.iter().enumerate() {
        if has_tls(cluster) {
            let path = || JsonPath::resource("clusters", "Cluster", Some(index), &cluster.name);
            check(&references::cluster_secrets(cluster), &path);
        }
    }
    // Dynamic clusters name their secrets in their facts (shared): none is decoded.
    for cluster in &dynamic.clusters {
        if cluster.tracked.resource.facts.has_tls && !checked(cluster) {
            let path = || JsonPath::resource("clusters", "Cluster", None, cluster.name());
            check(&cluster.tracked.resource.facts.secrets, &path);
        }
    }
    for (index, listener) in listeners.iter().filter(|_| listeners_changed) {
        let path = || JsonPath::resource("listeners", "Listener", *index, &listener.name);
        check(&references::listener_secrets(listener), &path);
    }
}

/// Compiles the RDS route configurations (errors at `RouteConfiguration "name"`); one
/// the previous snapshot compiled from the same resource is kept as it is.
#[allow(clippy::type_complexity)]
fn dynamic_route_configs(
    dynamic: &DynamicResources,
    previous: Option<&Snapshot>,
    problems: &mut Diagnostics,
) -> (
    HashMap<String, Arc<shunt_filters::http::RouteConfig>>,
    HashMap<String, Arc<Encoded<RouteConfiguration>>>,
) {
    let mut compiled = HashMap::new();
    let mut sources = HashMap::new();
    for tracked in &dynamic.route_configs {
        let source = &tracked.resource;
        let name: &str = &source.name;
        let kept = previous
            .filter(|p| {
                p.route_sources
                    .get(name)
                    .is_some_and(|s| Arc::ptr_eq(s, source))
            })
            .and_then(|p| p.route_configs.get(name).cloned());
        let route_config = match kept {
            Some(kept) => kept,
            None => match shared_route_config(source, problems) {
                Some(fresh) => fresh,
                None => continue,
            },
        };
        compiled.insert(name.to_owned(), route_config);
        sources.insert(name.to_owned(), source.clone());
    }
    (compiled, sources)
}

/// How many compiled route configurations are shared in this process now: a debug
/// counter (one per distinct version, whatever the number of pods holding it).
pub fn shared_route_configs() -> usize {
    shunt_core::interned::live::<RouteConfig>()
}

/// `source` compiled (errors at `RouteConfiguration "name"`), or the copy another pod
/// of this process compiled from the same bytes (see `shunt_core::interned`): in node
/// mode every pod whose push has the same version holds one, and its warnings were
/// reported by the pod that compiled it (only that pod decodes it). One that keeps
/// run-time state (per-route token buckets) is each pod's own, compiled once for it.
fn shared_route_config(
    source: &Encoded<RouteConfiguration>,
    problems: &mut Diagnostics,
) -> Option<Arc<RouteConfig>> {
    let path = JsonPath::resource("", "RouteConfiguration", None, &source.name);
    let compile = |problems: &mut Diagnostics| {
        let errors_before = problems.errors.len();
        shunt_filters::http::route_config::compile(&source.decode(), &path, problems)
            .filter(|_| problems.errors.len() == errors_before)
    };
    let mut own = Diagnostics::default();
    let shared = shunt_core::interned::made_once(source.digest(), || compile(&mut own).ok_or(()));
    problems.errors.extend(own.errors);
    problems.warnings.extend(own.warnings);
    let shared = shared.ok()?;
    // Token buckets are one pod's: a copy another pod holds is that pod's, and this
    // one compiles its own; a copy no other pod holds (this call made it) is this one's.
    if shared.holds_state() && Arc::strong_count(&shared) > 1 {
        return compile(&mut Diagnostics::default()).map(Arc::new);
    }
    Some(shared)
}

/// Compiles the SDS secrets (errors at `Secret "name"`) into `secrets`, next to the
/// static ones; one the previous snapshot compiled from the same resource is kept.
/// Returns what each was compiled from.
fn dynamic_secrets(
    dynamic: &DynamicResources,
    previous: Option<&Snapshot>,
    secrets: &mut HashMap<String, Arc<shunt_tls::Secret>>,
    problems: &mut Diagnostics,
) -> HashMap<String, Arc<Encoded<Secret>>> {
    let mut sources = HashMap::new();
    for tracked in &dynamic.secrets {
        let source = &tracked.resource;
        let name: &str = &source.name;
        let path = JsonPath::resource("", "Secret", None, name);
        if secrets.contains_key(name) {
            problems.warning(
                &path,
                "a static secret has this name; transport sockets get the static one",
            );
            continue;
        }
        let kept = previous
            .filter(|p| {
                p.secret_sources
                    .get(name)
                    .is_some_and(|s| Arc::ptr_eq(s, source))
            })
            .and_then(|p| p.secrets.get(name).cloned());
        let secret = match kept {
            Some(kept) => kept,
            None => match shunt_tls::secret::compile(&source.decode(), &path, problems) {
                Some(fresh) => Arc::new(fresh),
                None => continue,
            },
        };
        secrets.insert(name.to_owned(), secret);
        sources.insert(name.to_owned(), source.clone());
    }
    sources
}

/// Compiles a bootstrap's `static_resources`, with the stats of its listeners, clusters
/// and filters created in `stats`; every error names its JSON path.
///
/// The listeners the admin API serves as Istio's health ports
/// ([`shunt_config::health_ports::find`]) are left to it: they are HTTP listeners shunt
/// answers itself (see [`shunt_config::health_ports`]).
pub fn compile(bootstrap: &Bootstrap, stats: &StatsStore) -> Result<Compiled, CompileError> {
    compile_with(bootstrap, Arc::default(), None, stats)
}

/// Compiles the bootstrap's static resources together with `dynamic` ones (from xDS,
/// whose errors are at `Cluster "name"` / `Listener "name"` paths). Clusters and listeners
/// unchanged since `previous` are kept as they are.
pub fn compile_with(
    bootstrap: &Bootstrap,
    dynamic: Arc<DynamicResources>,
    previous: Option<&Snapshot>,
    stats: &StatsStore,
) -> Result<Compiled, CompileError> {
    let mut problems = Diagnostics::default();
    if let Some(dynamic) = &bootstrap.dynamic_resources
        && (!dynamic.lds_resources_locator.is_empty() || !dynamic.cds_resources_locator.is_empty())
    {
        problems.error(
            "dynamic_resources",
            "xDS-TP resource locators are not implemented; use lds_config / cds_config",
        );
    }
    // Borrowed: every pod's compile of every update reads its bootstrap's resources.
    let no_resources =
        envoy_types::pb::envoy::config::bootstrap::v3::bootstrap::StaticResources::default();
    let resources = bootstrap.static_resources.as_ref().unwrap_or(&no_resources);
    let node = local_node(bootstrap, previous);
    let health: HashSet<String> = shunt_config::health_ports::find(bootstrap)
        .into_iter()
        .map(|listener| listener.name)
        .collect();
    let static_clusters = &resources.clusters;
    let pod_clusters = cluster::PodClusters {
        stats: Arc::new(stats.clone()),
        creation: creation(bootstrap),
    };
    let (mut clusters, kept_clusters, dynamic_clusters_in_order) = compile_clusters(
        static_clusters,
        &dynamic,
        previous,
        &pod_clusters,
        &mut problems,
    );
    let all_clusters =
        kept_clusters.unwrap_or_else(|| Arc::new(std::mem::take(&mut clusters.clusters)));
    // Listeners compile from their own configs only (a missing cluster is a warning
    // their compiling gave already), so the same configs give the same listeners.
    let unchanged_listeners =
        previous.filter(|p| p.compiled_from_bootstrap() && same_listeners(&p.dynamic, &dynamic));
    // The dynamic listeners are decoded only when something below reads them: they
    // compile, or a check across resources needs them (pipe endpoints, an internal one).
    let read_listeners = unchanged_listeners.is_none()
        || !clusters.pipe_endpoints.is_empty()
        || dynamic.listeners.iter().any(|l| l.resource.facts.internal);
    let decoded_listeners: Vec<EnvoyListener> = match read_listeners {
        true => dynamic
            .listeners
            .iter()
            .map(|t| t.resource.decode())
            .collect(),
        false => Vec::new(),
    };
    let listener_sources: Vec<listener::Source> = resources
        .listeners
        .iter()
        .enumerate()
        .map(|(i, l)| (Some(i), l))
        .chain(decoded_listeners.iter().map(|l| (None, l)))
        .collect();
    let (listeners, index) = match unchanged_listeners {
        Some(previous) => (previous.listeners.clone(), previous.index.clone()),
        None => compile_listeners(
            &listener_sources,
            &health,
            &all_clusters,
            previous,
            stats,
            &node,
            &mut problems,
        ),
    };
    let mut secrets = shunt_tls::secret::compile_static(&resources.secrets, &mut problems);
    let secret_sources = dynamic_secrets(&dynamic, previous, &mut secrets, &mut problems);
    let (route_configs, route_sources) = dynamic_route_configs(&dynamic, previous, &mut problems);
    unknown_static_secrets(
        &resources.secrets,
        static_clusters,
        &dynamic,
        previous,
        &listener_sources,
        unchanged_listeners.is_none(),
        &mut problems,
    );
    unknown_internal_listeners(bootstrap, static_clusters, &listeners, &mut problems);
    internal_listener_extension(bootstrap, &listener_sources, &mut problems);
    pipe_endpoints(
        bootstrap,
        &clusters.pipe_endpoints,
        &listener_sources,
        &health,
        &mut problems,
    );
    let warming = if dynamic.validate_warming {
        validate_warming(&dynamic, &health, &all_clusters, stats, &mut problems)
    } else if dynamic.warming_clusters.is_empty() {
        Vec::new()
    } else {
        previous.map(|p| p.warming.clone()).unwrap_or_default()
    };
    problems.finish()?;
    let mut snapshot = Snapshot {
        listeners,
        clusters: all_clusters,
        route_configs,
        secrets,
        route_sources,
        secret_sources,
        index,
        dynamic_clusters_in_order,
        warming,
        node: node.clone(),
        ..Default::default()
    };
    snapshot.static_resources = match previous {
        Some(previous) if previous.loaded_at.is_some() => {
            snapshot.loaded_at = previous.loaded_at;
            previous.static_resources.clone()
        }
        _ => {
            snapshot.loaded_at = Some(SystemTime::now());
            Arc::new(Resources::from_bootstrap(bootstrap, SystemTime::now()))
        }
    };
    snapshot.dynamic = dynamic;
    Ok(Compiled {
        snapshot,
        warnings: problems.warnings,
        fresh_clusters: clusters.fresh,
    })
}

/// The bootstrap's node, with the workload index of the instance (which outlives its
/// snapshots: its xDS manager fills it).
fn local_node(
    bootstrap: &Bootstrap,
    previous: Option<&Snapshot>,
) -> Arc<shunt_core::peer::LocalNode> {
    let mut node = bootstrap
        .node
        .as_ref()
        .map(shunt_core::peer::LocalNode::from_node)
        .unwrap_or_default();
    if let Some(previous) = previous {
        node.workloads = previous.node.workloads.clone();
    }
    Arc::new(node)
}

/// The static and dynamic clusters, and whether the dynamic ones are in name order. An
/// update patches the previous snapshot's clusters where it can (see
/// `cluster_changes`): unchanged clusters cost nothing.
fn compile_clusters(
    static_clusters: &[EnvoyCluster],
    dynamic: &DynamicResources,
    previous: Option<&Snapshot>,
    pod: &cluster::PodClusters,
    problems: &mut Diagnostics,
) -> (cluster::CompiledClusters, Option<Arc<Clusters>>, bool) {
    let patch = previous
        .filter(|p| p.compiled_from_bootstrap() && p.dynamic_clusters_in_order)
        .and_then(|p| {
            let changes = cluster_changes(&p.dynamic.clusters, &dynamic.clusters, static_clusters)?;
            Some((p, changes))
        });
    let dynamic_clusters_in_order = patch.is_some() || in_name_order(&dynamic.clusters);
    let clusters = match patch {
        // Not one changed (an update of listeners or routes): the very map.
        Some((previous, changes)) if changes.is_empty() => {
            let kept = Some(previous.clusters.clone());
            return (Default::default(), kept, dynamic_clusters_in_order);
        }
        Some((previous, changes)) => patch_clusters(&previous.clusters, &changes, pod, problems),
        None => {
            let (decoded, _held): (Vec<EnvoyCluster>, Vec<_>) =
                dynamic.clusters.iter().map(|c| c.for_compile()).unzip();
            let sources: Vec<cluster::Source> = static_clusters
                .iter()
                .enumerate()
                .map(|(i, c)| cluster::Source::new(Some(i), c, shunt_config::digest(c)))
                .chain(
                    dynamic
                        .clusters
                        .iter()
                        .zip(&decoded)
                        .map(|(c, d)| c.source(d)),
                )
                .collect();
            let previous = previous.map(|p| &*p.clusters);
            cluster::compile_all(&sources, previous, pod, problems)
        }
    };
    (clusters, None, dynamic_clusters_in_order)
}

/// When the clusters are made: on first use if the bootstrap asks for it
/// (`cluster_manager.enable_deferred_cluster_creation`, which Istio's bootstrap sets
/// when it has a `cluster_manager`, and node mode's pod bootstraps always).
fn creation(bootstrap: &Bootstrap) -> cluster::Creation {
    let deferred = bootstrap
        .cluster_manager
        .as_ref()
        .is_some_and(|cm| cm.enable_deferred_cluster_creation);
    if deferred {
        cluster::Creation::Deferred
    } else {
        cluster::Creation::Eager
    }
}

/// How many changed clusters are decoded at a time: each is decoded only for its
/// compile, and a push of every cluster (a pod's first) reuses the few decoded ones'
/// memory rather than leaving the heap holed by all of them.
const DECODED_AT_ONCE: usize = 32;

/// `previous` with `changes` applied (see [`cluster::patch`]), the changed clusters
/// decoded [`DECODED_AT_ONCE`] at a time: each batch is a patch of the clusters the
/// previous one made, which keeps and compiles what one patch of all would.
fn patch_clusters(
    previous: &Clusters,
    changes: &[ClusterChange<'_>],
    pod: &cluster::PodClusters,
    problems: &mut Diagnostics,
) -> cluster::CompiledClusters {
    let removed: Vec<cluster::ClusterChange> = changes
        .iter()
        .filter_map(|change| match change {
            ClusterChange::Removed(name) => Some(cluster::ClusterChange::Removed(name)),
            ClusterChange::Upserted(_) => None,
        })
        .collect();
    let upserted: Vec<&DynamicCluster> = changes
        .iter()
        .filter_map(|change| match change {
            ClusterChange::Upserted(c) => Some(*c),
            ClusterChange::Removed(_) => None,
        })
        .collect();
    let mut compiled = cluster::patch(previous, &removed, pod, problems);
    for batch in upserted.chunks(DECODED_AT_ONCE) {
        let (decoded, _held): (Vec<EnvoyCluster>, Vec<_>) =
            batch.iter().map(|c| c.for_compile()).unzip();
        let changes: Vec<cluster::ClusterChange> = batch
            .iter()
            .zip(&decoded)
            .map(|(c, d)| cluster::ClusterChange::Upserted(c.source(d)))
            .collect();
        cluster::patch_in_place(&mut compiled, &changes, pod, problems);
    }
    compiled
}

/// The listeners, and their index (with each one's stats and config digest); one the
/// previous snapshot compiled from the same config is kept.
fn compile_listeners(
    sources: &[listener::Source],
    health: &HashSet<String>,
    clusters: &Clusters,
    previous: Option<&Snapshot>,
    stats: &StatsStore,
    node: &Arc<shunt_core::peer::LocalNode>,
    problems: &mut Diagnostics,
) -> (Vec<Arc<Listener>>, Arc<ListenerIndex>) {
    let (listeners, stats, digests) = listener::compile_all(
        sources,
        health,
        clusters,
        &|name, digest| previous.and_then(|p| p.kept_listener(name, digest)),
        stats,
        node,
        problems,
    );
    let mut index = ListenerIndex::new(&listeners);
    let names = || listeners.iter().map(|l| l.name.clone());
    index.stats = names().zip(stats).collect();
    index.digests = names().zip(digests).collect();
    (listeners, Arc::new(index))
}

/// Unix domain socket endpoints, which shunt does not implement: an error for a cluster
/// a listener routes to, a warning for another (it is kept without them). The xDS
/// client's own clusters reach their server themselves.
fn pipe_endpoints(
    bootstrap: &Bootstrap,
    pipe_endpoints: &[(String, Vec<String>)],
    listener_sources: &[listener::Source],
    health: &HashSet<String>,
    problems: &mut Diagnostics,
) {
    // Only pipe endpoints need to know which listeners route where.
    if pipe_endpoints.is_empty() {
        return;
    }
    let xds_clusters = xds_clusters(bootstrap);
    let routed = listener::routed_clusters(listener_sources, health);
    for (name, paths) in pipe_endpoints {
        if xds_clusters.contains(name.as_str()) {
            continue;
        }
        for path in paths {
            match routed.get(name) {
                Some(listener) => {
                    problems.error(
                        path,
                        format!(
                            "Unix domain socket endpoints are not implemented yet, and listener \
                             {listener:?} routes to cluster {name:?}"
                        ),
                    );
                }
                None => problems.warning(
                    path,
                    format!(
                        "Unix domain socket endpoints are not implemented yet; no listener \
                         routes to cluster {name:?}, which is kept without this endpoint"
                    ),
                ),
            }
        }
    }
}

/// Compiles the warming clusters and listeners of `dynamic` aside, keeping only their
/// errors (at their `Cluster "name"` / `Listener "name"` paths). Returns the clusters'
/// checks, which the snapshot holds while they warm (see [`Snapshot::warming`]).
fn validate_warming(
    dynamic: &DynamicResources,
    health: &HashSet<String>,
    clusters: &Clusters,
    stats: &StatsStore,
    problems: &mut Diagnostics,
) -> Vec<Arc<cluster::Checked>> {
    let mut aside = Diagnostics::default();
    // A few decoded at a time (see `patch_clusters`); the checks are kept.
    let mut checked = Vec::with_capacity(dynamic.warming_clusters.len());
    // Checked by another pod (node mode): neither decoded nor checked again. A check
    // is shared only if it passed, and only its errors matter here.
    let mut unchecked = Vec::new();
    for warming in &dynamic.warming_clusters {
        let digest = warming.resource.digest();
        match cluster::find_checked(&warming.resource.name, digest) {
            Some(found) => checked.push(found),
            None => unchecked.push((warming, digest)),
        }
    }
    for batch in unchecked.chunks(DECODED_AT_ONCE) {
        let decoded: Vec<EnvoyCluster> = batch.iter().map(|(t, _)| t.resource.decode()).collect();
        // By the digest `upstream::compile` finds a warming cluster's check by.
        let sources: Vec<cluster::Source> = decoded
            .iter()
            .zip(batch)
            .map(|(d, (_, digest))| cluster::Source::new(None, d, *digest))
            .collect();
        checked.extend(cluster::validate_all(&sources, &mut aside));
    }
    let decoded: Vec<EnvoyListener> = dynamic
        .warming_listeners
        .iter()
        .map(|t| t.resource.decode())
        .collect();
    let sources: Vec<listener::Source> = decoded.iter().map(|l| (None, l)).collect();
    let node = Arc::default();
    listener::compile_all(
        &sources,
        health,
        clusters,
        &|_, _| None,
        stats,
        &node,
        &mut aside,
    );
    problems.errors.extend(aside.errors);
    checked
}

#[cfg(test)]
mod internal_tests;
#[cfg(test)]
mod tests;
