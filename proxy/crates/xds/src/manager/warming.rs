//! Warming, as Envoy does it: which CDS clusters and LDS listeners are served and which
//! wait for their endpoints, routes or secrets (or `initial_fetch_timeout`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as EnvoyCluster;
use envoy_types::pb::envoy::config::listener::v3::Listener as EnvoyListener;

use super::resources::{Resource, with_endpoints_of};
use super::{Manager, TypeState};
use crate::snapshot::{DynamicCluster, Encoded};
use crate::type_url::TypeUrl;
use shunt_config::Tracked;
use shunt_config::references::SecretSource;

/// Maps by resource name rebuilt per update, a key per service: foldhash, not SipHash
/// (names come from config).
pub(super) type NameMap<V> = HashMap<Arc<str>, V, foldhash::fast::RandomState>;

/// The CDS clusters a rebuild served, with what an update of endpoints needs to redo
/// only the clusters those endpoints are for.
#[derive(Debug, Default)]
pub(super) struct ServedClusters {
    /// Active, in name order (as [`DynamicResources::clusters`]).
    pub(super) active: Vec<Arc<DynamicCluster>>,
    /// Waiting for their endpoints or secrets.
    pub(super) warming: Vec<Tracked<Arc<Encoded<EnvoyCluster>>>>,
    /// The active EDS clusters by the service their endpoints come under.
    pub(super) by_service: ByService,
    /// The EDS services of warming clusters: their endpoints may end the warming,
    /// which takes a full rebuild.
    pub(super) awaited: HashSet<Arc<str>, foldhash::fast::RandomState>,
}

/// The active EDS clusters by their service: per cluster the service (the accepted
/// cluster's own shared name), its place in [`ServedClusters::active`] and the digest
/// of its CDS config, sorted by service. A pod holds one of these per rebuild of its
/// clusters: a flat row of 32 bytes per cluster, a third of a hash map's.
#[derive(Debug, Default)]
pub(super) struct ByService(Vec<(Arc<str>, u32, u64)>);

impl ByService {
    fn push(&mut self, service: Arc<str>, place: usize, digest: u64) {
        let place = u32::try_from(place).expect("fewer than 2^32 clusters");
        self.0.push((service, place, digest));
    }

    /// Sorted by service, and no larger than it needs to be.
    fn seal(&mut self) {
        // Clusters come in name order, and Istio's EDS clusters are their own service:
        // already sorted, which the stable sort sees in one pass.
        self.0.sort_by(|a, b| a.0.cmp(&b.0));
        self.0.shrink_to_fit();
    }

    /// The clusters of `service`: their places in `active` and config digests.
    fn users<'a>(&'a self, service: &'a str) -> impl Iterator<Item = (usize, u64)> + 'a {
        let start = self.0.partition_point(|(s, ..)| &**s < service);
        self.0[start..]
            .iter()
            .take_while(move |(s, ..)| &**s == service)
            .map(|&(_, place, digest)| (place as usize, digest))
    }
}

/// The LDS listeners a rebuild served.
#[derive(Debug, Default)]
pub(super) struct ServedListeners {
    /// Served: the accepted version, or the last one served while a newer one warms.
    pub(super) active: Vec<Tracked<Arc<Encoded<EnvoyListener>>>>,
    /// Waiting for their routes or secrets.
    pub(super) warming: Vec<Tracked<Arc<Encoded<EnvoyListener>>>>,
    pub(super) version: String,
}

/// Whether secret `name` is there: SDS sent it or the bootstrap has it.
pub(super) fn has_secret(
    types: &BTreeMap<TypeUrl, TypeState>,
    static_secrets: &HashSet<String>,
    name: &str,
) -> bool {
    static_secrets.contains(name)
        || types
            .get(&TypeUrl::Secret)
            .is_some_and(|t| t.resources.contains_key(name))
}

/// Until when a resource warming since `since` (`None`: starting now) waits:
/// `initial_fetch_timeout` from its start, or for ever when that is 0.
pub(super) fn warm_until(
    timeout: std::time::Duration,
    since: Option<&Option<Instant>>,
) -> Option<Instant> {
    since
        .copied()
        .unwrap_or_else(|| (!timeout.is_zero()).then(|| Instant::now() + timeout))
}

pub(super) async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}

impl Manager {
    /// Works out every CDS cluster afresh: active (EDS ones with their endpoints filled
    /// in) or warming, and until when.
    pub(super) fn serve_clusters(&mut self) {
        let mut served = ServedClusters::default();
        let endpoints = self
            .types
            .get(&TypeUrl::ClusterLoadAssignment)
            .map(|t| &t.resources);
        // Every cluster names the same few secrets (Istio's `default` and `ROOTCA`):
        // each looked up once.
        let mut secrets_seen: Vec<(&str, bool)> = Vec::new();
        let mut has_secret = |name| match secrets_seen.iter().find(|(n, _)| *n == name) {
            Some(&(_, has)) => has,
            None => {
                let has = has_secret(&self.types, &self.static_secrets, name);
                secrets_seen.push((name, has));
                has
            }
        };
        let mut still_warming = NameMap::default();
        if let Some(clusters) = self.types.get(&TypeUrl::Cluster) {
            for entry in clusters.resources.values() {
                let Resource::Cluster(cluster) = &entry.resource else {
                    continue;
                };
                let tracked = entry.tracked(cluster);
                let service = cluster.eds_service();
                let secrets_missing = (cluster.facts.secrets.iter())
                    .any(|s| s.source != SecretSource::Static && !has_secret(&s.name));
                let eds = service.and_then(|s| endpoints.and_then(|e| e.get(&**s)));
                let waiting = secrets_missing || (service.is_some() && eds.is_none());
                if waiting && !self.timed_out.contains(&*cluster.name) {
                    let timeout = match &cluster.facts.eds {
                        Some(eds) if !secrets_missing => eds.fetch_timeout,
                        _ => self.plan.initial_fetch_timeout,
                    };
                    let deadline = warm_until(timeout, self.warming.get(&*cluster.name));
                    still_warming.insert(cluster.name.clone(), deadline);
                    served.awaited.extend(service.cloned());
                    served.warming.push(tracked);
                    continue;
                }
                let Some(service) = service else {
                    served.active.push(Arc::new(DynamicCluster {
                        tracked,
                        endpoints: None,
                        digest: entry.digest,
                    }));
                    continue;
                };
                let (endpoints, digest) = with_endpoints_of(entry.digest, eds);
                (served.by_service).push(service.clone(), served.active.len(), entry.digest);
                served.active.push(Arc::new(DynamicCluster {
                    tracked,
                    endpoints,
                    digest,
                }));
            }
        }
        served.by_service.seal();
        self.warming = still_warming;
        if !self.timed_out.is_empty()
            && let Some(clusters) = self.types.get(&TypeUrl::Cluster)
        {
            self.timed_out
                .retain(|name| clusters.resources.contains_key(&**name));
        }
        self.served = Some(served);
    }

    /// Redoes the served clusters whose endpoints (`services`) an update upserted, the
    /// others staying as they are: an update of one cluster's endpoints costs that
    /// cluster. False, with nothing done, when that is not all the update changes: no
    /// clusters were served yet, a warming cluster waits for one of these endpoints.
    pub(super) fn patch_served_clusters(&mut self, services: &[Arc<str>]) -> bool {
        let Some(served) = &mut self.served else {
            return false;
        };
        let Some(endpoints) = self
            .types
            .get(&TypeUrl::ClusterLoadAssignment)
            .map(|t| &t.resources)
        else {
            return false;
        };
        let patchable = services
            .iter()
            .all(|s| !served.awaited.contains(&**s) && endpoints.contains_key(s));
        if !patchable {
            return false;
        }
        for service in services {
            let eds = endpoints.get(service);
            for (i, cluster_digest) in served.by_service.users(service) {
                let old = &served.active[i];
                let (endpoints, digest) = with_endpoints_of(cluster_digest, eds);
                if digest != old.digest {
                    served.active[i] = Arc::new(DynamicCluster {
                        tracked: old.tracked.clone(),
                        endpoints,
                        digest,
                    });
                }
            }
        }
        true
    }

    /// Works out every LDS listener afresh: a listener warms until its routes and
    /// secrets are in (or its wait is over); a version already served keeps serving
    /// meanwhile.
    pub(super) fn serve_listeners(&mut self) {
        let mut served = ServedListeners::default();
        let routes = self
            .types
            .get(&TypeUrl::RouteConfiguration)
            .map(|t| &t.resources);
        let has_secret = |name: &str| has_secret(&self.types, &self.static_secrets, name);
        let deadline = |since| warm_until(self.plan.initial_fetch_timeout, since);
        let mut warming_listeners = HashMap::new();
        let mut active_listeners = HashMap::new();
        if let Some(listeners) = self.types.get(&TypeUrl::Listener) {
            served.version = listeners.system_version.clone();
            for entry in listeners.resources.values() {
                let Resource::Listener(l) = &entry.resource else {
                    continue;
                };
                let waiting = (l.facts.rds_names.iter())
                    .any(|name| !routes.is_some_and(|r| r.contains_key(name.as_str())))
                    || (l.facts.secrets.iter())
                        .any(|s| s.source != SecretSource::Static && !has_secret(&s.name));
                let tracked = entry.tracked(l);
                if waiting && !self.listeners_timed_out.contains(&*l.name) {
                    warming_listeners.insert(
                        l.name.to_string(),
                        deadline(self.warming_listeners.get(&*l.name)),
                    );
                    served.warming.push(tracked);
                    if let Some(active) = self.active_listeners.get(&*l.name) {
                        served.active.push(active.clone());
                        active_listeners.insert(l.name.to_string(), active.clone());
                    }
                    continue;
                }
                served.active.push(tracked.clone());
                active_listeners.insert(l.name.to_string(), tracked);
            }
            self.listeners_timed_out
                .retain(|name| listeners.resources.contains_key(name.as_str()));
        }
        self.warming_listeners = warming_listeners;
        self.active_listeners = active_listeners;
        self.served_listeners = Some(served);
    }
}

#[cfg(test)]
mod tests {
    use super::ByService;

    #[test]
    fn by_service_finds_every_cluster_of_a_service_and_no_other() {
        let mut by = ByService::default();
        by.push("b".into(), 0, 10);
        by.push("a".into(), 1, 11);
        by.push("b".into(), 2, 12);
        by.push("c".into(), 3, 13);
        by.seal();
        assert_eq!(by.users("b").collect::<Vec<_>>(), [(0, 10), (2, 12)]);
        assert_eq!(by.users("a").collect::<Vec<_>>(), [(1, 11)]);
        assert_eq!(by.users("c").collect::<Vec<_>>(), [(3, 13)]);
        assert_eq!(by.users("bb").count(), 0);
        assert_eq!(by.users("").count(), 0);
    }
}
