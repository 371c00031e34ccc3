//! What capture has installed, read back from the pinned maps and links: the pods, their
//! settings and counters, live redirected connections and short-circuited sockets
//! (`shunt inspect`). It only reads; installing is [`crate::ebpf`]'s.

use std::path::{Path, PathBuf};

use aya::maps::{MapData, PerCpuArray, PerCpuHashMap, SockHash};
use shunt_common::{
    AF_INET, Addr, AddrKey, Decision, DnsServerKey, ListenerKey, OriginalDst, PodConfig,
    PodCounterKey, SockTuple, flags, pins,
};

use crate::{
    bpffs::{Maps, pod_dir, words_addr},
    link, netns,
};

/// Every decision counter, summed over CPUs; `None` when nothing is installed.
pub fn counters(root: &Path) -> anyhow::Result<Option<Vec<(Decision, u64)>>> {
    let path = root.join(pins::COUNTERS);
    if !path.exists() {
        return Ok(None);
    }
    let maps = Maps { root };
    let arr: PerCpuArray<MapData, u64> = PerCpuArray::try_from(maps.map(pins::COUNTERS)?)?;
    let mut out = Vec::new();
    for d in Decision::ALL {
        let v = arr.get(&(d as u32), 0)?;
        out.push((d, v.iter().sum()));
    }
    Ok(Some(out))
}

/// One captured pod as the maps describe it.
#[derive(Debug, serde::Serialize)]
pub struct PodState {
    pub pod: String,
    /// `namespace/name`, when whoever enrolled the pod said (node mode does).
    pub name: Option<String>,
    /// Whether this pod reports its decisions (`shunt inspect --events on --pod`).
    pub events: bool,
    pub netns_cookie: u64,
    pub outbound_port: u16,
    pub inbound_port: u16,
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    pub addresses: Vec<String>,
    /// Each pinned link: the program and where it is attached.
    pub links: Vec<String>,
    pub inbound_listeners: Vec<String>,
    /// `off`, `resolvers` (`--redirect-dns`) or `all` (`--capture-all-dns`).
    pub dns_capture: &'static str,
    /// The resolvers whose DNS goes to the DNS proxy.
    pub dns_servers: Vec<String>,
    /// This pod's non-zero decision counters (all but the per-message sk_msg ones).
    pub counters: Vec<(String, u64)>,
}

/// A live redirected connection and where it was going.
#[derive(Debug, serde::Serialize)]
pub struct RedirectedConnection {
    pub pod: String,
    pub client: String,
    pub proxy_listener: String,
    pub original_dst: String,
    pub direction: &'static str,
}

/// A socket short-circuited right now, as its sends see the pair.
#[derive(Debug, serde::Serialize)]
pub struct ShortCircuitedSocket {
    pub local: String,
    pub remote: String,
    /// `undecided` (nothing sent yet), `redirect` or `fallback` (TCP).
    pub state: &'static str,
}

/// A pinned map as the kernel describes it.
#[derive(Debug, serde::Serialize)]
pub struct PinnedMap {
    pub pin: String,
    pub id: u32,
    pub kind: String,
    pub max_entries: u32,
}

/// The decision events' switch and ring, node-wide.
#[derive(Debug, serde::Serialize)]
pub struct EventsState {
    /// Every decision on the node reports (`shunt inspect --events on`).
    pub node_wide: bool,
    /// Records the ring had no room for, since the maps were created.
    pub dropped: u64,
}

#[derive(Debug, serde::Serialize)]
pub struct State {
    pub bpffs: String,
    pub events: EventsState,
    pub maps: Vec<PinnedMap>,
    pub pods: Vec<PodState>,
    pub counters: Vec<(String, u64)>,
    pub connections: Vec<RedirectedConnection>,
    /// Sockets in SOCK_PAIRS (bpftool cannot dump a SOCKHASH, so shunt counts them).
    pub sockmap_sockets: usize,
    pub short_circuited: Vec<ShortCircuitedSocket>,
}

fn pod_counters(maps: &Maps<'_>, pod_id: u32) -> Vec<(String, u64)> {
    let Ok(map) = maps.map(pins::POD_COUNTERS) else {
        return Vec::new();
    };
    let Ok(per_pod) = PerCpuHashMap::<MapData, PodCounterKey, u64>::try_from(map) else {
        return Vec::new();
    };
    Decision::ALL
        .iter()
        .filter_map(|d| {
            let key = PodCounterKey {
                pod_id,
                decision: *d as u32,
            };
            let n: u64 = per_pod.get(&key, 0).ok()?.iter().sum();
            (n > 0).then(|| (d.name().to_string(), n))
        })
        .collect()
}

/// "program → where" for every link pinned in a pod's folder, asked of the kernel.
fn attached_links(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut links: Vec<String> = entries
        .filter_map(Result::ok)
        // The loader's aya-log ring is pinned beside its links.
        .filter(|e| e.file_name() != pins::AYA_LOGS)
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let target = match link::pinned_target(&e.path()) {
                Ok(link::Target::Cgroup(id)) => cgroup_path(id).map_or_else(
                    || format!("cgroup id {id}"),
                    |p| format!("cgroup {}", p.display()),
                ),
                Ok(link::Target::Netns(ino)) => format!("netns {ino}"),
                Ok(link::Target::Other) => "?".into(),
                Err(err) => format!("unreadable: {err}"),
            };
            format!("{name} -> {target}")
        })
        .collect();
    links.sort();
    links
}

/// The cgroup v2 directory whose inode number is `id` (that is what a cgroup id is).
fn cgroup_path(id: u64) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut stack = vec![netns::cgroup2_mount()?];
    while let Some(dir) = stack.pop() {
        if std::fs::metadata(&dir).is_ok_and(|m| m.ino() == id) {
            return Some(dir);
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            stack.extend(
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    None
}

fn sockaddr(addr: &Addr, family: u32, port: u16) -> String {
    std::net::SocketAddr::new(words_addr(addr, family), port).to_string()
}

/// Everything the pinned maps say, for `shunt inspect`.
pub fn state(root: &Path) -> anyhow::Result<Option<State>> {
    let Some(counters) = counters(root)? else {
        return Ok(None);
    };
    let maps = Maps { root };
    let config = maps.hash::<u64, PodConfig>(pins::POD_CONFIG)?;
    let addrs = maps.hash::<AddrKey, PodConfig>(pins::POD_ADDRS)?;
    let listeners = SockHash::<MapData, ListenerKey>::try_from(maps.map(pins::LISTENERS)?)?;
    let listener_keys: Vec<ListenerKey> = listeners.keys().filter_map(Result::ok).collect();
    let dns_servers: Vec<DnsServerKey> = maps
        .hash::<DnsServerKey, u8>(pins::DNS_SERVERS)?
        .keys()
        .filter_map(Result::ok)
        .collect();
    let labels = crate::pod_names::all(root);
    let mut pods = Vec::new();
    for (cookie, pc) in config.iter().filter_map(Result::ok) {
        let links = attached_links(&pod_dir(root, pc.pod_id));
        pods.push(PodState {
            pod: format!("pod_{}", pc.pod_id),
            name: labels.get(&pc.pod_id).cloned(),
            events: pc.flags & flags::EVENTS != 0,
            netns_cookie: cookie,
            outbound_port: pc.outbound_port,
            inbound_port: pc.inbound_port,
            proxy_uid: pc.proxy_uid,
            proxy_gid: pc.proxy_gid,
            addresses: addrs
                .iter()
                .filter_map(Result::ok)
                .filter(|(_, v)| v.pod_id == pc.pod_id)
                .map(|(k, _)| words_addr(&k.addr, k.family).to_string())
                .collect(),
            links,
            dns_capture: match (
                pc.flags & flags::DNS_REDIRECT != 0,
                pc.flags & flags::DNS_CAPTURE_ALL != 0,
            ) {
                (false, _) => "off",
                (true, false) => "resolvers",
                (true, true) => "all",
            },
            dns_servers: dns_servers
                .iter()
                .filter(|k| k.pod_id == pc.pod_id)
                .map(|k| words_addr(&k.addr, k.family).to_string())
                .collect(),
            counters: pod_counters(&maps, pc.pod_id),
            inbound_listeners: listener_keys
                .iter()
                .filter(|k| k.pod_id == pc.pod_id)
                .map(|k| {
                    if k.family == AF_INET {
                        "ipv4".into()
                    } else {
                        "ipv6".into()
                    }
                })
                .collect(),
        });
    }
    let tuples = maps.hash::<SockTuple, OriginalDst>(pins::ORIG_DST_TUPLE)?;
    let connections = tuples
        .iter()
        .filter_map(Result::ok)
        .map(|(t, o)| RedirectedConnection {
            pod: format!("pod_{}", o.pod_id),
            client: sockaddr(&t.src, t.family, t.src_port),
            proxy_listener: sockaddr(&t.dst, t.family, t.dst_port),
            original_dst: sockaddr(&o.addr, o.family, u16::from_be(o.port)),
            direction: if o.direction == shunt_common::direction::INBOUND {
                "inbound"
            } else {
                "outbound"
            },
        })
        .collect();
    let sock_pairs = SockHash::<MapData, SockTuple>::try_from(maps.map(pins::SOCK_PAIRS)?)?;
    let sockmap_sockets = sock_pairs.keys().filter(Result::is_ok).count();
    let states = maps.hash::<SockTuple, u32>(pins::PAIR_STATE)?;
    let short_circuited = states
        .iter()
        .filter_map(Result::ok)
        .map(|(k, s)| ShortCircuitedSocket {
            local: sockaddr(&k.src, k.family, k.src_port),
            remote: sockaddr(&k.dst, k.family, k.dst_port),
            state: match s {
                shunt_common::pair_state::REDIRECT => "redirect",
                shunt_common::pair_state::FALLBACK => "fallback",
                _ => "undecided",
            },
        })
        .collect();
    let pinned = pins::MAPS
        .iter()
        .filter_map(|name| {
            let path = root.join(name);
            let info = aya::maps::MapInfo::from_pin(&path).ok()?;
            Some(PinnedMap {
                pin: path.display().to_string(),
                id: info.id(),
                kind: info
                    .map_type()
                    .map_or_else(|e| e.to_string(), |t| format!("{t:?}")),
                max_entries: info.max_entries(),
            })
        })
        .collect();
    Ok(Some(State {
        bpffs: root.display().to_string(),
        events: EventsState {
            node_wide: crate::events::node_wide(root).unwrap_or(false),
            dropped: crate::events::dropped(root).unwrap_or(0),
        },
        maps: pinned,
        pods,
        counters: counters
            .into_iter()
            .map(|(d, n)| (d.name().to_string(), n))
            .collect(),
        connections,
        sockmap_sockets,
        short_circuited,
    }))
}
