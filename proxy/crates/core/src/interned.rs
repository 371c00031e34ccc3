//! Small config values interned process-wide by content: every holder of an equal value
//! (the endpoints of one workload, each with the same metadata; every endpoint's
//! `tlsMode: istio`; in node mode, every pod with the same cluster) shares one copy.
//! The table keeps only weak references: a value goes with its last holder.
//!
//! A value is found by a digest of its content and then compared, so a digest that
//! misses (or collides) costs a copy, never a wrong value. Compiled config, which cannot
//! be compared, is shared by the digest of its source instead ([`made_once`]). Envoy
//! metadata is kept encoded ([`EncodedMetadata`]) with its maps in key order (protobuf
//! maps have no order of their own), and shared by its bytes.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, Weak};

use envoy_types::pb::envoy::config::core::v3::Metadata;

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

/// Envoy metadata as a process keeps it: its protobuf bytes, map keys in order, decoded
/// on first use. Decoded, a cluster's `istio` metadata and each endpoint's are a score of
/// blocks (a protobuf `Struct` is a hash map of boxed values): 2.2 KiB per service of a
/// sidecar's heap, for the few clusters whose metadata anything reads (a request's
/// stats or access log, the peer's workload). As bytes they are one block of about 150.
/// Equal metadata have equal bytes, whatever the order its maps were decoded in: they
/// are compared, hashed and shared by them.
pub struct EncodedMetadata {
    bytes: Box<[u8]>,
    decoded: OnceLock<Metadata>,
}

impl EncodedMetadata {
    pub fn new(metadata: &Metadata) -> Self {
        EncodedMetadata {
            bytes: canonical::metadata(metadata).into(),
            decoded: OnceLock::new(),
        }
    }

    /// What a holder's optional metadata decodes to.
    pub fn of(metadata: &Option<Arc<EncodedMetadata>>) -> Option<&Metadata> {
        metadata.as_deref().map(EncodedMetadata::decoded)
    }

    /// The metadata, decoded now if it was not.
    pub fn decoded(&self) -> &Metadata {
        use prost::Message;
        // Bytes this process encoded: they decode.
        self.decoded
            .get_or_init(|| Metadata::decode(&*self.bytes).unwrap_or_default())
    }
}

impl std::ops::Deref for EncodedMetadata {
    type Target = Metadata;

    fn deref(&self) -> &Metadata {
        self.decoded()
    }
}

impl Clone for EncodedMetadata {
    fn clone(&self) -> Self {
        EncodedMetadata {
            bytes: self.bytes.clone(),
            decoded: OnceLock::new(),
        }
    }
}

impl PartialEq for EncodedMetadata {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for EncodedMetadata {}

impl std::fmt::Debug for EncodedMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.decoded().fmt(f)
    }
}

/// The shared copy of `metadata`, encoded.
pub fn metadata(metadata: &Metadata) -> Arc<EncodedMetadata> {
    let encoded = EncodedMetadata::new(metadata);
    let mut hasher = DefaultHasher::new();
    encoded.bytes.hash(&mut hasher);
    intern(hasher.finish(), &encoded)
}

/// Protobuf's encoding of metadata with every map's keys in order (prost writes a map in
/// its hash order, which differs between two decodes of the same bytes).
mod canonical {
    use crate::proto::{encode_struct, map_entry};
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use prost::Message;

    pub(super) fn metadata(metadata: &Metadata) -> Vec<u8> {
        let mut out = Vec::new();
        let mut filters: Vec<_> = metadata.filter_metadata.iter().collect();
        filters.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (name, fields) in filters {
            map_entry(1, name, &encode_struct(fields), &mut out);
        }
        let mut typed: Vec<_> = metadata.typed_filter_metadata.iter().collect();
        typed.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (name, any) in typed {
            map_entry(2, name, &any.encode_to_vec(), &mut out);
        }
        out
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
        assert_eq!(EncodedMetadata::new(&a), EncodedMetadata::new(&b));
        let first = metadata(&a);
        let second = metadata(&b);
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(*first.decoded(), a, "decodes to what it was made of");
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

    /// Metadata is kept encoded with its keys in order: two decodes of one document (two
    /// hash maps, each in its own order) give the same bytes, which decode to it again.
    #[test]
    fn encoded_metadata_is_the_same_bytes_whatever_its_maps_order() {
        let fields: serde_json::Map<String, serde_json::Value> = (0..16)
            .map(|i| {
                (
                    format!("k{i}"),
                    serde_json::json!({"n": i, "s": "v", "l": [i, {"x": false}]}),
                )
            })
            .collect();
        let json = serde_json::json!({"filter_metadata": {"a": fields.clone(), "b": fields}});
        let decodes: Vec<Metadata> = (0..4).map(|_| metadata_of(json.clone())).collect();
        let encoded: Vec<EncodedMetadata> = decodes.iter().map(EncodedMetadata::new).collect();
        for (e, d) in encoded.iter().zip(&decodes) {
            assert_eq!(*e, encoded[0]);
            assert_eq!(e.decoded(), d);
        }
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
