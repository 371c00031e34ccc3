//! A snapshot's clusters by name, as Envoy's cluster manager holds them. With deferred
//! creation (Envoy's `cluster_manager.enable_deferred_cluster_creation`, and always in
//! node mode) a cluster is made the first time something looks it up: until then a
//! pod holds only its shared compile ([`Prototype`]) and no stats, hosts or balancer
//! of its own. Istio pushes every pod every service of the mesh; a pod talks to a few.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

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
}

/// One cluster: made, or made on first use from its shared compile.
pub struct Entry {
    /// The digest of the config it was compiled from (see `ClusterConfig::config_digest`),
    /// known without making it.
    digest: u64,
    /// The name its stats go under, when not its own (`alt_stat_name`).
    alt_stat_name: Option<Arc<str>>,
    made: OnceLock<Arc<Cluster>>,
    /// What makes it, taken when it is made.
    deferred: Mutex<Option<Deferred>>,
}

struct Deferred {
    prototype: Arc<Prototype>,
    /// The pod's stats store, one `Arc` for all its clusters.
    stats: Arc<Store>,
}

impl Entry {
    fn made(cluster: Arc<Cluster>) -> Arc<Entry> {
        let alt = &cluster.stats.observability_name;
        Arc::new(Entry {
            digest: cluster.config_digest,
            alt_stat_name: (!alt.is_empty() && *alt != cluster.name).then(|| alt.clone()),
            made: OnceLock::from(cluster),
            deferred: Mutex::new(None),
        })
    }

    pub(crate) fn deferred(prototype: Arc<Prototype>, stats: &Arc<Store>) -> Arc<Entry> {
        Arc::new(Entry {
            digest: prototype.digest(),
            alt_stat_name: prototype.alt_stat_name().cloned(),
            made: OnceLock::new(),
            deferred: Mutex::new(Some(Deferred {
                prototype,
                stats: stats.clone(),
            })),
        })
    }

    pub(crate) fn digest(&self) -> u64 {
        self.digest
    }

    /// The cluster, made now if it was not. `None` only if making it panicked (a bug):
    /// the cluster is then unknown rather than the proxy down.
    fn cluster(&self) -> Option<&Arc<Cluster>> {
        if let Some(made) = self.made.get() {
            return Some(made);
        }
        // Held while it is made: a second caller waits, then finds it made.
        let mut deferred = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(made) = self.made.get() {
            return Some(made);
        }
        let Deferred { prototype, stats } = deferred.take()?;
        Some(self.made.get_or_init(|| prototype.instantiate(&stats)))
    }
}

impl Clusters {
    /// The cluster `name`, made now if its creation was deferred.
    pub fn get(&self, name: &str) -> Option<&Arc<Cluster>> {
        self.by_name.get(name)?.cluster()
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
        self.by_name.get(name).map(|e| e.digest)
    }

    /// The clusters whose stats go under another name than their own
    /// (`alt_stat_name`), with that name.
    pub fn alt_stat_names(&self) -> impl Iterator<Item = (&Arc<str>, &Arc<str>)> {
        self.by_name
            .iter()
            .filter_map(|(name, e)| Some((name, e.alt_stat_name.as_ref()?)))
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
