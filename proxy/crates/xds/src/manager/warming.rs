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

/// The clusters served before, walked in step with those served now (both in name
/// order): one served as it was (the very resources, versions and endpoints) is the
/// same `Arc`. A pod's start serves its clusters for its CDS, its EDS and its secrets:
/// a new block per cluster each time, freed the next, and a snapshot compile that
/// finds every cluster changed, where it skips the ones it shares with the last.
struct Kept<'a> {
    before: std::iter::Peekable<std::slice::Iter<'a, Arc<DynamicCluster>>>,
}

impl<'a> Kept<'a> {
    fn new(before: &'a [Arc<DynamicCluster>]) -> Self {
        Kept {
            before: before.iter().peekable(),
        }
    }

    /// `made`, or the cluster served before that is the same.
    fn or_new(&mut self, made: DynamicCluster) -> Arc<DynamicCluster> {
        while let Some(old) = self.before.peek() {
            if Arc::ptr_eq(&old.tracked.resource, &made.tracked.resource) {
                let old = self.before.next().expect("peeked");
                if same(old, &made) {
                    return old.clone();
                }
                break;
            }
            if old.name() >= made.name() {
                break;
            }
            self.before.next();
        }
        Arc::new(made)
    }
}

/// Whether two served clusters are the same in everything a snapshot reads of them.
fn same(old: &DynamicCluster, new: &DynamicCluster) -> bool {
    old.digest == new.digest
        && old.tracked.last_updated == new.tracked.last_updated
        && old.tracked.version_info == new.tracked.version_info
        && match (&old.endpoints, &new.endpoints) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        }
}

impl Manager {
    /// Works out every CDS cluster afresh: active (EDS ones with their endpoints filled
    /// in) or warming, and until when.
    pub(super) fn serve_clusters(&mut self) {
        let mut served = ServedClusters::default();
        // What was served before: a cluster served as it was keeps its `Arc`.
        let before = self.served.take().map(|s| s.active).unwrap_or_default();
        let mut kept = Kept::new(&before);
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
                let (endpoints, digest) = match service {
                    Some(_) => with_endpoints_of(entry.digest, eds),
                    None => (None, entry.digest),
                };
                if let Some(service) = service {
                    (served.by_service).push(service.clone(), served.active.len(), entry.digest);
                }
                let made = DynamicCluster {
                    tracked,
                    endpoints,
                    digest,
                };
                served.active.push(kept.or_new(made));
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
    use super::*;

    fn served(name: &str, version: &str, at: std::time::SystemTime) -> DynamicCluster {
        let cluster = EnvoyCluster {
            name: name.into(),
            ..Default::default()
        };
        let cluster = Arc::new(Encoded::of(&cluster));
        DynamicCluster {
            digest: cluster.digest(),
            endpoints: None,
            tracked: Tracked {
                resource: cluster,
                version_info: Some(version.into()),
                last_updated: at,
            },
        }
    }

    /// A cluster served again as it was is the same `Arc`; one whose version changed,
    /// or that is new, is a new one; the walk in step survives a cluster added between.
    #[test]
    fn a_cluster_served_again_as_it_was_keeps_its_arc() {
        let at = std::time::SystemTime::now();
        let before: Vec<Arc<DynamicCluster>> = ["a", "b", "c"]
            .into_iter()
            .map(|n| Arc::new(served(n, "1", at)))
            .collect();
        let again = |old: &DynamicCluster| DynamicCluster {
            tracked: old.tracked.clone(),
            endpoints: old.endpoints.clone(),
            digest: old.digest,
        };
        let mut kept = Kept::new(&before);
        let a = kept.or_new(again(&before[0]));
        let mut b = again(&before[1]);
        b.tracked.version_info = Some("2".into());
        let b = kept.or_new(b);
        let added = kept.or_new(served("bb", "1", at));
        let c = kept.or_new(again(&before[2]));
        assert!(Arc::ptr_eq(&a, &before[0]));
        assert!(!Arc::ptr_eq(&b, &before[1]), "another version");
        assert_eq!(added.name(), "bb");
        assert!(Arc::ptr_eq(&c, &before[2]));
        // A cluster of the same name from other bytes is not the one served before.
        let mut kept = Kept::new(&before);
        assert!(!Arc::ptr_eq(&kept.or_new(served("a", "1", at)), &before[0]));
    }

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
