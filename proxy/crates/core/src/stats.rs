//! The in-memory stats store: counters, gauges and histograms by their Envoy names
//! (`cluster.<stat_name>.upstream_cx_total`, `listener.0.0.0.0_15001.downstream_cx_total`,
//! ...), which the data plane updates and the admin API reads.
//!
//! Names are created once (when a snapshot is compiled, say) and the handles kept: updating
//! a handle is one relaxed atomic operation, with no lock and no lookup, so the data path
//! never waits for a scrape. Only creating a name takes the store's lock. Tags (Prometheus
//! labels) are not stored: the admin API extracts them from the names as Envoy does, with
//! the bootstrap's `stats_config` (see `admin::tags`).
//!
//! Except for tagged stats ([`Store::tagged_counter`] and kin): those are created with
//! their tags, as Envoy's `counterFromStatNameWithTags` does for Istio's metrics, and keep
//! them (no extraction), under a name in a custom namespace (`istiocustom.`) that
//! `/stats/prometheus` writes without Envoy's `envoy_` prefix.
//!
//! A resource with a fixed set of stats (a cluster's thirty) keeps them as one block
//! under its prefix ([`Store::block`]): one entry and no name per stat (the names are
//! made when read), so an idle cluster costs its counters and little else; a name
//! under a block's prefix looked up one at a time is the block's stat.
//!
//! Stats live as long as their resource, as in Envoy's scopes: a cluster, listener or
//! connection manager holds a [`ScopeGuard`] for its prefix (`cluster.<name>.`); when the
//! last guard of a prefix goes, the stats under it that nobody holds are freed, and the
//! rest as soon as their last handle drops (checked at each snapshot). While a guard
//! lives nothing under its prefix is freed, so a counter Prometheus scraped never goes
//! back while its resource exists. Unscoped and tagged stats live as long as the store.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// One stat's value when read.
#[derive(Debug, Clone, PartialEq)]
pub enum StatValue {
    Counter(u64),
    Gauge(u64),
    Histogram(HistogramSummary),
}

/// A stat as the admin API reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stat {
    /// The full Envoy name, tags included: `cluster.agent.upstream_cx_total`.
    pub name: String,
    pub value: StatValue,
    /// Whether it was ever written (Envoy's `usedonly`).
    pub used: bool,
    /// A tagged stat's own tags (no extraction applies to it); `None` for the others.
    pub tags: Option<Arc<TagSet>>,
}

/// The tags a tagged stat was created with, and its name without them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagSet {
    /// `istiocustom.istio_requests_total`.
    pub extracted_name: String,
    /// In the order given: Prometheus shows labels in this order.
    pub tags: Vec<(String, String)>,
}

/// Envoy's registered custom stat namespaces: a stat under one is shown by
/// `/stats/prometheus` without the `envoy_` prefix and without the namespace. Istio's
/// stats filter registers `istiocustom`.
pub const CUSTOM_NAMESPACES: &[&str] = &["istiocustom"];

/// Envoy's full name of a tagged stat: the name, then each tag's name and value, all
/// joined by dots (`istiocustom.istio_requests_total.reporter.source...`).
pub fn tagged_name(name: &str, tags: &[(&str, &str)]) -> String {
    let mut full = String::with_capacity(
        name.len()
            + tags
                .iter()
                .map(|(k, v)| k.len() + v.len() + 2)
                .sum::<usize>(),
    );
    full.push_str(name);
    for (key, value) in tags {
        full.push('.');
        full.push_str(key);
        full.push('.');
        full.push_str(value);
    }
    full
}

impl Stat {
    pub fn counter(name: impl Into<String>, value: u64) -> Self {
        Stat {
            name: name.into(),
            value: StatValue::Counter(value),
            used: value > 0,
            tags: None,
        }
    }

    pub fn gauge(name: impl Into<String>, value: u64) -> Self {
        Stat {
            name: name.into(),
            value: StatValue::Gauge(value),
            used: true,
            tags: None,
        }
    }
}

/// Envoy's default histogram buckets (`stats_config.histogram_bucket_settings` unset), in
/// the unit the histogram records (milliseconds for `*_ms`).
pub const DEFAULT_BUCKETS: &[f64] = &[
    0.5, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
    60000.0, 300000.0, 600000.0, 1800000.0, 3600000.0,
];

/// Envoy's supported quantiles, as fractions.
pub const QUANTILES: &[f64] = &[0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 1.0];

/// A histogram's cumulative state: what Prometheus and `/stats` show.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSummary {
    /// `(upper bound, samples <= bound)`, ascending, cumulative like Prometheus buckets.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum: f64,
}

impl HistogramSummary {
    /// The value below which fraction `q` of the samples fall, interpolated linearly inside
    /// the bucket that holds it (Envoy computes from finer buckets: this is an estimate of
    /// the same thing). `None` when nothing was recorded.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q * self.count as f64;
        let mut lower = (0.0, 0u64);
        for &(bound, cumulative) in &self.buckets {
            if cumulative as f64 >= rank && cumulative > 0 {
                let in_bucket = (cumulative - lower.1) as f64;
                let position = if in_bucket > 0.0 {
                    (rank - lower.1 as f64).max(0.0) / in_bucket
                } else {
                    1.0
                };
                return Some(lower.0 + (bound - lower.0) * position);
            }
            lower = (bound, cumulative);
        }
        // Beyond the last bound: the mean of what is left is the best we know.
        Some(lower.0.max(self.sum / self.count as f64))
    }
}

/// A monotonically increasing count.
#[derive(Debug, Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn value(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (Envoy's gauges are unsigned: every `dec` pairs an `inc`).
#[derive(Debug, Clone, Default)]
pub struct Gauge(Arc<GaugeCell>);

#[derive(Debug, Default)]
struct GaugeCell {
    value: AtomicU64,
    used: AtomicBool,
}

impl Gauge {
    pub fn set(&self, value: u64) {
        self.0.value.store(value, Ordering::Relaxed);
        self.mark_used();
    }
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn dec(&self) {
        self.sub(1);
    }
    pub fn add(&self, n: u64) {
        self.0.value.fetch_add(n, Ordering::Relaxed);
        self.mark_used();
    }
    pub fn sub(&self, n: u64) {
        self.0.value.fetch_sub(n, Ordering::Relaxed);
        self.mark_used();
    }
    pub fn value(&self) -> u64 {
        self.0.value.load(Ordering::Relaxed)
    }
    fn mark_used(&self) {
        if !self.0.used.load(Ordering::Relaxed) {
            self.0.used.store(true, Ordering::Relaxed);
        }
    }
}

/// A distribution of recorded values over [`DEFAULT_BUCKETS`].
#[derive(Debug, Clone)]
pub struct Histogram(Arc<HistogramCell>);

#[derive(Debug)]
struct HistogramCell {
    /// Disjoint counts: `[i]` holds samples in `(bound[i-1], bound[i]]`; one more for the
    /// overflow. Allocated with the first sample: most of a node's clusters never
    /// record one, and each has three histograms in every pod.
    counts: std::sync::OnceLock<Box<[AtomicU64]>>,
    count: AtomicU64,
    /// The sum as f64 bits, updated by compare-and-swap: recording is rare next to the
    /// counters (once per connection or request), so the retry loop costs nothing.
    sum_bits: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram(Arc::new(HistogramCell {
            counts: std::sync::OnceLock::new(),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }))
    }
}

impl Histogram {
    pub fn record(&self, value: f64) {
        let index = DEFAULT_BUCKETS.partition_point(|&bound| bound < value);
        let counts = self.0.counts.get_or_init(|| {
            (0..=DEFAULT_BUCKETS.len())
                .map(|_| AtomicU64::new(0))
                .collect()
        });
        counts[index].fetch_add(1, Ordering::Relaxed);
        self.0.count.fetch_add(1, Ordering::Relaxed);
        let _ = self
            .0
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }

    pub fn summary(&self) -> HistogramSummary {
        let mut cumulative = 0;
        let counts = self.0.counts.get().map(|counts| &counts[..]);
        let buckets = DEFAULT_BUCKETS
            .iter()
            .enumerate()
            .map(|(i, &bound)| {
                cumulative += counts.map_or(0, |counts| counts[i].load(Ordering::Relaxed));
                (bound, cumulative)
            })
            .collect();
        HistogramSummary {
            buckets,
            count: self.0.count.load(Ordering::Relaxed),
            sum: f64::from_bits(self.0.sum_bits.load(Ordering::Relaxed)),
        }
    }
}

#[derive(Debug, Clone)]
enum Metric {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

/// Tagged stats by full name, with their tags.
type TaggedMetrics = BTreeMap<String, (Metric, Arc<TagSet>)>;

/// What a stat is: which kind of [`Metric`] a block's name is made as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn make(self) -> Metric {
        match self {
            Kind::Counter => Metric::Counter(Counter::default()),
            Kind::Gauge => Metric::Gauge(Gauge::default()),
            Kind::Histogram => Metric::Histogram(Histogram::default()),
        }
    }
}

/// A block's stats: the names after its prefix with their kinds, in a fixed order.
pub type BlockSpec = &'static [(&'static str, Kind)];

/// The stats of a block ([`Store::block`]), as handles.
#[derive(Debug, Clone)]
pub struct Block {
    spec: BlockSpec,
    metrics: Arc<[Metric]>,
}

impl Block {
    fn metric(&self, name: &str) -> Option<&Metric> {
        let i = self.spec.iter().position(|(n, _)| *n == name)?;
        self.metrics.get(i)
    }

    /// The counter `name` of the block; a handle to nowhere (with a debug assertion)
    /// if the spec has no counter of that name.
    pub fn counter(&self, name: &str) -> Counter {
        match self.metric(name) {
            Some(Metric::Counter(c)) => c.clone(),
            _ => {
                debug_assert!(false, "no counter {name} in the block");
                Counter::default()
            }
        }
    }

    pub fn gauge(&self, name: &str) -> Gauge {
        match self.metric(name) {
            Some(Metric::Gauge(g)) => g.clone(),
            _ => {
                debug_assert!(false, "no gauge {name} in the block");
                Gauge::default()
            }
        }
    }

    pub fn histogram(&self, name: &str) -> Histogram {
        match self.metric(name) {
            Some(Metric::Histogram(h)) => h.clone(),
            _ => {
                debug_assert!(false, "no histogram {name} in the block");
                Histogram::default()
            }
        }
    }
}

/// Every stat of the process by name. Cloning shares the store.
#[derive(Debug, Clone, Default)]
pub struct Store {
    metrics: Arc<RwLock<BTreeMap<String, Metric>>>,
    /// Blocks by prefix (`cluster.<name>.`): each name after the prefix is one stat.
    blocks: Arc<RwLock<BTreeMap<String, Block>>>,
    /// Tagged stats by full name ([`tagged_name`]), with their tags.
    tagged: Arc<RwLock<TaggedMetrics>>,
    /// Names asked for as two different kinds, reported once each.
    conflicts: Arc<Mutex<Vec<String>>>,
    /// The prefixes resources hold, and those whose resource went.
    scopes: Arc<Mutex<Scopes>>,
}

/// The scope prefixes in use (with how many guards each) and those released whose
/// stats are not all freed yet (some handle still held).
#[derive(Debug, Default)]
struct Scopes {
    live: HashMap<String, usize>,
    released: BTreeSet<String>,
}

/// A resource's hold on the stats under its prefix (`cluster.<name>.`): they are freed
/// once every guard of the prefix is dropped and nobody holds them.
#[derive(Debug)]
pub struct ScopeGuard {
    store: Store,
    prefix: String,
}

impl Clone for ScopeGuard {
    fn clone(&self) -> Self {
        self.store.scope(&self.prefix)
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let released = {
            let mut scopes = self.store.scopes.lock().unwrap_or_else(|e| e.into_inner());
            let Some(count) = scopes.live.get_mut(&self.prefix) else {
                return;
            };
            *count -= 1;
            if *count > 0 {
                return;
            }
            scopes.live.remove(&self.prefix);
            scopes.released.insert(self.prefix.clone());
            true
        };
        if released {
            self.store.free_released();
        }
    }
}

impl Metric {
    fn kind(&self) -> Kind {
        match self {
            Metric::Counter(_) => Kind::Counter,
            Metric::Gauge(_) => Kind::Gauge,
            Metric::Histogram(_) => Kind::Histogram,
        }
    }

    /// Whether a handle other than the store's own is held.
    fn held(&self) -> bool {
        match self {
            Metric::Counter(c) => Arc::strong_count(&c.0) > 1,
            Metric::Gauge(g) => Arc::strong_count(&g.0) > 1,
            Metric::Histogram(h) => Arc::strong_count(&h.0) > 1,
        }
    }
}

impl Store {
    pub fn new() -> Self {
        Self::default()
    }

    /// The counter of that name, created at zero on first use.
    pub fn counter(&self, name: &str) -> Counter {
        match self.get_or_insert(name, || Metric::Counter(Counter::default())) {
            Metric::Counter(counter) => counter,
            _ => {
                self.conflict(name, "counter");
                Counter::default()
            }
        }
    }

    /// The gauge of that name, created at zero on first use.
    pub fn gauge(&self, name: &str) -> Gauge {
        match self.get_or_insert(name, || Metric::Gauge(Gauge::default())) {
            Metric::Gauge(gauge) => gauge,
            _ => {
                self.conflict(name, "gauge");
                Gauge::default()
            }
        }
    }

    /// The histogram of that name, created empty on first use.
    pub fn histogram(&self, name: &str) -> Histogram {
        match self.get_or_insert(name, || Metric::Histogram(Histogram::default())) {
            Metric::Histogram(histogram) => histogram,
            _ => {
                self.conflict(name, "histogram");
                Histogram::default()
            }
        }
    }

    /// The tagged counter `name` with `tags` (in that order), created at zero on first use.
    pub fn tagged_counter(&self, name: &str, tags: &[(&str, &str)]) -> Counter {
        match self.get_or_insert_tagged(name, tags, || Metric::Counter(Counter::default())) {
            Metric::Counter(counter) => counter,
            _ => {
                self.conflict(name, "counter");
                Counter::default()
            }
        }
    }

    /// The tagged gauge `name` with `tags`, created at zero on first use.
    pub fn tagged_gauge(&self, name: &str, tags: &[(&str, &str)]) -> Gauge {
        match self.get_or_insert_tagged(name, tags, || Metric::Gauge(Gauge::default())) {
            Metric::Gauge(gauge) => gauge,
            _ => {
                self.conflict(name, "gauge");
                Gauge::default()
            }
        }
    }

    /// The tagged histogram `name` with `tags`, created empty on first use.
    pub fn tagged_histogram(&self, name: &str, tags: &[(&str, &str)]) -> Histogram {
        match self.get_or_insert_tagged(name, tags, || Metric::Histogram(Histogram::default())) {
            Metric::Histogram(histogram) => histogram,
            _ => {
                self.conflict(name, "histogram");
                Histogram::default()
            }
        }
    }

    /// The stats `spec` names under `prefix` (ending in `.`), kept as one block: the
    /// block already there with this prefix and spec, or a new one (taking over any of
    /// its names made one at a time before). Hold a [`ScopeGuard`] for the prefix: the
    /// block goes as its plain stats do.
    pub fn block(&self, prefix: &str, spec: BlockSpec) -> Block {
        if let Some(block) = self
            .blocks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(prefix)
            .filter(|b| b.spec == spec)
        {
            return block.clone();
        }
        let mut metrics = self.metrics.write().unwrap_or_else(|e| e.into_inner());
        let mut blocks = self.blocks.write().unwrap_or_else(|e| e.into_inner());
        if let Some(block) = blocks.get(prefix).filter(|b| b.spec == spec) {
            return block.clone();
        }
        // One buffer for the names looked up: a node-mode pod makes a block for each
        // of its clusters, and most names are in no map.
        let mut full = String::with_capacity(prefix.len() + 40);
        let made: Arc<[Metric]> = spec
            .iter()
            .map(|(name, kind)| {
                full.clear();
                full.push_str(prefix);
                full.push_str(name);
                match metrics.remove(full.as_str()) {
                    Some(existing) if existing.kind() == *kind => existing,
                    Some(other) => {
                        // Keep the first kind, as a plain name does; the block's gets
                        // a handle to nowhere.
                        metrics.insert(full.clone(), other);
                        kind.make()
                    }
                    None => kind.make(),
                }
            })
            .collect();
        let block = Block {
            spec,
            metrics: made,
        };
        // Another spec under the same prefix (not made by shunt): its stats go back to
        // being plain names.
        if let Some(old) = blocks.insert(prefix.to_owned(), block.clone()) {
            for ((name, _), metric) in old.spec.iter().zip(old.metrics.iter()) {
                if block.metric(name).is_none() {
                    metrics.insert(format!("{prefix}{name}"), metric.clone());
                }
            }
        }
        block
    }

    /// The stat of a block that `name` is, if any.
    fn in_block(&self, name: &str) -> Option<Metric> {
        let blocks = self.blocks.read().unwrap_or_else(|e| e.into_inner());
        if blocks.is_empty() {
            return None;
        }
        name.match_indices('.').find_map(|(i, _)| {
            blocks
                .get(&name[..=i])
                .and_then(|b| b.metric(&name[i + 1..]))
                .cloned()
        })
    }

    /// A hold on the stats under `prefix` (ending in `.`), for as long as the guard and
    /// its clones live.
    pub fn scope(&self, prefix: &str) -> ScopeGuard {
        let mut scopes = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        *scopes.live.entry(prefix.to_owned()).or_default() += 1;
        scopes.released.remove(prefix);
        ScopeGuard {
            store: self.clone(),
            prefix: prefix.to_owned(),
        }
    }

    /// Frees the stats under released prefixes that nobody holds (and not under a
    /// longer prefix still live: cluster `a.b` inside `cluster.a.`); a prefix is
    /// forgotten once nothing is left under it.
    fn free_released(&self) {
        let mut scopes = self.scopes.lock().unwrap_or_else(|e| e.into_inner());
        if scopes.released.is_empty() {
            return;
        }
        let mut metrics = self.metrics.write().unwrap_or_else(|e| e.into_inner());
        let mut blocks = self.blocks.write().unwrap_or_else(|e| e.into_inner());
        let Scopes { live, released } = &mut *scopes;
        released.retain(|prefix| {
            let blocks_under: Vec<String> = blocks
                .range::<str, _>((
                    std::ops::Bound::Included(prefix.as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(name, _)| name.starts_with(prefix.as_str()))
                .filter(|(name, _)| !live.contains_key(name.as_str()))
                .map(|(name, _)| name.clone())
                .collect();
            let mut blocks_left = false;
            for name in blocks_under {
                if blocks
                    .get(&name)
                    .is_some_and(|b| b.metrics.iter().any(Metric::held))
                {
                    blocks_left = true;
                } else {
                    blocks.remove(&name);
                }
            }
            let under: Vec<String> = metrics
                .range::<str, _>((
                    std::ops::Bound::Included(prefix.as_str()),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(name, _)| name.starts_with(prefix.as_str()))
                .filter(|(name, _)| {
                    !live
                        .keys()
                        .any(|l| l.len() > prefix.len() && name.starts_with(l.as_str()))
                })
                .map(|(name, _)| name.clone())
                .collect();
            let mut left = blocks_left;
            for name in under {
                if metrics.get(&name).is_some_and(Metric::held) {
                    left = true;
                } else {
                    metrics.remove(&name);
                }
            }
            left
        });
    }

    /// Stats in the store now (untagged and tagged).
    pub fn len(&self) -> usize {
        self.metrics.read().unwrap_or_else(|e| e.into_inner()).len()
            + self
                .blocks
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .map(|b| b.metrics.len())
                .sum::<usize>()
            + self.tagged.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every stat, sorted by name.
    pub fn snapshot(&self) -> Vec<Stat> {
        self.free_released();
        let mut stats: Vec<Stat> = {
            let metrics = self.metrics.read().unwrap_or_else(|e| e.into_inner());
            metrics
                .iter()
                .map(|(name, metric)| read(name, metric, None))
                .collect()
        };
        let blocks = self.blocks.read().unwrap_or_else(|e| e.into_inner());
        for (prefix, block) in blocks.iter() {
            for ((name, _), metric) in block.spec.iter().zip(block.metrics.iter()) {
                stats.push(read(&format!("{prefix}{name}"), metric, None));
            }
        }
        let tagged = self.tagged.read().unwrap_or_else(|e| e.into_inner());
        if !blocks.is_empty() && tagged.is_empty() {
            stats.sort_by(|a, b| a.name.cmp(&b.name));
        }
        if !tagged.is_empty() {
            stats.extend(
                tagged
                    .iter()
                    .map(|(name, (metric, tags))| read(name, metric, Some(tags.clone()))),
            );
            stats.sort_by(|a, b| a.name.cmp(&b.name));
        }
        stats
    }

    fn get_or_insert_tagged(
        &self,
        name: &str,
        tags: &[(&str, &str)],
        new: impl FnOnce() -> Metric,
    ) -> Metric {
        let full = tagged_name(name, tags);
        if let Some((metric, _)) = self
            .tagged
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&full)
        {
            return metric.clone();
        }
        let tag_set = Arc::new(TagSet {
            extracted_name: name.to_owned(),
            tags: tags
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        });
        self.tagged
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(full)
            .or_insert_with(|| (new(), tag_set))
            .0
            .clone()
    }

    fn get_or_insert(&self, name: &str, new: impl FnOnce() -> Metric) -> Metric {
        if let Some(metric) = self
            .metrics
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
        {
            return metric.clone();
        }
        if let Some(metric) = self.in_block(name) {
            return metric;
        }
        let mut metrics = self.metrics.write().unwrap_or_else(|e| e.into_inner());
        // Again under the write lock, so that a block made meanwhile is found (blocks are
        // made holding it too).
        if let Some(metric) = self.in_block(name) {
            return metric;
        }
        metrics.entry(name.to_owned()).or_insert_with(new).clone()
    }

    fn conflict(&self, name: &str, wanted: &str) {
        let mut conflicts = self.conflicts.lock().unwrap_or_else(|e| e.into_inner());
        if !conflicts.iter().any(|seen| seen == name) {
            conflicts.push(name.to_owned());
            tracing::warn!(
                stat = name,
                "stat asked for as a {wanted} but exists as another kind; updates are dropped"
            );
        }
    }
}

fn read(name: &str, metric: &Metric, tags: Option<Arc<TagSet>>) -> Stat {
    match metric {
        Metric::Counter(counter) => Stat {
            tags,
            ..Stat::counter(name, counter.value())
        },
        Metric::Gauge(gauge) => Stat {
            name: name.to_owned(),
            value: StatValue::Gauge(gauge.value()),
            used: gauge.0.used.load(Ordering::Relaxed),
            tags,
        },
        Metric::Histogram(histogram) => {
            let summary = histogram.summary();
            Stat {
                name: name.to_owned(),
                used: summary.count > 0,
                value: StatValue::Histogram(summary),
                tags,
            }
        }
    }
}

/// `cluster.<stat_name>.<stat>`, where `stat_name` is the cluster's `alt_stat_name` if it
/// has one, else its name (Envoy's observability name).
pub fn cluster_stat(stat_name: &str, stat: &str) -> String {
    format!("cluster.{stat_name}.{stat}")
}

/// The address part of a listener's stat names (`listener.<address>.<stat>`) when it has
/// no `stat_prefix`: the address as Envoy writes it in stat names, `0.0.0.0_15001`,
/// `[__]_15001` (every `:` becomes `_`).
pub fn listener_stat_prefix(address: &SocketAddr) -> String {
    address.to_string().replace(':', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_share_one_value_per_name() {
        let store = Store::new();
        let a = store.counter("cluster.c.upstream_cx_total");
        let b = store.counter("cluster.c.upstream_cx_total");
        a.inc();
        b.add(2);
        let gauge = store.gauge("server.live");
        gauge.add(3);
        gauge.inc();
        gauge.sub(2);
        gauge.dec();
        assert_eq!(gauge.value(), 1);
        let stats = store.snapshot();
        assert_eq!(
            stats,
            vec![
                Stat::counter("cluster.c.upstream_cx_total", 3),
                Stat::gauge("server.live", 1)
            ]
        );
    }

    #[test]
    fn a_name_keeps_its_first_kind() {
        let store = Store::new();
        store.counter("x").inc();
        store.gauge("x").set(7);
        assert_eq!(store.snapshot(), vec![Stat::counter("x", 1)]);
    }

    #[test]
    fn histograms_bucket_cumulatively_and_estimate_quantiles() {
        let histogram = Histogram::default();
        for value in [0.2, 3.0, 3.0, 7.0] {
            histogram.record(value);
        }
        let summary = histogram.summary();
        assert_eq!(summary.count, 4);
        assert_eq!(summary.sum, 13.2);
        assert_eq!(
            &summary.buckets[..4],
            &[(0.5, 1), (1.0, 1), (5.0, 3), (10.0, 4)]
        );
        assert_eq!(summary.quantile(1.0), Some(10.0));
        let median = summary.quantile(0.5).unwrap();
        assert!((1.0..=5.0).contains(&median), "{median}");
        assert_eq!(Histogram::default().summary().quantile(0.5), None);
    }

    #[test]
    fn tagged_stats_keep_their_tags_in_order_under_envoys_joined_name() {
        let store = Store::new();
        let tags = [("reporter", "source"), ("response_code", "200")];
        store
            .tagged_counter("istiocustom.istio_requests_total", &tags)
            .inc();
        store
            .tagged_counter("istiocustom.istio_requests_total", &tags)
            .add(2);
        store.counter("a.plain").inc();
        let stats = store.snapshot();
        assert_eq!(stats.len(), 2);
        assert_eq!(stats[0], Stat::counter("a.plain", 1));
        let tagged = &stats[1];
        assert_eq!(
            tagged.name,
            "istiocustom.istio_requests_total.reporter.source.response_code.200"
        );
        assert_eq!(tagged.value, StatValue::Counter(3));
        let tag_set = tagged.tags.as_deref().unwrap();
        assert_eq!(tag_set.extracted_name, "istiocustom.istio_requests_total");
        assert_eq!(
            tag_set.tags,
            vec![
                ("reporter".to_owned(), "source".to_owned()),
                ("response_code".to_owned(), "200".to_owned())
            ]
        );
    }

    #[test]
    fn listener_addresses_are_written_as_envoy_writes_them() {
        let v4: SocketAddr = "0.0.0.0:15001".parse().unwrap();
        let v6: SocketAddr = "[::]:15001".parse().unwrap();
        assert_eq!(listener_stat_prefix(&v4), "0.0.0.0_15001");
        assert_eq!(listener_stat_prefix(&v6), "[__]_15001");
    }
}

#[cfg(test)]
mod scope_tests {
    use super::*;

    fn names(store: &Store) -> Vec<String> {
        store.snapshot().into_iter().map(|s| s.name).collect()
    }

    #[test]
    fn a_scopes_stats_are_freed_when_its_last_guard_and_handle_go() {
        let store = Store::new();
        let unscoped = store.counter("server.live");
        unscoped.inc();
        let guard = store.scope("cluster.a.");
        let second = guard.clone();
        let nested = store.scope("cluster.a.b.");
        let held = store.counter("cluster.a.upstream_rq_total");
        held.add(5);
        // Looked up and let go, as a per-request stat is: kept while the scope lives.
        store.counter("cluster.a.grpc.s.m.success").add(3);
        store.counter("cluster.a.b.grpc.s.m.success").add(4);
        drop(guard);
        store.counter("cluster.a.grpc.s.m.success").inc();
        assert_eq!(
            store.counter("cluster.a.grpc.s.m.success").value(),
            4,
            "monotonic while live"
        );
        drop(second);
        // The released scope's unheld stat is gone; the held one stays until dropped;
        // the nested live scope keeps its own.
        assert_eq!(
            names(&store),
            [
                "cluster.a.b.grpc.s.m.success",
                "cluster.a.upstream_rq_total",
                "server.live"
            ]
        );
        drop(held);
        assert_eq!(
            names(&store),
            ["cluster.a.b.grpc.s.m.success", "server.live"]
        );
        drop(nested);
        assert_eq!(names(&store), ["server.live"]);
        assert_eq!(store.len(), 1);
        // Coming back starts afresh.
        let _again = store.scope("cluster.a.");
        assert_eq!(store.counter("cluster.a.upstream_rq_total").value(), 0);
    }

    const SPEC: BlockSpec = &[("rq", Kind::Counter), ("active", Kind::Gauge)];

    #[test]
    fn a_blocks_stats_are_stats_like_any_other() {
        let store = Store::new();
        // Made by name before the block: the block takes it over.
        store.counter("cluster.a.rq").add(2);
        let guard = store.scope("cluster.a.");
        let block = store.block("cluster.a.", SPEC);
        block.counter("rq").inc();
        block.gauge("active").set(4);
        store.counter("cluster.a.other").inc();
        store.counter("z").inc();
        // By name, the block's own stat; the same block again for the same prefix.
        store.counter("cluster.a.rq").inc();
        store.block("cluster.a.", SPEC).counter("rq").inc();
        assert_eq!(
            store.snapshot(),
            [
                Stat::gauge("cluster.a.active", 4),
                Stat::counter("cluster.a.other", 1),
                Stat::counter("cluster.a.rq", 5),
                Stat::counter("z", 1),
            ]
        );
        assert_eq!(store.len(), 4);
        // A name asked for as another kind keeps the block's.
        store.gauge("cluster.a.rq").set(9);
        assert_eq!(store.counter("cluster.a.rq").value(), 5);
        // Released with its scope once its handles go.
        let held = block.counter("rq");
        drop((guard, block));
        assert_eq!(names(&store), ["cluster.a.active", "cluster.a.rq", "z"]);
        drop(held);
        assert_eq!(names(&store), ["z"]);
        let _again = store.scope("cluster.a.");
        assert_eq!(store.block("cluster.a.", SPEC).counter("rq").value(), 0);
    }
}
