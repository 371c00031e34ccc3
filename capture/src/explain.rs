//! `shunt inspect --explain IP:PORT`: what the programs would decide for a connection,
//! without making it. The facts are read from the same maps the programs read, and the
//! decision is taken by the same pure functions they run (`shunt_common::outbound`,
//! `dns`, `inbound`), so the answer cannot drift from the kernel's.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context, bail};
use aya::maps::{HashMap as BpfHashMap, LpmTrie, MapData, SockHash, lpm_trie::Key};
use shunt_common::{
    AddrKey, CIDR_KEY_PREFIX_BITS, Cidr4, Cidr6, DNS_PORT, DNS_PROXY_PORT, Decision, DnsServerKey,
    INBOUND_PASSTHROUGH_V4, INBOUND_PASSTHROUGH_V6, ListenerKey, PodConfig, PortKey, Verdict,
    cidr_kind, dns, flags, inbound, outbound, pins, port_kind,
};

use crate::bpffs::{Maps, addr_words};

/// The connection asked about.
#[derive(Debug, Clone)]
pub struct Question {
    pub target: SocketAddr,
    /// The pod connecting (for the outbound answers); `None`: the only pod, if one.
    pub pod: Option<String>,
    pub uid: u32,
    pub gid: u32,
    /// The address the socket is bound to (rule 15 looks at it), if any.
    pub src: Option<IpAddr>,
}

/// One hook's answer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Answer {
    /// Who decides: `connect`, `sendmsg` (UDP to port 53) or `sk_lookup`.
    pub hook: &'static str,
    pub pod: String,
    pub outcome: &'static str,
    pub decision: &'static str,
    pub rule: &'static str,
    pub rule_text: &'static str,
    pub to_port: Option<u16>,
    /// What the maps cannot settle ahead (a fail-open pod's proxy being up).
    pub note: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Explanation {
    pub target: String,
    /// A TCP connect from the pod, as `--uid`/`--gid` (and bound to `--src`).
    pub outbound: Option<Answer>,
    /// A UDP datagram to port 53 from the pod (with DNS capture on).
    pub dns_udp: Option<Answer>,
    /// A TCP connection to the pod owning the target address, from another host (or
    /// from `--src`).
    pub inbound: Option<Answer>,
}

pub fn explain(root: &Path, q: &Question) -> anyhow::Result<Explanation> {
    let maps = Maps { root };
    let target = SocketAddr::new(q.target.ip().to_canonical(), q.target.port());
    let names = crate::pod_names::all(root);
    let from = match &q.pod {
        Some(p) => Some(crate::pod_names::resolve(root, p)?),
        None => only_pod(root)?,
    };
    let (mut outbound, mut dns_udp) = (None, None);
    if let Some(pod_id) = from {
        let cfg = pod_config(&maps, pod_id)?;
        let pod = crate::pod_names::display(&names, pod_id);
        outbound = Some(connect(&maps, &cfg, q, target, &pod)?);
        if target.port() == DNS_PORT && cfg.flags & flags::DNS_REDIRECT != 0 {
            dns_udp = Some(query(&maps, &cfg, q, target, &pod)?);
        }
    }
    let inbound = match owner(&maps, target.ip())? {
        Some(cfg) => {
            let pod = crate::pod_names::display(&names, cfg.pod_id);
            Some(steer(&maps, &cfg, q, target, &pod)?)
        }
        None => None,
    };
    if outbound.is_none() && inbound.is_none() {
        bail!(
            "--explain {target}: say which pod connects (--pod), or name one of a pod's own addresses"
        );
    }
    Ok(Explanation {
        target: target.to_string(),
        outbound,
        dns_udp,
        inbound,
    })
}

/// With no `--pod`: the pod, when exactly one is captured.
fn only_pod(root: &Path) -> anyhow::Result<Option<u32>> {
    let pods = crate::pod_names::enrolled(root)?;
    Ok(match pods.as_slice() {
        [one] => Some(*one),
        _ => None,
    })
}

fn pod_config(maps: &Maps<'_>, pod_id: u32) -> anyhow::Result<PodConfig> {
    let config: BpfHashMap<MapData, u64, PodConfig> = maps.hash(pins::POD_CONFIG)?;
    config
        .iter()
        .filter_map(Result::ok)
        .map(|(_, pc)| pc)
        .find(|pc| pc.pod_id == pod_id)
        .with_context(|| format!("pod_{pod_id} has no POD_CONFIG entry"))
}

/// The pod whose address `ip` is.
fn owner(maps: &Maps<'_>, ip: IpAddr) -> anyhow::Result<Option<PodConfig>> {
    let addrs: BpfHashMap<MapData, AddrKey, PodConfig> = maps.hash(pins::POD_ADDRS)?;
    let (addr, family) = addr_words(&ip);
    Ok(addrs.get(&AddrKey { addr, family }, 0).ok())
}

fn answer(hook: &'static str, pod: &str, v: Verdict, to_port: Option<u16>) -> Answer {
    Answer {
        hook,
        pod: pod.to_owned(),
        outcome: v.decision.outcome(),
        decision: v.decision.name(),
        rule: v.rule.label(),
        rule_text: v.rule.text(),
        to_port,
        note: None,
    }
}

fn is_loopback(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified()
}

fn is_passthrough(src: Option<IpAddr>) -> bool {
    match src {
        Some(IpAddr::V4(a)) => a == Ipv4Addr::from(INBOUND_PASSTHROUGH_V4),
        Some(IpAddr::V6(a)) => a == Ipv6Addr::from(INBOUND_PASSTHROUGH_V6),
        None => false,
    }
}

fn has_port(maps: &Maps<'_>, pod_id: u32, port: u16, kind: u16) -> anyhow::Result<bool> {
    let ports: BpfHashMap<MapData, PortKey, u8> = maps.hash(pins::POD_PORTS)?;
    Ok(ports.get(&PortKey { pod_id, port, kind }, 0).is_ok())
}

fn is_pod_addr(maps: &Maps<'_>, ip: IpAddr, pod_id: u32) -> anyhow::Result<bool> {
    Ok(owner(maps, ip)?.is_some_and(|c| c.pod_id == pod_id))
}

/// Whether `ip` falls in one of the pod's CIDRs of `kind` (the kernel's LPM lookup).
fn in_cidr(maps: &Maps<'_>, pod_id: u32, kind: u32, ip: IpAddr) -> anyhow::Result<bool> {
    let (addr, _) = addr_words(&ip);
    Ok(match ip {
        IpAddr::V4(_) => {
            let trie: LpmTrie<MapData, Cidr4, u8> = LpmTrie::try_from(maps.map(pins::CIDR_V4)?)?;
            let data = Cidr4 {
                pod_id,
                kind,
                addr: addr[0],
            };
            trie.get(&Key::new(CIDR_KEY_PREFIX_BITS + 32, data), 0)
                .is_ok()
        }
        IpAddr::V6(_) => {
            let trie: LpmTrie<MapData, Cidr6, u8> = LpmTrie::try_from(maps.map(pins::CIDR_V6)?)?;
            let data = Cidr6 { pod_id, kind, addr };
            trie.get(&Key::new(CIDR_KEY_PREFIX_BITS + 128, data), 0)
                .is_ok()
        }
    })
}

fn is_resolver(maps: &Maps<'_>, cfg: &PodConfig, ip: IpAddr) -> anyhow::Result<bool> {
    if cfg.flags & flags::DNS_CAPTURE_ALL != 0 {
        return Ok(true);
    }
    let servers: BpfHashMap<MapData, DnsServerKey, u8> = maps.hash(pins::DNS_SERVERS)?;
    let (addr, family) = addr_words(&ip);
    Ok(servers
        .get(
            &DnsServerKey {
                pod_id: cfg.pod_id,
                family,
                addr,
            },
            0,
        )
        .is_ok())
}

/// `cgroup/connect4|6`: `connect.rs`'s facts, from the maps.
fn connect(
    maps: &Maps<'_>,
    cfg: &PodConfig,
    q: &Question,
    target: SocketAddr,
    pod: &str,
) -> anyhow::Result<Answer> {
    let (ip, port) = (target.ip(), target.port());
    let v4 = ip.is_ipv4();
    let dns_port = cfg.flags & flags::DNS_REDIRECT != 0 && port == DNS_PORT;
    let all = cfg.flags
        & if v4 {
            flags::OUTBOUND_ALL_V4
        } else {
            flags::OUTBOUND_ALL_V6
        }
        != 0;
    let facts = outbound::ConnectFacts {
        uid: q.uid,
        gid: q.gid,
        proxy_uid: cfg.proxy_uid,
        proxy_gid: cfg.proxy_gid,
        port_excluded: has_port(maps, cfg.pod_id, port, port_kind::OUTBOUND_EXCLUDE)?,
        src_inbound_passthrough: is_passthrough(q.src),
        via_lo: is_loopback(ip) || is_pod_addr(maps, ip, cfg.pod_id)?,
        dst_localhost: ip == IpAddr::V4(Ipv4Addr::LOCALHOST)
            || ip == IpAddr::V6(Ipv6Addr::LOCALHOST),
        cidr_excluded: in_cidr(maps, cfg.pod_id, cidr_kind::EXCLUDE, ip)?,
        cidr_included: all || in_cidr(maps, cfg.pod_id, cidr_kind::INCLUDE, ip)?,
        dns_port,
        dns_resolver: dns_port && is_resolver(maps, cfg, ip)?,
    };
    let v = outbound::verdict(&facts);
    let to_port = match v.decision {
        Decision::OutboundRedirected => Some(cfg.outbound_port),
        Decision::InboundRedirectedLocal => Some(cfg.inbound_port),
        Decision::DnsCapturedTcp => Some(DNS_PROXY_PORT),
        _ => None,
    };
    let mut a = answer("connect", pod, v, to_port);
    if to_port.is_some()
        && cfg.flags & flags::FAIL_OPEN != 0
        && v.decision != Decision::DnsCapturedTcp
    {
        a.note = Some(format!(
            "the pod fails open: if nothing listens on its port {} then, the connect passes uncaptured (fail_open_no_proxy)",
            to_port.unwrap_or(0)
        ));
    }
    Ok(a)
}

/// `cgroup/sendmsg4|6` (and connect of a UDP socket) to port 53: `dns.rs`'s facts.
fn query(
    maps: &Maps<'_>,
    cfg: &PodConfig,
    q: &Question,
    target: SocketAddr,
    pod: &str,
) -> anyhow::Result<Answer> {
    let ip = target.ip();
    let v = dns::verdict_udp(&dns::QueryFacts {
        uid: q.uid,
        gid: q.gid,
        proxy_uid: cfg.proxy_uid,
        proxy_gid: cfg.proxy_gid,
        inbound_passthrough: is_loopback(ip) && is_passthrough(q.src),
        resolver: is_resolver(maps, cfg, ip)?,
    });
    let to_port = (v.decision == Decision::DnsCapturedUdp).then_some(DNS_PROXY_PORT);
    Ok(answer("sendmsg", pod, v, to_port))
}

/// `sk_lookup`: `inbound.rs`'s facts, and whether the pod's listener is registered.
fn steer(
    maps: &Maps<'_>,
    cfg: &PodConfig,
    q: &Question,
    target: SocketAddr,
    pod: &str,
) -> anyhow::Result<Answer> {
    let port = target.port();
    let all_ports = cfg.flags & flags::INBOUND_ALL_PORTS != 0;
    let local_source = match q.src {
        Some(src) => is_loopback(src) || is_pod_addr(maps, src, cfg.pod_id)?,
        None => false,
    };
    let facts = inbound::InboundFacts {
        local_source,
        capture: cfg.flags & flags::INBOUND != 0,
        all_ports,
        port_excluded: all_ports && has_port(maps, cfg.pod_id, port, port_kind::INBOUND_EXCLUDE)?,
        port_listed: !all_ports && has_port(maps, cfg.pod_id, port, port_kind::INBOUND_INCLUDE)?,
    };
    let mut v = inbound::verdict(&facts);
    if v.decision == Decision::InboundSteered && !listening(maps, cfg.pod_id, target)? {
        v = inbound::without_listener(cfg.flags & flags::FAIL_OPEN != 0);
    }
    let to_port = (v.decision == Decision::InboundSteered).then_some(cfg.inbound_port);
    Ok(answer("sk_lookup", pod, v, to_port))
}

/// Whether the pod's inbound listener for the target's family is registered.
fn listening(maps: &Maps<'_>, pod_id: u32, target: SocketAddr) -> anyhow::Result<bool> {
    let listeners: SockHash<MapData, ListenerKey> = SockHash::try_from(maps.map(pins::LISTENERS)?)?;
    let family = addr_words(&target.ip()).1;
    Ok(listeners
        .keys()
        .filter_map(Result::ok)
        .any(|k| k.pod_id == pod_id && k.family == family))
}

impl Explanation {
    /// For a person: one line per hook.
    pub fn text(&self, q: &Question) -> String {
        let mut out = format!("what the programs would decide for {}:\n", self.target);
        let line = |who: String, a: &Answer| {
            let to = a.to_port.map(|p| format!(" -> :{p}")).unwrap_or_default();
            let rule = if a.rule.is_empty() {
                " (no istio-iptables rule)".to_owned()
            } else {
                format!(" (rule {}: {})", a.rule, a.rule_text)
            };
            let note = a
                .note
                .as_ref()
                .map(|n| format!("\n    note: {n}"))
                .unwrap_or_default();
            format!(
                "  {who} [{}]: {} {}{to}{rule}{note}\n",
                a.hook, a.outcome, a.decision
            )
        };
        let src = q.src.map(|s| format!(", bound to {s}")).unwrap_or_default();
        if let Some(a) = &self.outbound {
            let who = format!(
                "TCP connect from {} as uid {} gid {}{src}",
                a.pod, q.uid, q.gid
            );
            out += &line(who, a);
        }
        if let Some(a) = &self.dns_udp {
            let who = format!(
                "UDP query from {} as uid {} gid {}{src}",
                a.pod, q.uid, q.gid
            );
            out += &line(who, a);
        }
        if let Some(a) = &self.inbound {
            let from = q.src.map_or("another host".to_owned(), |s| s.to_string());
            out += &line(format!("TCP connection to {} from {from}", a.pod), a);
        }
        if self.outbound.is_none() {
            out += "  (no pod connecting: name one with --pod for the outbound decision)\n";
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_passthrough_source_is_127_0_0_6_or_6() {
        assert!(is_passthrough(Some("127.0.0.6".parse().unwrap())));
        assert!(is_passthrough(Some("::6".parse().unwrap())));
        assert!(!is_passthrough(Some("127.0.0.1".parse().unwrap())));
        assert!(!is_passthrough(None));
    }
}
