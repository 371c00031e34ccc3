//! Resources interned process-wide: every manager of this process (in node mode, one
//! per pod) that accepts the same resource (same type, same wire bytes) holds the one
//! copy (its bytes, `snapshot::Encoded`, or for Istio's own types the decoded message;
//! an EDS cluster is compiled from its cluster and endpoints where they are: no third
//! copy). A copy lives while any manager or snapshot holds it; the table keeps only
//! weak references, so dropping the last pod that had a resource frees it.
//!
//! The key is the type with the length and xxh64 digest of the resource's bytes (the
//! name is part of the bytes): resources are immutable once accepted, so a pod's update
//! of its copy is a new key and never changes what another pod holds.
//!
//! Only where compiled config is shared ([`shunt_core::interned::sharing_compiled`],
//! node mode): a process of one proxy has no second manager to share with, and the
//! table's entry per resource was a small block kept among its decode's freed ones.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};

/// What an interned value is: an accepted resource of a type (kept as bytes or decoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Kind {
    Decoded(crate::type_url::TypeUrl),
}

type Key = (Kind, usize, u64);

struct Table {
    /// The copy under each key, held in the map itself: a copy is added only under the
    /// lock and when none is live, so a key never has two. foldhash: every pod looks up
    /// each resource of its pushes (digests need no SipHash).
    entries: HashMap<Key, Weak<dyn Any + Send + Sync>, foldhash::fast::FixedState>,
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

/// The value interned under (`kind`, `len`, `digest`), made by `make` (and interned)
/// when no live one is.
pub(super) fn intern<T, E>(
    kind: Kind,
    len: usize,
    digest: u64,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<Arc<T>, E>
where
    T: Send + Sync + 'static,
{
    if !shunt_core::interned::sharing_compiled() {
        return make().map(Arc::new);
    }
    let key = (kind, len, digest);
    if let Some(live) = lookup::<T>(&key) {
        return Ok(live);
    }
    // Made outside the lock: decoding a large resource must not hold up other pods.
    let made = Arc::new(make()?);
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    // Another manager may have made it meanwhile: keep the first, so both share it.
    if let Some(live) = live_in::<T>(&table, &key) {
        return Ok(live);
    }
    let erased: Arc<dyn Any + Send + Sync> = made.clone();
    table.entries.insert(key, Arc::downgrade(&erased));
    if table.entries.len() >= 2 * table.swept_at.max(64) {
        sweep(&mut table);
    }
    Ok(made)
}

fn lookup<T: Send + Sync + 'static>(key: &Key) -> Option<Arc<T>> {
    let table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    live_in(&table, key)
}

/// The live copy under `key`.
fn live_in<T: Send + Sync + 'static>(table: &Table, key: &Key) -> Option<Arc<T>> {
    table.entries.get(key)?.upgrade()?.downcast::<T>().ok()
}

/// Drops the copies no one holds any more.
fn sweep(table: &mut Table) {
    table.entries.retain(|_, weak| weak.strong_count() > 0);
    table.swept_at = table.entries.len();
}

/// How many decoded copies of resources are alive in this process (held by some pod):
/// two pods sharing a push count each resource once, and the count returns to zero
/// once no pod holds any.
pub fn count() -> usize {
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    sweep(&mut table);
    table.entries.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key no other test of this binary uses (the table is process-wide).
    fn key(n: u64) -> (Kind, usize, u64) {
        (
            Kind::Decoded(crate::type_url::TypeUrl::Secret),
            7,
            0x5eed_0000_0000_0000 | n,
        )
    }

    #[test]
    fn equal_keys_share_one_copy_until_the_last_holder_drops_it() {
        shunt_core::interned::share_compiled();
        let (kind, len, digest) = key(1);
        let first = intern(kind, len, digest, || Ok::<_, ()>(String::from("one"))).unwrap();
        let second = intern(kind, len, digest, || -> Result<String, ()> {
            panic!("made twice")
        })
        .unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        let (other_kind, other_len, other_digest) = key(2);
        let other = intern(other_kind, other_len, other_digest, || {
            Ok::<_, ()>(String::from("one"))
        })
        .unwrap();
        assert!(!Arc::ptr_eq(&first, &other), "another key is another copy");
        let weak = Arc::downgrade(&first);
        drop((first, second));
        assert!(
            weak.upgrade().is_none(),
            "the table holds no strong reference"
        );
        // Asked again, it is made again.
        let again = intern(kind, len, digest, || Ok::<_, ()>(String::from("two"))).unwrap();
        assert_eq!(*again, "two");
    }

    #[test]
    fn a_failed_make_interns_nothing() {
        shunt_core::interned::share_compiled();
        let (kind, len, digest) = key(3);
        assert_eq!(
            intern::<String, _>(kind, len, digest, || Err("bad")),
            Err("bad")
        );
        let made = intern(kind, len, digest, || Ok::<_, ()>(String::from("good"))).unwrap();
        assert_eq!(*made, "good");
    }
}
