//! istio-iptables' rules for a config, rule for rule and in its order (istio/istio
//! `tools/istio-iptables/pkg/capture/run.go`): nat capture, the `raw`-table conntrack
//! zones and nat redirects of DNS capture, TPROXY's mangle rules, excluded and KubeVirt
//! interfaces, owner groups and the INVALID drop. Pure: the renderer and the golden
//! tests read the same plan that `install` writes.

use std::net::IpAddr;

use ipnet::IpNet;

use super::{Family, builder::Builder};
use crate::config::{
    CaptureConfig, CidrSet, DNS_PROXY_PORT, InterceptionMode, OwnerGroups, PortSet,
};

const INBOUND: &str = "ISTIO_INBOUND";
const REDIRECT: &str = "ISTIO_REDIRECT";
const IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
const OUTPUT: &str = "ISTIO_OUTPUT";
const OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
const DIVERT: &str = "ISTIO_DIVERT";
const TPROXY: &str = "ISTIO_TPROXY";
const DROP: &str = "ISTIO_DROP";
/// The mark the proxy's own loopback connections to the pod IP carry in TPROXY mode.
const OUTBOUND_MARK: &str = "1338";

/// Every chain istio-iptables may create, per table (what cleanup looks for).
pub const CHAINS: [(&str, &[&str]); 3] = [
    ("nat", &[INBOUND, REDIRECT, IN_REDIRECT, OUTPUT, OUTPUT_DNS]),
    ("mangle", &[DIVERT, TPROXY, INBOUND, DROP]),
    ("raw", &[OUTPUT_DNS, INBOUND]),
];

/// How istio-iptables writes an address it was given as text: IPv4-compatible IPv6
/// addresses keep their dotted tail (`::127.0.0.53`), as a resolver list spells them.
fn host_cidr(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}/32"),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            if o[..12].iter().all(|&b| b == 0) && o[12] != 0 {
                format!("::{}.{}.{}.{}/128", o[12], o[13], o[14], o[15])
            } else {
                format!("{v6}/128")
            }
        }
    }
}

fn family_of(net: &IpNet) -> Family {
    match net {
        IpNet::V4(_) => Family::V4,
        IpNet::V6(_) => Family::V6,
    }
}

/// `-i`, split by family as istio-iptables' SeparateV4V6 does.
struct Ranges<'a> {
    wildcard: bool,
    cidrs: Vec<&'a IpNet>,
}

impl Ranges<'_> {
    fn has_loopback(&self) -> bool {
        self.cidrs.iter().any(|c| c.addr().is_loopback())
    }
}

fn include_ranges(cfg: &CaptureConfig, family: Family) -> Ranges<'_> {
    match &cfg.outbound_include {
        CidrSet::All => Ranges {
            wildcard: true,
            cidrs: vec![],
        },
        CidrSet::Only(cidrs) => Ranges {
            wildcard: false,
            cidrs: cidrs.iter().filter(|c| family_of(c) == family).collect(),
        },
    }
}

pub fn plan(cfg: &CaptureConfig) -> Builder {
    let mut b = Builder::new(cfg.ipv6);
    let dns = cfg.dns.active();
    let loopback = cfg.host_ipv4_loopback.to_string();
    let loopback = loopback.as_str();
    let tproxy = cfg.mode == InterceptionMode::Tproxy;
    let mark = cfg.tproxy.mark.to_string();
    let tunnel = cfg.inbound_tunnel_port;
    let include_v4 = include_ranges(cfg, Family::V4);
    let include_v6 = include_ranges(cfg, Family::V6);

    // Excluded interfaces: neither direction is captured.
    for nic in &cfg.exclude_interfaces {
        b.append("nat", "PREROUTING", &format!("-i {nic} -j RETURN"));
        b.append("nat", "OUTPUT", &format!("-o {nic} -j RETURN"));
    }
    if tproxy {
        for nic in &cfg.exclude_interfaces {
            b.append("mangle", "PREROUTING", &format!("-i {nic} -j RETURN"));
            b.append("mangle", "OUTPUT", &format!("-o {nic} -j RETURN"));
        }
    }
    // KubeVirt interfaces: the VM's traffic is not inbound (see the outbound rules below).
    for nic in &cfg.kube_virt_interfaces {
        b.insert("nat", "PREROUTING", 1, &format!("-i {nic} -j RETURN"));
    }
    if cfg.drop_invalid {
        b.append(
            "mangle",
            "PREROUTING",
            &format!("-m conntrack --ctstate INVALID -j {DROP}"),
        );
        b.append("mangle", DROP, "-j DROP");
    }
    b.append(
        "nat",
        INBOUND,
        &format!("-p tcp --dport {tunnel} -j RETURN"),
    );
    b.append(
        "nat",
        REDIRECT,
        &format!("-p tcp -j REDIRECT --to-ports {}", cfg.proxy_port),
    );
    b.append(
        "nat",
        IN_REDIRECT,
        &format!("-p tcp -j REDIRECT --to-ports {}", cfg.inbound_capture_port),
    );
    inbound(cfg, &mut b, loopback, &mark);

    // Every protocol enters ISTIO_OUTPUT: DNS over UDP is sorted out inside it.
    b.append("nat", "OUTPUT", &format!("-j {OUTPUT}"));
    for port in &cfg.outbound_ports_exclude {
        b.append("nat", OUTPUT, &format!("-p tcp --dport {port} -j RETURN"));
        b.append("nat", OUTPUT, &format!("-p udp --dport {port} -j RETURN"));
    }
    b.append_versioned("nat", OUTPUT, "127.0.0.6/32", "::6/128", |src| {
        format!("-o lo -s {src} -j RETURN")
    });
    let app_to_itself_returns = !include_v4.has_loopback() && !include_v6.has_loopback();
    for (owner, ids) in [
        ("--uid-owner", &cfg.proxy_uids),
        ("--gid-owner", &cfg.proxy_gids),
    ] {
        for id in ids.iter() {
            // The proxy calling its own pod over lo is inbound traffic; with DNS capture
            // its queries to a resolver on lo go straight out instead (uids only, as
            // istio-iptables does).
            let ports = if dns && owner == "--uid-owner" {
                format!("-m multiport ! --dports 53,{tunnel}")
            } else {
                format!("! --dport {tunnel}")
            };
            b.append_versioned("nat", OUTPUT, loopback, "::1/128", |lo| {
                format!("-o lo ! -d {lo} -p tcp {ports} -m owner {owner} {id} -j {IN_REDIRECT}")
            });
            // The app calling its own pod over lo is not captured, unless -i names
            // loopback; with DNS capture a TCP query to a resolver on lo still is.
            if app_to_itself_returns {
                let spec = if dns {
                    format!("-o lo -p tcp ! --dport 53 -m owner ! {owner} {id} -j RETURN")
                } else {
                    format!("-o lo -m owner ! {owner} {id} -j RETURN")
                };
                b.append("nat", OUTPUT, &spec);
            }
            // The proxy's own traffic, any protocol, any destination.
            b.append("nat", OUTPUT, &format!("-m owner {owner} {id} -j RETURN"));
        }
    }
    match &cfg.owner_groups {
        OwnerGroups::AllExcept(groups) => {
            for g in groups {
                b.append(
                    "nat",
                    OUTPUT,
                    &format!("-m owner --gid-owner {g} -j RETURN"),
                );
            }
        }
        OwnerGroups::Only(groups) => {
            // One rule: a socket of none of these groups is not captured.
            let mut spec: Vec<String> = groups
                .iter()
                .map(|g| format!("-m owner ! --gid-owner {g}"))
                .collect();
            spec.push("-j RETURN".into());
            b.append("nat", OUTPUT, &spec.join(" "));
        }
    }
    if dns {
        dns_capture(cfg, &mut b);
    }
    b.append_versioned("nat", OUTPUT, loopback, "::1/128", |lo| {
        format!("-d {lo} -j RETURN")
    });
    for cidr in &cfg.outbound_exclude {
        b.append_to(
            family_of(cidr),
            "nat",
            OUTPUT,
            &format!("-d {cidr} -j RETURN"),
        );
    }
    for port in &cfg.outbound_ports_include {
        b.append(
            "nat",
            OUTPUT,
            &format!("-p tcp --dport {port} -j {REDIRECT}"),
        );
    }
    for (family, ranges) in [(Family::V4, &include_v4), (Family::V6, &include_v6)] {
        outbound_include(cfg, &mut b, family, ranges);
    }
    if tproxy {
        tproxy_marks(cfg, &mut b, loopback, &mark);
    }
    b
}

/// Inbound capture: nat REDIRECT to the inbound port, or TPROXY in mangle.
fn inbound(cfg: &CaptureConfig, b: &mut Builder, loopback: &str, mark: &str) {
    if cfg.inbound_include == PortSet::Only(vec![]) {
        return;
    }
    let tproxy = cfg.mode == InterceptionMode::Tproxy;
    let table = if tproxy {
        b.append("mangle", DIVERT, &format!("-j MARK --set-mark {mark}"));
        b.append("mangle", DIVERT, "-j ACCEPT");
        b.append_versioned("mangle", TPROXY, loopback, "::1/128", |lo| {
            format!(
                "! -d {lo} -p tcp -j TPROXY --tproxy-mark {mark}/0xffffffff --on-port {}",
                cfg.inbound_capture_port
            )
        });
        "mangle"
    } else {
        "nat"
    };
    b.append(table, "PREROUTING", &format!("-p tcp -j {INBOUND}"));
    match &cfg.inbound_include {
        PortSet::All => {
            for port in &cfg.inbound_exclude {
                b.append(table, INBOUND, &format!("-p tcp --dport {port} -j RETURN"));
            }
            if tproxy {
                b.append(
                    "mangle",
                    INBOUND,
                    &format!("-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j {DIVERT}"),
                );
                b.append("mangle", INBOUND, &format!("-p tcp -j {TPROXY}"));
            } else {
                b.append("nat", INBOUND, &format!("-p tcp -j {IN_REDIRECT}"));
            }
        }
        PortSet::Only(ports) => {
            for port in ports {
                if tproxy {
                    b.append(
                        "mangle",
                        INBOUND,
                        &format!(
                            "-p tcp --dport {port} -m conntrack --ctstate RELATED,ESTABLISHED -j {DIVERT}"
                        ),
                    );
                    b.append(
                        "mangle",
                        INBOUND,
                        &format!("-p tcp --dport {port} -j {TPROXY}"),
                    );
                } else {
                    b.append(
                        "nat",
                        INBOUND,
                        &format!("-p tcp --dport {port} -j {IN_REDIRECT}"),
                    );
                }
            }
        }
    }
}

/// `-i`: everything left goes to the proxy, or only the listed CIDRs; a KubeVirt
/// interface's traffic to them is redirected on arrival.
fn outbound_include(cfg: &CaptureConfig, b: &mut Builder, family: Family, ranges: &Ranges) {
    if ranges.wildcard {
        b.append_to(family, "nat", OUTPUT, &format!("-j {REDIRECT}"));
        for nic in &cfg.kube_virt_interfaces {
            b.insert_to(
                family,
                "nat",
                "PREROUTING",
                1,
                &format!("-i {nic} -j {REDIRECT}"),
            );
        }
        return;
    }
    for cidr in &ranges.cidrs {
        for nic in &cfg.kube_virt_interfaces {
            b.insert_to(
                family,
                "nat",
                "PREROUTING",
                1,
                &format!("-i {nic} -d {cidr} -j {REDIRECT}"),
            );
        }
        b.append_to(family, "nat", OUTPUT, &format!("-d {cidr} -j {REDIRECT}"));
    }
}

/// DNS to the pod's resolvers (or any, with `--capture-all-dns`) goes to the agent's
/// 15053; the `raw` table puts the proxy's upstream queries (zone 1) and the app's
/// queries to the proxy (zone 2) in separate conntrack zones, so the two flows that
/// share a 5-tuple once NATed never collide.
fn dns_capture(cfg: &CaptureConfig, b: &mut Builder) {
    let all = cfg.dns.capture_all;
    let v4: Vec<String> = cfg
        .dns
        .servers
        .iter()
        .filter(|s| s.is_ipv4())
        .map(host_cidr)
        .collect();
    let v6: Vec<String> = cfg
        .dns
        .servers
        .iter()
        .filter(|s| s.is_ipv6())
        .map(host_cidr)
        .collect();
    let servers = [(Family::V4, &v4), (Family::V6, &v6)];
    b.append("raw", "OUTPUT", &format!("-j {OUTPUT_DNS}"));
    for (family, list) in servers {
        if all || !list.is_empty() {
            b.append_to(family, "nat", OUTPUT, &format!("-j {OUTPUT_DNS}"));
        }
    }
    for proto in ["tcp", "udp"] {
        // istio-iptables spells the UDP target's option in the singular.
        let to = if proto == "tcp" {
            "--to-ports"
        } else {
            "--to-port"
        };
        if all {
            b.append(
                "nat",
                OUTPUT_DNS,
                &format!("-p {proto} --dport 53 -j REDIRECT {to} {DNS_PROXY_PORT}"),
            );
            continue;
        }
        for (family, list) in servers {
            for server in list {
                b.append_to(
                    family,
                    "nat",
                    OUTPUT_DNS,
                    &format!("-p {proto} --dport 53 -d {server} -j REDIRECT {to} {DNS_PROXY_PORT}"),
                );
            }
        }
    }
    for (owner, ids) in [
        ("--uid-owner", &cfg.proxy_uids),
        ("--gid-owner", &cfg.proxy_gids),
    ] {
        for id in ids.iter() {
            b.append(
                "raw",
                OUTPUT_DNS,
                &format!("-p udp --dport 53 -m owner {owner} {id} -j CT --zone 1"),
            );
            b.append(
                "raw",
                OUTPUT_DNS,
                &format!("-p udp --sport {DNS_PROXY_PORT} -m owner {owner} {id} -j CT --zone 2"),
            );
        }
    }
    if all {
        b.append("raw", "PREROUTING", &format!("-j {INBOUND}"));
        b.append("raw", OUTPUT_DNS, "-p udp --dport 53 -j CT --zone 2");
        b.append("raw", INBOUND, "-p udp --sport 53 -j CT --zone 1");
        return;
    }
    for (family, list) in servers {
        if !list.is_empty() {
            b.append_to(family, "raw", "PREROUTING", &format!("-j {INBOUND}"));
        }
        for server in list {
            b.append_to(
                family,
                "raw",
                OUTPUT_DNS,
                &format!("-p udp --dport 53 -d {server} -j CT --zone 2"),
            );
            b.append_to(
                family,
                "raw",
                INBOUND,
                &format!("-p udp --sport 53 -s {server} -j CT --zone 1"),
            );
        }
    }
}

/// TPROXY's connection marks: the proxy's loopback calls to the pod IP are marked 1338
/// so ISTIO_INBOUND can tell them from the app's own; marked connections route to lo.
fn tproxy_marks(cfg: &CaptureConfig, b: &mut Builder, loopback: &str, mark: &str) {
    b.append(
        "mangle",
        "PREROUTING",
        &format!("-p tcp -m mark --mark {mark} -j CONNMARK --save-mark"),
    );
    b.append(
        "mangle",
        "OUTPUT",
        &format!("-p tcp -o lo -m mark --mark {mark} -j RETURN"),
    );
    for (owner, ids) in [
        ("--uid-owner", &cfg.proxy_uids),
        ("--gid-owner", &cfg.proxy_gids),
    ] {
        for id in ids.iter() {
            b.append_versioned("mangle", "OUTPUT", loopback, "::1/128", |lo| {
                format!("! -d {lo} -p tcp -o lo -m owner {owner} {id} -j MARK --set-mark {OUTBOUND_MARK}")
            });
        }
    }
    b.append(
        "mangle",
        "OUTPUT",
        &format!("-p tcp -m connmark --mark {mark} -j CONNMARK --restore-mark"),
    );
    b.insert(
        "mangle",
        INBOUND,
        1,
        &format!("-p tcp -m mark --mark {mark} -j RETURN"),
    );
    b.insert_to(
        Family::V4,
        "mangle",
        INBOUND,
        2,
        "-p tcp -s 127.0.0.6/32 -i lo -j RETURN",
    );
    b.insert_to(
        Family::V6,
        "mangle",
        INBOUND,
        2,
        "-p tcp -s ::6/128 -i lo -j RETURN",
    );
    b.insert(
        "mangle",
        INBOUND,
        3,
        &format!("-p tcp -i lo -m mark ! --mark {OUTBOUND_MARK} -j RETURN"),
    );
}
