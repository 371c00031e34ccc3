//! A snapshot's clusters by name, as Envoy's cluster manager holds them. With deferred
//! creation (Envoy's `cluster_manager.enable_deferred_cluster_creation`, and always in
//! node mode) a cluster is made the first time something looks it up: until then a
//! pod holds only its shared compile ([`Prototype`]) and no stats, hosts or balancer
//! of its own. Istio pushes every pod every service of the mesh; a pod talks to a few.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use shunt_core::stats::Store;

use super::Cluster;
use super::compile::Prototype;

/// The clusters by name. Cloning copies pointers only: an update copies the map of
/// thousands of clusters without copying a name or a cluster, and a cluster made after
/// the copy (deferred) is made once for both. Looked up on every request: foldhash
/// rather than SipHash, a fraction of the instructions per lookup (only config inserts
/// names, so flooding is no concern).
#[derive(Clone, Default)]
pub struct Clusters {
    by_name: HashMap<Arc<str>, Arc<Entry>, foldhash::fast::RandomState>,
    /// The pod's stats store, where a deferred cluster's stats go when it is made: one
    /// `Arc` for the map rather than one per cluster (entries move only between the
    /// maps of one pod's snapshots).
    stats: Option<Arc<Store>>,
}

/// One cluster: made, or made on first use from its shared compile. Two words: a pod
/// holds one per cluster of the mesh (Istio pushes them all), most never made.
pub struct Entry {
    made: OnceLock<Arc<Cluster>>,
    /// What makes it (deferred): shared by every pod with the same cluster, kept for
    /// its digest and stat name once the cluster is made.
    prototype: Option<Arc<Prototype>>,
}

impl Entry {
    fn made(cluster: Arc<Cluster>) -> Arc<Entry> {
        Arc::new(Entry {
            made: OnceLock::from(cluster),
            prototype: None,
        })
    }

    pub(crate) fn deferred(prototype: Arc<Prototype>) -> Arc<Entry> {
        Arc::new(Entry {
            made: OnceLock::new(),
            prototype: Some(prototype),
        })
    }

    /// The digest of the config it was compiled from (see `ClusterConfig::config_digest`),
    /// known without making it.
    pub(crate) fn digest(&self) -> u64 {
        match (&self.prototype, self.made.get()) {
            (Some(prototype), _) => prototype.digest(),
            (None, Some(made)) => made.config_digest,
            (None, None) => 0,
        }
    }

    /// The name its stats go under, when not its own (`alt_stat_name`).
    fn alt_stat_name(&self) -> Option<&Arc<str>> {
        if let Some(prototype) = &self.prototype {
            return prototype.alt_stat_name();
        }
        let made = self.made.get()?;
        let alt = &made.stats.observability_name;
        (!alt.is_empty() && *alt != made.name).then_some(alt)
    }

    /// The cluster, made now (in the pod's `stats`) if it was not; a second caller
    /// waits for the first to make it. `None` only without a store to make it in.
    fn cluster(&self, stats: Option<&Arc<Store>>) -> Option<&Arc<Cluster>> {
        if let Some(made) = self.made.get() {
            return Some(made);
        }
        let (prototype, stats) = (self.prototype.as_ref()?, stats?);
        Some(self.made.get_or_init(|| prototype.instantiate(stats)))
    }
}

impl Clusters {
    /// The cluster `name`, made now if its creation was deferred.
    pub fn get(&self, name: &str) -> Option<&Arc<Cluster>> {
        self.by_name.get(name)?.cluster(self.stats.as_ref())
    }

    /// The cluster `name` if it is made, without making it (the admin API's listing:
    /// a cluster nothing used has only its configured hosts).
    pub fn made(&self, name: &str) -> Option<&Arc<Cluster>> {
        self.by_name.get(name)?.made.get()
    }

    /// Every cluster made so far.
    pub fn made_clusters(&self) -> impl Iterator<Item = &Arc<Cluster>> {
        self.by_name.values().filter_map(|e| e.made.get())
    }

    /// Every cluster's name, in no order.
    pub fn names(&self) -> impl Iterator<Item = &Arc<str>> {
        self.by_name.keys()
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The digest of the config the cluster `name` was compiled from.
    pub fn digest_of(&self, name: &str) -> Option<u64> {
        self.by_name.get(name).map(|e| e.digest())
    }

    /// The clusters whose stats go under another name than their own
    /// (`alt_stat_name`), with that name.
    pub fn alt_stat_names(&self) -> impl Iterator<Item = (&Arc<str>, &Arc<str>)> {
        self.by_name
            .iter()
            .filter_map(|(name, e)| Some((name, e.alt_stat_name()?)))
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// How many clusters are not made yet (deferred, and not used since).
    pub fn deferred(&self) -> usize {
        self.by_name
            .values()
            .filter(|e| e.made.get().is_none())
            .count()
    }

    pub fn insert(&mut self, name: Arc<str>, cluster: Arc<Cluster>) {
        self.by_name.insert(name, Entry::made(cluster));
    }

    pub fn remove(&mut self, name: &str) {
        self.by_name.remove(name);
    }

    pub(crate) fn entry(&self, name: &str) -> Option<(&Arc<str>, &Arc<Entry>)> {
        self.by_name.get_key_value(name)
    }

    pub(crate) fn take_entry(&mut self, name: &str) -> Option<(Arc<str>, Arc<Entry>)> {
        self.by_name.remove_entry(name)
    }

    pub(crate) fn insert_entry(&mut self, name: Arc<str>, entry: Arc<Entry>) {
        self.by_name.insert(name, entry);
    }

    /// Where the clusters not made yet will keep their stats (the pod's store).
    pub(crate) fn set_stats(&mut self, stats: &Arc<Store>) {
        if !self.stats.as_ref().is_some_and(|s| Arc::ptr_eq(s, stats)) {
            self.stats = Some(stats.clone());
        }
    }
}

impl std::ops::Index<&str> for Clusters {
    type Output = Arc<Cluster>;

    /// The cluster `name`; panics if there is none (tests).
    fn index(&self, name: &str) -> &Arc<Cluster> {
        self.get(name)
            .unwrap_or_else(|| panic!("no cluster named {name:?}"))
    }
}

impl std::fmt::Debug for Clusters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&str> = self.by_name.keys().map(|n| &**n).collect();
        names.sort_unstable();
        f.debug_struct("Clusters")
            .field("names", &names)
            .field("deferred", &self.deferred())
            .finish()
    }
}
