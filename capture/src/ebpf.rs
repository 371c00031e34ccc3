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
    maps::{HashMap, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap, SockHash, lpm_trie::Key},
};
use ipnet::IpNet;
use shunt_common::{
    AF_INET, AF_INET6, Addr, AddrKey, CIDR_KEY_PREFIX_BITS, Cidr4, Cidr6, Decision, DnsServerKey,
    ListenerKey, OriginalDst, PodConfig, PodCounterKey, PortKey, SockTuple, cidr_kind,
    events::PodLabel, flags, pins, port_kind,
};

use crate::{
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

pub fn pod_dir(root: &Path, pod_id: u32) -> PathBuf {
    root.join("pods").join(format!("pod_{pod_id}"))
}

pub fn addr_words(ip: &IpAddr) -> (Addr, u32) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], AF_INET),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], AF_INET6)
        }
    }
}

pub fn words_addr(addr: &Addr, family: u32) -> IpAddr {
    if family == AF_INET {
        IpAddr::from(addr[0].to_ne_bytes())
    } else {
        let mut o = [0u8; 16];
        for (i, w) in addr.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::from(o)
    }
}

fn pod_config(cfg: &CaptureConfig, pod: &PodIdentity, extra_flags: u32) -> PodConfig {
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

/// The shared maps, opened from their pins.
pub(crate) struct Maps<'a> {
    pub(crate) root: &'a Path,
}

impl Maps<'_> {
    pub(crate) fn map(&self, name: &str) -> anyhow::Result<Map> {
        let path = self.root.join(name);
        let data = MapData::from_pin(&path)
            .with_context(|| format!("opening pinned map {}", path.display()))?;
        Ok(Map::from_map_data(data)?)
    }
    pub(crate) fn hash<K: Pod, V: Pod>(
        &self,
        name: &str,
    ) -> anyhow::Result<HashMap<MapData, K, V>> {
        Ok(HashMap::try_from(self.map(name)?)?)
    }
    fn lpm<K: Pod, V: Pod>(&self, name: &str) -> anyhow::Result<LpmTrie<MapData, K, V>> {
        Ok(LpmTrie::try_from(self.map(name)?)?)
    }
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
    if any_pod || crate::node::node_dir(root).exists() {
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
    fn addresses_round_trip_through_map_words() {
        for s in ["10.0.0.7", "fd00::1:2", "::ffff:1.2.3.4"] {
            let ip: IpAddr = s.parse().unwrap();
            let (words, family) = addr_words(&ip);
            assert_eq!(words_addr(&words, family), ip);
        }
    }

    /// The configuration `shunt capture FLAGS` makes.
    fn config(flags: &[&str]) -> CaptureConfig {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: crate::CaptureArgs,
        }
        let argv = std::iter::once("capture").chain(flags.iter().copied());
        <Cli as clap::Parser>::parse_from(argv)
            .args
            .config()
            .unwrap()
    }

    #[test]
    fn dns_capture_sets_its_flags_and_attaches_its_programs_only_when_asked() {
        let pod = PodIdentity {
            id: 7,
            netns_cookie: 1,
            addresses: vec![],
        };
        let dns_programs = |cfg: &CaptureConfig| {
            cgroup_programs(cfg)
                .iter()
                .filter(|(name, _)| name.contains("dns"))
                .count()
        };
        let off = config(&["--capture-all-dns"]);
        assert_eq!(
            pod_config(&off, &pod, 0).flags & (flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL),
            0
        );
        assert_eq!(dns_programs(&off), 0);
        let on = config(&["--redirect-dns"]);
        assert_eq!(
            pod_config(&on, &pod, 0).flags & (flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL),
            flags::DNS_REDIRECT
        );
        assert_eq!(dns_programs(&on), 4);
        let all = config(&["--redirect-dns", "--capture-all-dns"]);
        assert_eq!(
            pod_config(&all, &pod, 0).flags & (flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL),
            flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL
        );
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
