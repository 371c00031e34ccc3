//! Small config values interned process-wide by content: every holder of an equal value
//! (the endpoints of one workload, each with the same metadata; every endpoint's
//! `tlsMode: istio`; in node mode, every pod with the same cluster) shares one copy.
//! The table keeps only weak references: a value goes with its last holder.
//!
//! A value is found by a digest of its content and then compared, so a digest that
//! misses (or collides) costs a copy, never a wrong value. Compiled config, which cannot
//! be compared, is shared by the digest of its source instead ([`made_once`]). [`metadata_digest`] hashes
//! Envoy metadata in key order: protobuf maps have no order of their own.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, LazyLock, Mutex, Weak};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

type Key = (TypeId, u64);

struct Table {
    /// foldhash: every pod looks up each of its resources here (digests need no SipHash).
    entries: HashMap<Key, Vec<Weak<dyn Any + Send + Sync>>, foldhash::fast::FixedState>,
    /// Entries when dead ones were last dropped: the next sweep waits until the table
    /// has doubled since.
    swept_at: usize,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(|| {
    Mutex::new(Table {
        entries: HashMap::with_hasher(foldhash::fast::FixedState::with_seed(0)),
        swept_at: 0,
    })
});

/// The shared copy of `value` (whose content has `digest`): a live one equal to it, or
/// a new one.
pub fn intern<T>(digest: u64, value: &T) -> Arc<T>
where
    T: Clone + PartialEq + Send + Sync + 'static,
{
    let key = (TypeId::of::<T>(), digest);
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let copies = table.entries.entry(key).or_default();
    copies.retain(|weak| weak.strong_count() > 0);
    if let Some(live) = copies
        .iter()
        .filter_map(|weak| weak.upgrade()?.downcast::<T>().ok())
        .find(|live| **live == *value)
    {
        return live;
    }
    let made = Arc::new(value.clone());
    let erased: Arc<dyn Any + Send + Sync> = made.clone();
    copies.push(Arc::downgrade(&erased));
    if table.entries.len() >= 2 * table.swept_at.max(64) {
        sweep(&mut table);
    }
    made
}

/// Whether [`made_once`] shares: on in a process of many proxies (node mode's pods),
/// off in one of a single proxy, which would only pay for the shared copies.
static SHARE_COMPILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns the sharing of compiled config ([`made_once`]) on for this process.
pub fn share_compiled() {
    SHARE_COMPILED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether compiled config is shared in this process (see [`share_compiled`]).
pub fn sharing_compiled() -> bool {
    SHARE_COMPILED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Compiled config shared process-wide (in node mode, by every pod whose push has it):
/// the value under `key`, made by `make` when no live one is. Unlike [`intern`] nothing
/// is compared: `key` must be a digest of everything `make` reads (the source's bytes),
/// so that a pod's new version of a resource is a new key and never changes what
/// another pod holds. A failed `make` shares nothing: each pod that gets the bad
/// resource refuses it itself. Without [`share_compiled`], every call makes its own.
pub fn made_once<T, E>(key: u64, make: impl FnOnce() -> Result<T, E>) -> Result<Arc<T>, E>
where
    T: Send + Sync + 'static,
{
    if !sharing_compiled() {
        return make().map(Arc::new);
    }
    let key = (TypeId::of::<T>(), key);
    if let Some(live) = live_made(&COMPILED.lock().unwrap_or_else(|e| e.into_inner()), &key) {
        return Ok(live);
    }
    // Made outside the lock: compiling a large resource must not hold up other pods.
    let made = Arc::new(make()?);
    let mut table = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
    // Another pod may have made it meanwhile: keep the first, so both share it.
    if let Some(live) = live_made(&table, &key) {
        return Ok(live);
    }
    let erased: Arc<dyn Any + Send + Sync> = made.clone();
    table.entries.insert(key, Arc::downgrade(&erased));
    if table.entries.len() >= 2 * table.swept_at.max(64) {
        sweep_made(&mut table);
    }
    Ok(made)
}

/// The live value of `T` [`made_once`] made under `key`, if any: nothing is made.
pub fn find<T: Send + Sync + 'static>(key: u64) -> Option<Arc<T>> {
    live_made(
        &COMPILED.lock().unwrap_or_else(|e| e.into_inner()),
        &(TypeId::of::<T>(), key),
    )
}

/// How many values of `T` [`made_once`] made are alive (held by some pod): a debug
/// counter that tells shared compiled config (one per distinct source) from copies.
pub fn live<T: 'static>() -> usize {
    let mut table = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
    sweep_made(&mut table);
    let of_t = TypeId::of::<T>();
    table.entries.keys().filter(|(t, _)| *t == of_t).count()
}

/// [`made_once`]'s values: one per key (nothing is compared, so a key has no second
/// copy), held in the map itself, one memory read fewer per pod's lookup than a list.
struct MadeTable {
    entries: HashMap<Key, Weak<dyn Any + Send + Sync>, foldhash::fast::FixedState>,
    /// As [`Table::swept_at`].
    swept_at: usize,
}

static COMPILED: LazyLock<Mutex<MadeTable>> = LazyLock::new(|| {
    Mutex::new(MadeTable {
        entries: HashMap::with_hasher(foldhash::fast::FixedState::with_seed(0)),
        swept_at: 0,
    })
});

fn live_made<T: Send + Sync + 'static>(table: &MadeTable, key: &Key) -> Option<Arc<T>> {
    table.entries.get(key)?.upgrade()?.downcast::<T>().ok()
}

/// Drops the values of [`made_once`] no one holds any more.
fn sweep_made(table: &mut MadeTable) {
    table.entries.retain(|_, weak| weak.strong_count() > 0);
    table.swept_at = table.entries.len();
}

/// Drops the values no one holds any more, and the keys left with none.
fn sweep(table: &mut Table) {
    table.entries.retain(|_, copies| {
        copies.retain(|weak| weak.strong_count() > 0);
        !copies.is_empty()
    });
    table.swept_at = table.entries.len();
}

/// The shared copy of `metadata`.
pub fn metadata(metadata: &Metadata) -> Arc<Metadata> {
    intern(metadata_digest(metadata), metadata)
}

/// A digest of `metadata` that equal metadata share, whatever the order of its maps.
pub fn metadata_digest(metadata: &Metadata) -> u64 {
    let mut hasher = DefaultHasher::new();
    let mut filters: Vec<_> = metadata.filter_metadata.iter().collect();
    filters.sort_unstable_by(|a, b| a.0.cmp(b.0));
    for (name, fields) in filters {
        name.hash(&mut hasher);
        hash_struct(fields, &mut hasher);
    }
    let mut typed: Vec<_> = metadata.typed_filter_metadata.iter().collect();
    typed.sort_unstable_by(|a, b| a.0.cmp(b.0));
    for (name, any) in typed {
        name.hash(&mut hasher);
        any.type_url.hash(&mut hasher);
        any.value.hash(&mut hasher);
    }
    hasher.finish()
}

fn hash_struct(fields: &Struct, hasher: &mut DefaultHasher) {
    let mut sorted: Vec<_> = fields.fields.iter().collect();
    sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
    sorted.len().hash(hasher);
    for (key, value) in sorted {
        key.hash(hasher);
        hash_value(value, hasher);
    }
}

fn hash_value(value: &Value, hasher: &mut DefaultHasher) {
    match &value.kind {
        None => 0u8.hash(hasher),
        Some(Kind::NullValue(_)) => 1u8.hash(hasher),
        Some(Kind::NumberValue(n)) => (2u8, n.to_bits()).hash(hasher),
        Some(Kind::StringValue(s)) => (3u8, s).hash(hasher),
        Some(Kind::BoolValue(b)) => (4u8, b).hash(hasher),
        Some(Kind::StructValue(s)) => {
            5u8.hash(hasher);
            hash_struct(s, hasher);
        }
        Some(Kind::ListValue(list)) => {
            (6u8, list.values.len()).hash(hasher);
            for v in &list.values {
                hash_value(v, hasher);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata_of(json: serde_json::Value) -> Metadata {
        shunt_config::message_from_json(json).unwrap()
    }

    #[test]
    fn equal_metadata_is_one_copy_until_its_last_holder_goes() {
        let json = serde_json::json!({"filter_metadata": {
            "envoy.transport_socket_match": {"tlsMode": "istio"},
            "istio": {"workload": "w;ns;w;v1;Kubernetes", "n": 1, "l": [true, null, {"a": "b"}]}}});
        // Decoded twice: two maps, each with its own order.
        let (a, b) = (metadata_of(json.clone()), metadata_of(json));
        assert_eq!(metadata_digest(&a), metadata_digest(&b));
        let first = metadata(&a);
        let second = metadata(&b);
        assert!(Arc::ptr_eq(&first, &second));
        let other = metadata(&metadata_of(serde_json::json!({"filter_metadata": {
            "istio": {"workload": "x"}}})));
        assert!(!Arc::ptr_eq(&first, &other));
        let weak = Arc::downgrade(&first);
        drop((first, second));
        assert!(
            weak.upgrade().is_none(),
            "the table holds no strong reference"
        );
    }

    #[test]
    fn made_once_shares_by_key_until_the_last_holder_drops_it() {
        share_compiled();
        struct Compiled(&'static str);
        let first = made_once(0xc0de_0001, || Ok::<_, ()>(Compiled("one"))).unwrap();
        let second = made_once(0xc0de_0001, || -> Result<Compiled, ()> {
            panic!("made twice")
        })
        .unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(live::<Compiled>(), 1);
        assert!(find::<Compiled>(0xc0de_0001).is_some_and(|found| Arc::ptr_eq(&found, &first)));
        assert!(find::<Compiled>(0xc0de_0003).is_none());
        assert!(made_once(0xc0de_0002, || Err::<Compiled, _>("bad")).is_err());
        assert_eq!(live::<Compiled>(), 1, "a failed make shares nothing");
        drop((first, second));
        assert_eq!(live::<Compiled>(), 0);
        let again = made_once(0xc0de_0001, || Ok::<_, ()>(Compiled("two"))).unwrap();
        assert_eq!(again.0, "two");
    }

    #[test]
    fn a_digest_that_collides_still_compares_the_values() {
        let one = intern(7, &String::from("one"));
        let two = intern(7, &String::from("two"));
        assert_eq!((one.as_str(), two.as_str()), ("one", "two"));
        assert!(Arc::ptr_eq(&one, &intern(7, &String::from("one"))));
    }
}
