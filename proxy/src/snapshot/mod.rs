//! The compiled snapshot: one immutable picture of the listeners and clusters a proxy
//! serves, built from Envoy types and checked once ([`compile`]), then read by every
//! connection without further validation.
//!
//! A [`Store`] holds the current snapshot behind one pointer. Swapping it is atomic; each
//! accepted connection takes the `Arc` current when it was accepted and keeps it to its
//! end, so a new snapshot never changes a connection in flight. Clusters carry run-time
//! state (health, DNS answers, counters) inside their `Arc`, so a later snapshot that
//! keeps a cluster can share it.

mod cluster;
pub(crate) mod convert;
mod listener;
pub mod live;
mod problems;
mod tcp_proxy;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;

pub use listener::ListenerStats;
pub(crate) use problems::Problems;
pub use problems::{CompileError, Problem};
pub(crate) use tcp_proxy::access_logs;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as EnvoyCluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener as EnvoyListener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;

use crate::admin::stats::Store as StatsStore;
use crate::admin::{Resources, Tracked, UpdateFailure};
use crate::listener::config::Listener;
use crate::upstream::Cluster;

#[derive(Debug, Default)]
pub struct Snapshot {
    /// In bootstrap order.
    pub listeners: Vec<Arc<Listener>>,
    pub clusters: HashMap<String, Arc<Cluster>>,
    /// Route configurations by name, for HTTP connection managers with `rds`: each
    /// request looks its route configuration up here, in the snapshot current then.
    /// Filled from RDS resources; empty without them.
    pub route_configs: HashMap<String, Arc<crate::http::RouteConfig>>,
    /// Secrets by name (static `secrets`, SDS): TLS contexts that name one look it up
    /// here when a handshake starts, so a new snapshot rotates them for new handshakes.
    pub secrets: HashMap<String, Arc<crate::tls::Secret>>,
    /// The RDS and SDS resources `route_configs` and `secrets` were compiled from: an
    /// update compiles again only those that changed (a new `Arc`).
    route_sources: HashMap<String, Arc<RouteConfiguration>>,
    secret_sources: HashMap<String, Arc<Secret>>,
    /// Listener index by each of its addresses, for `use_original_dst` hand-offs.
    by_address: HashMap<SocketAddr, usize>,
    /// Listener index by name: every accepted connection looks its listener up.
    by_name: HashMap<Arc<str>, usize>,
    /// Each listener's stats, by listener name.
    listener_stats: HashMap<Arc<str>, ListenerStats>,
    /// The bootstrap's static resources as `/config_dump` shows them (listeners served
    /// by the admin API's health ports too), shared by every snapshot.
    static_resources: Arc<Resources>,
    /// The xDS resources this snapshot was compiled from.
    dynamic: Arc<DynamicResources>,
    /// Config digests of the compiled clusters and listeners, by name: what the next
    /// update compares against to keep unchanged ones.
    listener_digests: HashMap<Arc<str>, u64>,
    /// When the bootstrap's static resources were loaded (kept across updates).
    loaded_at: Option<SystemTime>,
}

impl Snapshot {
    pub fn new(listeners: Vec<Arc<Listener>>, clusters: HashMap<String, Arc<Cluster>>) -> Self {
        let mut by_address = HashMap::new();
        let mut by_name = HashMap::new();
        for (index, listener) in listeners.iter().enumerate() {
            for addr in &listener.addresses {
                by_address.entry(*addr).or_insert(index);
            }
            by_name.entry(listener.name.clone()).or_insert(index);
        }
        Snapshot {
            listener_stats: HashMap::new(),
            listeners,
            clusters,
            route_configs: HashMap::new(),
            secrets: HashMap::new(),
            route_sources: HashMap::new(),
            secret_sources: HashMap::new(),
            by_address,
            by_name,
            static_resources: Arc::default(),
            dynamic: Arc::default(),
            listener_digests: HashMap::new(),
            loaded_at: None,
        }
    }

    /// Every resource this snapshot serves, static and dynamic, as `/config_dump` shows
    /// them. Built on demand: an update does not pay for copies only the admin API reads.
    pub fn resources(&self) -> Resources {
        (*self.static_resources).clone().with_dynamic(&self.dynamic)
    }

    /// This snapshot's cluster `name`, if it was compiled from the config with `digest`.
    fn kept_cluster(&self, name: &str, digest: u64) -> Option<Arc<Cluster>> {
        self.clusters
            .get(name)
            .filter(|c| c.config_digest == digest)
            .cloned()
    }

    /// This snapshot's listener `name`, if it was compiled from the config with `digest`.
    fn kept_listener(&self, name: &str, digest: u64) -> Option<Arc<Listener>> {
        (self.listener_digests.get(name) == Some(&digest))
            .then(|| self.listener(name).cloned())
            .flatten()
    }

    pub fn listener(&self, name: &str) -> Option<&Arc<Listener>> {
        self.by_name.get(name).map(|&index| &self.listeners[index])
    }

    /// The stats of `listener` (one of this snapshot's).
    pub fn listener_stats(&self, listener: &Listener) -> Option<&ListenerStats> {
        self.listener_stats.get(&listener.name)
    }

    /// The listener a connection restored to `destination` is handed to: the one with
    /// exactly that address, else the wildcard address of its family on that port
    /// (Envoy's `getBalancedHandlerByAddress`).
    pub fn listener_for_address(&self, destination: SocketAddr) -> Option<&Arc<Listener>> {
        let wildcard: IpAddr = match destination {
            SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        self.by_address
            .get(&destination)
            .or_else(|| {
                self.by_address
                    .get(&SocketAddr::new(wildcard, destination.port()))
            })
            .map(|&index| &self.listeners[index])
    }
}

/// The current snapshot, swapped whole.
#[derive(Debug, Default)]
pub struct Store {
    current: RwLock<Arc<Snapshot>>,
}

impl Store {
    pub fn new(snapshot: Snapshot) -> Self {
        Store {
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
    pub warnings: Vec<Problem>,
    /// Its clusters that were not in the previous snapshot as they are: they start.
    pub fresh_clusters: Vec<Arc<Cluster>>,
}

/// What a proxy serves besides the bootstrap's `static_resources`: the resources accepted
/// over xDS so far ([`crate::xds`]). Empty without a control plane. Resources are shared
/// (`Arc`) with the xDS client's state, so building this for an update copies no config.
#[derive(Debug, Clone, Default)]
pub struct DynamicResources {
    /// Active listeners.
    pub listeners: Vec<Tracked<Arc<EnvoyListener>>>,
    /// Listeners waiting for their routes or secrets (Envoy's listener warming): not
    /// served yet.
    pub warming_listeners: Vec<Tracked<Arc<EnvoyListener>>>,
    /// Active clusters.
    pub clusters: Vec<DynamicCluster>,
    /// Clusters waiting for their endpoints (Envoy's cluster warming): not served yet.
    pub warming_clusters: Vec<Tracked<Arc<EnvoyCluster>>>,
    /// The endpoints EDS delivered, by cluster (`/config_dump?include_eds`).
    pub endpoints: Vec<Tracked<Arc<ClusterLoadAssignment>>>,
    pub route_configs: Vec<Tracked<Arc<RouteConfiguration>>>,
    pub secrets: Vec<Tracked<Arc<Secret>>>,
    /// The last versions accepted over LDS and CDS.
    pub listeners_version: String,
    pub clusters_version: String,
    /// Resources whose last update was refused (NACKed), for `/config_dump`'s error state.
    pub errors: Vec<UpdateFailure>,
}

/// An active CDS cluster.
#[derive(Debug, Clone)]
pub struct DynamicCluster {
    /// As CDS sent it: what `/config_dump` shows.
    pub tracked: Tracked<Arc<EnvoyCluster>>,
    /// What is compiled: an EDS cluster with its endpoints in `load_assignment`.
    pub effective: Arc<EnvoyCluster>,
    /// `effective`'s config digest.
    pub digest: u64,
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

/// A transport socket naming a secret without `sds_config` names a static one: Envoy
/// refuses the config when `static_resources.secrets` lacks it, and so does shunt.
fn unknown_static_secrets(
    statics: &[Secret],
    clusters: &[cluster::Source],
    listeners: &[(String, &EnvoyListener)],
    problems: &mut problems::Problems,
) {
    use crate::xds::references::{self, SecretSource};
    let known: HashSet<&str> = statics.iter().map(|s| s.name.as_str()).collect();
    let clusters = clusters.iter().map(|(index, cluster, _)| {
        let path = match index {
            Some(i) => format!("static_resources.clusters[{i}]"),
            None => format!("Cluster {:?}", cluster.name),
        };
        (path, references::cluster_secrets(cluster))
    });
    let listeners = listeners
        .iter()
        .map(|(path, listener)| (path.clone(), references::listener_secrets(listener)));
    for (path, refs) in clusters.chain(listeners) {
        for secret in refs {
            if secret.source == SecretSource::Static && !known.contains(secret.name.as_str()) {
                problems.error(
                    format!("{path}.transport_socket"),
                    format!(
                        "names secret {:?} without an sds_config, and static_resources.secrets has no such secret",
                        secret.name
                    ),
                );
            }
        }
    }
}

/// Compiles the RDS route configurations (errors at `RouteConfiguration "name"`); one
/// the previous snapshot compiled from the same resource is kept as it is.
#[allow(clippy::type_complexity)]
fn dynamic_route_configs(
    dynamic: &DynamicResources,
    previous: Option<&Snapshot>,
    problems: &mut problems::Problems,
) -> (
    HashMap<String, Arc<crate::http::RouteConfig>>,
    HashMap<String, Arc<RouteConfiguration>>,
) {
    let mut compiled = HashMap::new();
    let mut sources = HashMap::new();
    for tracked in &dynamic.route_configs {
        let source = &tracked.resource;
        let name = &source.name;
        let kept = previous
            .filter(|p| {
                p.route_sources
                    .get(name)
                    .is_some_and(|s| Arc::ptr_eq(s, source))
            })
            .and_then(|p| p.route_configs.get(name).cloned());
        let route_config = match kept {
            Some(kept) => kept,
            None => {
                let path = format!("RouteConfiguration {name:?}");
                match crate::http::route_config::compile(source, &path, problems) {
                    Some(fresh) => Arc::new(fresh),
                    None => continue,
                }
            }
        };
        compiled.insert(name.clone(), route_config);
        sources.insert(name.clone(), source.clone());
    }
    (compiled, sources)
}

/// Compiles the SDS secrets (errors at `Secret "name"`) into `secrets`, next to the
/// static ones; one the previous snapshot compiled from the same resource is kept.
/// Returns what each was compiled from.
fn dynamic_secrets(
    dynamic: &DynamicResources,
    previous: Option<&Snapshot>,
    secrets: &mut HashMap<String, Arc<crate::tls::Secret>>,
    problems: &mut problems::Problems,
) -> HashMap<String, Arc<Secret>> {
    let mut sources = HashMap::new();
    for tracked in &dynamic.secrets {
        let source = &tracked.resource;
        let name = &source.name;
        let path = format!("Secret {name:?}");
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
            None => match crate::tls::secret::compile(source, &path, problems) {
                Some(fresh) => Arc::new(fresh),
                None => continue,
            },
        };
        secrets.insert(name.clone(), secret);
        sources.insert(name.clone(), source.clone());
    }
    sources
}

/// A config digest, to tell an unchanged resource from a changed one cheaply.
pub fn digest<M: prost::Message>(message: &M) -> u64 {
    xxhash_rust::xxh64::xxh64(&message.encode_to_vec(), 0)
}

/// Compiles a bootstrap's `static_resources`, with the stats of its listeners, clusters
/// and filters created in `stats`; every error names its JSON path.
///
/// The listeners the admin API serves as Istio's health ports
/// ([`crate::admin::health_ports::find`]) are left to it: they are HTTP listeners shunt
/// answers itself until it has an HTTP router.
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
    let mut problems = problems::Problems::default();
    if let Some(dynamic) = &bootstrap.dynamic_resources
        && (!dynamic.lds_resources_locator.is_empty() || !dynamic.cds_resources_locator.is_empty())
    {
        problems.error(
            "dynamic_resources",
            "xDS-TP resource locators are not implemented; use lds_config / cds_config",
        );
    }
    let resources = bootstrap.static_resources.clone().unwrap_or_default();
    let health: HashSet<String> = crate::admin::health_ports::find(bootstrap)
        .into_iter()
        .map(|listener| listener.name)
        .collect();
    // The xDS client reaches its server through these itself (`crate::xds::source`); the
    // data plane compiles them too (TLS included), so a listener may route to them.
    let xds_clusters = xds_clusters(bootstrap);
    let cluster_sources: Vec<cluster::Source> = resources
        .clusters
        .iter()
        .enumerate()
        .map(|(i, c)| (Some(i), c, digest(c)))
        .chain(
            dynamic
                .clusters
                .iter()
                .map(|c| (None, &*c.effective, c.digest)),
        )
        .collect();
    let listener_sources: Vec<(String, &EnvoyListener)> = resources
        .listeners
        .iter()
        .enumerate()
        .map(|(i, l)| (format!("static_resources.listeners[{i}]"), l))
        .chain(
            dynamic
                .listeners
                .iter()
                .map(|t| (format!("Listener {:?}", t.resource.name), &*t.resource)),
        )
        .collect();
    let mut secrets = crate::tls::secret::compile_static(&resources.secrets, &mut problems);
    let secret_sources = dynamic_secrets(&dynamic, previous, &mut secrets, &mut problems);
    let (route_configs, route_sources) = dynamic_route_configs(&dynamic, previous, &mut problems);
    unknown_static_secrets(
        &resources.secrets,
        &cluster_sources,
        &listener_sources,
        &mut problems,
    );
    let clusters = cluster::compile_all(&cluster_sources, previous, stats, &mut problems);
    let (listeners, listener_stats, listener_digests) = listener::compile_all(
        &listener_sources,
        &health,
        &clusters.clusters,
        previous,
        stats,
        &mut problems,
    );
    // Only pipe endpoints need to know which listeners route where.
    let routed = if clusters.pipe_endpoints.is_empty() {
        HashMap::new()
    } else {
        listener::routed_clusters(&listener_sources, &health)
    };
    for (name, paths) in &clusters.pipe_endpoints {
        // The xDS client reaches its server through these itself.
        if xds_clusters.contains(name.as_str()) {
            continue;
        }
        for path in paths {
            match routed.get(name) {
                Some(listener) => problems.error(
                    path,
                    format!(
                        "Unix domain socket endpoints are not implemented yet, and listener \
                         {listener:?} routes to cluster {name:?}"
                    ),
                ),
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
    problems.finish()?;
    let mut snapshot = Snapshot::new(listeners, clusters.clusters);
    snapshot.secrets = secrets;
    snapshot.secret_sources = secret_sources;
    snapshot.route_configs = route_configs;
    snapshot.route_sources = route_sources;
    snapshot.listener_digests = snapshot
        .listeners
        .iter()
        .map(|l| l.name.clone())
        .zip(listener_digests)
        .collect();
    snapshot.listener_stats = snapshot
        .listeners
        .iter()
        .map(|l| l.name.clone())
        .zip(listener_stats)
        .collect();
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

#[cfg(test)]
mod tests;
