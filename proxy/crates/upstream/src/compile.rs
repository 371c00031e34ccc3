//! Compiling `static_resources.clusters` into [`Cluster`]s: discovery type, endpoints,
//! `lb_policy` and its config, `connect_timeout`, `upstream_bind_config`, circuit
//! breakers, outlier detection and active health checks. What shunt cannot honour is an
//! error when it changes where traffic goes, a warning when it only changes how well.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster as EnvoyCluster, OutlierDetection as EnvoyOutlier,
    cluster::{
        ClusterDiscoveryType, DiscoveryType, DnsLookupFamily, LbConfig, LbPolicy as EnvoyLbPolicy,
    },
};
use envoy_types::pb::envoy::config::core::v3::address::Address;
use envoy_types::pb::envoy::config::core::v3::{
    HealthCheck as EnvoyHealthCheck, HealthStatus, RoutingPriority,
    health_check::{HealthChecker, Payload, payload},
};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use prost::Message as _;

use super::cluster::UpstreamProtocol;
use super::cluster::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_DNS_REFRESH_RATE};
use super::clusters::Entry;
use super::dns_cluster::{DnsTarget, LookupFamily};
use super::health_check::{Checker, HealthCheck};
use super::host::{FAILED_EDS_HEALTH, Host};
use super::load_balancer::{
    DEFAULT_MAGLEV_TABLE_SIZE, DEFAULT_MAX_RING_SIZE, DEFAULT_MIN_RING_SIZE, LbPolicy,
};
use super::outlier::OutlierDetection;
use super::stats::ClusterStats;
use super::{Cluster, ClusterConfig, Clusters, Discovery};
use shunt_config::convert::{self, duration_or};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::Store;

/// The discovery types (`Cluster.type`, by enum name) compiled here: every one of
/// Envoy's. Config validation's list of them.
pub const CLUSTER_TYPES: &[&str] = &["STATIC", "STRICT_DNS", "LOGICAL_DNS", "EDS", "ORIGINAL_DST"];

/// Custom cluster types (`Cluster.cluster_type`) compiled here: none yet.
pub const CUSTOM_CLUSTER_TYPES: &[&str] = &[];

/// The compiled clusters, and the endpoints left out of them for being Unix domain
/// sockets: each cluster's name with its endpoints' paths, in bootstrap order. Whether
/// leaving them out matters depends on whether a served listener routes to the cluster
/// (see `snapshot::compile`).
#[derive(Default)]
pub struct CompiledClusters {
    pub clusters: Clusters,
    /// The clusters compiled afresh (not kept from the previous snapshot): they start.
    pub fresh: Vec<Arc<Cluster>>,
    pub pipe_endpoints: Vec<(String, Vec<String>)>,
}

/// A cluster to compile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Source<'a> {
    /// Its index in `static_resources.clusters` (`None`: from CDS).
    pub index: Option<usize>,
    pub cluster: &'a EnvoyCluster,
    /// An EDS cluster's endpoints as EDS sent them (a `ClusterLoadAssignment`'s wire
    /// bytes), in place of its `load_assignment`: decoded while the cluster compiles,
    /// kept only as bytes (a tenth of the decoded size) and never copied into a clone
    /// of the cluster.
    pub endpoints: Option<&'a [u8]>,
    /// The digest of the config and endpoints: the same digest, the same cluster.
    pub digest: u64,
    /// The digest of the config alone (an EDS cluster's, as CDS sent it): what its
    /// check while it warmed is found by (see [`find_checked`]).
    pub config_digest: u64,
}

impl<'a> Source<'a> {
    /// A cluster compiled as written (its own `load_assignment`).
    pub fn new(index: Option<usize>, cluster: &'a EnvoyCluster, digest: u64) -> Self {
        Source {
            index,
            cluster,
            endpoints: None,
            digest,
            config_digest: digest,
        }
    }
}

/// What an update does to one dynamic cluster (see [`patch`]).
#[derive(Debug, PartialEq)]
pub enum ClusterChange<'a> {
    /// Added, or its config (endpoints included) changed: the new version.
    Upserted(Source<'a>),
    Removed(&'a str),
}

/// A cluster's JSON path in messages, written only when needed: an update keeps most
/// clusters as they are and names none of them.
fn path_of(index: Option<usize>, cluster: &EnvoyCluster) -> JsonPath {
    JsonPath::resource("clusters", "Cluster", index, &cluster.name)
}

/// When a pod's clusters are made (Envoy's `cluster_manager.enable_deferred_cluster_creation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Creation {
    /// Each one as it compiles.
    Eager,
    /// Each one when first looked up, if making it starts nothing (no DNS, no health
    /// checks, not ORIGINAL_DST): until then it is its shared compile only.
    Deferred,
}

/// What of a compile is the pod's own: where its clusters keep their stats (one `Arc`
/// for all of them, which each cluster not made yet holds) and when they are made.
#[derive(Clone)]
pub struct PodClusters {
    pub stats: Arc<Store>,
    pub creation: Creation,
}

/// Compiles `clusters`, each with its JSON path (`static_resources.clusters[3]`, or an
/// xDS resource's `Cluster "name"`), made as `pod.creation` says. A cluster whose Envoy
/// config (endpoints included) is the same as in `previous` keeps its compiled `Arc`,
/// so its health, DNS answers and connection counts carry over an update.
pub fn compile_all(
    clusters: &[Source<'_>],
    previous: Option<&Clusters>,
    pod: &PodClusters,
    problems: &mut Diagnostics,
) -> CompiledClusters {
    let mut compiled = CompiledClusters::default();
    for source in clusters {
        compiled.add(*source, previous, pod, problems);
    }
    compiled
}

/// Compiles an update as a patch of `previous` (compiled from the same bootstrap): its
/// clusters with `changes` applied, the others keeping their `Arc`. The result is what
/// [`compile_all`] makes of the whole updated set, at the cost of the changed clusters
/// only; the caller checks that no change needs a check across clusters (a missing
/// name, the name of a static cluster: see `snapshot::cluster_changes`).
pub fn patch(
    previous: &Clusters,
    changes: &[ClusterChange<'_>],
    pod: &PodClusters,
    problems: &mut Diagnostics,
) -> CompiledClusters {
    // Clones only pointers: the names and clusters are shared.
    let mut compiled = CompiledClusters {
        clusters: previous.clone(),
        ..Default::default()
    };
    patch_in_place(&mut compiled, changes, pod, problems);
    compiled
}

/// [`patch`] applied to `compiled` itself: an update's changes taken a batch at a time
/// cost the batch, not a copy of the map per batch.
pub fn patch_in_place(
    compiled: &mut CompiledClusters,
    changes: &[ClusterChange<'_>],
    pod: &PodClusters,
    problems: &mut Diagnostics,
) {
    // Every changed name goes first, so that a replaced cluster is not a second one;
    // what it was is kept aside, to be kept if its config is the same.
    let mut replaced = Clusters::default();
    for change in changes {
        let name = match change {
            ClusterChange::Upserted(source) => source.cluster.name.as_str(),
            ClusterChange::Removed(name) => name,
        };
        if let Some((name, entry)) = compiled.clusters.take_entry(name) {
            replaced.insert_entry(name, entry);
        }
    }
    for change in changes {
        if let ClusterChange::Upserted(source) = change {
            compiled.add(*source, Some(&replaced), pod, problems);
        }
    }
}

impl CompiledClusters {
    /// Adds one cluster: kept from `previous` if its config is the same there, else
    /// compiled (and `fresh` if made now).
    fn add(
        &mut self,
        source: Source<'_>,
        previous: Option<&Clusters>,
        pod: &PodClusters,
        problems: &mut Diagnostics,
    ) {
        let Source {
            index,
            cluster,
            digest,
            ..
        } = source;
        if cluster.name.is_empty() {
            let path = path_of(index, cluster);
            problems.error(path.field("name"), "a cluster needs a name");
            return;
        }
        if self.clusters.contains_key(cluster.name.as_str()) {
            let path = path_of(index, cluster);
            problems.error(
                path.field("name"),
                format!("a second cluster named {:?}", cluster.name),
            );
            return;
        }
        // Where this map's deferred clusters, kept or new, are made.
        self.clusters.set_stats(&pod.stats);
        // An unchanged cluster keeps its entry and the name it is under.
        let kept = previous
            .and_then(|p| p.entry(&cluster.name))
            .filter(|(_, kept)| kept.digest() == digest);
        if let Some((name, kept)) = kept {
            self.clusters.insert_entry(name.clone(), kept.clone());
            return;
        }
        let mut pipes = Vec::new();
        // The path is written only if this process has not compiled the cluster yet.
        let compile = || prototype(source, &path_of(index, cluster));
        let Some(prototype) = shared_prototype(source, &mut pipes, problems, compile) else {
            return;
        };
        if !pipes.is_empty() {
            self.pipe_endpoints.push((cluster.name.clone(), pipes));
        }
        // Every pod's map holds the prototype's name, not a copy of its own.
        let name = prototype.name.clone();
        if pod.creation == Creation::Deferred && prototype.deferrable() {
            self.clusters.insert_entry(name, Entry::deferred(prototype));
        } else {
            let made = prototype.instantiate(&pod.stats);
            self.fresh.push(made.clone());
            self.clusters.insert(name, made);
        }
    }
}

struct Endpoint {
    host: String,
    port: u16,
    weight: u32,
    priority: u32,
    unhealthy: bool,
    /// `metadata.filter_metadata["envoy.transport_socket_match"]`.
    socket_match: Option<Arc<shunt_tls::transport_socket::MatchMetadata>>,
    /// `envoy_internal_address` (then `host` is empty and `port` 0).
    internal: Option<super::internal::InternalAddress>,
    metadata: Option<Arc<shunt_core::interned::EncodedMetadata>>,
}

/// Compiles one cluster for a pod whose stats are in `stats`; the paths of endpoints
/// left out for being Unix domain sockets go to `pipes`. What does not depend on the
/// pod ([`Prototype`]) is compiled once per process for each version of the cluster
/// and shared; the pod gets its own stats, hosts and run-time state.
pub fn compile(
    source: Source<'_>,
    path: &JsonPath,
    stats: &Store,
    pipes: &mut Vec<String>,
    problems: &mut Diagnostics,
) -> Option<Arc<Cluster>> {
    let compile = || prototype(source, path);
    let prototype = shared_prototype(source, pipes, problems, compile)?;
    Some(prototype.instantiate(stats))
}

/// What of one cluster no pod owns, compiled by `compile` once per process (see
/// [`shared`]); the paths of endpoints left out for being Unix domain sockets go to
/// `pipes`.
fn shared_prototype(
    source: Source<'_>,
    pipes: &mut Vec<String>,
    problems: &mut Diagnostics,
    compile: impl FnOnce() -> Result<Prototype, Diagnostics>,
) -> Option<Arc<Prototype>> {
    let prototype = shared(source, problems, compile)?;
    pipes.extend(prototype.pipes.iter().cloned());
    Some(prototype)
}

/// Checks that one cluster compiles, its errors and warnings in `problems`, without
/// making a pod's cluster of it (a warming cluster, before its endpoints come). In
/// node mode the check is shared: the caller holds it while the cluster warms, so that
/// other pods checking the same cluster find it, and so does the compile of the
/// cluster with its endpoints, which keeps it (see `Prototype::_checked`).
pub fn validate(
    source: Source<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<Checked>> {
    shared(source, problems, || {
        prototype(source, path).map(|made| Checked {
            warnings: made.warnings,
        })
    })
}

/// A cluster checked while it warmed ([`validate`]): only what the check reported.
#[derive(Debug)]
pub struct Checked {
    warnings: Vec<shunt_config::Diagnostic>,
}

/// What `make` makes of `source`, shared by every pod of this process with the same
/// source (see `shunt_core::interned::made_once`), its warnings (or errors) in
/// `problems`.
fn shared<T>(
    source: Source<'_>,
    problems: &mut Diagnostics,
    make: impl FnOnce() -> Result<T, Diagnostics>,
) -> Option<Arc<T>>
where
    T: Reported + Send + Sync + 'static,
{
    let made = if source.digest == 0 {
        // No digest of its config (unit tests): nothing to share it by.
        make().map(Arc::new)
    } else {
        let key = key(source.index, &source.cluster.name, source.digest);
        shunt_core::interned::made_once(key, make)
    };
    match made {
        Ok(made) => {
            problems.warnings.extend(made.warnings().iter().cloned());
            Some(made)
        }
        Err(failed) => {
            problems.errors.extend(failed.errors);
            problems.warnings.extend(failed.warnings);
            None
        }
    }
}

/// What a shared compile reported, given to each pod's diagnostics.
trait Reported {
    fn warnings(&self) -> &[shunt_config::Diagnostic];
}

impl Reported for Prototype {
    fn warnings(&self) -> &[shunt_config::Diagnostic] {
        &self.warnings
    }
}

impl Reported for Checked {
    fn warnings(&self) -> &[shunt_config::Diagnostic] {
        &self.warnings
    }
}

/// [`validate`]s each cluster of `sources` (at its path, as [`compile_all`] puts it);
/// the checks, to hold while the clusters warm.
pub fn validate_all(sources: &[Source<'_>], problems: &mut Diagnostics) -> Vec<Arc<Checked>> {
    sources
        .iter()
        .filter_map(|source| validate(*source, &path_of(source.index, source.cluster), problems))
        .collect()
}

/// The key a cluster's compile is shared by: the digest of what it is compiled from,
/// its name, and its place in a bootstrap if static (diagnostics name it:
/// `clusters[3]`). Nothing is written out: every pod looks up each of its clusters.
fn key(index: Option<usize>, name: &str, digest: u64) -> u64 {
    let place = index.map_or(0, |i| (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    xxhash_rust::xxh64::xxh64(name.as_bytes(), digest ^ place)
}

/// What compiling a cluster makes that is the same in every pod that has it: its config
/// (without stats) and its hosts as compiled, with what the compile reported (warnings,
/// Unix domain socket endpoints left out). In node mode every pod with the same version
/// of a cluster holds one; each pod's [`Cluster`] is made from it
/// ([`Prototype::instantiate`]) with its own stats, hosts and run-time state.
#[derive(Debug)]
pub struct Prototype {
    config: ClusterConfig,
    /// The cluster's name, the key every pod's map holds it under.
    name: Arc<str>,
    hosts: Vec<Host>,
    /// Shared by every pod's entry that names it (`alt_stat_name`).
    observability_name: Arc<str>,
    pipes: Vec<String>,
    warnings: Vec<shunt_config::Diagnostic>,
    /// An EDS cluster's check while it warmed ([`validate`]: the same cluster without
    /// its endpoints), held so that a pod that gets the cluster later finds it checked
    /// already.
    _checked: Option<Arc<Checked>>,
}

impl Prototype {
    /// A pod's cluster: its stats in the pod's `stats`, hosts of its own.
    pub(crate) fn instantiate(self: &Arc<Self>, stats: &Store) -> Arc<Cluster> {
        let mut config = self.config.clone();
        config.stats = Some(ClusterStats::new(stats, &self.observability_name));
        // Held while the pod's cluster is, so that other pods find it: node mode only.
        config.prototype = shunt_core::interned::sharing_compiled().then(|| self.clone());
        Cluster::new(config, self.hosts.iter().map(Host::fresh).collect())
    }

    /// The digest of the config it was compiled from.
    pub(crate) fn digest(&self) -> u64 {
        self.config.config_digest
    }

    /// The name its stats go under, when not its own.
    pub(crate) fn alt_stat_name(&self) -> Option<&Arc<str>> {
        Some(&self.observability_name).filter(|alt| ***alt != *self.config.name)
    }

    /// Whether a pod's cluster may be made when first used: making it starts nothing
    /// (see `Cluster::start`), so nothing is late for having waited.
    fn deferrable(&self) -> bool {
        matches!(self.config.discovery, Discovery::Static | Discovery::Eds)
            && self.config.health_checks.is_empty()
    }
}

/// How many compiled clusters are shared in this process now (one per distinct cluster
/// version, whatever the number of pods that hold it): a debug counter.
pub fn shared_clusters() -> usize {
    shunt_core::interned::live::<Prototype>()
}

/// The shared compile of the CDS cluster `name` whose config and endpoints have
/// `digest`, if a pod of this process holds one: the caller that holds it may compile
/// the cluster from a [`Source`] with only its name (`snapshot::DynamicCluster::for_compile`), since
/// [`compile`] finds it and reads nothing else.
pub fn find_shared(name: &str, digest: u64) -> Option<Arc<Prototype>> {
    shunt_core::interned::find::<Prototype>(key(None, name, digest))
}

/// The check of the warming CDS cluster `name` whose config (as CDS sent it) has
/// `config_digest`, if a pod of this process holds one: a pod whose cluster warms
/// neither decodes nor checks it again.
pub fn find_checked(name: &str, config_digest: u64) -> Option<Arc<Checked>> {
    shunt_core::interned::find::<Checked>(key(None, name, config_digest))
}

/// Compiles what of one cluster no pod owns (see [`Prototype`]); the diagnostics if it
/// does not compile. The stages follow the `Cluster` message: discovery type, load
/// assignment, lb policy, bind config, circuit breakers, health, transport socket,
/// protocol options.
fn prototype(source: Source<'_>, path: &JsonPath) -> Result<Prototype, Diagnostics> {
    let mut problems = Diagnostics::default();
    let mut pipes = Vec::new();
    let made = compile_config(source, path, &mut pipes, &mut problems);
    let checked = source.endpoints.and_then(|_| {
        let key = key(source.index, &source.cluster.name, source.config_digest);
        shunt_core::interned::find::<Checked>(key)
    });
    match made {
        Some((config, hosts, observability_name)) if problems.errors.is_empty() => Ok(Prototype {
            name: config.name.as_str().into(),
            config,
            hosts,
            observability_name: observability_name.into(),
            pipes,
            warnings: problems.warnings,
            _checked: checked,
        }),
        _ => Err(problems),
    }
}

/// The config and hosts of one cluster, and the name its stats go under.
fn compile_config(
    source: Source<'_>,
    path: &JsonPath,
    pipes: &mut Vec<String>,
    problems: &mut Diagnostics,
) -> Option<(ClusterConfig, Vec<Host>, String)> {
    let cluster = source.cluster;
    // The endpoints compiled: EDS's, else the cluster's `load_assignment`.
    let from_eds = match source
        .endpoints
        .map(ClusterLoadAssignment::decode)
        .transpose()
    {
        Ok(from_eds) => from_eds,
        Err(err) => {
            problems.error(
                path.field("load_assignment"),
                format!("its EDS endpoints do not decode: {err}"),
            );
            return None;
        }
    };
    let assignment = from_eds.as_ref().or(cluster.load_assignment.as_ref());
    let mut config = ClusterConfig::new(cluster.name.clone());
    config.config_digest = source.digest;
    let observability_name = if cluster.alt_stat_name.is_empty() {
        &cluster.name
    } else {
        &cluster.alt_stat_name
    };
    config.http_protocol = http_protocol(cluster, path, problems);
    let kind = discovery_type(cluster, path, problems)?;
    config.connect_timeout = duration_or(
        cluster.connect_timeout.as_ref(),
        DEFAULT_CONNECT_TIMEOUT,
        &path.field("connect_timeout"),
        problems,
    );
    config.lb_policy = lb_policy(cluster, kind, path, problems);
    let endpoints = endpoints(assignment, kind, path, pipes, problems);
    // A CDS cluster's endpoints come over EDS (a warming one's check has none yet).
    let endpoints_missing = source.index.is_some() && assignment.is_none();
    let (discovery, hosts) = discovery(
        cluster,
        endpoints_missing,
        kind,
        &endpoints,
        path,
        &mut config,
        problems,
    )?;
    config.discovery = discovery;
    config.source_address = upstream_bind_config(cluster, path, problems);
    circuit_breakers(cluster, path, &mut config, problems);
    health(cluster, path, &mut config, problems);
    common_lb_config(cluster, assignment, path, &mut config, problems);
    transport_socket(cluster, path, &mut config, problems);
    config.metadata = cluster
        .metadata
        .as_ref()
        .map(shunt_core::interned::metadata);
    config.metadata_exchange = upstream_metadata_exchange(cluster, path, problems);
    config.port_override = original_dst_lb_config(cluster, path, problems);
    config.transport_socket_matches = shunt_tls::transport_socket::matches(
        &cluster.transport_socket_matches,
        &path.field("transport_socket_matches"),
        problems,
    )
    .into();
    if cluster.load_balancing_policy.is_some() {
        problems.error(
            path.field("load_balancing_policy"),
            "load_balancing_policy extensions are not implemented yet; use lb_policy",
        );
    }
    Some((config, hosts, observability_name.clone()))
}

/// `type` (STATIC when unset); `None` for a custom `cluster_type`, not implemented.
fn discovery_type(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<DiscoveryType> {
    match &cluster.cluster_discovery_type {
        None => Some(DiscoveryType::Static),
        Some(ClusterDiscoveryType::Type(t)) => {
            Some(DiscoveryType::try_from(*t).unwrap_or_else(|_| {
                problems.error(path.field("type"), format!("unknown cluster type {t}"));
                DiscoveryType::Static
            }))
        }
        Some(ClusterDiscoveryType::ClusterType(custom)) => {
            problems.error(
                path.field("cluster_type"),
                format!(
                    "custom cluster type {:?} is not implemented yet",
                    custom.name
                ),
            );
            None
        }
    }
}

/// How the cluster finds its hosts, and the hosts known now (STATIC and EDS): the
/// endpoints read as the discovery type wants them. `None` when LOGICAL_DNS has other
/// than one endpoint.
fn discovery(
    cluster: &EnvoyCluster,
    endpoints_missing: bool,
    kind: DiscoveryType,
    endpoints: &[(Endpoint, JsonPath)],
    path: &JsonPath,
    config: &mut ClusterConfig,
    problems: &mut Diagnostics,
) -> Option<(Discovery, Vec<Host>)> {
    let (family, refresh) = dns_resolution(cluster, path, problems);
    let target = |e: &Endpoint| DnsTarget {
        name: e.host.clone(),
        port: e.port,
        weight: e.weight,
        priority: e.priority,
    };
    let discovery = match kind {
        DiscoveryType::Static => {
            return Some((Discovery::Static, hosts(endpoints, kind, problems)));
        }
        DiscoveryType::Eds => {
            let hosts = hosts(endpoints, kind, problems);
            eds_cluster_config(cluster, endpoints_missing, path, problems);
            return Some((Discovery::Eds, hosts));
        }
        DiscoveryType::StrictDns => Discovery::StrictDns {
            targets: endpoints.iter().map(|(e, _)| target(e)).collect(),
            refresh,
            family,
        },
        DiscoveryType::LogicalDns => {
            if endpoints.len() != 1 {
                problems.error(
                    path.field("load_assignment"),
                    format!(
                        "LOGICAL_DNS needs exactly one endpoint, not {}",
                        endpoints.len()
                    ),
                );
                return None;
            }
            Discovery::LogicalDns {
                target: target(&endpoints[0].0),
                refresh,
                family,
            }
        }
        DiscoveryType::OriginalDst => {
            if !endpoints.is_empty() {
                problems.error(
                    path.field("load_assignment"),
                    "an ORIGINAL_DST cluster has no endpoints of its own",
                );
            }
            config.cleanup_interval = duration_or(
                cluster.cleanup_interval.as_ref(),
                super::cluster::DEFAULT_CLEANUP_INTERVAL,
                &path.field("cleanup_interval"),
                problems,
            );
            Discovery::OriginalDst
        }
    };
    Some((discovery, Vec::new()))
}

/// `dns_lookup_family` and `dns_refresh_rate`, read (and checked) for every cluster as
/// Envoy does, used by the DNS clusters.
fn dns_resolution(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> (LookupFamily, Duration) {
    let family = match DnsLookupFamily::try_from(cluster.dns_lookup_family) {
        Ok(DnsLookupFamily::V4Only) => LookupFamily::V4Only,
        Ok(DnsLookupFamily::V6Only) => LookupFamily::V6Only,
        Ok(DnsLookupFamily::V4Preferred) => LookupFamily::V4Preferred,
        Ok(DnsLookupFamily::All) => LookupFamily::All,
        _ => LookupFamily::Auto,
    };
    #[allow(
        deprecated,
        reason = "Envoy still reads dns_refresh_rate, and bootstraps use it"
    )]
    let refresh_rate = cluster.dns_refresh_rate.as_ref();
    let refresh = duration_or(
        refresh_rate,
        DEFAULT_DNS_REFRESH_RATE,
        &path.field("dns_refresh_rate"),
        problems,
    );
    if refresh.is_zero() {
        problems.error(path.field("dns_refresh_rate"), "must be greater than 0s");
    }
    (family, refresh)
}

/// The hosts of a STATIC or EDS cluster's endpoints: internal listeners, or IP
/// addresses (a name is an error: only the DNS clusters resolve them).
fn hosts(
    endpoints: &[(Endpoint, JsonPath)],
    kind: DiscoveryType,
    problems: &mut Diagnostics,
) -> Vec<Host> {
    let mut hosts = Vec::new();
    for (endpoint, endpoint_path) in endpoints {
        if let Some(internal) = &endpoint.internal {
            hosts.push(
                Host::internal(internal.clone())
                    .with_weight(endpoint.weight)
                    .with_priority(endpoint.priority)
                    .with_socket_match(endpoint.socket_match.clone())
                    .with_metadata(endpoint.metadata.clone()),
            );
            continue;
        }
        match endpoint.host.parse::<std::net::IpAddr>() {
            Ok(ip) => hosts.push(
                Host::new(std::net::SocketAddr::new(ip, endpoint.port))
                    .with_weight(endpoint.weight)
                    .with_priority(endpoint.priority)
                    .with_socket_match(endpoint.socket_match.clone())
                    .with_metadata(endpoint.metadata.clone())
                    .with_health_flags(if endpoint.unhealthy {
                        FAILED_EDS_HEALTH
                    } else {
                        0
                    }),
            ),
            Err(_) => {
                problems.error(
                    endpoint_path.field("address"),
                    format!(
                        "{:?} is not an IP address; a {} cluster needs IP endpoints \
                     (use STRICT_DNS or LOGICAL_DNS for names)",
                        endpoint.host,
                        kind.as_str_name()
                    ),
                );
            }
        }
    }
    hosts
}

/// An EDS cluster's `eds_cluster_config`, checked: a static one gets no endpoints over
/// EDS (`endpoints_missing`: static, without a `load_assignment`).
fn eds_cluster_config(
    cluster: &EnvoyCluster,
    endpoints_missing: bool,
    path: &JsonPath,
    problems: &mut Diagnostics,
) {
    // Envoy's proto validation: a config source needs its specifier.
    if let Some(eds) = &cluster.eds_cluster_config
        && eds
            .eds_config
            .as_ref()
            .is_some_and(|source| source.config_source_specifier.is_none())
    {
        problems.error(
            path.field("eds_cluster_config").field("eds_config"),
            "a config source needs ads, api_config_source or path_config_source",
        );
    }
    if endpoints_missing {
        problems.warning(
            path.field("eds_cluster_config"),
            "a static cluster gets no endpoints over EDS (only CDS clusters \
             subscribe to theirs) and this one has no load_assignment: it has \
             no endpoints",
        );
    }
}

/// `upstream_bind_config.source_address`: the address upstream connections bind to.
fn upstream_bind_config(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<std::net::SocketAddr> {
    let bind = cluster.upstream_bind_config.as_ref()?;
    let source = bind.source_address.as_ref()?;
    let bind_path = path.field("upstream_bind_config").field("source_address");
    let address = envoy_types::pb::envoy::config::core::v3::Address {
        address: Some(Address::SocketAddress(source.clone())),
    };
    let mut inner = Diagnostics::default();
    let source_address = convert::ip_socket_addr(Some(&address), &bind_path, &mut inner);
    for p in inner.errors {
        // Paths from the helper name `.socket_address`, which this field has not.
        problems.error(p.path.replace(".socket_address", ""), p.message);
    }
    source_address
}

/// `circuit_breakers`: the DEFAULT priority's `max_connections`.
fn circuit_breakers(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    config: &mut ClusterConfig,
    problems: &mut Diagnostics,
) {
    let Some(breakers) = &cluster.circuit_breakers else {
        return;
    };
    for threshold in &breakers.thresholds {
        // HIGH priority applies to requests routed with that priority; tcp_proxy
        // connections are always DEFAULT, as in Envoy.
        if threshold.priority == RoutingPriority::Default as i32
            && let Some(max) = threshold.max_connections
        {
            config.max_connections = u64::from(max.value);
        }
    }
    if !breakers.per_host_thresholds.is_empty() {
        problems.warning(
            path.field("circuit_breakers").field("per_host_thresholds"),
            "per-host circuit breakers are not implemented yet; ignored",
        );
    }
}

/// `outlier_detection` and `health_checks`.
fn health(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    config: &mut ClusterConfig,
    problems: &mut Diagnostics,
) {
    if let Some(outlier) = &cluster.outlier_detection {
        config.outlier_detection = Some(outlier_detection(
            outlier,
            &path.field("outlier_detection"),
            problems,
        ));
    }
    for (i, check) in cluster.health_checks.iter().enumerate() {
        if let Some(check) = health_check(check, &path.field("health_checks").index(i), problems) {
            config.health_checks.push(check);
        }
    }
}

/// `common_lb_config.healthy_panic_threshold` and the load assignment's
/// `policy.overprovisioning_factor`: how priorities and panic mode weigh hosts.
fn common_lb_config(
    cluster: &EnvoyCluster,
    assignment: Option<&ClusterLoadAssignment>,
    path: &JsonPath,
    config: &mut ClusterConfig,
    problems: &mut Diagnostics,
) {
    if let Some(common) = &cluster.common_lb_config
        && let Some(threshold) = &common.healthy_panic_threshold
    {
        config.panic_threshold = threshold.value.clamp(0.0, 100.0);
    }
    if let Some(factor) = assignment
        .and_then(|a| a.policy.as_ref())
        .and_then(|p| p.overprovisioning_factor)
    {
        if factor.value == 0 {
            problems.error(
                path.field("load_assignment")
                    .field("policy")
                    .field("overprovisioning_factor"),
                "must be greater than 0",
            );
        }
        config.overprovisioning_factor = factor.value.max(1);
    }
}

/// `transport_socket`: TLS to the upstream, or plain text (and whether it is a
/// passthrough of the downstream's).
fn transport_socket(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    config: &mut ClusterConfig,
    problems: &mut Diagnostics,
) {
    if let Some(socket) = &cluster.transport_socket
        && let Ok(tls) =
            shunt_tls::transport_socket::upstream(socket, &path.field("transport_socket"), problems)
    {
        config.transport_socket = tls;
        config.passthrough = shunt_tls::transport_socket::passthrough(socket);
    }
}

/// ORIGINAL_DST's `original_dst_lb_config`: the port override, if any.
fn original_dst_lb_config(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<u16> {
    let Some(LbConfig::OriginalDstLbConfig(original)) = &cluster.lb_config else {
        return None;
    };
    let o_path = path.field("original_dst_lb_config");
    let mut port_override = None;
    if let Some(port) = original.upstream_port_override {
        match u16::try_from(port.value) {
            Ok(port) if port > 0 => port_override = Some(port),
            _ => {
                problems.error(
                    o_path.field("upstream_port_override"),
                    format!("{} is not a TCP port", port.value),
                );
            }
        }
    }
    if original.use_http_header || original.metadata_key.is_some() {
        // Istio sets metadata_key to steer to a waypoint named in the endpoint's
        // metadata; without one the destination stays the original.
        problems.warning(
            &o_path,
            "use_http_header and metadata_key are not implemented; the original destination is used",
        );
    }
    port_override
}

fn lb_policy(
    cluster: &EnvoyCluster,
    kind: DiscoveryType,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> LbPolicy {
    let policy_path = path.field("lb_policy");
    let policy = EnvoyLbPolicy::try_from(cluster.lb_policy).unwrap_or_else(|_| {
        problems.error(
            &policy_path,
            format!("unknown lb_policy {}", cluster.lb_policy),
        );
        EnvoyLbPolicy::RoundRobin
    });
    match policy {
        EnvoyLbPolicy::ClusterProvided if kind == DiscoveryType::OriginalDst => {
            LbPolicy::RoundRobin
        }
        // An ORIGINAL_DST cluster has one possible host per connection: any policy will do.
        _ if kind == DiscoveryType::OriginalDst => LbPolicy::RoundRobin,
        EnvoyLbPolicy::RoundRobin => LbPolicy::RoundRobin,
        EnvoyLbPolicy::Random => LbPolicy::Random,
        EnvoyLbPolicy::LeastRequest => {
            let choice_count = match &cluster.lb_config {
                Some(LbConfig::LeastRequestLbConfig(c)) => c.choice_count.map_or(2, |c| c.value),
                _ => 2,
            };
            if choice_count < 2 {
                problems.error(
                    path.field("least_request_lb_config").field("choice_count"),
                    "must be at least 2",
                );
            }
            // Envoy's default bias is 1.0; it reads runtime overrides we do not have.
            let active_request_bias = match &cluster.lb_config {
                Some(LbConfig::LeastRequestLbConfig(c)) => c
                    .active_request_bias
                    .as_ref()
                    .map_or(1.0, |b| b.default_value),
                _ => 1.0,
            };
            if !(0.0..=10.0).contains(&active_request_bias) {
                problems.error(
                    path.field("least_request_lb_config")
                        .field("active_request_bias"),
                    "must be between 0 and 10",
                );
            }
            LbPolicy::LeastRequest {
                choice_count,
                active_request_bias,
            }
        }
        EnvoyLbPolicy::RingHash => {
            let (mut min, mut max) = (DEFAULT_MIN_RING_SIZE, DEFAULT_MAX_RING_SIZE);
            if let Some(LbConfig::RingHashLbConfig(c)) = &cluster.lb_config {
                min = c.minimum_ring_size.map_or(min, |v| v.value);
                max = c.maximum_ring_size.map_or(max, |v| v.value);
            }
            if min == 0 || min > max || max > DEFAULT_MAX_RING_SIZE {
                problems.error(
                    path.field("ring_hash_lb_config"),
                    format!("ring sizes must satisfy 0 < minimum ({min}) <= maximum ({max}) <= 8M"),
                );
            }
            LbPolicy::RingHash {
                min_ring_size: min,
                max_ring_size: max,
            }
        }
        EnvoyLbPolicy::Maglev => {
            let table_size = match &cluster.lb_config {
                Some(LbConfig::MaglevLbConfig(c)) => {
                    c.table_size.map_or(DEFAULT_MAGLEV_TABLE_SIZE, |v| v.value)
                }
                _ => DEFAULT_MAGLEV_TABLE_SIZE,
            };
            if !is_prime(table_size) || table_size > 5_000_011 {
                problems.error(
                    path.field("maglev_lb_config").field("table_size"),
                    format!("{table_size} must be a prime no larger than 5000011"),
                );
            }
            LbPolicy::Maglev { table_size }
        }
        EnvoyLbPolicy::ClusterProvided => {
            problems.error(
                &policy_path,
                "CLUSTER_PROVIDED is only valid for ORIGINAL_DST clusters",
            );
            LbPolicy::RoundRobin
        }
        EnvoyLbPolicy::LoadBalancingPolicyConfig => {
            problems.error(
                &policy_path,
                "LOAD_BALANCING_POLICY_CONFIG is not implemented yet",
            );
            LbPolicy::RoundRobin
        }
    }
}

fn is_prime(n: u64) -> bool {
    n >= 2
        && (2..)
            .take_while(|d| d * d <= n)
            .all(|d| !n.is_multiple_of(d))
}

/// The endpoints of `load_assignment` with the path of each; Unix domain socket
/// endpoints are left out, their paths pushed to `pipes`.
fn endpoints(
    assignment: Option<&ClusterLoadAssignment>,
    kind: DiscoveryType,
    path: &JsonPath,
    pipes: &mut Vec<String>,
    problems: &mut Diagnostics,
) -> Vec<(Endpoint, JsonPath)> {
    let mut out = Vec::new();
    let Some(assignment) = assignment else {
        return out;
    };
    for (l, locality) in assignment.endpoints.iter().enumerate() {
        for (e, lb_endpoint) in locality.lb_endpoints.iter().enumerate() {
            let endpoint_path = path
                .field("load_assignment")
                .field("endpoints")
                .index(l)
                .field("lb_endpoints")
                .index(e);
            let endpoint = match &lb_endpoint.host_identifier {
                Some(HostIdentifier::Endpoint(endpoint)) => endpoint,
                Some(HostIdentifier::EndpointName(name)) => {
                    problems.error(
                        endpoint_path.field("endpoint_name"),
                        format!("named endpoint {name:?} is not implemented yet"),
                    );
                    continue;
                }
                None => {
                    problems.error(&endpoint_path, "an endpoint needs an address");
                    continue;
                }
            };
            let address_path = endpoint_path.field("endpoint").field("address");
            let unhealthy = matches!(
                HealthStatus::try_from(lb_endpoint.health_status),
                Ok(HealthStatus::Unhealthy | HealthStatus::Draining | HealthStatus::Timeout)
            );
            let weight = lb_endpoint
                .load_balancing_weight
                .map_or(1, |w| w.value.max(1));
            let socket_match =
                shunt_tls::transport_socket::endpoint_match_metadata(lb_endpoint.metadata.as_ref());
            // The endpoints of one workload have the same metadata: one copy.
            let metadata = lb_endpoint
                .metadata
                .as_ref()
                .map(shunt_core::interned::metadata);
            match endpoint.address.as_ref().and_then(|a| a.address.as_ref()) {
                Some(Address::Pipe(_)) => {
                    pipes.push(address_path.field("pipe").into());
                    continue;
                }
                Some(Address::EnvoyInternalAddress(internal)) => {
                    let internal_path = address_path.field("envoy_internal_address");
                    let Some(address) = internal_address(internal, kind, &internal_path, problems)
                    else {
                        continue;
                    };
                    out.push((
                        Endpoint {
                            host: String::new(),
                            port: 0,
                            weight,
                            priority: locality.priority,
                            unhealthy,
                            socket_match,
                            internal: Some(address),
                            metadata,
                        },
                        internal_path,
                    ));
                    continue;
                }
                _ => {}
            }
            let Some(socket) =
                convert::socket_address(endpoint.address.as_ref(), &address_path, problems)
            else {
                continue;
            };
            let socket_path = address_path.field("socket_address");
            let Some(port) = convert::port(socket, &socket_path, problems) else {
                continue;
            };
            if port == 0 && kind != DiscoveryType::OriginalDst {
                problems.error(socket_path.field("port_value"), "an endpoint needs a port");
                continue;
            }
            out.push((
                Endpoint {
                    host: socket.address.clone(),
                    port,
                    weight,
                    priority: locality.priority,
                    unhealthy,
                    socket_match,
                    internal: None,
                    metadata,
                },
                socket_path,
            ));
        }
    }
    out
}

/// An endpoint's `envoy_internal_address` at `path`: only STATIC and EDS clusters
/// list internal listeners (Envoy resolves no names and restores no destination for
/// them).
fn internal_address(
    internal: &envoy_types::pb::envoy::config::core::v3::EnvoyInternalAddress,
    kind: DiscoveryType,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<super::internal::InternalAddress> {
    use envoy_types::pb::envoy::config::core::v3::envoy_internal_address::AddressNameSpecifier;
    let name = match &internal.address_name_specifier {
        Some(AddressNameSpecifier::ServerListenerName(name)) if !name.is_empty() => name,
        _ => {
            problems.error(
                path.field("server_listener_name"),
                "an internal address needs the name of an internal listener",
            );
            return None;
        }
    };
    if !matches!(kind, DiscoveryType::Static | DiscoveryType::Eds) {
        problems.error(
            path,
            format!(
                "a {} cluster cannot have internal listener endpoints (only STATIC and EDS)",
                kind.as_str_name()
            ),
        );
        return None;
    }
    Some(super::internal::InternalAddress {
        server_listener_name: name.as_str().into(),
        endpoint_id: internal.endpoint_id.clone(),
    })
}

fn outlier_detection(
    outlier: &EnvoyOutlier,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> OutlierDetection {
    let defaults = OutlierDetection::default();
    let value = |v: Option<envoy_types::pb::google::protobuf::UInt32Value>, default: u32| {
        v.map_or(default, |v| v.value)
    };
    let (consecutive, enforcing) = if outlier.split_external_local_origin_errors {
        (
            value(outlier.consecutive_local_origin_failure, 5),
            value(outlier.enforcing_consecutive_local_origin_failure, 100),
        )
    } else {
        // Envoy maps a connect failure to a 5xx when local and external errors are not split.
        (
            value(outlier.consecutive_5xx, 5),
            value(outlier.enforcing_consecutive_5xx, 100),
        )
    };
    if outlier.success_rate_stdev_factor.is_some() || outlier.failure_percentage_threshold.is_some()
    {
        problems.warning(
            path,
            "success rate and failure percentage ejection are not implemented; only consecutive failures eject",
        );
    }
    let base = duration_or(
        outlier.base_ejection_time.as_ref(),
        defaults.base_ejection_time,
        &path.field("base_ejection_time"),
        problems,
    );
    OutlierDetection {
        consecutive: consecutive.max(1),
        enforcing: enforcing.min(100),
        base_ejection_time: base,
        max_ejection_time: duration_or(
            outlier.max_ejection_time.as_ref(),
            defaults.max_ejection_time.max(base),
            &path.field("max_ejection_time"),
            problems,
        ),
        max_ejection_percent: value(outlier.max_ejection_percent, defaults.max_ejection_percent)
            .min(100),
    }
}

fn health_check(
    check: &EnvoyHealthCheck,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<HealthCheck> {
    let required = |d: Option<&envoy_types::pb::google::protobuf::Duration>,
                    field: &str,
                    problems: &mut Diagnostics|
     -> Option<Duration> {
        let field_path = path.field(field);
        match d {
            None => {
                problems.error(field_path, "is required");
                None
            }
            Some(d) => convert::duration(d, &field_path, problems).filter(|d| {
                let ok = !d.is_zero();
                if !ok {
                    problems.error(path.field(field), "must be greater than 0s");
                }
                ok
            }),
        }
    };
    let timeout = required(check.timeout.as_ref(), "timeout", problems);
    let interval = required(check.interval.as_ref(), "interval", problems);
    let threshold = |v: Option<envoy_types::pb::google::protobuf::UInt32Value>,
                     field: &str,
                     problems: &mut Diagnostics| {
        let value = v.map(|v| v.value);
        if value.is_none() {
            problems.error(path.field(field), "is required");
        }
        value.unwrap_or(1).max(1)
    };
    let unhealthy_threshold = threshold(check.unhealthy_threshold, "unhealthy_threshold", problems);
    let healthy_threshold = threshold(check.healthy_threshold, "healthy_threshold", problems);
    let checker = match &check.health_checker {
        Some(HealthChecker::TcpHealthCheck(tcp)) => Checker::Tcp {
            send: tcp.send.as_ref().and_then(|p| {
                payload_bytes(p, &path.field("tcp_health_check").field("send"), problems)
            }),
            receive: tcp
                .receive
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    payload_bytes(
                        p,
                        &path.field("tcp_health_check").field("receive").index(i),
                        problems,
                    )
                })
                .collect(),
        },
        Some(HealthChecker::HttpHealthCheck(http)) => {
            if http.path.is_empty() {
                problems.error(path.field("http_health_check").field("path"), "is required");
            }
            let mut expected: Vec<_> = http
                .expected_statuses
                .iter()
                .filter_map(|r| Some(u16::try_from(r.start).ok()?..u16::try_from(r.end).ok()?))
                .collect();
            if expected.is_empty() {
                expected.push(200..201);
            }
            Checker::Http {
                host: http.host.clone(),
                path: http.path.clone(),
                expected_statuses: expected,
            }
        }
        Some(HealthChecker::GrpcHealthCheck(_)) => {
            problems.error(
                path.field("grpc_health_check"),
                "gRPC health checks are not implemented yet",
            );
            return None;
        }
        Some(HealthChecker::CustomHealthCheck(custom)) => {
            problems.error(
                path.field("custom_health_check"),
                format!(
                    "custom health checker {:?} is not implemented yet",
                    custom.name
                ),
            );
            return None;
        }
        None => {
            problems.error(
                path,
                "a health check needs a health checker (tcp_health_check or http_health_check)",
            );
            return None;
        }
    };
    let optional = |d: Option<&envoy_types::pb::google::protobuf::Duration>,
                    field: &str,
                    problems: &mut Diagnostics| {
        duration_or(d, Duration::ZERO, &path.field(field), problems)
    };
    let interval_jitter = optional(check.interval_jitter.as_ref(), "interval_jitter", problems);
    let initial_jitter = optional(check.initial_jitter.as_ref(), "initial_jitter", problems);
    Some(HealthCheck {
        timeout: timeout?,
        interval: interval?,
        interval_jitter,
        interval_jitter_percent: check.interval_jitter_percent,
        initial_jitter,
        unhealthy_threshold,
        healthy_threshold,
        checker,
    })
}

/// A health check payload: `text` is hex in Envoy's API.
fn payload_bytes(p: &Payload, path: &JsonPath, problems: &mut Diagnostics) -> Option<Vec<u8>> {
    match &p.payload {
        Some(payload::Payload::Binary(bytes)) => Some(bytes.clone()),
        Some(payload::Payload::Text(hex)) => {
            let decoded: Option<Vec<u8>> = (hex.len() % 2 == 0)
                .then(|| {
                    (0..hex.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                        .collect()
                })
                .flatten();
            if decoded.is_none() {
                problems.error(path.field("text"), format!("{hex:?} is not hex"));
            }
            decoded
        }
        None => None,
    }
}

const HTTP_PROTOCOL_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// The cluster protocol options read here: config validation's list of them.
pub const PROTOCOL_OPTIONS: &[&str] = &[HTTP_PROTOCOL_OPTIONS];

/// The HTTP version the router speaks to the cluster: HTTP/2 when its upstream
/// `HttpProtocolOptions` say so explicitly (or the deprecated
/// `http2_protocol_options` is set), the downstream's with
/// `use_downstream_protocol_config`, else HTTP/1.1.
#[allow(
    deprecated,
    reason = "Istio and older configs still set http2_protocol_options"
)]
fn http_protocol(
    cluster: &EnvoyCluster,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> UpstreamProtocol {
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
        HttpProtocolOptions,
        http_protocol_options::{UpstreamProtocolOptions, explicit_http_config::ProtocolConfig},
    };
    let mut protocol = if cluster.http2_protocol_options.is_some() {
        UpstreamProtocol::Http2
    } else {
        UpstreamProtocol::Http1
    };
    let Some(any) = cluster
        .typed_extension_protocol_options
        .get(HTTP_PROTOCOL_OPTIONS)
    else {
        return protocol;
    };
    let o_path = path
        .field("typed_extension_protocol_options")
        .key(HTTP_PROTOCOL_OPTIONS);
    let Some(options) = convert::decode::<HttpProtocolOptions>(any, &o_path, problems) else {
        return protocol;
    };
    match options.upstream_protocol_options {
        Some(UpstreamProtocolOptions::ExplicitHttpConfig(explicit)) => {
            match explicit.protocol_config {
                Some(ProtocolConfig::Http2ProtocolOptions(_)) => protocol = UpstreamProtocol::Http2,
                Some(ProtocolConfig::HttpProtocolOptions(_)) => protocol = UpstreamProtocol::Http1,
                Some(ProtocolConfig::Http3ProtocolOptions(_)) => {
                    problems.error(
                        o_path
                            .field("explicit_http_config")
                            .field("http3_protocol_options"),
                        "HTTP/3 upstreams are not implemented yet",
                    );
                }
                None => {}
            }
        }
        Some(UpstreamProtocolOptions::UseDownstreamProtocolConfig(_)) => {
            protocol = UpstreamProtocol::UseDownstream;
        }
        Some(UpstreamProtocolOptions::AutoConfig(_)) => problems.warning(
            o_path.field("auto_config"),
            "ALPN protocol selection is not implemented; HTTP/1.1 is used",
        ),
        None => {}
    }
    protocol
}

/// The type of Istio's upstream metadata exchange filter's config.
const METADATA_EXCHANGE: &str = "envoy.tcp.metadataexchange.config.MetadataExchange";

/// The upstream network filters (a cluster's `filters`) read here: config validation's
/// list of them.
pub const UPSTREAM_NETWORK_FILTERS: &[&str] = &[METADATA_EXCHANGE];

/// The protocol of the cluster's upstream metadata exchange filter, if it has one. Other
/// upstream network filters are not implemented: a warning says they are left out.
fn upstream_metadata_exchange(
    cluster: &envoy_types::pb::envoy::config::cluster::v3::Cluster,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<str>> {
    let mut protocol = None;
    for (i, filter) in cluster.filters.iter().enumerate() {
        let f_path = path.field("filters").index(i).field("typed_config");
        let Some(any) = &filter.typed_config else {
            continue;
        };
        let Some(any) = shunt_config::typed_struct::unwrap(any, &f_path, problems) else {
            continue;
        };
        let kind = shunt_config::convert::type_name(&any);
        if kind != METADATA_EXCHANGE {
            problems.warning(
                &f_path,
                format!("upstream network filter {kind} is not implemented; left out"),
            );
            continue;
        }
        let config =
            shunt_config::convert::decode::<UpstreamMetadataExchange>(&any, &f_path, problems)?;
        protocol = Some(Arc::from(if config.protocol.is_empty() {
            shunt_core::peer::exchange::PROTOCOL
        } else {
            config.protocol.as_str()
        }));
    }
    protocol
}

/// `envoy.tcp.metadataexchange.config.MetadataExchange`, the fields shunt reads.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UpstreamMetadataExchange {
    #[prost(string, tag = "1")]
    pub protocol: String,
}

impl prost::Name for UpstreamMetadataExchange {
    const NAME: &'static str = "MetadataExchange";
    const PACKAGE: &'static str = "envoy.tcp.metadataexchange.config";
}
