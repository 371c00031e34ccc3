//! Every map, BTF-defined so `bpftool map dump` pretty-prints keys and values.
//! Userspace pins them under the bpffs root so all pods share one set.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{
        Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf, SockHash,
    },
    macros::btf_map,
};
use shunt_common::{
    AddrKey, Cidr4, Cidr6, Decision, DnsServerKey, ListenerKey, OriginalDst, PodConfig,
    PodCounterKey, PortKey, SockTuple,
    events::{DecisionEvent, EVENTS_RING_BYTES, PodLabel},
};

/// Network namespace cookie → the pod's capture settings.
#[btf_map]
pub static POD_CONFIG: HashMap<u64, PodConfig, 4096> = HashMap::new();

/// A pod's own address → its settings (self-call detection and `sk_lookup`).
#[btf_map]
pub static POD_ADDRS: HashMap<AddrKey, PodConfig, 16384> = HashMap::new();

/// Excluded/included ports per pod (value unused, 1).
#[btf_map]
pub static POD_PORTS: HashMap<PortKey, u8, 65536> = HashMap::new();

#[btf_map]
pub static CIDR_V4: LpmTrie<Cidr4, u8, 16384> = LpmTrie::new();

#[btf_map]
pub static CIDR_V6: LpmTrie<Cidr6, u8, 16384> = LpmTrie::new();

/// Written at connect (the 4-tuple is not known yet), moved to `ORIG_DST_TUPLE` by
/// sockops. LRU so a socket that never reaches the TCP layer cannot leak an entry.
#[btf_map]
pub static ORIG_DST_COOKIE: LruHashMap<u64, OriginalDst, 65536> = LruHashMap::new();

/// Redirected connection (as its client sees it) → original destination.
#[btf_map]
pub static ORIG_DST_TUPLE: LruHashMap<SockTuple, OriginalDst, 65536> = LruHashMap::new();

/// Each pod's inbound listener, per family, for `sk_lookup` to assign.
#[btf_map]
pub static LISTENERS: SockHash<ListenerKey, 8192> = SockHash::new();

/// One counter per `Decision`.
#[btf_map]
pub static COUNTERS: PerCpuArray<u64, { Decision::COUNT as usize }> = PerCpuArray::new();

/// Local sockets that skip the TCP/IP stack, each under its own 4-tuple (see
/// `shortcircuit.rs`); the `sk_msg` program is attached to this map.
#[btf_map]
pub static SOCK_PAIRS: SockHash<SockTuple, 65536> = SockHash::new();

/// Short-circuited socket (its own 4-tuple) → `pair_state`.
#[btf_map]
pub static PAIR_STATE: LruHashMap<SockTuple, u32, 65536> = LruHashMap::new();

/// Cookies of sockets the proxy connected (uid/gid exempt): candidates for proxy-to-proxy
/// short-circuit across pods.
#[btf_map]
pub static PROXY_SOCKS: LruHashMap<u64, u32, 65536> = LruHashMap::new();

/// The same counters per pod, where the program knows the pod (not per message).
#[btf_map]
pub static POD_COUNTERS: PerCpuHashMap<PodCounterKey, u64, 65536> = PerCpuHashMap::new();

/// Each pod's resolvers (value unused, 1): DNS to them goes to the DNS proxy.
#[btf_map]
pub static DNS_SERVERS: HashMap<DnsServerKey, u8, 16384> = HashMap::new();

/// Socket cookie → the resolver a captured UDP query was sent to, so its reply can
/// show that address again. LRU: UDP sockets have no close hook to clean up after.
#[btf_map]
pub static DNS_ORIG_DST: LruHashMap<u64, OriginalDst, 65536> = LruHashMap::new();

/// Decision events on their way to user space (`events.rs`): bounded, never waited on.
#[btf_map]
pub static EVENTS: RingBuf<DecisionEvent, { EVENTS_RING_BYTES as usize }> = RingBuf::new();

/// `[0]`: the node-wide switch (`shunt_common::events::switch`). Per pod, events are a
/// flag of its `PodConfig`.
#[btf_map]
pub static EVENTS_ON: Array<u32, 1> = Array::new();

/// Events the ring had no room for.
#[btf_map]
pub static EVENTS_DROPPED: PerCpuArray<u64, 1> = PerCpuArray::new();

/// Pod id → its Kubernetes namespace and name, for user space's tools only (node mode
/// writes them; the programs never read them). Not preallocated: most pods of a
/// sidecar node have none.
#[btf_map]
pub static POD_LABELS: HashMap<u32, PodLabel, 4096, { BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

/// Counts `decision` globally and for `pod_id`.
#[inline(always)]
pub fn count_pod(pod_id: u32, decision: Decision) {
    count(decision);
    let key = PodCounterKey {
        pod_id,
        decision: decision as u32,
    };
    match POD_COUNTERS.get_ptr_mut(&key) {
        // SAFETY: this CPU's slot of a per-CPU value.
        Some(n) => unsafe { *n += 1 },
        None => {
            let _ = POD_COUNTERS.insert(&key, &1, 0);
        }
    }
}

#[inline(always)]
pub fn count(decision: Decision) {
    count_n(decision, 1);
}

#[inline(always)]
pub fn count_n(decision: Decision, n: u64) {
    if let Some(counter) = COUNTERS.get_ptr_mut(decision as u32) {
        // SAFETY: per-CPU slot, and programs do not migrate CPUs mid-run.
        unsafe { *counter += n };
    }
}

/// Whether `addr` is one of the pod's own addresses.
#[inline(always)]
pub fn is_pod_addr(addr: shunt_common::Addr, family: u32, pod_id: u32) -> bool {
    let key = AddrKey { addr, family };
    match POD_ADDRS.get_ptr(&key) {
        // SAFETY: a map value pointer from a successful lookup.
        Some(cfg) => unsafe { (*cfg).pod_id == pod_id },
        None => false,
    }
}
