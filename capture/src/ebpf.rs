//! The eBPF backend: loads shunt's programs, pins the shared maps under the bpffs root,
//! writes the pod's settings, attaches connect4/6, getsockopt and sockops (and with DNS
//! capture sendmsg4/6 and recvmsg4/6) to the pod's cgroup and sk_lookup to its network
//! namespace, pinning each link under
//! `<root>/pods/pod_<netns inode>/` so capture outlives this process. Anything that
//! fails part-way is rolled back.

use std::{
    fs::File,
    net::IpAddr,
    os::fd::{AsFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use aya::{
    Ebpf, EbpfLoader, Pod,
    maps::{HashMap, LpmTrie, MapData, PerCpuHashMap, SockHash, lpm_trie::Key},
};
use ipnet::IpNet;
use shunt_common::{
    Addr, AddrKey, CIDR_KEY_PREFIX_BITS, Cidr4, Cidr6, Decision, DnsServerKey, ListenerKey,
    OriginalDst, PodConfig, PodCounterKey, PortKey, SockTuple, cidr_kind, events::PodLabel, flags,
    pins, port_kind,
};

use crate::{
    bpffs::{Maps, addr_words, pod_dir},
    config::{CaptureConfig, CidrSet, PortSet},
    link, netns,
};

/// The eBPF object `build.rs` built from `../ebpf` (the eBPF crate's binary is `shunt`).
#[cfg(not(shunt_no_ebpf))]
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/shunt"));
/// Built without the eBPF toolchain: no programs (see [`built_with_programs`]).
#[cfg(shunt_no_ebpf)]
static OBJECT: &[u8] = &[];

/// Why this build has no eBPF programs, when it has none (set by `build.rs`).
const MISSING_REASON: Option<&str> = option_env!("SHUNT_EBPF_MISSING");

/// Whether this shunt carries its eBPF programs; if not, an error saying why and what to do.
pub fn built_with_programs() -> anyhow::Result<()> {
    if OBJECT.is_empty() {
        bail!(
            "this shunt was built without its eBPF programs ({}): run `cargo xtask setup` and rebuild, or use --backend iptables",
            MISSING_REASON.unwrap_or("no eBPF object at build time")
        );
    }
    Ok(())
}

/// Program name (the fn in ebpf/) and where it attaches.
const CGROUP_PROGRAMS: [(&str, u32); 4] = [
    ("capture_connect4", link::BPF_CGROUP_INET4_CONNECT),
    ("capture_connect6", link::BPF_CGROUP_INET6_CONNECT),
    ("original_dst", link::BPF_CGROUP_GETSOCKOPT),
    ("track_sockets", link::BPF_CGROUP_SOCK_OPS),
];
/// DNS capture's UDP half, attached only with `--redirect-dns` (they see every datagram).
const DNS_PROGRAMS: [(&str, u32); 4] = [
    ("capture_dns4", link::BPF_CGROUP_UDP4_SENDMSG),
    ("capture_dns6", link::BPF_CGROUP_UDP6_SENDMSG),
    ("restore_dns_reply4", link::BPF_CGROUP_UDP4_RECVMSG),
    ("restore_dns_reply6", link::BPF_CGROUP_UDP6_RECVMSG),
];
pub(crate) const NETNS_PROGRAM: &str = "steer_inbound";

/// The cgroup programs this configuration attaches, in order.
pub(crate) fn cgroup_programs(cfg: &CaptureConfig) -> Vec<(&'static str, u32)> {
    let dns = if cfg.dns.redirect {
        &DNS_PROGRAMS[..]
    } else {
        &[]
    };
    CGROUP_PROGRAMS.iter().chain(dns).copied().collect()
}
const SK_MSG_PROGRAM: &str = "short_circuit";

/// The pod `shunt capture` runs in.
#[derive(Debug, Clone)]
pub struct PodIdentity {
    pub id: u32,
    pub netns_cookie: u64,
    pub addresses: Vec<IpAddr>,
}

impl PodIdentity {
    pub fn current() -> anyhow::Result<Self> {
        Ok(PodIdentity {
            id: netns::netns_inode().context("reading /proc/self/ns/net")?,
            netns_cookie: netns::netns_cookie()
                .context("SO_NETNS_COOKIE (needs Linux 5.14 or later)")?,
            addresses: netns::pod_addresses().context("listing this namespace's addresses")?,
        })
    }
}

pub(crate) fn pod_config(cfg: &CaptureConfig, pod: &PodIdentity, extra_flags: u32) -> PodConfig {
    let mut f = extra_flags;
    if cfg.sockmap {
        f |= flags::SOCKMAP;
    }
    if cfg.outbound_include == CidrSet::All {
        f |= flags::OUTBOUND_ALL_V4 | flags::OUTBOUND_ALL_V6;
    }
    if cfg.dns.redirect {
        f |= flags::DNS_REDIRECT;
        if cfg.dns.capture_all {
            f |= flags::DNS_CAPTURE_ALL;
        }
    }
    match &cfg.inbound_include {
        PortSet::All => f |= flags::INBOUND | flags::INBOUND_ALL_PORTS,
        PortSet::Only(p) if !p.is_empty() => f |= flags::INBOUND,
        PortSet::Only(_) => {}
    }
    // The pod's primary addresses (link-local IPv6 is not a usable source for the app).
    let v4 = pod.addresses.iter().find(|a| a.is_ipv4());
    let v6 = pod.addresses.iter().find(|a| match a {
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
        IpAddr::V4(_) => false,
    });
    PodConfig {
        pod_id: pod.id,
        proxy_uid: cfg.proxy_uid,
        proxy_gid: cfg.proxy_gid,
        outbound_port: cfg.proxy_port,
        inbound_port: cfg.inbound_capture_port,
        flags: f,
        addr_v4: v4.map_or(0, |a| addr_words(a).0[0]),
        addr_v6: v6.map_or([0; 4], |a| addr_words(a).0),
    }
}

/// What `--dry-run` prints for this backend.
pub fn plan(cfg: &CaptureConfig, cgroup: Option<&Path>, root: &Path) -> anyhow::Result<String> {
    let pod = PodIdentity::current()?;
    let pc = pod_config(cfg, &pod, 0);
    let mut out = String::new();
    out.push_str(&format!(
        "# eBPF capture for pod_{} (netns cookie {})\n",
        pod.id, pod.netns_cookie
    ));
    if let Err(err) = built_with_programs() {
        out.push_str(&format!("# {err}\n"));
    }
    let cg = cgroup.map_or("<--cgroup required>".into(), |c| c.display().to_string());
    for (prog, _) in cgroup_programs(cfg) {
        out.push_str(&format!("attach {prog} to cgroup {cg}\n"));
    }
    out.push_str(&format!(
        "attach {NETNS_PROGRAM} to this network namespace\n"
    ));
    out.push_str(&format!(
        "pin maps under {} and links under {}\n",
        root.display(),
        pod_dir(root, pod.id).display()
    ));
    out.push_str(&format!("POD_CONFIG[{}] = {pc:?}\n", pod.netns_cookie));
    for a in &pod.addresses {
        out.push_str(&format!("POD_ADDRS[{a}] = pod_{}\n", pod.id));
    }
    for p in cfg
        .inbound_exclusions()
        .iter()
        .filter(|_| matches!(cfg.inbound_include, PortSet::All))
    {
        out.push_str(&format!("POD_PORTS[{p}] = inbound exclude\n"));
    }
    if let PortSet::Only(ports) = &cfg.inbound_include {
        for p in ports {
            out.push_str(&format!("POD_PORTS[{p}] = inbound include\n"));
        }
    }
    for p in &cfg.outbound_ports_exclude {
        out.push_str(&format!("POD_PORTS[{p}] = outbound exclude\n"));
    }
    for c in &cfg.outbound_exclude {
        out.push_str(&format!("CIDR[{c}] = exclude\n"));
    }
    if let CidrSet::Only(cidrs) = &cfg.outbound_include {
        for c in cidrs {
            out.push_str(&format!("CIDR[{c}] = include\n"));
        }
    }
    if cfg.dns.redirect {
        out.push_str(&format!(
            "DNS (UDP and TCP) to port 53 of {} -> 127.0.0.1/::1 port {}\n",
            if cfg.dns.capture_all {
                "any address"
            } else {
                "the pod's resolvers"
            },
            shunt_common::DNS_PROXY_PORT
        ));
        for s in &cfg.dns.servers {
            out.push_str(&format!("DNS_SERVERS[{s}] = pod_{}\n", pod.id));
        }
    }
    Ok(out)
}

/// Installs capture for the current network namespace, or leaves nothing behind.
pub fn install(cfg: &CaptureConfig, cgroup: &Path, root: &Path) -> anyhow::Result<PodIdentity> {
    built_with_programs()?;
    netns::check_cgroup2_dir(cgroup)?;
    netns::ensure_bpffs(root)?;
    check_pinned_maps(root)?;
    let pod = PodIdentity::current()?;
    let dir = pod_dir(root, pod.id);
    if dir.exists() {
        bail!(
            "capture is already installed for this network namespace ({}); run `shunt capture --cleanup` first",
            dir.display()
        );
    }
    let result = install_pod(cfg, cgroup, root, &pod);
    if let Err(err) = result {
        let _ = cleanup_pod(root, &pod);
        return Err(err.context("eBPF capture rolled back"));
    }
    Ok(pod)
}

fn install_pod(
    cfg: &CaptureConfig,
    cgroup: &Path,
    root: &Path,
    pod: &PodIdentity,
) -> anyhow::Result<()> {
    let dir = pod_dir(root, pod.id);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut bpf = load(root, &dir, Loader::Pod)?;
    write_config(root, cfg, pod, 0)?;
    if let Some(label) = crate::pod_names::from_environment() {
        crate::pod_names::write(root, pod.id, &label)?;
    }
    let cgroup_fd = File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
    let netns_fd = File::open("/proc/thread-self/ns/net")?;
    for (name, attach_type) in cgroup_programs(cfg) {
        let prog_fd = load_program(&mut bpf, name)?;
        let link = link::create(prog_fd.as_fd(), cgroup_fd.as_fd(), attach_type)
            .with_context(|| format!("attaching {name} to cgroup {}", cgroup.display()))?;
        link::pin(&link, &dir.join(name)).with_context(|| format!("pinning link {name}"))?;
    }
    attach_sk_msg(&mut bpf, root)?;
    let prog_fd = load_program(&mut bpf, NETNS_PROGRAM)?;
    let link = link::create(prog_fd.as_fd(), netns_fd.as_fd(), link::BPF_SK_LOOKUP)
        .context("attaching sk_lookup to this network namespace")?;
    link::pin(&link, &dir.join(NETNS_PROGRAM)).context("pinning the sk_lookup link")?;
    Ok(())
}

/// Attaches the short-circuit's sk_msg program to the shared SOCK_PAIRS map whatever
/// the pod's setting: the per-pod SOCKMAP flag decides which sockets join, so the
/// runtime switch needs no reload.
pub(crate) fn attach_sk_msg(bpf: &mut Ebpf, root: &Path) -> anyhow::Result<()> {
    let prog_fd = load_program(bpf, SK_MSG_PROGRAM)?;
    let map = MapData::from_pin(root.join(pins::SOCK_PAIRS)).context("opening SOCK_PAIRS")?;
    link::attach_to_map(prog_fd.as_fd(), map.fd().as_fd(), link::BPF_SK_MSG_VERDICT)
        .context("attaching the sk_msg program to SOCK_PAIRS")
}

/// Loads one program into the kernel (the verifier runs here) and returns its fd.
pub(crate) fn load_program(bpf: &mut Ebpf, name: &str) -> anyhow::Result<OwnedFd> {
    use aya::programs::Program;
    let prog = bpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?;
    let refused = || {
        format!(
            "the kernel refused to load program {name} (needs CAP_BPF + CAP_NET_ADMIN and Linux 5.15+)"
        )
    };
    // Only the load is per type; the fd comes from the program whatever its type.
    match prog {
        Program::CgroupSockAddr(p) => p.load(),
        Program::CgroupSockopt(p) => p.load(),
        Program::SockOps(p) => p.load(),
        Program::SkLookup(p) => p.load(),
        Program::SkMsg(p) => p.load(),
        other => bail!("program {name} has unexpected type {:?}", other.prog_type()),
    }
    .with_context(refused)?;
    let fd = prog.fd()?.as_fd().try_clone_to_owned()?;
    Ok(fd)
}

/// Key and value sizes of every map, as this build defines them (LPM keys carry a 4-byte
/// prefix length; SOCKHASH values are socket fds).
fn expected_map_sizes() -> [(&'static str, usize, usize); 19] {
    use std::mem::size_of as sz;
    [
        (pins::POD_CONFIG, sz::<u64>(), sz::<PodConfig>()),
        (pins::POD_ADDRS, sz::<AddrKey>(), sz::<PodConfig>()),
        (pins::POD_PORTS, sz::<PortKey>(), 1),
        (pins::CIDR_V4, 4 + sz::<Cidr4>(), 1),
        (pins::CIDR_V6, 4 + sz::<Cidr6>(), 1),
        (pins::ORIG_DST_COOKIE, sz::<u64>(), sz::<OriginalDst>()),
        (pins::ORIG_DST_TUPLE, sz::<SockTuple>(), sz::<OriginalDst>()),
        (pins::LISTENERS, sz::<ListenerKey>(), 4),
        (pins::COUNTERS, 4, 8),
        (pins::SOCK_PAIRS, sz::<SockTuple>(), 4),
        (pins::PAIR_STATE, sz::<SockTuple>(), 4),
        (pins::PROXY_SOCKS, 8, 4),
        (pins::POD_COUNTERS, sz::<PodCounterKey>(), 8),
        (pins::DNS_SERVERS, sz::<DnsServerKey>(), 1),
        (pins::DNS_ORIG_DST, sz::<u64>(), sz::<OriginalDst>()),
        (pins::EVENTS, 0, 0),
        (pins::EVENTS_ON, 4, 4),
        (pins::EVENTS_DROPPED, 4, 8),
        (pins::POD_LABELS, 4, sz::<PodLabel>()),
    ]
}

/// Maps whose number of entries is part of the layout: COUNTERS has one per decision.
fn expected_max_entries() -> [(&'static str, u32); 2] {
    [
        (pins::COUNTERS, Decision::COUNT),
        (pins::EVENTS, shunt_common::events::EVENTS_RING_BYTES),
    ]
}

/// Maps pinned by another shunt build with other layouts would be reused silently and
/// misread: refuse, before anything is installed, and say how to recover.
pub(crate) fn check_pinned_maps(root: &Path) -> anyhow::Result<()> {
    for (name, key, value) in expected_map_sizes() {
        let path = root.join(name);
        if !path.exists() {
            continue;
        }
        let info = aya::maps::MapInfo::from_pin(&path)
            .with_context(|| format!("reading pinned map {}", path.display()))?;
        let (k, v) = (info.key_size() as usize, info.value_size() as usize);
        if (k, v) != (key, value) {
            bail!(
                "{} was pinned by an incompatible shunt (key {k} B, value {v} B; this build \
                 expects {key} B and {value} B): run `shunt capture --cleanup` with the old \
                 version in every pod, or remove {}",
                path.display(),
                root.display()
            );
        }
    }
    for (name, entries) in expected_max_entries() {
        let path = root.join(name);
        let Ok(info) = aya::maps::MapInfo::from_pin(&path) else {
            continue;
        };
        if info.max_entries() != entries {
            bail!(
                "{} was pinned by an incompatible shunt ({} entries; this build expects \
                 {entries}): run `shunt capture --cleanup` with the old version in every pod, \
                 or remove {}",
                path.display(),
                info.max_entries(),
                root.display()
            );
        }
    }
    Ok(())
}

/// Who loads the programs: where their aya-log ring is pinned (see `pins::AYA_LOGS`)
/// and whether they sit above pods that are not enrolled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Loader {
    /// `shunt capture`: one pod's programs, attached to that pod's cgroup.
    Pod,
    /// `shunt node`: the node's programs, attached above every pod.
    Node,
}

/// Loads the object; maps already pinned under `root` are reused, so every pod shares
/// them. The aya-log ring is pinned in `own_dir` (the loader's folder: the pod's or the
/// node's), so the process that reads it sees its own programs' records only, and a
/// program loaded later by the same owner (node mode after a restart) writes to the
/// same ring.
pub(crate) fn load(root: &Path, own_dir: &Path, loader_kind: Loader) -> anyhow::Result<Ebpf> {
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let paths: Vec<(&str, PathBuf)> = pins::MAPS.iter().map(|m| (*m, root.join(m))).collect();
    let log_pin = own_dir.join(pins::AYA_LOGS);
    let mut loader = EbpfLoader::new();
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader.map_pin_path(pins::AYA_LOGS, log_pin.as_path());
    let node_mode = u8::from(loader_kind == Loader::Node);
    loader.override_global("SHUNT_NODE_MODE", &node_mode, true);
    loader.load(OBJECT).map_err(|e| {
        let hint = if format!("{e:?}").contains("PermissionDenied")
            || format!("{e:?}").contains("EPERM")
        {
            " (needs CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN, or root)"
        } else {
            ""
        };
        anyhow::anyhow!(
            "loading the eBPF object and its maps under {}{hint}: {e}",
            root.display()
        )
    })
}

/// The prefix's network address (host bits cleared), as the LPM key wants it.
fn masked(cidr: &IpNet) -> Addr {
    addr_words(&cidr.network()).0
}

pub(crate) fn write_config(
    root: &Path,
    cfg: &CaptureConfig,
    pod: &PodIdentity,
    extra_flags: u32,
) -> anyhow::Result<()> {
    let maps = Maps { root };
    // A pod enrolled again (node mode after a restart) keeps its events switch.
    let events_on = maps
        .hash::<u64, PodConfig>(pins::POD_CONFIG)?
        .get(&pod.netns_cookie, 0)
        .is_ok_and(|old| old.pod_id == pod.id && old.flags & flags::EVENTS != 0);
    let extra_flags = extra_flags | if events_on { flags::EVENTS } else { 0 };
    let pc = pod_config(cfg, pod, extra_flags);
    let mut addrs = maps.hash::<AddrKey, PodConfig>(pins::POD_ADDRS)?;
    for ip in &pod.addresses {
        let (addr, family) = addr_words(ip);
        addrs
            .insert(AddrKey { addr, family }, pc, 0)
            .with_context(|| format!("POD_ADDRS[{ip}]"))?;
    }
    let mut ports = maps.hash::<PortKey, u8>(pins::POD_PORTS)?;
    let mut put_port = |port: u16, kind: u16| {
        ports
            .insert(
                PortKey {
                    pod_id: pod.id,
                    port,
                    kind,
                },
                1,
                0,
            )
            .with_context(|| format!("POD_PORTS[{port}]"))
    };
    match &cfg.inbound_include {
        PortSet::All => {
            for p in cfg.inbound_exclusions() {
                put_port(p, port_kind::INBOUND_EXCLUDE)?;
            }
        }
        PortSet::Only(list) => {
            for &p in list {
                put_port(p, port_kind::INBOUND_INCLUDE)?;
            }
        }
    }
    for &p in &cfg.outbound_ports_exclude {
        put_port(p, port_kind::OUTBOUND_EXCLUDE)?;
    }
    let mut v4 = maps.lpm::<Cidr4, u8>(pins::CIDR_V4)?;
    let mut v6 = maps.lpm::<Cidr6, u8>(pins::CIDR_V6)?;
    let included = match &cfg.outbound_include {
        CidrSet::All => vec![],
        CidrSet::Only(c) => c.clone(),
    };
    let entries = cfg
        .outbound_exclude
        .iter()
        .map(|c| (c, cidr_kind::EXCLUDE))
        .chain(included.iter().map(|c| (c, cidr_kind::INCLUDE)));
    for (cidr, kind) in entries {
        let addr = masked(cidr);
        let len = CIDR_KEY_PREFIX_BITS + u32::from(cidr.prefix_len());
        if matches!(cidr, IpNet::V4(_)) {
            let key = Key::new(
                len,
                Cidr4 {
                    pod_id: pod.id,
                    kind,
                    addr: addr[0],
                },
            );
            v4.insert(&key, 1, 0)
                .with_context(|| format!("CIDR_V4[{cidr}]"))?;
        } else {
            let key = Key::new(
                len,
                Cidr6 {
                    pod_id: pod.id,
                    kind,
                    addr,
                },
            );
            v6.insert(&key, 1, 0)
                .with_context(|| format!("CIDR_V6[{cidr}]"))?;
        }
    }
    if cfg.dns.redirect {
        let mut servers = maps.hash::<DnsServerKey, u8>(pins::DNS_SERVERS)?;
        for ip in &cfg.dns.servers {
            // A v4-mapped resolver is matched as the IPv4 address the hooks see.
            let ip = match ip {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(*ip, IpAddr::V4),
                IpAddr::V4(_) => *ip,
            };
            let (addr, family) = addr_words(&ip);
            servers
                .insert(
                    DnsServerKey {
                        pod_id: pod.id,
                        family,
                        addr,
                    },
                    1,
                    0,
                )
                .with_context(|| format!("DNS_SERVERS[{ip}]"))?;
        }
    }
    // Last: this entry enrols the namespace; until now the programs ignored it.
    let mut config = maps.hash::<u64, PodConfig>(pins::POD_CONFIG)?;
    config
        .insert(pod.netns_cookie, pc, 0)
        .context("POD_CONFIG")?;
    Ok(())
}

/// Removes the current namespace's capture. Returns whether anything was installed.
pub fn cleanup(root: &Path) -> anyhow::Result<bool> {
    let pod = PodIdentity::current()?;
    cleanup_pod(root, &pod)
}

fn retain_other_pods<K: Pod, V: Pod>(
    map: &mut HashMap<MapData, K, V>,
    belongs: impl Fn(&K, &V) -> bool,
) -> usize {
    let doomed: Vec<K> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, v)| belongs(k, v))
        .map(|(k, _)| k)
        .collect();
    doomed.iter().filter(|k| map.remove(k).is_ok()).count()
}

pub(crate) fn cleanup_pod(root: &Path, pod: &PodIdentity) -> anyhow::Result<bool> {
    let mut found = false;
    let dir = pod_dir(root, pod.id);
    if dir.exists() {
        found = true;
        // Removing a link's last pin detaches it.
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            std::fs::remove_file(&path).with_context(|| format!("unpinning {}", path.display()))?;
        }
        std::fs::remove_dir(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let maps = Maps { root };
    let id = pod.id;
    if let Ok(mut m) = maps.hash::<u64, PodConfig>(pins::POD_CONFIG) {
        found |= retain_other_pods(&mut m, |k, v| *k == pod.netns_cookie || v.pod_id == id) > 0;
    }
    if let Ok(mut m) = maps.hash::<AddrKey, PodConfig>(pins::POD_ADDRS) {
        retain_other_pods(&mut m, |_, v| v.pod_id == id);
    }
    if let Ok(mut m) = maps.hash::<PortKey, u8>(pins::POD_PORTS) {
        retain_other_pods(&mut m, |k, _| k.pod_id == id);
    }
    if let Ok(mut m) = maps.hash::<u64, OriginalDst>(pins::ORIG_DST_COOKIE) {
        retain_other_pods(&mut m, |_, v| v.pod_id == id);
    }
    if let Ok(mut m) = maps.hash::<SockTuple, OriginalDst>(pins::ORIG_DST_TUPLE) {
        retain_other_pods(&mut m, |_, v| v.pod_id == id);
    }
    if let Ok(mut m) = maps.hash::<DnsServerKey, u8>(pins::DNS_SERVERS) {
        retain_other_pods(&mut m, |k, _| k.pod_id == id);
    }
    if let Ok(mut m) = maps.hash::<u64, OriginalDst>(pins::DNS_ORIG_DST) {
        retain_other_pods(&mut m, |_, v| v.pod_id == id);
    }
    if let Ok(mut m) = maps.hash::<u32, PodLabel>(pins::POD_LABELS) {
        retain_other_pods(&mut m, |k, _| *k == id);
    }
    if let Ok(mut m) = maps.hash::<SockTuple, u32>(pins::PAIR_STATE) {
        // Sockets still open fall back to TCP (a missing state means TCP).
        retain_other_pods(&mut m, |k, _| pair_of_pod(k, pod));
    }
    if let Ok(map) = maps.map(pins::POD_COUNTERS)
        && let Ok(mut m) = PerCpuHashMap::<MapData, PodCounterKey, u64>::try_from(map)
    {
        let doomed: Vec<_> = m
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.pod_id == id)
            .collect();
        for k in doomed {
            let _ = m.remove(&k);
        }
    }
    if let Ok(mut m) = maps.lpm::<Cidr4, u8>(pins::CIDR_V4) {
        remove_pod_cidrs(&mut m, |d| d.pod_id == id);
    }
    if let Ok(mut m) = maps.lpm::<Cidr6, u8>(pins::CIDR_V6) {
        remove_pod_cidrs(&mut m, |d| d.pod_id == id);
    }
    if let Ok(map) = maps.map(pins::LISTENERS)
        && let Ok(mut m) = SockHash::<MapData, ListenerKey>::try_from(map)
    {
        {
            let doomed: Vec<_> = m
                .keys()
                .filter_map(Result::ok)
                .filter(|k| k.pod_id == id)
                .collect();
            for k in doomed {
                let _ = m.remove(&k);
            }
        }
    }
    remove_root_if_unused(root)?;
    Ok(found)
}

/// Whether a short-circuit key belongs to `pod`: its namespace, or one of its addresses.
fn pair_of_pod(key: &SockTuple, pod: &PodIdentity) -> bool {
    key.netns == pod.netns_cookie
        || pod.addresses.iter().any(|ip| {
            let (addr, family) = addr_words(ip);
            family == key.family && addr == key.src
        })
}

/// The runtime switch: turns the current pod's short-circuit on or off. Off sends every
/// open pair back to TCP (the one switch that cannot reorder bytes); on takes effect
/// for connections established from now on.
pub fn set_sockmap(root: &Path, on: bool) -> anyhow::Result<PodIdentity> {
    let pod = PodIdentity::current()?;
    let maps = Maps { root };
    let mut config = maps.hash::<u64, PodConfig>(pins::POD_CONFIG)?;
    let Ok(mut pc) = config.get(&pod.netns_cookie, 0) else {
        bail!(
            "no eBPF capture is installed for this network namespace (pod_{})",
            pod.id
        );
    };
    if on {
        pc.flags |= flags::SOCKMAP;
    } else {
        pc.flags &= !flags::SOCKMAP;
    }
    config.insert(pod.netns_cookie, pc, 0)?;
    let mut addrs = maps.hash::<AddrKey, PodConfig>(pins::POD_ADDRS)?;
    let keys: Vec<AddrKey> = addrs.keys().filter_map(Result::ok).collect();
    for key in keys {
        if addrs.get(&key, 0).is_ok_and(|v| v.pod_id == pod.id) {
            addrs.insert(key, pc, 0)?;
        }
    }
    if !on {
        let mut state = maps.hash::<SockTuple, u32>(pins::PAIR_STATE)?;
        let keys: Vec<SockTuple> = state
            .keys()
            .filter_map(Result::ok)
            .filter(|k| pair_of_pod(k, &pod))
            .collect();
        for key in keys {
            state.insert(key, shunt_common::pair_state::FALLBACK, 0)?;
        }
    }
    Ok(pod)
}

fn remove_pod_cidrs<K: Pod>(trie: &mut LpmTrie<MapData, K, u8>, belongs: impl Fn(&K) -> bool) {
    let doomed: Vec<_> = trie
        .keys()
        .filter_map(Result::ok)
        .filter(|k| belongs(&k.data()))
        .collect();
    for key in doomed {
        let _ = trie.remove(&key);
    }
}

/// With no pod left, the maps' pins go too, and with them the maps.
pub(crate) fn remove_root_if_unused(root: &Path) -> anyhow::Result<()> {
    let pods = root.join("pods");
    let any_pod = std::fs::read_dir(&pods)
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    // A node's links (`shunt node`) keep the maps for the pods still to come.
    if any_pod || crate::bpffs::node_dir(root).exists() {
        return Ok(());
    }
    let _ = std::fs::remove_dir(&pods);
    for name in pins::MAPS {
        let path = root.join(name);
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| format!("unpinning {}", path.display()))?;
        }
    }
    if root.exists() {
        std::fs::remove_dir(root)
            .with_context(|| format!("removing {} (not empty?)", root.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_clears_host_bits_in_network_order() {
        let net = |s: &str| crate::config::parse_cidr(s).unwrap();
        let ip = |s: &str| addr_words(&s.parse().unwrap()).0;
        assert_eq!(masked(&net("10.1.2.3/8")), ip("10.0.0.0"));
        assert_eq!(masked(&net("192.168.77.9/20")), ip("192.168.64.0"));
        assert_eq!(masked(&net("0.0.0.0/0")), ip("0.0.0.0"));
        assert_eq!(masked(&net("fd00:1:2::7/40")), ip("fd00:1::"));
        assert_eq!(masked(&net("fd00::7")), ip("fd00::7"));
    }

    #[test]
    fn a_build_without_programs_says_why_and_what_to_do() {
        match built_with_programs() {
            Ok(()) => assert!(!OBJECT.is_empty()),
            Err(err) => {
                let err = err.to_string();
                assert!(
                    err.contains("without its eBPF programs")
                        && err.contains("cargo xtask setup")
                        && err.contains("--backend iptables"),
                    "{err}"
                );
            }
        }
    }
}
